"""The model's layers as single tape nodes, each backward written in closed form.

What this file teaches: autograd.py could build every layer from its small ops
(a LayerNorm is a mean, a subtraction, a variance, a square root, ...), and the
tape would get every gradient right. But each op is a node with its own Python
bookkeeping and its own temporaries. A layer written as ONE node, with the
backward derived by hand beside the forward, costs about what the plain NumPy
math costs (`make bench` measures it):

    linear         y = x W + b           dx = g W^T, dW = x^T g, db = sum_rows g
                   (x may be (..., in): every leading axis counts as rows)
    layer_norm     (x - mu) / sigma * gamma + beta
    gelu           0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
    softmax        s = exp(a) / sum exp(a)          da = s (g - sum(g s))
    log_softmax    a - logsumexp(a)                 da = g - softmax(a) sum(g)
    cross_entropy  sum_b -log softmax(logits_b)[y_b] * scale

The same reasoning one level up: the residual MLP block the models repeat L times,
h + fc2(GELU(fc1(LN(h)))), is five nodes when composed from the ops above (LayerNorm,
two linears, GELU, the residual add), and at small sizes each node's bookkeeping is a
few microseconds against NumPy work of the same order. `residual_mlp` is the block as
ONE node: the forward chains the layers' forward math, the backward their closed forms
in reverse, through the same helpers the single-layer nodes use (`_layer_norm_forward`,
`_gelu_forward`, ...), so the numbers are the composition's. Tensor parallelism, which
needs a collective between the layers, composes the single-layer nodes instead
(parallel/tensor_parallel.py).

`linear` (and `residual_mlp`, for its two linears) leaves its weight gradients to
`autograd.weight_grad`, so a zero-bubble pipeline can run them later
(`autograd.defer_weight_grads`). The finite-difference checks of `tests/core/test_autograd.py`
cover every op here.
"""

from __future__ import annotations

import math

import numpy as np

from minipar import placement as _pl
from minipar.core import precision as _mp
from minipar.core.autograd import Tensor, weight_grad
from minipar.core.documents import IGNORE

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           partial: bool = False) -> Tensor:
    """y = x @ W + b, one fused node. Weights are (in, out); x is (rows, in) or, for a
    sequence model, (B, T, in): every leading axis counts as rows.
    Backward: dx = g W^T, dW = x^T g, db = sum_rows g (the sums run over all B*T rows).
    The rows are flattened to one (N, in) matrix first: one BLAS call, not one per row
    of a stacked matmul. `partial=True` (a row-parallel share, tensor_parallel.py): under
    --mixed the output stays in the master dtype, to be summed over tp before rounding."""
    if _mp.LOW is not None:  # --mixed: 16-bit operands, master sums, one rounding
        return _linear_mixed(x, weight, bias, partial)
    xd, wd = x.data, weight.data
    flat = xd.ndim == 2                                          # (rows, in): no reshapes
    rows_in = xd if flat else xd.reshape(-1, xd.shape[-1])      # (N, in), a view
    out = rows_in @ wd if flat else (rows_in @ wd).reshape(*xd.shape[:-1], wd.shape[-1])
    if bias is not None:
        out += bias.data
    parents = (x, weight) if bias is None else (x, weight, bias)

    def backward(g: np.ndarray) -> None:
        grad_rows = g if flat else g.reshape(-1, g.shape[-1])   # (N, out)
        if x.requires_grad:
            dx = grad_rows @ weight.data.T                       # (N, out) @ (out, in)
            x.accumulate(dx if flat else dx.reshape(x.data.shape), fresh=True)

        def weight_grads() -> None:  # x.data and weight.data as they are now (ZeRO-3 regathers)
            rows = x.data if flat else x.data.reshape(-1, x.data.shape[-1])
            weight.accumulate(rows.T @ grad_rows, fresh=True)   # (in, N) @ (N, out)
            if bias is not None:
                bias.accumulate(grad_rows.sum(axis=0), fresh=True)
        weight_grad(weight_grads)
    return _linear_placed(Tensor.from_op(out, parents, backward), x, weight, bias)


def _linear_mixed(x: Tensor, weight: Tensor, bias: Tensor | None, partial: bool = False
                  ) -> Tensor:
    """`linear` under the mixed-precision policy (core/precision.py): every matmul
    takes 16-bit operands and sums in the master dtype; the output, dx, dW and db are
    each rounded once to 16 bits (dW and db then add into the master main gradient).
    `partial`: the output is left unrounded in the master dtype (a partial sum)."""
    shape = x.data.shape
    rows_in = _mp.to_low(x.data).reshape(-1, shape[-1])                 # (N, in), 16-bit
    q = _mp.block_operand      # --fp8: Q(X), Q(W), Q(dY) of a block's layer (core/fp8.py)
    x_q = q(rows_in, "x", weight)
    out = _mp.matmul(x_q, q(weight.data, "weight", weight))             # master sums
    if bias is not None:
        out += _mp.upcast(bias.data)
    out = (out if partial else _mp.to_low(out)).reshape(*shape[:-1], out.shape[-1])
    parents = (x, weight) if bias is None else (x, weight, bias)
    kept = x_q if x_q is not rows_in else None    # --fp8: Q(X) again in dW, not requantized

    def backward(g: np.ndarray) -> None:
        words = _mp.to_low(g).reshape(-1, g.shape[-1])   # (N, out): rounded once, and
        grad_rows = q(words, "dy", weight)               # widened once for dx, dW and db
        wide = _mp.upcast(words) if grad_rows is words or bias is not None else None
        grad_rows = grad_rows if wide is None else _mp.widened_once(grad_rows, words, wide)
        if x.requires_grad:
            dx = _mp.to_low(_mp.matmul(grad_rows, q(weight.data, "weight", weight).T))
            x.accumulate(dx.reshape(shape), fresh=True)

        def weight_grads() -> None:
            rows = kept if kept is not None else _mp.to_low(x.data).reshape(-1, shape[-1])
            weight.accumulate(_mp.to_low(_mp.matmul(rows.T, grad_rows)), fresh=True)
            if bias is not None:
                bias.accumulate(_mp.to_low(wide.sum(axis=0)), fresh=True)
        weight_grad(weight_grads)
    return _linear_placed(Tensor.from_op(out, parents, backward), x, weight, bias)


def _linear_placed(result: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`result` of a linear, with its placement when checking."""
    if _pl.ON:  # placement/__init__.py: data, column and row parallelism's rules, then the bias
        layer = weight.name.removesuffix(".weight")
        _pl.follow(result, _pl.linear(f"{layer} linear", x, weight, bias), f"{layer} output")
    return result


def round_low(a: Tensor) -> Tensor:
    """a rounded to 16 bits under --mixed (core/precision.py), a itself without it.
    Backward: the gradient passes unchanged (rounding is the identity to first order)."""
    if _mp.LOW is None or a.data.dtype == _mp.LOW:
        return a
    result = Tensor.from_op(_mp.to_low(a.data), (a,), lambda g: a.accumulate(g))
    return _pl.follow(result, _pl.of(a), a.name) if _pl.ON else result


def gelu(a: Tensor) -> Tensor:
    """GELU, tanh form: 0.5 z (1 + tanh(sqrt(2/pi)(z + 0.044715 z^3))). One fused node."""
    z = _mp.upcast(a.data)             # --mixed: computed in the master dtype, rounded
    out, t = _gelu_forward(z)

    def backward(g: np.ndarray) -> None:
        a.accumulate(_mp.round_low(_gelu_backward(_mp.upcast(g), z, t)), fresh=True)
    result = Tensor.from_op(_mp.round_low(out), (a,), backward)
    return _pl.follow(result, _pl.nonlinear("GELU", a), a.name) if _pl.ON else result


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis (biased var).
    One fused node; the backward is the standard closed form
    dx = (g_hat - mean(g_hat) - x_hat mean(g_hat x_hat)) / sigma, g_hat = g gamma."""
    # --mixed (core/precision.py): statistics in the master dtype on upcast inputs, the
    # output and the gradients rounded to 16 bits; without it upcast/round_low do nothing
    up, rnd = _mp.upcast, _mp.round_low
    out, x_hat, inv_sigma = _layer_norm_forward(up(x.data), up(gamma.data), up(beta.data),
                                                eps)

    def backward(g: np.ndarray) -> None:
        g = up(g)
        lead = tuple(range(g.ndim - 1))
        gamma.accumulate(rnd((g * x_hat).sum(axis=lead)), fresh=True)
        beta.accumulate(rnd(g.sum(axis=lead)), fresh=True)
        if x.requires_grad:
            x.accumulate(rnd(_layer_norm_input_grad(g, up(gamma.data), x_hat, inv_sigma)),
                         fresh=True)
    result = Tensor.from_op(rnd(out), (x, gamma, beta), backward)
    if _pl.ON:
        layer = gamma.name.removesuffix(".weight")
        _pl.follow(result, _pl.layer_norm(f"LayerNorm {layer}", x, gamma, beta),
                   f"{layer} output")
    return result


# ------------------------------------------- the layers' math, forward and backward
def _gelu_forward(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GELU of z and the tanh its backward reuses:

        t = tanh(c (z + k z^3)),  GELU(z) = 0.5 z (1 + t),   c = sqrt(2/pi), k = 0.044715

    written as t = tanh(z (c + c k z^2)) and z (0.5 + 0.5 t): two (B, d_ff) arrays made,
    eight passes over memory, each in place."""
    t = z * z
    t *= _SQRT_2_OVER_PI * 0.044715
    t += _SQRT_2_OVER_PI
    t *= z
    np.tanh(t, out=t)
    out = t * 0.5
    out += 0.5
    out *= z
    return out, t


def _gelu_backward(g: np.ndarray, z: np.ndarray, t: np.ndarray) -> np.ndarray:
    """dGELU/dz * g, from z and its tanh t:

        dGELU/dz = 0.5 (1 + t) + 0.5 z (1 - t^2) c (1 + 3 k z^2)

    the second term as (1 - t^2) z (0.5 c + 1.5 c k z^2): two arrays made, in place."""
    one_minus_t2 = t * t
    np.subtract(1.0, one_minus_t2, out=one_minus_t2)
    slope = z * z
    slope *= 1.5 * _SQRT_2_OVER_PI * 0.044715
    slope += 0.5 * _SQRT_2_OVER_PI
    slope *= z
    slope *= one_minus_t2
    half_t = np.multiply(t, 0.5, out=one_minus_t2)
    slope += half_t
    slope += 0.5
    slope *= g
    return slope


def _layer_norm_forward(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LayerNorm over the last axis: the output, x_hat and 1/sigma (the backward's)."""
    centered = x - x.mean(axis=-1, keepdims=True)
    inv_sigma = 1.0 / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    x_hat = centered * inv_sigma
    return x_hat * gamma + beta, x_hat, inv_sigma


def _layer_norm_input_grad(g: np.ndarray, gamma: np.ndarray, x_hat: np.ndarray,
                           inv_sigma: np.ndarray) -> np.ndarray:
    """dx = (g_hat - mean(g_hat) - x_hat mean(g_hat x_hat)) / sigma, g_hat = g gamma."""
    g_hat = g * gamma
    dx = g_hat - g_hat.mean(axis=-1, keepdims=True) \
        - x_hat * (g_hat * x_hat).mean(axis=-1, keepdims=True)
    dx *= inv_sigma
    return dx


# ------------------------------------------------------------ a whole block
def residual_mlp(h: Tensor, gamma: Tensor, beta: Tensor, w1: Tensor, b1: Tensor,
                 w2: Tensor, b2: Tensor, eps: float = 1e-5) -> Tensor:
    """h + fc2(GELU(fc1(LN(h)))) as one node: nn.DenseBlock, the MLP models' block and
    the transformer's FFN half. h is (rows, d) or (B, T, d): every leading axis counts as
    rows, flattened once to (N, d) for the whole block.

        forward    u = LN(h)   a = u W1 + b1   z = GELU(a)   out = h + z W2 + b2
        backward   dz = g W2^T, da = GELU'(a) dz, du = da W1^T, dh = g + LN'(du)
                   dW2 = z^T g, db2 = sum g, dW1 = u^T da, db1 = sum da (via
                   `weight_grad`, so ZB-H1 / ZB-V can put them off), dgamma, dbeta

    It keeps what the five nodes would, but the second linear's output (folded into
    `out` at once): u, x_hat, 1/sigma, a, z and GELU's tanh."""
    if _mp.LOW is not None:  # --mixed: the same block, rounded as core/precision.py says
        return _residual_mlp_mixed(h, gamma, beta, w1, b1, w2, b2, eps)
    shape = h.data.shape
    rows = h.data.reshape(-1, shape[-1])                                    # (N, d), a view
    u, x_hat, inv_sigma = _layer_norm_forward(rows, gamma.data, beta.data, eps)
    a = u @ w1.data                                                         # (N, d) @ (d, f)
    a += b1.data
    z, t = _gelu_forward(a)
    out = z @ w2.data                                                       # (N, f) @ (f, d)
    out += b2.data
    out += rows                                                             # the residual
    parents = (h, gamma, beta, w1, b1, w2, b2)

    def backward(g: np.ndarray) -> None:
        g_rows = g.reshape(-1, shape[-1])                                   # (N, d)
        dz = g_rows @ w2.data.T                                             # (N, d) @ (d, f)

        def fc2_grads() -> None:
            w2.accumulate(z.T @ g_rows, fresh=True)
            b2.accumulate(g_rows.sum(axis=0), fresh=True)
        weight_grad(fc2_grads)
        da = _gelu_backward(dz, a, t)
        du = da @ w1.data.T                                                 # (N, f) @ (f, d)

        def fc1_grads() -> None:
            w1.accumulate(u.T @ da, fresh=True)
            b1.accumulate(da.sum(axis=0), fresh=True)
        weight_grad(fc1_grads)
        gamma.accumulate((du * x_hat).sum(axis=0), fresh=True)
        beta.accumulate(du.sum(axis=0), fresh=True)
        if h.requires_grad:                  # the residual's g plus the LayerNorm's
            dh = _layer_norm_input_grad(du, gamma.data, x_hat, inv_sigma)
            dh += g_rows
            h.accumulate(dh.reshape(shape), fresh=True)
    return _residual_mlp_placed(Tensor.from_op(out.reshape(shape), parents, backward),
                                h, gamma, beta, w1, b1, w2, b2)


def _residual_mlp_placed(result: Tensor, h: Tensor, gamma: Tensor, beta: Tensor, w1: Tensor,
                         b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """`result` of a residual MLP block, with its placement when checking."""
    if _pl.ON:  # placement/__init__.py: the five layers' rules in turn
        _pl.follow(result, _pl.residual_mlp(h, gamma, beta, w1, b1, w2, b2), h.name)
    return result


def _residual_mlp_mixed(h: Tensor, gamma: Tensor, beta: Tensor, w1: Tensor, b1: Tensor,
                        w2: Tensor, b2: Tensor, eps: float) -> Tensor:
    """`residual_mlp` under the mixed-precision policy (core/precision.py). Where each
    value is rounded to 16 bits (L) or kept in the master dtype (M):

        forward    u = L(LN_M(h))   a = L(u W1 + b1)   z = L(GELU_M(a))
                   out = L(h + L(z W2 + b2))            (each matmul: M sums)
        backward   g -> L; dz = L(g W2^T); da = L(GELU'_M(a) dz); du = L(da W1^T)
                   dh = L(L(LN'_M(du)) + g); every weight gradient L(...) once"""
    up, low, mm, once = _mp.upcast, _mp.to_low, _mp.matmul, _mp.widened_once
    shape = h.data.shape
    rows = low(h.data).reshape(-1, shape[-1])                               # (N, d)
    rows_up = up(rows)      # widened once: LayerNorm's input (read, not written) and the residual
    u, x_hat, inv_sigma = _layer_norm_forward(rows_up, up(gamma.data), up(beta.data), eps)
    u = low(u)
    q = _mp.block_operand      # --fp8: Q(X), Q(W), Q(dY) of fc1 and fc2 (core/fp8.py)
    u_q = q(u, "x", w1)
    a = mm(u_q, q(w1.data, "weight", w1))
    a += up(b1.data)
    a = low(a)
    z, t = _gelu_forward(up(a))
    z = low(z)
    z_q = q(z, "x", w2)
    out = mm(z_q, q(w2.data, "weight", w2))
    out += up(b2.data)
    out = up(low(out))
    out += rows_up                                                          # the residual
    out = low(out)
    parents = (h, gamma, beta, w1, b1, w2, b2)

    def backward(g: np.ndarray) -> None:
        g_rows = low(g).reshape(-1, shape[-1])                              # (N, d)
        g_up = up(g_rows)     # widened once: dz, dW2, db2 and the residual's dh use it
        g_q = once(q(g_rows, "dy", w2), g_rows, g_up)
        dz = low(mm(g_q, q(w2.data, "weight", w2).T))

        def fc2_grads() -> None:
            w2.accumulate(low(mm(z_q.T, g_q)), fresh=True)
            b2.accumulate(low(g_up.sum(axis=0)), fresh=True)
        weight_grad(fc2_grads)
        da = low(_gelu_backward(up(dz), up(a), t))
        da_up = up(da)        # widened once: du, dW1 and db1 use it
        da_q = once(q(da, "dy", w1), da, da_up)
        du = up(low(mm(da_q, q(w1.data, "weight", w1).T)))

        def fc1_grads() -> None:
            w1.accumulate(low(mm(u_q.T, da_q)), fresh=True)
            b1.accumulate(low(da_up.sum(axis=0)), fresh=True)
        weight_grad(fc1_grads)
        gamma.accumulate(low((du * x_hat).sum(axis=0)), fresh=True)
        beta.accumulate(low(du.sum(axis=0)), fresh=True)
        if h.requires_grad:
            dh = up(low(_layer_norm_input_grad(du, up(gamma.data), x_hat, inv_sigma)))
            dh += g_up
            h.accumulate(low(dh).reshape(shape), fresh=True)
    return _residual_mlp_placed(Tensor.from_op(out.reshape(shape), parents, backward),
                                h, gamma, beta, w1, b1, w2, b2)


# ------------------------------------------------------ softmax and losses
def softmax(a: Tensor, axis: int = -1, master: bool = False) -> Tensor:
    """exp(a) / sum exp(a), stabilized. Backward: s * (g - sum(g s)). Under --mixed the
    output is rounded to 16 bits, unless `master` (the MoE router's probabilities, which
    feed the gates and the aux loss, not a matmul, stay in the master dtype)."""
    keep = (lambda x: x) if master else _mp.round_low
    data = _mp.upcast(a.data)          # --mixed: in the master dtype, output rounded
    shifted = data - data.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    s = e / e.sum(axis=axis, keepdims=True)

    def backward(g: np.ndarray) -> None:
        g = _mp.upcast(g)
        a.accumulate(_mp.round_low(s * (g - (g * s).sum(axis=axis, keepdims=True))),
                     fresh=True)
    out = Tensor.from_op(keep(s), (a,), backward)
    return _pl.follow(out, _pl.nonlinear("softmax", a, over=axis), a.name) if _pl.ON else out


def log_softmax(a: Tensor, axis: int = -1) -> Tensor:
    """a - logsumexp(a). Backward: g - softmax(a) sum(g)."""
    data = _mp.upcast(a.data)          # --mixed: in the master dtype, kept there
    shifted = data - data.max(axis=axis, keepdims=True)
    out = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))

    def backward(g: np.ndarray) -> None:
        g = _mp.upcast(g)
        a.accumulate(_mp.round_low(g - np.exp(out) * g.sum(axis=axis, keepdims=True)),
                     fresh=True)
    result = Tensor.from_op(out, (a,), backward)
    return _pl.follow(result, _pl.nonlinear("log_softmax", a, over=axis), a.name) \
        if _pl.ON else result


def cross_entropy(logits: Tensor, labels: np.ndarray, scale: float | None = None) -> Tensor:
    """sum_b -log softmax(logits_b)[y_b] * scale; `scale` defaults to 1/N (the mean).
    Rows labelled `documents.IGNORE` (padding) add nothing, to the loss or the gradient.
    logits (N, C) with labels (N,), or (B, T, C) with labels (B, T): every position is a
    row, N = B*T. Passing the scale lets a data-parallel rank divide by the *global* batch.
    Backward: (softmax - onehot(y)) * scale."""
    # --mixed: the loss in the master dtype on upcast logits; their gradient rounded
    flat = _mp.upcast(logits.data).reshape(-1, logits.shape[-1])  # (N, C)
    labels = np.asarray(labels).reshape(-1)                  # (N,)
    scale = 1.0 / flat.shape[0] if scale is None else scale
    valid = labels != IGNORE           # --documents: padded positions count 0 (documents.py)
    rows = np.arange(flat.shape[0])[valid]
    labels = labels[valid]
    shifted = flat - flat.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    total = e.sum(axis=-1, keepdims=True)
    picked = shifted[rows, labels] - np.log(total[rows, 0])
    out = np.asarray(-picked.sum() * scale)

    def backward(g: np.ndarray) -> None:
        d = e / total
        d[rows, labels] -= 1.0
        if rows.size < flat.shape[0]:
            d[~valid] = 0.0
        logits.accumulate(_mp.round_low((d * (g * scale)).reshape(logits.shape)), fresh=True)
    result = Tensor.from_op(out, (logits,), backward)
    return _pl.follow(result, _pl.cross_entropy("cross-entropy", logits), "the loss") \
        if _pl.ON else result
