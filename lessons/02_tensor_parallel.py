"""Lesson 2: tensor parallelism, one weight matrix split across ranks (Megatron-LM).

    mpiexec -n 4 python lessons/02_tensor_parallel.py          # the source's examples, 1/8 size
    mpiexec -n 4 python lessons/02_tensor_parallel.py --full   # the real sizes (W: 512 MiB)
    mpiexec -n 2 python lessons/02_tensor_parallel.py          # any rank count dividing 512
    mpiexec -n 4 python lessons/02_tensor_parallel.py --plot figures   # + 02_tp_ledger.png

The source text's examples: a linear layer Y = X W with W of 8192 x 8192 on 2
GPUs, held as two column blocks of 8192 x 4096; each GPU computes half of Y,
then an AllGather; and W of 4096 x 4096 on 4 GPUs as four 4096 x 1024 blocks.
Its other communication, AllReduce, is the row split's.

1. The first example by hand, in this file, on raw NumPy arrays (scaled by 1/8
   unless `--full`, the ratios kept: W 1024 x 1024 as two 1024 x 512 blocks):
   ranks 0 and 1 each hold a column block, compute their half of Y, and one
   `Allgather` of mpi4py joins the halves; max |Y - X W| on every rank.
2. The second example by hand on all the ranks: W 4096 x 4096 (512 x 512) on 4
   ranks as 4096 x 1024 (512 x 128) column blocks, the same Allgather.
3. The row split by hand: rank k holds rows k of W and columns k of X, its
   product is a partial sum of the whole Y, and one `Allreduce` adds them.
4. The library's run of the same three (minipar/parallel/tensor_parallel.py:
   ColumnParallelLinear, RowParallelLinear) on the same arrays, equal to them.

Beyond the source (each part's header says so):

5. Two layers, GELU(X W1) W2, the MLP of every transformer block: split W1 by
   columns and W2 by rows (Megatron, Shoeybi et al. 2019) and one Allreduce
   replaces the Allgathers, because GELU works on a column shard as it stands.
6. One training step of minipar's model on a tp group: the communication ledger
   beside Megatron's count (2 Allreduces of B x d per block), with sequence
   parallelism (Korthikanti et al. 2022) beside it, parameter memory per rank
   beside 1/tp of the model, and the check against one process.

The code behind parts 4-6: minipar/parallel/tensor_parallel.py.
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
from minipar.settings.config import ConfigError, TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.settings.validation import problems


def banner(tp: Group, title: str) -> None:
    if tp.rank == 0:
        print(f"\n=== {title}", flush=True)


def say(comm: MPI.Comm, text: str) -> None:
    """Print from rank 0 of `comm` only."""
    if comm.Get_rank() == 0:
        print(text, flush=True)


# ------------------------------------------- parts 1-3: the source's examples, by hand
SCALE = 8        # the source's sizes divided by 8 unless --full: every ratio kept
TOKENS = 32      # rows of X (the source gives none; 64 with --full)


def arrays(size: int, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """X (tokens, size) and W (size, size), the same on every rank: each rank draws them
    from one seeded generator (wasteful at scale, exact here: no rank sends W)."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(tokens, size)), rng.normal(size=(size, size)) / np.sqrt(size)


def column_by_hand(comm: MPI.Comm, source: int, full: bool, seed: int) -> np.ndarray:
    """Y = X W with W split by columns on the ranks of `comm`, by hand: rank k computes
    Y[:, cols_k] = X W[:, cols_k] and an mpi4py Allgather joins the blocks. Returns Y."""
    n, k = comm.Get_size(), comm.Get_rank()
    size = source if full else source // SCALE
    tokens = 2 * TOKENS if full else TOKENS
    x, w = arrays(size, tokens, seed)
    width = size // n
    cols = slice(k * width, (k + 1) * width)
    w_k = w[:, cols]                                     # my column block: (D, D/n)
    y_k = x @ w_k                                        # (B, D) @ (D, D/n) -> (B, D/n)
    say_in_order(comm, f"holds W[:, {cols.start}:{cols.stop}] ({size} x {width}, "
                       f"{w_k.nbytes / MiB:.1f} of the {w.nbytes / MiB:.1f} MiB of W), "
                       f"computes Y[:, {cols.start}:{cols.stop}] ({tokens} x {width})")
    blocks = np.empty((n, tokens, width))
    comm.Allgather(y_k, blocks)                          # every rank's (B, D/n) -> all of them
    y = np.concatenate(list(blocks), axis=1)             # blocks side by side: Y (B, D)
    diff = comm.allreduce(float(np.max(np.abs(y - x @ w))), op=MPI.MAX)
    if k == 0:
        print(f"comm.Allgather(y_k, blocks) rebuilds Y ({tokens} x {size}) on every rank: "
              f"max |Y - X @ W| = {diff:.1e} -> {verdict(diff < 1e-12)}", flush=True)
    return y


def row_by_hand(comm: MPI.Comm, source: int, full: bool, seed: int) -> np.ndarray:
    """Y = X W with W split by rows, by hand: rank k holds W[rows_k, :] and the matching
    columns of X; X[:, rows_k] W[rows_k, :] is a partial sum of all of Y, and an mpi4py
    Allreduce adds the partial sums. Returns Y."""
    n, k = comm.Get_size(), comm.Get_rank()
    size = source if full else source // SCALE
    tokens = 2 * TOKENS if full else TOKENS
    x, w = arrays(size, tokens, seed)
    height = size // n
    rows = slice(k * height, (k + 1) * height)
    w_k = w[rows, :]                                     # my row block: (D/n, D)
    partial = x[:, rows] @ w_k                           # (B, D/n) @ (D/n, D) -> (B, D), a share
    say_in_order(comm, f"holds W[{rows.start}:{rows.stop}, :] ({height} x {size}) and "
                       f"X[:, {rows.start}:{rows.stop}], computes a share of all of Y "
                       f"({tokens} x {size})")
    y = np.empty_like(partial)
    comm.Allreduce(partial, y, op=MPI.SUM)               # the shares of every rank -> their sum
    diff = comm.allreduce(float(np.max(np.abs(y - x @ w))), op=MPI.MAX)
    if k == 0:
        print(f"comm.Allreduce(partial, y, op=MPI.SUM) adds the shares into Y on every rank: "
              f"max |Y - X @ W| = {diff:.1e} -> {verdict(diff < 1e-12)}", flush=True)
    return y


def the_library(comm: MPI.Comm, source: int, full: bool, seed: int,
                by_hand: dict[str, np.ndarray]) -> None:
    """The library's layers on the same X and W (bias zero): ColumnParallelLinear with
    gather_output=True is the column split and its Allgather, RowParallelLinear the row
    split and its Allreduce; each Y against the one written by hand."""
    size = source if full else source // SCALE
    tokens = 2 * TOKENS if full else TOKENS
    x, w = arrays(size, tokens, seed)
    full_params = {"w.weight": w, "w.bias": np.zeros(size)}
    tp = Group(comm, "tp", Ledger())
    layers = {"column": lambda: ColumnParallelLinear(full_params, "w", tp, gather_output=True),
              "row": lambda: RowParallelLinear(full_params, "w", tp, input_is_parallel=False)}
    for how in by_hand:
        layer = layers[how]()
        tp.ledger.reset()
        with ag.no_grad():
            y = layer(ag.Tensor(x)).data
        diff = comm.allreduce(float(np.max(np.abs(y - by_hand[how]))), op=MPI.MAX)
        moved = ", ".join(f"{e.calls} x {op} of {e.elements} elements"
                          for (op, _), e in sorted(tp.ledger.entries.items()))
        if comm.Get_rank() == 0:
            name = type(layer).__name__
            print(f"  {name + '(W, tp)':>27} on {comm.Get_size()} ranks, {size} x {size}: "
                  f"{moved};\n  {'':>27} max |Y - by hand| = {diff:.1e} -> {verdict(diff < 1e-12)}",
                  flush=True)


def source_examples(world: MPI.Comm, full: bool) -> None:
    """Parts 1-4: the source's two column splits, the row split, then the library."""
    n, me = world.Get_size(), world.Get_rank()
    scale = ("the source's size" if full else "scaled by 1/8; --full for the source's size")
    pair = world.Split(0 if me < 2 else MPI.UNDEFINED, me)   # ranks 0 and 1: the 2 GPUs
    say(world, f"\n=== 1. the source's first example by hand: W 8192 x 8192 on 2 ranks as two "
               f"8192 x 4096 column blocks\n({scale}; on ranks 0 and 1"
               + (f", ranks 2..{n - 1} wait)" if n > 2 else ")"))
    pair_y = column_by_hand(pair, 8192, full, seed=0) if pair != MPI.COMM_NULL else None
    world.Barrier()
    say(world, f"\n=== 2. the source's second example by hand: W 4096 x 4096 on {n} ranks as "
               f"{n} column blocks of 4096 x {4096 // n}\n({scale}"
               + ("" if n == 4 else "; the source's example is 4 ranks: mpiexec -n 4") + ")")
    hand = {"column": column_by_hand(world, 4096, full, seed=1)}
    say(world, f"\n=== 3. the row split by hand: the same W on {n} ranks as {n} row blocks of "
               f"{4096 // n} x 4096, an Allreduce")
    hand["row"] = row_by_hand(world, 4096, full, seed=1)
    say(world, "\n=== 4. the library's run of the same: minipar's tensor-parallel layers on "
               "the same X and W")
    if pair != MPI.COMM_NULL:
        the_library(pair, 8192, full, 0, {"column": pair_y})
        pair.Free()
    world.Barrier()
    the_library(world, 4096, full, 1, hand)


# ---------------------------------------------- part 5: column, then row
def two_layers(tp: Group) -> None:
    """GELU(X W1 + b1) W2 + b2: column-then-column with Allgathers, or column-then-row."""
    n, k = tp.size, tp.rank
    tokens, d, f = 32, 64, 256
    banner(tp, f"5. Beyond the source: two layers, column then row (Megatron-LM): "
               f"Z = GELU(X W1 + b1) W2 + b2,\nB={tokens} d={d} f={f}, {n} ranks")
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


# ------------------------------------------- part 6: one step of the TP model
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
    if n < 2 or 512 % n:  # every rank sees the same size: all stop here, together
        raise ConfigError(f"lesson 2 splits W's 512 columns evenly over the ranks: run it on "
                          f"2 or more ranks, a count dividing 512 (got {n}): mpiexec -n 4 "
                          "python lessons/02_tensor_parallel.py")
    tp = Group(world, "tp", Ledger())  # the whole world is one tensor-parallel group
    source_examples(world, args.full)
    two_layers(tp)
    banner(tp, "6. Beyond the source: one training step of minipar's model, tp = every rank, "
               "and sequence parallelism")
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
