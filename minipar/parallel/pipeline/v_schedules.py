"""The V-shaped pipeline schedules: ZB-V and DualPipeV, and DualPipe, their two-way twin.

What this file teaches: when each rank holds two model chunks, the order of its
forwards and backwards can close the pipeline's bubble. The model is cut into
2 pp chunks; rank s holds chunks s and 2pp-1-s, a V: the forward runs down the
ranks and back up, so rank 0 holds both the first chunk and the last (the loss),
and the backward starts where the forward started. With the backward split into
B (input gradient: the previous stage waits for it) and W (weight gradient: no
one waits for it), the put-off W's are what fills the gaps.

- ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", the
  zero-bubble family of "Zero Bubble Pipeline Parallelism"): built here on
  per-rank clocks in unit time (`zb_v_orders`): warm-up forwards fixed per
  rank, then every rank one B and one F in turn, a W only where the rank would
  otherwise wait for its input or where its memory (1F1B's: 2 pp
  chunk-activations, pp microbatches of a whole stage) is full. With F = B = W
  and M >= 2 pp - 1 no rank ever idles between its first and its last
  instruction: the bubble is zero.
- DualPipeV (DeepSeek-V3, 2024): the same V, eight phases whose steady state runs
  *overlapped* F&B steps: the forward of one microbatch and the backward of
  another in one step. On GPUs the point of the pair is that one's computation
  hides the other's communication (the pipeline Send/Recv and MoE's
  dispatch/combine Alltoall run on another stream while the other chunk
  computes); here the two microbatches' instructions run one after the other
  inside the step, so the step's duration is its own cost `F&B` in the
  simulator (F + B + W when nothing overlaps, less when the hardware overlaps).
- DualPipe (DeepSeek-V3): microbatches fed from both ends. Two copies of the
  model, one per direction: rank r holds stage r of the copy whose microbatches
  enter at rank 0 (chunk 0) and stage pp-1-r of the copy whose microbatches
  enter at rank pp-1 (chunk 1), so 2x the parameters (each rank 2 L/pp blocks),
  and after the step the two copies' gradients of a stage are summed
  (v_executor.py `sum_the_two_copies`): one process's step. By symmetry
  ranks r and pp-1-r run mirror images of one program, and that program is
  DualPipeV's for pp/2 ranks and M/2 microbatches (`dualpipe_order`): its
  bubble is DeepSeek-V3's (PP/2-1)(F&B+B-3W), its activation memory PP + 1.

Run the checks: `python -m pytest tests/parallel/test_pipeline_schedules.py`.
"""

from __future__ import annotations

import functools
from collections import deque

from minipar.parallel.pipeline.instructions import (
    BACKWARD,
    FORWARD,
    OVERLAPPED,
    WEIGHT,
    Instruction,
)


# ------------------------------------------------------------------ ZB-V
class _ZeroBubbleV:
    """ZB-V's orders, placed on one clock per rank in unit time (F = B = W = 1).

    Rank r's chunk c is virtual stage r (c = 0) or 2pp-1-r (c = 1). An instruction
    starts when its rank is free and what it needs has ended: F after the F of the
    stage before, B after its own F and the B of the stage after, W after its B.
    """

    def __init__(self, pp: int, microbatches: int) -> None:
        self.pp, self.microbatches = pp, microbatches
        self.cap = 2 * pp  # chunk-activations (F done, W not yet): 1F1B's memory
        self.end: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> time
        self.clock = [0] * pp
        self.alive = [0] * pp
        self.put_off: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
        self.count = {(kind, r, c): 0 for kind in (FORWARD, BACKWARD)
                      for r in range(pp) for c in (0, 1)}
        self.orders: list[list[Instruction]] = [[] for _ in range(pp)]

    def stage(self, r: int, c: int) -> int:
        return r if c == 0 else 2 * self.pp - 1 - r

    def ready(self, kind: str, r: int, c: int) -> int | None:
        """When rank r's next `kind` of chunk c could start; None if it has none left
        or what it needs is not placed yet."""
        i, v = self.count[(kind, r, c)], self.stage(r, c)
        if i == self.microbatches:
            return None
        needs = [(FORWARD, v - 1, i)] if kind == FORWARD and v > 0 else []
        if kind == BACKWARD:
            needs = [(FORWARD, v, i)] + ([(BACKWARD, v + 1, i)] if v < 2 * self.pp - 1 else [])
        if any(need not in self.end for need in needs):
            return None
        return max((self.end[need] for need in needs), default=0)

    def run(self, r: int, kind: str, v: int, i: int, start: int) -> None:
        self.end[(kind, v, i)] = self.clock[r] = start + 1
        self.orders[r].append(Instruction(kind, i, int(v >= self.pp)))
        self.alive[r] += (kind == FORWARD) - (kind == WEIGHT)
        if kind == BACKWARD:
            self.put_off[r].append((v, i))

    def weight(self, r: int) -> None:
        """The oldest put-off W of rank r, now."""
        v, i = self.put_off[r].popleft()
        self.run(r, WEIGHT, v, i, self.clock[r])

    def put(self, r: int, kind: str, c: int) -> None:
        """Rank r's next `kind` of chunk c: W's first where its memory is full or where
        it would wait for its input, then the instruction itself."""
        start = self.ready(kind, r, c)
        while kind == FORWARD and self.alive[r] >= self.cap:
            self.weight(r)                                 # memory forces a W
        while self.put_off[r] and self.clock[r] < start:
            self.weight(r)                                 # a W instead of waiting
        i = self.count[(kind, r, c)]
        self.run(r, kind, self.stage(r, c), i, max(start, self.clock[r]))
        self.count[(kind, r, c)] += 1

    def can(self, kind: str, r: int, c: int) -> bool:
        return self.ready(kind, r, c) is not None

    def forwards(self, r: int) -> int:
        return self.count[(FORWARD, r, 0)] + self.count[(FORWARD, r, 1)]

    def warm_up(self) -> None:
        """1. every rank its first chunk-0 forward (microbatch 1 down the V's left arm);
        2. from the bottom rank up, rank r feeds more chunk-0 forwards (through ranks
           0..r) while microbatch 1 has not come back up to its chunk 1, keeping room
           for the 2(r+1) chunk-activations still to come; then that chunk-1 forward;
        3. from rank 1 down, rank r forwards (alternating chunks, fed from the bottom)
           until it has done as many as the rank above it and more chunk-1 ones."""
        pp = self.pp
        for r in range(pp):                                               # 1
            self.put(r, FORWARD, 0)
        for r in range(pp - 1, -1, -1):                                   # 2
            if r < pp - 1:
                back = self.end[(FORWARD, self.stage(r + 1, 1), 0)]
                while self.alive[r] + 2 * (r + 1) <= self.cap and self.clock[r] < back \
                        and self.count[(FORWARD, r, 0)] < self.microbatches:
                    for j in range(r + 1):
                        self.put(j, FORWARD, 0)
            self.put(r, FORWARD, 1)
        c = 0
        for r in range(1, pp):                                            # 3
            ones = (FORWARD, r, 1)
            while self.forwards(r) < self.forwards(r - 1) or \
                    self.count[ones] <= self.count[(FORWARD, r - 1, 1)] < self.microbatches:
                placed = [self.put(j, FORWARD, c) for j in range(pp - 1, r - 1, -1)
                          if self.can(FORWARD, j, c)]
                c = 1 - c
                if not placed and not any(self.can(FORWARD, r, k) for k in (0, 1)):
                    break

    def steady(self) -> None:
        """Rounds: every rank one backward, then every rank one forward. A rank takes
        chunk 1's B and chunk 0's B in turn (chunk 0's once its input gradient is in);
        the chunk-1 B's are placed from rank 0 down (their gradients flow down), the
        chunk-0 B's from the bottom up; forwards likewise alternate the chunks."""
        pp = self.pp
        for _ in range(2 * self.microbatches):
            down, up = [], []
            for r in range(pp):
                ones, zeros = self.count[(BACKWARD, r, 1)], self.count[(BACKWARD, r, 0)]
                if ones > zeros and (r == pp - 1 or self.can(BACKWARD, r, 0)
                                     or ones == self.microbatches):
                    up.append(r)
                else:
                    down.append(r)
            for r in down:
                if self.can(BACKWARD, r, 1):
                    self.put(r, BACKWARD, 1)
            for r in reversed(up):
                if self.can(BACKWARD, r, 0):
                    self.put(r, BACKWARD, 0)
            for r in range(pp):
                ones, zeros = self.count[(FORWARD, r, 1)], self.count[(FORWARD, r, 0)]
                c = 0 if ones >= zeros or not self.can(FORWARD, r, 1) else 1
                if self.can(FORWARD, r, c):
                    self.put(r, FORWARD, c)

    def build(self) -> list[list[Instruction]]:
        self.warm_up()
        self.steady()
        for r in range(self.pp):       # cool-down: the W's still put off
            while self.put_off[r]:
                self.weight(r)
        return self.orders


@functools.cache
def _zb_v_orders(pp: int, microbatches: int) -> tuple[tuple[Instruction, ...], ...]:
    return tuple(tuple(order) for order in _ZeroBubbleV(pp, microbatches).build())


def zb_v_orders(pp: int, microbatches: int) -> list[list[Instruction]]:
    """ZB-V: every rank's F/B/W order (Qi et al.'s construction, see `_ZeroBubbleV`).

    The memory limit is 1F1B's: at most 2 pp chunk-activations per rank. With F = B =
    W = 1 and M >= 2 pp - 1 no rank idles between its first and last instruction
    (tests/parallel/test_pipeline_schedules.py, pp 2..8): the first M's warm-up fills rank 0
    until microbatch 1 comes back round the V (2 pp - 1 forwards), and the put-off W's
    cover every later wait, the cool-down's included.
    """
    return [list(order) for order in _zb_v_orders(pp, microbatches)]


def zb_v_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """One rank's ZB-V order (the orders are built for all ranks at once)."""
    return list(_zb_v_orders(pp, microbatches)[stage])


# ------------------------------------------------------------- DualPipeV
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



# --------------------------------------------------------------- DualPipe
def dualpipe_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """DualPipe (DeepSeek-V3): microbatches 0..M/2-1 enter at rank 0 (chunk 0: the copy
    whose stage r is on rank r), M/2..M-1 at rank pp-1 (chunk 1: stage r on rank pp-1-r).

    Rank r runs DualPipeV's program for pp/2 ranks and M/2 microbatches, as rank
    min(r, pp-1-r): the first half of the ranks reads the V's chunk 0 as direction 0
    and its chunk 1 as direction 1, the second half the other way round (its mirror
    image), and the V's microbatch j of direction d is microbatch j + d M/2. Where
    DualPipeV's rank pp/2-1 hands its output from chunk 0 to chunk 1 itself, DualPipe's
    two middle ranks send each other theirs. Needs pp even and M even, M >= 2 pp.
    """
    if pp % 2:
        raise ValueError(f"dualpipe needs an even pp, two mirrored halves (got {pp})")
    if microbatches % 2 or microbatches < 2 * pp:
        raise ValueError(f"dualpipe needs an even number of microbatches, at least 2 pp = "
                         f"{2 * pp} (got {microbatches}): half enter at each end")
    half = microbatches // 2
    mirrored = int(stage >= pp // 2)

    def direction(chunk: int) -> int:
        return chunk ^ mirrored

    order = []
    for ins in dualpipev_order(pp // 2, half, min(stage, pp - 1 - stage)):
        d = direction(ins.chunk)
        if ins.kind == OVERLAPPED:
            back = direction(ins.back_chunk)
            order.append(Instruction(OVERLAPPED, ins.microbatch + d * half, d,
                                     ins.back_microbatch + back * half, back))
        else:
            order.append(Instruction(ins.kind, ins.microbatch + d * half, d))
    return order
