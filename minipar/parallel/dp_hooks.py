"""Hooks around the pieces of a model: how a strategy learns a gradient is complete.

What this file teaches: each piece of the model (embedding, block, head) is wrapped in a
`Piece`, which puts a marker node on its input in the autograd tape. Backward visits a
node only after everything computed from it, so the marker's backward runs once the
whole piece is done: its parameters' gradients for this microbatch are complete. After
the last microbatch (gradient accumulation: one sync per step) the piece's buckets can
go. ZeRO (zero.py) uses the same hooks to gather and drop parameters around each piece.
The marker costs nothing but its node, except on data (the embedding's input): there
the piece would compute a gradient for it, so `_skip_input_grad` spares it.

Used by overlapped DP (data_parallel.py: `OverlappedAllreduce`) and ZeRO 2/3 (zero.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from minipar import placement
from minipar.core import autograd as ag
from minipar.core.autograd import Tensor
from minipar.core.nn import Module, Parameter


class Hooks:
    """What a strategy may do around each piece of the model; by default nothing."""

    def before_forward(self, piece: Piece) -> None:
        """Just before the piece computes (ZeRO-3: gather its parameters)."""

    def after_forward(self, piece: Piece) -> None:
        """Just after it (ZeRO-3: drop them again)."""

    def before_backward(self, piece: Piece) -> None:
        """Before any of the piece's backward runs (ZeRO-3: gather them again)."""

    def after_backward(self, piece: Piece) -> None:
        """After all of it: its parameters' gradients of this microbatch are complete."""


_ALWAYS = Tensor(np.zeros(()), requires_grad=True)  # makes a marker part of the tape


def _marker(x: Tensor, hook: Callable[[], None], after_weight_grads: bool = False) -> Tensor:
    """Forward: identity. Backward: call `hook`, then pass the gradient on unchanged.
    `_ALWAYS` as a second parent keeps the node on the tape even when x is data.

    With `after_weight_grads`, the hook joins the queue of weight-gradient work when a
    zero-bubble schedule puts that work off (autograd.defer_weight_grads): it then runs
    after the piece's weight gradients, whenever the schedule runs them."""
    def backward(g: np.ndarray) -> None:
        if after_weight_grads:
            ag.weight_grad(hook)  # now, or queued behind the piece's weight gradients
        else:
            hook()
        x.accumulate(g)
    out = Tensor.from_op(x.data, (x, _ALWAYS), backward)
    return placement.follow(out, placement.of(x), x.name) if placement.ON else out


class Piece(Module):
    """A piece of the model (embedding, block or head) with hooks at its four edges.

    Marker nodes on its input and outputs turn the autograd walk into events:
    the output markers' backward runs before any of the piece's backward, the
    input marker's after all of it. Other attributes are read through to the piece.
    """

    def __init__(self, inner: Module, hooks: Hooks) -> None:
        self.inner = inner
        self.hooks = hooks
        self.own = inner.parameters()  # fixed once built; the hooks ask every microbatch

    def parameters(self) -> list[Parameter]:
        return self.own

    def __getattr__(self, name: str) -> object:
        if name == "inner":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor | None]:
        hooks = self.hooks
        hooks.before_forward(self)
        entry = _marker(x, lambda: hooks.after_backward(self), True)
        out = self.inner(entry)
        hooks.after_forward(self)
        data = None if x.requires_grad else entry  # the input is data (the embedding's)

        def backward_starts() -> None:
            if data is not None:
                _skip_input_grad(data)
            hooks.before_backward(self)
        outs = out if isinstance(out, tuple) else (out,)
        marked = tuple(t if t is None else _marker(t, backward_starts)
                       for t in outs)  # a block returns (h, aux): both lead back here
        return marked if isinstance(out, tuple) else marked[0]


def _skip_input_grad(entry: Tensor) -> None:
    """Spare the piece the gradient of a data input, which nobody uses. The input marker
    must be on the tape for its hook, so the piece's first op would compute a gradient
    for it (the embedding's: one (B, d) @ (d, d_in) matmul per microbatch, thrown away
    by the data). Called as the piece's backward starts: the first op then sees an input
    needing no gradient, and the marker gets a placeholder one, which is what makes the
    walk run its backward (the hook) after the piece's. No number changes."""
    entry.grad = np.zeros(())
    entry.requires_grad = False


def install_hooks(chunks: Sequence[Module], hooks: Hooks) -> list[Piece]:
    """Wrap every piece of every chunk (in place) in a `Piece` calling `hooks`;
    returns the pieces in forward order."""
    pieces: list[Piece] = []
    for chunk in chunks:
        if chunk.embed is not None:
            chunk.embed = Piece(chunk.embed, hooks)
            pieces.append(chunk.embed)
        chunk.blocks = [Piece(block, hooks) for block in chunk.blocks]
        pieces += chunk.blocks
        if chunk.head is not None:
            chunk.head = Piece(chunk.head, hooks)
            pieces.append(chunk.head)
    return pieces
