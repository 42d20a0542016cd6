"""Pipeline schedules as data, checked without MPI: every F and B exactly once and in
dependency order, sends matching receives, bubble and memory against the formulas.

Bubble, as defined in parallel/pipeline/schedules.py: with T the time the last stage
finishes (F = 1, B = 2; ZB-H1 B = W = 1; communication free),
bubble = (pp T - busy time of all stages) / (pp T).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from fractions import Fraction

import pytest

from minipar.parallel.pipeline import chunk_layout
from minipar.parallel.pipeline import schedules as simulator
from minipar.parallel.pipeline.chunk_layout import V, iter_messages, virtual_stage
from minipar.parallel.pipeline.instructions import BACKWARD, COMPUTE, FORWARD, WEIGHT, Instruction
from minipar.parallel.pipeline.schedules import layout_of, programs
from minipar.parallel.pipeline.simulator import Costs, DeadlockError, ScheduleError, gantt, simulate

LOGICAL = Costs()  # F = B = W = 1, F&B = 3
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
        out += [("zb-v", pp, m, 1)]
        if m >= 2 * pp:  # dualpipev's rule
            out += [("dualpipev", pp, m, 1)]
        if pp % 2 == 0 and m % 2 == 0 and m >= 2 * pp:  # dualpipe's
            out += [("dualpipe", pp, m, 1)]
    return out


@functools.cache
def simulate_schedule(name: str, pp: int, m: int, v: int = 1, synchronous_sends: bool = False,
                      weights: Costs = LOGICAL):
    """The simulator, each case played once for all the tests below."""
    return simulator.simulate_schedule(name, pp, m, v, synchronous_sends, weights)


def exact(value: float) -> Fraction:
    """Logical times are small integers, so the float bubble is a ratio of integers."""
    return Fraction(value).limit_denominator(10_000)


def parts(sim, pp: int, layout: str) -> list[tuple[int, str, int, object]]:
    """(virtual stage, kind, microbatch, slot) of every F, B, W played, an F&B step
    counted as its F, B and W (all three spanning the step)."""
    out = []
    for slot in sim.timeline:
        ins = Instruction(slot.kind, slot.microbatch, slot.chunk, slot.back_microbatch,
                          slot.back_chunk)
        for part in ins.parts():
            out.append((virtual_stage(pp, slot.stage, part.chunk, layout), part.kind,
                        part.microbatch, slot))
    return out


def chain_microbatches(name: str, pp: int, m: int, vs: int) -> range:
    """The microbatches virtual stage vs runs: all, or in DualPipe its chain's half."""
    if name != "dualpipe":
        return range(m)
    return range(m // 2) if vs < pp else range(m // 2, m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v",
                                  "dualpipev", "dualpipe"])
def test_every_compute_runs_once_in_dependency_order(name):
    """Every (virtual stage, kind, microbatch) once, after what it needs. DualPipe's two
    chains (virtual stages 0..pp-1 and pp..2pp-1) each take half the microbatches."""
    for _, pp, m, v in [c for c in cases() if c[0] == name]:
        sim = simulate_schedule(name, pp, m, v)
        split = name in ("zb-h1", "zb-v", "dualpipev", "dualpipe")
        kinds = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
        layout = layout_of(name)
        v = 2 if name in ("zb-v", "dualpipev", "dualpipe") else v
        played = parts(sim, pp, layout)
        seen = Counter((vs, kind, mb) for vs, kind, mb, _ in played)
        microbatches = functools.partial(chain_microbatches, name, pp, m)
        expected = {(vs, k, mb) for vs in range(pp * v) for k in kinds
                    for mb in microbatches(vs)}
        assert set(seen) == expected and set(seen.values()) == {1}, (name, pp, m, v)
        at = {(vs, kind, mb): slot for vs, kind, mb, slot in played}
        for vs in range(pp * v):
            for mb in microbatches(vs):
                assert at[vs, FORWARD, mb].end <= at[vs, BACKWARD, mb].start
                chain_goes_on = vs + 1 < pp * v and (name != "dualpipe" or vs != pp - 1)
                if chain_goes_on:  # forward flows down, backward flows up
                    assert at[vs, FORWARD, mb].end <= at[vs + 1, FORWARD, mb].start
                    assert at[vs + 1, BACKWARD, mb].end <= at[vs, BACKWARD, mb].start
                if split and at[vs, BACKWARD, mb] is not at[vs, WEIGHT, mb]:
                    assert at[vs, BACKWARD, mb].end <= at[vs, WEIGHT, mb].start


def test_one_unit_rule_every_rank_does_m_stages_of_work_in_every_schedule():
    """The unit rule (`UNIT_RULE`, `chunk_share`): a chunk costs its share of a stage,
    so in every schedule each rank is busy exactly M (F + B + W) of a whole stage per
    step -- 3M units in logical time, and so for other weights -- however its layers are
    cut into chunks (interleaved V per rank, a V's two halves, DualPipe's two copies)."""
    for weights in (LOGICAL, Costs(2, 3, 1)):
        work = weights.forward + weights.backward + weights.weight
        for name, pp, m, v in cases():
            if weights is not LOGICAL and pp > 4:
                continue
            sim = simulate_schedule(name, pp, m, v, weights=weights)
            busy = [0.0] * pp
            for slot in sim.timeline:
                busy[slot.stage] += slot.end - slot.start
            assert busy == pytest.approx([m * work] * pp), (name, pp, m, v, weights)
    assert simulator.chunk_share("zb-v") == simulator.chunk_share("dualpipev") == 0.5
    assert simulator.chunk_share("interleaved", 3) == pytest.approx(1 / 3)
    assert simulator.chunk_share("dualpipe") == simulator.chunk_share("1f1b") == 1.0
    assert "share" in simulator.UNIT_RULE


def test_sends_and_receives_match_pairwise_in_order():
    """Between every pair of neighbouring ranks, in each direction, the k-th send is
    the k-th receive (same microbatch, same boundary): MPI delivers messages of one
    tag in order, so each Recv gets its own microbatch's tensor."""
    for name, pp, m, v in cases():
        sent, received = defaultdict(list), defaultdict(list)
        layout = layout_of(name)
        for stage, other, (is_send, what) in iter_messages(programs(name, pp, m, v),
                                                           layout):
            if is_send:
                sent[(stage, other, what[0])].append(what)
            else:
                received[(other, stage, what[0])].append(what)
            assert abs(stage - other) in (1, pp - 1), "neighbours only"
        assert sent == received, (name, pp, m, v)
        # every boundary carries one activation and one gradient per microbatch; in a
        # V the boundary at the bottom (pp - 1 | pp) stays inside rank pp - 1; DualPipe's
        # two chains have pp - 1 boundaries each, and half the microbatches
        boundaries = {"loop": pp * v - 1, "v": 2 * pp - 2, "dual": pp - 1}[layout]
        assert sum(len(x) for x in sent.values()) == 2 * m * boundaries


def test_no_deadlock_with_isend_for_pp_2_to_8_and_m_1_to_16():
    """The executor never blocks in a send (Isend) and waits in Recv only: exactly the
    simulator's eager mode. Every program finishes there, so the executor cannot hang."""
    for name, pp, m, v in cases():
        sim = simulate_schedule(name, pp, m, v)
        assert len(sim.timeline) == sum(1 for p in programs(name, pp, m, v)
                                        for i in p if i.kind in COMPUTE)
    with pytest.raises(ValueError, match="at least 2 pp"):
        programs("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="even pp"):
        programs("dualpipe", 3, 12)
    with pytest.raises(ValueError, match="even number of microbatches"):
        programs("dualpipe", 4, 9)
    with pytest.raises(ValueError, match="at least 2 pp"):
        programs("dualpipe", 4, 6)


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


# ------------------------------------------------- the papers' tables, per rank
WEIGHTS = [Costs(), Costs(1, 1, 1), Costs(2, 2, 1), Costs(1, 2, 1), Costs(2, 1, 1),
           Costs(3, 2, 2)]


def test_1f1b_and_zb_h1_idle_per_rank_is_deepseek_v3_table_2_for_any_weights():
    """DeepSeek-V3 Table 2 (B there is the full backward, our B + W): 1F1B idles
    (PP-1)(F+B) and ZB1P (PP-1)(F+B-2W) on its worst rank, for any durations, and
    hold PP microbatches on their first rank."""
    for weights in WEIGHTS:
        f, b, w = weights.forward, weights.backward + weights.weight, weights.weight
        for pp in range(2, 7):
            for m in (pp, 2 * pp, 3 * pp + 1):
                one = simulate_schedule("1f1b", pp, m, weights=weights)
                zb = simulate_schedule("zb-h1", pp, m, weights=weights)
                assert max(one.idle) == one.idle[0] == (pp - 1) * (f + b), (weights, pp, m)
                assert max(zb.idle) == zb.idle[0] == (pp - 1) * (f + b - 2 * w), (weights, pp, m)
                assert one.peak_in_flight[0] == zb.peak_in_flight[0] == pp


def test_zero_bubble_table_bubble_rates_for_equal_f_b_w():
    """Qi et al.'s table (T_F = T_B = T_W): 1F1B's idle is (p-1)(F+B+W) = 3(p-1), ZB-H1's a
    third of it, (p-1)."""
    for pp in range(2, 9):
        for m in range(pp, 17):
            one = simulate_schedule("1f1b", pp, m)
            zb = simulate_schedule("zb-h1", pp, m)
            assert max(one.idle) == 3 * (pp - 1) and max(zb.idle) == pp - 1, (pp, m)


def test_dualpipev_idle_is_deepseek_v3_table_2_and_holds_pp_plus_1():
    """DualPipeV on pp ranks is DualPipe on PP = 2pp ranks folded in half: its worst rank
    idles (PP/2-1)(F&B+B-3W), B the full backward, in logical time (F = B = W, F&B =
    F + B + W: nothing overlaps here; a chunk holds half a stage, so F = B = W = 1/2 in
    stage units, F&B = 3/2, and B + W = 1 the full backward); each rank holds at most
    PP + 1 = 2pp + 1 chunk-activations, and 1x the parameters (2 chunks of L/(2pp) blocks: L/pp)."""
    for pp in range(2, 9):
        for m in range(2 * pp, 2 * pp + 9):
            sim = simulate_schedule("dualpipev", pp, m)
            big_pp, f_and_b, b, w = 2 * pp, 1.5, 1, 0.5
            assert max(sim.idle) == (big_pp // 2 - 1) * (f_and_b + b - 3 * w), (pp, m)
            assert max(sim.peak_in_flight) == big_pp + 1, (pp, m)
            assert sim.peak_in_flight[0] == big_pp + 1


def test_zb_v_keeps_1f1b_memory_and_beats_zb_h1():
    """ZB-V (`v_schedules.zb_v_orders`): at most 2 pp chunk-activations per rank (pp
    microbatches of a whole stage, 1F1B's memory) for every M; with F = B = W = 1 and
    M >= 2 pp - 1 no rank idles between its own first and last instruction -- the zero
    bubble of Qi et al. -- so each rank's span is exactly its work, 2M chunks' F, B, W of
    1/2 unit each: 3 M units, 1F1B's work (T = 3M against 1F1B's 3M + 3(pp-1)), and the
    bubble fraction is below ZB-H1's. Below the bound rank 0 cannot fill the first trip
    round the V (2 pp - 1 units) with forwards, and idles."""
    for pp in range(2, 9):
        for m in [*range(1, 17), 2 * pp + 7, 40]:
            zv = simulate_schedule("zb-v", pp, m)
            assert max(zv.peak_in_flight) <= 2 * pp, (pp, m)
            if m >= 2 * pp - 1:
                assert zv.idle == [0] * pp, (pp, m, zv.idle)
                for s in range(pp):
                    mine = [slot for slot in zv.timeline if slot.stage == s]
                    span = max(x.end for x in mine) - min(x.start for x in mine)
                    assert span == 3 * m, (pp, m, s)
                assert zv.makespan < simulate_schedule("1f1b", pp, m).makespan, (pp, m)
                assert zv.bubble < simulate_schedule("zb-h1", pp, m).bubble, (pp, m)
            else:
                assert max(zv.idle) > 0, (pp, m)


def test_dualpipe_idle_is_deepseek_v3_table_2_with_twice_the_parameters():
    """DualPipe on PP ranks (even), M >= 2 PP microbatches, half fed from each end: its
    worst rank idles DeepSeek-V3 Table 2's (PP/2-1)(F&B+B-3W) (B the full backward) in
    logical time, each rank holds at most PP + 1 chunk-activations, and a chunk is a whole
    stage of L/PP blocks: 2 L/PP blocks per rank, twice DualPipeV's (2 chunks of L/(2 PP))."""
    for big_pp in (2, 4, 6, 8):
        for m in range(2 * big_pp, 2 * big_pp + 9, 2):
            sim = simulate_schedule("dualpipe", big_pp, m)
            f_and_b, b, w = 3, 2, 1
            assert max(sim.idle) == (big_pp // 2 - 1) * (f_and_b + b - 3 * w), (big_pp, m)
            assert max(sim.peak_in_flight) == big_pp + 1, (big_pp, m)
            folded = simulate_schedule("dualpipev", big_pp // 2, m // 2)
            # the mirror of DualPipeV's program; a DualPipeV chunk on PP/2 ranks is half of
            # its stage, so one DualPipe stage: its stage units weigh twice DualPipe's
            assert max(sim.idle) == 2 * max(folded.idle)
    layers, pp = 16, 4
    assert blocks_per_rank("dualpipe", layers, pp) == 2 * blocks_per_rank("dualpipev",
                                                                          layers, pp)
    assert blocks_per_rank("dualpipe", layers, pp) == 2 * blocks_per_rank("1f1b", layers, pp)


def blocks_per_rank(name: str, layers: int, pp: int) -> int:
    """Blocks a rank holds: its chunks, each one run of the model's `model_stage`s."""
    layout = layout_of(name)
    runs = pp if layout == "dual" else pp * simulator.chunks_per_rank(name)
    chunks = {chunk_layout.model_stage(pp, virtual_stage(pp, 0, c, layout), layout)
              for c in range(simulator.chunks_per_rank(name))}
    return len(chunks) * layers // runs


def test_v_placement_puts_the_first_and_last_chunks_on_rank_0():
    from minipar.parallel.pipeline.chunk_layout import rank_and_chunk

    pp = 4
    assert [virtual_stage(pp, s, c, V) for s in range(pp) for c in (0, 1)] == \
        [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(rank_and_chunk(pp, virtual_stage(pp, s, c, V), V) == (s, c)
               for s in range(pp) for c in (0, 1))


def test_overlapped_step_stands_for_f_then_full_backward():
    step = Instruction("F&B", 4, 0, 1, 1)
    assert [str(p) for p in step.parts()] == ["F5", "B2/1", "W2/1"]
    assert str(step) == "F5/0&B2/1"
    lines = gantt(simulate_schedule("dualpipev", 2, 4), 2)
    assert lines[0].startswith("stage 0: F1a     F2a     F3a     F1b     B1b     W1b     F2b     "
                               "F4a&B2b F4a&B2b F4a&B2b .")


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
