"""The pipeline worker beyond one chain of stages: the V layouts, DualPipe's two chains and
the split backward (v_schedules.py builds their orders; executor.py's `StageWorker` runs
the loop layouts of GPipe, 1F1B and interleaved 1F1B, which this extends).

    W      the split schedules (ZB-H1, Qi et al. 2023; ZB-V, DualPipeV, DualPipe): B
           computes the input gradients now, W the weight-gradient matmuls B put off
           (autograd.defer_weight_grads)
    F&B    DualPipe(V): the forward of one (chunk, microbatch), then the backward and W
           of another, in one step (on GPUs one's compute hides the other's traffic;
           here they run one after the other)

In a V (ZB-V, DualPipeV) rank s holds virtual stages s and 2pp-1-s; at the bottom of
the V rank pp-1 hands its chunk 0's output to its chunk 1 (and chunk 1's input gradient
back to chunk 0) itself, with no message: a copy into a fresh leaf, exactly what a
Send/Recv would deliver. DualPipe's rank r holds stage r of one copy of the model (its
microbatches enter at rank 0) and stage pp-1-r of another (entering at rank pp-1);
after the step's instructions the mirror ranks r and pp-1-r add their copies'
gradients (`sum_the_two_copies`).

Run it: `mpiexec -n 4 python -m minipar train --pp 4 --layers 8 --microbatches 8
--schedule dualpipev --check`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from minipar.core import autograd as ag
from minipar.core import precision
from minipar.core.autograd import Tensor
from minipar.core.nn import Model
from minipar.parallel.pipeline.chunk_layout import LOOP, local_boundary
from minipar.parallel.pipeline.executor import StageWorker, rows_of
from minipar.parallel.pipeline.instructions import OVERLAPPED, WEIGHT, Instruction

if TYPE_CHECKING:
    from minipar.comm.collectives import Group


@functools.cache
def extended(worker: type[StageWorker]) -> type[StageWorker]:
    """`worker` (executor.StageWorker, or a class derived from it) with `TwoChunks`
    mixed in: it takes `layout` and `split_backward` besides the worker's own arguments."""
    return type(f"TwoChunks{worker.__name__}", (TwoChunks, worker), {})


class TwoChunks:
    """A stage worker's extension (`extended`): chunks in a V or on two chains
    (`layout`, chunk_layout.py), and the backward split into B and W (`split_backward`)."""

    def __init__(self, *args: object, layout: str = LOOP, split_backward: bool = False,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.layout, self.split_backward = layout, split_backward
        self.deferred: dict[tuple[int, int], list] = {}   # the put-off weight work
        self.handlers.update({WEIGHT: self.weight, OVERLAPPED: self.overlapped})

    def fed_locally(self, chunk: int) -> bool:
        """Whether this chunk's input comes from this rank's other chunk (the V's bottom)."""
        v = self.where(chunk)
        return not self.is_first(chunk) and local_boundary(self.pp, self.stage, v - 1,
                                                           self.layout)

    def feeds_locally(self, chunk: int) -> bool:
        """Whether this chunk's output goes to this rank's other chunk (the V's bottom)."""
        v = self.where(chunk)
        return not self.is_last(chunk) and local_boundary(self.pp, self.stage, v, self.layout)

    def forward(self, ins: Instruction) -> None:
        if self.fed_locally(ins.chunk):  # the V's bottom: this rank's chunk 0's output
            previous = self.outputs[(ins.chunk - 1, ins.microbatch)][0].data
            self.inputs[(ins.chunk, ins.microbatch)] = rows_of(
                Tensor(previous.copy(), requires_grad=True), self.boundary_rows_over)
        super().forward(ins)

    def roots(self, ins: Instruction, out: Tensor, aux: Tensor | None) -> list:
        if not self.feeds_locally(ins.chunk):
            return super().roots(ins, out, aux)
        grad = self.inputs.pop((ins.chunk + 1, ins.microbatch)).grad  # chunk 1's input's
        return [(out, grad)] + ([(aux, self.aux_weight * self.backward_seed)]
                                if aux is not None else [])

    def backward(self, ins: Instruction) -> None:
        if not self.split_backward:
            super().backward(ins)
            return
        with ag.defer_weight_grads() as pending:   # B now (input gradients), W later
            super().backward(ins)
        self.deferred[(ins.chunk, ins.microbatch)] = pending

    def weight(self, ins: Instruction) -> None:
        for work in self.deferred.pop((ins.chunk, ins.microbatch)):
            work()

    def overlapped(self, ins: Instruction) -> None:
        """F&B: the forward of one microbatch, then the full backward (B, W) of another.
        The receives of both ran before this step, the sends of both run after it."""
        forward, backward, weight = ins.parts()
        self.forward(forward)
        self.backward(backward)
        self.weight(weight)


def sum_the_two_copies(chunks: list[Model], pp_group: Group) -> None:
    """DualPipe: each stage's gradient becomes the sum of its two copies' gradients.

    Rank r holds stage r of one copy (chunk 0) and stage pp-1-r of the other (chunk 1);
    rank pp-1-r holds the same two stages the other way round. Each stage's gradient
    is the sum of its two copies' (microbatches 0..M/2-1 through one, M/2..M-1 through
    the other): one process's gradient. Both ranks add the same two numbers, so the
    copies stay equal through the optimizer step.
    """
    partner = pp_group.size - 1 - pp_group.rank
    mine = [p for chunk in chunks for p in chunk.parameters()]
    for p in mine:
        p.grad = np.zeros(p.data.shape, dtype=precision.grad_dtype(p.data.dtype)) \
            if p.grad is None else p.grad
    flat = np.concatenate([p.grad.ravel() for p in mine])     # chunk 0's, then chunk 1's
    received = np.empty_like(flat)
    # gradients of both copies held here (2 L/pp blocks) <-> the mirror rank pp-1-r
    pp_group.Sendrecv(flat, dest=partner, recvbuf=received, source=partner)
    offset = 0  # the partner's chunk 0 is our chunk 1's stage, its chunk 1 our chunk 0's
    for p in [p for chunk in reversed(chunks) for p in chunk.parameters()]:
        p.grad = p.grad + received[offset:offset + p.grad.size].reshape(p.grad.shape)
        offset += p.grad.size
