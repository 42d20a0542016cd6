"""Rank side of tests/run/test_generate.py: many generate runs (and the trainings that save
their checkpoints) in ONE MPI job, start-up paid once.

    mpiexec -n 4 python -m tests.harness.rank_generate runs.json OUTDIR

`runs.json` is a list of {"train": {TrainConfig fields}} (train and --save: a checkpoint
for later runs) or {"generate": [flags of python -m minipar generate]}. Rank 0 writes
run i's tokens and logits (`result.npz`) and its decode ledger and memory report
(`report.json`) into OUTDIR/<i>/. An exception on any rank aborts the job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.checkpoint.save_load import holding
from minipar.comm.collectives import Ledger
from minipar.comm.job import abort_on_exception
from minipar.comm.mesh import Mesh
from minipar.run.decode import generate_on_mesh
from minipar.run.generate import config_from_args, full_params, make_parser
from minipar.run.train import problems, train
from minipar.settings.config import TrainConfig


def main() -> None:
    world = MPI.COMM_WORLD
    runs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for i, run in enumerate(runs):
        if "train" in run:
            cfg = TrainConfig(**run["train"]).resolved(world.Get_size())
            errors = problems(cfg, world.Get_size())
            if errors:
                raise SystemExit(f"run {i} {run}: {errors[0]}")
            with holding(world, cfg.save):
                train(cfg, world)
            continue
        gcfg, errors = config_from_args(make_parser().parse_args(run["generate"]),
                                        world.Get_size())
        if errors:
            raise SystemExit(f"run {i} {run}: {errors[0]}")
        mesh = Mesh(gcfg.train.mesh_shape(), world, Ledger())
        result = generate_on_mesh(gcfg, mesh, full_params(gcfg.train))
        mesh.free()
        if world.Get_rank() == 0:
            (out / str(i)).mkdir(parents=True, exist_ok=True)
            np.savez(out / str(i) / "result.npz", tokens=result.tokens, logits=result.logits)
            (out / str(i) / "report.json").write_text(json.dumps(
                {"ledger": result.ledger, "memory": result.memory}))


if __name__ == "__main__":
    abort_on_exception(main)
