"""Rank side of the data-parallel benchmark: step time of `train` at a fixed global batch.

    mpiexec -n N python -m bench.dp_rank STEPS OUT.json

Every rank trains the same model on its B/N rows; rank 0 writes the median step time.
"""

from __future__ import annotations

import json
import sys
import time

from mpi4py import MPI

from minipar.run.train import train
from minipar.settings.config import TrainConfig

SHAPE = dict(layers=1, d_in=784, d_model=1024, d_ff=1024, classes=10, batch=256)


def main() -> None:
    world = MPI.COMM_WORLD
    steps, out = int(sys.argv[1]), sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float64"
    cfg = TrainConfig(**SHAPE, steps=steps, dtype=dtype, lr=0.01).resolved(world.Get_size())
    stamps: list[float] = []
    world.Barrier()
    train(cfg, world, on_step=lambda step, loss: stamps.append(time.perf_counter()))
    if world.Get_rank() == 0:
        durations = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))
        with open(out, "w") as f:
            json.dump({"ranks": world.Get_size(), "median": durations[len(durations) // 2],
                       "min": durations[0], "max": durations[-1]}, f)


if __name__ == "__main__":
    main()
