"""The transformer's placement rules: attention, ring attention, the lookup and the
vocabulary-parallel loss, MoE's rows.

What this file teaches: how tensor, context and expert parallelism keep the
algebra of placement/rules.py on the ops the transformer adds, axis by axis:

    attention (one node)  q, k, v sharded alike by rows (dim 0) or by heads (the last
                          dim) -> the same; q sharded along positions (dim 1: context
                          parallelism) needs k and v whole, out of an Allgather whose
                          backward sums their gradient; a Partial is refused
    ring attention        q, k, v all Shard(1) over cp -> Shard(1): the block a rank
                          holds at each step is another rank's shard, still Shard(1)
    lookup                the ids' placement; the table's gradient partial where the ids
                          are sharded; vocabulary-parallel (the table Shard(0) over tp):
                          each rank looks up its rows -> Partial over tp
    vocabulary loss       logits Shard(-1) over tp, the row max and sums Allreduced first
                          -> a loss Replicate over tp
    MoE rows              the Alltoallv dispatch keeps row shards, refuses a Partial

Callers reach them as `placement.attention`, `placement.vocab_lookup`, ...;
docs/design.md, "Placements", states each with the strategy that needs it.
"""

from __future__ import annotations

from collections.abc import Iterable

from minipar.placement.rules import Shaped, cross_entropy, grad_partial
from minipar.placement.types import (
    REPLICATED,
    AxisGroup,
    HasPlacement,
    Partial,
    Placements,
    Replicate,
    Shard,
    axes_among,
    axis_of,
    get,
    of,
    refuse,
    shard_dim,
)


def attention(op: str, q: HasPlacement, k: HasPlacement, v: HasPlacement,
              key_bias: HasPlacement | None = None) -> Placements:
    """softmax(q k^T) v over (B, T, H dh), one node, axis by axis:

        rows (dim 0)       q, k, v sharded alike: my sequences       -> rows
        heads (dim -1)     q, k, v column-sharded alike, the key bias
                           its matching Shard(0): my whole heads     -> heads (tensor
                           parallelism; Ulysses after its Alltoall)
        positions (dim 1)  q only: every query needs every earlier key, so k and v
                           must be whole along T, out of an Allgather whose backward
                           sums their gradient (context parallelism) -> positions
        Partial            refused: softmax is not linear."""
    out: Placements = {}
    for axis in axes_among(q, k, v, *([key_bias] if key_bias is not None else [])):
        pq, pk, pv = get(q, axis), get(k, axis), get(v, axis)
        for x, p in ((q, pq), (k, pk), (v, pv)):
            if isinstance(p, Partial):
                raise refuse(op, x, axis, p, REPLICATED, " (softmax is not linear: an "
                             "Allreduce is missing)")
        dq = shard_dim(pq, q.ndim)
        if dq == -2:                                          # my positions' queries
            for x, p in ((k, pk), (v, pv)):
                if not (isinstance(p, Replicate) and p.grad_summed):
                    raise refuse(f"{op} (queries split along positions: every query "
                                 "needs every earlier key)", x, axis, p,
                                 "replicated with its gradient summed over the axis",
                                 " (an Allgather of K and V along T is missing)"
                                 if isinstance(p, Shard) else " (an Allgather is missing)")
            out[axis] = Shard(1)
            continue
        for x, p in ((k, pk), (v, pv)):
            if shard_dim(p, x.ndim) != dq or (dq is None and p != pq):
                raise refuse(f"{op} with {q.name or 'q'} ({pq} over {axis})", x, axis, p,
                             pq if not isinstance(pq, Replicate) else REPLICATED,
                             " (q, k and v must be split alike)")
        if key_bias is not None:
            needed = Shard(0) if dq == -1 else REPLICATED
            if get(key_bias, axis) != needed:
                raise refuse(f"{op} (the key bias of {'my heads' if dq == -1 else 'q'})",
                             key_bias, axis, get(key_bias, axis), needed)
        if dq is not None:
            out[axis] = Shard(dq % q.ndim)
    return out


def ring_attention(op: str, q: HasPlacement, k: HasPlacement, v: HasPlacement,
                   group: AxisGroup) -> Placements:
    """Ring attention over `group` (cp), one node: q, k and v all sharded along
    positions (dim 1) over the ring's axis. Inside the node the K, V block a rank holds
    at step s is the shard of rank r - s: still "sharded along T over cp", its owner
    rotating, and every block visits every rank once; the node's output is my
    positions' rows, Shard(1). Which rank's block is held when, and the log-sum-exp
    merge of the partial results, are values inside the node, not placements.
    Over the other axes, the rule of `attention`."""
    axis = axis_of(group)
    for x in (q, k, v):
        if shard_dim(get(x, axis), x.ndim) != -2:
            raise refuse(f"{op} over {axis}", x, axis, get(x, axis), Shard(1),
                         " (a ring passes blocks of positions)")
    others = {a: p for a, p in (("q", q), ("k", k), ("v", v))}
    out = attention(op, *(_Without(t, axis) for t in others.values()))
    out[axis] = Shard(1)
    return out


class _Without:
    """A view of a tensor's placement with one axis left out."""

    def __init__(self, t: HasPlacement, axis: str) -> None:
        self.name, self.ndim, self.shape = getattr(t, "name", ""), t.ndim, t.shape
        self.placement = {a: p for a, p in of(t).items() if a != axis}


def embedding(op: str, weight: HasPlacement, ids: HasPlacement) -> Placements:
    """Rows of a table picked by ids: the output has the ids' placement (plus a last
    dim d); the table's gradient sums over the picked rows: partial where ids are
    sharded."""
    out: Placements = {}
    for axis, p in of(ids).items():
        if not isinstance(p, Shard):
            raise refuse(op, ids, axis, p, "sharded or replicated")
        out[axis] = p
        grad_partial(weight, axis)
    return out


def vocab_lookup(op: str, weight: HasPlacement, ids: HasPlacement, tp: AxisGroup
                 ) -> Placements:
    """Rows of a table split by rows over tp (the vocabulary-parallel embedding): each
    rank looks up the ids inside its rows and gives zeros for the others, so the output
    is a Partial sum over tp (every id inside exactly one rank's rows); the ids are
    whole over tp, and over the other axes the rule of `embedding`."""
    if get(weight, axis_of(tp)) != Shard(0) and tp.size > 1:
        raise refuse(op, weight, axis_of(tp), get(weight, axis_of(tp)), Shard(0),
                     " (each rank holds its rows of the vocabulary)")
    if axis_of(tp) in of(ids):
        raise refuse(op, ids, axis_of(tp), get(ids, axis_of(tp)), REPLICATED,
                     " (every rank looks up every id in its rows)")
    out = embedding(op, weight, ids)
    if tp.size > 1:
        out[axis_of(tp)] = Partial()
    return out


def vocab_cross_entropy(op: str, logits: HasPlacement, statistics: Iterable[HasPlacement],
                        tp: AxisGroup) -> Placements:
    """The cross-entropy from logits split by columns (the vocabulary) over tp: each row
    needs three numbers about its WHOLE row (the max, the sum of exps, the target's
    logit), each a Partial (max or sum) of the ranks' pieces until an Allreduce makes
    it whole; with them the loss is the same on every rank of tp (Replicate). Over the
    other axes, the rule of `cross_entropy` (rows sharded: a Partial(avg))."""
    axis = axis_of(tp)
    if tp.size > 1 and shard_dim(get(logits, axis), logits.ndim) != -1:
        raise refuse(op, logits, axis, get(logits, axis), Shard(-1 % logits.ndim),
                     " (my columns of the vocabulary)")
    for stat in statistics:
        if not isinstance(get(stat, axis), Replicate):
            raise refuse(op, stat, axis, get(stat, axis), REPLICATED,
                         " (an Allreduce is missing)")
    return cross_entropy(op, _Without(logits, axis))


def picked_for(op: str, table: HasPlacement, rows: HasPlacement) -> Placements:
    """Rows of a replicated table picked by one id per row of `rows` (each MoE row's
    own b2): placed as `rows` are, and the table's gradient is partial wherever they
    are sharded (the rule of `embedding`, with ids placed as the rows they label)."""
    return embedding(op, table, Shaped(dict(of(rows)), getattr(rows, "name", ""),
                                        rows.ndim, rows.shape))


def rows_exchanged(op: str, x: HasPlacement, group: AxisGroup) -> Placements:
    """Alltoallv of rows (the MoE dispatch and combine): rows go to other ranks whole,
    so none may be a partial sum; the rows held stay a shard of the same tokens' rows
    (regrouped by destination), so every placement is kept."""
    for axis, p in of(x).items():
        if isinstance(p, Partial):
            raise refuse(f"{op} over {axis_of(group)}", x, axis, p, REPLICATED)
    return dict(of(x))

