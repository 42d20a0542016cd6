"""Optimizers that update plain lists of arrays.

What this file teaches: an optimizer is a rule `p <- p - step(g, state)` applied
element by element. Because it never needs to know which model a number
belongs to, ZeRO can hand it just this rank's *shard* of the parameters and
gradients (a flat slice) and it works unchanged.

    SGD:  p -= lr * g
    Adam: m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
          p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

Muon (muon.py) is not elementwise: it needs each weight matrix whole. So every
strategy hands its optimizer the same three things, whatever it holds: the arrays
it updates, their gradients, and `held`: for each array, which boxes of which
canonical parameters its elements are (`Held`). An elementwise rule ignores
`held`; Muon reads it to find the other pieces of each matrix on the mesh. This
is the one door between a strategy and its optimizer (docs/design.md, "Muon").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from minipar.core.held import Held, held_whole

__all__ = ["SGD", "Adam", "Held", "Optimizer", "held_whole", "make_optimizer"]


class SGD:
    """Plain gradient descent; no state."""

    def __init__(self, lr: float) -> None:
        self.lr = lr
        self.t = 0

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray],
             held: Sequence[Sequence[Held]] | None = None) -> None:
        """Update every array of `params` in place from the matching gradient (`held`:
        what the arrays are; an elementwise rule has no use for it)."""
        self.t += 1
        for p, g in zip(params, grads):
            p -= self.lr * g

    def state_arrays(self) -> dict[str, list[np.ndarray]]:
        """Optimizer state per parameter slot (none for SGD), for checkpoints."""
        return {}

    def held_state(self) -> dict[str, list[np.ndarray]]:
        """The state arrays as kept, for the memory report (none)."""
        return {}

    def bind(self, meeting: object) -> None:
        """How matrices meet over the mesh (parallel/muon_mesh.py): an elementwise rule
        needs no one else's numbers."""

    def state_per_parameter(self, name: str, shape: tuple[int, ...]) -> int:
        """Arrays of optimizer state a parameter needs (SGD: none)."""
        return 0


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

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray],
             held: Sequence[Sequence[Held]] | None = None) -> None:
        """One Adam update of every array of `params`, in place (`held`: unused)."""
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

    def held_state(self) -> dict[str, list[np.ndarray]]:
        """The state arrays as kept, for the memory report: m and v."""
        return self.state_arrays()

    def bind(self, meeting: object) -> None:
        """How matrices meet over the mesh (parallel/muon_mesh.py): an elementwise rule
        needs no one else's numbers."""

    def state_per_parameter(self, name: str, shape: tuple[int, ...]) -> int:
        """Arrays of optimizer state a parameter needs (Adam: m and v)."""
        return 2


class Optimizer(Protocol):
    """What every strategy hands its arrays to: SGD, Adam, Muon (muon.py)."""

    lr: float
    t: int   # steps taken

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray],
             held: Sequence[Sequence[Held]] | None = None) -> None:
        """Update `params` in place from `grads`; `held` says what each array holds."""

    def state_arrays(self) -> dict[str, list[np.ndarray]]:
        """Each state slot as one array per handed array, for checkpoints."""

    def held_state(self) -> dict[str, list[np.ndarray]]:
        """The state arrays as the optimizer keeps them: the bytes it holds."""

    def bind(self, meeting: object) -> None:
        """How a matrix's pieces meet over the mesh (parallel/muon_mesh.py), before the
        first step."""

    def state_per_parameter(self, name: str, shape: tuple[int, ...]) -> int:
        """How many arrays of the parameter's size its optimizer state needs."""


OPTIMIZERS = ("sgd", "adam", "muon")


def make_optimizer(name: str, lr: float, **rule: object) -> Optimizer:
    """`--optimizer sgd|adam|muon` -> an optimizer object (`rule`: Muon's momentum,
    nesterov, ns_steps, weight_decay and mode, muon.py)."""
    if name == "sgd":
        return SGD(lr)
    if name == "adam":
        return Adam(lr)
    if name == "muon":
        from minipar.core.muon import Muon

        return Muon(lr, **rule)
    raise ValueError(f"unknown optimizer {name!r}")
