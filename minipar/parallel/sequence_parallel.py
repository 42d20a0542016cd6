"""Sequence parallelism (Korthikanti et al. 2022, `--sp`): a layer on tensor_parallel.py's
linears that splits their neighbours by rows.

Outside fc1..fc2 every rank of a tp group computes the same LayerNorm and residual on
all B rows. With SP each rank keeps B/tp rows there instead (the transformer: T/tp
positions, axis 1); the Allreduce after fc2 becomes a Reduce_scatter (sum, keep my
rows) and the entry of fc1 an Allgather of rows -- the same ring volume (Allreduce =
Reduce_scatter + Allgather), with the activation memory of the row-split region
divided by tp. It is a layer on tensor_parallel.py's plain linears, as Megatron's SP is:

    AllgatherThenColumn                the column linear entered by an Allgather of rows
                                       (positions) instead of f
    RowThenReduceScatter               the row linear's partial sums added by a
                                       Reduce_scatter instead of g
    SequenceParallelBlock, ...Attention  the tensor-parallel MLP block and attention with
                                       those two at their ends
    sequence_parallel_hooks            split the residual stream after the embedding,
                                       gather it back before the head
    allreduce_sequence_parallel_grads  parameters used on row shards (LayerNorm gamma
                                       and beta, fc2's bias) get only this rank's rows'
                                       share of their gradient: summed over tp
    ReplicatedOverTp                   a block every tp rank runs whole (the MoE FFN)
                                       between an Allgather and a split

Placements: the residual stream is Shard(0) over tp (Shard(1) for the transformer's
positions); the parameters used on it get a Partial gradient over tp, summed before
the dp sync.

Run it: `mpiexec -n 4 python -m minipar train --model gpt --tp 4 --sp --check --ledger`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from minipar import placement
from minipar.comm.collectives import Group, all_gather, gather_from, reduce_scatter, scatter_to
from minipar.core import fused_layers
from minipar.core.autograd import Tensor
from minipar.core.nn import Module, Parameter
from minipar.parallel import tensor_parallel
from minipar.parallel.buckets import pack, unpack


# ----------------------------------------------- the linears' two ends
class AllgatherThenColumn(Module):
    """Forward: Allgather along `axis`, then the column linear. Backward: the linear's,
    then Reduce_scatter of the input gradient (each rank keeps its rows' sum).

    The Allgather takes the place of f: x is this rank's block of rows (B/tp, d), or of
    positions (B, T/tp, d) on `axis` 1, and every rank's column shard needs all of them.
    Its backward sums the input gradients of every rank's shard, as f's Allreduce did,
    and keeps this rank's rows of the sum."""

    def __init__(self, linear: tensor_parallel.ColumnParallelLinear, tp: Group,
                 axis: int = 0) -> None:
        linear.entered = True   # the Allgather below is the region's entry, not f
        self.linear, self.tp, self.axis = linear, tp, axis

    def __call__(self, x: Tensor) -> Tensor:
        return self.linear(all_gather(x, self.tp, self.axis))  # my rows -> all of them


class RowThenReduceScatter(Module):
    """Forward: the row linear's partial sum, then Reduce_scatter along `axis`, then the
    bias. Backward: Allgather of the output gradient, then the linear's.

    The Reduce_scatter takes the place of g: it adds the tp shares (B, d) up, as g's
    Allreduce did, and leaves each rank its rows (B/tp, d) (positions (B, T/tp, d) on
    `axis` 1) -- the same ring volume, half the collective."""

    def __init__(self, linear: tensor_parallel.RowParallelLinear, tp: Group,
                 axis: int = 0) -> None:
        self.linear, self.tp, self.axis = linear, tp, axis

    @property
    def weight(self) -> Parameter:
        """The row linear's W[rows, :] (f/tp, d), read where the linear itself would be."""
        return self.linear.weight

    @property
    def bias(self) -> Parameter:
        """The row linear's b (d,), added once after the Reduce_scatter."""
        return self.linear.bias

    def __call__(self, x: Tensor) -> Tensor:
        # shares (B, d) summed -> my rows (B/tp, d); the transformer's (B, T/tp, d)
        y = reduce_scatter(self.linear.partial(x), self.tp, self.axis)
        return fused_layers.round_low(y) + self.linear.bias  # the bias once, after the sum


# ----------------------------------------------- the blocks built on them
class SequenceParallelBlock(tensor_parallel.TensorParallelBlock):
    """The tensor-parallel MLP block on this rank's B/tp rows (the transformer's T/tp
    positions, `axis` 1): LayerNorm and the residual on them, fc1 entered by an
    Allgather, fc2 left by a Reduce_scatter (each in both directions: forward and
    backward swap)."""

    def __init__(self, full: dict[str, np.ndarray], index: int, tp: Group,
                 ln: str = "ln", axis: int = 0) -> None:
        super().__init__(full, index, tp, ln=ln)
        self.fc1 = AllgatherThenColumn(self.fc1, tp, axis)   # my rows -> (B, d), then fc1
        self.fc2 = RowThenReduceScatter(self.fc2, tp, axis)  # fc2's shares -> my rows

    def partial_over_tp(self) -> list[Parameter]:
        """Replicated parameters whose gradient is only this rank's share: LayerNorm's
        gamma and beta and fc2's bias see B/tp rows on each rank."""
        return [self.ln.weight, self.ln.bias, self.fc2.bias]


class SequenceParallelAttention(tensor_parallel.TensorParallelAttention):
    """Attention split by heads on this rank's T/tp positions: the entry shared by q, k
    and v is an Allgather of positions (B, T/tp, d) -> (B, T, d) and proj's exit a
    Reduce_scatter back to them; LN1 and the residual hold T/tp positions per rank."""

    def __init__(self, full: dict[str, np.ndarray], index: int, heads: int, tp: Group,
                 selective: bool = False, core: Callable[..., Tensor] | None = None) -> None:
        super().__init__(full, index, heads, tp, selective=selective, core=core)
        self.proj = RowThenReduceScatter(self.proj, tp, axis=1)

    def enter(self, a: Tensor) -> Tensor:
        return all_gather(a, self.tp, 1)   # my (B, T/tp, d) -> (B, T, d); back: Reduce_scatter

    def partial_over_tp(self) -> list[Parameter]:
        """LN1's gamma and beta and proj's bias see T/tp positions here."""
        return [self.ln.weight, self.ln.bias, self.proj.bias]


class ReplicatedOverTp(Module):
    """A block every tp rank runs whole on the same input (the MoE FFN: its experts
    split over ep, not tp). Under sequence parallelism its input is my positions: an
    Allgather of them first (backward: keep my positions' gradient, each rank's copy
    of the block gives the full one) and a split back after (backward: Allgather)."""

    def __init__(self, block: Module, tp: Group) -> None:
        self.block, self.tp = block, tp

    def __call__(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        out, aux = self.block(gather_from(h, self.tp, axis=1))   # (B, T/tp, d) -> (B, T, d)
        return scatter_to(out, self.tp, axis=1), aux             # -> my (B, T/tp, d)

    @property
    def last_stats(self) -> dict:
        return getattr(self.block, "last_stats", {})


def sequence_parallel_hooks(tp: Group, axis: int = 0
                            ) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """`(enter, leave)` for `nn.Model`: split the residual stream by rows after the
    embedding, gather it back before the head.

    The embedding and head are replicated: every tp rank computes the same h0 and
    seeds the same loss. So the entry is `scatter_to` (forward split, backward
    Allgather: each rank's h0 gets the gradient of all rows, as in one process)
    and the exit `gather_from` (forward Allgather, backward split: each rank keeps
    its rows' gradient). The other pair (`all_gather` / `reduce_scatter`) would
    sum tp identical copies and make every gradient tp times too large.
    """
    def enter(h: Tensor) -> Tensor:
        return scatter_to(h, tp, axis=axis)   # keep my rows (B/tp, d); backward Allgather

    def leave(h: Tensor) -> Tensor:
        return gather_from(h, tp, axis=axis)  # my rows (B/tp, d) of every rank -> (B, d)
    return enter, leave


def allreduce_sequence_parallel_grads(chunks: Sequence[Module], tp: Group) -> None:
    """Sum over tp the gradients that sequence parallelism left split by rows.

    Call it once per step, after the backward of the last microbatch (the shares of
    all microbatches have accumulated in `.grad`) and before the data-parallel sync,
    as Megatron does. One Allreduce, all such gradients packed in one buffer:
    3 d per block (gamma, beta, fc2 bias) of this rank's chunks.
    """
    pieces = [piece for chunk in chunks
              for piece in (chunk.embed, *chunk.blocks, chunk.head) if piece is not None]
    params = [p for piece in pieces if hasattr(piece, "partial_over_tp")
              for p in piece.partial_over_tp() if p.grad is not None]
    if not params or tp.size == 1:
        return
    packed = pack(params)
    tp.Allreduce(MPI.IN_PLACE, packed, op=MPI.SUM)  # my rows' share (3 d per block) -> the sum
    placement.summed(params, tp)                    # Partial -> Replicate over tp
    unpack(params, packed, 1.0)
