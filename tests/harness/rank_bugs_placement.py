"""Rank side of tests/bugs/test_bugs_placement.py, one MPI job on 4 ranks:

1. one step of every bug's demo run with placement checking on; rank 0 writes {bug:
   the line that stopped it, or null} to the JSON file given first;
2. with a second file: every bug's own `try:` line (`python -m minipar bugs`, the
   hangs left out: their watchdog ends the job) run exactly as printed, through the
   command's `main` in this same job; rank 0 writes {bug: {"code": exit code,
   "out": what rank 0 printed}} there.

    mpiexec -n 4 python -m tests.harness.rank_bugs_placement OUT.json [TRY.json]
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
from pathlib import Path

from mpi4py import MPI

from minipar.bugs.catalog import BUGS, MIXED_BUGS, command
from minipar.comm.job import abort_on_exception
from minipar.placement import PlacementError
from minipar.run.train import problems, train
from minipar.settings.config import TrainConfig
from tests.bugs.test_bugs import fields


def try_line_argv(line: str) -> list[str]:
    """The arguments after `python -m minipar` of a `try:` line."""
    words = shlex.split(line)
    return words[words.index("minipar") + 1:]


def run_try_lines(world: MPI.Comm) -> dict[str, dict]:
    """Every bug's `try:` line through `main`, rank 0's stdout and stderr kept."""
    from minipar.__main__ import main

    out = {}
    for name, bug in {**BUGS, **MIXED_BUGS}.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            code = main(try_line_argv(command(bug)))
        world.Barrier()
        out[name] = {"code": code, "out": printed.getvalue(), "line": command(bug)}
    return out


def main() -> None:
    world = MPI.COMM_WORLD
    found: dict[str, str | None] = {}
    for name, bug in BUGS.items():
        cfg = TrainConfig(**fields(bug, inject_bug=name, steps=1, check_placements=True)
                          ).resolved(world.Get_size())
        errors = problems(cfg, world.Get_size())
        if errors:
            raise SystemExit(f"{name}: {errors[0]}")
        try:
            train(cfg, world)
            found[name] = None
        except PlacementError as error:  # raised on every rank at the same op
            found[name] = str(error)
    if world.Get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(found))
    if len(sys.argv) > 2:
        tried = run_try_lines(world)
        if world.Get_rank() == 0:
            Path(sys.argv[2]).write_text(json.dumps(tried))


if __name__ == "__main__":
    abort_on_exception(main)
