"""Pipeline schedules as data, and a simulator that plays them in logical time.

What this file teaches: a pipeline schedule is nothing but, for each stage, an
ordered list of instructions -- receive an activation, run a forward, send it
on, receive a gradient, run a backward, send it back. Written as data, a
schedule can be printed, simulated and tested without a single MPI process;
the executor (pipeline_parallel.py) then runs the same list with Send/Recv.

The schedules, each from its paper:

- GPipe (Huang et al. 2019): every forward, then every backward. Simple; a
  stage holds the activations of all M microbatches at once.
- 1F1B, PipeDream-flush (Narayanan et al. 2021): warm-up forwards, then one
  forward / one backward in a steady state, then cool-down backwards. Same
  bubble as GPipe, but stage s holds at most pp - s microbatches.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): each rank holds V
  model chunks (virtual stages s, s + pp, ...); the bubble shrinks by V.
- ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward is
  split into B (input gradient: the previous stage waits for it) and W (weight
  gradient: nobody waits for it); putting W off fills the cool-down bubble.
- ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): the
  model cut into 2 pp chunks placed in a V -- rank s holds chunks s and
  2pp-1-s, so rank 0 holds the first and the last, the loss. The paper's
  schedule (found by search) has zero bubble for F = B = W and M large enough;
  the greedy list built here (`zb_v_orders`) comes close but not to zero,
  holding at most 2pp chunk-activations: the activation memory of 1F1B (pp
  microbatches of a whole stage).
- DualPipeV (DeepSeek-V3, 2024): the same V placement, its bidirectional
  DualPipe folded in half. Its steady state runs *overlapped* F&B steps: the
  forward of one microbatch and the backward of another in one step. On GPUs
  the point of the pair is that one's computation hides the other's
  communication (the pipeline Send/Recv and MoE's dispatch/combine Alltoall
  run on another stream while the other chunk computes); here the two
  microbatches' instructions run one after the other inside the step, so the
  step's duration is its own cost `F&B` in the simulator (F + B + W when
  nothing overlaps, less when the hardware overlaps).
  DualPipe itself is not built: it sends microbatches both ways through PP
  ranks, rank r holding stage r for one direction and stage PP-1-r for the
  other -- the two ends of one model twice, so 2x the parameters, whose
  gradients the two copies must sum. By that symmetry its ranks r and PP-1-r
  run mirror images of one program, and ranks 0..PP/2-1 run exactly
  DualPipeV's on pp = PP/2 (the V's bottom then a message): its bubble and
  activation memory are DualPipeV's.

Bubble, as measured here: run the instruction lists with F = 1 time unit and
B = 2 for a stage's share of the model (B = W = 1 for the split schedules; a
chunk of the interleaved schedule holds 1/V of a stage's layers, so it costs
F = 1/V, B = 2/V), communication free (`Costs` weighs F, B, W and the F&B pair
otherwise). With T the time from the start to the moment the last stage
finishes, the bubble fraction is

    bubble = (pp * T - total busy time of all stages) / (pp * T),

the share of stage-time spent idle. It comes out exactly (pp-1)/(M+pp-1) for
GPipe and 1F1B, (pp-1)/(V M+pp-1) for interleaved, and (pp-1)/(3M+pp-1) for
ZB-H1 when M >= pp: its idle time is pp-1 units against 1F1B's 3(pp-1), a third.
Interleaving does the same work in 3M + 3(pp-1)/V units where 1F1B needs
3M + 3(pp-1): the warm-up and cool-down are made of chunks V times smaller.

The simulator also replays a real run (`replay`): each instruction takes the
compute time it was measured to take, and the dependencies of the schedule do
the rest. That is what a pipeline would do on one core per rank, even when the
run was timed with more ranks than cores.

The papers' tables count the bubble per rank instead: the time a rank idles
between its own first and its own last instruction (`Simulation.idle`; with
the optimizer step not synchronized, each rank's next step starts right after
its own last one, so that is what a step costs). The worst rank's: 1F1B
(pp-1)(F+B+W), ZB-H1 (pp-1)(F+B-W), ZB-V 0 in the paper (M large, F = B = W),
DualPipeV (pp-1)(F&B+B-2W) -- DeepSeek-V3's table writes B for the *full*
backward (our B + W) and PP for the ranks of the unfolded DualPipe (2 pp):
(PP/2-1)(F&B+B-3W). The simulator reproduces 1F1B's and ZB-H1's for any
durations, DualPipeV's in logical time (F = B = W, F&B = F + B + W).

Run the checks: `python -m pytest tests/test_pipeline_schedules.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")  # `--schedule`
V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank, placed in a V
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev")  # B (input gradient) and W (weights) apart
FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
OVERLAPPED = "F&B"  # DualPipe's step: the forward of one microbatch, the backward of another
RECV_ACT, SEND_ACT = "recv_act", "send_act"
RECV_GRAD, SEND_GRAD = "recv_grad", "send_grad"
COMPUTE = (FORWARD, BACKWARD, WEIGHT, OVERLAPPED)


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's program: `kind` on microbatch `microbatch` of model chunk
    `chunk` (always 0 unless the schedule has several chunks per rank).

    An `F&B` step carries two: the forward of (`chunk`, `microbatch`) and the full
    backward (B, then its W) of (`back_chunk`, `back_microbatch`)."""

    kind: str
    microbatch: int
    chunk: int = 0
    back_microbatch: int = -1
    back_chunk: int = -1

    def __str__(self) -> str:
        if self.kind == OVERLAPPED:
            return (f"F{self.microbatch + 1}/{self.chunk}"
                    f"&B{self.back_microbatch + 1}/{self.back_chunk}")
        suffix = f"/{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch + 1}{suffix}"

    def parts(self) -> list[Instruction]:
        """The plain F, B, W this step stands for, in the order they run: an F&B step
        is its F, then its B and W; any other instruction is itself."""
        if self.kind != OVERLAPPED:
            return [self]
        back = (self.back_microbatch, self.back_chunk)
        return [Instruction(FORWARD, self.microbatch, self.chunk),
                Instruction(BACKWARD, *back), Instruction(WEIGHT, *back)]


# ----------------------------------------------------------- compute order
def gpipe_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """GPipe: all forwards, then all backwards (in the same microbatch order)."""
    return ([Instruction(FORWARD, m) for m in range(microbatches)]
            + [Instruction(BACKWARD, m) for m in range(microbatches)])


def one_f_one_b_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """1F1B (PipeDream-flush): warm-up, steady state, cool-down.

    Stage s starts with pp - s - 1 forwards: just enough that when the first
    gradient comes back, the pipe behind it is full. From then on every forward
    is followed by the oldest backward, so at most pp - s microbatches are alive.
    """
    # exercise: one-f-one-b
    warmup = min(pp - stage - 1, microbatches)
    steady = microbatches - warmup
    order = [Instruction(FORWARD, m) for m in range(warmup)]          # warm-up
    for i in range(steady):                                           # steady: 1F, 1B
        order += [Instruction(FORWARD, warmup + i), Instruction(BACKWARD, i)]
    order += [Instruction(BACKWARD, m) for m in range(steady, microbatches)]  # cool-down
    return order
    # end exercise


def interleaved_order(pp: int, microbatches: int, stage: int, virtual: int
                      ) -> list[Instruction]:
    """Interleaved 1F1B (Megatron-LM): 1F1B over (chunk, microbatch) pairs.

    Forwards go in groups of pp microbatches: microbatches 1..pp through chunk 0,
    the same pp through chunk 1, ..., then the next pp. Backwards walk the chunks
    in reverse. Needs M divisible by pp (every group full). Warm-up is 1F1B's
    pp - s - 1 plus (V - 1) pp: the first backward needs a microbatch through all V
    chunks. With V = 1 this is exactly 1F1B.
    """
    total = virtual * microbatches

    def unit(k: int, forward: bool) -> Instruction:
        group, within = divmod(k, pp * virtual)
        chunk = within // pp
        microbatch = group * pp + within % pp
        if forward:
            return Instruction(FORWARD, microbatch, chunk)
        return Instruction(BACKWARD, microbatch, virtual - 1 - chunk)

    warmup = min(pp - stage - 1 + (virtual - 1) * pp, total)
    steady = total - warmup
    order = [unit(k, True) for k in range(warmup)]                    # warm-up
    for i in range(steady):                                           # steady: 1F, 1B
        order += [unit(warmup + i, True), unit(i, False)]
    order += [unit(k, False) for k in range(steady, total)]           # cool-down
    return order


def zb_h1_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """ZB-H1: 1F1B with each backward split into B (input gradient) and W (weights).

    Stage s runs W of microbatch i only `stage` microbatches after its B: the
    last stages, whose B's the whole pipe waits for, put their W's off the most,
    and those W's fill the cool-down where 1F1B sits idle. Alive microbatches (F
    done, W not yet) stay at most pp, the memory of 1F1B.
    """
    warmup = min(pp - stage - 1, microbatches)
    steady = microbatches - warmup
    lag = stage  # W of microbatch i runs `lag` microbatches after its B

    def put_off_weight(i: int) -> list[Instruction]:
        return [Instruction(WEIGHT, i - lag)] if i >= lag else []

    order = [Instruction(FORWARD, m) for m in range(warmup)]          # warm-up
    for i in range(steady):                                           # steady: F, B, W
        order += [Instruction(FORWARD, warmup + i), Instruction(BACKWARD, i)]
        order += put_off_weight(i)
    for m in range(steady, microbatches):                             # cool-down: B, W
        order += [Instruction(BACKWARD, m)] + put_off_weight(m)
    order += [Instruction(WEIGHT, m)                                  # the last W's fill
              for m in range(max(microbatches - lag, 0), microbatches)]  # the tail
    return order


@functools.cache
def _zb_v_orders(pp: int, microbatches: int) -> tuple[tuple[Instruction, ...], ...]:
    return tuple(tuple(order) for order in zb_v_orders(pp, microbatches))


def zb_v_orders(pp: int, microbatches: int) -> list[list[Instruction]]:
    """ZB-V: every rank's F/B/W order, built by playing the V greedily in unit time.

    Virtual stage v (of 2 pp) is chunk 0 of rank v for v < pp and chunk 1 of rank
    2pp-1-v after: the forward runs down ranks 0..pp-1 and back up, so the loss
    and the first backward are on rank 0. Time goes in steps of one unit (F = B = W);
    at each step every rank takes the first of these that it can run now:

    1. a B whose gradient has arrived (the oldest microbatch; chunk 1 first): the
       ranks behind wait for it;
    2. an F whose input has arrived (chunk 1 first: it brings a microbatch nearer
       its loss), unless the rank already holds 2 pp chunk-activations (F done, W
       not yet) -- 1F1B's memory;
    3. a put-off W (the oldest): work nobody waits for, kept for the gaps.

    A rank idles only when none applies. The simulator then replays the lists as
    given (tests/test_pipeline_schedules.py). This greedy rule is not the paper's
    search: with F = B = W no rank but rank 0 idles (pp <= 3), and rank 0 idles
    fewer chunk-units than ZB-H1's 2(pp - 1), but not zero: its last backward waits
    for the whole V after its put-off W's ran out. The paper's zero needs a
    smarter placement of the W's at the end.
    """
    stages, cap = 2 * pp, 2 * pp

    def rank(v: int) -> int:
        return v if v < pp else stages - 1 - v

    finished: dict[tuple[str, int, int], int] = {}  # (kind, v, microbatch) -> end time
    next_f, next_b = [0] * stages, [0] * stages
    put_off: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    alive = [0] * pp
    orders: list[list[Instruction]] = [[] for _ in range(pp)]
    left, t = 3 * stages * microbatches, 0

    def ready(kind: str, v: int, i: int) -> bool:
        return finished.get((kind, v, i), t + 1) <= t

    while left:
        for r in range(pp):
            front, back = r, stages - 1 - r          # chunk 0, chunk 1
            pick = None
            backwards = [(next_b[v], -v) for v in (back, front) if next_b[v] < microbatches
                         and ready(FORWARD, v, next_b[v])
                         and (v == stages - 1 or ready(BACKWARD, v + 1, next_b[v]))]
            if backwards:
                i, v = min(backwards)
                pick = (BACKWARD, -v, i)
            elif alive[r] < cap:
                pick = next(((FORWARD, v, next_f[v]) for v in (back, front)
                             if next_f[v] < microbatches
                             and (v == 0 or ready(FORWARD, v - 1, next_f[v]))), None)
            if pick is None and put_off[r]:
                pick = (WEIGHT, *put_off[r].pop(0))
            if pick is None:
                continue                              # idle this unit
            kind, v, i = pick
            finished[pick] = t + 1
            orders[r].append(Instruction(kind, i, int(v >= pp)))
            left -= 1
            if kind == FORWARD:
                next_f[v] += 1
                alive[r] += 1
            elif kind == BACKWARD:
                next_b[v] += 1
                put_off[r].append((v, i))
            else:
                alive[r] -= 1
        t += 1
    assert all(rank(v) == r for r in range(pp) for v in (r, stages - 1 - r))
    return orders


def dualpipev_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """DualPipeV (DeepSeek-V3): eight phases; chunk 0 is virtual stage s, chunk 1 is
    2pp-1-s. `F&B` is an overlapped step, a "full" backward is B then its W at once,
    a "split" one puts its W off to a later W step (the zero-bubble trick).

    1. 2(pp-s-1) F0: fill the V's left arm (rank 0 the longest);
    2. s+1 times F0 F1: the first microbatches turn at the bottom of the V;
    3. pp-s-1 times B1 (split), its W, F1: chunk 1's first backwards, in 1F1B;
    4. M-2pp+s+1 times F0&B1, F1&B0: the steady state, two overlapped steps;
    5. pp-s-1 times B1 (full), F1&B0;
    6. s+1 times B1 B0: the last backwards, the second half of them split;
    7. pp-s-1 times W, B0 (split);
    8. s+1 times W: the put-off weight gradients fill the end.

    Needs M >= 2 pp (phase 4 runs at least once on rank 0). A rank holds at most
    2 pp + 1 chunk-activations, one more than 1F1B (DeepSeek-V3's PP + 1).
    """
    if microbatches < 2 * pp:
        raise ValueError(f"dualpipev needs at least 2 pp = {2 * pp} microbatches "
                         f"(got {microbatches})")
    order: list[Instruction] = []
    nxt = {(FORWARD, 0): 0, (FORWARD, 1): 0, (BACKWARD, 0): 0, (BACKWARD, 1): 0}
    put_off: list[tuple[int, int]] = []

    def take(kind: str, chunk: int) -> int:
        i = nxt[(kind, chunk)]
        nxt[(kind, chunk)] += 1
        return i

    def forward(chunk: int) -> None:
        order.append(Instruction(FORWARD, take(FORWARD, chunk), chunk))

    def backward(chunk: int, split: bool) -> None:
        i = take(BACKWARD, chunk)
        order.append(Instruction(BACKWARD, i, chunk))
        if split:
            put_off.append((i, chunk))
        else:
            order.append(Instruction(WEIGHT, i, chunk))

    def weight() -> None:
        order.append(Instruction(WEIGHT, *put_off.pop(0)))

    def overlapped(forward_chunk: int, backward_chunk: int) -> None:
        order.append(Instruction(OVERLAPPED, take(FORWARD, forward_chunk), forward_chunk,
                                 take(BACKWARD, backward_chunk), backward_chunk))

    s, last = stage, pp - 1
    for _ in range(2 * (pp - s - 1)):                          # 1
        forward(0)
    for _ in range(s + 1):                                     # 2
        forward(0)
        forward(1)
    for _ in range(pp - s - 1):                                # 3
        backward(1, split=True)
        weight()
        forward(1)
    for i in range(microbatches - 2 * pp + s + 1):             # 4
        if i == 0 and s == last:  # its first B1 waits for the whole V: F0 goes ahead
            forward(0)
            backward(1, split=False)
        else:
            overlapped(0, 1)
        overlapped(1, 0)
    for _ in range(pp - s - 1):                                # 5
        backward(1, split=False)
        overlapped(1, 0)
    split = False
    for i in range(s + 1):                                     # 6
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        backward(1, split)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        backward(0, split)
    for _ in range(pp - s - 1):                                # 7
        weight()
        backward(0, split=True)
    while put_off:                                             # 8
        weight()
    return order


def compute_order(schedule: str, pp: int, microbatches: int, stage: int,
                  virtual: int = 1) -> list[Instruction]:
    """The F/B/W order of one stage under `schedule`, without communication."""
    if schedule == "gpipe":
        return gpipe_order(pp, microbatches, stage)
    if schedule == "1f1b":
        return one_f_one_b_order(pp, microbatches, stage)
    if schedule == "interleaved":
        return interleaved_order(pp, microbatches, stage, virtual)
    if schedule == "zb-h1":
        return zb_h1_order(pp, microbatches, stage)
    if schedule == "zb-v":
        return list(_zb_v_orders(pp, microbatches)[stage])
    if schedule == "dualpipev":
        return dualpipev_order(pp, microbatches, stage)
    raise ValueError(f"unknown schedule {schedule!r} (one of {', '.join(SCHEDULES)})")


def chunks_per_rank(schedule: str, virtual: int = 1) -> int:
    """How many model chunks a pipeline rank holds: 2 for the V schedules, V for
    interleaved, else 1."""
    return 2 if schedule in V_SHAPED else virtual


# ---------------------------------------------------- adding communication
def virtual_stage(pp: int, stage: int, chunk: int, v_shape: bool = False) -> int:
    """Which virtual stage (run of blocks, in model order) chunk `chunk` of pipeline
    rank `stage` is: chunk * pp + stage when chunks loop round the ranks
    (interleaved), stage or 2pp-1-stage in a V (ZB-V, DualPipeV)."""
    if v_shape:
        return stage if chunk == 0 else 2 * pp - 1 - stage
    return chunk * pp + stage


def placement(pp: int, v: int, v_shape: bool = False) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage v: the inverse of `virtual_stage`."""
    if v_shape:
        return (v, 0) if v < pp else (2 * pp - 1 - v, 1)
    return v % pp, v // pp


def local_boundary(pp: int, stage: int, boundary: int, v_shape: bool) -> bool:
    """Whether both sides of boundary b (virtual stages b, b + 1) are on this rank: the
    bottom of the V, where rank pp-1 hands its chunk 0's output to its chunk 1 itself."""
    return placement(pp, boundary, v_shape)[0] == placement(pp, boundary + 1, v_shape)[0]


def with_communication(order: list[Instruction], pp: int, stage: int, virtual: int = 1,
                       v_shape: bool = False) -> list[Instruction]:
    """Wrap each compute instruction in the messages it needs and produces.

    A forward receives its input from the previous virtual stage (unless it is
    the first) and sends its output to the next (unless it is the last); a
    backward receives the gradient of its output from the next virtual stage and
    sends the gradient of its input back. Receives sit right before the compute
    that needs them, sends right after the compute that produced them. An F&B
    step receives both its inputs first and sends both its outputs after. A
    boundary inside the rank (the bottom of the V) needs no message.
    """
    chunks = 2 if v_shape else virtual
    last = pp * chunks - 1

    def crosses(boundary: int) -> bool:
        return 0 <= boundary < last and not local_boundary(pp, stage, boundary, v_shape)

    program: list[Instruction] = []
    for ins in order:
        before, after = [], []
        for part in ins.parts():
            v = virtual_stage(pp, stage, part.chunk, v_shape)
            at = (part.microbatch, part.chunk)
            if part.kind == FORWARD:
                before += [Instruction(RECV_ACT, *at)] if crosses(v - 1) else []
                after += [Instruction(SEND_ACT, *at)] if crosses(v) else []
            elif part.kind == BACKWARD:
                before += [Instruction(RECV_GRAD, *at)] if crosses(v) else []
                after += [Instruction(SEND_GRAD, *at)] if crosses(v - 1) else []
        program += before + [ins] + after
    return program


def schedule(name: str, pp: int, microbatches: int, stage: int, virtual: int = 1
             ) -> list[Instruction]:
    """The full program of pipeline rank `stage`: compute and communication in order.

    `schedule("1f1b", 4, 8, 3)` is the last stage's list; the executor runs it
    with Send/Recv, the simulator with a logical clock.
    """
    return with_communication(compute_order(name, pp, microbatches, stage, virtual),
                              pp, stage, chunks_per_rank(name, virtual), name in V_SHAPED)


def programs(name: str, pp: int, microbatches: int, virtual: int = 1
             ) -> list[list[Instruction]]:
    """Every stage's program, stage 0 first."""
    return [schedule(name, pp, microbatches, s, virtual) for s in range(pp)]


def peer(kind: str, pp: int, stage: int, chunk: int = 0, v_shape: bool = False) -> int:
    """The pipeline rank a message of `kind` about `chunk` goes to or comes from.

    Activations flow to the next virtual stage, gradients to the previous one. When
    chunks loop (interleaved) that is rank stage + 1 or stage - 1 around the ring
    (mod pp): the last rank's chunk c feeds rank 0's chunk c + 1. In a V, chunk 0
    flows down the ranks and chunk 1 back up."""
    downstream = kind in (SEND_ACT, RECV_GRAD)
    if v_shape:
        v = virtual_stage(pp, stage, chunk, True)
        return placement(pp, v + 1 if downstream else v - 1, True)[0]
    return (stage + 1) % pp if downstream else (stage - 1) % pp


# ----------------------------------------------------------- the simulator
class ScheduleError(RuntimeError):
    """A program that cannot be right: a message received out of order, a backward
    before its forward."""


class DeadlockError(RuntimeError):
    """Every unfinished stage waits for a message no one will send."""


@dataclass(frozen=True)
class Slot:
    """One compute instruction placed on the clock: `kind` of (chunk, microbatch) on
    `stage` from `start` to `end` (an F&B step also names its backward's pair)."""

    stage: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float
    back_microbatch: int = -1
    back_chunk: int = -1


@dataclass
class Simulation:
    """What playing the programs produced: the compute timeline, the time T at which
    the last stage finishes, the bubble fraction, per stage the peak number of
    (chunk, microbatch) pairs whose activations it held at once, and per stage the
    time it idled between its own first and last instruction (the papers' bubble)."""

    timeline: list[Slot]
    makespan: float
    bubble: float
    peak_in_flight: list[int]
    idle: list[float]


@dataclass(frozen=True)
class Costs:
    """Durations in the simulator: F a chunk's forward, B its input gradient, W its
    weight gradient, `overlapped` an F&B step (a forward and a full backward B + W,
    of two microbatches). Schedules that do not split the backward charge B + W for
    it. The defaults are logical time: a backward is two matmuls per forward one
    (F = 1, B + W = 2), and nothing overlaps (F&B = F + B + W)."""

    forward: float = 1.0
    backward: float = 1.0
    weight: float = 1.0
    overlapped: float | None = None

    def durations(self, split_backward: bool) -> dict[str, float]:
        """kind -> duration, for a schedule that splits its backward or does not."""
        pair = self.forward + self.backward + self.weight
        return {FORWARD: self.forward,
                BACKWARD: self.backward if split_backward else self.backward + self.weight,
                WEIGHT: self.weight,
                OVERLAPPED: pair if self.overlapped is None else self.overlapped}


def costs(schedule: str, virtual: int = 1, weights: Costs = Costs()) -> dict[str, float]:
    """Logical durations of one stage's share of the layers: F = 1, B = 2 (a backward
    is two matmuls per forward one); the split schedules (ZB-H1, ZB-V, DualPipeV) cut
    the backward into B = 1 (input gradient) and W = 1 (weights). An interleaved chunk
    holds 1/V of a stage's layers, so it is charged 1/V of each: the same work per step
    as 1F1B, in smaller pieces. `weights` sets other durations."""
    durations = weights.durations(schedule in SPLIT_BACKWARD)
    share = 1.0 / virtual if schedule == "interleaved" else 1.0
    return {kind: share * d for kind, d in durations.items()}


def message(ins: Instruction, pp: int, stage: int, v_shape: bool = False
            ) -> tuple[str, int, int]:
    """What a send or receive carries: (activation or gradient, the boundary it crosses,
    microbatch). Boundary b lies between virtual stages b and b + 1."""
    v = virtual_stage(pp, stage, ins.chunk, v_shape)
    boundary = {SEND_ACT: v, RECV_ACT: v - 1, SEND_GRAD: v - 1, RECV_GRAD: v}[ins.kind]
    return ("act" if ins.kind in (SEND_ACT, RECV_ACT) else "grad", boundary, ins.microbatch)


class _Player:
    """Plays every stage's program on its own clock; see `simulate`."""

    def __init__(self, progs: list[list[Instruction]], cost: dict[str, float],
                 synchronous_sends: bool, v_shape: bool) -> None:
        self.progs, self.cost, self.synchronous = progs, cost, synchronous_sends
        self.v_shape = v_shape
        self.pp = len(progs)
        self.pc = [0] * self.pp
        self.clock = [0.0] * self.pp
        self.channels: dict[tuple[int, int, str], list[tuple[tuple, float]]] = {}
        self.done: set[tuple[int, str, int, int]] = set()
        self.alive = [0] * self.pp
        self.peak = [0] * self.pp
        kinds = {part.kind for p in progs for i in p for part in i.parts()}
        self.release = WEIGHT if WEIGHT in kinds else BACKWARD
        self.timeline: list[Slot] = []

    def current(self, stage: int) -> Instruction | None:
        program = self.progs[stage]
        return program[self.pc[stage]] if self.pc[stage] < len(program) else None

    def peer(self, ins: Instruction, stage: int) -> int:
        return peer(ins.kind, self.pp, stage, ins.chunk, self.v_shape)

    def message(self, ins: Instruction, stage: int) -> tuple[str, int, int]:
        return message(ins, self.pp, stage, self.v_shape)

    def step(self, s: int) -> bool:
        """Run stage s's next instruction if it can run now; False if it must wait."""
        ins = self.current(s)
        if ins.kind in COMPUTE:
            self.compute(s, ins)
        elif ins.kind in (SEND_ACT, SEND_GRAD):
            if not self.send(s, ins):
                return False
        elif not self.receive(s, ins):
            return False
        self.pc[s] += 1
        return True

    def check(self, s: int, part: Instruction) -> None:
        """A compute part may run only after what it needs ran on this rank: B after
        its F, W after its B, and across the bottom of the V, chunk 1's F after chunk
        0's and chunk 0's B after chunk 1's."""
        needs = [(s, {BACKWARD: FORWARD, WEIGHT: BACKWARD}[part.kind], part.chunk)] \
            if part.kind in (BACKWARD, WEIGHT) else []
        v = virtual_stage(self.pp, s, part.chunk, self.v_shape)
        step = {FORWARD: -1, BACKWARD: 1}.get(part.kind)
        if step and 0 <= v + step < 2 * self.pp and self.v_shape \
                and placement(self.pp, v + step, True)[0] == s:
            needs.append((s, part.kind, placement(self.pp, v + step, True)[1]))
        for stage, kind, chunk in needs:
            if (stage, kind, chunk, part.microbatch) not in self.done:
                raise ScheduleError(f"stage {s}: {part} before its {kind}"
                                    + (f" of chunk {chunk}" if chunk != part.chunk else ""))
        key = (s, part.kind, part.chunk, part.microbatch)
        if key in self.done:
            raise ScheduleError(f"stage {s}: {part} runs twice")
        self.done.add(key)
        self.alive[s] += (part.kind == FORWARD) - (part.kind == self.release)
        self.peak[s] = max(self.peak[s], self.alive[s])

    def compute(self, s: int, ins: Instruction) -> None:
        for part in ins.parts():
            self.check(s, part)
        start = self.clock[s]  # a measured duration of this very instruction, else its kind's
        self.clock[s] = start + self.cost.get((s, ins.kind, ins.chunk, ins.microbatch),
                                              self.cost.get(ins.kind, 0.0))
        self.timeline.append(Slot(s, ins.kind, ins.microbatch, ins.chunk, start,
                                  self.clock[s], ins.back_microbatch, ins.back_chunk))

    def send(self, s: int, ins: Instruction) -> bool:
        dest = self.peer(ins, s)
        sent = self.message(ins, s)
        if not self.synchronous:  # eager (Isend): post and go on
            self.channels.setdefault((s, dest, sent[0]), []).append((sent, self.clock[s]))
            return True
        other = self.current(dest)  # rendezvous: only when the receiver is at its Recv
        if other is None or other.kind not in (RECV_ACT, RECV_GRAD) \
                or self.peer(other, dest) != s:
            return False
        if self.message(other, dest) != sent:
            raise ScheduleError(f"stage {dest} expects {self.message(other, dest)} "
                                f"from stage {s}, which sends {sent}")
        self.clock[s] = self.clock[dest] = max(self.clock[s], self.clock[dest])
        self.pc[dest] += 1
        return True

    def receive(self, s: int, ins: Instruction) -> bool:
        if self.synchronous:
            return False  # completed by the sender's `send`
        source = self.peer(ins, s)
        expected = self.message(ins, s)
        queue = self.channels.get((source, s, expected[0]), [])
        if not queue:
            return False
        got, sent_at = queue.pop(0)
        if got != expected:
            raise ScheduleError(f"stage {s} expects {expected} from stage {source}, "
                                f"which sent {got} first")
        self.clock[s] = max(self.clock[s], sent_at)
        return True


def simulate(progs: list[list[Instruction]], cost: dict[str, float],
             synchronous_sends: bool = False, v_shape: bool = False) -> Simulation:
    """Play every stage's program in logical time, honoring every dependency.

    Each stage runs its instructions in order on its own clock: a compute
    instruction takes `cost[(stage, kind, chunk, microbatch)]` if given (a measured
    duration, see `replay`), else `cost[kind]`; communication takes no time, and a receive
    waits until its message was sent. With `synchronous_sends` a send also waits
    until the receiver reaches the matching receive (MPI's rendezvous protocol,
    what a blocking `Send` of a large message does); otherwise sends never block
    (`Isend`). Raises `DeadlockError` if the stages get stuck, `ScheduleError` if a
    message arrives out of order or a backward precedes its forward. `v_shape`:
    the chunks are placed in a V (ZB-V, DualPipeV), not round the ranks.
    """
    player = _Player(progs, cost, synchronous_sends, v_shape)
    progress = True
    while progress:
        progress = False
        for s in range(player.pp):
            while player.current(s) is not None and player.step(s):
                progress = True
    stuck = {s: str(player.current(s)) for s in range(player.pp) if player.current(s)}
    if stuck:
        raise DeadlockError(f"stages stuck at {stuck}")
    makespan = max(player.clock)
    intervals = [(slot.stage, slot.start, slot.end) for slot in player.timeline]
    idle = []
    for stage in range(player.pp):
        mine = [slot for slot in player.timeline if slot.stage == stage]
        span = max(slot.end for slot in mine) - min(slot.start for slot in mine)
        idle.append(span - sum(slot.end - slot.start for slot in mine))
    return Simulation(player.timeline, makespan, bubble_fraction(intervals, player.pp),
                      player.peak, idle)


def simulate_schedule(name: str, pp: int, microbatches: int, virtual: int = 1,
                      synchronous_sends: bool = False, weights: Costs = Costs()
                      ) -> Simulation:
    """`simulate` the programs of schedule `name` with its logical costs (or `weights`)."""
    return simulate(programs(name, pp, microbatches, virtual), costs(name, virtual, weights),
                    synchronous_sends, name in V_SHAPED)


def replay(name: str, pp: int, microbatches: int, virtual: int,
           timeline: list[dict]) -> Simulation:
    """Play schedule `name` with each compute instruction taking the time it took in a
    real run (`timeline`: the records of `RunResult.extras["timeline"]`, seconds),
    communication free: the pipeline the measured compute times would make on one
    core per rank. A record's "cpu" (the CPU time of the instruction, which a rank
    waiting for a shared core does not accumulate) is used where present, else its
    wall-clock end - start; with several replicas of a stage (dp > 1) the slowest one's,
    as a step waits for its slowest replica. Times come out in seconds."""
    measured: dict[tuple, float] = {}
    for r in timeline:
        if r["kind"] in COMPUTE:
            key = (r["stage"], r["kind"], r["chunk"], r["microbatch"])
            measured[key] = max(measured.get(key, 0.0), r.get("cpu", r["end"] - r["start"]))
    return simulate(programs(name, pp, microbatches, virtual), measured,
                    v_shape=name in V_SHAPED)


def bubble_fraction(intervals: list[tuple[int, float, float]], stages: int) -> float:
    """Idle share of stage-time: 1 - busy / (stages * T) for busy (stage, start, end)
    intervals, T from the first start to the last end. Works for simulated slots
    and for wall-clock timelines alike."""
    begin = min(start for _, start, _ in intervals)
    end = max(stop for _, _, stop in intervals)
    busy = sum(stop - start for _, start, stop in intervals)
    return 1.0 - busy / (stages * (end - begin))


def bubble_formula(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The papers' bubble fractions, which the simulator reproduces exactly:
    (pp-1)/(M+pp-1) for GPipe and 1F1B, (pp-1)/(V M+pp-1) interleaved, and for ZB-H1
    (pp-1)/(3M+pp-1) -- idle pp-1 units where 1F1B idles 3(pp-1) -- when M >= pp."""
    if schedule in V_SHAPED:
        raise ValueError(f"{schedule} has no closed-form bubble on this measure: simulate "
                         "it (its per-rank idle time is in Simulation.idle)")
    per_stage_work = {"interleaved": virtual * microbatches, "zb-h1": 3 * microbatches}
    return (pp - 1) / (per_stage_work.get(schedule, microbatches) + pp - 1)


def in_flight_peak(kinds: list[str]) -> int:
    """Peak number of microbatches alive on a stage whose compute ran in this order:
    alive from its F until its B (or its W, when the schedule has W's)."""
    kinds = [part for kind in kinds for part in ([FORWARD, WEIGHT] if kind == OVERLAPPED
                                                 else [kind])]
    release = WEIGHT if WEIGHT in kinds else BACKWARD
    alive = peak = 0
    for kind in kinds:
        alive += (kind == FORWARD) - (kind == release)
        peak = max(peak, alive)
    return peak


# ------------------------------------------------------- a text Gantt chart
def gantt(sim: Simulation, pp: int) -> list[str]:
    """One line per stage, one cell per forward (a time unit; 1/V of one with V
    chunks): `F3` forward of microbatch 3, `B3` backward (two cells when B = 2),
    `W3` weight gradient, `.` idle. With model chunks, a letter names the chunk
    (`F3a`, `F3b`); `F3a&B1b` an F&B step."""
    chunks = max(slot.chunk for slot in sim.timeline) + 1
    cell = min(slot.end - slot.start for slot in sim.timeline)  # 1, or 1/V interleaved

    def label(slot: Slot) -> str:
        def one(kind: str, microbatch: int, chunk: int) -> str:
            return f"{kind}{microbatch + 1}" + ("abcdefgh"[chunk] if chunks > 1 else "")

        if slot.kind == OVERLAPPED:  # F3a&B1b
            return one(FORWARD, slot.microbatch, slot.chunk) + "&" + one(
                BACKWARD, slot.back_microbatch, slot.back_chunk)
        return one(slot.kind, slot.microbatch, slot.chunk)

    width = max(len(label(slot)) for slot in sim.timeline)
    units = int(round(sim.makespan / cell))
    rows = [["." for _ in range(units)] for _ in range(pp)]
    for slot in sim.timeline:
        for t in range(int(round(slot.start / cell)), int(round(slot.end / cell))):
            rows[slot.stage][t] = label(slot)
    return [f"stage {s}: " + " ".join(cell.ljust(width) for cell in row).rstrip()
            for s, row in enumerate(rows)]


def iter_messages(progs: list[list[Instruction]], v_shape: bool = False
                  ) -> Iterator[tuple[int, int, tuple]]:
    """Every send and receive as (stage, peer, (direction, boundary, microbatch)), each
    stage's in program order: what the pairwise matching test compares."""
    pp = len(progs)
    for s, program in enumerate(progs):
        for ins in program:
            if ins.kind not in COMPUTE:
                yield s, peer(ins.kind, pp, s, ins.chunk, v_shape), (
                    ins.kind.startswith("send"), message(ins, pp, s, v_shape))
