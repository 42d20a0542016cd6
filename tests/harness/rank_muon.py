"""Rank side of tests/parallel/test_muon.py: several `--optimizer muon` configs in one job.

    mpiexec -n 4 python -m tests.harness.rank_muon configs.json OUTDIR

Rank 0 writes each run's dump to OUTDIR/<i>/ and `replicas.json`: every copy of a
replicated parameter that is not bitwise equal to the first one holding it (train.py,
`gather_full_params`; empty when every replica agrees), and `memory.json`: every rank's
measured bytes of parameters, gradients and optimizer state. A config may `save` a
checkpoint that a later config of the same job `resume`s on another mesh.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpi4py import MPI

from minipar.comm.job import abort_on_exception, wait_for_rank0
from minipar.run.results import dump
from minipar.run.train import problems, train
from minipar.settings.config import TrainConfig


def main() -> None:
    world = MPI.COMM_WORLD
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for i, fields in enumerate(configs):
        cfg = TrainConfig(**fields).resolved(world.Get_size())
        errors = problems(cfg, world.Get_size())
        if errors:
            raise SystemExit(f"config {i} {fields}: {errors[0]}")
        result = train(cfg, world)
        memory = world.gather(vars(result.extras["memory"]))
        if world.Get_rank() == 0:
            (out / str(i)).mkdir(parents=True, exist_ok=True)
            (out / str(i) / "memory.json").write_text(json.dumps(memory))
            dump(out / str(i), cfg, result)
            (out / str(i) / "replicas.json").write_text(
                json.dumps(result.extras["replica_disagreements"]))
        wait_for_rank0(world)


if __name__ == "__main__":
    abort_on_exception(main)
