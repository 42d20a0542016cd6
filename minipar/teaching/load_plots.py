"""Pictures of load: which rank computes what, and when, and who waits.

What this file teaches: work that is split unevenly leaves ranks idle, and a picture
shows where. A pipeline schedule is a Gantt chart (GPipe, Huang et al. 2019; 1F1B,
Narayanan et al. 2021): one row per stage, and the white space is the bubble, which
shrinks with the microbatches as (pp-1)/(M+pp-1). An MoE router (GShard, Lepikhin et
al. 2021; Switch, Fedus et al. 2022) fills some experts more than others, and every ep
rank waits for the busiest one; its aux loss, trained, evens them out. Measured times
are drawn as what they are: medians over repeats, on the cores they ran on (with more
ranks than cores a wall clock measures the ranks taking turns; a replay of the measured
CPU times shows the schedule instead). Ring attention (Liu et al. 2023) with a causal
mask gives rank r of cp contiguous pieces r + 1 blocks of scores to compute and rank 0
one; the zig-zag layout gives every rank the same.

Every function takes plain data (the simulator's `Simulation`, the records of
`RunResult.extras`) and returns a matplotlib `Figure` built without pyplot, as
plots.py does (its `save` writes the PNG).

    mpiexec -n 4 python lessons/04_pipeline_parallel.py --plot figures
    mpiexec -n 8 python lessons/03_expert_parallel.py --plot figures
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from textwrap import fill

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Polygon, Rectangle

from minipar.parallel.pipeline.instructions import COMPUTE
from minipar.parallel.pipeline.schedules import (
    SIMULATED_ONLY,
    UNIT_RULE,
    bubble_formula,
    simulate_schedule,
)
from minipar.parallel.pipeline.simulator import Simulation, measured_bubble

KIND_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green", "F&B": "tab:purple"}
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient (ZB schedules)",
              "F&B": "F&B: a forward and a full backward in one step"}


# ------------------------------------------------------------ pipeline Gantt
def timeline_bars(timeline: Sequence[dict]) -> list[dict]:
    """A real run's timeline (`extras["timeline"]`, seconds) as bars in milliseconds:
    row = world rank; compute instructions, and receives (time spent waiting)."""
    return [{"row": r["rank"], "kind": r["kind"], "microbatch": r["microbatch"],
             "chunk": r["chunk"], "start": 1000 * r["start"], "end": 1000 * r["end"]}
            for r in timeline if r["kind"] in COMPUTE or r["kind"].startswith("recv")]


def draw_gantt(ax: Axes, bars: Sequence[dict], row_names: dict[int, str], unit: str,
               title: str) -> None:
    """One row per rank, one box per instruction: F blue, B orange, W green, the
    microbatch number inside (1-based); a second model chunk hatched; a thin grey
    strip where a rank sat in a receive. White space is the bubble.

    The boxes of one look (colour, height, hatch) are one PolyCollection: a figure of a
    few thousand instructions is a handful of artists to lay out and draw, not one
    Rectangle each (`gantt_boxes` reads them back)."""
    end = max(bar["end"] for bar in bars)
    looks: dict[tuple, list] = {}
    for bar in bars:
        y, start, stop = bar["row"], bar["start"], bar["end"]
        if bar["kind"] not in COMPUTE:  # waiting for a message
            look, half = ("0.6", 0.18, None), 0.09
        else:
            look, half = (KIND_COLORS[bar["kind"]], 0.8, "///" if bar["chunk"] else None), 0.4
            if stop - start > 0.022 * end:  # room for the number
                label = ax.text((start + stop) / 2, y, str(bar["microbatch"] + 1), ha="center",
                                va="center", fontsize=7, color="white")
                label.set_in_layout(False)  # inside its box: nothing for the layout to fit
        looks.setdefault(look, []).append(
            [(start, y - half), (start, y + half), (stop, y + half), (stop, y - half)])
    for (color, height, hatch), corners in looks.items():
        compute = height == 0.8
        ax.add_collection(PolyCollection(
            np.array(corners, dtype=float), facecolors=color, hatch=hatch, label=color,
            edgecolors="white" if compute else "none", linewidths=0.6 if compute else 0))
    rows = sorted(row_names)
    ax.set_yticks(rows, [row_names[r] for r in rows])
    ax.set_ylim(max(rows) + 0.6, min(rows) - 0.6)
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=10)


def gantt_boxes(ax: Axes, height: float) -> list[tuple[float, float, float]]:
    """The boxes `draw_gantt` drew of one height (0.8 an instruction, 0.18 a wait), as
    (row, start, end): read back from the collections, to check a figure against its data."""
    found = []
    for collection in ax.collections:
        for path in collection.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            if abs((y1 - y0) - height) < 1e-9:
                found.append((round((y0 + y1) / 2), float(x0), float(x1)))
    return found


# 16 colours and 16 markers, both distinct for the first 16 series (matplotlib's cycle
# has 10 colours: bug 11 would look like bug 1)
SERIES_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                 "tab:pink", "tab:gray", "tab:olive", "tab:cyan", "black", "gold", "navy",
                 "lime", "darkred", "teal")
SERIES_MARKERS = "osD^v<>pP*hXd8H+"


def series_style(i: int) -> dict:
    """Line style of series i: its own colour AND its own marker (distinct up to 16)."""
    return {"color": SERIES_COLORS[i % len(SERIES_COLORS)],
            "marker": SERIES_MARKERS[i % len(SERIES_MARKERS)], "fillstyle": "none"}


def gantt_legend(figure: Figure, kinds: Iterable[str], chunks: bool, waits: bool) -> None:
    names = dict(KIND_NAMES, B="backward: input gradient") if "W" in kinds else KIND_NAMES
    handles = [Patch(color=KIND_COLORS[k], label=names[k]) for k in ("F", "B", "W", "F&B")
               if k in kinds]
    if chunks:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                             label="second model chunk"))
    if waits:
        handles.append(Patch(color="0.6", label="waiting in Recv"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
                  frameon=False)


def gantt_figure(sim: Simulation, timeline: Sequence[dict] | None = None,
                 title: str = "", replayed: Simulation | None = None,
                 cores: int | None = None) -> Figure:
    """The schedule as the simulator plays it (in stage units, `UNIT_RULE`: F = 1,
    B = 2 for a whole stage's layers, a chunk its share), and beside it, if given,
    the wall-clock timeline of a real run's last step (every rank; from
    `RunResult.extras["timeline"]`) and `replayed`: that run's measured compute times
    played on the schedule's dependencies (`schedules.replay`). With `cores`
    fewer than the ranks, the wall-clock panel says it was oversubscribed. Box numbers
    are microbatches."""
    panels = 1 + bool(timeline) + (replayed is not None)
    pp = max(s.stage for s in sim.timeline) + 1
    real = timeline_bars(timeline) if timeline else []
    rows = max(pp, len({bar["row"] for bar in real}))
    figure = Figure(figsize=(5.6 * panels, 1.5 + 0.42 * rows), layout="constrained")
    figure.get_layout_engine().set(rect=(0, 0.08, 1, 0.92))
    axes = figure.subplots(1, panels, squeeze=False)[0]
    simulated = [dict(vars(slot), row=slot.stage) for slot in sim.timeline]
    draw_gantt(axes[0], simulated, {s: f"stage {s}" for s in range(pp)},
               UNIT_RULE, f"simulator: T = {sim.makespan:g} units, bubble {sim.bubble:.1%}")
    if timeline:
        stage_of = {r["rank"]: r["stage"] for r in timeline}
        measured = measured_bubble(timeline)
        ranks = len(stage_of)
        shared = (f"\n{ranks} ranks on {cores} cores: oversubscribed, the wall clock "
                  "measures the sharing" if cores and ranks > cores else
                  f"\n{ranks} ranks on {cores} cores" if cores else "")
        draw_gantt(axes[1], real, {r: f"rank {r} (stage {s})" for r, s in stage_of.items()},
                   "ms, wall clock", f"real run, last step: bubble {measured:.1%}{shared}")
    if replayed is not None:
        bars = [dict(vars(slot), row=slot.stage, start=1000 * slot.start, end=1000 * slot.end)
                for slot in replayed.timeline]
        draw_gantt(axes[-1], bars, {s: f"stage {s}" for s in range(pp)}, "ms of CPU time",
                   f"replay: bubble {replayed.bubble:.1%}\nthe measured CPU times "
                   "on the schedule's dependencies")
    kinds = {s.kind for s in sim.timeline}
    chunks = any(s.chunk for s in sim.timeline)
    gantt_legend(figure, kinds, chunks, waits=bool(timeline))
    if title:
        figure.suptitle(title, fontsize=11)
    return figure


# ------------------------------------------------------------------- bubble
def bubble_figure(pp: int, microbatches: Sequence[int] = (1, 2, 4, 8, 16, 32),
                  schedules: Sequence[tuple[str, int]] = (("1f1b", 1), ("interleaved", 2),
                                                          ("zb-h1", 1)),
                  measured: dict[int, float] | None = None,
                  replayed: dict[int, float] | None = None,
                  measured_label: str = "1F1B, real run (wall clock)") -> Figure:
    """Bubble fraction against the number of microbatches M: the papers' formulas as
    lines, the simulator as dots on them, and (if given) a real 1F1B run's bubble per
    M: wall clock as crosses (named `measured_label`), its measured compute times
    replayed on the schedule (`schedules.replay`) as squares. GPipe and 1F1B
    share (pp-1)/(M+pp-1). ZB-V, DualPipeV and DualPipe have no closed form on this
    measure: their simulated dots are joined by a dashed line."""
    names = {"1f1b": "GPipe and 1F1B: (pp-1)/(M+pp-1)",
             "interleaved": "interleaved, V={v}: (pp-1)/(VM+pp-1)",
             "zb-h1": "ZB-H1: (pp-1)/(3M+pp-1), M >= pp",
             "zb-v": "ZB-V (simulator), 2 chunks in a V",
             "dualpipev": "DualPipeV (simulator), M >= 2pp",
             "dualpipe": "DualPipe (simulator), both ends, M even >= 2pp"}
    colors = {"1f1b": "tab:blue", "interleaved": "tab:purple", "zb-h1": "tab:green",
              "zb-v": "tab:red", "dualpipev": "tab:brown", "dualpipe": "tab:olive"}
    figure = Figure(figsize=(10.5, 4.2), layout="constrained")  # the legend right of the axes
    ax = figure.subplots()
    grid = np.geomspace(min(microbatches), max(microbatches), 200)
    for name, virtual in schedules:
        color = colors.get(name, "0.3")
        lo = {"zb-h1": pp, "dualpipev": 2 * pp, "dualpipe": 2 * pp}.get(name, min(microbatches))
        sims = [m for m in microbatches if m >= lo and (name != "interleaved" or m % pp == 0)
                and (name != "dualpipe" or m % 2 == 0)]
        dots = [simulate_schedule(name, pp, m, virtual).bubble for m in sims]
        label = names.get(name, name).format(v=virtual)
        if name in SIMULATED_ONLY:
            ax.plot(sims, dots, "o--", color=color, markersize=5, label=label)
            continue
        line = grid[grid >= lo]
        ax.plot(line, [bubble_formula(name, pp, m, virtual) for m in line], color=color,
                label=label)
        ax.plot(sims, dots, "o", color=color, markersize=5)
    if measured:
        ax.plot(list(measured), list(measured.values()), "x", color="black", markersize=8,
                mew=2, label=measured_label)
    if replayed:
        ax.plot(list(replayed), list(replayed.values()), "s", color="tab:cyan", markersize=7,
                fillstyle="none", mew=1.5,
                label="1F1B, real run's CPU times replayed on the schedule")
    ax.plot([], [], "o", color="0.4", label="simulator")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(microbatches), [str(m) for m in microbatches])
    ax.set_xlabel("microbatches per step, M")
    ax.set_ylabel("bubble: idle share of stage-time")
    ax.set_ylim(0, 1)
    ax.set_title(f"the pipeline bubble, pp = {pp} stages", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    return figure


# ------------------------------------------------------------------- memory
def in_flight_memory_figure(pp: int, microbatches: int, schedules: Sequence[tuple[str, int]],
                  chunks: dict[str, int]) -> Figure:
    """Activation memory per stage, as the simulator counts it: the peak number of
    (chunk, microbatch) activations a rank holds, in whole stages' worth (a chunk of
    V per rank is 1/V of a stage), one group of bars per schedule."""
    figure = Figure(figsize=(7, 3.8), layout="constrained")
    ax = figure.subplots()
    width = 0.8 / pp
    for s in range(pp):
        heights = []
        for name, virtual in schedules:
            m = max(microbatches, 2 * pp) if name in ("dualpipev", "dualpipe") \
                else microbatches
            peak = simulate_schedule(name, pp, m, virtual).peak_in_flight[s]
            heights.append(peak / chunks.get(name, 1))
        ax.bar(np.arange(len(schedules)) + (s - (pp - 1) / 2) * width, heights, width,
               label=f"stage {s}", color=str(0.15 + 0.6 * s / max(pp - 1, 1)))
    ax.set_xticks(range(len(schedules)), [name for name, _ in schedules])
    ax.axhline(pp, color="tab:red", linewidth=1, linestyle="--", label=f"pp = {pp}")
    ax.set_ylabel("peak activations held\n(microbatches x whole stages)")
    ax.set_title(f"activation memory per stage, pp = {pp}, M = {microbatches}", fontsize=10)
    ax.legend(fontsize=8, ncol=pp + 1)
    return figure


# ------------------------------------------------------------ measured times
def timing_figure(times: dict[str, Sequence[float]], title: str = "",
                  unit: str = "ms") -> Figure:
    """Measured times side by side: one bar per label at the median of its samples,
    a line from the fastest to the slowest sample, the median written beside it."""
    figure = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = figure.subplots()
    for x, samples in enumerate(times.values()):
        median = float(np.median(samples))
        ax.bar(x, median, width=0.6, color=f"C{x}")
        ax.vlines(x, min(samples), max(samples), color="black", lw=1.5)
        ax.text(x + 0.05, median, f" {median:.3g} {unit}", va="bottom", fontsize=8)
    ax.set_xticks(range(len(times)), list(times), fontsize=9)
    ax.set_ylim(0, 1.15 * max(max(s) for s in times.values()))
    ax.set_ylabel(f"{unit} (bar: median; line: fastest to slowest)")
    ax.set_title(fill(title or "measured times", 70), fontsize=10)
    return figure


# ------------------------------------------------------------ the aux loss
def balance_figure(histories: dict[float, Sequence[dict]], capacity_factor: float,
                   title: str = "") -> Figure:
    """Training runs of one MoE block, one line per aux-loss coefficient: the router's
    imbalance (max/mean assignments per expert) and the share of assignments dropped
    at capacity, step by step (`histories[coef]` = records with step, imbalance,
    dropped)."""
    figure = Figure(figsize=(11, 3.8), layout="constrained")
    left, right = figure.subplots(1, 2)
    for i, (coef, history) in enumerate(histories.items()):
        steps = [h["step"] for h in history]
        label = "no aux loss" if coef == 0 else f"aux coef {coef:g}"
        style = dict(series_style(i), markevery=max(1, len(steps) // 10), markersize=5)
        left.plot(steps, [h["imbalance"] for h in history], label=label, **style)
        right.plot(steps, [100 * h["dropped"] for h in history], label=label, **style)
    left.axhline(1.0, color="black", ls=":", lw=1, label="perfect balance")
    left.set_ylim(0, None)
    left.set_ylabel("imbalance: max / mean assignments")
    right.set_ylim(0, None)
    right.set_ylabel(f"% of assignments dropped (capacity factor {capacity_factor:g})")
    for ax in (left, right):
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_title("the router's imbalance", fontsize=10)
    right.set_title("tokens the full experts turn away", fontsize=10)
    if title:
        figure.suptitle(title, fontsize=11)
    return figure


# -------------------------------------------------------------- expert load
def expert_load_figure(stats: dict, title: str = "") -> Figure:
    """An MoE block's load (`moe/load_stats.py` `load_stats`): assignments routed to each
    expert and kept under the capacity limit, the experts of each ep rank shaded
    alike; and beside it the kept assignments each ep rank computes."""
    routed, kept = np.asarray(stats["routed"]), np.asarray(stats["kept"])
    ranks = len(stats["rank_load"])
    per_rank = len(routed) // ranks
    figure = Figure(figsize=(11, 3.8), layout="constrained")
    left, right = figure.subplots(1, 2, width_ratios=(3, 1))
    experts = np.arange(len(routed))
    for j in range(0, ranks, 2):  # shade every other rank's experts
        left.axvspan(j * per_rank - 0.5, (j + 1) * per_rank - 0.5, color="0.93")
    if stats.get("limit") is None:  # nothing dropped: routed = kept
        left.bar(experts, kept, color="tab:red", label="routed = kept (no capacity)")
    else:
        left.bar(experts, routed, color="tab:red", alpha=0.35, label="routed (chose it)")
        left.bar(experts, kept, color="tab:red", label="kept (computed)")
    mean, limit = routed.mean(), stats.get("limit")
    if limit is not None and np.isclose(limit, mean):  # capacity factor 1: one line, both names
        left.axhline(limit, color="black", ls="--", lw=1.2,
                     label=f"capacity ceil(c k B/E) = {limit} = perfect balance (mean)")
    else:
        if limit is not None:
            left.axhline(limit, color="black", ls="--", lw=1.2,
                         label=f"capacity ceil(c k B/E) = {limit}")
        left.axhline(mean, color="tab:blue", ls=":", lw=1.5,
                     label=f"perfect balance (mean {mean:.1f})")
    left.set_xlabel(f"expert (shaded bands: {per_rank} experts of one ep rank)")
    left.set_ylabel("(token, slot) assignments")
    left.set_xlim(-0.5, len(routed) - 0.5)
    left.set_ylim(0, 1.45 * routed.max())  # room for the legend above the bars
    left.legend(fontsize=8, loc="upper right", ncol=2)
    left.set_title(f"per expert: max/mean {stats['imbalance']:.2f}, "
                   f"{stats['dropped']} dropped", fontsize=10)
    load = np.asarray(stats["rank_load"])
    right.bar(np.arange(ranks), load, color="tab:red")
    right.axhline(load.mean(), color="0.3", ls=":", lw=1, label="mean")
    right.set_xticks(np.arange(ranks))
    right.set_xlabel("ep rank")
    right.set_ylabel("kept assignments")
    right.set_ylim(0, 1.25 * load.max())
    right.set_title(f"per rank: max/mean {stats['rank_imbalance']:.2f}", fontsize=10)
    right.legend(fontsize=8, loc="upper right")
    if title:
        figure.suptitle(title, fontsize=11)
    return figure


# ------------------------------------------------------ ring attention's blocks
def ring_blocks_figure(modes: dict[str, list[list[list[tuple[int, int, int, int, bool]]]]],
                       seq_len: int, title: str = "") -> Figure:
    """Which (query, key) blocks each rank computes at each ring step: one panel per
    (mode, rank), the T x T plane of scores with queries down and keys across. A block
    is coloured by the ring step that computes it (its number written in it); a block
    on the diagonal is a triangle, its upper half masked; grey is never computed. Each
    title counts the rank's work in blocks of (T/cp)^2 scores.

    `modes[name][rank][step]` lists the blocks as (q_start, q_stop, k_start, k_stop,
    on_diagonal) in positions (context_parallel.visible_blocks, mapped to positions)."""
    names = list(modes)
    cp = len(next(iter(modes.values())))
    figure = Figure(figsize=(2.4 * cp + 0.6, 2.5 * len(names) + 0.8), layout="constrained")
    axes = np.atleast_2d(figure.subplots(len(names), cp))
    for row, name in enumerate(names):
        for rank in range(cp):
            ax = axes[row, rank]
            ax.add_patch(Rectangle((0, 0), seq_len, seq_len, color="0.92"))
            count = 0
            for step, blocks in enumerate(modes[name][rank]):
                for q0, q1, k0, k1, diagonal in blocks:
                    corners = ([(k0, q0), (k0, q1), (k1, q1)] if diagonal else
                               [(k0, q0), (k0, q1), (k1, q1), (k1, q0)])
                    ax.add_patch(Polygon(corners, closed=True, color=f"C{step % 10}",
                                         ec="white", lw=0.8))
                    ax.text((k0 + k1) / 2 - (k1 - k0) * 0.15 * diagonal,
                            (q0 + q1) / 2 + (q1 - q0) * 0.15 * diagonal, str(step),
                            ha="center", va="center", fontsize=7, color="white")
                    count += (q1 - q0) * (k1 - k0)      # computed whole, then masked
            ax.set_xlim(0, seq_len)
            ax.set_ylim(seq_len, 0)
            ax.set_aspect("equal")
            ax.set_xticks([0, seq_len], ["0", str(seq_len)], fontsize=7)
            ax.set_yticks([0, seq_len], ["0", str(seq_len)], fontsize=7)
            blocks = count / (seq_len / cp) ** 2
            ax.set_title(f"{name}, rank {rank}: {blocks:g} blocks", fontsize=8)
            if rank == 0:
                ax.set_ylabel("query position", fontsize=8)
            if row == len(names) - 1:
                ax.set_xlabel("key position", fontsize=8)
    figure.legend(handles=[Patch(color=f"C{s}", label=f"ring step {s}") for s in range(cp)]
                  + [Patch(color="0.92", label="not computed")],
                  loc="outside lower center", ncol=cp + 1, fontsize=8)
    if title:
        figure.suptitle(title, fontsize=10)
    return figure
