"""Several hosts: the README's recipe run across simulated hosts, over TCP, not memory.

Two hosts (a, b) and a head node are network namespaces on one bridge
(`tests/harness/netns.py`); `mpiexec` runs on the head node and reaches the hosts through
`tests/harness/netns_ssh`, the ssh stand-in. Each job prints where its ranks ran, and the
bytes each host's card moved are read from the kernel's counters around it:

- 8 MiB sent from a rank on a to a rank on b cross both cards, and MPI says which
  transport carried them (UCX: `tcp/eth0` for `inter-node`; libfabric: `tcp`);
- `train --dp 2 --tp 2 --pp 2 --check` on both layouts of the README, 4 ranks per
  host: `-hosts a:4,b:4` (consecutive ranks: only pipeline traffic crosses) and
  `-hosts a,b` (round-robin: the tensor-parallel pairs straddle the hosts), the
  second resuming the checkpoint the first saved, traced (`--trace`: every rank on one
  time line, the far host's clock offset measured by ping-pong);
- lesson 6 across the hosts;
- a rank SIGKILLed on host b ends the whole job within seconds, nothing left running.

Skipped, with the reason, where namespaces cannot be made (not root, no `ip`).

    make hosts-test            # or: sudo .venv/bin/python -m pytest -q tests/comm/test_hosts.py
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.mpi import ROOT, Job, mpiexec, read_dump
from tests.harness.netns import (
    SimulatedHosts,
    kill_everything_in,
    our_links,
    our_namespaces,
    pids_in,
    remove_leftovers,
    why_not,
)
from tests.harness.trace_checks import check_trace

REASON = why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

MIB = 1 << 20
MESH = ["--dp", "2", "--tp", "2", "--pp", "2"]
CONSECUTIVE, ROUND_ROBIN = [4, 4], None      # -hosts a:4,b:4 and -hosts a,b
# What chooses the network, per MPICH netmod (the PyPI wheel holds both; UCX by default).
UCX = {"UCX_NET_DEVICES": "eth0"}
OFI = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}


@dataclass
class HostJob:
    """A finished job across the hosts: the job, the bytes each host's card moved, its
    seconds, and the processes still alive in the namespaces once mpiexec returned."""

    job: Job
    wire: list[int]
    seconds: float
    left_running: list[int]

    def hosts(self) -> list[str]:
        """Each rank's host, in rank order, from the job's `hosts:` line."""
        found = re.search(r"^hosts: (.*)$", self.job.stdout, flags=re.M)
        assert found, self.job.explain()
        return found.group(1).split()


def run_on(cluster: SimulatedHosts, n: int, args: list[str], slots: list[int] | None,
           network: dict[str, str] = UCX, timeout: float = 90) -> HostJob:
    """`mpiexec -hosts ... -n n python -m tests.harness.rank_hosts ARGS` from the head node,
    killed (with everything on the hosts) if it outlives `timeout` seconds."""
    cmd = [*cluster.mpiexec(mpiexec(), slots), "-n", str(n), sys.executable,
           "-m", "tests.harness.rank_hosts", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", MPIEXEC_TIMEOUT=str(int(timeout)), PYTHONPATH=str(ROOT),
               PYTHONFAULTHANDLER="1", **cluster.environment())
    env.pop("UCX_NET_DEVICES", None)           # the single-host `lo` must not leak in:
    env.update(network)                        # only what this network says
    before, start = cluster.bytes_on_the_wire(), time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout + 5)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - start
    deadline = time.monotonic() + 2            # a rank's exit may trail mpiexec's a little
    while (left := cluster.processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_everything_in(cluster.tag)            # a stray rank fails this test, not the next
    wire = [b - a for a, b in zip(before, cluster.bytes_on_the_wire())]
    command = " ".join(shlex.quote(f"{k}={v}") for k, v in
                       {**cluster.environment(), **network}.items()) + " " + shlex.join(cmd)
    return HostJob(Job(proc.returncode, out, err, command, timed_out), wire, seconds, left)


def succeeded(run: HostJob) -> None:
    assert run.job.returncode == 0 and not run.job.timed_out, run.job.explain()
    assert run.left_running == [], f"left running: {run.left_running}\n{run.job.explain()}"


def transports(ucx_proto_info: str) -> dict[str, set[str]]:
    """The transports UCX chose (`UCX_PROTO_INFO=y`), per kind of peer: "self",
    "intra-node", "inter-node" -> {"tcp/eth0", "sysv/memory", ...}."""
    chosen: dict[str, set[str]] = {}
    kind = None
    for line in ucx_proto_info.splitlines():
        header = re.search(r"\| ucp_context_\d+ (.+?) cfg#\d+ \|", line)
        if header:
            kind = header.group(1)
        elif kind and (row := re.search(r"\|\s*(\S+/\S+)\s*\|\s*$", line)):
            chosen.setdefault(kind, set()).add(row.group(1))
    return chosen


@pytest.fixture(scope="module")
def cluster():
    with SimulatedHosts(2) as hosts:
        yield hosts
    assert our_namespaces(hosts.tag) == [] and our_links(hosts.tag) == []


def test_ranks_on_two_hosts_talk_tcp_through_their_cards(cluster):
    run = run_on(cluster, 2, ["probe", str(8 * MIB)], ROUND_ROBIN,
                 network={**UCX, "UCX_PROTO_INFO": "y"})
    succeeded(run)
    assert run.hosts() == ["a", "b"]
    assert "probe: 8388608 bytes 0 -> 1 intact" in run.job.stdout, run.job.explain()
    # every byte left a's card and entered b's (plus start-up and TCP's own few percent)
    assert all(8 * MIB <= wire < 9 * MIB for wire in run.wire), run.wire
    chosen = transports(run.job.stdout + run.job.stderr)
    assert chosen.get("inter-node") == {"tcp/eth0"}, chosen     # not sysv, posix or cma


def test_libfabric_tcp_carries_them_too(cluster):
    run = run_on(cluster, 2, ["probe", str(8 * MIB)], ROUND_ROBIN,
                 network={**OFI, "MPIR_CVAR_DEBUG_SUMMARY": "1"})
    succeeded(run)
    assert "probe: 8388608 bytes 0 -> 1 intact" in run.job.stdout, run.job.explain()
    assert all(8 * MIB <= wire < 9 * MIB for wire in run.wire), run.wire
    said = run.job.stdout + run.job.stderr
    assert "libfabric provider: tcp - 198.18.0.0/24" in said, run.job.explain()


def step_bytes(dump: Path, axes: set[str]) -> int:
    """The fewest bytes one training step puts on the wire when only the mesh `axes`
    cross hosts, from its ledger (`--dump`: every rank's calls of the last step): each
    Isend crosses once, and each rank of a 2-rank Allreduce of n bytes must receive n."""
    ledger = json.loads((dump / "ledger.json").read_text())
    return sum(r["bytes"] for r in ledger
               if r["group"] in axes and r["op"] in ("Isend", "Send", "Allreduce"))


LAYOUTS = [(CONSECUTIVE, ["a"] * 4 + ["b"] * 4, "pp"), (ROUND_ROBIN, ["a", "b"] * 4, "tp")]


@pytest.mark.parametrize("slots, hosts, crossing", LAYOUTS, ids=["a:4,b:4", "a,b"])
def test_train_on_a_layout_and_the_axis_that_crosses_the_hosts(cluster, tmp_path, slots,
                                                                hosts, crossing):
    """rank = tp_rank + 2 (dp_rank + 2 pp_rank). a:4,b:4 puts stage 0 on a and stage 1 on
    b: only the pipeline's Isends cross, every tp pair shares a host (Megatron-LM's
    layout). a,b deals ranks out in turn: every tp pair straddles the hosts, and the dp
    and pp partners (rank + 2, rank + 4) share one. Run 1 step, then 3: the difference
    is two steps' traffic (start-up and the final gathers cancel), against the ledger."""
    wire = {}
    for steps in (1, 3):
        run = run_on(cluster, 8, ["where", "train", *MESH, "--steps", str(steps), "--check",
                                  "--dump", str(tmp_path / str(steps))], slots)
        succeeded(run)
        assert run.hosts() == hosts
        assert re.search(r"^check against one process: .* -> OK", run.job.stdout, re.M)
        wire[steps] = run.wire
    two_steps = [b - a for a, b in zip(wire[1], wire[3])]
    predicted = 2 * step_bytes(tmp_path / "3", {crossing})
    other = 2 * step_bytes(tmp_path / "3", {"tp", "pp"} - {crossing})
    assert predicted > 0 and other > 0
    # each card carries all of it, plus TCP's and UCX's headers; the two jobs' own
    # start-up and acknowledgements differ by a few KB, so the difference is not exact
    for card in two_steps:
        assert abs(card - predicted) <= 0.15 * predicted + 32 * 1024, (two_steps, predicted)
    assert max(two_steps) < predicted + other, "the other axis crossed too"


def test_a_checkpoint_saved_on_one_layout_resumes_on_the_other(cluster, tmp_path):
    folder = str(tmp_path / "ckpt")
    first = run_on(cluster, 8, ["where", "train", *MESH, "--steps", "2", "--save", folder,
                                "--dump", str(tmp_path / "first")], CONSECUTIVE)
    succeeded(first)
    second = run_on(cluster, 8, ["where", "train", *MESH, "--steps", "4", "--check",
                                 "--resume", folder, "--dump", str(tmp_path / "second"),
                                 "--trace", str(tmp_path / "trace")], ROUND_ROBIN)
    succeeded(second)
    check_trace_across_hosts(tmp_path / "trace", read_dump(tmp_path / "second"))
    assert first.hosts() == ["a"] * 4 + ["b"] * 4 and second.hosts() == ["a", "b"] * 4
    steps = re.findall(r"^step +(\d+)", second.job.stdout, flags=re.M)
    assert steps == ["3", "4"], second.job.explain()            # resumed after step 2
    # the whole 4-step run (two steps on each layout) equals one process ...
    assert re.search(r"^check against one process: .* -> OK", second.job.stdout, re.M)
    assert "done: 4 steps on dp=2 tp=2 pp=2" in second.job.stdout
    # ... and continues the saved run's losses bit for bit
    losses = [read_dump(tmp_path / name)["losses"] for name in ("first", "second")]
    assert losses[1][:2] == losses[0] and len(losses[1]) == 4


def check_trace_across_hosts(folder: Path, dump: dict) -> None:
    """The resumed run's --trace: every rank on one time line. Ranks on rank 0's host read
    its clock (offset 0); the others measured theirs by ping-pong, and these simulated
    hosts share one kernel clock, so what they measured is 0 within half a round trip;
    every message's receive ends after its send began."""
    doc = json.loads((folder / "trace.json").read_text())
    info = doc["otherData"]["minipar"]
    assert info["hosts"] == ["a", "b"] * 4, info["hosts"]
    offsets = info["clock_offsets_us"]
    assert [offsets[r] for r in range(0, 8, 2)] == [0.0] * 4, offsets
    assert all(abs(offsets[r]) < 1000 for r in range(1, 8, 2)), offsets
    labels = [e["args"]["labels"] for e in doc["traceEvents"] if e["name"] == "process_labels"]
    assert sum("host b, clock offset" in label for label in labels) == 4, labels
    check_trace(folder, dump, "two hosts")
    sent = {e["id"]: e["ts"] for e in doc["traceEvents"] if e["ph"] == "s"}
    late = [(e["id"], sent[e["id"]] - e["ts"]) for e in doc["traceEvents"]
            if e["ph"] == "f" and e["ts"] + 1000 < sent[e["id"]]]
    assert not late, f"receives before their sends (id, us): {late[:5]}"


def test_a_lesson_across_hosts(cluster):
    run = run_on(cluster, 8, ["where", "lessons/06_hybrid.py"], CONSECUTIVE, timeout=180)
    succeeded(run)
    assert run.hosts() == ["a"] * 4 + ["b"] * 4
    assert re.search(r"^=== 5\. dp=2 x tp=2 x pp=2 against one process .* -> OK$",
                     run.job.stdout, flags=re.M), run.job.explain()
    assert "MISMATCH" not in run.job.stdout and "DIFFER" not in run.job.stdout


def test_a_rank_killed_on_the_far_host_ends_the_job(cluster):
    run = run_on(cluster, 8, ["where", "fault", "kill:6:2", "train", *MESH, "--steps", "50"],
                 CONSECUTIVE, timeout=60)
    assert run.hosts()[6] == "b"
    assert "rank 6: injected kill at step 2" in run.job.stderr, run.job.explain()
    assert run.job.returncode != 0 and not run.job.timed_out, run.job.explain()
    assert run.seconds < 30, run.job.explain()
    assert "done:" not in run.job.stdout
    assert run.left_running == [], run.left_running   # every rank on a and on b has ended


@pytest.mark.parametrize("how", ["raise", "SIGTERM", "SIGKILL"])
def test_a_failed_or_stopped_run_leaves_nothing_behind(how):
    """A test that raises, or a run stopped by SIGTERM: the hosts remove themselves. A
    run stopped by SIGKILL cannot, and the next run's `remove_leftovers` removes what it
    left (the pid it is named after no longer exists). Each is a process of its own."""
    stop = {"raise": "raise RuntimeError('a failing test')",
            "SIGTERM": "os.kill(os.getpid(), signal.SIGTERM)",
            "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)"}[how]
    child = subprocess.run([sys.executable, "-c", (
        "import os, signal, subprocess, time\nfrom tests.harness.netns import SimulatedHosts\n"
        "with SimulatedHosts(2) as hosts:\n"
        "    subprocess.Popen(['ip', 'netns', 'exec', hosts.netns(0), 'sleep', '600'],\n"
        "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "    while not hosts.processes():   # until it runs on host a\n"
        "        time.sleep(0.01)\n"
        "    print(hosts.tag, flush=True)\n"
        f"    {stop}\n")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert child.returncode != 0 and child.stdout.startswith("mpx"), child.stderr
    tag = child.stdout.strip()
    if how == "SIGKILL":     # left behind: the namespaces, the links, the sleeping process
        assert our_namespaces(tag) and our_links(tag) and pids_in(tag)
        remove_leftovers()
    else:
        message = {"raise": "a failing test", "SIGTERM": "removing the simulated hosts"}
        assert message[how] in child.stderr, child.stderr
    assert our_namespaces(tag) == [] and our_links(tag) == [] and pids_in(tag) == []
