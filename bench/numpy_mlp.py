"""The yardstick: one training step of the reference MLP written as plain NumPy.

Forward and backward by hand, no tape, no closures: the fastest honest way to
run docs/design.md's dense model on one thread. `bench/run.py` times minipar's
autograd against this, so "the autograd adds little" is a measured ratio.
"""

from __future__ import annotations

import math

import numpy as np

C = math.sqrt(2.0 / math.pi)


def numpy_step(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, layers: int,
               lr: float) -> float:
    """Forward, backward and an SGD update of the dense model, in place; returns the loss."""
    h = x @ params["embed.weight"] + params["embed.bias"]
    saved = []
    for i in range(layers):
        p = f"blocks.{i}"
        mu = h.mean(axis=1, keepdims=True)
        xc = h - mu
        inv = 1.0 / np.sqrt((xc * xc).mean(axis=1, keepdims=True) + 1e-5)
        xh = xc * inv
        u = xh * params[f"{p}.ln.weight"] + params[f"{p}.ln.bias"]
        a = u @ params[f"{p}.fc1.weight"] + params[f"{p}.fc1.bias"]
        t = np.tanh(C * (a + 0.044715 * a * a * a))
        z = 0.5 * a * (1.0 + t)
        saved.append((xh, inv, u, a, t, z))
        h = h + z @ params[f"{p}.fc2.weight"] + params[f"{p}.fc2.bias"]
    logits = h @ params["head.weight"] + params["head.bias"]
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    total = e.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(-(shifted[rows, y] - np.log(total[:, 0])).mean())
    d = e / total
    d[rows, y] -= 1.0
    d /= len(y)
    grads = {"head.weight": h.T @ d, "head.bias": d.sum(axis=0)}
    dh = d @ params["head.weight"].T
    for i in reversed(range(layers)):
        p = f"blocks.{i}"
        xh, inv, u, a, t, z = saved[i]
        grads[f"{p}.fc2.weight"] = z.T @ dh
        grads[f"{p}.fc2.bias"] = dh.sum(axis=0)
        dz = dh @ params[f"{p}.fc2.weight"].T
        da = dz * (0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * C * (1.0 + 3 * 0.044715 * a * a))
        grads[f"{p}.fc1.weight"] = u.T @ da
        grads[f"{p}.fc1.bias"] = da.sum(axis=0)
        du = da @ params[f"{p}.fc1.weight"].T
        grads[f"{p}.ln.weight"] = (du * xh).sum(axis=0)
        grads[f"{p}.ln.bias"] = du.sum(axis=0)
        gh = du * params[f"{p}.ln.weight"]
        dx = (gh - gh.mean(axis=1, keepdims=True)
              - xh * (gh * xh).mean(axis=1, keepdims=True)) * inv
        dh = dh + dx
    grads["embed.weight"] = x.T @ dh
    grads["embed.bias"] = dh.sum(axis=0)
    for name, g in grads.items():
        params[name] -= lr * g
    return loss
