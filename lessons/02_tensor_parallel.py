"""Lesson 2: tensor parallelism, one weight matrix split across ranks (Megatron-LM).

    mpiexec -n 2 python lessons/02_tensor_parallel.py          # W 8192x8192 scaled to 1024x1024
    mpiexec -n 4 python lessons/02_tensor_parallel.py          # W 4096x4096 scaled to 512x512
    mpiexec -n 2 python lessons/02_tensor_parallel.py --full   # the source's sizes (~1.5 GiB)
    mpiexec -n 4 python lessons/02_tensor_parallel.py --plot figures   # + 02_tp_ledger.png

The source text's example: a linear layer Y = X W with W of 8192 x 8192 on 2
GPUs, held as two column blocks of 8192 x 4096; each GPU computes half of Y,
then an AllGather; and W of 4096 x 4096 on 4 GPUs as four 4096 x 1024 blocks.

1. That example on real arrays (scaled by 1/8 unless `--full`, same ratios):
   each rank's block of W, its part of Y, the Allgather, and max |Y - X W|.
2. Two layers, GELU(X W1) W2, the MLP of every transformer block: split W1 by
   columns and W2 by rows (Megatron, Shoeybi et al. 2019) and one Allreduce
   replaces the Allgathers, because GELU works on a column shard as it stands.
3. One training step of minipar's model on a tp group: the communication ledger
   beside Megatron's count (2 Allreduces of B x d per block), with sequence
   parallelism (Korthikanti et al. 2022) beside it, parameter memory per rank
   beside 1/tp of the model, and the check against one process.

The code behind part 3: minipar/parallel/tensor_parallel.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Group, Ledger
from minipar.comm.job import run_collectively, say_in_order, verdict
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import build_rank_model
from minipar.core import autograd as ag
from minipar.core import fused_layers, nn
from minipar.core.byte_units import MiB
from minipar.core.memory import wire_elements
from minipar.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    parameter_count,
    shard,
)
from minipar.run.train import train, train_reference
from minipar.settings.config import ConfigError, TrainConfig, problems
from minipar.settings.preflight import lesson_arguments


def banner(tp: Group, title: str) -> None:
    if tp.rank == 0:
        print(f"\n=== {title}", flush=True)


# ------------------------------------------------- part 1: the source's example
def column_split(tp: Group, full: bool) -> None:
    """Y = X W with W split by columns: rank k computes Y[:, cols_k], Allgather joins them."""
    n, k = tp.size, tp.rank
    size = 16384 // n if full else 2048 // n    # 8192 on 2 ranks, 4096 on 4 (the source)
    size -= size % n
    tokens = 64 if full else 32
    source = 16384 // n
    scale = ("the source's size" if full else
             f"the source's {source} x {source} scaled by 1/8; --full for its real size")
    banner(tp, f"1. Y = X W, W {size} x {size} split by columns over {n} ranks ({scale})")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(tokens, size))
    # every rank draws the full W from one seeded generator and keeps its block:
    # wasteful at scale, exact here (all ranks agree on W without sending it)
    w = rng.normal(size=(size, size)) / np.sqrt(size)
    cols = shard(size, n, k)
    w_mine = w[:, cols].copy()
    if k != 0:
        del w  # only rank 0 keeps the full W, to check the result at the end
    y_mine = x @ w_mine                        # (B, D) @ (D, D/n) -> (B, D/n)
    say_in_order(tp, f"holds W[:, {cols.start}:{cols.stop}] ({size} x {size // n}, "
                     f"{w_mine.nbytes / MiB:.1f} of the {size * size * 8 / MiB:.1f} MiB of W), "
                     f"computes Y[:, {cols.start}:{cols.stop}] ({tokens} x {size // n})")
    blocks = np.empty((n, tokens, size // n))
    tp.Allgather(y_mine, blocks)               # Y's (B, D/n) block of every rank -> all of them
    y = np.concatenate(list(blocks), axis=1)   # (B, D), on every rank
    if k == 0:
        diff = float(np.max(np.abs(y - x @ w)))
        print(f"Allgather rebuilds Y ({tokens} x {size}) on every rank: "
              f"max |Y - X @ W| = {diff:.1e}", flush=True)


# ---------------------------------------------- part 2: column, then row
def two_layers(tp: Group) -> None:
    """GELU(X W1 + b1) W2 + b2: column-then-column with Allgathers, or column-then-row."""
    n, k = tp.size, tp.rank
    tokens, d, f = 32, 64, 256
    banner(tp, f"2. Z = GELU(X W1 + b1) W2 + b2, B={tokens} d={d} f={f}, {n} ranks")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(tokens, d))
    full = {"fc1.weight": rng.normal(size=(d, f)) / 8, "fc1.bias": rng.normal(size=f) / 8,
            "fc2.weight": rng.normal(size=(f, d)) / 16, "fc2.bias": rng.normal(size=d) / 8}
    expected = fused_layers.gelu(ag.Tensor(x @ full["fc1.weight"] + full["fc1.bias"])).data \
        @ full["fc2.weight"] + full["fc2.bias"]
    ways = {
        "column + Allgather, column + Allgather": (
            ColumnParallelLinear(full, "fc1", tp, gather_output=True),
            ColumnParallelLinear(full, "fc2", tp, gather_output=True)),
        "column, GELU on the shard, row + Allreduce": (
            ColumnParallelLinear(full, "fc1", tp), RowParallelLinear(full, "fc2", tp)),
    }
    for name, (first, second) in ways.items():
        tp.ledger.reset()
        with ag.no_grad():                     # forward only: the backward mirrors it
            z = second(fused_layers.gelu(first(ag.Tensor(x))))
        entries = sorted(tp.ledger.entries.items())
        wire = sum(wire_elements(op, e.elements, n) for (op, _), e in entries)
        moved = ", ".join(f"{e.calls} x {op} ({e.elements} elements)" for (op, _), e in entries)
        if k == 0:
            print(f"{name}:\n  {moved}, {wire:.0f} elements on the wire per rank; "
                  f"max |Z - one process| = {np.max(np.abs(z.data - expected)):.1e}", flush=True)
    rows_first_fails(tp, x, full)


def rows_first_fails(tp: Group, x: np.ndarray, full: dict[str, np.ndarray]) -> None:
    """Why not rows first: a row split of W1 gives partial sums, and GELU of a sum is
    not the sum of GELUs, so an Allreduce would have to come before GELU as well."""
    n, k = tp.size, tp.rank
    (tokens, d), f = x.shape, full["fc1.bias"].size
    rows = shard(d, n, k)
    share = x[:, rows] @ full["fc1.weight"][rows] + full["fc1.bias"] / n
    gelu_of_shares = fused_layers.gelu(ag.Tensor(share)).data
    tp.Allreduce(MPI.IN_PLACE, gelu_of_shares)  # GELU(share_k) (B, f) of every rank -> sum
    wrong = float(np.max(np.abs(gelu_of_shares - fused_layers.gelu(ag.Tensor(
        x @ full["fc1.weight"] + full["fc1.bias"])).data)))
    if k == 0:
        print(f"why column first: GELU works on a column shard as it is, and that shard is\n"
              f"  exactly the slice of the input a row-split W2 needs; nothing moves between\n"
              f"  the matmuls. Rows first gives partial sums, and sum_k GELU(share_k) differs\n"
              f"  from GELU(X W1 + b1) by up to {wrong:.2f}. Megatron: "
              f"Allreduce 2(n-1)/n B d = {wire_elements('Allreduce', tokens * d, n):.0f} vs\n"
              f"  Allgathers (n-1)/n (B f + B d) = "
              f"{wire_elements('Allgather', tokens * (f + d), n):.0f} elements per rank.",
              flush=True)


# ------------------------------------------- part 3: one step of the TP model
def one_step(world: MPI.Comm, sp: bool) -> tuple[list[dict], float]:
    """Train one step with tp = world size; print the ledger beside Megatron's count.
    Returns the step's ledger and rank 0's tp wire elements (on rank 0; empty elsewhere)."""
    n = world.Get_size()
    cfg = TrainConfig(layers=4, d_model=64, d_in=32, batch=32, steps=1, dp=1, tp=n,
                      sp=sp).resolved(n)
    errors = problems(cfg, n)
    if errors:
        raise SystemExit(f"this mesh cannot run the lesson: {errors[0]}")
    result = train(cfg, world)
    if world.Get_rank() != 0:
        return [], 0.0
    L, B, d = cfg.layers, cfg.batch // cfg.microbatches, cfg.d_model
    tp_ops = {r["op"]: r for r in result.ledger if r["rank"] == 0 and r["group"] == "tp"}
    expected = ({"Allreduce": (2 * L, 2 * L * B * d)} if not sp else
                {"Allgather": (2 * L + 2, (2 * L + 2) * B * d),
                 "Reduce_scatter": (2 * L, 2 * L * B * d), "Allreduce": (1, 3 * d * L)})
    print(f"{'with' if sp else 'without'} --sp, tp={n}, L={L} blocks, B={B} rows, d={d}:")
    wire = 0.0
    for op, (calls, elements) in expected.items():
        seen = tp_ops.get(op, {"calls": 0, "elements": 0})
        wire += wire_elements(op, seen["elements"], n)
        ok = (seen["calls"], seen["elements"]) == (calls, elements)
        print(f"  tp {op:>14}: {seen['calls']:3d} calls, {seen['elements']:6d} elements; "
              f"expected {calls:3d}, {elements:6d} -> {verdict(ok, 'matches', 'DIFFERS')}")
    print(f"  wire per rank: {wire:.0f} elements" + (
        " (Megatron: one Allreduce of B x d forward and one backward per block)" if not sp
        else f" = {(2 * L + 2) * B * d * (n - 1) / n:.0f} Allgather + "
             f"{2 * L * B * d * (n - 1) / n:.0f} Reduce_scatter + "
             f"{3 * d * L * 2 * (n - 1) / n:.0f} Allreduce:\n"
             f"  per block the same volume as the Allreduce it replaces (an Allreduce is a\n"
             f"  Reduce_scatter + an Allgather), plus 2 Allgathers entering and leaving the\n"
             f"  row-split stream and the LayerNorm / fc2-bias gradient sum"))
    ref = train_reference(cfg)
    worst = max(float(np.max(np.abs(result.final[k] - v)) / np.max(np.abs(v)))
                for k, v in ref.final.items())
    print(f"  against one process: loss {result.losses[0]:.12f} vs {ref.losses[0]:.12f}, "
          f"params max rel diff {worst:.1e} -> {verdict(worst <= 1e-9)}",
          flush=True)
    return result.ledger, wire


def memory(world: MPI.Comm) -> None:
    """Parameters each rank holds, beside 1/tp of the replicated model."""
    n = world.Get_size()
    cfg = TrainConfig(layers=4, d_model=64, d_in=32, batch=32, steps=1, dp=1, tp=n,
                      sp=True).resolved(n)
    mesh = Mesh(cfg.mesh_shape(), world, Ledger())
    full = nn.init_params(cfg.model_config(), cfg.seed)
    mine = parameter_count(build_rank_model(cfg, mesh, full))
    mesh.free()
    total = sum(v.size for v in full.values())
    split = sum(v.size for name, v in full.items()
                if name.endswith(("fc1.weight", "fc1.bias", "fc2.weight")))
    rows, d = cfg.batch, cfg.d_model
    if world.Get_rank() == 0:
        print(f"parameters per rank: {mine} ({mine * 8 / 1024:.0f} KiB); the whole model "
              f"{total}, 1/tp of it {total / n:.0f}.\n  The gap: embedding, head, "
              f"LayerNorms and fc2 biases ({total - split} elements) are replicated, the "
              f"{split} of fc1 and fc2 split.\n  Activations of the LayerNorm / residual "
              f"region per block: {rows} x {d} per rank, with --sp {rows // n} x {d}.",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the source's exact sizes")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    world = MPI.COMM_WORLD
    n = world.Get_size()
    if n < 2 or 2048 % n:  # every rank sees the same size: all stop here, together
        raise ConfigError(f"lesson 2 splits W's 2048 columns evenly over the ranks: run it on "
                          f"2 or more ranks, a count dividing 2048 (got {n}): mpiexec -n 2 "
                          "python lessons/02_tensor_parallel.py")
    tp = Group(world, "tp", Ledger())  # the whole world is one tensor-parallel group
    column_split(tp, args.full)
    two_layers(tp)
    banner(tp, "3. one training step of minipar's model, tp = every rank")
    steps = {label: one_step(world, sp) for label, sp in
             (("tensor parallel", False), ("+ sequence parallel (--sp)", True))}
    ledgers = {label: ledger for label, (ledger, _) in steps.items()}
    (_, plain), (_, with_sp) = steps.values()
    if world.Get_rank() == 0:
        print(f"on the wire, --sp sends {with_sp / plain:.2f} x plain TP's bytes per rank "
              "(the figure's bars)", flush=True)
    memory(world)
    if args.plot and world.Get_rank() == 0:
        from minipar.comm.mesh import MeshShape
        from minipar.teaching.ledger_tables import group_sizes
        from minipar.teaching.plots import ledger_figure, save

        path = save(ledger_figure(ledgers, group_sizes(MeshShape(dp=1, tp=world.Get_size())),
                                  f"one step on tp = {world.Get_size()} ranks: the tp wire "
                                  "bytes, without and with --sp (ring formulas)"),
                    args.plot / "02_tp_ledger.png")
        print(f"figure: {path}", flush=True)


if __name__ == "__main__":
    run_collectively(main)
