"""Pictures of what the ranks did: pipeline Gantt charts, the bubble, the ledger, the
expert load, memory per rank and loss curves.

What this file teaches: every number a lesson prints has a shape that is easier
to see than to read. A pipeline schedule is a Gantt chart (GPipe, Huang et al.
2019; 1F1B, Narayanan et al. 2021); its bubble shrinks with the microbatches as
(pp-1)/(M+pp-1); the ledger (comm.py) is bytes per mesh axis and operation;
an MoE router (GShard, Switch) fills some experts more than others; ZeRO
(Rajbhandari et al. 2020) cuts the bytes of each rank by stage; and a parallel
run's loss curve lies on the single-process one.

Every function takes plain data (the simulator's `Simulation`, the records of
`RunResult.extras` and `RunResult.ledger`, `memory.ModelStates`) and returns a
matplotlib `Figure` built without pyplot, so it draws headless (Agg) in a
lesson and shows inline in a notebook; `save(figure, path)` writes a PNG.

    mpiexec -n 4 python lessons/04_pipeline_parallel.py --plot figures
    mpiexec -n 8 python -m minipar tour --plot figures
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from textwrap import fill

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minipar.memory import ModelStates
from minipar.parallel.pipeline_schedules import (
    COMPUTE,
    Simulation,
    bubble_formula,
    bubble_fraction,
    simulate_schedule,
)

KIND_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient (ZB-H1)"}
AXIS_COLORS = {"dp": "tab:blue", "tp": "tab:orange", "pp": "tab:green", "ep": "tab:red",
               "edp": "tab:purple", "world": "tab:gray"}
STATE_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}


def save(figure: Figure, path: Path | str) -> Path:
    """Write `figure` as a PNG (folders made as needed); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def byte_unit(top: float) -> tuple[float, str]:
    """The largest binary unit that keeps `top` bytes >= 1: (1024.0, 'KiB') for 5000."""
    for power, name in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if top >= 1024 ** power:
            return float(1024 ** power), name
    return 1.0, "bytes"


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
    strip where a rank sat in a receive. White space is the bubble."""
    end = max(bar["end"] for bar in bars)
    for bar in bars:
        y, width = bar["row"], bar["end"] - bar["start"]
        if bar["kind"] not in COMPUTE:  # waiting for a message
            ax.barh(y, width, left=bar["start"], height=0.18, color="0.6")
            continue
        ax.barh(y, width, left=bar["start"], height=0.8, color=KIND_COLORS[bar["kind"]],
                edgecolor="white", linewidth=0.6, hatch="///" if bar["chunk"] else None)
        if width > 0.022 * end:  # room for the number
            ax.text(bar["start"] + width / 2, y, str(bar["microbatch"] + 1), ha="center",
                    va="center", fontsize=7, color="white")
    rows = sorted(row_names)
    ax.set_yticks(rows, [row_names[r] for r in rows])
    ax.set_ylim(max(rows) + 0.6, min(rows) - 0.6)
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=10)


def gantt_legend(figure: Figure, kinds: Iterable[str], chunks: bool, waits: bool) -> None:
    names = dict(KIND_NAMES, B="backward: input gradient") if "W" in kinds else KIND_NAMES
    handles = [Patch(color=KIND_COLORS[k], label=names[k]) for k in "FBW" if k in kinds]
    if chunks:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                             label="second model chunk"))
    if waits:
        handles.append(Patch(color="0.6", label="waiting in Recv"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
                  frameon=False)


def gantt_figure(sim: Simulation, timeline: Sequence[dict] | None = None,
                 title: str = "") -> Figure:
    """The schedule as the simulator plays it (F = 1 unit, B = 2), and beside it, if
    given, the wall-clock timeline of a real run's last step (every rank; from
    `RunResult.extras["timeline"]`). Box numbers are microbatches."""
    panels = 2 if timeline else 1
    pp = max(s.stage for s in sim.timeline) + 1
    real = timeline_bars(timeline) if timeline else []
    rows = max(pp, len({bar["row"] for bar in real}))
    figure = Figure(figsize=(6.5 * panels, 1.2 + 0.42 * rows), layout="constrained")
    figure.get_layout_engine().set(rect=(0, 0.08, 1, 0.92))
    axes = figure.subplots(1, panels, squeeze=False)[0]
    simulated = [dict(vars(slot), row=slot.stage) for slot in sim.timeline]
    draw_gantt(axes[0], simulated, {s: f"stage {s}" for s in range(pp)},
               "logical units: F = 1", f"simulator: bubble {sim.bubble:.1%}")
    if timeline:
        stage_of = {r["rank"]: r["stage"] for r in timeline}
        measured = measured_bubble(timeline)
        draw_gantt(axes[1], real, {r: f"rank {r} (stage {s})" for r, s in stage_of.items()},
                   "ms, wall clock", f"real run, last step: bubble {measured:.1%}")
    kinds = {s.kind for s in sim.timeline}
    chunks = any(s.chunk for s in sim.timeline)
    gantt_legend(figure, kinds, chunks, waits=bool(timeline))
    if title:
        figure.suptitle(title, fontsize=11)
    return figure


def measured_bubble(timeline: Sequence[dict]) -> float:
    """Idle share of rank-time in a real timeline, 1 - busy / (ranks * T), as the
    simulator measures it (`pipeline_schedules.bubble_fraction`)."""
    busy = [(r["rank"], r["start"], r["end"]) for r in timeline if r["kind"] in COMPUTE]
    return bubble_fraction(busy, len({rank for rank, _, _ in busy}))


# ------------------------------------------------------------------- bubble
def bubble_figure(pp: int, microbatches: Sequence[int] = (1, 2, 4, 8, 16, 32),
                  schedules: Sequence[tuple[str, int]] = (("1f1b", 1), ("interleaved", 2),
                                                          ("zb-h1", 1)),
                  measured: dict[int, float] | None = None) -> Figure:
    """Bubble fraction against the number of microbatches M: the papers' formulas as
    lines, the simulator as dots on them, and (if given) a real 1F1B run's measured
    bubble per M as crosses. GPipe and 1F1B share (pp-1)/(M+pp-1)."""
    names = {"1f1b": "GPipe and 1F1B: (pp-1)/(M+pp-1)",
             "interleaved": "interleaved, V={v}: (pp-1)/(VM+pp-1)",
             "zb-h1": "ZB-H1: (pp-1)/(3M+pp-1), M >= pp"}
    figure = Figure(figsize=(7, 4.2), layout="constrained")
    ax = figure.subplots()
    grid = np.geomspace(min(microbatches), max(microbatches), 200)
    for (name, virtual), color in zip(schedules, ("tab:blue", "tab:purple", "tab:green")):
        lo = pp if name == "zb-h1" else min(microbatches)
        line = grid[grid >= lo]
        ax.plot(line, [bubble_formula(name, pp, m, virtual) for m in line], color=color,
                label=names.get(name, name).format(v=virtual))
        sims = [m for m in microbatches if m >= lo and (name != "interleaved" or m % pp == 0)]
        ax.plot(sims, [simulate_schedule(name, pp, m, virtual).bubble for m in sims], "o",
                color=color, markersize=5)
    if measured:
        ax.plot(list(measured), list(measured.values()), "x", color="black", markersize=8,
                mew=2, label="1F1B, real run (wall clock)")
    ax.plot([], [], "o", color="0.4", label="simulator")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(microbatches), [str(m) for m in microbatches])
    ax.set_xlabel("microbatches per step, M")
    ax.set_ylabel("bubble: idle share of stage-time")
    ax.set_ylim(0, 1)
    ax.set_title(f"the pipeline bubble, pp = {pp} stages", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure


# ------------------------------------------------------------------- ledger
def busiest(records: Sequence[dict]) -> dict[tuple[str, str], dict]:
    """Per (axis, op), the record of the rank that moved the most bytes."""
    best: dict[tuple[str, str], dict] = {}
    for r in records:
        key = (r["group"], r["op"])
        if key not in best or r["bytes"] > best[key]["bytes"]:
            best[key] = r
    return best


def ledger_figure(runs: dict[str, Sequence[dict]] | Sequence[dict], title: str = "") -> Figure:
    """The ledger of a step as bars: one group per (mesh axis, operation), one bar per
    run (`runs` maps a label to its records; or pass one run's records), height =
    bytes of the buffers that operation was called on by the busiest rank
    (DESIGN.md's convention), the number of calls on top."""
    runs = runs if isinstance(runs, dict) else {"": runs}
    best = {label: busiest(records) for label, records in runs.items()}
    order = list(AXIS_COLORS)  # mesh axes in mesh order, then operations by name
    keys = sorted({key for per in best.values() for key in per},
                  key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[1]))
    top = max([r["bytes"] for per in best.values() for r in per.values()] or [1])
    factor, unit = byte_unit(top)
    width = 0.8 / len(runs)
    width_inches = min(11.0, max(6.5, 2.5 + 1.1 * len(keys) * max(1, len(runs) / 2)))
    figure = Figure(figsize=(width_inches, 4.4), layout="constrained")
    ax = figure.subplots()
    for x, key in enumerate(keys):
        present = [(i, label) for i, label in enumerate(best) if key in best[label]]
        for slot, (i, label) in enumerate(present):  # the runs that have it, centred
            record = best[label][key]
            xi = x + width * (slot - (len(present) - 1) / 2)
            color = f"C{i}" if len(runs) > 1 else AXIS_COLORS.get(key[0], "0.5")
            ax.bar(xi, record["bytes"] / factor, width=width * 0.95, color=color)
            calls = record["calls"]
            ax.text(xi, record["bytes"] / factor, f"{calls}\ncall{'s' * (calls != 1)}",
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)), [f"{op}\n{axis} axis" for axis, op in keys], fontsize=8)
    ax.set_ylim(0, (1.5 if len(runs) > 1 else 1.2) * top / factor)  # room for the legend
    ax.set_ylabel(f"{unit} per rank in the last step (busiest rank)")
    if len(runs) > 1:
        ax.legend(handles=[Patch(color=f"C{i}", label=label) for i, label in enumerate(runs)],
                  fontsize=8, loc="upper center", ncol=min(len(runs), 4))
    ax.set_title(fill(title or "the communication ledger", int(11 * width_inches)),
                 fontsize=10)
    return figure


def sent_per_axis(records: Sequence[dict]) -> dict[str, float]:
    """Bytes the busiest rank of each axis handed to MPI in the step (receives left
    out: they mirror the sends), axes in mesh order: dp, tp, pp, ep, edp."""
    per_axis: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        if r["op"] not in ("Recv", "Irecv"):
            per_axis[r["group"]][r["rank"]] += r["bytes"]
    order = list(AXIS_COLORS)
    return {axis: max(per_axis[axis].values()) for axis in
            sorted(per_axis, key=lambda a: order.index(a) if a in order else len(order))}


def ledger_compare_figure(ledgers: dict[str, Sequence[dict]], title: str = "") -> Figure:
    """Several runs' ledgers side by side: one horizontal bar per run, cut by mesh
    axis, length = bytes the busiest rank of that axis sent in the last step."""
    sent = {label: sent_per_axis(records) for label, records in ledgers.items()}
    factor, unit = byte_unit(max(sum(per.values()) for per in sent.values()))
    labels = list(ledgers)[::-1]
    figure = Figure(figsize=(8.5, 1.2 + 0.45 * len(labels)), layout="constrained")
    ax = figure.subplots()
    for y, label in enumerate(labels):
        left = 0.0
        for axis, value in sent[label].items():
            ax.barh(y, value / factor, left=left, color=AXIS_COLORS.get(axis, "0.5"))
            left += value / factor
        ax.text(left, y, f" {left:.3g} {unit}", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlim(0, 1.15 * max(sum(per.values()) for per in sent.values()) / factor)
    ax.set_xlabel(f"{unit} sent per rank in the last step (busiest rank of each axis)")
    axes_seen = {axis for per in sent.values() for axis in per}
    ax.legend(handles=[Patch(color=c, label=f"{a} axis") for a, c in AXIS_COLORS.items()
                       if a in axes_seen], fontsize=8, loc="center left",
              bbox_to_anchor=(1.01, 0.5))
    ax.set_title(fill(title or "what moved, by mesh axis", 90), fontsize=10)
    return figure


# -------------------------------------------------------------- expert load
def expert_load_figure(stats: dict, title: str = "") -> Figure:
    """An MoE block's load (`expert_parallel.load_stats`): assignments routed to each
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
        left.axhline(stats["limit"], color="black", ls="--", lw=1,
                     label=f"capacity ceil(c k B/E) = {stats['limit']}")
    left.axhline(routed.mean(), color="0.3", ls=":", lw=1, label="perfect balance")
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


# ------------------------------------------------------------------- memory
def as_states(value: ModelStates | dict) -> ModelStates:
    """A `ModelStates`, or the dict of one (read back from JSON)."""
    return value if isinstance(value, ModelStates) else ModelStates(**value)


def memory_figure(runs: dict[str, Sequence[ModelStates | dict]],
                  marks: dict[str, ModelStates] | None = None,
                  mark_label: str = "formula (memory.zero_formula)", title: str = "",
                  relative: bool = False) -> Figure:
    """Bytes of model states each rank holds, one group of bars per run (a ZeRO
    stage, a mesh), one stacked bar per rank: parameters, gradients, optimizer
    state. A black line over a group marks `marks[label].total` (a formula, or
    what one process holds), named `mark_label`. With `relative`, every group is
    drawn in percent of its mark, so runs of different models compare."""
    states = {label: [as_states(s) for s in ranks] for label, ranks in runs.items()}
    scale = {label: 100 / marks[label].total if relative else 1.0 for label in states}
    tops = [s.total * scale[k] for k, ranks in states.items() for s in ranks]
    tops += [m.total * scale[k] for k, m in (marks or {}).items()]
    factor, unit = (1.0, "%") if relative else byte_unit(max(tops))
    bars = sum(len(r) for r in states.values()) + 1.2 * len(states)
    width_inches = min(11.0, max(6.5, 1.5 + 0.22 * bars))
    figure = Figure(figsize=(width_inches, 4.4), layout="constrained")
    ax = figure.subplots()
    x0, ticks = 0.0, []
    for label, ranks in states.items():
        xs = x0 + np.arange(len(ranks))
        bottom = np.zeros(len(ranks))
        for kind, color in STATE_COLORS.items():
            values = np.array([getattr(s, kind) for s in ranks]) * scale[label] / factor
            ax.bar(xs, values, bottom=bottom, color=color, width=0.85)
            bottom += values
        if marks and label in marks:
            ax.hlines(marks[label].total * scale[label] / factor, xs[0] - 0.45, xs[-1] + 0.45,
                      color="black", lw=2)
        ticks.append((xs.mean(), label))
        x0 += len(ranks) + 1.2
    ax.set_xticks([t for t, _ in ticks], [name for _, name in ticks], fontsize=8)
    ax.set_ylabel("% of what one process holds, per rank" if relative
                  else f"{unit} per rank (one bar per rank)")
    ax.set_ylim(0, 1.2 * max(tops) / factor)
    held = {k for k in STATE_COLORS if any(getattr(s, k) for r in states.values() for s in r)}
    handles = [Patch(color=c, label=k) for k, c in STATE_COLORS.items() if k in held]
    if marks:
        handles.append(Patch(color="black", label=mark_label))
    ax.legend(handles=handles, fontsize=8, ncol=len(handles), loc="upper center")
    ax.set_title(fill(title or "model states per rank", int(11 * width_inches)), fontsize=10)
    return figure


# ------------------------------------------------------------------- losses
def loss_figure(runs: dict[str, Sequence[float]], references: dict[str, Sequence[float]],
                title: str = "") -> Figure:
    """Each parallel run's step losses drawn over its single-process run (`runs` and
    `references` share labels), and beside it their relative difference per step on
    a log scale against the 1e-9 tolerance (an exact 0 is drawn at 1e-18)."""
    figure = Figure(figsize=(12, 4), layout="constrained")
    left, right = figure.subplots(1, 2)
    drawn: set[tuple] = set()
    markers, worst = "osD^v<>p*h", 1e-18
    for i, (label, losses) in enumerate(runs.items()):
        ref = np.asarray(references[label])
        steps = np.arange(1, len(ref) + 1)
        if tuple(np.round(ref, 12)) not in drawn:  # runs of one model share a reference
            drawn.add(tuple(np.round(ref, 12)))
            left.plot(steps, ref, color="0.5", lw=4, alpha=0.5)
        style = dict(color=f"C{i}", marker=markers[i % len(markers)], fillstyle="none")
        left.plot(steps, losses, ls="none", markersize=5, **style)
        diff = np.maximum(np.abs(np.asarray(losses) - ref) / np.abs(ref), 1e-18)
        right.plot(steps, diff, label=label, **style)
        worst = max(worst, float(diff.max()))
    left.set_xlabel("step")
    left.set_ylabel("loss (before the step's update)")
    left.set_title("parallel runs (marks) over the single-process run (grey)", fontsize=10)
    right.axhline(1e-9, color="black", ls="--", lw=1)
    right.set_yscale("log")
    top = max(-6, int(np.ceil(np.log10(worst))) + 1)  # decades: 1e-18 (= 0) .. 1e{top}
    right.set_ylim(1e-19, 10.0 ** (top + 0.5))
    ticks = list(range(-18, top + 1, 2 if top <= -6 else 4))
    right.set_yticks([10.0 ** t for t in ticks], ["exactly 0"] + [f"1e{t}" for t in ticks[1:]])
    right.minorticks_off()
    right.set_xlabel("step")
    right.set_ylabel("|parallel - one process| / |one process|")
    right.set_title("relative difference of the loss (dashed: tolerance 1e-9)", fontsize=10)
    for ax in (left, right):
        ax.xaxis.get_major_locator().set_params(integer=True)
    figure.legend(loc="outside right center", fontsize=8, frameon=False)
    if title:
        figure.suptitle(title, fontsize=11)
    return figure


# ---------------------------------------------------------------- Alltoall
def draw_chunks(ax: Axes, codes: np.ndarray, title: str) -> None:
    """Rank r's row of chunks; code 100 * s + c is chunk A_c made by rank s, coloured
    by s."""
    ranks, width = codes.shape
    for r in range(ranks):
        for j in range(width):
            source, chunk = divmod(int(codes[r, j]), 100)
            ax.add_patch(Rectangle((j - 0.47, r - 0.47), 0.94, 0.94, color=f"C{source % 10}"))
            ax.text(j, r, f"A{chunk}\nof rank {source}", ha="center", va="center",
                    fontsize=8, color="white")
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xticks(range(width), [f"slot {j}" for j in range(width)], fontsize=8)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_aspect("equal")


def alltoall_figure(before: np.ndarray, after: np.ndarray) -> Figure:
    """The source text's Alltoall: each rank's chunks [A1..AN] before, and after it
    rank j holding chunk j+1 of every rank. Colour = the rank that made the chunk."""
    n = min(before.shape[0], 8)  # beyond 8 ranks the cells just get smaller
    figure = Figure(figsize=(1.2 + 2.0 * n, 1.1 + 0.9 * n), layout="constrained")
    left, right = figure.subplots(1, 2)
    draw_chunks(left, before, "before: every rank holds [A1, ..., AN]")
    draw_chunks(right, after, "after Alltoall: slot i of rank j = A(j+1) of rank i")
    figure.suptitle("Alltoall: colour = the rank that made the chunk", fontsize=11)
    return figure


# --------------------------------------------------------------- the tour
def whole_model(cfg: object) -> ModelStates:
    """Bytes of model states one process holds for `cfg` (a TrainConfig): every
    parameter, its gradient and its optimizer state."""
    from minipar.memory import optimizer_bytes_per_param
    from minipar.nn import canonical_shapes

    psi = sum(int(np.prod(shape)) for shape in canonical_shapes(cfg.model_config()).values())
    itemsize = np.dtype(cfg.dtype).itemsize
    return ModelStates(params=psi * itemsize, grads=psi * itemsize,
                       optimizer=psi * optimizer_bytes_per_param(cfg.optimizer, itemsize))


def short_label(stop: dict) -> str:
    """'TP (dp2 tp4)' from a tour stop's title and config."""
    cfg = stop["cfg"]
    mesh = " ".join(f"{axis}{getattr(cfg, axis)}" for axis in ("dp", "tp", "pp", "ep")
                    if getattr(cfg, axis) > 1 and not (axis == "ep" and cfg.model != "moe"))
    return f"{stop['title'].split('  ')[0]} ({mesh})"


def tour_figures(folder: Path | str, stops: Sequence[dict]) -> Path:
    """The tour's figures from its runs, written to `folder`: what each strategy
    moved per axis, memory per rank, every loss curve over one process, and the
    pipeline and expert-load pictures of the stops that have them.

    Each stop is a dict: `title`, `cfg` (TrainConfig), `losses`, `reference` (the
    one-process losses), `ledger`, `memory` (one ModelStates per rank) and
    `extras` (RunResult.extras of rank 0)."""
    folder = Path(folder)
    labels = [short_label(stop) for stop in stops]
    save(ledger_compare_figure({k: s["ledger"] for k, s in zip(labels, stops)},
                               "the tour: what one rank sent in the last step, per axis"),
         folder / "tour_ledger.png")
    names = [k.replace(" (", "\n(") for k in labels]
    save(memory_figure(dict(zip(names, (s["memory"] for s in stops))),
                       dict(zip(names, (whole_model(s["cfg"]) for s in stops))),
                       "one process (the whole model) = 100%",
                       "the tour: the share of the model states each of the 8 ranks holds",
                       relative=True),
         folder / "tour_memory.png")
    save(loss_figure({k: s["losses"] for k, s in zip(labels, stops)},
                     {k: s["reference"] for k, s in zip(labels, stops)},
                     "the tour: every strategy on 8 ranks against one process"),
         folder / "tour_losses.png")
    # the first pipelined stop (simulated beside its real run), the first MoE stop
    piped = [(k, s) for k, s in zip(labels, stops) if s["extras"].get("timeline")][:1]
    for label, stop in piped:
        cfg = stop["cfg"]
        sim = simulate_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual)
        save(gantt_figure(sim, stop["extras"]["timeline"], f"{label}: {cfg.schedule}, "
                          f"M = {cfg.microbatches} microbatches"), folder / "tour_pipeline.png")
    routed = [(k, s) for k, s in zip(labels, stops) if s["extras"].get("expert_load")][:1]
    for label, stop in routed:  # block 1's load in the last microbatch
        save(expert_load_figure(stop["extras"]["expert_load"][0], f"{label}: block 1, "
                                f"{stop['cfg'].experts} experts, top-{stop['cfg'].top_k}"),
             folder / "tour_experts.png")
    return folder
