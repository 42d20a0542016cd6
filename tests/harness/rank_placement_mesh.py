"""Rank side of tests/placement/test_placement_mesh.py: the transformer's placement bugs on a mesh.

Each case trains one step of a small transformer on 2 ranks with placement checking on,
with one piece swapped for a broken one (lesson 8's bugs of the transformer,
minipar/bugs/catalog.py,
and the vocabulary-parallel embedding without its Allreduce), and rank 0 writes
{case: {"stopped": the line that stopped it, or null, "loss": the step loss or null}}
to the JSON file given. "correct-*" cases run the same meshes unbroken.

    mpiexec -n 2 python -m tests.harness.rank_placement_mesh OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpi4py import MPI

from minipar.comm.job import abort_on_exception
from minipar.parallel import vocab_parallel
from minipar.placement import PlacementError
from minipar.run.train import problems, train
from minipar.settings.config import TrainConfig
from tests import shapes

GPT = dict(shapes.GPT, batch=4, steps=1, check_placements=True)


def embedding_without_allreduce(x: object, group: object) -> object:
    """The vocabulary-parallel embedding's Allreduce dropped: BUG: each rank keeps the
    rows of its own ids only."""
    return x


CASES = {  # name: (flags, [(module, attribute, replacement)])
    "correct-tp": (dict(tp=2), []),
    "tp-copy-to-no-allreduce": (dict(tp=2, inject_bug="tp-copy-to-no-allreduce"), []),
    "vocab-embedding-no-allreduce": (dict(tp=2), [
        (vocab_parallel, "reduce_from", embedding_without_allreduce)]),
    "vocab-loss-no-max": (dict(tp=2, sp=True, inject_bug="tp-vocab-loss-no-max"), []),
    "correct-cp-allgather": (dict(cp=2, cp_mode="allgather"), []),
    "cp-no-allgather": (dict(cp=2, cp_mode="allgather", inject_bug="cp-no-allgather"), []),
    "correct-cp-ring": (dict(cp=2, cp_mode="ring"), []),
    "ring-no-lse-merge": (dict(cp=2, cp_mode="ring", inject_bug="cp-ring-no-lse-merge"), []),
    "zigzag-no-lse-merge": (dict(cp=2, cp_mode="zigzag", inject_bug="cp-ring-no-lse-merge"),
                            []),
}


def main() -> None:
    world = MPI.COMM_WORLD
    found: dict[str, dict] = {}
    for name, (flags, swaps) in CASES.items():
        cfg = TrainConfig(**{**GPT, **flags}).resolved(world.Get_size())
        errors = problems(cfg, world.Get_size())
        if errors:
            raise SystemExit(f"{name}: {errors[0]}")
        originals = [(module, attribute, getattr(module, attribute))
                     for module, attribute, _ in swaps]
        for module, attribute, replacement in swaps:
            setattr(module, attribute, replacement)
        try:
            found[name] = {"stopped": None, "loss": train(cfg, world).losses[-1]}
        except PlacementError as error:  # raised on every rank at the same op
            found[name] = {"stopped": str(error), "loss": None}
        finally:
            for module, attribute, original in originals:
                setattr(module, attribute, original)
    if world.Get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(found))


if __name__ == "__main__":
    abort_on_exception(main)
