"""Pipeline schedules as data, checked without MPI: every F and B exactly once and in
dependency order, sends matching receives, bubble and memory against the formulas.

Bubble, as defined in pipeline_schedules.py: with T the time the last stage
finishes (F = 1, B = 2; ZB-H1 B = W = 1; communication free),
bubble = (pp T - busy time of all stages) / (pp T).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from fractions import Fraction

import pytest

from minipar.parallel import pipeline_schedules as simulator
from minipar.parallel.pipeline_schedules import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    WEIGHT,
    DeadlockError,
    Instruction,
    ScheduleError,
    gantt,
    iter_messages,
    programs,
    simulate,
    virtual_stage,
)

PIPELINES = [(pp, m) for pp in range(2, 9) for m in range(1, 17)]


def cases() -> list[tuple[str, int, int, int]]:
    """(schedule, pp, M, V) for pp 2..8 and M 1..16; interleaved with V = 2 and 3
    where M is divisible by pp (its rule), and with V = 1 everywhere."""
    out = []
    for pp, m in PIPELINES:
        out += [("gpipe", pp, m, 1), ("1f1b", pp, m, 1), ("zb-h1", pp, m, 1),
                ("interleaved", pp, m, 1)]
        if m % pp == 0:
            out += [("interleaved", pp, m, 2), ("interleaved", pp, m, 3)]
    return out


@functools.cache
def simulate_schedule(name: str, pp: int, m: int, v: int = 1, synchronous_sends: bool = False):
    """The simulator, each case played once for all the tests below."""
    return simulator.simulate_schedule(name, pp, m, v, synchronous_sends)


def exact(value: float) -> Fraction:
    """Logical times are small integers, so the float bubble is a ratio of integers."""
    return Fraction(value).limit_denominator(10_000)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_every_compute_runs_once_in_dependency_order(name):
    for _, pp, m, v in [c for c in cases() if c[0] == name]:
        sim = simulate_schedule(name, pp, m, v)
        kinds = (FORWARD, BACKWARD, WEIGHT) if name == "zb-h1" else (FORWARD, BACKWARD)
        seen = Counter((virtual_stage(pp, s.stage, s.chunk), s.kind, s.microbatch)
                       for s in sim.timeline)
        expected = {(vs, k, mb) for vs in range(pp * v) for k in kinds for mb in range(m)}
        assert set(seen) == expected and set(seen.values()) == {1}, (name, pp, m, v)
        at = {(virtual_stage(pp, s.stage, s.chunk), s.kind, s.microbatch): s
              for s in sim.timeline}
        for vs in range(pp * v):
            for mb in range(m):
                assert at[vs, FORWARD, mb].end <= at[vs, BACKWARD, mb].start
                if vs + 1 < pp * v:  # forward flows down, backward flows up
                    assert at[vs, FORWARD, mb].end <= at[vs + 1, FORWARD, mb].start
                    assert at[vs + 1, BACKWARD, mb].end <= at[vs, BACKWARD, mb].start
                if name == "zb-h1":
                    assert at[vs, BACKWARD, mb].end <= at[vs, WEIGHT, mb].start


def test_sends_and_receives_match_pairwise_in_order():
    """Between every pair of neighbouring ranks, in each direction, the k-th send is
    the k-th receive (same microbatch, same boundary): MPI delivers messages of one
    tag in order, so each Recv gets its own microbatch's tensor."""
    for name, pp, m, v in cases():
        sent, received = defaultdict(list), defaultdict(list)
        for stage, other, (is_send, what) in iter_messages(programs(name, pp, m, v)):
            if is_send:
                sent[(stage, other, what[0])].append(what)
            else:
                received[(other, stage, what[0])].append(what)
            assert abs(stage - other) in (1, pp - 1), "neighbours only"
        assert sent == received, (name, pp, m, v)
        # every boundary carries one activation and one gradient per microbatch
        assert sum(len(x) for x in sent.values()) == 2 * m * (pp * v - 1)


def test_no_deadlock_with_isend_for_pp_2_to_8_and_m_1_to_16():
    """The executor never blocks in a send (Isend) and waits in Recv only: exactly the
    simulator's eager mode. Every program finishes there, so the executor cannot hang."""
    for name, pp, m, v in cases():
        sim = simulate_schedule(name, pp, m, v)
        assert len(sim.timeline) == sum(1 for p in programs(name, pp, m, v)
                                        for i in p if i.kind in COMPUTE)


def test_blocking_sends_would_deadlock_1f1b():
    """Why the executor uses Isend: with rendezvous (blocking) sends, stage 0 sends the
    activation of F2 while stage 1 sends the gradient of B1, each waiting for the other."""
    with pytest.raises(DeadlockError, match="send_act2.*send_grad1"):
        simulate_schedule("1f1b", 2, 4, synchronous_sends=True)
    assert simulate_schedule("gpipe", 4, 8, synchronous_sends=True).makespan == 33


def test_simulator_catches_a_wrong_program():
    good = programs("1f1b", 2, 2)
    swapped = [good[0], good[1][:]]
    i = swapped[1].index(Instruction("recv_act", 0))
    j = swapped[1].index(Instruction("recv_act", 1))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match="expects"):
        simulate(swapped, {FORWARD: 1, BACKWARD: 2})
    backward_first = [good[0], [Instruction(BACKWARD, 0), *good[1]]]
    with pytest.raises(ScheduleError, match="before its F"):
        simulate(backward_first, {FORWARD: 1, BACKWARD: 2})


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(name):
    for pp, m in PIPELINES:
        sim = simulate_schedule(name, pp, m)
        assert exact(sim.bubble) == Fraction(pp - 1, m + pp - 1), (pp, m)
        assert sim.makespan == 3 * (m + pp - 1)


def test_interleaved_bubble_is_exactly_p_minus_1_over_v_m_plus_p_minus_1():
    for name, pp, m, v in cases():
        if name == "interleaved":
            sim = simulate_schedule(name, pp, m, v)
            assert exact(sim.bubble) == Fraction(pp - 1, v * m + pp - 1), (pp, m, v)


def test_zb_h1_idle_time_is_a_third_of_1f1b():
    """ZB-H1 with M >= pp: T = 3M + pp - 1, so each stage idles pp - 1 units where 1F1B
    idles 3(pp - 1): bubble (pp-1)/(3M+pp-1). With M < pp it still beats 1F1B."""
    for pp, m in PIPELINES:
        zb, one = simulate_schedule("zb-h1", pp, m), simulate_schedule("1f1b", pp, m)
        idle_zb, idle_one = zb.makespan - 3 * m, one.makespan - 3 * m
        if m >= pp:
            assert idle_zb == pp - 1 and idle_one == 3 * (pp - 1), (pp, m)
            assert exact(zb.bubble) == Fraction(pp - 1, 3 * m + pp - 1)
        else:
            assert zb.bubble < one.bubble, (pp, m)


def test_peak_in_flight_gpipe_m_1f1b_at_most_p():
    for pp, m in PIPELINES:
        assert simulate_schedule("gpipe", pp, m).peak_in_flight == [m] * pp
        one = simulate_schedule("1f1b", pp, m).peak_in_flight
        assert one == [min(pp - s, m) for s in range(pp)], (pp, m)
        assert max(simulate_schedule("zb-h1", pp, m).peak_in_flight) <= min(pp, m)


def test_1f1b_reads_as_warmup_steady_cooldown():
    """Stage 1 of 4 with 6 microbatches: 2 warm-up F, 4 x (F, B), 2 cool-down B."""
    kinds = [f"{i.kind}{i.microbatch + 1}" for i in programs("1f1b", 4, 6)[1]
             if i.kind in COMPUTE]
    assert kinds == ["F1", "F2", "F3", "B1", "F4", "B2", "F5", "B3", "F6", "B4", "B5", "B6"]


def test_gantt_chart_of_1f1b():
    lines = gantt(simulate_schedule("1f1b", 2, 3), 2)
    assert lines == ["stage 0: F1 F2 .  .  B1 B1 F3 B2 B2 .  B3 B3",
                     "stage 1: .  F1 B1 B1 F2 B2 B2 F3 B3 B3 .  ."]


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 3)])
def test_interleaving_finishes_the_same_model_sooner(pp, m, v):
    """A chunk holds 1/V of a stage's layers and is charged F = 1/V, B = 2/V: the same
    work per stage (3M units) as 1F1B, but the warm-up and cool-down shrink by V:
    T = 3M + 3(pp-1)/V against 1F1B's 3M + 3(pp-1)."""
    one = simulate_schedule("1f1b", pp, m)
    interleaved = simulate_schedule("interleaved", pp, m, v)
    busy = defaultdict(float)
    for slot in interleaved.timeline:
        busy[slot.stage] += slot.end - slot.start
    assert all(t == pytest.approx(3 * m) for t in busy.values())  # same work as 1F1B
    assert one.makespan == pytest.approx(3 * m + 3 * (pp - 1))
    assert interleaved.makespan == pytest.approx(3 * m + 3 * (pp - 1) / v)
    assert interleaved.makespan < one.makespan


def test_replay_plays_measured_durations_on_the_dependencies():
    """Replaying a timeline whose durations are the logical costs gives back the
    simulation; doubling one stage's forwards delays exactly what depends on them."""
    base = simulate_schedule("1f1b", 4, 8)
    timeline = [{"stage": s.stage, "kind": s.kind, "chunk": s.chunk,
                 "microbatch": s.microbatch, "start": 10.0, "end": 10.0 + s.end - s.start}
                for s in base.timeline]
    same = simulator.replay("1f1b", 4, 8, 1, timeline)
    assert same.makespan == pytest.approx(base.makespan)
    assert same.bubble == pytest.approx(base.bubble)
    slower = [dict(r, end=r["start"] + 2 * (r["end"] - r["start"]))
              if r["stage"] == 1 and r["kind"] == FORWARD else r for r in timeline]
    slow = simulator.replay("1f1b", 4, 8, 1, slower)
    assert slow.makespan > base.makespan
    assert all(s.end - s.start == 2 for s in slow.timeline if s.stage == 1 and s.kind == FORWARD)
