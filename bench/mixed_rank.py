"""Rank side of the mixed-precision benchmark: a bf16 step against a float32 step of the
same model, and the wire bytes of their DP gradient sync, in one job.

    mpiexec -n 2 python -m bench.mixed_rank REPEATS OUT.json

Three runs of the MLP of bench/dp_rank.py's size (dp = 2, SGD), each built and stepped
as `train` does, under its precision policy: float32 without --mixed; `--mixed bf16
--dtype float32` (the gradient Allreduce on the float32 main gradients, the default);
and the same with `--grad-reduce-dtype low` (a 16-bit copy summed by the hand-written
MPI.Op, a Python function MPI calls on every chunk it adds). Each repetition takes one
step of each, the order rotating; rank 0 writes the slowest rank's step per
repetition, the ratio of each bf16 run to the float32 one per repetition (goal <= 1.5:
NumPy has no bfloat16 BLAS, so every 16-bit matmul widens its operands, multiplies in
float32 and rounds the result), the time of the master -> 16-bit casts after the update
alone, the replica check every --mixed step runs (a CRC-32 of every piece and one
allgather) alone, and the bytes the ledger records on the dp axis in one step (goal
0.5 with `low`: the 16-bit gradient Allreduce).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from bench.dp_limit_rank import build
from bench.timing import spread
from minipar.core import precision
from minipar.parallel.mixed import cast_copies
from minipar.run.agreement import replica_check
from minipar.run.mesh_step import train_step
from minipar.settings.config import TrainConfig

SHAPE = dict(layers=2, d_in=256, d_model=512, d_ff=512, classes=10, batch=256,
             optimizer="sgd")
RUNS = {"float32": dict(dtype="float32"),
        "bf16": dict(dtype="float32", mixed="bf16"),
        "bf16 low": dict(dtype="float32", mixed="bf16", grad_reduce_dtype="low")}


def dp_bytes(setup: tuple, world: MPI.Comm) -> int:
    """Bytes rank 0's ledger records on the dp axis in one step (step 0, not timed)."""
    cfg, mesh, chunks, updater = setup
    mesh.ledger.enabled = True
    mesh.ledger.reset()
    with precision.use(cfg.mixed, cfg.dtype):
        train_step(cfg, mesh, chunks, updater, 0, [])
    moved = sum(r["bytes"] for r in mesh.ledger.records(mesh.rank) if r["group"] == "dp")
    mesh.ledger.enabled = False
    return world.bcast(moved)


def main() -> None:
    world = MPI.COMM_WORLD
    repeats, out = int(sys.argv[1]), sys.argv[2]
    n = world.Get_size()
    setups = {}
    for name, extra in RUNS.items():   # built as `train` builds them: under the policy
        cfg = TrainConfig(**SHAPE, **extra, dp=n).resolved(n)
        with precision.use(cfg.mixed, cfg.dtype):
            setups[name] = build(cfg, world)
    wire = {name: dp_bytes(setup, world) for name, setup in setups.items()}
    samples: dict[str, list[float]] = {name: [] for name in RUNS}
    names = list(RUNS)
    for rep in range(repeats + 2):  # the first two: warm-up, not kept
        for name in names[rep % 3:] + names[:rep % 3]:
            cfg, mesh, chunks, updater = setups[name]
            world.Barrier()
            start = time.perf_counter()
            with precision.use(cfg.mixed, cfg.dtype):   # as `train` runs a step (16-bit ops)
                train_step(cfg, mesh, chunks, updater, rep + 1, [])
            if rep >= 2:
                samples[name].append(time.perf_counter() - start)
    updater = setups["bf16"][3]   # the casts after the update, alone
    params = [p.data for p in updater.params]
    casts = []
    for _ in range(repeats):
        start = time.perf_counter()
        cast_copies(updater.masters, params)
        casts.append(time.perf_counter() - start)
    cfg, mesh, chunks, _ = setups["bf16"]   # the replica check of every --mixed step, alone
    checks = []
    for _ in range(repeats):
        start = time.perf_counter()
        replica_check(mesh, chunks, updater, 0)
        checks.append(time.perf_counter() - start)
    everyone = world.gather(samples)
    if world.Get_rank() == 0:
        results: dict = {}
        for name in samples:
            slowest = [max(r[name][i] for r in everyone) for i in range(repeats)]
            results[name] = {"steps": slowest, "step": spread(slowest)}
        for name in ("bf16", "bf16 low"):
            results[f"{name}/float32"] = spread([b / f for b, f in zip(
                results[name]["steps"], results["float32"]["steps"])])
        results["casts"] = spread(casts)
        results["replica check"] = spread(checks)
        results["wire"] = wire
        results["wire bf16/float32"] = wire["bf16 low"] / wire["float32"]
        results["params"] = int(sum(np.prod(p.shape) for p in params))
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
