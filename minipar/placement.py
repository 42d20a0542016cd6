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

and every collective is a *transition* (comm.py checks each one):

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
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

ON = False  # checking on? Every op tests this one flag before doing anything here


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the same whole values. `grad_summed`: the tensor
    came out of an operator whose backward sums its gradient over the axis (copy_to)."""

    grad_summed: bool = False

    def __str__(self) -> str:
        return "replicated"


@dataclass(frozen=True)
class Shard:
    """Rank k of the axis holds the k-th equal piece along `dim` (negative: from the end)."""

    dim: int

    def __str__(self) -> str:
        return f"sharded along dim {self.dim}"


@dataclass(frozen=True)
class Partial:
    """The true tensor is the sum (or mean, `op="avg"`; or max, `op="max"`: a row
    statistic) of every rank's tensor."""

    op: str = "sum"

    def __str__(self) -> str:
        return {"sum": "a partial sum", "avg": "a partial average"}.get(self.op,
                                                                        f"a partial {self.op}")


Placement = Replicate | Shard | Partial
Placements = dict[str, Placement]        # axis name -> placement; absent = Replicate
REPLICATED = Replicate()


class PlacementError(ValueError):
    """A tensor's placement is not the one the op needs: the line says which and where."""


class HasPlacement(Protocol):
    """What the rules read of a tensor: its name, its number of dims, its shape."""

    name: str
    ndim: int
    shape: tuple[int, ...]


class AxisGroup(Protocol):
    """What the rules read of a communicator: the axis it spans and its size."""

    name: str
    size: int


# The communicators that span two mesh axes at once: the gradient sync of context
# parallelism sums over dp x cp (mesh.py's dp_cp and edp_cp, which the ledger names "dp"
# and "edp": they are told from the plain groups by their size, dp cp). With cp = 1
# the mesh hands out the dp group itself, and an axis of size 1 records nothing.
_COMPOUND = {"dp_cp": ("dp", "cp"), "edp_cp": ("edp", "cp")}
_SIZES: dict[str, int] = {}   # axis -> size, set by `checking` (unknown: taken as > 1)


def axes_of(group: AxisGroup) -> tuple[str, ...]:
    """The mesh axes a group spans (one, or dp and cp for dp_cp) of size > 1."""
    cp = _SIZES.get("cp", 1)
    if group.name in ("dp", "edp") and cp > 1 and group.size == _SIZES.get(group.name, 1) * cp:
        return tuple(a for a in (group.name, "cp") if _SIZES.get(a, 1) > 1)
    if group.name not in _COMPOUND:
        return (group.name,) if group.size > 1 else ()
    return tuple(a for a in _COMPOUND[group.name] if _SIZES.get(a, 2) > 1)


def axis_of(group: AxisGroup) -> str:
    """The mesh axis a group spans, by which placements are recorded (the first one of
    a group spanning two)."""
    axes = axes_of(group)
    return axes[0] if axes else _COMPOUND.get(group.name, (group.name,))[0]


# ------------------------------------------------------------------ switch
@contextlib.contextmanager
def checking(enabled: bool = True, sizes: dict[str, int] | None = None) -> Iterator[None]:
    """Inside this block (if `enabled`) every op propagates and checks placements.
    `sizes`: each mesh axis's size (what a group spanning two axes needs to know)."""
    global ON
    previous, ON = ON, enabled
    previous_sizes = dict(_SIZES)
    _SIZES.clear()
    _SIZES.update(sizes or {})
    _SUMMED.clear()
    _PARTIAL_GRADS.clear()
    try:
        yield
    finally:
        ON = previous
        _SIZES.clear()
        _SIZES.update(previous_sizes)
        _SUMMED.clear()
        _PARTIAL_GRADS.clear()


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


def of(t: object) -> Placements:
    """The placements of `t` (a Tensor; plain arrays and numbers are replicated)."""
    return getattr(t, "placement", None) or {}


def get(t: object, axis: str) -> Placement:
    """The placement of `t` over one axis."""
    return of(t).get(axis, REPLICATED)


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


# --------------------------------------------------------------- messages
_INTERNAL = ("placement.py", "autograd.py", "fused.py", "comm.py", "attention.py")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _caller() -> str:
    """file:line of the model code that called the op (the first frame outside the
    files that implement ops and collectives)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _HERE \
            and os.path.basename(frame.f_code.co_filename) in _INTERNAL:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    short = path[path.rfind("minipar"):] if "minipar" in path else path
    return f"{short}:{frame.f_lineno}"


_FIX = {(Partial, Replicate): " (an Allreduce is missing)",
        (Shard, Replicate): " (an Allgather is missing)",
        (Replicate, Partial): " (it is already whole: summing it would count it once per rank)",
        (Replicate, Shard): " (a split is missing)",
        (Partial, Shard): " (a Reduce_scatter is missing)"}


def refuse(op: str, t: HasPlacement, axis: str, found: Placement, needed: Placement | str,
           why: str = "") -> PlacementError:
    """The error of one violation, as one line: which tensor is what over which axis,
    what the op needs, why, and where the op was called."""
    label = t.name or "a tensor"
    if not why and not isinstance(needed, str):
        why = _FIX.get((type(found), type(needed)), "")
    return PlacementError(f"{label} is {found} over {axis}; {op} needs it {needed}{why} "
                          f"[at {_caller()}]")


def _dim(p: Placement, ndim: int) -> int | None:
    """The sharded dim of `p` counted from the end (-1 = last), or None."""
    return (p.dim - ndim if p.dim >= 0 else p.dim) if isinstance(p, Shard) else None


def _axes(*tensors: object) -> list[str]:
    return sorted({a for t in tensors for a in of(t)})


def _pname(*tensors: object) -> str:
    return next((t.name for t in tensors if getattr(t, "name", "")), "")


# ------------------------------------------------------------ elementwise
def _broadcasts(t: HasPlacement, dim_from_end: int) -> bool:
    """Does `t` broadcast along that dim (missing there, or of size 1)?"""
    return -dim_from_end > t.ndim or t.shape[dim_from_end] == 1


def _grad_partial(t: object, axis: str) -> None:
    """A replicated operand meets rows sharded over `axis`: its gradient is a partial
    sum over `axis`, and so is that of every replicated tensor it was computed from, up
    to the parameters (recorded: the sync must sum them) or to an operator whose
    backward sums it (`grad_summed`)."""
    stack, seen = [getattr(t, "t", t)], set()  # through an `_Only` view
    while stack:  # (a node has parents only if it needs a gradient, or under no_grad in
        node = stack.pop()   # the forward of a recomputed block: the replay will need it)
        if id(node) in seen:
            continue
        seen.add(id(node))
        p = get(node, axis)
        if not isinstance(p, Replicate) or p.grad_summed:
            continue
        if hasattr(node, "sync"):  # a Parameter
            if getattr(node, "requires_grad", False):
                _PARTIAL_GRADS.setdefault(id(node), (node, set()))[1].add(axis)
        else:
            stack.extend(getattr(node, "parents", ()))


def add(op: str, a: HasPlacement, b: HasPlacement) -> Placements:
    """a + b (and a - b). Same placement on both sides stays; a replicated term that
    broadcasts along the other side's shard dim is fine (a bias on rows); Partial(avg)
    + Replicate is fine (the mean of a_k + c is mean(a_k) + c); anything else is refused.
    """
    out: Placements = {}
    for axis in _axes(a, b):
        pa, pb = get(a, axis), get(b, axis)
        if isinstance(pa, Replicate) and isinstance(pb, Replicate):
            continue
        if isinstance(pa, Shard) and isinstance(pb, Shard) \
                and _dim(pa, a.ndim) == _dim(pb, b.ndim):   # dims aligned from the end
            out[axis] = Shard(_dim(pa, a.ndim))
            continue
        if pa == pb and not isinstance(pa, Shard):
            out[axis] = pa
            continue
        for (x, px), (y, py) in (((a, pa), (b, pb)), ((b, pb), (a, pa))):
            if isinstance(px, Partial) and isinstance(py, Replicate):
                if px.op == "avg":
                    out[axis] = px
                    break
                raise refuse(f"{op} with {y.name or 'a replicated term'}", x, axis, px,
                             REPLICATED)
            if isinstance(px, Shard) and isinstance(py, Replicate):
                if _broadcasts(y, _dim(px, x.ndim)):
                    out[axis] = Shard(_dim(px, x.ndim))   # counted from the end
                    _grad_partial(y, axis)
                    break
                raise refuse(f"{op} with {y.name or 'a whole tensor'} (whole along "
                             f"dim {px.dim})", x, axis, px, REPLICATED)
        else:  # blame a partial sum first: it is the tensor missing its Allreduce
            x, px, y, py = (b, pb, a, pa) if pb == Partial() else (a, pa, b, pb)
            raise refuse(f"{op} with {y.name or 'a tensor'} ({py} over {axis})", x, axis,
                         px, REPLICATED if px == Partial() else py)
    return out


def mul(op: str, a: HasPlacement, b: HasPlacement, divide: bool = False) -> Placements:
    """a * b (or a / b with `divide`): linear in each factor, so one Partial factor
    times a replicated one stays Partial; two Partial factors are refused, and so is a
    Partial divisor (1/(a1+a2) != 1/a1 + 1/a2). Shards combine as in `add`."""
    out: Placements = {}
    for axis in _axes(a, b):
        pa, pb = get(a, axis), get(b, axis)
        if isinstance(pa, Partial) and isinstance(pb, Partial):
            raise refuse(f"{op} by {b.name or 'another partial sum'} (also partial)",
                         a, axis, pa, REPLICATED, " (a product of two partial sums is not "
                         "a partial sum: an Allreduce is missing)")
        if divide and isinstance(pb, Partial):
            raise refuse(f"{op} of {a.name or 'a tensor'} (as divisor)", b, axis, pb,
                         REPLICATED)
        partial = pa if isinstance(pa, Partial) else pb if isinstance(pb, Partial) else None
        if partial is not None:
            other = b if partial is pa else a
            if isinstance(get(other, axis), Shard):
                raise refuse(op, other, axis, get(other, axis), REPLICATED,
                             " (a shard times a partial sum)")
            out[axis] = partial
            continue
        out.update(add(op, _Only(a, axis), _Only(b, axis)))
    return out


class _Only:
    """A view of a tensor's placement over one axis (for reusing a rule per axis)."""

    def __init__(self, t: HasPlacement, axis: str) -> None:
        self.name, self.ndim, self.shape = getattr(t, "name", ""), t.ndim, t.shape
        self.placement = {axis: get(t, axis)} if axis in of(t) else {}
        self.sync = getattr(t, "sync", False)
        self.requires_grad = getattr(t, "requires_grad", False)
        self.t = t

    def __hash__(self) -> int:
        return id(self.t)


def nonlinear(op: str, x: HasPlacement, over: int | None = None) -> Placements:
    """A nonlinear op (GELU, exp, tanh, log, sqrt) keeps Shards and refuses Partial;
    with `over` (softmax, LayerNorm: a normalization along that dim) a Shard of that
    dim is refused too: each row must be whole."""
    out: Placements = {}
    for axis, p in of(x).items():
        if isinstance(p, Partial):
            raise refuse(op, x, axis, p, REPLICATED, f" ({op} is not linear: "
                         "an Allreduce is missing)")
        if over is not None and isinstance(p, Shard) and \
                _dim(p, x.ndim) == (over - x.ndim if over >= 0 else over):
            raise refuse(f"{op} (along dim {over})", x, axis, p, REPLICATED,
                         " (it needs whole rows: an Allgather is missing)")
        out[axis] = p
    return out


def layer_norm(op: str, x: HasPlacement, gamma: HasPlacement, beta: HasPlacement
               ) -> Placements:
    """LayerNorm normalizes along the last dim: x must hold whole rows; its gain and
    bias get a partial gradient over any axis that shards x's rows."""
    out = nonlinear(op, x, over=-1)
    for axis, p in out.items():
        if isinstance(p, Shard):
            _grad_partial(gamma, axis)
            _grad_partial(beta, axis)
    return out


# ----------------------------------------------------------- linear algebra
def matmul(op: str, x: HasPlacement, w: HasPlacement) -> Placements:
    """x @ W with x (..., k), W (k, n): the placement rules of data, column and row
    parallelism (module docstring). Output (..., n)."""
    out: Placements = {}
    for axis in _axes(x, w):
        px, pw = get(x, axis), get(w, axis)
        dx, dw = _dim(px, x.ndim), _dim(pw, w.ndim)
        if isinstance(px, Replicate) and isinstance(pw, Replicate):
            continue
        if isinstance(px, Shard) and dx != -1 and isinstance(pw, Replicate):
            out[axis] = Shard(dx)                  # my rows times the whole W: my rows
            _grad_partial(w, axis)                 # dW = x^T g sums over my rows only
        elif isinstance(px, Replicate) and dw == -1:
            if not px.grad_summed:
                raise refuse(f"{op} (W sharded by columns: its input gradient is only "
                             "this rank's share)", x, axis, px, "replicated with its "
                             "gradient summed over the axis", " (a copy_to is missing)")
            out[axis] = Shard(-1)                  # x times my columns: my columns
        elif dx == -1 and dw == -2:
            out[axis] = Partial()                  # my columns of x times my rows of W
        elif isinstance(px, Partial) and isinstance(pw, Replicate):
            out[axis] = px                         # (x1 + x2) W = x1 W + x2 W
        elif isinstance(px, Replicate) and isinstance(pw, Partial):
            out[axis] = pw
        elif dx == -1:
            raise refuse(f"{op} (x is split along the contraction, {w.name or 'W'} is "
                         f"{pw})", x, axis, px, REPLICATED,
                         " (W must be sharded by rows, or x gathered)")
        elif dw == -2:
            raise refuse(f"{op} with {w.name or 'W'} sharded by rows", x, axis, px,
                         Shard(-1), " (x must be its matching column shard: a split "
                         "is missing)")
        else:
            raise refuse(f"{op} with {w.name or 'W'} ({pw} over {axis})", x, axis, px,
                         REPLICATED)
    return out


def linear(op: str, x: HasPlacement, w: HasPlacement, bias: HasPlacement | None
           ) -> Placements:
    """x @ W + b: `matmul`, then the bias add's rule (a partial sum plus a replicated
    bias is refused: the bias would count once per rank)."""
    out = matmul(op, x, w)
    if bias is None:
        return out
    product = _Shaped(out, op.replace(" linear", "") + " product",
                      x.ndim, (*x.shape[:-1], w.shape[-1]))
    return add(f"{op}: the bias add", product, bias)


class _Shaped:
    """Placements with a name and a shape: an intermediate result no op returns."""

    def __init__(self, placement: Placements, name: str, ndim: int,
                 shape: tuple[int, ...]) -> None:
        self.placement, self.name, self.ndim, self.shape = placement, name, ndim, shape


# ------------------------------------------------------------- reductions
def reduce(op: str, x: HasPlacement, axis: int | tuple[int, ...] | None, keepdims: bool,
           mean: bool = False) -> Placements:
    """Sum (or mean) over dims: a Shard of a reduced dim becomes Partial(sum) (Partial
    avg for a mean of equal shards); a Shard of a kept dim moves to its new index."""
    dims = range(x.ndim) if axis is None else [a % x.ndim for a in
                                               ((axis,) if isinstance(axis, int) else axis)]
    out: Placements = {}
    for mesh_axis, p in of(x).items():
        if not isinstance(p, Shard):
            out[mesh_axis] = p
            continue
        d = p.dim % x.ndim
        if d in dims:
            out[mesh_axis] = Partial("avg" if mean else "sum")
        else:
            out[mesh_axis] = Shard(d if keepdims else d - sum(1 for r in dims if r < d))
    return out


def cross_entropy(op: str, logits: HasPlacement) -> Placements:
    """The mean CE over rows: each row needs its whole row of logits; rows sharded over
    an axis give a loss that is the mean of every rank's loss there: Partial(avg)."""
    out: Placements = {}
    for axis, p in nonlinear(op, logits, over=-1).items():
        out[axis] = Partial("avg") if isinstance(p, Shard) else p
    return out


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


# ----------------------------------------------------------------- shapes
def reshape(op: str, x: HasPlacement, shape: tuple[int, ...],
            tokens: bool = False, like: HasPlacement | None = None) -> Placements:
    """A Shard follows its dim through a reshape when that dim stays the outermost of
    the dims it is merged with (B, T) -> (B T), or is kept; otherwise refused.

    Two exceptions name what the caller means. `tokens=True`: rows and positions (B, T)
    become tokens (B T) for a position-wise op (the MoE FFN), so a shard of positions
    (context parallelism) becomes a shard of tokens in a strided layout, which no
    collective gathers back (capacity orders them by `context_parallel.TokenLayout`).
    `like`: the reshape back to `like`'s shape, tokens -> (B, T): each shard of the
    tokens is `like`'s shard again."""
    out: Placements = {}
    for axis, p in of(x).items():
        if not isinstance(p, Shard):
            out[axis] = p
            continue
        d = p.dim % x.ndim
        if like is not None and isinstance(get(like, axis), Shard) and d == 0 \
                and tuple(shape) == tuple(like.shape):
            out[axis] = Shard(get(like, axis).dim % like.ndim)
            continue
        before = _prod(x.shape[:d])
        new = [j for j in range(len(shape) + 1) if _prod(shape[:j]) == before]
        if tokens and (not new or new[0] >= len(shape)) and len(shape) < x.ndim:
            new = [0]                # positions merged into the token dim
        if not new or new[0] >= len(shape):
            raise refuse(f"{op} to {shape}", x, axis, p, "sharded along a dim the "
                         "reshape keeps outermost")
        out[axis] = Shard(new[0])   # the outermost: size-1 dims before it stay whole
    return out


def _prod(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def transpose(x: HasPlacement, axes: tuple[int, ...] | None) -> Placements:
    """A Shard moves with its dim."""
    order = list(axes) if axes is not None else list(range(x.ndim))[::-1]
    return {a: Shard(order.index(p.dim % x.ndim)) if isinstance(p, Shard) else p
            for a, p in of(x).items()}


def same(*tensors: HasPlacement, op: str = "concat") -> Placements:
    """Ops that stack or pick within this rank's piece (concat, rows taken, index_add):
    every operand must have the same placement, which the output keeps. An operand
    with none (a fresh zero buffer) takes any placement."""
    labeled = [t for t in tensors if of(t)]
    if not labeled:
        return {}
    first = labeled[0]
    for t in labeled[1:]:
        for axis in _axes(first, t):
            if get(t, axis) != get(first, axis):
                raise refuse(f"{op} with {first.name or 'a tensor'} "
                             f"({get(first, axis)} over {axis})", t, axis, get(t, axis),
                             get(first, axis))
    return dict(of(first))


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
    for axis in _axes(q, k, v, *([key_bias] if key_bias is not None else [])):
        pq, pk, pv = get(q, axis), get(k, axis), get(v, axis)
        for x, p in ((q, pq), (k, pk), (v, pv)):
            if isinstance(p, Partial):
                raise refuse(op, x, axis, p, REPLICATED, " (softmax is not linear: an "
                             "Allreduce is missing)")
        dq = _dim(pq, q.ndim)
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
            if _dim(p, x.ndim) != dq or (dq is None and p != pq):
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
        if _dim(get(x, axis), x.ndim) != -2:
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
        _grad_partial(weight, axis)
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
    if tp.size > 1 and _dim(get(logits, axis), logits.ndim) != -1:
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
    return embedding(op, table, _Shaped(dict(of(rows)), getattr(rows, "name", ""),
                                        rows.ndim, rows.shape))


def rows_exchanged(op: str, x: HasPlacement, group: AxisGroup) -> Placements:
    """Alltoallv of rows (the MoE dispatch and combine): rows go to other ranks whole,
    so none may be a partial sum; the rows held stay a shard of the same tokens' rows
    (regrouped by destination), so every placement is kept."""
    for axis, p in of(x).items():
        if isinstance(p, Partial):
            raise refuse(f"{op} over {axis_of(group)}", x, axis, p, REPLICATED)
    return dict(of(x))


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
                                 and _dim(found, x.ndim) == _dim(needed, x.ndim)))
        if not ok:
            shown = {Replicate: REPLICATED, Partial: Partial(), Shard: "sharded"}.get(
                needed, needed)
            raise refuse(op, x, axis, found, shown)
    return follow(out, {**of(x), **{axis: result for axis in axes_of(group)}}, x.name,
                  summed=True)


# --------------------------------------------------------- gradient sync
_PARTIAL_GRADS: dict[int, tuple[object, set[str]]] = {}  # param id -> (param, axes)
_SUMMED: dict[int, set[str]] = {}                          # param id -> axes summed over


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
        for key, (p, axes) in sorted(_PARTIAL_GRADS.items(), key=lambda kv: kv[1][0].name):
            for axis in sorted(axes):
                group = (p.sync or axis) if axis == "dp" else axis
                if sizes.get(group, 1) > 1 and group not in _SUMMED.get(key, set()):
                    return (f"{p.name}'s gradient is a partial sum over {group} (it was used "
                            f"on rows sharded over {axis}); the optimizer step needs it "
                            f"summed (an Allreduce over {group} is missing)")
        return None
    finally:
        _PARTIAL_GRADS.clear()
        _SUMMED.clear()
