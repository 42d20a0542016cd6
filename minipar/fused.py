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

`linear` leaves its weight gradients to `autograd._weight_grad`, so a zero-bubble
pipeline can run them later (`autograd.defer_weight_grads`). The finite-difference
checks of `tests/test_autograd.py` cover every op here.
"""

from __future__ import annotations

import math

import numpy as np

from minipar import placement as _pl
from minipar.autograd import Tensor, _weight_grad

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x @ W + b, one fused node. Weights are (in, out); x is (rows, in) or, for a
    sequence model, (B, T, in): every leading axis counts as rows.
    Backward: dx = g W^T, dW = x^T g, db = sum_rows g (the sums run over all B*T rows).
    The rows are flattened to one (N, in) matrix first: one BLAS call, not one per row
    of a stacked matmul."""
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
        _weight_grad(weight_grads)
    result = Tensor.from_op(out, parents, backward)
    if _pl.ON:  # placement.py: data, column and row parallelism's rules, then the bias
        layer = weight.name.removesuffix(".weight")
        _pl.follow(result, _pl.linear(f"{layer} linear", x, weight, bias), f"{layer} output")
    return result


def gelu(a: Tensor) -> Tensor:
    """GELU, tanh form: 0.5 z (1 + tanh(sqrt(2/pi)(z + 0.044715 z^3))). One fused node."""
    z = a.data
    inner = _SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    t = np.tanh(inner)
    out = 0.5 * z * (1.0 + t)

    def backward(g: np.ndarray) -> None:
        dinner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * z * z)
        a.accumulate(g * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * dinner), fresh=True)
    result = Tensor.from_op(out, (a,), backward)
    return _pl.follow(result, _pl.nonlinear("GELU", a), a.name) if _pl.ON else result


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis (biased var).
    One fused node; the backward is the standard closed form
    dx = (g_hat - mean(g_hat) - x_hat mean(g_hat x_hat)) / sigma, g_hat = g gamma."""
    mu = x.data.mean(axis=-1, keepdims=True)
    centered = x.data - mu
    inv_sigma = 1.0 / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    x_hat = centered * inv_sigma
    out = x_hat * gamma.data + beta.data

    def backward(g: np.ndarray) -> None:
        lead = tuple(range(g.ndim - 1))
        gamma.accumulate((g * x_hat).sum(axis=lead), fresh=True)
        beta.accumulate(g.sum(axis=lead), fresh=True)
        if x.requires_grad:
            g_hat = g * gamma.data
            dx = g_hat - g_hat.mean(axis=-1, keepdims=True) \
                - x_hat * (g_hat * x_hat).mean(axis=-1, keepdims=True)
            x.accumulate(dx * inv_sigma, fresh=True)
    result = Tensor.from_op(out, (x, gamma, beta), backward)
    if _pl.ON:
        layer = gamma.name.removesuffix(".weight")
        _pl.follow(result, _pl.layer_norm(f"LayerNorm {layer}", x, gamma, beta),
                   f"{layer} output")
    return result


# ------------------------------------------------------ softmax and losses
def softmax(a: Tensor, axis: int = -1) -> Tensor:
    """exp(a) / sum exp(a), stabilized. Backward: s * (g - sum(g s))."""
    shifted = a.data - a.data.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    s = e / e.sum(axis=axis, keepdims=True)

    def backward(g: np.ndarray) -> None:
        a.accumulate(s * (g - (g * s).sum(axis=axis, keepdims=True)), fresh=True)
    out = Tensor.from_op(s, (a,), backward)
    return _pl.follow(out, _pl.nonlinear("softmax", a, over=axis), a.name) if _pl.ON else out


def log_softmax(a: Tensor, axis: int = -1) -> Tensor:
    """a - logsumexp(a). Backward: g - softmax(a) sum(g)."""
    shifted = a.data - a.data.max(axis=axis, keepdims=True)
    out = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))

    def backward(g: np.ndarray) -> None:
        a.accumulate(g - np.exp(out) * g.sum(axis=axis, keepdims=True), fresh=True)
    result = Tensor.from_op(out, (a,), backward)
    return _pl.follow(result, _pl.nonlinear("log_softmax", a, over=axis), a.name) \
        if _pl.ON else result


def cross_entropy(logits: Tensor, labels: np.ndarray, scale: float | None = None) -> Tensor:
    """sum_b -log softmax(logits_b)[y_b] * scale; `scale` defaults to 1/N (the mean).
    logits (N, C) with labels (N,), or (B, T, C) with labels (B, T): every position is a
    row, N = B*T. Passing the scale lets a data-parallel rank divide by the *global* batch.
    Backward: (softmax - onehot(y)) * scale."""
    flat = logits.data.reshape(-1, logits.shape[-1])         # (N, C)
    labels = np.asarray(labels).reshape(-1)                  # (N,)
    rows = np.arange(flat.shape[0])
    scale = 1.0 / flat.shape[0] if scale is None else scale
    shifted = flat - flat.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    total = e.sum(axis=-1, keepdims=True)
    picked = shifted[rows, labels] - np.log(total[:, 0])
    out = np.asarray(-picked.sum() * scale)

    def backward(g: np.ndarray) -> None:
        d = e / total
        d[rows, labels] -= 1.0
        logits.accumulate((d * (g * scale)).reshape(logits.shape), fresh=True)
    result = Tensor.from_op(out, (logits,), backward)
    return _pl.follow(result, _pl.cross_entropy("cross-entropy", logits), "the loss") \
        if _pl.ON else result
