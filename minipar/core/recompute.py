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

Placements (placement/__init__.py, `--check-placements`): the first forward, without a tape,
is checked as any forward is, and the node's output takes the placements it derived.
The replay in the backward is the same ops on the same placements: it runs with
checking paused (`placement.paused`), so nothing is checked or recorded twice, and a
violation can only stop the forward, where every rank stops at the same op.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minipar import placement
from minipar.core import autograd as ag
from minipar.core import routing
from minipar.core.autograd import Tensor
from minipar.core.nn import Module, Parameter


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
            with placement.paused():  # checked in the forward already (module docstring)
                again = op(*(fresh.get(id(a), a) for a in args),
                           **{k: fresh.get(id(v), v) for k, v in options.items()})
            again.backward(g)
            for t in inputs:
                if fresh[id(t)].grad is not None:
                    t.accumulate(fresh[id(t)].grad, fresh=True)
        result = Tensor.from_op(out.data, inputs, backward)
        return placement.follow(result, placement.of(out), out.name, summed=True) \
            if placement.ON else result
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
            # checked in the forward already (module docstring); its routing counted
            # there too (routing.py: b's load is the step's tokens, once each)
            with placement.paused(), routing.not_counting():
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
        if placement.ON:  # the placements the forward derived
            placement.follow(result, placement.of(out), out.name, summed=True)
        if aux is None:
            return result, None

        def keep_aux(g: np.ndarray) -> None:
            seeds["aux"] = g
            if result.grad is None:  # the loss uses aux only: h' still runs its backward
                result.accumulate(np.zeros_like(result.data), fresh=True)
        aux_out = Tensor.from_op(aux.data, (result,), keep_aux)
        return result, placement.follow(aux_out, placement.of(aux), aux.name, summed=True) \
            if placement.ON else aux_out


# ------------------------------------------------------------ what the tape keeps
def _buffer(a: np.ndarray) -> np.ndarray:
    """The array that owns `a`'s memory (a view's base, all the way down)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def tape_bytes(out: Tensor, exclude: tuple[Tensor, ...] = ()) -> int:
    """Bytes of the arrays the tape behind `out` keeps alive for the backward: every
    node's output and every array its backward closure holds (lesson 5 counted the
    outputs alone; attention's probabilities, LayerNorm's x_hat, GELU's tanh live in
    closures). Parameters, the arrays of `exclude` (a block's input) and views of
    arrays already counted are not counted again: one buffer, one count."""
    skip = {id(_buffer(t.data)) for t in exclude}
    held: dict[int, int] = {}
    seen: set[int] = set()

    def keep(a: np.ndarray) -> None:
        root = _buffer(a)
        if id(root) not in skip and a.dtype.kind == "f":
            held[id(root)] = root.nbytes

    def visit(value: object) -> None:  # a closure cell: arrays, tensors, containers
        if isinstance(value, Parameter):
            return
        if isinstance(value, Tensor):
            stack.append(value)
        elif isinstance(value, np.ndarray):
            keep(value)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    stack = [out]
    while stack:
        node = stack.pop()
        if id(node) in seen or isinstance(node, Parameter) or not node.requires_grad:
            continue
        seen.add(id(node))
        if not any(node is t for t in exclude):
            keep(node.data)
        for cell in getattr(node._backward, "__closure__", None) or ():
            visit(cell.cell_contents)
        stack.extend(node.parents)
    return sum(held.values())


def gpt_block_activation_bytes(tokens: int, d_model: int, d_ff: int, heads: int,
                               seq_len: int, itemsize: int, tp: int = 1, sp: bool = False,
                               recompute: str = "none") -> int:
    """Bytes one dense transformer block of minipar keeps for its backward, per rank
    and microbatch of `tokens` = b s positions (`tape_bytes` measures exactly this).

    Counted array by array (h, the block input, belongs to the block before):

      whole on every rank   LN1 out, x_hat; proj out; h'; LN2 out, x_hat; h_out (7 b d:
                            at tp = 1 the FFN half is one node, fused.residual_mlp, whose
                            fc2 output goes straight into h_out); with tp the FFN is
                            five nodes again, which keep fc2's output too, and each
                            reduction adds its sum and the bias added after it (2 b d
                            per reduction: 12 b d)
      split by heads / f    q, k, v, o (4 b d), fc1 out, GELU out and its tanh (3 b f)
      scores                k + bk (b d), P (b H s), its log-sum-exp (b H)
      small                 LayerNorm's 1/sigma (2 b)

    so, in numbers per position,

      tp = 1    7d + 5d + 3f + 2 + H s + H
      tp > 1    12d + (5d + 3f + H s + H)/t + 2
      tp + sp   4d + (10d + 5d + 3f + H s + H + 2)/t  (4d: the two Allgathered inputs
                and the two partial sums before the Reduce_scatters, whole on every rank)

    selective drops the scores (b d + b H s + b H, over t); full keeps only the block
    output, b d (over t with sp), which is the next block's input. Beside Korthikanti
    et al.'s sbh(34 + 5as/h) bytes in 16-bit numbers: with f = 4d, tp = 1 this is
    24d + 2 + H s + H numbers, where Megatron's 34h bytes are 17 h numbers plus 1-byte
    dropout masks; minipar has no dropout (no masks), but its tape keeps what Megatron
    frees or never makes: x_hat beside LN's output, GELU's tanh, k + bk, the
    sums before and after each bias, and under sp the gathered inputs (Megatron
    gathers them again in the backward) -- which is why sp leaves 4d whole here."""
    b, d, f = tokens, d_model, d_ff
    scores = b * d + b * heads * seq_len + b * heads
    if recompute == "selective":
        scores = 0
    if recompute == "full":
        numbers = b * d // (tp if sp else 1)
    elif tp == 1:
        numbers = 7 * b * d + 4 * b * d + 3 * b * f + 2 * b + scores
    elif not sp:
        numbers = 12 * b * d + (4 * b * d + 3 * b * f + scores) // tp + 2 * b
    else:
        numbers = 4 * b * d + (10 * b * d + 4 * b * d + 3 * b * f + scores + 2 * b) // tp
    return numbers * itemsize
