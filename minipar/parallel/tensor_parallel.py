"""Tensor parallelism: one layer's weight matrix split across the ranks of a tp group.

What this file teaches (the source text's second strategy, and Megatron-LM,
Shoeybi et al. 2019). For `Y = X W`, split W by columns: rank k holds
`W[:, cols_k]` and computes `Y[:, cols_k] = X W[:, cols_k]`; an Allgather
rebuilds Y (the source: W 8192x8192 on 2 ranks as two 8192x4096 blocks). Split
W by rows instead and rank k needs only `X[:, rows_k]`; its product is a
*partial sum* of Y, and an Allreduce adds the partial sums up.

Megatron's pairing for the MLP, `GELU(u W1) W2`: fc1 by columns, fc2 by rows.
GELU is elementwise, so it runs on the column shard `u W1[:, cols_k]` as it
stands (it could not run on a partial sum: GELU(a + b) != GELU(a) + GELU(b)),
and that shard is exactly the input slice the row-split fc2 needs. Between the
two matmuls nothing moves; one Allreduce of B x d ends the block in the
forward (g = `reduce_from`), one Allreduce of B x d starts it in the backward
(f = `copy_to`, whose backward sums the input gradient of every rank's shard).

Sequence parallelism (`--sp`) is a layer on these linears, in sequence_parallel.py:
an Allgather of rows (or positions) before the column linear in place of f, a
Reduce_scatter of the row linear's partial sums in place of g, and the rest of it --
splitting the residual stream, the gradients left split by rows, an MoE block run
whole. Nothing here knows of it.

The transformer (`--model gpt`, gpt.py) is split the same way block by block:
attention by heads (`TensorParallelAttention`: the q, k, v columns and proj rows of
H/tp whole heads, one Allreduce after it), then the FFN as above, so four Allreduces
of (B, T, d) per block and microbatch. Its embedding and head are vocabulary-parallel
(vocab_parallel.py); the MLP models' stay replicated (dense inputs, C tiny).

Placements over tp (`--check-placements`): fc1's W and b Shard(1) and Shard(0), fc2's W
Shard(0), the rest Replicate; `copy_to`'s output Replicate (its gradient summed), fc1's
and GELU's Shard(1), fc2's product Partial until `reduce_from` makes it Replicate: only
then may the replicated bias and residual be added.

Run it: `mpiexec -n 4 python -m minipar train --tp 4 --check --ledger`, or the lessons
`mpiexec -n 4 python lessons/02_tensor_parallel.py`, lessons/11_transformer_tp.py (-n 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from minipar import placement
from minipar.comm.collectives import (
    Group,
    copy_to,
    gather_from,
    reduce_from,
    scatter_to,
)
from minipar.core import attention, fused_layers, gpt
from minipar.core.autograd import Tensor
from minipar.core.nn import LayerNorm, Module, Parameter
from minipar.placement import Shard


def shard(size: int, parts: int, rank: int) -> slice:
    """The contiguous slice `rank` holds when `size` is cut into `parts` equal pieces."""
    step = size // parts
    return slice(rank * step, (rank + 1) * step)


# ------------------------------------------------------------- the linears
class ColumnParallelLinear(Module):
    """y = x @ W + b with W (d, f) split by columns: rank k holds W[:, cols_k], b[cols_k].

    Input: x, the same on every rank (`copy_to` at the entry: forward identity,
    backward Allreduce, because the input gradient `g_k W[:, cols_k]^T` of each
    rank is only its shard's share).
    Output: the column shard (B, f/tp), or with `gather_output` the full (B, f)
    by an Allgather of columns (the source's form). `entered`: x is inside the region
    already (the attention's q, k and v share one entry; sequence parallelism enters by
    an Allgather of its own, sequence_parallel.py).
    """

    def __init__(self, full: dict[str, np.ndarray], name: str, tp: Group,
                 gather_output: bool = False, entered: bool = False) -> None:
        weight = full[f"{name}.weight"]
        cols = shard(weight.shape[1], tp.size, tp.rank)
        self.weight = Parameter(weight[:, cols], f"{name}.weight",
                                full_index=(slice(None), cols), sync="dp")
        self.bias = Parameter(full[f"{name}.bias"][cols], f"{name}.bias",
                              full_index=(cols,), sync="dp")
        placement.place(self.weight, tp, Shard(1))   # my columns of W (d, f)
        placement.place(self.bias, tp, Shard(0))     # and of b (f,)
        self.tp = tp
        self.gather_output = gather_output
        self.entered = entered

    def __call__(self, x: Tensor) -> Tensor:
        # exercise: column-parallel
        if not self.entered:  # else x is inside the region already (shared by q, k, v)
            x = copy_to(x, self.tp)                # f: nothing moves; backward Allreduce
        y = fused_layers.linear(x, self.weight, self.bias)   # (B, d) @ (d, f/tp) -> (B, f/tp)
        if self.gather_output:
            y = gather_from(y, self.tp, axis=-1)   # (B, f/tp) of every rank -> Y (B, f)
        return y
        # end exercise


class RowParallelLinear(Module):
    """y = x @ W + b with W (f, d) split by rows: rank k holds W[rows_k, :] and all of b.

    Input: the column shard x[:, rows_k] (B, f/tp) that a column-parallel layer
    produced, or with `input_is_parallel=False` the full x, of which this rank
    keeps its columns (backward: Allgather). Each rank's product is a partial sum
    of y; `reduce_from` (Allreduce, backward identity) adds them up, and only then
    is the bias added: once, not tp times. `partial` is the product before the sum
    (sequence parallelism sums it by a Reduce_scatter instead, sequence_parallel.py).
    """

    def __init__(self, full: dict[str, np.ndarray], name: str, tp: Group,
                 input_is_parallel: bool = True) -> None:
        weight = full[f"{name}.weight"]
        rows = shard(weight.shape[0], tp.size, tp.rank)
        self.weight = Parameter(weight[rows, :], f"{name}.weight",
                                full_index=(rows, slice(None)), sync="dp")
        self.bias = Parameter(full[f"{name}.bias"], f"{name}.bias", sync="dp")
        placement.place(self.weight, tp, Shard(0))   # my rows of W (f, d); b replicated
        self.tp = tp
        self.input_is_parallel = input_is_parallel

    def partial(self, x: Tensor) -> Tensor:
        """This rank's share of x @ W: (B, f/tp) @ (f/tp, d) -> (B, d), not yet summed."""
        # exercise: row-parallel
        if not self.input_is_parallel:
            x = scatter_to(x, self.tp, axis=-1)    # keep my columns (B, f/tp); no message
        # (--mixed: the share stays in the master dtype, summed before one rounding)
        return fused_layers.linear(x, self.weight, partial=True)
        # end exercise

    def __call__(self, x: Tensor) -> Tensor:
        # exercise: row-parallel
        y = reduce_from(self.partial(x), self.tp)  # g: shares (B, d) of every rank -> their sum
        return fused_layers.round_low(y) + self.bias  # the bias once, after the sum
        # end exercise


# ---------------------------------------------------------------- the block
class TensorParallelBlock(Module):
    """h + fc2(GELU(fc1(LN(h)))) with fc1 column-parallel and fc2 row-parallel.

    The reference `DenseBlock`, split Megatron's way. Per block and microbatch the
    tp group exchanges one Allreduce of B x d in the forward (after fc2) and one in
    the backward (before fc1), nothing else (sequence parallelism's form of it:
    sequence_parallel.SequenceParallelBlock).
    """

    def __init__(self, full: dict[str, np.ndarray], index: int, tp: Group,
                 ln: str = "ln") -> None:
        p = f"blocks.{index}"
        self.ln = LayerNorm(full, f"{p}.{ln}")     # replicated (gamma, beta of size d)
        self.fc1 = ColumnParallelLinear(full, f"{p}.fc1", tp)
        self.fc2 = RowParallelLinear(full, f"{p}.fc2", tp)

    def __call__(self, h: Tensor) -> tuple[Tensor, None]:
        u = self.ln(h)                  # (B, d) on every rank
        # f, then (B, d) @ (d, f/tp) -> (B, f/tp), GELU on the shard
        z = fused_layers.gelu(self.fc1(u))
        return h + self.fc2(z), None    # (B, f/tp) @ (f/tp, d), then g -> (B, d)


# ------------------------------------------------------- the transformer
class TensorParallelAttention(gpt.Attention):
    """h + proj(attention(LN1(h))) split by heads: rank k of tp holds heads
    k H/tp .. (k+1) H/tp - 1.

    Head h is columns h dh .. (h+1) dh of Wq, Wk, Wv and rows h dh .. (h+1) dh of Wo,
    so a contiguous column block of q, k and v (column-parallel, with their biases) and
    the matching row block of proj (row-parallel) are whole heads: attention runs on
    the H/tp local heads with no communication at all (heads never mix before proj),
    and proj's partial sums meet in ONE Allreduce of (B, T, d) (g). The three
    projections share one entry (f, `enter`): its backward is ONE Allreduce of the
    input gradient, the sum of the q, k and v shares of every rank (sequence
    parallelism's form of it: sequence_parallel.SequenceParallelAttention). Under
    context parallelism `core` is the cp strategy, run on this rank's H/tp heads of its
    T/cp positions (docs/design.md, "Context parallelism"): the sequence is split over
    cp, the heads over tp, independently."""

    def __init__(self, full: dict[str, np.ndarray], index: int, heads: int, tp: Group,
                 selective: bool = False,
                 core: Callable[..., Tensor] | None = None) -> None:
        p = f"blocks.{index}"
        # exercise: attention-heads
        self.heads = heads // tp.size                 # this rank's heads
        # end exercise
        self.selective = selective
        # local heads: the plain node, or context parallelism's exchange of my heads'
        # keys and values inside my cp group (context_parallel.py)
        self.core = attention.attention if core is None else core
        self.tp = tp
        self.ln = LayerNorm(full, f"{p}.ln1")         # replicated (gamma, beta of size d)
        # exercise: attention-heads
        # my heads' columns of q, k, v; called inside the region (`enter` was their f)
        self.q, self.k, self.v = (ColumnParallelLinear(full, f"{p}.attn.{part}", tp,
                                                       entered=True)
                                  for part in ("q", "k", "v"))
        self.proj = RowParallelLinear(full, f"{p}.attn.proj", tp)
        # end exercise

    def enter(self, a: Tensor) -> Tensor:
        # exercise: attention-heads
        return copy_to(a, self.tp)   # f, shared by q, k and v: backward ONE Allreduce
        # end exercise


def parameter_count(modules: Sequence[Module]) -> int:
    """Elements of the parameters this rank holds (for memory per rank)."""
    return sum(p.data.size for m in modules for p in m.parameters())
