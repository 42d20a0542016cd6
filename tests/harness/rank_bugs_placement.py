"""Rank side of tests/bugs/test_bugs_placement.py: one step of every bug's demo run with
placement checking on, in one MPI job; rank 0 writes {bug: the line that stopped it,
or null} to the JSON file given.

    mpiexec -n 4 python -m tests.harness.rank_bugs_placement OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpi4py import MPI

from minipar.bugs.catalog import BUGS
from minipar.comm.job import abort_on_exception
from minipar.placement import PlacementError
from minipar.run.train import problems, train
from minipar.settings.config import TrainConfig
from tests.bugs.test_bugs import fields


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


if __name__ == "__main__":
    abort_on_exception(main)
