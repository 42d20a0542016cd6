"""Run several `python -m minipar` command lines on every rank of one MPI job, each rank
its own line (an MPMD launch in one job), recording how each ended.

    mpiexec -n 2 python -m tests.harness.rank_commands OUTDIR CASES.json

CASES.json is a list of cases, each a list of one argv per rank
(`[["train", "--dp", "2"], ["train", "--dp", "2", "--layers", "0"]]`). Each case runs
in-process through `minipar.__main__.main`; each rank writes OUTDIR/rank{r}.json, a list
of {"code", "stderr", "stdout"}. Only cases that refuse belong here: one that runs would
train on.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from mpi4py import MPI

from minipar.__main__ import main as minipar


def main() -> None:
    out, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    rank = MPI.COMM_WORLD.Get_rank()
    records = []
    for case in cases:
        err, std = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
            try:
                code = minipar(case[rank])
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
        records.append({"code": code, "stderr": err.getvalue(), "stdout": std.getvalue()})
        MPI.COMM_WORLD.Barrier()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
