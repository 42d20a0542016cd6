"""The vocabulary split over tp: the token embedding by rows, the head by columns, the loss.

What this file teaches (Megatron-LM, Shoeybi et al. 2019, section 3). The two largest
arrays of a language model are V x d: the token embedding and the head. Rank k of the
tp group holds vocabulary rows `k V/tp .. (k+1) V/tp - 1` of both.

Embedding: an id outside my rows looks up nothing (zeros); every id is inside exactly
one rank's rows, so the Allreduce (`reduce_from`) of the partial embeddings (B, T, d)
is tok[x] exactly. Under sequence parallelism that sum is a Reduce_scatter along T:
each rank keeps its positions. The position embedding is small and replicated.

Head and loss: logits = LN_f(h) Wh + bh with Wh (d, V) split by columns gives each rank
the logits of its V/tp tokens, (B, T, V/tp). The cross-entropy of a row needs three
numbers about the WHOLE row, and each is a reduction of the pieces:

    m = max_v z_v           Allreduce(MAX) of my rows' maxima          (B T numbers)
    s = sum_v exp(z_v - m)  Allreduce(SUM) of my sums,  together with
    t = z_y - m             Allreduce(SUM) of the target's shifted logit (0 if y is not mine)
    loss_row = log s - t

so one Allreduce of B T and one of 2 B T replace an Allgather of B T V: the full
logits are never formed on any rank. Backward, on my columns alone:
d z_v = (exp(z_v - m) / s - [v == y]) / N, no communication; the head's input
gradient is a partial sum over the vocabulary, which the region's entry f sums
(its backward Allreduce), as for any column-parallel linear.

Placements over tp (placement/__init__.py, `--check-placements`): tok is Shard(0), the lookup
a Partial sum until its Allreduce (or Reduce_scatter along T); Wh and bh are Shard(1)
and Shard(0), the logits Shard(2); the row max is a Partial("max") and the sums a
Partial sum until `allreduce_statistic`, and the loss is Replicate over tp.

`--no-vocab-parallel` keeps gpt.py's replicated embedding and head on every tp rank.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minipar import placement
from minipar.comm.collectives import Group, all_gather, reduce_from, reduce_scatter
from minipar.core import attention, fused_layers, precision
from minipar.core.autograd import Tensor
from minipar.core.documents import IGNORE
from minipar.core.nn import LayerNorm, Module, Parameter
from minipar.parallel import tensor_parallel
from minipar.parallel.tensor_parallel import shard
from minipar.placement import Partial, Replicate, Shard


def vocab_lookup(weight: Tensor, ids: Tensor | np.ndarray, first: int,
                 tp: Group | None = None) -> Tensor:
    """Rows of `weight` (V/tp, d), holding ids first .. first + V/tp - 1, for `ids` of
    any shape; an id outside them gives a zero row. Backward: the gradients of my ids'
    positions are summed into their rows (sorted ids, one `np.add.reduceat`, as
    attention.embedding), the others dropped. Ids given as a Tensor get zeros, as in
    attention.embedding (the piece hooks watch for them). Placement over `tp`: a
    Partial sum (placement.vocab_lookup)."""
    given = ids if isinstance(ids, Tensor) else None
    ids = np.asarray(given.data if given is not None else ids)
    local = ids - first
    mine = (local >= 0) & (local < weight.shape[0])
    out = weight.data[np.where(mine, local, 0)]                 # ids.shape + (d,)
    out[~mine] = 0.0

    def backward(g: np.ndarray) -> None:
        # my positions' gradients (n, d) summed into their rows (n,)
        # (--mixed: summed in the master dtype, rounded once)
        weight.accumulate(precision.round_low(attention.rows_summed_by_id(
            precision.upcast(g[mine]), local[mine], precision.upcast(weight.data))),
            fresh=True)
        if given is not None:
            given.accumulate(np.zeros(ids.shape, dtype=given.dtype), fresh=True)
    parents = (weight,) if given is None else (weight, given)
    result = Tensor.from_op(out, parents, backward)
    if placement.ON and tp is not None:   # my rows' lookups, zeros elsewhere: Partial
        placement.follow(result, placement.vocab_lookup(
            f"the lookup in {weight.name}", weight, given if given is not None
            else Tensor(ids), tp), "tok_embed output")
    return result


def allreduce_statistic(stat: Tensor, tp: Group, op: MPI.Op) -> Tensor:
    """Allreduce a row statistic of the loss in place over tp (MAX or SUM): a Partial
    (max or sum) of my columns' numbers -> the whole row's, Replicate."""
    tp.Allreduce(MPI.IN_PLACE, stat.data, op=op)               # (.., N) mine -> the row's
    if placement.ON:
        placement.transition(f"the Allreduce of {stat.name}", stat, tp,
                             Partial("max" if op == MPI.MAX else "sum"), Replicate(), stat)
    return stat


def _statistic(values: np.ndarray, name: str, tp: Group, op: str) -> Tensor:
    """A row statistic of my columns as a named constant: Partial(`op`) over tp."""
    stat = Tensor(values, name=name)
    return placement.place(stat, tp, Partial(op)) if placement.ON else stat


def parallel_cross_entropy(logits: Tensor, labels: np.ndarray, first: int, tp: Group,
                           scale: float | None = None) -> Tensor:
    """sum over rows of CE(full row, y) * scale (default 1/N), from my columns
    `first .. first + V/tp - 1` of the logits (..., V/tp): the same number on every rank
    of tp. Forward: Allreduce(MAX) of the row maxima, one Allreduce(SUM) of the sums of
    exps and target logits packed together. Backward: (softmax - onehot) on my columns."""
    # (--mixed: the loss and its statistics in the master dtype on upcast logits)
    flat = precision.upcast(logits.data).reshape(-1, logits.shape[-1])   # (N, V/tp)
    labels = np.asarray(labels).reshape(-1)
    rows = np.arange(flat.shape[0])
    scale = 1.0 / flat.shape[0] if scale is None else scale
    row_max = _statistic(flat.max(axis=-1), "the row maxima of the logits", tp, "max")
    allreduce_statistic(row_max, tp, MPI.MAX)                  # (N,) my maxima -> the max
    shifted = flat - row_max.data[:, None]
    e = np.exp(shifted)
    local = labels - first
    mine = (local >= 0) & (local < flat.shape[1])
    stats = _statistic(np.stack([e.sum(axis=-1),               # (2, N): my sums of exps,
                                 np.where(mine, shifted[rows, np.where(mine, local, 0)],
                                          0.0)]),
                       "the sums of exps and target logits", tp, "sum")
    allreduce_statistic(stats, tp, MPI.SUM)                    # and target logits -> totals
    total, target = stats.data
    valid = labels != IGNORE   # --documents: padded positions add 0 (documents.py)
    out = np.asarray((np.log(total[valid]) - target[valid]).sum() * scale)

    def backward(g: np.ndarray) -> None:
        d = e / total[:, None]
        d[rows[mine], local[mine]] -= 1.0
        d[~valid] = 0.0
        logits.accumulate(precision.round_low((d * (g * scale)).reshape(logits.shape)),
                          fresh=True)
    result = Tensor.from_op(out, (logits,), backward)
    if placement.ON:  # my columns in, whole statistics: the same loss on every tp rank
        placement.follow(result, placement.vocab_cross_entropy(
            "the vocabulary-parallel cross-entropy", logits, (row_max, stats), tp), "the loss")
    return result


class VocabParallelEmbedding(Module):
    """h0 = tok[x] + pos[positions] with my V/tp rows of tok: zeros for the other ids,
    then the Allreduce of (B, T, d), or with `sequence_parallel` a Reduce_scatter that
    leaves my T/tp positions (B, T/tp, d), to which their position rows are added.

    `positions` are the global positions of the T columns this rank holds (context
    parallelism: its T/cp of every sequence; under SP each tp rank then keeps T/(cp tp)
    of those, a contiguous run of them in the order they are stored); `positions_over`
    the group they are one shard of (cp: placement checking needs to know)."""

    def __init__(self, full: dict[str, np.ndarray], tp: Group,
                 sequence_parallel: bool = False, positions: np.ndarray | None = None,
                 positions_over: Group | None = None) -> None:
        rows = shard(full["tok_embed.weight"].shape[0], tp.size, tp.rank)
        self.tok = Parameter(full["tok_embed.weight"][rows], "tok_embed.weight",
                             full_index=(rows, slice(None)))
        placement.place(self.tok, tp, Shard(0))                 # my rows of the vocabulary
        self.pos = Parameter(full["pos_embed.weight"], "pos_embed.weight")
        self.first = rows.start
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.positions, self.positions_over = positions, positions_over

    def __call__(self, x: Tensor, positions: np.ndarray | None = None) -> Tensor:
        positions = self.positions if positions is None else positions
        positions = np.arange(x.shape[1]) if positions is None else positions
        partial = vocab_lookup(self.tok, x, self.first, self.tp)  # (B, T, d), 0 if not mine
        if self.sequence_parallel:
            mine = positions[shard(len(positions), self.tp.size, self.tp.rank)]
            h = reduce_scatter(partial, self.tp, axis=1)       # sum, keep my (B, T/tp, d)
            return h + attention.embedding(self.pos, self._placed(mine))
        return reduce_from(partial, self.tp) + attention.embedding(self.pos,
                                                                   self._placed(positions))

    def _placed(self, ids: np.ndarray) -> np.ndarray | Tensor:
        """Position ids as placement checking sees them: one shard over cp, and under SP
        over tp (a Tensor with those placements; the array itself when checking is off)."""
        if not placement.ON:
            return ids
        out = Tensor(ids)
        if self.positions_over is not None:
            placement.place(out, self.positions_over, Shard(0))
        return placement.place(out, self.tp, Shard(0)) if self.sequence_parallel else out

    def partial_over_tp(self) -> list[Parameter]:
        """Under SP each rank adds the position rows of its T/tp positions only."""
        return [self.pos] if self.sequence_parallel else []


class VocabParallelHead(Module):
    """My V/tp columns of logits = LN_f(h) Wh + bh, (B, T, V/tp); `loss` is the parallel
    cross-entropy on them. LN_f is replicated (under SP: on my positions, then the
    Allgather along T that enters the column-parallel head)."""

    def __init__(self, full: dict[str, np.ndarray], tp: Group,
                 sequence_parallel: bool = False) -> None:
        self.ln_f = LayerNorm(full, "ln_f")
        cols = shard(full["head.weight"].shape[1], tp.size, tp.rank)
        self.weight = Parameter(full["head.weight"][:, cols], "head.weight",
                                full_index=(slice(None), cols))
        self.bias = Parameter(full["head.bias"][cols], "head.bias", full_index=(cols,))
        placement.place(self.weight, tp, Shard(1))              # my columns of Wh (d, V)
        placement.place(self.bias, tp, Shard(0))                # and of bh (V,)
        self.first = cols.start
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def __call__(self, h: Tensor) -> Tensor:
        u = self.ln_f(h)
        if self.sequence_parallel:
            # my (B, T/tp, d) -> (B, T, d); backward: Reduce_scatter
            u = all_gather(u, self.tp, axis=1)
        else:  # f; looked up at call time: --inject-bug swaps tensor_parallel's copy_to
            u = tensor_parallel.copy_to(u, self.tp)
        return fused_layers.linear(u, self.weight, self.bias)         # (B, T, d) @ (d, V/tp)

    def loss(self, logits: Tensor, labels: np.ndarray) -> Tensor:
        """Mean over the B*T positions of CE(logits, y), from my vocabulary columns."""
        return parallel_cross_entropy(logits, labels, self.first, self.tp)

    def partial_over_tp(self) -> list[Parameter]:
        """Under SP, LN_f's gamma and beta see my T/tp positions only."""
        return [self.ln_f.weight, self.ln_f.bias] if self.sequence_parallel else []
