"""Rank side of the several-hosts tests: say where each rank runs, move bytes between hosts.

    mpiexec ... -n 2 python -m tests.harness.rank_hosts probe 8388608
    mpiexec ... -n 8 python -m tests.harness.rank_hosts where train --dp 2 --tp 2 --pp 2 --check
    mpiexec ... -n 8 python -m tests.harness.rank_hosts where fault kill:6:2 train --dp 2 ...
    mpiexec ... -n 8 python -m tests.harness.rank_hosts where lessons/06_hybrid.py

Both first print, from rank 0, one line naming every rank's host in rank order
(`hosts: a a a a b b b b`), from `MPI_Get_processor_name` (the host's hostname).
`probe N` then sends N bytes from rank 0 to the last rank and checks that they
arrived intact (`probe: N bytes 0 -> 1 intact`). `where ARGS...` runs
`python -m minipar ARGS...` through its real entry point, and `where fault SPEC ARGS...`
the same with one rank failing as `tests/harness/rank_faults.py` says, and `where SCRIPT.py ARGS...`
runs a lesson script.
"""

from __future__ import annotations

import runpy
import sys

import numpy as np
from mpi4py import MPI

from minipar.__main__ import run
from tests.harness.rank_faults import inject

comm = MPI.COMM_WORLD


def say_hosts() -> None:
    """Rank 0 prints every rank's host, in rank order."""
    hosts = comm.gather(MPI.Get_processor_name(), root=0)
    if comm.Get_rank() == 0:
        print("hosts:", " ".join(hosts), flush=True)


def probe(nbytes: int) -> None:
    """Rank 0 sends `nbytes` to the last rank, which checks every byte."""
    last = comm.Get_size() - 1
    pattern = (np.arange(nbytes) % 251).astype(np.uint8)   # not all equal: a torn copy shows
    if comm.Get_rank() == 0:
        comm.Send(pattern, dest=last, tag=7)               # N bytes -> the last rank
    elif comm.Get_rank() == last:
        got = np.empty_like(pattern)
        comm.Recv(got, source=0, tag=7)
        state = "intact" if np.array_equal(got, pattern) else "CORRUPTED"
        print(f"probe: {nbytes} bytes 0 -> {last} {state}", flush=True)
    comm.Barrier()


if __name__ == "__main__":
    say_hosts()
    if sys.argv[1] == "probe":
        probe(int(sys.argv[2]))
    else:
        args = sys.argv[2:]
        if args[0] == "fault":
            inject(args[1])
            args = args[2:]
        if args[0].endswith(".py"):                         # a lesson script
            sys.argv = args
            runpy.run_path(args[0], run_name="__main__")
        else:
            sys.argv = ["minipar", *args]
            run()
