"""The pipeline simulator: every stage's program played on its own clock.

Each stage runs its instructions in order; a compute instruction takes its cost, a
receive waits for its message, a send never blocks (Isend) unless asked to behave like
a rendezvous Send. Out of it come the timeline, the bubble, each stage's idle time and
the peak activations it held, and a text Gantt chart; a stuck program raises
`DeadlockError`, a wrong one `ScheduleError`. parallel/pipeline/schedules.py gives it the
programs and the costs of each schedule (`simulate_schedule`, `replay`).
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.parallel.pipeline.chunk_layout import (
    LOOP,
    V,
    message,
    peer,
    rank_and_chunk,
    virtual_stage,
)
from minipar.parallel.pipeline.instructions import (
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
                and rank_and_chunk(self.pp, v + step, V)[0] == s:
            needs.append((s, part.kind, rank_and_chunk(self.pp, v + step, V)[1]))
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


def bubble_fraction(intervals: list[tuple[int, float, float]], stages: int) -> float:
    """Idle share of stage-time: 1 - busy / (stages * T) for busy (stage, start, end)
    intervals, T from the first start to the last end. Works for simulated slots
    and for wall-clock timelines alike."""
    begin = min(start for _, start, _ in intervals)
    end = max(stop for _, _, stop in intervals)
    busy = sum(stop - start for _, start, stop in intervals)
    return 1.0 - busy / (stages * (end - begin))


def measured_bubble(timeline: list[dict]) -> float:
    """Idle share of rank-time in a real run's timeline (`RunResult.extras["timeline"]`):
    `bubble_fraction` over its compute instructions, one stage per rank that computed."""
    busy = [(r["rank"], r["start"], r["end"]) for r in timeline if r["kind"] in COMPUTE]
    return bubble_fraction(busy, len({rank for rank, _, _ in busy}))


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
    """One line per stage, one cell per shortest instruction (a chunk's forward: one
    stage unit, 1/V of one interleaved, 1/2 in a V): `F3` forward of microbatch 3,
    `B3` backward (two cells when B = 2), `W3` weight gradient, `.` idle. With model
    chunks, a letter names the chunk (`F3a`, `F3b`); `F3a&B1b` an F&B step."""
    chunks = max(slot.chunk for slot in sim.timeline) + 1
    cell = min(slot.end - slot.start for slot in sim.timeline)  # 1, 1/V interleaved, 1/2 V

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
