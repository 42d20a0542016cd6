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
- The V-shaped ones, two chunks per rank (pipeline_v.py): ZB-V (Qi et al. 2024),
  zero bubble; DualPipeV (DeepSeek-V3), overlapped F&B steps; and DualPipe, the
  two-way pipeline with two copies of the model. Here they are only dispatched
  (`compute_order`) and placed (`virtual_stage`: a V, or two opposite chains).

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
(pp-1)(F+B+W), ZB-H1 (pp-1)(F+B-W), ZB-V 0 (F = B = W, M >= 2pp - 1),
DualPipeV (pp-1)(F&B+B-2W) and DualPipe on PP ranks (PP/2-1)(F&B+B-2W) --
DeepSeek-V3's table writes B for the *full* backward (our B + W) and PP for the
ranks of DualPipe, the unfolded DualPipeV (PP = 2 pp): (PP/2-1)(F&B+B-3W). The
simulator reproduces 1F1B's and ZB-H1's for any durations, ZB-V's, DualPipeV's
and DualPipe's in logical time (F = B = W, F&B = F + B + W).

Run the checks: `python -m pytest tests/test_pipeline_schedules.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from minipar.parallel.pipeline_instructions import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    OVERLAPPED,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    WEIGHT,
    Instruction,
)
from minipar.parallel.pipeline_v import dualpipe_order, dualpipev_order, zb_v_order

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev",  # `--schedule`
             "dualpipe")
V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank, placed in a V
TWO_WAY = ("dualpipe",)  # two copies of the model, microbatches fed from both ends
SIMULATED_ONLY = V_SHAPED + TWO_WAY  # no closed-form bubble fraction: the simulator's
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev", "dualpipe")  # B (input grad), W apart
LOOP, V, DUAL = "loop", "v", "dual"  # where a rank's chunks sit: `layout_of`


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
        return zb_v_order(pp, microbatches, stage)
    if schedule == "dualpipev":
        return dualpipev_order(pp, microbatches, stage)
    if schedule == "dualpipe":
        return dualpipe_order(pp, microbatches, stage)
    raise ValueError(f"unknown schedule {schedule!r} (one of {', '.join(SCHEDULES)})")


def chunks_per_rank(schedule: str, virtual: int = 1) -> int:
    """How many model chunks a pipeline rank holds: 2 for the V schedules and DualPipe,
    V for interleaved, else 1."""
    return 2 if schedule in SIMULATED_ONLY else virtual


def layout_of(schedule: str) -> str:
    """Where a rank's chunks sit: in a V (`V`: ZB-V, DualPipeV), on two chains running
    opposite ways (`DUAL`: DualPipe), or looping round the ranks (`LOOP`: the rest)."""
    return V if schedule in V_SHAPED else DUAL if schedule in TWO_WAY else LOOP


# ---------------------------------------------------- adding communication
def virtual_stage(pp: int, stage: int, chunk: int, layout: str = LOOP) -> int:
    """Which virtual stage chunk `chunk` of pipeline rank `stage` is: chunk * pp + stage
    when chunks loop round the ranks (interleaved), stage or 2pp-1-stage in a V (ZB-V,
    DualPipeV). DualPipe's two chains are virtual stages 0..pp-1 (chunk 0: stage s on
    rank s) and pp..2pp-1 (chunk 1: stage s on rank pp-1-s), each a whole model."""
    if layout == V:
        return stage if chunk == 0 else 2 * pp - 1 - stage
    if layout == DUAL:
        return chunk * pp + (stage if chunk == 0 else pp - 1 - stage)
    return chunk * pp + stage


def placement(pp: int, v: int, layout: str = LOOP) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage v: the inverse of `virtual_stage`."""
    if layout == V:
        return (v, 0) if v < pp else (2 * pp - 1 - v, 1)
    if layout == DUAL:
        chunk, position = divmod(v, pp)
        return (position if chunk == 0 else pp - 1 - position), chunk
    return v % pp, v // pp


def model_stage(pp: int, v: int, layout: str = LOOP) -> int:
    """Which run of blocks virtual stage v computes: v itself, except in DualPipe, whose
    two chains are two copies of one model of pp stages (v mod pp)."""
    return v % pp if layout == DUAL else v


def first_stage(pp: int, v: int, layout: str = LOOP) -> bool:
    """Whether virtual stage v takes the batch (holds the embedding)."""
    return model_stage(pp, v, layout) == 0


def last_stage(pp: int, v: int, chunks: int, layout: str = LOOP) -> bool:
    """Whether virtual stage v computes the loss (holds the head), with `chunks` per rank."""
    return model_stage(pp, v, layout) == (pp if layout == DUAL else pp * chunks) - 1


def local_boundary(pp: int, stage: int, boundary: int, layout: str = LOOP) -> bool:
    """Whether both sides of boundary b (virtual stages b, b + 1) are on this rank: the
    bottom of the V, where rank pp-1 hands its chunk 0's output to its chunk 1 itself."""
    return layout == V and placement(pp, boundary, V)[0] == placement(pp, boundary + 1, V)[0]


def with_communication(order: list[Instruction], pp: int, stage: int, virtual: int = 1,
                       layout: str = LOOP) -> list[Instruction]:
    """Wrap each compute instruction in the messages it needs and produces.

    A forward receives its input from the previous virtual stage (unless it is
    the first) and sends its output to the next (unless it is the last); a
    backward receives the gradient of its output from the next virtual stage and
    sends the gradient of its input back. Receives sit right before the compute
    that needs them, sends right after the compute that produced them. An F&B
    step receives both its inputs first and sends both its outputs after. A
    boundary inside the rank (the bottom of the V) needs no message.
    """
    chunks = 2 if layout != LOOP else virtual

    def before_me(v: int) -> bool:  # a message crosses the boundary into v
        return not first_stage(pp, v, layout) and not local_boundary(pp, stage, v - 1, layout)

    def after_me(v: int) -> bool:   # a message crosses the boundary out of v
        return not last_stage(pp, v, chunks, layout) and not local_boundary(pp, stage, v,
                                                                            layout)

    program: list[Instruction] = []
    for ins in order:
        before, after = [], []
        for part in ins.parts():
            v = virtual_stage(pp, stage, part.chunk, layout)
            at = (part.microbatch, part.chunk)
            if part.kind == FORWARD:
                before += [Instruction(RECV_ACT, *at)] if before_me(v) else []
                after += [Instruction(SEND_ACT, *at)] if after_me(v) else []
            elif part.kind == BACKWARD:
                before += [Instruction(RECV_GRAD, *at)] if after_me(v) else []
                after += [Instruction(SEND_GRAD, *at)] if before_me(v) else []
        program += before + [ins] + after
    return program


def schedule(name: str, pp: int, microbatches: int, stage: int, virtual: int = 1
             ) -> list[Instruction]:
    """The full program of pipeline rank `stage`: compute and communication in order.

    `schedule("1f1b", 4, 8, 3)` is the last stage's list; the executor runs it
    with Send/Recv, the simulator with a logical clock.
    """
    return with_communication(compute_order(name, pp, microbatches, stage, virtual),
                              pp, stage, chunks_per_rank(name, virtual), layout_of(name))


def programs(name: str, pp: int, microbatches: int, virtual: int = 1
             ) -> list[list[Instruction]]:
    """Every stage's program, stage 0 first."""
    return [schedule(name, pp, microbatches, s, virtual) for s in range(pp)]


def peer(kind: str, pp: int, stage: int, chunk: int = 0, layout: str = LOOP) -> int:
    """The pipeline rank a message of `kind` about `chunk` goes to or comes from.

    Activations flow to the next virtual stage, gradients to the previous one. When
    chunks loop (interleaved) that is rank stage + 1 or stage - 1 around the ring
    (mod pp): the last rank's chunk c feeds rank 0's chunk c + 1. In a V, chunk 0
    flows down the ranks and chunk 1 back up; in DualPipe chunk 0 flows down, chunk 1 up."""
    downstream = kind in (SEND_ACT, RECV_GRAD)
    if layout != LOOP:
        v = virtual_stage(pp, stage, chunk, layout)
        return placement(pp, v + 1 if downstream else v - 1, layout)[0]
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


def message(ins: Instruction, pp: int, stage: int, layout: str = LOOP
            ) -> tuple[str, int, int]:
    """What a send or receive carries: (activation or gradient, the boundary it crosses,
    microbatch). Boundary b lies between virtual stages b and b + 1."""
    v = virtual_stage(pp, stage, ins.chunk, layout)
    boundary = {SEND_ACT: v, RECV_ACT: v - 1, SEND_GRAD: v - 1, RECV_GRAD: v}[ins.kind]
    return ("act" if ins.kind in (SEND_ACT, RECV_ACT) else "grad", boundary, ins.microbatch)


class _Player:
    """Plays every stage's program on its own clock; see `simulate`."""

    def __init__(self, progs: list[list[Instruction]], cost: dict[str, float],
                 synchronous_sends: bool, layout: str) -> None:
        self.progs, self.cost, self.synchronous = progs, cost, synchronous_sends
        self.layout = layout
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
        return peer(ins.kind, self.pp, stage, ins.chunk, self.layout)

    def message(self, ins: Instruction, stage: int) -> tuple[str, int, int]:
        return message(ins, self.pp, stage, self.layout)

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
        v = virtual_stage(self.pp, s, part.chunk, self.layout)
        step = {FORWARD: -1, BACKWARD: 1}.get(part.kind)
        if step and 0 <= v + step < 2 * self.pp and self.layout == V \
                and placement(self.pp, v + step, V)[0] == s:
            needs.append((s, part.kind, placement(self.pp, v + step, V)[1]))
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
             synchronous_sends: bool = False, layout: str = LOOP) -> Simulation:
    """Play every stage's program in logical time, honoring every dependency.

    Each stage runs its instructions in order on its own clock: a compute
    instruction takes `cost[(stage, kind, chunk, microbatch)]` if given (a measured
    duration, see `replay`), else `cost[kind]`; communication takes no time, and a receive
    waits until its message was sent. With `synchronous_sends` a send also waits
    until the receiver reaches the matching receive (MPI's rendezvous protocol,
    what a blocking `Send` of a large message does); otherwise sends never block
    (`Isend`). Raises `DeadlockError` if the stages get stuck, `ScheduleError` if a
    message arrives out of order or a backward precedes its forward. `layout`:
    where the chunks sit (`layout_of`: round the ranks, in a V, or DualPipe's two chains).
    """
    player = _Player(progs, cost, synchronous_sends, layout)
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
                    synchronous_sends, layout_of(name))


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
                    layout=layout_of(name))


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
    if schedule in SIMULATED_ONLY:
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


def iter_messages(progs: list[list[Instruction]], layout: str = LOOP
                  ) -> Iterator[tuple[int, int, tuple]]:
    """Every send and receive as (stage, peer, (direction, boundary, microbatch)), each
    stage's in program order: what the pairwise matching test compares."""
    pp = len(progs)
    for s, program in enumerate(progs):
        for ins in program:
            if ins.kind not in COMPUTE:
                yield s, peer(ins.kind, pp, s, ins.chunk, layout), (
                    ins.kind.startswith("send"), message(ins, pp, s, layout))
