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
interleaved 1F1B, Megatron-LM; ZB-H1, Qi et al. 2023; the V-shaped ZB-V,
DualPipeV and DualPipe of parallel/pipeline/v_schedules.py): a list computed by
parallel/pipeline/schedules.py, which also simulates it. This file is only the worker
that runs a list (ShallowSpeed's design):

    recv_act   Recv the input activation of (chunk, microbatch) from the previous rank
    F          forward of the chunk; the last stage adds the loss CE/M + aux/M
    send_act   Isend the output activation to the next rank
    recv_grad  Recv the gradient of that output from the next rank
    B          backward: from the loss (last stage) or from (output, received gradient)
               plus (aux, 1/M) for a stage with MoE blocks
    send_grad  Isend the gradient of the input back to the previous rank
    W          the split schedules (ZB-H1, ZB-V, DualPipe(V)): the weight-gradient matmuls
               B put off (autograd.defer_weight_grads)
    F&B        DualPipe(V): the forward of one (chunk, microbatch), then the backward and W
               of another, in one step (on GPUs one's compute hides the other's traffic;
               here they run one after the other)

In a V (ZB-V, DualPipeV) rank s holds virtual stages s and 2pp-1-s; at the
bottom of the V rank pp-1 hands its chunk 0's output to its chunk 1 (and
chunk 1's input gradient back to chunk 0) itself, with no message: a copy into
a fresh leaf, exactly what a Send/Recv would deliver. DualPipe's rank r holds
stage r of one copy of the model (its microbatches enter at rank 0) and stage
pp-1-r of another (entering at rank pp-1); after the step's instructions the
mirror ranks r and pp-1-r add their copies' gradients (`sum_the_two_copies`).

Why Isend and a blocking Recv: the simulator shows that with blocking sends
(MPI's rendezvous protocol for large messages) 1F1B deadlocks -- stage 0 sends
F2's activation while stage 1 sends B1's gradient, each waiting for the other's
Recv. With Isend a rank waits only in Recv, and the simulator proves every
Recv's message is sent (tests/parallel/test_pipeline_schedules.py, pp 2..8, M 1..16).
Messages carry tag 0 (activation) or 1 (gradient); in each direction they are
sent and received in the same order, which is how each Recv gets the right
microbatch (MPI never lets two messages with the same tag overtake each other).

Placements (placement/__init__.py): what crosses a stage boundary keeps the placement it had
(rows Shard(0) over dp; under sequence parallelism over tp too), declared again on
the receiving side (`rows_of`); Send/Recv move it whole, so a partial sum is
refused before it is sent.

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
from minipar.parallel.pipeline.chunk_layout import (
    LOOP,
    first_stage,
    last_stage,
    local_boundary,
    peer,
    virtual_stage,
)
from minipar.parallel.pipeline.instructions import (
    BACKWARD,
    FORWARD,
    OVERLAPPED,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    WEIGHT,
    Instruction,
)
from minipar.parallel.pipeline.schedules import schedule
from minipar.placement import Shard

if TYPE_CHECKING:
    from minipar.comm.collectives import Group

ACT_TAG, GRAD_TAG = 0, 1
# the --trace spans of the compute instructions (B is "backward (B)" when split)
SPAN_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "backward (W)",
              OVERLAPPED: "F&B"}


# The last stage's loss of one microbatch from (logits, the chunk's aux loss or None,
# labels): the caller's to define (train.py: CE/M + aux/M); the pipeline only runs it.
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
    gradient, the put-off weight work -- never in one shared buffer, because
    1F1B has several microbatches in flight at once.

    What it is given, and nothing else: the pipeline group `pp_group` (its rank is
    this stage), the model `chunks` this rank holds (`virtual` of them), the step's
    batch `x, y` with this rank's `rows` of each microbatch, the last stage's `loss`
    function, `aux_weight` (what a block's aux loss counts for in the step's loss:
    1/M), the `boundary` shape of an activation and its `dtype` (the model's; by
    default x's, which for the transformer holds integer token ids instead),
    whether the backward is split (ZB-H1, ZB-V, DualPipe(V): B now, W later) and
    where the chunks sit (`layout`, schedules.layout_of: in a V for ZB-V and
    DualPipeV, on two opposite chains for DualPipe). `rank` only labels the timeline.
    """

    def __init__(self, pp_group: Group, chunks: list[Model], x: np.ndarray, y: np.ndarray,
                 rows: list[slice], loss: LossFunction, aux_weight: float,
                 boundary: tuple[int, ...], virtual: int = 1, split_backward: bool = False,
                 rank: int = 0, dtype: np.dtype | str | None = None,
                 layout: str = LOOP, rows_over: Sequence[Group] = (),
                 boundary_rows_over: Sequence[Group] = ()) -> None:
        self.group, self.rank, self.layout = pp_group, rank, layout
        self.stage, self.pp, self.virtual = pp_group.rank, pp_group.size, virtual
        self.chunks = chunks
        self.loss_function, self.aux_weight = loss, aux_weight
        self.shape, self.dtype = boundary, np.dtype(x.dtype if dtype is None else dtype)
        self.rows = rows
        self.x, self.y = x, y
        self.split_backward = split_backward
        # the groups whose ranks hold other rows of the data / of a boundary activation
        # (placement/__init__.py: Shard(0) over each; dp, and tp under sequence parallelism)
        self.rows_over, self.boundary_rows_over = rows_over, boundary_rows_over
        self.inputs: dict[tuple[int, int], Tensor] = {}
        self.outputs: dict[tuple[int, int], tuple[Tensor, Tensor | None]] = {}
        self.grads: dict[tuple[int, int], np.ndarray] = {}
        self.deferred: dict[tuple[int, int], list] = {}
        self.sending: dict[tuple[int, int, int], tuple[object, np.ndarray]] = {}  # Requests
        self.loss = 0.0
        # what the backward of the loss (and of each aux loss) starts from: 1, or the
        # precision's S (--mixed fp16: the loss scale, set by run/train.py)
        self.backward_seed = 1.0
        self.timeline: list[dict] = []
        self.handlers = {RECV_ACT: self.recv_act, FORWARD: self.forward,
                         SEND_ACT: self.send_act, RECV_GRAD: self.recv_grad,
                         BACKWARD: self.backward, SEND_GRAD: self.send_grad,
                         WEIGHT: self.weight, OVERLAPPED: self.overlapped}

    def run(self, program: list[Instruction]) -> float:
        """Run every instruction in order, timing each; returns this rank's share of the
        step loss (CE/M of its microbatches on the last stage, plus aux/M of its blocks)."""
        records = []  # plain tuples while the step runs (less work between instructions)
        clock, handlers = time.time, self.handlers  # wall clock: comparable between ranks
        traced = trace.RECORDER is not None   # --trace: a span per compute instruction
        for ins in program:
            flight.set_microbatch(ins.microbatch)  # the flight recorder's calls are tagged
            start = clock()
            cpu = time.thread_time()  # CPU time: what it cost, even on a shared core
            if traced and ins.kind in SPAN_NAMES:
                self.traced(ins)
            else:
                handlers[ins.kind](ins)
            records.append((ins, start, clock(), time.thread_time() - cpu))
        self.timeline += [{"rank": self.rank, "stage": self.stage, "kind": ins.kind,
                           "microbatch": ins.microbatch, "chunk": ins.chunk, "start": start,
                           "end": end, "cpu": cpu} for ins, start, end, cpu in records]
        trace.wait([request for request, _ in self.sending.values()],
                   "Waitall of the sends over pp")
        self.sending.clear()
        return self.loss

    def traced(self, ins: Instruction) -> None:
        """A compute instruction inside its --trace span (trace.py), and the activation
        bytes it leaves held: a forward keeps its tape, the backward frees it (its W,
        when the backward is split)."""
        name = "backward (B)" if ins.kind == BACKWARD and self.split_backward \
            else SPAN_NAMES[ins.kind]
        with trace.span(name, microbatch=ins.microbatch, chunk=ins.chunk, kind=ins.kind):
            self.handlers[ins.kind](ins)
        forward, backward, weight = ins.parts() if ins.kind == OVERLAPPED else (
            ins if ins.kind == FORWARD else None, ins if ins.kind == BACKWARD else None,
            ins if ins.kind == WEIGHT else None)
        if forward is not None:
            trace.hold((forward.chunk, forward.microbatch),
                       self.outputs[(forward.chunk, forward.microbatch)][0])
        done = weight if weight is not None else None if self.split_backward else backward
        if done is not None:
            trace.release((done.chunk, done.microbatch))

    def where(self, chunk: int) -> int:
        """The virtual stage (position in the model) of this rank's chunk `chunk`."""
        return virtual_stage(self.pp, self.stage, chunk, self.layout)

    def is_first(self, chunk: int) -> bool:
        return first_stage(self.pp, self.where(chunk), self.layout)

    def is_last(self, chunk: int) -> bool:
        return last_stage(self.pp, self.where(chunk), self.virtual, self.layout)

    def fed_locally(self, chunk: int) -> bool:
        """Whether this chunk's input comes from this rank's other chunk (the V's bottom)."""
        v = self.where(chunk)
        return not self.is_first(chunk) and local_boundary(self.pp, self.stage, v - 1,
                                                           self.layout)

    def feeds_locally(self, chunk: int) -> bool:
        """Whether this chunk's output goes to this rank's other chunk (the V's bottom)."""
        v = self.where(chunk)
        return not self.is_last(chunk) and local_boundary(self.pp, self.stage, v, self.layout)

    def peer(self, ins: Instruction) -> int:
        return peer(ins.kind, self.pp, self.stage, ins.chunk, self.layout)

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
        key = (ins.chunk, ins.microbatch)
        rows = self.rows[ins.microbatch]
        if self.fed_locally(ins.chunk):  # the V's bottom: this rank's chunk 0's output
            previous = self.outputs[(ins.chunk - 1, ins.microbatch)][0].data
            self.inputs[key] = rows_of(Tensor(previous.copy(), requires_grad=True),
                                       self.boundary_rows_over)
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
        key = (ins.chunk, ins.microbatch)
        out, aux = self.outputs.pop(key)
        scale = self.backward_seed                       # 1 but under --mixed fp16
        if self.is_last(ins.chunk):
            roots = [(out, scale)]                       # out is the loss
        elif self.feeds_locally(ins.chunk):  # the V's bottom: chunk 1's input gradient
            grad = self.inputs.pop((ins.chunk + 1, ins.microbatch)).grad
            roots = [(out, grad)] + ([(aux, self.aux_weight * scale)] if aux is not None
                                     else [])
        else:
            roots = [(out, self.grads.pop(key))]        # (output, gradient received)
            roots += [(aux, self.aux_weight * scale)] if aux is not None else []  # aux/M
            # its gradient came back: the activation was sent
            trace.wait([self.sending.pop((ACT_TAG, *key))[0]],
                       "Wait of an activation send over pp")
        if self.split_backward:  # B now (input gradients), W later (weight gradients)
            with ag.defer_weight_grads() as pending:
                ag.backward_from(roots)
            self.deferred[key] = pending
        else:
            ag.backward_from(roots)

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


def gather_timeline(world: Group, timeline: list[dict]) -> list[dict] | None:
    """Every rank's timeline on world rank 0 (None elsewhere), times in seconds from the
    earliest start on any rank. A collective over `world` (a `comm.Group`)."""
    everything = world.gather(timeline)  # small Python lists of records -> rank 0
    if everything is None:
        return None
    records = [dict(record) for rank in everything for record in rank]
    origin = min((r["start"] for r in records), default=0.0)
    for r in records:
        r["start"] -= origin
        r["end"] -= origin
    return records


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
