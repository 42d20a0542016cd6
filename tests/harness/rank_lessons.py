"""Run several lessons' `main` on every rank of one MPI job, recording how each ended.

    mpiexec -n 3 python -m tests.harness.rank_lessons OUTDIR "10_transformer.py --quick" ...

Each lesson runs in-process as `run_collectively` would run it (its ConfigError one
line from rank 0, exit 2: `log.refuse_together`); each rank writes OUTDIR/rank{r}.json,
a list of {"lesson", "code", "stderr", "stdout"}. A lesson that does not refuse would
train on: only lessons expected to refuse belong here.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import shlex
import sys
from pathlib import Path

from mpi4py import MPI

from minipar.comm.job import refuse_together

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    records = []
    for case in cases:
        script, *flags = shlex.split(case)
        lesson = runpy.run_path(str(ROOT / "lessons" / script), run_name="lesson")
        sys.argv = [script, *flags]
        err, std = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
            try:
                refuse_together(lesson["main"])()
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
        records.append({"lesson": case, "code": code, "stderr": err.getvalue(),
                        "stdout": std.getvalue()})
        MPI.COMM_WORLD.Barrier()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{MPI.COMM_WORLD.Get_rank()}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
