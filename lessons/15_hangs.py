"""Lesson 15: when it hangs -- every rank's last calls, lined up, name the rank that disagrees.

    mpiexec -n 4 python lessons/15_hangs.py                    # every hang of bugs/hangs.py
    mpiexec -n 4 python lessons/15_hangs.py --quick --plot figures   # one hang; 15_hangs.png

Wrong numbers are caught by the equivalence checks (lesson 8); no numbers at all --
a job that hangs -- is the other half of debugging distributed training. MPI
matches the calls of one communicator by their ORDER: the k-th collective a rank
makes on a group meets the k-th collective of every other member, whatever op,
size or line it came from. So every rank must keep the same order of loops:

    for step in steps:                  # the same number of steps everywhere
        for microbatch in microbatches: # the same M (a pipeline: a schedule that
            forward, backward           #   pairs every Send with a Recv)
        sync gradients                  # the same buckets, in the same order
        report the loss                 # every rank, not only the one that prints

A collective inside `if rank == 0:`, a stage that receives before it sends, a
call handed the wrong group, a buffer shorter than the counts announced: each
leaves some rank waiting for a call that never comes. The watchdog (--timeout)
sees only that this rank waits too long. The flight recorder (minipar/comm/flight.py)
keeps every rank's last 1000 calls -- group, sequence number, op, elements,
dtype, the line of strategy code that made the call, step, microbatch,
started/completed -- and on a hang every rank writes them to `--flight DIR`;
lined up by (group, sequence number) (minipar/comm/flight_report.py) they name the
first disagreement in one sentence, which ends the watchdog's line.

The lesson, on 4 ranks:
1. a healthy job asked for its records while it runs (SIGUSR1 to every rank, as
   `kill -USR1 <mpiexec's pid>` does from a shell): the records agree;
2. each hang of minipar/bugs/hangs.py, run as its own job by rank 0 (a hang ends
   the job it happens in): the watchdog's line, its verdict, checked against what
   the verdict must name, and the aligned records around it
   (`python -m minipar flight DIR --all`);
3. how to look at a live stuck job yourself: `py-spy dump --pid PID` on every rank
   (pip's `py-spy`; run here on one hang when it is installed).

With --plot DIR: 15_hangs.png, each hang's last calls per rank, the ones still
inside a call marked.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpi4py import MPI

from minipar.bugs.hangs import HANGS, Hang
from minipar.comm import flight
from minipar.comm.flight_files import load, run_of
from minipar.comm.flight_report import table, verdict
from minipar.comm.job import run_collectively, say_in_order, wait_for_rank0
from minipar.comm.job import verdict as check
from minipar.run.train import train
from minipar.settings.config import TrainConfig
from minipar.teaching.classroom import mpiexec, rank_environment
from minipar.teaching.lines import print  # the builtin, a line wider than the page wrapped

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
ROOT = Path(__file__).resolve().parent.parent
SMALL = {"layers": 2, "d_model": 16, "d_in": 8, "batch": 16, "steps": 1}
TIMEOUT = 2


def say(*text: object) -> None:
    if rank == 0:
        print(*text, flush=True)


# ----------------------------------------------------------- a healthy job
def healthy(folder: Path) -> None:
    """Train one step on dp 2 x tp 2, then every rank is sent SIGUSR1 by rank 0 and its
    recorder's own thread writes its records (the main thread could be inside MPI)."""
    flight.arm(str(folder), comm)
    flight.reset()
    train(TrainConfig(dp=2, tp=2, microbatches=2, **SMALL).resolved(size), comm)
    if rank == 0:
        for pid in [pid for _, pid in flight.STATE.peers]:
            os.kill(pid, signal.SIGUSR1)   # what `kill -USR1` on mpiexec's pid forwards
    mine = folder / f"rank{rank}.json"
    deadline = time.monotonic() + 10
    while run_of(mine) != flight.STATE.run and time.monotonic() < deadline:
        time.sleep(0.02)
    comm.Barrier()
    flight.disarm()
    lines = [f"pid {os.getpid()}: {len(load(folder)[rank]['calls'])} calls recorded, the "
             f"last: {load(folder)[rank]['calls'][-1]['op']} over "
             f"{load(folder)[rank]['calls'][-1]['axis']}"]
    say("=== 1. a healthy job (dp 2 x tp 2, one step), asked for its records by SIGUSR1:")
    say_in_order(comm, lines[0])
    if rank == 0:
        dumps = load(folder)
        said = verdict(dumps)
        print(f"   verdict: {said}  [{check(said.startswith('the records agree'))}]")
        print("   the tp group's records, side by side (python -m minipar flight DIR --all):")
        rows = table(dumps).splitlines()
        start = next(i for i, line in enumerate(rows) if line.startswith("tp{0,1} calls"))
        print("\n".join("     " + line for line in rows[start:start + 6]), flush=True)


# ------------------------------------------------------------------ hangs
def child_environment() -> dict[str, str]:
    """This job's environment without its launcher's variables: a job started from a
    rank must not think it is part of this one."""
    return {k: v for k, v in rank_environment().items()
            if not k.startswith(("PMI_", "HYD", "MPIR_", "PMIX"))}


def train_line(hang: Hang, folder: Path, timeout: float) -> list[str]:
    """The command that runs `hang` on 4 ranks: the lesson's small model, the hang's own
    flags, the watchdog's timeout and the flight folder."""
    flags = [part for key, value in {**SMALL, **hang.flags}.items()
             for part in (f"--{key.replace('_', '-')}", str(value))]
    return [mpiexec(), "-n", "4", sys.executable, "-m", "minipar", "train", *flags,
            "--inject-bug", hang.name, "--timeout", str(timeout), "--flight", str(folder)]


def as_typed(line: list[str]) -> str:
    """`train_line` as a student types it (`mpiexec`, `python`): pasted, it runs the same job."""
    return shlex.join(["mpiexec", *line[1:3], "python", *line[4:]])


ENDINGS = {"watchdog:": "the watchdog (a wait cut after --timeout)",
           "MPI error:": "an MPI error raised inside the call (MPI saw the mismatch itself)"}


def run_hang(hang: Hang, folder: Path) -> dict:
    """Run one hang as its own 4-rank job (rank 0 only). It ends one of two ways, each with
    one line that ends with the flight verdict: the watchdog cuts a wait, or MPI raises an
    error inside the call (a message longer than its receive); `ending` says which."""
    start = time.monotonic()
    line = train_line(hang, folder, TIMEOUT)
    job = subprocess.run(line, cwd=ROOT, env=child_environment(), capture_output=True,
                         text=True, timeout=120)
    seconds = time.monotonic() - start
    said = next((x for x in job.stderr.splitlines()
                 if x.startswith("minipar: error: ") and "; flight (" in x), "")
    ending = next((how for key, how in ENDINGS.items() if key in said), "")
    return {"command": as_typed(line), "line": said, "ending": ending,
            "verdict": said.split(f"; flight ({folder}): ", 1)[-1] if said else "",
            "seconds": seconds, "code": job.returncode, "dumps": load(folder) if said else {},
            "traceback": "Traceback" in job.stderr}


def show(index: int, hang: Hang, found: dict) -> None:
    named = all(words in found["verdict"] for words in hang.names)
    if index == 1:
        print("\n=== 2. each hang injected into a job of 4 ranks, and what ended it")
    print(f"\n2.{index} {hang.name} [{hang.strategy}]: {hang.broken}")
    print(f"   why it hangs: {hang.why}")
    print(f"   run: {found['command']}")
    print(f"   ended after {found['seconds']:.1f} s (exit {found['code']}) by "
          f"{found['ending'] or '(no line ending in a verdict)'}; its line:")
    print(f"   {found['line'].split('; flight (')[0]}")
    print(f"   verdict: {found['verdict'] or '(none)'}")
    ended = found["ending"] == ENDINGS["watchdog:"] or (
        hang.mpi_may_fail and found["ending"] == ENDINGS["MPI error:"])
    print(f"   ended by the watchdog{' or an MPI error' * hang.mpi_may_fail}, one line, "
          f"no traceback: [{check(ended and not found['traceback'])}]")
    print(f"   names {', '.join(repr(w) for w in hang.names)}: [{check(named)}]")
    print(f"   every rank's dump in the folder: [{check(sorted(found['dumps']) == [0, 1, 2, 3])}]")
    if found["dumps"]:
        rows = table(found["dumps"]).splitlines()[:-1]
        heads = [i for i, r in enumerate(rows) if not r.startswith(" ")]  # a group's title
        near = [i for i, r in enumerate(rows) if " *" in r or "<-- differs" in r][:4]
        shown = sorted({j for i in near for j in (max(h for h in heads if h < i),
                                                  max(h for h in heads if h < i) + 1, i)})
        print("   the records around it, a line per rank (* a rank still inside that call):")
        for j in shown:
            if j in heads:        # a group's title; its next row names the columns
                print("     " + rows[j])
            elif j - 1 not in heads:
                header = rows[max(h for h in heads if h < j) + 1]
                print("\n".join("       " + line for line in by_rank(header, rows[j])))


def by_rank(header: str, row: str) -> list[str]:
    """One row of flight_report.table (a call number, then a column per rank) as one line
    per rank, the columns cut where the header's `rank N` titles start: four ranks' cells
    side by side are wider than the page."""
    starts = [m.start() for m in re.finditer(r"rank \d+", header)]
    names = re.findall(r"rank \d+", header)
    flag = "  <-- differs" if row.endswith("<-- differs") else ""
    body = row.removesuffix(flag)
    cells = [body[a:b].strip() or "-" for a, b in zip(starts, [*starts[1:], len(body) + 1])]
    seq = body[:starts[0]].strip()
    return [f"call {seq:<4} {name}: {cell}" + (flag if i == 0 else "")
            for i, (name, cell) in enumerate(zip(names, cells))]


def py_spy_demo(folder: Path) -> None:
    """Rank 0: start a hang with a long timeout, `py-spy dump` one stuck rank, end it."""
    hang = HANGS["hang-pp-both-recv"]
    print("\n=== 3. a live stuck job, seen from outside: `py-spy dump --pid PID` on every rank "
          "(`pgrep -f 'minipar train'` lists the pids; `kill -USR1 <mpiexec's pid>` makes "
          "every rank write its flight records and go on waiting)")
    if shutil.which("py-spy") is None:
        print("   (py-spy is not installed here: pip install py-spy, then run the line above "
              "on each rank of a job started with --timeout 0)")
        return
    proc = subprocess.Popen(train_line(hang, folder, 60), cwd=ROOT, env=child_environment(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        time.sleep(8)   # the ranks start and get stuck
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and str(folder) in
                Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                and "python" in Path(f"/proc/{p}/cmdline").read_bytes().decode(
                    errors="replace").split("\0")[0]]
        for pid in sorted(pids)[:1]:
            out = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True,
                                 text=True, timeout=30).stdout
            print("\n".join("     " + x for x in out.splitlines()[:12]))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def plot(path: Path, runs: dict[str, dict]) -> None:
    """Each hang's last calls per rank (minipar/teaching/flight_plots.py)."""
    from minipar.teaching import plots
    from minipar.teaching.flight_plots import flight_figure

    figure = flight_figure({name: (found["dumps"], found["verdict"])
                            for name, found in runs.items() if found["dumps"]},
                           "lesson 15: each rank's last calls when the job was stopped "
                           "(by the watchdog, or by an MPI error)")
    say(f"\nwrote {plots.save(figure, path)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hang", choices=list(HANGS), action="append",
                        help="only this hang (repeatable); default: all")
    parser.add_argument("--quick", action="store_true", help="one hang only")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write 15_hangs.png")
    args = parser.parse_args()
    if size != 4:
        say("lesson 15 runs on 4 ranks (mpiexec -n 4): each hang needs 4")
        raise SystemExit(2)
    names = args.hang or (["hang-pp-both-recv"] if args.quick else list(HANGS))
    work = Path(comm.bcast(tempfile.mkdtemp(prefix="minipar-15-") if rank == 0 else None))
    say("lesson 15: when it hangs. MPI pairs the calls of a communicator by their order, "
        "so every rank keeps the same order of loops:\n" + __doc__.split("\n\n")[3] + "\n")
    healthy(work / "healthy")
    runs: dict[str, dict] = {}
    if rank == 0:
        for index, name in enumerate(names, start=1):
            runs[name] = run_hang(HANGS[name], work / name)
            show(index, HANGS[name], runs[name])
        py_spy_demo(work / "live")
        if args.plot:
            plot(args.plot / "15_hangs.png", runs)
        shutil.rmtree(work, ignore_errors=True)
    wait_for_rank0(comm)   # the others asleep while rank 0 runs the hangs


if __name__ == "__main__":
    run_collectively(main)
