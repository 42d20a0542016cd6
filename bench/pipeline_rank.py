"""Rank side of the pipeline benchmark: the bubble on a real timeline vs the formula.

    mpiexec -n 2 python -m bench.pipeline_rank OUT.json

Two stages on two cores (one rank per core, so idle time is the schedule's, not
the machine's); blocks wide enough that compute outweighs the messages. For each
microbatch count, the last step's recorded timeline gives the measured bubble:
1 - busy / (stages * span), busy = the F and B instructions; and the executor's
own cost, outside the compute: per instruction, the time between one instruction's
end and the next one's start (the loop, the timeline record) plus the time inside the
sends (Isend returns at once), and the time the stages wait inside their Recvs.
"""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from minipar.config import TrainConfig
from minipar.parallel.pipeline_schedules import bubble_formula, bubble_fraction
from minipar.train import train

COMPUTE = ("F", "B", "W")


def overhead(timeline: list[dict]) -> dict[str, float]:
    """Seconds per instruction outside compute, over every stage of the timeline."""
    gaps = sends = recvs = 0.0
    count = 0
    for stage in sorted({r["stage"] for r in timeline}):
        mine = sorted((r for r in timeline if r["stage"] == stage), key=lambda r: r["start"])
        gaps += sum(b["start"] - a["end"] for a, b in zip(mine, mine[1:]))
        sends += sum(r["end"] - r["start"] for r in mine if r["kind"].startswith("send"))
        recvs += sum(r["end"] - r["start"] for r in mine if r["kind"].startswith("recv"))
        count += len(mine)
    return {"instructions": count, "between_per_instruction": gaps / count,
            "send_per_instruction": sends / count, "recv_wait_per_instruction": recvs / count}


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
                    "formula": bubble_formula(schedule, pp, microbatches),
                    **overhead(timeline)}
    if world.Get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
