"""Rank side of the pipeline benchmark: the bubble on a real timeline vs the formula.

    mpiexec -bind-to core -n 2 python -m bench.pipeline_rank RUNS OUT.json

Two stages on two cores, each rank bound to its own core (`bench/run.py` launches it
so: one rank per core, so idle time is the schedule's, not the machine's); blocks wide
enough that compute outweighs the messages. For each microbatch count, RUNS runs of a
few steps each; the last step's recorded timeline of each run gives

    measured   1 - busy / (stages * span), busy = the F and B instructions
    replayed   the same schedule played with each instruction's measured CPU time and
               free, instant messages (schedules.replay): the bubble these
               very compute times make, so measured / replayed is what the executor
               and the messages add, and replayed / formula what unequal stages add
               (the formula assumes every stage's F and B take the same time)

and the executor's own cost outside the compute: per instruction, the time between one
instruction's end and the next one's start (the loop, the timeline record) plus the
time inside the sends (Isend returns at once), and the time the stages wait inside
their Recvs. Rank 0 writes, per setting, the median run's figures and each ratio's
median, min and max over the runs; and, under "message", what one activation's hop
costs by itself (`message_cost`): back to back, and right after a forward's worth of
matmuls, as every hop of a pipeline comes.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from bench.timing import spread
from minipar.parallel.pipeline.schedules import bubble_formula, replay
from minipar.parallel.pipeline.simulator import bubble_fraction
from minipar.run.train import train
from minipar.settings.config import TrainConfig

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


def stage_imbalance(timeline: list[dict], pp: int) -> float:
    """The slowest stage's F + B time over the fastest's (1.0: equal stages)."""
    per_stage = [sum(r["end"] - r["start"] for r in timeline
                     if r["stage"] == s and r["kind"] in COMPUTE) for s in range(pp)]
    return max(per_stage) / min(per_stage)


def one_run(schedule: str, microbatches: int, world: MPI.Comm) -> dict | None:
    """Train a few steps; rank 0 returns the last step's figures."""
    pp = world.Get_size()
    cfg = TrainConfig(layers=4, d_in=64, d_model=256, d_ff=1024, batch=256,
                      microbatches=microbatches, steps=3, pp=pp,
                      schedule=schedule).resolved(pp)
    timeline = train(cfg, world).extras.get("timeline")
    if world.Get_rank() != 0:
        return None
    busy = [(r["stage"], r["start"], r["end"]) for r in timeline if r["kind"] in COMPUTE]
    return {"measured": bubble_fraction(busy, pp),
            "replayed": replay(schedule, pp, microbatches, 1, timeline).bubble,
            "formula": bubble_formula(schedule, pp, microbatches),
            "imbalance": stage_imbalance(timeline, pp), **overhead(timeline)}


def message_cost(world: MPI.Comm, repeats: int = 200) -> dict[str, float] | None:
    """Rank 0 Isends one activation-sized message (32 x 256 float64, 64 KB) to rank 1,
    which waits in its Recv; medians of the Isend call and of the one-way time (send
    start to Recv return, on the wall clock both ranks share), in seconds: with MPI
    called back to back, and with 3 ms of matmuls (8 MB of weights, what one F of this
    benchmark streams) between one message and the next."""
    rng = np.random.default_rng(0)
    weights, rows = rng.random((1024, 1024)), rng.random((64, 1024))
    out: dict[str, float] = {}
    for label in ("back to back", "after compute"):
        isend, one_way = [], []
        for _ in range(repeats):
            world.Barrier()
            if world.Get_rank() == 0:
                message = rng.random(32 * 256)
                if label == "after compute":
                    for _ in range(3):
                        rows @ weights
                sent = time.time()
                start = time.perf_counter()
                request = world.Isend(message, dest=1, tag=7)
                isend.append(time.perf_counter() - start)
                world.send(sent, dest=1, tag=8)
                request.Wait()
            elif world.Get_rank() == 1:
                buffer = np.empty(32 * 256)
                world.Recv(buffer, source=0, tag=7)
                arrived = time.time()
                one_way.append(arrived - world.recv(source=0, tag=8))
        got = world.gather((isend, one_way))
        if world.Get_rank() == 0:
            out[f"isend {label}"] = float(np.median(got[0][0]))
            out[f"one-way {label}"] = float(np.median(got[1][1]))
    return out if world.Get_rank() == 0 else None


def main() -> None:
    world = MPI.COMM_WORLD
    runs, out = int(sys.argv[1]), sys.argv[2]
    results = {}
    for schedule in ("gpipe", "1f1b"):
        for microbatches in (1, 2, 4, 8):
            found = [one_run(schedule, microbatches, world) for _ in range(runs)]
            if world.Get_rank() != 0:
                continue
            ratio = {"measured/formula": [r["measured"] / r["formula"] for r in found],
                     "replayed/formula": [r["replayed"] / r["formula"] for r in found],
                     "measured/replayed": [r["measured"] / r["replayed"] for r in found]}
            middle = found[int(np.argsort(ratio["measured/formula"])[len(found) // 2])]
            results[f"{schedule} M={microbatches}"] = {
                **middle, **{name: spread(v) for name, v in ratio.items()},
                "imbalance_range": spread([r["imbalance"] for r in found])}
    message = message_cost(world)
    if world.Get_rank() == 0:
        results["message"] = message
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
