"""Rank side of data parallelism against its limit: the 2-rank step vs one rank's share.

    mpiexec -n 2 python -m bench.dp_limit_rank REPEATS OUT.json

The limit of data parallelism on dp ranks is one process doing one rank's share of
the batch (B/dp rows) with no gradient sync at all. In one job, interleaved
repetition by repetition (the order rotating), every rank times:

    share       dp = 1 on its own (MPI.COMM_SELF), B/dp rows: the limit
    whole       rank 0 alone with the whole batch (B rows), the other ranks asleep:
                what the speed-up is measured against; whole / share is the most a
                speed-up can be on this machine, where ranks side by side share the
                memory bandwidth and the last-level cache
    allreduce   one Allreduce of a reused buffer as long as the whole gradient, nothing
                else: the sync's floor, so (share + allreduce) / share is the closest
                a step with a blocking sync can come to its limit
    averaged    the same Allreduce, then the buffer divided by dp (one pass of
                x *= 1/dp): the floor of a sync that averages, as every DP step must
    naive       the dp-rank step, one Allreduce per parameter
    bucketed    one Allreduce per bucket (reused flat buffers)
    overlapped  Iallreduce per bucket during backward, several bucket sizes; backward
                starts from 1/dp, so the sums arrive averaged (data_parallel.py)
    divided after  overlapped (65536) as it was before that: backward from 1, each
                bucket divided by dp after the last Wait (one more pass)

each step cut into compute (its rows drawn, forward, backward; with overlap also the
launches), sync (the Allreduces, or the Waitall left after backward) and the
optimizer. For overlapped steps also the seconds inside the hooks' MPI calls during
backward: the Tests that move the buckets on (`_progress`) and the launches (pack and
Iallreduce); on this machine's two cores a bucket's bytes are moved by the ranks' own
cores, inside those calls, so overlap can hide waiting but not that work. Waiting for
the slower rank is inside sync; it is estimated as the other rank's longer compute
(max over ranks of compute - this rank's). Rank 0 writes medians, min and max over the
repetitions of the slowest rank's step.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from bench.dp_rank import SHAPE
from bench.timing import spread
from minipar.comm.collectives import Ledger
from minipar.comm.job import wait_for_rank0
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import parallelize
from minipar.core import nn
from minipar.core.data import rank_rows
from minipar.core.optim import make_optimizer
from minipar.parallel.data_parallel import allreduce_gradients, bucketed_allreduce
from minipar.run.mesh_step import forward_backward
from minipar.run.reference import step_batch
from minipar.settings.config import TrainConfig

BUCKETS = (16384, 65536, 262144, 1048576)  # elements (float64: 128 KB .. 8 MB)


def build(cfg: TrainConfig, comm: object) -> tuple:
    """A mesh, the rank's model and its updater for `cfg` over `comm`."""
    mesh = Mesh(cfg.mesh_shape(), comm, Ledger())
    mesh.ledger.enabled = False
    full = nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)
    chunks, updater = parallelize(cfg, mesh, full, make_optimizer(cfg.optimizer, cfg.lr))
    return cfg, mesh, chunks, updater


def timed_step(setup: tuple, step: int) -> tuple[float, float, float]:
    """One training step; seconds of (compute, sync, optimizer)."""
    cfg, mesh, chunks, updater = setup
    start = time.perf_counter()
    x, y = step_batch(cfg, step, rank_rows(cfg.batch, cfg.microbatches, cfg.dp,
                                           mesh.coords["dp"]))
    params = updater.params
    for p in params:
        p.grad = None
    forward_backward(cfg, mesh, chunks, x, y, loss_scale=updater.backward_seed)  # 1 or 1/dp
    computed = time.perf_counter()
    if cfg.dp > 1 and cfg.grad_sync == "naive":
        allreduce_gradients(params, mesh)
    elif cfg.dp > 1 and cfg.grad_sync == "bucketed":
        bucketed_allreduce(updater.buckets, mesh, updater.flats)
    elif cfg.dp > 1:
        updater.overlap.finish()
    synced = time.perf_counter()
    updater.optimizer.step([p.data for p in params], [p.grad for p in params])
    return computed - start, synced - computed, time.perf_counter() - synced


def timed_whole(setup: tuple, step: int, world: MPI.Comm) -> tuple[float, float, float]:
    """Rank 0's step on the whole batch while the others sleep (`log.wait_for_rank0`):
    one process alone on the machine, as a run on one rank is."""
    parts = timed_step(setup, step) if world.Get_rank() == 0 else (0.0, 0.0, 0.0)
    wait_for_rank0(world)
    return parts


def timed_allreduce(buffer: np.ndarray, world: MPI.Comm, average: bool = False
                    ) -> tuple[float, float, float]:
    """One in-place Allreduce of `buffer` over every rank (as sync; no compute); with
    `average`, then divided by the ranks (a buffer of ones stays ones: no subnormals)."""
    start = time.perf_counter()
    world.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
    if average:
        buffer *= 1.0 / world.Get_size()
    return 0.0, time.perf_counter() - start, 0.0


def clock_hooks(overlap: object) -> dict[str, float]:
    """Seconds spent inside `overlap`'s Tests and launches, added up until reset: the
    instance's two methods wrapped in timers (the numbers they compute unchanged)."""
    clocks = {"tests": 0.0, "launches": 0.0}
    for attr, key in (("_progress", "tests"), ("_launch", "launches")):
        def timed(*args: object, f: object = getattr(overlap, attr), key: str = key) -> None:
            start = time.perf_counter()
            f(*args)
            clocks[key] += time.perf_counter() - start
        setattr(overlap, attr, timed)
    return clocks


def main() -> None:
    world = MPI.COMM_WORLD
    repeats, out = int(sys.argv[1]), sys.argv[2]
    dp = world.Get_size()
    base = TrainConfig(**SHAPE, dtype="float64", lr=0.01)
    setups = {"share": build(replace(base, batch=base.batch // dp).resolved(1), MPI.COMM_SELF),
              "naive": build(replace(base, grad_sync="naive").resolved(dp), world),
              "bucketed": build(replace(base, grad_sync="bucketed").resolved(dp), world)}
    for size in BUCKETS:
        setups[f"overlapped {size}"] = build(
            replace(base, grad_sync="overlapped", bucket_size=size).resolved(dp), world)
    after = build(replace(base, grad_sync="overlapped").resolved(dp), world)
    after[3].backward_seed, after[3].overlap.scale = 1.0, 1.0 / dp   # the division, after
    setups["divided after"] = after
    whole = build(base.resolved(1), MPI.COMM_SELF)
    gradient = np.ones(sum(p.data.size for p in setups["share"][3].params))
    averaged = gradient.copy()
    clocks = {name: clock_hooks(setup[3].overlap) for name, setup in setups.items()
              if setup[3].overlap is not None}
    steps = {name: (lambda rep, s=setup: timed_step(s, rep)) for name, setup in setups.items()}
    steps["whole"] = lambda rep: timed_whole(whole, rep, world)
    steps["allreduce"] = lambda rep: timed_allreduce(gradient, world)
    steps["averaged"] = lambda rep: timed_allreduce(averaged, world, average=True)
    names = list(steps)
    samples: dict[str, list] = {name: [] for name in names}
    inside: dict[str, dict[str, list]] = {name: {"tests": [], "launches": []}
                                          for name in clocks}
    for rep in range(repeats + 2):  # the first two: warm-up, not kept
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            world.Barrier()  # every rank starts each timed step together
            for key in clocks.get(name, {}):
                clocks[name][key] = 0.0
            parts = steps[name](rep)
            if rep >= 2:
                samples[name].append(parts)
                for key, seconds in clocks.get(name, {}).items():
                    inside[name][key].append(seconds)
    everyone = world.gather(samples)
    if world.Get_rank() != 0:
        return
    results = {}
    for name in names:
        per_rank = np.array([ranks[name] for ranks in everyone])   # (dp, repeats, 3)
        compute, sync, optimizer = per_rank[0].T
        waiting = per_rank[:, :, 0].max(axis=0) - per_rank[0, :, 0]
        slowest = per_rank.sum(axis=2).max(axis=0)  # the slowest rank, repetition by repetition
        results[name] = {"steps": slowest.tolist(), "step": spread(list(slowest)),
                         "compute": spread(list(compute)), "sync": spread(list(sync)),
                         "waiting": spread(list(waiting)), "optimizer": spread(list(optimizer))}
        for key, seconds in inside.get(name, {}).items():
            results[name][key] = spread(seconds)   # rank 0's, inside its compute
    results["buckets"] = {f"overlapped {size}": len(setups[f"overlapped {size}"][3].buckets)
                          for size in BUCKETS}
    results["ranks"] = dp
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
