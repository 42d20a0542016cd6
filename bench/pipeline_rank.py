"""Rank side of the pipeline benchmark: the bubble on a real timeline vs the formula.

    mpiexec -n 2 python -m bench.pipeline_rank OUT.json

Two stages on two cores (one rank per core, so idle time is the schedule's, not
the machine's); blocks wide enough that compute outweighs the messages. For each
microbatch count, the last step's recorded timeline gives the measured bubble:
1 - busy / (stages * span), busy = the F and B instructions.
"""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from minipar.config import TrainConfig
from minipar.parallel.pipeline_schedules import bubble_formula, bubble_fraction
from minipar.train import train

COMPUTE = ("F", "B", "W")


def main() -> None:
    world = MPI.COMM_WORLD
    pp = world.Get_size()
    results = {}
    for schedule in ("gpipe", "1f1b"):
        for microbatches in (1, 2, 4, 8):
            cfg = TrainConfig(layers=4, d_in=64, d_model=256, d_ff=1024, batch=256,
                              microbatches=microbatches, steps=3, pp=pp,
                              schedule=schedule).resolved(pp)
            timeline = train(cfg, world).extras.get("timeline")
            if world.Get_rank() == 0:
                busy = [(r["stage"], r["start"], r["end"]) for r in timeline
                        if r["kind"] in COMPUTE]
                results[f"{schedule} M={microbatches}"] = {
                    "measured": bubble_fraction(busy, pp),
                    "formula": bubble_formula(schedule, pp, microbatches)}
    if world.Get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
