"""The placement rules of the ops every model uses: elementwise, products, x @ W,
reductions, reshapes.

What this file teaches: each op takes its inputs' placements (placement/types.py)
and derives its output's, or refuses with one line, and each rule is a fact of
linear algebra:

    a + b            same placement on both sides stays; a replicated term beside a
                     shard only if it broadcasts along the shard's dim (a bias on rows);
                     Partial(sum) + Replicate is refused (the term would count once per rank)
    a * b, a / b     linear in each factor: Partial * Replicate is Partial; Partial *
                     Partial and a Partial divisor are refused
    GELU, softmax    nonlinear: Partial refused; a normalization (softmax, LayerNorm, the
                     cross-entropy) refuses a shard of the dim it normalizes
    x @ W            Shard(rows) @ Replicate -> Shard(rows); Replicate @ Shard(cols) ->
                     Shard(cols) (x's gradient summed: copy_to); Shard(cols) @ Shard(rows)
                     -> Partial; Partial @ Replicate -> Partial
    sum, mean        over a sharded dim: Partial(sum), Partial(avg)
    reshape, .T      a shard moves with its dim

A replicated operand that meets rows sharded over an axis gets a gradient that is
a partial sum over it (`grad_partial`): the rules record which parameters, and
the gradient sync (placement/__init__.py) checks that each was summed. Callers reach these
rules as `placement.add`, `placement.matmul`, ...; docs/design.md, "Placements".
"""

from __future__ import annotations

from collections.abc import Iterable

from minipar.placement.types import (
    REPLICATED,
    HasPlacement,
    Partial,
    Placements,
    Replicate,
    Shard,
    axes_among,
    get,
    of,
    refuse,
    shard_dim,
)

PARTIAL_GRADIENTS: dict[int, tuple[object, set[str]]] = {}  # param id -> (param, axes)


# ------------------------------------------------------------ elementwise
def _broadcasts(t: HasPlacement, dim_from_end: int) -> bool:
    """Does `t` broadcast along that dim (missing there, or of size 1)?"""
    return -dim_from_end > t.ndim or t.shape[dim_from_end] == 1


def grad_partial(t: object, axis: str) -> None:
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
                PARTIAL_GRADIENTS.setdefault(id(node), (node, set()))[1].add(axis)
        else:
            stack.extend(getattr(node, "parents", ()))


def add(op: str, a: HasPlacement, b: HasPlacement) -> Placements:
    """a + b (and a - b). Same placement on both sides stays; a replicated term that
    broadcasts along the other side's shard dim is fine (a bias on rows); Partial(avg)
    + Replicate is fine (the mean of a_k + c is mean(a_k) + c); anything else is refused.
    """
    out: Placements = {}
    for axis in axes_among(a, b):
        pa, pb = get(a, axis), get(b, axis)
        if isinstance(pa, Replicate) and isinstance(pb, Replicate):
            continue
        if isinstance(pa, Shard) and isinstance(pb, Shard) \
                and shard_dim(pa, a.ndim) == shard_dim(pb, b.ndim):   # dims aligned from the end
            out[axis] = Shard(shard_dim(pa, a.ndim))
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
                if _broadcasts(y, shard_dim(px, x.ndim)):
                    out[axis] = Shard(shard_dim(px, x.ndim))   # counted from the end
                    grad_partial(y, axis)
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
    for axis in axes_among(a, b):
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
                shard_dim(p, x.ndim) == (over - x.ndim if over >= 0 else over):
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
            grad_partial(gamma, axis)
            grad_partial(beta, axis)
    return out


# ----------------------------------------------------------- linear algebra
def matmul(op: str, x: HasPlacement, w: HasPlacement) -> Placements:
    """x @ W with x (..., k), W (k, n): the placement rules of data, column and row
    parallelism (module docstring). Output (..., n)."""
    out: Placements = {}
    for axis in axes_among(x, w):
        px, pw = get(x, axis), get(w, axis)
        dx, dw = shard_dim(px, x.ndim), shard_dim(pw, w.ndim)
        if isinstance(px, Replicate) and isinstance(pw, Replicate):
            continue
        if isinstance(px, Shard) and dx != -1 and isinstance(pw, Replicate):
            out[axis] = Shard(dx)                  # my rows times the whole W: my rows
            grad_partial(w, axis)                 # dW = x^T g sums over my rows only
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
    product = Shaped(out, op.replace(" linear", "") + " product",
                      x.ndim, (*x.shape[:-1], w.shape[-1]))
    return add(f"{op}: the bias add", product, bias)


class Shaped:
    """Placements with a name and a shape: an intermediate result no op returns."""

    def __init__(self, placement: Placements, name: str, ndim: int,
                 shape: tuple[int, ...]) -> None:
        self.placement, self.name, self.ndim, self.shape = placement, name, ndim, shape


def residual_mlp(h: HasPlacement, gamma: HasPlacement, beta: HasPlacement,
                 w1: HasPlacement, b1: HasPlacement, w2: HasPlacement, b2: HasPlacement
                 ) -> Placements:
    """fused.residual_mlp, h + fc2(GELU(fc1(LN(h)))) in one node: the rules of its five
    layers in turn, each intermediate named as the five separate nodes would name it."""
    def named(weight: HasPlacement) -> str:
        return weight.name.removesuffix(".weight")

    wide = (*h.shape[:-1], w1.shape[-1])
    u = Shaped(layer_norm(f"LayerNorm {named(gamma)}", h, gamma, beta),
                f"{named(gamma)} output", h.ndim, h.shape)
    a = Shaped(linear(f"{named(w1)} linear", u, w1, b1), f"{named(w1)} output", h.ndim, wide)
    z = Shaped(nonlinear("GELU", a), a.name, h.ndim, wide)
    f = Shaped(linear(f"{named(w2)} linear", z, w2, b2), f"{named(w2)} output", h.ndim,
                h.shape)
    return add("add", h, f)


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
        for axis in axes_among(first, t):
            if get(t, axis) != get(first, axis):
                raise refuse(f"{op} with {first.name or 'a tensor'} "
                             f"({get(first, axis)} over {axis})", t, axis, get(t, axis),
                             get(first, axis))
    return dict(of(first))

