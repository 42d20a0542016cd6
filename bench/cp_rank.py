"""Rank side of context parallelism's benchmark: the cp-rank step vs one rank alone.

    mpiexec -n 2 python -m bench.cp_rank REPEATS OUT.json

One job, every rank timing, interleaved repetition by repetition (the order rotating):

    one         cp = 1 on its own (MPI.COMM_SELF): the whole sequence of every row
    allgather   cp = 2, each rank T/2 positions; K and V gathered before attention
    ring        cp = 2, contiguous halves; K, V blocks passed around the ring
    zigzag      cp = 2, chunks r and 2cp-1-r: the ring's causal work balanced
    ulysses     cp = 2, Alltoall from positions to heads and back

The same global batch, the same model (`--model gpt`, float64). Both ranks run `one`
at the same time, so both variants share the two cores and the memory bus alike. Rank 0
writes the slowest rank's step per repetition for each variant.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

from mpi4py import MPI

from bench.dp_limit_rank import build
from bench.timing import spread
from minipar.run.mesh_step import train_step
from minipar.settings.config import TrainConfig

SHAPE = dict(model="gpt", layers=2, d_model=128, d_ff=512, heads=4, seq_len=128, vocab=64,
             batch=8)
MODES = ("allgather", "ring", "zigzag", "ulysses")


def main() -> None:
    world = MPI.COMM_WORLD
    repeats, out = int(sys.argv[1]), sys.argv[2]
    cp = world.Get_size()
    base = TrainConfig(**SHAPE, dtype="float64", lr=0.01)
    setups = {"one": build(base.resolved(1), MPI.COMM_SELF)}
    for mode in MODES:
        setups[mode] = build(replace(base, cp=cp, cp_mode=mode).resolved(cp), world)
    names = list(setups)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats + 2):  # the first two: warm-up, not kept
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            cfg, mesh, chunks, updater = setups[name]
            world.Barrier()  # every rank starts each timed step together
            start = time.perf_counter()
            train_step(cfg, mesh, chunks, updater, rep, [])
            if rep >= 2:
                samples[name].append(time.perf_counter() - start)
    everyone = world.gather(samples)
    if world.Get_rank() == 0:
        results = {}
        for name in names:
            slowest = [max(r[name][i] for r in everyone) for i in range(repeats)]
            results[name] = {"steps": slowest, "step": spread(slowest)}
        results["ranks"] = cp
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
