"""Rank side of `tests.mpi.sweep`: train several configs in one MPI job.

    mpiexec -n 8 python -m tests.rank_sweep configs.json OUTDIR

Rank 0 writes each run's dump to OUTDIR/<i>/, plus `memory.json`: every rank's
measured bytes of parameters, gradients and optimizer state (a list by world
rank; `RunResult.extras["memory"]`), and `scores.json`: every rank's attention
score entries per block in the last forward (`extras["attention_scores"]`).
An exception on any rank aborts the job (as `python -m mpi4py` does) with that
rank's traceback.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from mpi4py import MPI

from minipar.__main__ import dump
from minipar.config import TrainConfig, problems
from minipar.train import train


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
        # every rank's measured model-state bytes -> rank 0, for memory.json
        memory = world.gather(vars(result.extras["memory"]))
        # every rank's attention score entries per block (context parallelism's work)
        scores = world.gather(result.extras["attention_scores"])
        if world.Get_rank() == 0:
            dump(out / str(i), cfg, result)
            (out / str(i) / "memory.json").write_text(json.dumps(memory))
            (out / str(i) / "scores.json").write_text(json.dumps(scores))


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        from minipar.log import abort_all

        abort_all(f"rank {MPI.COMM_WORLD.Get_rank()} failed:\n{traceback.format_exc()}")
