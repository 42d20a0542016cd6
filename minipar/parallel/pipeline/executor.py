"""Pipeline parallelism: the model cut into stages that pass activations along.

What this file teaches (the source text's fourth strategy: 48 layers on 4
ranks, 1-12 / 13-24 / 25-36 / 37-48). Stage s holds a contiguous run of blocks
(`assemble.build_rank_model`: the embedding on the first stage, the head on the
last; with --virtual V, V chunks per rank, virtual stages s, s + pp, ...). A
microbatch's activation (B/(M dp), d) goes forward from stage to stage by
Send/Recv, and the gradient of that activation comes back the same way.
The messages travel on `mesh.pp`, whose ranks share their dp and tp
coordinates: with tensor parallelism, tp rank k of one stage talks only to tp
rank k of the next (each holds the whole activation, or with --sp its rows).

The order in which a stage runs forwards and backwards is the schedule
(GPipe, Huang et al. 2019; 1F1B, PipeDream-flush, Narayanan et al. 2021;
interleaved 1F1B, Megatron-LM): a list computed by
parallel/pipeline/schedules.py, which also simulates it. This file is only the worker
that runs a list (ShallowSpeed's design):

    recv_act   Recv the input activation of (chunk, microbatch) from the previous rank
    F          forward of the chunk; the last stage adds the loss CE/M + aux/M
    send_act   Isend the output activation to the next rank
    recv_grad  Recv the gradient of that output from the next rank
    B          backward: from the loss (last stage) or from (output, received gradient)
               plus (aux, 1/M) for a stage with MoE blocks
    send_grad  Isend the gradient of the input back to the previous rank

The V layouts (ZB-V, DualPipeV), DualPipe's two chains and the split backward (B now,
W later: ZB-H1 and those three) extend this worker in v_executor.py; what --trace
records around it is stage_trace.py's.

Why Isend and a blocking Recv: with blocking sends (MPI's rendezvous protocol for large
messages) 1F1B deadlocks -- stage 0 sends F2's activation while stage 1 sends B1's
gradient, each waiting for the other's Recv. With Isend a rank waits only in Recv, and
the simulator proves every Recv's message is sent (tests/parallel/test_pipeline_schedules.py).
Messages carry tag 0 (activation) or 1 (gradient), sent and received in the same order
in each direction: MPI never lets two messages with the same tag overtake each other.

Placements: what crosses a stage boundary keeps its placement (rows Shard(0) over dp,
under sequence parallelism over tp too), declared again on the receiving side
(`rows_of`); Send/Recv move it whole, so a partial sum is refused before it is sent.

Run it: `mpiexec -n 4 python -m minipar train --pp 4 --microbatches 8 --schedule 1f1b --check`,
or the lesson `mpiexec -n 4 python lessons/04_pipeline_parallel.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from minipar import placement
from minipar.comm import flight, trace
from minipar.core import autograd as ag
from minipar.core import precision
from minipar.core.autograd import Tensor
from minipar.core.nn import Model
from minipar.parallel.pipeline import chunk_layout, stage_trace
from minipar.parallel.pipeline.instructions import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    Instruction,
)
from minipar.parallel.pipeline.schedules import schedule
from minipar.placement import Shard

if TYPE_CHECKING:
    from minipar.comm.collectives import Group

ACT_TAG, GRAD_TAG = 0, 1

# The last stage's loss of one microbatch from (logits, the chunk's aux loss or None,
# labels): the caller's to define (run/mesh_step.py: CE/M + aux/M); the pipeline only runs it.
LossFunction = Callable[[Tensor, "Tensor | None", np.ndarray], Tensor]


def rows_of(t: Tensor, groups: Sequence[Group | tuple[Group, int]]) -> Tensor:
    """`t` declared Shard(0) over each group: its rows are one piece of the batch; a
    `(group, dim)` pair declares Shard(dim) (the transformer's positions, dim 1, over
    cp, and over tp under sequence parallelism)."""
    for group in groups:
        group, dim = group if isinstance(group, tuple) else (group, 0)
        placement.place(t, group, Shard(dim))
    return t


class StageWorker:
    """Runs one rank's instruction list for one training step.

    Everything a microbatch needs between its forward and its backward is kept
    per (chunk, microbatch) -- its input, its output, its aux loss, the received
    gradient -- never in one shared buffer, because 1F1B has several microbatches
    in flight at once.

    What it is given, and nothing else: the pipeline group `pp_group` (its rank is
    this stage), the model `chunks` this rank holds (`virtual` of them), the step's
    batch `x, y` with this rank's `rows` of each microbatch, the last stage's `loss`
    function, `aux_weight` (what a block's aux loss counts for in the step's loss:
    1/M), the `boundary` shape of an activation and its `dtype` (the model's; by
    default x's, which for the transformer holds integer token ids instead), and the
    groups over which the data's rows (`rows_over`) and a boundary activation's
    (`boundary_rows_over`) are split. `rank` only labels the timeline.
    """

    layout = chunk_layout.LOOP   # the chunks loop round the ranks (v_executor.py: V, DUAL)

    def __init__(self, pp_group: Group, chunks: list[Model], x: np.ndarray, y: np.ndarray,
                 rows: list[slice], loss: LossFunction, aux_weight: float,
                 boundary: tuple[int, ...], virtual: int = 1, rank: int = 0,
                 dtype: np.dtype | str | None = None, rows_over: Sequence[Group] = (),
                 boundary_rows_over: Sequence[Group] = ()) -> None:
        self.group, self.rank, self.chunks = pp_group, rank, chunks
        self.stage, self.pp, self.virtual = pp_group.rank, pp_group.size, virtual
        self.loss_function, self.aux_weight = loss, aux_weight
        self.shape, self.dtype = boundary, np.dtype(x.dtype if dtype is None else dtype)
        self.x, self.y, self.rows = x, y, rows
        # the groups whose ranks hold other rows of the data / of a boundary activation
        # (placement/__init__.py: Shard(0) over each; dp, and tp under sequence parallelism)
        self.rows_over, self.boundary_rows_over = rows_over, boundary_rows_over
        self.inputs: dict[tuple[int, int], Tensor] = {}
        self.outputs: dict[tuple[int, int], tuple[Tensor, Tensor | None]] = {}
        self.grads: dict[tuple[int, int], np.ndarray] = {}
        self.sending: dict[tuple[int, int, int], tuple[object, np.ndarray]] = {}  # Requests
        self.loss = 0.0
        # what the backward of the loss (and of each aux loss) starts from: 1, or the
        # precision's S (--mixed fp16: the loss scale, set by run/mesh_step.py)
        self.backward_seed = 1.0
        self.timeline: list[dict] = []
        self.handlers = {RECV_ACT: self.recv_act, FORWARD: self.forward,
                         SEND_ACT: self.send_act, RECV_GRAD: self.recv_grad,
                         BACKWARD: self.backward, SEND_GRAD: self.send_grad}

    def run(self, program: list[Instruction]) -> float:
        """Run every instruction in order, timing each; returns this rank's share of the
        step loss (CE/M of its microbatches on the last stage, plus aux/M of its blocks)."""
        records = []  # plain tuples while the step runs (less work between instructions)
        clock = time.time  # wall clock: comparable between ranks
        # --trace: each compute instruction inside its span (stage_trace.py)
        handlers = self.handlers if trace.RECORDER is None else stage_trace.spanned(self)
        for ins in program:
            flight.set_microbatch(ins.microbatch)  # the flight recorder's calls are tagged
            start = clock()
            cpu = time.thread_time()  # CPU time: what it cost, even on a shared core
            handlers[ins.kind](ins)
            records.append((ins, start, clock(), time.thread_time() - cpu))
        self.timeline += [{"rank": self.rank, "stage": self.stage, "kind": ins.kind,
                           "microbatch": ins.microbatch, "chunk": ins.chunk, "start": start,
                           "end": end, "cpu": cpu} for ins, start, end, cpu in records]
        trace.wait([request for request, _ in self.sending.values()],
                   "Waitall of the sends over pp")
        self.sending.clear()
        return self.loss

    def is_first(self, chunk: int) -> bool:
        return chunk_layout.first_stage(self.pp, self.where(chunk), self.layout)

    def is_last(self, chunk: int) -> bool:
        return chunk_layout.last_stage(self.pp, self.where(chunk), self.virtual, self.layout)

    def where(self, chunk: int) -> int:
        """The virtual stage (position in the model) of this rank's chunk `chunk`."""
        return chunk_layout.virtual_stage(self.pp, self.stage, chunk, self.layout)

    def peer(self, ins: Instruction) -> int:
        return chunk_layout.peer(ins.kind, self.pp, self.stage, ins.chunk, self.layout)

    # ------------------------------------------------------------ messages
    def recv_act(self, ins: Instruction) -> None:
        buf = np.empty(self.shape, dtype=self.dtype)
        # activation (B/(M dp), d) of this microbatch <- the previous stage (--mixed:
        # 16-bit, as uint16 words: comm/low_precision.py)
        self.group.Recv(precision.wire(buf), source=self.peer(ins), tag=ACT_TAG)
        self.inputs[(ins.chunk, ins.microbatch)] = rows_of(
            Tensor(buf, requires_grad=True), self.boundary_rows_over)

    def send_act(self, ins: Instruction) -> None:
        sent = self.outputs[(ins.chunk, ins.microbatch)][0]
        if placement.ON:  # the next stage takes it as whole rows: no partial sum may go
            placement.rows_exchanged("Send to the next stage", sent, self.group)
        out = np.ascontiguousarray(sent.data, dtype=self.dtype)
        # activation (B/(M dp), d) of this microbatch -> the next stage
        request = self.group.Isend(precision.wire(out), dest=self.peer(ins), tag=ACT_TAG)
        self.sending[(ACT_TAG, ins.chunk, ins.microbatch)] = (request, out)

    def recv_grad(self, ins: Instruction) -> None:
        buf = np.empty(self.shape, dtype=self.dtype)
        # gradient (B/(M dp), d) of our output <- the next stage
        self.group.Recv(precision.wire(buf), source=self.peer(ins), tag=GRAD_TAG)
        self.grads[(ins.chunk, ins.microbatch)] = buf

    def send_grad(self, ins: Instruction) -> None:
        grad = np.ascontiguousarray(self.inputs.pop((ins.chunk, ins.microbatch)).grad,
                                    dtype=self.dtype)
        # gradient (B/(M dp), d) of our input -> the previous stage
        request = self.group.Isend(precision.wire(grad), dest=self.peer(ins),
                                   tag=GRAD_TAG)
        self.sending[(GRAD_TAG, ins.chunk, ins.microbatch)] = (request, grad)

    # ------------------------------------------------------------- compute
    def forward(self, ins: Instruction) -> None:
        key, rows = (ins.chunk, ins.microbatch), self.rows[ins.microbatch]
        h = rows_of(Tensor(self.x[rows]), self.rows_over) if self.is_first(ins.chunk) \
            else self.inputs[key]
        out, aux = self.chunks[ins.chunk].forward(h)
        if self.is_last(ins.chunk):                      # out is the logits
            loss = self.loss_function(out, aux, self.y[rows])   # e.g. CE/M + aux/M
            self.loss += loss.item()
            self.outputs[key] = (loss, None)
        else:
            self.loss += 0.0 if aux is None else aux.item() * self.aux_weight  # aux / M
            self.outputs[key] = (out, aux)

    def backward(self, ins: Instruction) -> None:
        out, aux = self.outputs.pop((ins.chunk, ins.microbatch))
        ag.backward_from(self.roots(ins, out, aux))

    def roots(self, ins: Instruction, out: Tensor, aux: Tensor | None) -> list:
        """Where the backward of (chunk, microbatch) starts: (tensor, its gradient) pairs."""
        scale = self.backward_seed                       # 1 but under --mixed fp16
        if self.is_last(ins.chunk):
            return [(out, scale)]                        # out is the loss
        key = (ins.chunk, ins.microbatch)
        roots = [(out, self.grads.pop(key))]             # (output, gradient received)
        roots += [(aux, self.aux_weight * scale)] if aux is not None else []  # aux/M
        # its gradient came back: the activation was sent
        trace.wait([self.sending.pop((ACT_TAG, *key))[0]], "Wait of an activation send over pp")
        return roots


def forward_backward(worker: StageWorker, schedule_name: str, microbatches: int,
                     timeline: list[dict] | None = None) -> float:
    """One step's forwards and backwards on this rank, in the order the schedule says.

    Gradients accumulate in the parameters' `.grad` as in the one-process loop.
    Returns this rank's share of the step loss (`agreement.report_loss` sums over pp);
    appends the wall-clock start/end of every instruction to `timeline` if given.
    """
    program = schedule(schedule_name, worker.pp, microbatches, worker.stage, worker.virtual)
    loss = worker.run(program)
    if timeline is not None:
        timeline.extend(worker.timeline)
    return loss

