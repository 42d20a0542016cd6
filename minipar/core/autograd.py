"""A small reverse-mode autograd over NumPy arrays.

What this file teaches: how a tape of operations turns a forward computation
into its gradient. Every differentiable op below builds its output `Tensor`
and, right beside the forward math, a `backward` closure that receives the
gradient of the output and adds the gradients of the inputs (chain rule, one
local step at a time).

Design choices a reader should notice:

- Parents are kept in a tuple and `backward()` walks them in a deterministic
  reverse topological order, so the order in which gradients are summed never
  depends on object ids: two runs give bitwise-identical gradients.
- Gradients *accumulate* (`+=`): a tensor used twice receives both gradients.
- Broadcasting in the forward becomes a sum over the broadcast axes in the
  backward (`_unbroadcast`).
- The model's layers (`linear`, `layer_norm`, `gelu`, `cross_entropy`, ...)
  are fused into one node each, in core/fused_layers.py, so the tape's bookkeeping stays
  small next to the matmuls.
- Parallel code adds its own ops with `Tensor.from_op` (see `comm/collectives.py`): a
  collective is just another node whose backward is another collective.
- With placement checking on (placement/__init__.py), each op also gives its output the
  placement its rule derives from the inputs' (`if _pl.ON:` below): replicated,
  sharded or partial over each mesh axis. Off, that is one flag test per op.

Run the gradient checks: `python -m pytest tests/core/test_autograd.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from minipar import placement as _pl
from minipar.core import precision as _mp

_GRAD_ENABLED = True
_DEFERRED: list[Callable[[], None]] | None = None  # weight-gradient work put off (zero bubble)


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Inside this block ops build no tape: results are plain constants."""
    global _GRAD_ENABLED
    previous, _GRAD_ENABLED = _GRAD_ENABLED, False
    try:
        yield
    finally:
        _GRAD_ENABLED = previous


@contextlib.contextmanager
def defer_weight_grads() -> Iterator[list[Callable[[], None]]]:
    """Inside this block, `linear` and `matmul` compute input gradients at once but put
    the weight-gradient matmuls (x^T g) in the yielded list, to run later.

    This is the split a zero-bubble pipeline schedule (ZB-H1) needs: the backward "B"
    (input gradient, which the previous stage waits for) runs now, the "W" (weight
    gradient, which nobody waits for) fills a bubble later: `for work in pending: work()`.
    """
    global _DEFERRED
    previous, _DEFERRED = _DEFERRED, []
    try:
        yield _DEFERRED
    finally:
        _DEFERRED = previous


def weight_grad(work: Callable[[], None]) -> None:
    """Run `work` now, or put it off when inside `defer_weight_grads()`."""
    if _DEFERRED is None:
        work()
    else:
        _DEFERRED.append(work)


class Tensor:
    """An array plus the recipe to push gradients back to the arrays it came from.

    `data` is the value, `grad` the accumulated gradient of the final scalar with
    respect to it (same shape), `parents` the tensors it was computed from and
    `_backward` the closure that moves `self.grad` into the parents' grads. A leaf
    (a parameter, an input) keeps its `grad`; an op's is freed once its own backward has
    run (`backward_from`), as nothing reads it after that.
    """

    # `placement` (placement/__init__.py) is set only while placement checking is on
    __slots__ = ("_backward", "data", "grad", "name", "parents", "placement", "requires_grad")
    __array_priority__ = 100  # so ndarray + Tensor calls Tensor.__radd__

    def __init__(self, data: np.ndarray | float, requires_grad: bool = False,
                 name: str = "") -> None:
        self.data = np.asarray(data)
        self.grad: np.ndarray | None = None
        self.requires_grad = requires_grad
        self.parents: tuple[Tensor, ...] = ()
        self._backward: Callable[[np.ndarray], None] | None = None
        self.name = name

    # ----------------------------------------------------------------- tape
    @classmethod
    def from_op(cls, data: np.ndarray, parents: Sequence[Tensor],
                backward: Callable[[np.ndarray], None]) -> Tensor:
        """Make the output of an op. `backward(grad_out)` must add to the parents' grads
        (use `parent.accumulate(g)`). No tape is recorded when no parent needs a gradient
        or inside `no_grad()`."""
        out = cls(data)
        if _GRAD_ENABLED:
            for p in parents:  # a plain loop: this runs once per op, so it is kept cheap
                if p.requires_grad:
                    out.requires_grad = True
                    out.parents = tuple(parents)
                    out._backward = backward
                    break
        elif _pl.ON:  # no tape, but placement checking walks back to the parameters
            out.parents = tuple(parents)   # (the forward of a recomputed block, recompute.py)
        return out

    def accumulate(self, g: np.ndarray, fresh: bool = False) -> None:
        """Add `g` to this tensor's gradient (the rule that makes reuse work).

        `fresh=True` promises that `g` is a new array nobody else holds, so the first
        gradient can be kept without a copy (a copy per node would cost as much as
        the tape itself); shared arrays (an `add` hands the same g to both inputs)
        are copied, because later accumulations write into the stored gradient."""
        if not self.requires_grad:
            return
        if self.grad is not None:
            self.grad += g
        elif fresh and g.dtype == self.data.dtype and g.flags.writeable \
                and g.flags.c_contiguous:
            self.grad = g
        else:
            self.grad = np.array(g, dtype=self.data.dtype, copy=True)

    def backward(self, grad: np.ndarray | None = None) -> None:
        """Backpropagate from this tensor (a scalar loss, or any tensor given `grad`).

        Nodes are visited in reverse topological order; a node's gradient is
        complete before its closure runs, because every consumer comes later in
        the forward order and therefore earlier in this walk.
        """
        backward_from([(self, 1.0 if grad is None else grad)])

    def zero_grad(self) -> None:
        self.grad = None

    def detach(self) -> Tensor:
        """The same values, cut from the tape (a constant)."""
        return Tensor(self.data)

    # ----------------------------------------------------------- properties
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    def numpy(self) -> np.ndarray:
        return self.data

    def item(self) -> float:
        return float(self.data)

    def __repr__(self) -> str:
        label = f" {self.name}" if self.name else ""
        return f"Tensor{label}(shape={self.shape}, dtype={self.dtype})"

    # ------------------------------------------------------- operator sugar
    def __add__(self, other: TensorLike) -> Tensor:
        return add(self, other)

    def __radd__(self, other: TensorLike) -> Tensor:
        return add(other, self)

    def __sub__(self, other: TensorLike) -> Tensor:
        return sub(self, other)

    def __rsub__(self, other: TensorLike) -> Tensor:
        return sub(other, self)

    def __mul__(self, other: TensorLike) -> Tensor:
        return mul(self, other)

    def __rmul__(self, other: TensorLike) -> Tensor:
        return mul(other, self)

    def __truediv__(self, other: TensorLike) -> Tensor:
        return div(self, other)

    def __rtruediv__(self, other: TensorLike) -> Tensor:
        return div(other, self)

    def __neg__(self) -> Tensor:
        return mul(self, -1.0)

    def __matmul__(self, other: Tensor) -> Tensor:
        return matmul(self, other)

    def __getitem__(self, index: object) -> Tensor:
        return getitem(self, index)

    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        return sum_(self, axis, keepdims)

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        return mean(self, axis, keepdims)

    def reshape(self, *shape: int) -> Tensor:
        return reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple)
                       else shape)

    @property
    def T(self) -> Tensor:
        return transpose(self)


TensorLike = Tensor | np.ndarray | float


def _topological_order(roots: Sequence[Tensor]) -> list[Tensor]:
    """Every op node reachable from `roots`, each after all of its parents."""
    order: list[Tensor] = []
    seen: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(r, False) for r in reversed(roots)]
    while stack:  # iterative DFS: deep models do not hit Python's recursion limit
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for parent in reversed(node.parents):
            # leaves (parameters, inputs) need no ordering: they only receive gradients
            if parent._backward is not None and id(parent) not in seen:
                stack.append((parent, False))
    return order


def backward_from(pairs: Sequence[tuple[Tensor, np.ndarray | float]]) -> None:
    """Backpropagate several roots at once, root i seeded with gradient g_i.

    A pipeline stage needs this: its output receives the gradient sent back by
    the next stage, while its own MoE aux loss is seeded with its loss weight.
    Each node runs once, after all of its consumers, as in `Tensor.backward`.
    """
    roots = [t for t, _ in pairs if t.requires_grad]
    order = _topological_order(roots)
    for t, g in pairs:
        t.accumulate(np.broadcast_to(np.asarray(g, dtype=t.dtype), t.shape))
    for node in reversed(order):
        if node._backward is not None and node.grad is not None:
            node._backward(node.grad)
            node.grad = None  # read by its own backward only: free it now (peak memory)


def as_tensor(x: TensorLike) -> Tensor:
    """Wrap arrays and numbers as constant tensors; tensors pass through."""
    return x if isinstance(x, Tensor) else Tensor(np.asarray(x))


def _operands(a: TensorLike, b: TensorLike) -> tuple[Tensor, Tensor]:
    """Both sides of a binary op as tensors. A bare Python number takes the other side's
    dtype: as a float64 constant it would silently promote a float32 model to float64."""
    if isinstance(a, Tensor) and isinstance(b, (int, float)):
        return a, Tensor(np.asarray(b, dtype=a.dtype))
    if isinstance(b, Tensor) and isinstance(a, (int, float)):
        return Tensor(np.asarray(a, dtype=b.dtype)), b
    return as_tensor(a), as_tensor(b)


def _unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum `g` down to `shape`: the backward of NumPy broadcasting."""
    if g.shape == shape:
        return g
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        i + extra for i, n in enumerate(shape) if n == 1 and g.shape[i + extra] != 1)
    g = g.sum(axis=axes, keepdims=True) if axes else g
    return g.reshape(shape)


# ------------------------------------------------------------ elementwise
def add(a: TensorLike, b: TensorLike) -> Tensor:
    """a + b, broadcasting. Backward: the gradient flows unchanged to both."""
    a, b = _operands(a, b)

    def backward(g: np.ndarray) -> None:
        a.accumulate(_unbroadcast(g, a.shape))
        # b is the last to read g, which the walk frees after this closure: b may keep it
        b.accumulate(_unbroadcast(g, b.shape), fresh=a is not b)
    out = Tensor.from_op(a.data + b.data, (a, b), backward)
    return _pl.follow(out, _pl.add("add", a, b), _pl.first_name(a, b)) if _pl.ON else out


def sub(a: TensorLike, b: TensorLike) -> Tensor:
    """a - b. Backward: +g to a, -g to b."""
    a, b = _operands(a, b)

    def backward(g: np.ndarray) -> None:
        a.accumulate(_unbroadcast(g, a.shape))
        b.accumulate(_unbroadcast(-g, b.shape), fresh=True)
    out = Tensor.from_op(a.data - b.data, (a, b), backward)
    return _pl.follow(out, _pl.add("subtract", a, b), _pl.first_name(a, b)) if _pl.ON else out


def mul(a: TensorLike, b: TensorLike) -> Tensor:
    """a * b. Backward: d(ab) = b da + a db."""
    a, b = _operands(a, b)

    def backward(g: np.ndarray) -> None:
        a.accumulate(_unbroadcast(g * b.data, a.shape), fresh=True)
        b.accumulate(_unbroadcast(g * a.data, b.shape), fresh=True)
    out = Tensor.from_op(a.data * b.data, (a, b), backward)
    return _pl.follow(out, _pl.mul("multiply", a, b), _pl.first_name(a, b)) if _pl.ON else out


def div(a: TensorLike, b: TensorLike) -> Tensor:
    """a / b. Backward: da = g / b, db = -g a / b^2."""
    a, b = _operands(a, b)
    out = a.data / b.data

    def backward(g: np.ndarray) -> None:
        a.accumulate(_unbroadcast(g / b.data, a.shape), fresh=True)
        b.accumulate(_unbroadcast(-g * out / b.data, b.shape), fresh=True)
    result = Tensor.from_op(out, (a, b), backward)
    return _pl.follow(result, _pl.mul("divide", a, b, divide=True), _pl.first_name(a, b)) \
        if _pl.ON else result


def exp(a: Tensor) -> Tensor:
    """e^a. Backward: g * e^a."""
    out = np.exp(a.data)
    return _nonlinear("exp", a, Tensor.from_op(
        out, (a,), lambda g: a.accumulate(g * out, fresh=True)))


def log(a: Tensor) -> Tensor:
    """ln a. Backward: g / a."""
    return _nonlinear("log", a, Tensor.from_op(
        np.log(a.data), (a,), lambda g: a.accumulate(g / a.data, fresh=True)))


def tanh(a: Tensor) -> Tensor:
    """tanh a. Backward: g (1 - tanh^2 a)."""
    out = np.tanh(a.data)
    return _nonlinear("tanh", a, Tensor.from_op(
        out, (a,), lambda g: a.accumulate(g * (1.0 - out * out), fresh=True)))


def sqrt(a: Tensor) -> Tensor:
    """sqrt a. Backward: g / (2 sqrt a)."""
    out = np.sqrt(a.data)
    return _nonlinear("sqrt", a, Tensor.from_op(
        out, (a,), lambda g: a.accumulate(g * 0.5 / out, fresh=True)))


def _nonlinear(op: str, a: Tensor, out: Tensor) -> Tensor:
    """`out` of a nonlinear elementwise op on `a`, with its placement when checking."""
    return _pl.follow(out, _pl.nonlinear(op, a), a.name) if _pl.ON else out


# ------------------------------------------------------------- reductions
def sum_(a: Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
    """Sum over axes. Backward: the gradient is broadcast back over the summed axes."""
    out = a.data.sum(axis=axis, keepdims=keepdims)

    def backward(g: np.ndarray) -> None:
        if axis is not None and not keepdims:
            g = np.expand_dims(g, axis)
        a.accumulate(np.broadcast_to(g, a.shape))
    result = Tensor.from_op(out, (a,), backward)
    return _pl.follow(result, _pl.reduce("sum", a, axis, keepdims), a.name) if _pl.ON \
        else result


def mean(a: Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
    """Mean over axes: a sum divided by the count."""
    count = a.data.size if axis is None else int(np.prod([a.shape[i] for i in np.atleast_1d(axis)]))
    out = mul(sum_(a, axis, keepdims), 1.0 / count)
    return _pl.follow(out, _pl.reduce("mean", a, axis, keepdims, mean=True), a.name) \
        if _pl.ON else out


# ----------------------------------------------------------------- shapes
def reshape(a: Tensor, shape: tuple[int, ...], tokens: bool = False,
            like: Tensor | None = None) -> Tensor:
    """Same values, new shape. Backward: reshape the gradient back. `tokens` and `like`
    only tell placement checking what the reshape means (placement.reshape: rows and
    positions merged into tokens, and tokens back to `like`'s rows and positions)."""
    out = Tensor.from_op(a.data.reshape(shape), (a,), lambda g: a.accumulate(g.reshape(a.shape)))
    # a view of the same values: its gradient is summed wherever the input's is
    return _pl.follow(out, _pl.reshape("reshape", a, out.shape, tokens, like), a.name,
                      summed=True) if _pl.ON else out


def transpose(a: Tensor, axes: tuple[int, ...] | None = None) -> Tensor:
    """Permute axes. Backward: the inverse permutation."""
    inverse = None if axes is None else tuple(np.argsort(axes))
    out = Tensor.from_op(np.transpose(a.data, axes), (a,),
                         lambda g: a.accumulate(np.transpose(g, inverse)))
    return _pl.follow(out, _pl.transpose(a, axes), a.name, summed=True) if _pl.ON else out


def getitem(a: Tensor, index: object) -> Tensor:
    """a[index] for slices or index arrays (a gather). Backward: scatter-add the gradient
    into the taken places; `np.add.at` sums repeated indices correctly."""
    def backward(g: np.ndarray) -> None:
        full = np.zeros_like(a.data)
        np.add.at(full, index, g)
        a.accumulate(full, fresh=True)
    out = Tensor.from_op(a.data[index], (a,), backward)
    # picking within this rank's piece keeps its placement (a row shard stays one), and
    # the picked values' gradient goes back into a's, summed wherever a's is
    return _pl.follow(out, _pl.of(a), a.name, summed=True) if _pl.ON else out


def take_rows(a: Tensor, rows: np.ndarray) -> Tensor:
    """a[rows] for a 1-D integer array: gather rows. Backward: index_add into rows."""
    def backward(g: np.ndarray) -> None:
        full = np.zeros_like(a.data)
        np.add.at(full, rows, g)
        a.accumulate(full, fresh=True)
    out = Tensor.from_op(a.data[rows], (a,), backward)
    return _pl.follow(out, _pl.of(a), a.name, summed=True) if _pl.ON else out


def index_add(base: Tensor, rows: np.ndarray, values: Tensor) -> Tensor:
    """out = base; out[rows] += values (repeated rows add up): scatter-add.
    Backward: base gets g, values get g[rows] (a gather)."""
    out = base.data.copy()
    np.add.at(out, rows, values.data)

    def backward(g: np.ndarray) -> None:
        base.accumulate(g)
        values.accumulate(g[rows], fresh=True)
    result = Tensor.from_op(out, (base, values), backward)
    return _pl.follow(result, _pl.same(base, values, op="index_add"), values.name) \
        if _pl.ON else result


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join along an axis. Backward: cut the gradient back into the pieces."""
    sizes = [t.shape[axis] for t in tensors]
    bounds = np.cumsum(sizes)[:-1]

    def backward(g: np.ndarray) -> None:
        for t, piece in zip(tensors, np.split(g, bounds, axis=axis)):
            t.accumulate(piece)
    out = Tensor.from_op(np.concatenate([t.data for t in tensors], axis=axis),
                         tuple(tensors), backward)
    return _pl.follow(out, _pl.same(*tensors), _pl.first_name(*tensors)) if _pl.ON else out


def split(a: Tensor, sections: int | Sequence[int], axis: int = 0) -> list[Tensor]:
    """Cut into pieces (equal count, or at the given indices, as `np.split`).
    Each piece is a slice, whose backward puts its gradient in its place."""
    pieces = np.split(np.arange(a.shape[axis]), sections)
    out = []
    for rows in pieces:
        index = [slice(None)] * a.ndim
        index[axis] = slice(int(rows[0]), int(rows[-1]) + 1) if len(rows) else slice(0, 0)
        out.append(getitem(a, tuple(index)))
    return out


# ------------------------------------------------------------- linear algebra
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b, batched over leading axes as `np.matmul` (both operands at least 2-D).
    Backward: dA = g B^T, dB = A^T g, each summed over the axes its operand was broadcast
    along. A 2-D weight under a (..., n, k) input gets the sum over every leading axis,
    computed as one (k, N) @ (N, m) matmul of the flattened rows."""
    if _mp.LOW is not None:  # --mixed (core/precision.py): 16-bit operands, master sums
        return _matmul_mixed(a, b)

    def backward(g: np.ndarray) -> None:
        if a.requires_grad:
            a.accumulate(_unbroadcast(g @ np.swapaxes(b.data, -1, -2), a.shape), fresh=True)
        if b.requires_grad:
            weight_grad(lambda: b.accumulate(_matmul_weight_grad(a.data, g, b.shape),
                                              fresh=True))
    out = Tensor.from_op(a.data @ b.data, (a, b), backward)
    return _pl.follow(out, _pl.matmul("matmul", a, b), _pl.first_name(a, b)) if _pl.ON else out


def _matmul_mixed(a: Tensor, b: Tensor) -> Tensor:
    """`matmul` under the mixed-precision policy: the operands rounded to 16 bits, the
    products summed in the master dtype, the result rounded once; dA and dB the same."""
    low, up = _mp.to_low, _mp.upcast

    def backward(g: np.ndarray) -> None:
        g16 = up(low(g))
        if a.requires_grad:
            a.accumulate(low(_unbroadcast(g16 @ np.swapaxes(up(low(b.data)), -1, -2),
                                          a.shape)), fresh=True)
        if b.requires_grad:
            weight_grad(lambda: b.accumulate(low(_matmul_weight_grad(
                up(low(a.data)), g16, b.shape)), fresh=True))
    out = Tensor.from_op(low(_mp.matmul(a.data, b.data)), (a, b), backward)
    return _pl.follow(out, _pl.matmul("matmul", a, b), _pl.first_name(a, b)) if _pl.ON else out


def _matmul_weight_grad(a: np.ndarray, g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A^T g summed down to the shape of the right operand of `a @ b`."""
    if len(shape) == 2:  # a weight: every leading axis of a is rows -> (k, N) @ (N, m)
        return a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
    return _unbroadcast(np.swapaxes(a, -1, -2) @ g, shape)
