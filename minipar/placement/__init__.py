"""Placements: for each mesh axis, is a tensor replicated, sharded, or a partial sum?

What this file teaches: the bugs that ship in parallel trainers pass every shape
check -- a partial sum over tp treated as the whole tensor, a shard treated as
the full tensor, a gradient nobody sums. They are *placement* errors, and
placements follow an algebra as strict as shapes do. For each mesh axis (dp, tp,
ep, ...) a tensor on a rank is one of

    Replicate()      every rank of the axis holds the same, whole values
    Shard(dim)       rank k holds the k-th equal piece along `dim`
    Partial("sum")   the true tensor is the sum of every rank's tensor
    Partial("avg")   the true tensor is the mean of every rank's tensor

(an axis not listed is Replicate), and every op has a rule:

    elementwise a + b     keeps placements; Partial + Partial stays Partial(sum), but
                          Partial(sum) + Replicate is refused: the replicated term would
                          be added once per rank (a bias added tp times)
    a * b                 linear in each side: Partial * Replicate is Partial;
                          Partial * Partial is refused ((a1+a2)(b1+b2) != a1 b1 + a2 b2)
    GELU, exp, softmax    nonlinear: refuse a Partial (GELU(a+b) != GELU(a) + GELU(b));
    LayerNorm             a normalization over a Shard dim needs the whole row
    x @ W                 x Shard(rows) @ W Replicate -> Shard(rows)     (data parallel)
                          x Replicate @ W Shard(cols) -> Shard(cols)     (column parallel)
                          x Shard(cols) @ W Shard(rows) -> Partial(sum)  (row parallel)
                          x Partial @ W Replicate -> Partial             (linear)
                          x Shard(cols) @ W Replicate, x Replicate @ W Shard(rows): refused
    sum over dim d        Shard(d) -> Partial(sum); mean over Shard(d) -> Partial(avg)
    cross-entropy         logits Shard(rows) -> a loss that is Partial(avg) over that axis
    attention (one node)  q, k, v Shard(rows) or Shard(heads) alike -> the same; q
                          Shard(positions) needs k, v whole, gathered (context parallel)
    vocabulary-parallel   lookup in my rows of the table -> Partial(sum); the loss from my
                          columns of logits needs its row max (Partial("max")) and sums
                          Allreduced -> Replicate

and every collective is a *transition* (comm/collectives.py checks each one):

    Allreduce        Partial -> Replicate        (reduce_from, sum_replicated)
    Allgather(dim)   Shard(dim) -> Replicate     (gather_from, all_gather)
    split(dim)       Replicate -> Shard(dim)     (scatter_to: no message)
    Reduce_scatter   Partial -> Shard(0)         (reduce_scatter)
    Alltoallv        Shard(0) -> Shard(0)        (rows regrouped by destination)
    Allgather(T)     Shard(1) -> Replicate       (context parallelism's K and V)
    Alltoall         Shard(1) -> Shard(2)        (Ulysses: positions -> heads, and back)
    Sendrecv ring    Shard(1) stays Shard(1)     (the ring node: blocks change owner)

Conjugates: the backward of an op moves placements the other way. A replicated x
entering a column-parallel matmul gets from it a gradient that is only this rank's
share (Partial over tp), so x must come out of an operator whose backward sums it
(copy_to: forward identity, backward Allreduce; or all_gather under sequence
parallelism). The output of such an operator is `Replicate(grad_summed=True)`.
Weights are the same story one level up: a weight replicated over dp used on
dp-sharded rows has a gradient that is Partial over dp, and the gradient sync
must sum it before the optimizer step (`summed`, `check_gradients`).

Checking is off by default and then costs nothing but one flag test per op: the
placement lives in an optional slot of `autograd.Tensor`, set only while `ON`.
A violation raises `PlacementError` with one line naming the tensor, the axis,
the placement found, the one needed, the op and the model line that called it.
Scalar factors are not tracked: Partial(avg) and Partial(sum) differ by the
known count the sync divides by; a wrong factor is a value, not a placement.
docs/design.md, "Placements", states every rule, the transformer's included.

The algebra, one idea per file (this one is what every caller imports, and it
re-exports the others' names: `placement.Shard`, `placement.linear`, ...):

    placement/types.py        Replicate, Shard, Partial; the axes a group spans; the
                              one-line refusal
    placement/rules.py        the rules of elementwise ops, x @ W, reductions, reshapes
    placement/transformer.py  attention, ring attention, the lookup and the
                              vocabulary-parallel loss, MoE's rows
    placement/__init__.py (here)       the switch (`checking`, `ON`), declaring a placement
                              (`place`, `follow`), the collectives' transitions and the
                              gradient sync (`summed`, `check_gradients`)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from minipar.placement.rules import (
    PARTIAL_GRADIENTS,
    add,
    cross_entropy,
    layer_norm,
    linear,
    matmul,
    mul,
    nonlinear,
    reduce,
    reshape,
    residual_mlp,
    same,
    transpose,
)
from minipar.placement.transformer import (
    attention,
    embedding,
    picked_for,
    ring_attention,
    rows_exchanged,
    vocab_cross_entropy,
    vocab_lookup,
)
from minipar.placement.types import (
    AXIS_SIZES,
    REPLICATED,
    AxisGroup,
    HasPlacement,
    Partial,
    Placement,
    PlacementError,
    Placements,
    Replicate,
    Shard,
    axes_of,
    axis_of,
    first_name,
    get,
    of,
    refuse,
    shard_dim,
)

__all__ = [  # the package's public face: every name a caller may take from here
    "add",
    "attention",
    "axes_of",
    "axis_of",
    "AXIS_SIZES",
    "AxisGroup",
    "check_gradients",
    "checking",
    "cross_entropy",
    "embedding",
    "first_name",
    "follow",
    "get",
    "HasPlacement",
    "layer_norm",
    "linear",
    "loss",
    "matmul",
    "mul",
    "nonlinear",
    "of",
    "ON",
    "Partial",
    "PARTIAL_GRADIENTS",
    "paused",
    "picked_for",
    "place",
    "Placement",
    "PlacementError",
    "Placements",
    "reduce",
    "refuse",
    "Replicate",
    "REPLICATED",
    "reshape",
    "residual_mlp",
    "ring_attention",
    "rows_exchanged",
    "same",
    "Shard",
    "shard_dim",
    "summed",
    "transition",
    "transpose",
    "unsummed_gradient",
    "vocab_cross_entropy",
    "vocab_lookup",
]

ON = False  # checking on? Every op tests this one flag before doing anything here


# ------------------------------------------------------------------ switch
@contextlib.contextmanager
def checking(enabled: bool = True, sizes: dict[str, int] | None = None) -> Iterator[None]:
    """Inside this block (if `enabled`) every op propagates and checks placements.
    `sizes`: each mesh axis's size (what a group spanning two axes needs to know)."""
    global ON
    previous, ON = ON, enabled
    previous_sizes = dict(AXIS_SIZES)
    AXIS_SIZES.clear()
    AXIS_SIZES.update(sizes or {})
    _SUMMED.clear()
    PARTIAL_GRADIENTS.clear()
    try:
        yield
    finally:
        ON = previous
        AXIS_SIZES.clear()
        AXIS_SIZES.update(previous_sizes)
        _SUMMED.clear()
        PARTIAL_GRADIENTS.clear()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Inside this block nothing is checked nor recorded, and what was recorded stays:
    the replay of a recomputed forward (recompute.py), whose placements are those the
    forward already derived and checked -- the same ops on the same placements."""
    global ON
    previous, ON = ON, False
    try:
        yield
    finally:
        ON = previous


# ------------------------------------------------------------- declaring
def place(t: object, group: AxisGroup, p: Placement) -> object:
    """Declare `t`'s placement over `group`'s axis (a parameter's shard, the data's
    rows). Nothing is recorded on a group of one (every tensor is whole there) or
    while checking is off. Returns `t`."""
    if ON:
        follow(t, {**of(t), **{axis: p for axis in axes_of(group)}}, summed=True)
    return t


def follow(out: object, placements: Placements, name: str = "", summed: bool = False
           ) -> object:
    """Give an op's output its placements (and a name, for the messages). Shard dims
    are stored counted from the front of the output. `Replicate(grad_summed=True)`
    belongs to the output of the operator that sums the gradient (`summed=True`): an
    op's output is plainly replicated (its other inputs' gradients are not summed)."""
    out.placement = {a: Shard(p.dim % out.ndim) if isinstance(p, Shard) else p
                     for a, p in placements.items()
                     if not isinstance(p, Replicate) or (summed and p.grad_summed)}
    if name and not out.name:
        out.name = name
    return out


# --------------------------------------------------------- gradient sync
def loss(op: str, t: HasPlacement, dp: AxisGroup) -> None:
    """The step's loss: what the gradient sync expects. Over dp (and cp: the sync runs
    over dp x cp, `dp` is then that group) it may be the mean of the ranks' losses
    (the sync averages the gradients); over any other axis it must be whole: a rank
    would otherwise seed only its share of the gradient."""
    averaged = axes_of(dp) or (axis_of(dp),)
    for axis, p in of(t).items():
        if axis in averaged and p == Partial("avg"):
            continue
        raise refuse(op, t, axis, p, REPLICATED if axis not in averaged else Partial("avg"))


# ------------------------------------------------------------ collectives
def transition(op: str, x: HasPlacement, group: AxisGroup, needed: type | Placement,
               result: Placement, out: object) -> object:
    """A collective's rule: `x` must be `needed` over the group's axis (a class: any
    placement of that kind; an instance: exactly it), and `out` becomes `result`
    there, keeping its other axes (copied unchanged)."""
    for axis in axes_of(group):   # one axis, or dp and cp for the dp_cp group
        found = get(x, axis)
        ok = isinstance(found, needed) if isinstance(needed, type) else \
            (found == needed or (isinstance(found, Shard) and isinstance(needed, Shard)
                                 and shard_dim(found, x.ndim) == shard_dim(needed, x.ndim)))
        if not ok:
            shown = {Replicate: REPLICATED, Partial: Partial(), Shard: "sharded"}.get(
                needed, needed)
            raise refuse(op, x, axis, found, shown)
    return follow(out, {**of(x), **{axis: result for axis in axes_of(group)}}, x.name,
                  summed=True)


_SUMMED: dict[int, set[str]] = {}  # param id -> axes its gradient was summed over


def summed(params: Iterable[object], group: AxisGroup) -> None:
    """The gradient sync states what it did: these gradients were summed over `group`
    (Partial -> Replicate over its axis, before the optimizer step)."""
    if ON:
        for p in params:
            for axis in axes_of(group):   # dp_cp: both dp and cp
                if not isinstance(get(p, axis), Replicate):
                    raise refuse(f"the gradient sum over {axis}", p, axis, get(p, axis),
                                 REPLICATED, " (summing gradients of different pieces "
                                 "would mix them)")
                _SUMMED.setdefault(id(p), set()).add(axis)


def check_gradients(sizes: dict[str, int]) -> None:
    """Raise the `unsummed_gradient` line, if any (one process; on a mesh, train.py
    agrees on it over every rank first, so all of them stop at the same step)."""
    problem = unsummed_gradient(sizes)
    if problem:
        raise PlacementError(problem)


def unsummed_gradient(sizes: dict[str, int]) -> str | None:
    """After the sync: every parameter whose gradient the forward made a partial sum
    over some axis (a replicated weight used on sharded rows) must have been summed
    over it. Over dp, a parameter is summed on its replicas' group (`p.sync`: "dp",
    or "edp" for an expert weight, whose other dp ranks hold other experts); `sizes`
    gives each group's size (nothing to sum on a group of one). Returns the line
    naming the first such gradient left partial, or None; clears the record."""
    try:
        for key, (p, axes) in sorted(PARTIAL_GRADIENTS.items(), key=lambda kv: kv[1][0].name):
            for axis in sorted(axes):
                group = (p.sync or axis) if axis == "dp" else axis
                if sizes.get(group, 1) > 1 and group not in _SUMMED.get(key, set()):
                    return (f"{p.name}'s gradient is a partial sum over {group} (it was used "
                            f"on rows sharded over {axis}); the optimizer step needs it "
                            f"summed (an Allreduce over {group} is missing)")
        return None
    finally:
        PARTIAL_GRADIENTS.clear()
        _SUMMED.clear()
