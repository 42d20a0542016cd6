"""The figures draw the data they are given, from real MPI runs, as readable PNGs.

Real data: one `classroom.train` job on 4 ranks (a pipeline, an MoE model with
expert parallelism, ZeRO-3) and the guided tour on 8 ranks with `--plot`. Each
figure is checked against the numbers it was drawn from (bar heights, box
counts, curves), then saved and read back as a picture that is not blank.
"""

from __future__ import annotations

import re
import time

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
from matplotlib.patches import Rectangle

from minipar.core import nn
from minipar.core.byte_units import byte_unit
from minipar.core.memory import wire_formula
from minipar.parallel.pipeline.instructions import COMPUTE
from minipar.parallel.pipeline.schedules import bubble_formula, simulate_schedule
from minipar.parallel.pipeline.simulator import bubble_fraction, measured_bubble
from minipar.teaching import classroom, load_plots, plots
from tests.harness.mpi import minipar

SMALL = dict(d_model=16, d_in=8, batch=32, steps=2)


def picture_problem(path: object) -> str | None:
    """What keeps a PNG from being a real figure (too small, blank or all ink, too few
    colours), or None: big enough, some ink on white, several colours."""
    image = matplotlib.image.imread(path)
    if image.shape[0] < 200 or image.shape[1] < 300:
        return f"{image.shape[1]}x{image.shape[0]} pixels: too small"
    ink = (image[..., :3] < 0.9).any(axis=-1).mean()  # share of pixels that are not white
    if not 0.01 < ink < 0.95:
        return f"{ink:.1%} of it inked: blank or solid"
    rgb = (image[..., :3] * 255).astype(np.uint32)   # one integer per colour: a 1-D unique
    colours = np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2])  # (axis=0: 50x slower)
    if len(colours) <= 10:
        return f"{len(colours)} colours: not a drawing"
    return None


def assert_picture(path: object) -> None:
    """A PNG of a real figure (`picture_problem` finds nothing wrong with it)."""
    problem = picture_problem(path)
    assert problem is None, (path, problem)


@pytest.fixture(scope="module")
def runs() -> list[classroom.Run]:
    """A pipeline, an expert-parallel MoE and ZeRO-3, each on 4 ranks, in one job."""
    return classroom.train(4, [
        dict(SMALL, layers=4, dp=1, pp=4, microbatches=4, schedule="1f1b"),
        dict(SMALL, model="moe", layers=2, dp=4, ep=4, experts=8, capacity_factor=1.0),
        dict(SMALL, layers=2, dp=4, zero=3, optimizer="adam", lr=0.01),
        dict(SMALL, layers=2, dp=4, zero=0, optimizer="adam", lr=0.01)])


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                              ("zb-h1", 1)])
def test_gantt_has_one_box_per_simulated_instruction(schedule, virtual, tmp_path):
    sim = simulate_schedule(schedule, 4, 8, virtual)
    figure = load_plots.gantt_figure(sim)
    ax = figure.axes[0]
    drawn = sorted(load_plots.gantt_boxes(ax, 0.8))
    assert drawn == sorted((s.stage, s.start, s.end) for s in sim.timeline)
    assert f"{sim.bubble:.1%}" in ax.get_title()
    assert_picture(plots.save(figure, tmp_path / "gantt.png"))


def test_bubble_figure_draws_the_formulas_and_the_simulator(tmp_path):
    figure = load_plots.bubble_figure(4, measured={4: 0.5, 8: 0.4})
    lines = figure.axes[0].get_lines()
    named = {(line.get_color(), line.get_linestyle()): line for line in lines}
    schedules = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
    for (name, virtual), color in zip(schedules, ("tab:blue", "tab:purple", "tab:green")):
        curve, dots = named[(color, "-")], named[(color, "None")]
        assert np.allclose(curve.get_ydata(), [bubble_formula(name, 4, m, virtual)
                                               for m in curve.get_xdata()])
        assert np.allclose(dots.get_ydata(), [bubble_formula(name, 4, m, virtual)
                                              for m in dots.get_xdata()])  # M >= pp
    crosses = named[("black", "None")]
    assert list(crosses.get_xdata()) == [4, 8] and list(crosses.get_ydata()) == [0.5, 0.4]
    assert_picture(plots.save(figure, tmp_path / "bubble.png"))


def test_real_pipeline_timeline_beside_the_simulator(runs, tmp_path):
    timeline = runs[0].extras["timeline"]
    compute = [r for r in timeline if r["kind"] in COMPUTE]
    assert len(compute) == 4 * 4 * 2  # 4 stages x 4 microbatches x (F, B)
    figure = load_plots.gantt_figure(simulate_schedule("1f1b", 4, 4), timeline)
    real = figure.axes[1]
    assert sorted(load_plots.gantt_boxes(real, 0.8)) == sorted(
        (r["rank"], 1000 * r["start"], 1000 * r["end"]) for r in compute)
    assert len(load_plots.gantt_boxes(real, 0.18)) == sum(
        r["kind"].startswith("recv") for r in timeline)
    intervals = [(r["stage"], r["start"], r["end"]) for r in compute]
    assert measured_bubble(timeline) == pytest.approx(bubble_fraction(intervals, 4))
    assert_picture(plots.save(figure, tmp_path / "pipeline.png"))


def psi_of(run: classroom.Run) -> int:
    return sum(int(np.prod(s)) for s in nn.canonical_shapes(run.cfg.model_config()).values())


def test_wire_bytes_are_the_ring_formulas(runs):
    """The bars' numbers, by hand: on dp = 4 an Allreduce puts 2 x 3/4 of its buffer on
    the wire, an Allgatherv and a Reduce_scatter 3/4; a Recv nothing; a Send all of it."""
    sizes = plots.group_sizes(runs[2].cfg.mesh_shape())
    assert sizes["dp"] == 4
    for r in runs[2].ledger + runs[3].ledger:
        share = {"Allreduce": 1.5, "Allgatherv": 0.75, "Reduce_scatter": 0.75}.get(r["op"], 0)
        if r["group"] == "dp" and r["elements"]:
            assert plots.wire_bytes(r, sizes) == pytest.approx(share * r["bytes"]), r
    pipe = plots.group_sizes(runs[0].cfg.mesh_shape())
    for r in runs[0].ledger:
        if r["op"] in ("Send", "Isend"):
            assert plots.wire_bytes(r, pipe) == r["bytes"]
        if r["op"] in ("Recv", "Irecv"):
            assert plots.wire_bytes(r, pipe) == 0


def test_ledger_bars_are_the_busiest_ranks_wire_bytes(runs, tmp_path):
    ledger = runs[2].ledger  # ZeRO-3 on dp = 4: Allgatherv and Reduce_scatter
    sizes = plots.group_sizes(runs[2].cfg.mesh_shape())
    figure = plots.ledger_figure(ledger, sizes)
    heights = sorted(b.get_height() for b in figure.axes[0].patches)
    best = plots.busiest(ledger, sizes)
    factor, unit = byte_unit(max(r["wire"] for r in best.values()))
    expected = sorted(0.75 * r["bytes"] / factor for r in best.values())  # (N-1)/N, N = 4
    assert heights == pytest.approx(expected)
    assert unit in figure.axes[0].get_ylabel() and "wire" in figure.axes[0].get_ylabel()
    psi = psi_of(runs[2])  # ZeRO-3 moves 3 (N-1)/N Psi per rank (the paper's 3 Psi)
    assert sum(expected) * factor == pytest.approx(wire_formula(psi, 4, 3) * 8)
    assert_picture(plots.save(figure, tmp_path / "ledger.png"))


def test_compare_bars_show_zero3_at_one_and_a_half_dp(runs, tmp_path):
    """The tour's and lesson 5's figure: bar length = wire bytes per axis; ZeRO-3
    puts 3 (N-1)/N Psi on the wire, DP 2 (N-1)/N Psi: 1.5 x, as lesson 7 says."""
    ledgers = {"pipeline": runs[0].ledger, "ZeRO-3": runs[2].ledger, "DP": runs[3].ledger}
    sizes = {k: plots.group_sizes(run.cfg.mesh_shape())
             for k, run in zip(ledgers, (runs[0], runs[2], runs[3]))}
    sent = {k: plots.sent_per_axis(v, sizes[k]) for k, v in ledgers.items()}
    assert sent["ZeRO-3"]["dp"] / sent["DP"]["dp"] == pytest.approx(1.5)
    assert sent["DP"]["dp"] == pytest.approx(wire_formula(psi_of(runs[3]), 4, 0) * 8)
    figure = plots.ledger_compare_figure(ledgers, sizes)
    ax = figure.axes[0]
    factor, _ = byte_unit(max(sum(per.values()) for per in sent.values()))
    labels = [t.get_text() for t in ax.get_yticklabels()]
    for label in ledgers:
        y = labels.index(label)
        drawn = sum(b.get_width() for b in ax.patches if abs(b.get_y() + b.get_height() / 2
                                                             - y) < 1e-9)
        assert drawn == pytest.approx(sum(sent[label].values()) / factor), label
    assert_picture(plots.save(figure, tmp_path / "compare.png"))


def test_expert_load_bars_are_the_routers_counts(runs, tmp_path):
    stats = runs[1].extras["expert_load"][0]
    figure = load_plots.expert_load_figure(stats)
    left, right = figure.axes
    kept = [b.get_height() for b in left.patches if isinstance(b, Rectangle)
            and b.get_alpha() is None and b.get_width() == 0.8]
    assert kept == stats["kept"]
    assert [b.get_height() for b in right.patches] == stats["rank_load"]
    assert sum(stats["rank_load"]) == sum(stats["kept"])
    assert_picture(plots.save(figure, tmp_path / "experts.png"))


def test_memory_and_losses_are_what_the_ranks_measured(runs, tmp_path):
    zero = runs[2]
    figure = plots.memory_figure({"ZeRO-3": zero.memory})
    bars = figure.axes[0].patches
    factor, _ = byte_unit(max(m.total for m in zero.memory))
    tops: dict[float, float] = {}  # each rank's stacked bar: its highest edge
    for b in bars:
        x = round(b.get_x(), 6)
        tops[x] = max(tops.get(x, 0.0), b.get_y() + b.get_height())
    assert [tops[x] for x in sorted(tops)] == pytest.approx([m.total / factor
                                                            for m in zero.memory])
    assert_picture(plots.save(figure, tmp_path / "memory.png"))
    figure = plots.loss_figure({"ZeRO-3": zero.losses}, {"ZeRO-3": zero.reference})
    marks = [line for line in figure.axes[0].get_lines() if line.get_linestyle() == "None"]
    assert list(marks[0].get_ydata()) == zero.losses  # the run's marks over the reference
    diff = [line for line in figure.axes[1].get_lines() if line.get_label() == "ZeRO-3"][0]
    assert max(diff.get_ydata()) <= 1e-9
    assert np.allclose(zero.losses, zero.reference, rtol=1e-9, atol=0)
    assert_picture(plots.save(figure, tmp_path / "losses.png"))


def test_the_tour_writes_its_figures(tmp_path):
    job = minipar(8, ["tour", "--plot", str(tmp_path)], timeout=240)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    assert "every strategy equals one process" in job.stdout
    names = {p.name for p in tmp_path.glob("*.png")}
    assert names == {"tour_ledger.png", "tour_memory.png", "tour_losses.png",
                     "tour_pipeline.png", "tour_experts.png", "tour_trace_pp.png"}, names
    assert re.search(r"traced \(.*trace_pp\): bubble \d+\.\d%", job.stdout), job.stdout
    for name in names:
        assert_picture(tmp_path / name)


def test_a_stuck_job_is_killed_after_its_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        classroom.mpirun(2, "-c", "import time; time.sleep(60)", timeout=1, echo=False)
    assert time.monotonic() - start < 30


def test_memory_figure_stacks_saved_activations_on_top(runs, tmp_path):
    """Lesson 5's figure: each rank's bar is its model states plus its saved activations,
    the activations drawn in their own colour on top."""
    zero = runs[2]
    acts = [1000.0 * (r + 1) for r in range(len(zero.memory))]
    figure = plots.memory_figure({"ZeRO-3": zero.memory}, activations={"ZeRO-3": acts})
    factor, _ = byte_unit(max(m.total + a for m, a in zip(zero.memory, acts)))
    red = [b for b in figure.axes[0].patches
           if tuple(b.get_facecolor()[:3]) == matplotlib.colors.to_rgb(plots.ACTIVATION_COLOR)]
    assert [b.get_height() for b in red] == pytest.approx([a / factor for a in acts])
    assert [b.get_y() for b in red] == pytest.approx([m.total / factor for m in zero.memory])
    assert_picture(plots.save(figure, tmp_path / "memory_acts.png"))


def test_timing_bars_are_medians_and_capacity_line_is_one_when_it_is_the_mean(tmp_path):
    times = {"naive": [3.0, 1.0, 2.0], "bucketed": [1.0, 1.5, 0.5]}
    figure = load_plots.timing_figure(times, "measured")
    bars = [b.get_height() for b in figure.axes[0].patches]
    assert bars == pytest.approx([2.0, 1.0])
    assert_picture(plots.save(figure, tmp_path / "timing.png"))
    # capacity factor 1 with 16 assignments on 4 experts: the limit IS the mean, one line
    stats = dict(routed=[8, 4, 2, 2], kept=[4, 4, 2, 2], limit=4, dropped=4, imbalance=2.0,
                 rank_load=[8, 4], rank_imbalance=4 / 3)
    lines = load_plots.expert_load_figure(stats).axes[0].get_lines()
    assert len(lines) == 1 and "perfect balance" in lines[0].get_label()
    stats = dict(stats, limit=5, kept=[5, 4, 2, 2], dropped=3)
    assert len(load_plots.expert_load_figure(stats).axes[0].get_lines()) == 2


def test_context_parallel_groups_count_their_cp_ranks():
    """Under cp the gradient Allreduce the ledger names `dp` runs over the dp x cp
    replicas: on dp 2 x cp 2 it puts 2 x 3/4 of its buffer on the wire, not 2 x 1/2."""
    from minipar.comm.mesh import MeshShape

    sizes = plots.group_sizes(MeshShape(dp=2, tp=1, pp=1, ep=2, cp=2))
    assert (sizes["dp"], sizes["cp"], sizes["edp"]) == (4, 2, 2)
    record = {"op": "Allreduce", "group": "dp", "elements": 100, "bytes": 800}
    assert plots.wire_bytes(record, sizes) == pytest.approx(1200)
    ring = {"op": "Sendrecv", "group": "cp", "elements": 10, "bytes": 80}
    assert plots.wire_bytes(ring, sizes) == 80


def test_every_series_has_its_own_colour_and_marker():
    """Lesson 8 draws 12 bugs: each one a colour and a marker no other series has (the
    default cycle repeats its colours after 10)."""
    styles = [plots.series_style(i) for i in range(12)]
    assert len({s["color"] for s in styles}) == 12
    assert len({s["marker"] for s in styles}) == 12
    rgb = [matplotlib.colors.to_rgb(s["color"]) for s in styles]
    assert len(set(rgb)) == 12


def test_balance_curves_differ_in_colour_and_marker(tmp_path):
    """Lesson 3's aux-loss figure: each coefficient's curve has its own colour AND its own
    marker, in both panels (told apart in grey print too), and draws the numbers given."""
    histories = {coef: [dict(step=s, imbalance=4.0 - s * (1 + coef), dropped=0.1 * i)
                        for s in range(3)] for i, coef in enumerate((0.0, 0.01, 0.1))}
    figure = load_plots.balance_figure(histories, 1.0)
    for ax in figure.axes[:2]:
        curves = [line for line in ax.get_lines() if line.get_label() != "perfect balance"]
        assert len(curves) == 3
        assert len({line.get_marker() for line in curves}) == 3
        assert len({matplotlib.colors.to_rgb(line.get_color()) for line in curves}) == 3
    imbalance = [list(line.get_ydata()) for line in figure.axes[0].get_lines()[:3]]
    assert imbalance[2] == pytest.approx([4.0, 2.9, 1.8])
    assert_picture(plots.save(figure, tmp_path / "balance.png"))


def test_trace_title_splits_the_hidden_share_by_axis():
    """A trace's title gives the hidden share of every axis beside the total, so the
    lesson's one-axis number (dp 8.3%) is found in the figure next to all traffic's 6.3%."""
    from minipar.teaching.trace_report import Measured, by_axis_text

    two = Measured(ranks=[], window=1, bubble=None, hidden=0.063,
                   hidden_by_axis={"dp": 0.083, "world": 0.0})
    assert by_axis_text(two) == " (dp 8.3%, world 0.0%)"
    one = Measured(ranks=[], window=1, bubble=None, hidden=0.5, hidden_by_axis={"pp": 0.5})
    assert by_axis_text(one) == ""
