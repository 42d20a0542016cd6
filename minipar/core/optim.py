"""Optimizers that update plain lists of arrays.

What this file teaches: an optimizer is a rule `p <- p - step(g, state)` applied
element by element. Because it never needs to know which model a number
belongs to, ZeRO can hand it just this rank's *shard* of the parameters and
gradients (a flat slice) and it works unchanged.

    SGD:  p -= lr * g
    Adam: m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
          p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SGD:
    """Plain gradient descent; no state."""

    def __init__(self, lr: float) -> None:
        self.lr = lr
        self.t = 0

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> None:
        """Update every array of `params` in place from the matching gradient."""
        self.t += 1
        for p, g in zip(params, grads):
            p -= self.lr * g

    def state_arrays(self) -> dict[str, list[np.ndarray]]:
        """Optimizer state per parameter slot (none for SGD), for checkpoints."""
        return {}


class Adam:
    """Adam (Kingma & Ba) with bias correction; m and v are kept per array slot.

    The state is created on the first step with the shapes of the arrays it is
    given: hand it shards and it keeps sharded state (ZeRO stage 1).
    """

    def __init__(self, lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.t = 0
        self.m: list[np.ndarray] = []
        self.v: list[np.ndarray] = []

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> None:
        """One Adam update of every array of `params`, in place."""
        if not self.m:
            self.m = [np.zeros_like(p) for p in params]
            self.v = [np.zeros_like(p) for p in params]
        self.t += 1
        correct1 = 1.0 - self.b1 ** self.t
        correct2 = 1.0 - self.b2 ** self.t
        for p, g, m, v in zip(params, grads, self.m, self.v):
            m *= self.b1
            m += (1.0 - self.b1) * g
            v *= self.b2
            v += (1.0 - self.b2) * (g * g)
            p -= self.lr * (m / correct1) / (np.sqrt(v / correct2) + self.eps)

    def state_arrays(self) -> dict[str, list[np.ndarray]]:
        """`{"m": [...], "v": [...]}`, one array per parameter slot, for checkpoints."""
        return {"m": self.m, "v": self.v} if self.m else {}


Optimizer = SGD | Adam  # what every updater is handed: `step(params, grads)`, `state_arrays()`


def make_optimizer(name: str, lr: float) -> Optimizer:
    """`--optimizer sgd|adam` -> an optimizer object."""
    if name == "sgd":
        return SGD(lr)
    if name == "adam":
        return Adam(lr)
    raise ValueError(f"unknown optimizer {name!r}")
