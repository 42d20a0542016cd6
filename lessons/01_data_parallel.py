"""Lesson 1: data parallelism, one model copy per rank and a slice of the batch each.

    mpiexec -n 8 python lessons/01_data_parallel.py           # batch 1024, 128 per rank
    mpiexec -n 8 python lessons/01_data_parallel.py --full    # minipar's default model size
    mpiexec -n 4 python lessons/01_data_parallel.py           # any rank count dividing 1024
    mpiexec -n 8 python lessons/01_data_parallel.py --plot figures   # + 01_gradient_sync.png,
                                         #   01_sync_time.png, and the trace of part 6

The source text's example: a global batch of 1024 on 8 GPUs, 128 each. Every
GPU holds the whole model, computes g_i = grad L_i on its own 128 rows, and an
AllReduce gives everyone g = 1/8 sum_i g_i. Because L = 1/8 sum_i L_i (each L_i
a mean over 128 rows, L the mean over all 1024), g is exactly the gradient of
one process on the whole batch.

1. The source's example by hand, in this file: a linear model on raw NumPy
   arrays, each rank's g_i on its 128 rows, one `comm.Allreduce` of mpi4py, the
   1/8, and g checked against the one-process gradient of all 1024 rows.
2. The library's run of the same thing on minipar's residual MLP
   (minipar/parallel/data_parallel.py, `allreduce_gradients`: one Allreduce per
   parameter, then / N): each rank's slice and local gradient, then the same g
   on every rank, equal to one process to ~1e-16; and the library's call on
   part 1's arrays, equal to the hand-written one.

Beyond the source (each part's header says so):

3. Bucketed: the gradients packed into a few buffers, one Allreduce each: the
   same numbers in fewer, larger messages (PyTorch DDP, Li et al. 2020). Each
   rank's ledger: it Allreduced exactly the parameter count, whichever way; a
   ring puts 2(N-1)/N of it on the wire.
4. Overlapped: each bucket's nonblocking Iallreduce starts from inside backward,
   as soon as backward has finished the parameters in it.
5. The three ways timed: forward + backward + gradient sync, the slowest rank
   of each step, the median and spread of several steps, on as many ranks as this
   machine has cores (with more ranks than cores a wall clock measures the ranks
   taking turns); "fastest" only when one way's spread is clear of the others'.
   The bytes are the same; the time is not.
6. With --plot, the overlapped sync in a traced training run: how much of the
   Iallreduces' time the backward hid, measured, and the timeline drawn.

The code behind it: minipar/parallel/data_parallel.py.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Ledger
from minipar.comm.job import run_collectively, say_in_order, verdict, wait_for_rank0
from minipar.comm.mesh import Mesh, MeshShape
from minipar.core import nn, timing
from minipar.core.byte_units import format_bytes
from minipar.core.data import make_batch, shard_rows
from minipar.core.memory import wire_elements
from minipar.core.threads import cores
from minipar.parallel.buckets import make_buckets
from minipar.parallel.data_parallel import (
    OverlappedAllreduce,
    allreduce_gradients,
    bucketed_allreduce,
)
from minipar.parallel.dp_hooks import install_hooks
from minipar.run.train import train
from minipar.settings.config import ConfigError, TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.teaching import trace_files, trace_report

BATCH = 1024


def banner(mesh: Mesh, title: str) -> None:
    if mesh.rank == 0:
        print(f"\n=== {title}", flush=True)


# ------------------------------------------ part 1: the source's example, by hand
def by_hand(comm: MPI.Comm) -> tuple[np.ndarray, np.ndarray]:
    """g = 1/N sum_i g_i with one mpi4py Allreduce, on a linear model y = x W and the loss
    L = 1/B sum_rows 1/2 |x W - t|^2, whose gradient is dL/dW = x^T (x W - t) / B.
    Returns (this rank's g_i, the averaged g)."""
    n, me = comm.Get_size(), comm.Get_rank()
    rows = BATCH // n                                   # 1024 / 8 = 128
    rng = np.random.default_rng(0)                      # the same numbers on every rank:
    x = rng.normal(size=(BATCH, 16))                    # the global batch, 1024 x 16
    t = rng.normal(size=(BATCH, 4))                     # its targets, 1024 x 4
    w = rng.normal(size=(16, 4))                        # the model, the same on every rank
    mine = slice(me * rows, (me + 1) * rows)            # rank i's 128 rows
    x_i, t_i = x[mine], t[mine]
    g_i = x_i.T @ (x_i @ w - t_i) / rows                # g_i = grad L_i, a mean over 128 rows
    g = np.empty_like(g_i)
    comm.Allreduce(g_i, g, op=MPI.SUM)                  # every rank: g = sum_i g_i
    g /= n                                              # the 1/8: g = 1/8 sum_i g_i
    one_process = x.T @ (x @ w - t) / BATCH             # one process, all 1024 rows
    rel = float(np.max(np.abs(g - one_process)) / np.max(np.abs(one_process)))
    if me == 0:
        print(f"a linear model W (16 x 4), loss L = mean over rows of 1/2 |x W - t|^2; "
              f"rank i takes rows {rows}i..{rows}i+{rows - 1}\nand computes "
              f"g_i = x_i^T (x_i W - t_i) / {rows}; then comm.Allreduce(g_i, g, op=MPI.SUM) "
              f"and g /= {n}", flush=True)
    say_in_order(comm, f"rows {mine.start}..{mine.stop - 1}: |g_{me}| = "
                       f"{np.linalg.norm(g_i):.15f}   after Allreduce and /{n}: |g| = "
                       f"{np.linalg.norm(g):.15f}")
    if me == 0:
        print(f"one process on all {BATCH} rows: |g| = {np.linalg.norm(one_process):.15f}; "
              f"max relative difference {rel:.1e} -> {verdict(rel <= 1e-9)}\n"
              f"(L = 1/{n} sum_i L_i, each L_i a mean over {rows} rows, so 1/{n} sum_i g_i is "
              f"the gradient of L:\n the same numbers, added in another order)", flush=True)
    return g_i, g


def library_on_hand_arrays(mesh: Mesh, g_i: np.ndarray, g: np.ndarray) -> None:
    """Part 1's g_i handed to the library's sync (a Parameter whose gradient is g_i):
    `allreduce_gradients` leaves it equal to the g written by hand."""
    p = nn.Parameter(np.zeros_like(g_i), "w")
    p.grad = g_i.copy()
    allreduce_gradients([p], mesh)
    diff = float(np.max(np.abs(p.grad - g)))
    mesh.ledger.reset()
    if mesh.rank == 0:
        print(f"the library on part 1's arrays: allreduce_gradients([W], mesh) leaves W.grad "
              f"= the g of part 1:\n  max |difference| = {diff:.1e} -> {verdict(diff == 0.0)}",
              flush=True)


def norm(grads: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(g * g)) for g in grads)))


def local_gradients(model: nn.Model, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """g_i: the gradient of the mean loss over this rank's rows only."""
    model.zero_grad()
    nn.loss_fn(model, x, y).backward()
    return [p.grad.copy() for p in model.parameters()]


def compare(mesh: Mesh, model: nn.Model, single: list[np.ndarray], how: str) -> None:
    """Each rank's synced gradient against the one-process gradient of the whole batch."""
    grads = [p.grad for p in model.parameters()]
    worst = max(float(np.max(np.abs(g - s)) / np.max(np.abs(s))) for g, s in zip(grads, single))
    if mesh.rank == 0:
        print(f"after {how}, every rank holds g = 1/N sum_i g_i; against one process on "
              f"all {BATCH} rows:", flush=True)
    say_in_order(mesh.world, f"|g| = {norm(grads):.15f}   max relative difference {worst:.1e} "
                 f"-> {verdict(worst <= 1e-9)}")


def ledger_line(mesh: Mesh, psi: int) -> list[dict]:
    """What this rank's ledger recorded for the sync just done, beside the formula.
    Returns those records (for the figure) and empties the ledger."""
    n = mesh.shape.dp
    records = mesh.ledger.records(mesh.rank)
    for (op, group), entry in sorted(mesh.ledger.entries.items()):
        if mesh.rank == 0:
            wire = wire_elements(op, entry.elements, n)
            print(f"  ledger (rank 0): {op} on {group}: {entry.calls} calls, "
                  f"{entry.elements} elements (the parameter count: {psi});\n    on the wire "
                  f"{wire:.0f} elements ({format_bytes(8 * wire)}) = 2(N-1)/N x {psi} = "
                  f"{2 * (n - 1) / n * psi:.0f}", flush=True)
    mesh.ledger.reset()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="minipar's default model size")
    parser.add_argument("--bucket-size", type=int, default=2000, help="elements per bucket")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per way (part 5)")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write the figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    world = MPI.COMM_WORLD
    n = world.Get_size()
    if BATCH % n:
        raise ConfigError(f"lesson 1 splits a batch of {BATCH} rows evenly: run it on a rank "
                          f"count dividing {BATCH} (got {n})")
    mesh = Mesh(MeshShape(dp=n), world, Ledger())
    sizes = nn.ModelConfig() if args.full else nn.ModelConfig(layers=2, d_in=16, d_model=32,
                                                              d_ff=128)
    # every rank draws the same full model from one seed: the replicas start equal
    model = nn.build_reference(sizes, nn.init_params(sizes, seed=0))
    psi = sum(p.data.size for p in model.parameters())
    x, y = make_batch(0, 0, BATCH, sizes.d_in, sizes.classes)  # the same global batch everywhere
    rows = shard_rows(BATCH, 1, n, 0, mesh.rank)

    banner(mesh, f"1. the source's example by hand: batch {BATCH} on {n} ranks, "
                 f"{BATCH // n} each, g = 1/{n} sum_i g_i")
    g_i, g = by_hand(world)

    banner(mesh, f"2. the library's run of the same thing: minipar's MLP ({psi} parameters "
                 "on every rank),\none Allreduce per parameter, then / N")
    single = local_gradients(model, x, y)  # one process, all rows: the answer to match
    local = local_gradients(model, x[rows], y[rows])
    say_in_order(mesh.world, f"rows {rows.start}..{rows.stop - 1}: local gradient "
                             f"|g_{mesh.rank}| = {norm(local):.15f}")
    if mesh.rank == 0:
        print(f"  (one process on all {BATCH} rows: |g| = {norm(single):.15f})", flush=True)
    allreduce_gradients(model.parameters(), mesh)  # g_i -> 1/N sum_i g_i, tensor by tensor
    compare(mesh, model, single, "the naive Allreduce")
    syncs = {"naive": ledger_line(mesh, psi)}  # rank 0's ledger of each way, for the figure
    library_on_hand_arrays(mesh, g_i, g)

    buckets = make_buckets(model.parameters(), args.bucket_size)
    banner(mesh, f"3. Beyond the source: bucketed, {len(buckets)} buckets of at most "
                 f"{args.bucket_size} elements (a larger tensor alone), last layer first")
    for p, g in zip(model.parameters(), local):
        p.grad = g.copy()
    bucketed_allreduce(buckets, mesh)
    compare(mesh, model, single, "the bucketed Allreduce")
    syncs["bucketed"] = ledger_line(mesh, psi)

    banner(mesh, "4. Beyond the source: overlapped, each bucket's Iallreduce starts during "
                 "backward")
    overlap = OverlappedAllreduce(buckets, mesh, microbatches=1)
    install_hooks([model], overlap)  # marker nodes around the embedding, blocks and head
    local_gradients(model, x[rows], y[rows])  # backward starts the Iallreduces...
    started = len(overlap.in_flight)
    overlap.finish()                          # ...and here we wait for them
    if mesh.rank == 0:
        print(f"{started} of {len(buckets)} Iallreduces had started inside backward", flush=True)
    compare(mesh, model, single, "the overlapped Iallreduce")
    syncs["overlapped"] = ledger_line(mesh, psi)
    times = timed(sizes, mesh, args.bucket_size, args.repeats, n)
    k = timing_ranks(n)
    mesh.free()
    if args.plot:
        traced_overlap(sizes, args.bucket_size, args.plot / "trace_overlapped", world)
    if args.plot and mesh.rank == 0:
        from minipar.teaching.load_plots import timing_figure
        from minipar.teaching.plots import save

        path = save(timing_figure(times, f"forward + backward + gradient sync of {psi} "
                                  f"parameters on dp = {k} {timing.where(k)}, median of "
                                  f"{args.repeats} steps; {timing.verdict(times)}"),
                    args.plot / "01_sync_time.png")
        print(f"figure: {path}", flush=True)
    if args.plot and mesh.rank == 0:
        from minipar.teaching.ledger_tables import group_sizes
        from minipar.teaching.plots import ledger_figure, save

        path = save(ledger_figure(syncs, group_sizes(mesh.shape),
                                  f"three ways to sync {psi} gradients over dp = {n}: the same "
                                  f"wire bytes, 2(N-1)/N x {psi} x 8, in fewer calls"),
                    args.plot / "01_gradient_sync.png")
        print(f"figure: {path}", flush=True)


def timing_ranks(n: int) -> int:
    """How many ranks part 5 times on: as many as there are cores (at most n), so each
    timed rank has a core of its own, and a divisor of the batch."""
    return max(k for k in range(1, min(n, cores()) + 1) if BATCH % k == 0)


def timed(sizes: nn.ModelConfig, mesh: Mesh, bucket_size: int, repeats: int,
          ranks: int) -> dict[str, list[float]] | None:
    """Part 5: each way's step (forward, backward, sync) timed `repeats` times, the ways
    interleaved so a busy moment of the machine hits all three alike, on the first
    `timing_ranks` ranks only (dp = that many, a core each): with more ranks than cores
    the wall clock measures the ranks taking turns, not the sync. The other ranks sleep
    meanwhile. A step lasts as long as its slowest rank: each time is the max over the
    timed ranks (seconds). Returns the times on rank 0, None elsewhere."""
    k = timing_ranks(ranks)
    sub = mesh.world.comm.Split(0 if mesh.rank < k else MPI.UNDEFINED, mesh.rank)
    times, waits = {}, (0, 0)
    if sub != MPI.COMM_NULL:
        timers = Mesh(MeshShape(dp=k), sub, Ledger())
        rows = shard_rows(BATCH, 1, k, 0, timers.rank)
        x, y = make_batch(0, 0, BATCH, sizes.d_in, sizes.classes)
        x, y = x[rows], y[rows]
        plain = nn.build_reference(sizes, nn.init_params(sizes, seed=0))
        hooked = nn.build_reference(sizes, nn.init_params(sizes, seed=0))
        plain_buckets = make_buckets(plain.parameters(), bucket_size)
        overlap = OverlappedAllreduce(make_buckets(hooked.parameters(), bucket_size), timers, 1)
        install_hooks([hooked], overlap)
        waits = (len([p for p in plain.parameters() if p.sync]), len(plain_buckets))

        def step(model: nn.Model, sync: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                sub.Barrier()  # every timed rank starts the step together
                local_gradients(model, x, y)
                sync()
            return run

        ways = {"naive": step(plain, lambda: allreduce_gradients(plain.parameters(), timers)),
                "bucketed": step(plain, lambda: bucketed_allreduce(plain_buckets, timers)),
                "overlapped": step(hooked, overlap.finish)}
        times = timing.timed(ways, repeats, clock=lambda t: sub.allreduce(t, op=MPI.MAX))
        timers.free()
        sub.Free()
    wait_for_rank0(mesh.world.comm)  # the untimed ranks asleep until rank 0 is done
    if mesh.rank == 0:
        print(f"\n=== 5. Beyond the source: the three ways timed: forward + backward + sync, "
              f"ms, slowest rank,\n{repeats} steps each, interleaved; on dp = {k} "
              f"{timing.where(k)}" + (f",\nnot the {ranks} ranks above: {ranks} ranks on "
                                      f"{cores()} cores would time the ranks taking turns"
                                      if k < ranks else ""), flush=True)
        print(f"  (naive blocks {waits[0]} times a step, bucketed {waits[1]}, overlapped "
              "starts its Iallreduces during backward and waits once)", flush=True)
        for way, seconds in times.items():
            print(f"  {way:>10}: {timing.Spread.of(seconds).text()}", flush=True)
        print(f"  {timing.verdict(times)} (a way is fastest only if its slowest step beats "
              "the others' fastest)", flush=True)
    return {way: [1000 * t for t in seconds] for way, seconds in times.items()} \
        if mesh.rank == 0 else None


def traced_overlap(sizes: nn.ModelConfig, bucket_size: int, folder: Path,
                   world: MPI.Comm) -> None:
    """Part 6 (with --plot): the overlapped sync in a real training run, traced
    (`train --grad-sync overlapped --trace`): how much of the Iallreduces' time ran under
    the backward, measured (trace_report.measure, what `python -m minipar trace` prints),
    and the run's timeline drawn."""
    n = world.Get_size()
    if world.Get_rank() == 0:   # the trace of an earlier run of this lesson: replaced
        shutil.rmtree(folder, ignore_errors=True)
    world.Barrier()
    cfg = TrainConfig(layers=sizes.layers, d_in=sizes.d_in, d_model=sizes.d_model,
                      d_ff=sizes.d_ff, batch=BATCH, steps=2, dp=n, grad_sync="overlapped",
                      bucket_size=bucket_size, trace=str(folder)).resolved(n)
    train(cfg, world)
    if world.Get_rank() != 0:
        return
    doc = trace_files.load(folder)
    m = trace_report.measure(doc)
    print(f"\n=== 6. Beyond the source: the overlap in a traced run (train --grad-sync overlapped "
          f"--trace\n{folder}):\n{m.hidden_by_axis.get('dp', 0):.1%} of the dp Iallreduces' "
          f"time ran under compute; {n} ranks on {cores()} cores"
          + ("\n(oversubscribed: a rank waiting for a core looks idle)" if n > cores() else ""),
          flush=True)
    from minipar.teaching.plots import save

    path = save(trace_report.figure(doc, f"overlapped gradient sync, dp = {n}: each bucket's "
                                         "Iallreduce from its start inside backward to the "
                                         "Waitall"), folder.parent / "01_trace_overlapped.png")
    print(f"figure: {path}", flush=True)


if __name__ == "__main__":
    run_collectively(main)
