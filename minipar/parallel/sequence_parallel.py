"""Sequence parallelism (Korthikanti et al. 2022, `--sp`): the tensor-parallel linears'
neighbours split by rows (tensor_parallel.py holds the linears and the block).

Outside fc1..fc2 every rank of a tp group computes the same LayerNorm and residual on
all B rows. With SP each rank keeps B/tp rows there instead (the transformer: T/tp
positions, axis 1); the Allreduce after fc2 becomes a Reduce_scatter (sum, keep my
rows) and the entry of fc1 an Allgather of rows -- the same ring volume (Allreduce =
Reduce_scatter + Allgather), with the activation memory of the row-split region
divided by tp. What that needs beyond the linears' `sequence_parallel=True`:

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

from mpi4py import MPI

from minipar import placement
from minipar.comm.collectives import Group, gather_from, scatter_to
from minipar.core.autograd import Tensor
from minipar.core.nn import Module
from minipar.parallel.buckets import pack, unpack


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
