"""Rank side of the flight recorder's cost: a step with it against a step without.

    mpiexec -n 2 python -m bench.flight_rank REPEATS OUT.json

A call-heavy step on purpose (tensor parallelism, 8 blocks, 4 microbatches: one
Allreduce per block forward and one backward, per microbatch, over a small batch):
the recorder's share of a step is largest where the calls are many and the work
between them small. Per repetition, a few steps with `flight.record` as it is and a
few with it replaced by a function that does nothing, alternating which goes first;
and, apart, the cost of one `record` call timed in a loop times the calls a step
makes. Rank 0 writes: the two step times (median, range), their ratio, calls per
step, microseconds per call, and that cost as a share of the step.
"""

from __future__ import annotations

import json
import sys
import time

from mpi4py import MPI

from bench.timing import spread
from minipar.comm import flight
from minipar.run.train import train
from minipar.settings.config import TrainConfig

FIELDS = {"tp": 2, "layers": 8, "d_model": 64, "d_in": 32, "batch": 32, "microbatches": 4,
          "steps": 3}


def steps_of(cfg: TrainConfig, world: MPI.Comm) -> list[float]:
    """Seconds of each step after the first (between the on_step callbacks)."""
    stamps: list[float] = []
    world.Barrier()
    start = time.perf_counter()
    train(cfg, world, on_step=lambda step, loss: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip([start, *stamps][1:], stamps[1:])]


def main() -> None:
    world = MPI.COMM_WORLD
    repeats, out = int(sys.argv[1]), sys.argv[2]
    cfg = TrainConfig(**FIELDS).resolved(world.Get_size())
    recording = flight.record
    samples: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(repeats + 1):
        for name in (["on", "off"] if rep % 2 else ["off", "on"]):
            flight.record = recording if name == "on" else (lambda *args: None)
            times = steps_of(cfg, world)
            if rep:  # the first round warms up
                samples[name] += times
    flight.record = recording
    flight.reset()
    steps_of(cfg, world)   # the calls of the last step, counted from the ring
    last = [r for r in flight.records() if r["step"] == cfg.steps]
    group = type("G", (), {})()   # what record reads of a comm.Group (no MPI call)
    group.comm, group.name, group._flight_key = None, "tp", "tp{0,1}"
    group.ledger = type("L", (), {"enabled": True})()
    loops = 20000
    begin = time.perf_counter()
    for _ in range(loops):
        recording(group, "Allreduce", 2048, 8, ())
    per_call = (time.perf_counter() - begin) / loops
    flight.reset()
    if world.Get_rank() == 0:
        on, off = spread(samples["on"]), spread(samples["off"])
        json.dump({"on": on, "off": off, "on/off": on["median"] / off["median"],
                   "calls_per_step": len(last), "seconds_per_call": per_call,
                   "share_of_step": len(last) * per_call / off["median"]}, open(out, "w"))


if __name__ == "__main__":
    main()
