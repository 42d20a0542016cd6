"""Activation recomputation: keep less from the forward, compute it again in the backward.

What this file teaches (Chen et al. 2016; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models"). A tape keeps, from every
node's forward, what its backward needs: a block's LayerNorm output, its wide FFN
activations, attention's (B, H, T, T) probabilities. Recomputation trades that memory
for time: a node keeps only its *inputs*, and its backward first runs the forward
again (with a tape, this time) and then backpropagates through that fresh tape,
which dies as soon as the gradients have left.

    --recompute full       each block is one such node: it keeps the block input alone
                           and pays one more forward of the block in the backward
                           (FLOPs 6 -> 8 per parameter and token; collectives inside
                           the block run again too)
    --recompute selective  only the attention core (scores, mask, softmax, P V) is one:
                           it keeps q, k, v and drops the T x T arrays, the part of a
                           transformer's activations that grows with T^2, for the
                           price of recomputing a few batched matmuls and no
                           communication at all

The forward run again is the same computation on the same numbers, so the gradients
are bit for bit those without recomputation: `--check` holds on every mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minipar import autograd as ag
from minipar.autograd import Tensor
from minipar.nn import Module, Parameter


def recomputed(op: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`op` as a node that keeps only its tensor arguments: the forward runs without a
    tape, the backward runs `op` again on them (with a tape) and backpropagates through
    it. The arrays `op` saves for its backward live only inside this node's backward."""
    def run(*args: object, **options: object) -> Tensor:
        inputs = [t for t in (*args, *options.values()) if isinstance(t, Tensor)]
        with ag.no_grad():
            out = op(*args, **options)

        def backward(g: np.ndarray) -> None:
            fresh = {id(t): Tensor(t.data, requires_grad=t.requires_grad) for t in inputs}
            again = op(*(fresh.get(id(a), a) for a in args),
                       **{k: fresh.get(id(v), v) for k, v in options.items()})
            again.backward(g)
            for t in inputs:
                if fresh[id(t)].grad is not None:
                    t.accumulate(fresh[id(t)].grad, fresh=True)
        return Tensor.from_op(out.data, inputs, backward)
    return run


class Recomputed(Module):
    """A block h -> (h', aux) that keeps only h for its backward (`--recompute full`).

    Forward: the block without a tape. Backward: the block again on a fresh leaf copy
    of h, with a tape, then backpropagation from (h', its gradient) and (aux, its
    gradient) through it; the parameters receive their gradients there, h receives
    the leaf's. The aux loss is a second output: a node after h' whose backward only
    records its gradient, so h' always runs after it (it is a consumer of h')."""

    def __init__(self, block: Module) -> None:
        self.block = block

    def __getattr__(self, name: str) -> object:  # ln, fc1, partial_over_tp, last_stats...
        return getattr(self.__dict__["block"], name)

    def parameters(self) -> list[Parameter]:
        return self.block.parameters()

    def __call__(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        with ag.no_grad():
            out, aux = self.block(h)
        seeds: dict[str, np.ndarray] = {}

        def backward(g: np.ndarray) -> None:
            leaf = Tensor(h.data, requires_grad=h.requires_grad)
            again, aux_again = self.block(leaf)
            roots = [(again, g)]
            if aux_again is not None and "aux" in seeds:
                roots.append((aux_again, seeds.pop("aux")))
            ag.backward_from(roots)
            if leaf.grad is not None:
                h.accumulate(leaf.grad, fresh=True)
        # the parameters are reached through the backward, not the tape: mark the node
        # as needing a gradient even when h does not (the first block after the embedding
        # of a pipeline stage that is not first gets a constant h)
        parents = (h, *self.block.parameters())
        result = Tensor.from_op(out.data, parents, backward)
        if aux is None:
            return result, None

        def keep_aux(g: np.ndarray) -> None:
            seeds["aux"] = g
            if result.grad is None:  # the loss uses aux only: h' still runs its backward
                result.accumulate(np.zeros_like(result.data), fresh=True)
        return result, Tensor.from_op(aux.data, (result,), keep_aux)
