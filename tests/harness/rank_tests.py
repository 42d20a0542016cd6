"""Run named check functions on every rank of one MPI job; one verdict file per rank.

Rank side (what the tests launch, and what you run by hand to reproduce a failure):

    mpiexec -n 4 python -m tests.harness.rank_tests OUTDIR
    tests.comm.test_ring:check_ring_allreduce ...

Each rank runs the checks in order, each on a fresh duplicate of COMM_WORLD, and
writes `OUTDIR/rank3.txt`: `START name`, then `PASS name seconds` or `FAIL name`
with the traceback. An exception on one rank aborts the whole job at once
(`MPI_Abort`: the others would otherwise wait forever in a collective its rank
will never join). A rank still inside one check after `--stuck-after` seconds
dumps every thread's stack into its file (`faulthandler`) and exits, which ends
the job too: a deadlock fails in seconds and shows where each rank sits.

Pytest side (never imports `mpi4py.MPI`): `run_checks(n, names)` launches the
job through `tests.harness.mpi.launch` and reads the files back into a `RankReport`;
`suite_report(n)` does it once per rank count for every check in `SUITE`, so the
whole MPI unit suite costs one mpiexec start-up per rank count.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import importlib
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from tests.harness.mpi import Job, launch, mpiexec

# Every rank-side check of the MPI unit tests; each runs on 1, 2, 3, 4 and 8 ranks.
SUITE = [
    "tests.comm.test_mesh:check_mesh_communicators",
    "tests.comm.test_comm:check_ledger_records",
    "tests.comm.test_comm:check_conjugate_pairs",
    "tests.comm.test_ring:check_ring_allreduce",
    "tests.comm.test_ring:check_ring_reduce_scatter",
    "tests.comm.test_ring:check_ring_allgather",
    "tests.comm.test_ring:check_pairwise_alltoall",
    "tests.comm.test_ring:check_pairwise_alltoallv",
    "tests.parallel.test_context_parallel:check_context_parallel_attention",
]
RANK_COUNTS = (1, 2, 3, 4, 8)


# ------------------------------------------------------------------ rank side
def agree(comm: object, problems: list[str]) -> None:
    """Collective verdict: every rank raises if any rank found a problem (failures are
    collective: docs/design.md, "Tests"), with all ranks' problems in the message."""
    everyone = comm.allgather(problems)  # each rank's list -> every rank
    found = [f"rank {rank}: {p}" for rank, mine in enumerate(everyone) for p in mine]
    if found:
        raise AssertionError(f"{len(found)} problem(s):\n" + "\n".join(found[:40]))


def _resolve(name: str) -> object:
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def rank_main(argv: list[str]) -> None:
    from mpi4py import MPI

    from minipar.comm.job import abort_all

    parser = argparse.ArgumentParser(prog="python -m tests.harness.rank_tests")
    parser.add_argument("outdir", type=Path)
    parser.add_argument("names", nargs="+", help="module:function, run in order")
    parser.add_argument("--stuck-after", type=float, default=60.0,
                        help="seconds one check may take before its stack is dumped")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    referee = world.Dup()  # the runner's own communicator: never confused with a check's
    args.outdir.mkdir(parents=True, exist_ok=True)
    path = args.outdir / f"rank{rank}.txt"
    with open(path, "w", buffering=1) as out:
        for name in args.names:
            out.write(f"START {name}\n")
            out.flush()
            faulthandler.dump_traceback_later(args.stuck_after, exit=True, file=out)
            comm = world.Dup()
            started = time.perf_counter()
            try:
                _resolve(name)(comm)
                referee.Barrier()  # every rank finished this check before the next starts
            except BaseException:
                out.write(f"FAIL {name}\n{traceback.format_exc()}")
                out.flush()
                abort_all(f"rank {rank} failed in {name}: see {path}\n")
                os._exit(1)  # MPI_Abort may return before the launcher's kill arrives
            faulthandler.cancel_dump_traceback_later()
            comm.Free()
            out.write(f"PASS {name} {time.perf_counter() - started:.3f}\n")
        out.write("DONE\n")


# ---------------------------------------------------------------- pytest side
@dataclass
class Verdict:
    """What one rank says about one check: pass, fail, stuck, unfinished or not run."""

    status: str
    text: str = ""
    seconds: float = 0.0


def read_rank_file(path: Path) -> dict[str, Verdict]:
    """Parse one rank's file. A check started without a verdict is `stuck` if the
    watchdog dumped its stack there, else `unfinished` (killed when another rank failed)."""
    sections: list[tuple[str, list[str]]] = []
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    for line in lines:
        if line.startswith("START "):
            sections.append((line[len("START "):].strip(), []))
        elif line.strip() != "DONE" and sections:
            sections[-1][1].append(line)
    verdicts = {}
    for name, body in sections:
        first = body[0].split() if body else []
        if first[:2] == ["PASS", name]:
            verdicts[name] = Verdict("pass", seconds=float(first[2]))
        elif first[:2] == ["FAIL", name]:
            verdicts[name] = Verdict("fail", "".join(body[1:]))
        else:
            text = "".join(body)
            stuck = "most recent call first" in text
            verdicts[name] = Verdict("stuck" if stuck else "unfinished",
                                     text or "(no output: killed when the job ended)")
    return verdicts


@dataclass
class RankReport:
    """Every rank's verdicts of one job, and how to rerun one check by hand."""

    n: int
    folder: Path
    job: Job
    verdicts: list[dict[str, Verdict]]
    elapsed: float

    def rerun(self, name: str) -> str:
        return (f"OMP_NUM_THREADS=1 {shlex.quote(mpiexec())} -n {self.n} "
                f"{shlex.quote(sys.executable)} -m tests.harness.rank_tests "
                f"/tmp/minipar-rerun {name}")

    def problem(self, name: str) -> str | None:
        """None if every rank passed `name` (and the job ended cleanly), else the story."""
        states = [v.get(name, Verdict("not run")) for v in self.verdicts]
        if all(s.status == "pass" for s in states):
            # a job that failed anyway is this check's problem only if nothing else failed
            blamed = any(v.status != "pass" for verdicts in self.verdicts
                         for v in verdicts.values())
            if self.job.returncode == 0 or blamed:
                return None
        lines = [f"check {name} on {self.n} ranks did not pass "
                 f"(job: {'timed out' if self.job.timed_out else f'exit {self.job.returncode}'}"
                 f" after {self.elapsed:.1f} s)"]
        for rank, state in enumerate(states):
            if state.status != "pass":
                lines.append(f"--- rank {rank}: {state.status.upper()}")
                lines.append(state.text.rstrip()[-3000:])
        lines.append(f"rerun: {self.rerun(name)}  (verdict files: {self.folder})")
        lines.append(f"--- mpiexec stderr (tail) ---\n{self.job.stderr[-1500:]}")
        return "\n".join(line for line in lines if line)

    def assert_passed(self, name: str) -> None:
        story = self.problem(name)
        assert story is None, story


def run_checks(n: int, names: list[str], folder: Path, timeout: float = 120,
               stuck_after: float = 60) -> RankReport:
    """Launch `names` on n ranks in one job; read back every rank's verdicts."""
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    job = launch(n, ["-m", "tests.harness.rank_tests", str(folder), *names,
                     "--stuck-after", str(stuck_after)], timeout)
    elapsed = time.perf_counter() - started
    verdicts = [read_rank_file(folder / f"rank{rank}.txt") for rank in range(n)]
    return RankReport(n, folder, job, verdicts, elapsed)


@functools.cache
def suite_report(n: int) -> RankReport:
    """Every check of `SUITE` on n ranks, in one job per rank count (cached per session)."""
    folder = Path(tempfile.mkdtemp(prefix=f"minipar-rank-tests-{n}-"))
    report = run_checks(n, SUITE, folder)
    if all(report.problem(name) is None for name in SUITE):
        shutil.rmtree(folder, ignore_errors=True)
    return report


if __name__ == "__main__":
    rank_main(sys.argv[1:])
