"""Pictures of what the ranks did: the ledger, memory per rank, loss curves, the
Alltoall, and the tour's figures; the shared helper `save` (bytes scaled by `byte_units.byte_unit`).

What this file teaches: every number a lesson prints has a shape that is easier
to see than to read, and three pictures check every strategy: the ledger
(comm/collectives.py) is bytes per mesh axis and operation; ZeRO (Rajbhandari et al. 2020)
cuts the bytes of each rank by stage; and a parallel run's loss curve lies on the
single-process one. How busy each rank was (the pipeline's Gantt chart and bubble,
the expert load) is drawn by teaching/load_plots.py.

Every function takes plain data (the records of `RunResult.ledger`,
`memory.ModelStates`, step losses) and returns a matplotlib `Figure` built without
pyplot, so it draws headless (Agg) in a lesson and shows inline in a notebook;
`save(figure, path)` writes a PNG.

    mpiexec -n 4 python lessons/07_zero.py --plot figures
    mpiexec -n 8 python -m minipar tour --plot figures
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from textwrap import fill

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minipar.core.byte_units import byte_unit
from minipar.core.memory import ModelStates, optimizer_bytes_per_param
from minipar.core.nn import canonical_shapes
from minipar.core.threads import cores
from minipar.parallel.pipeline.schedules import replay, simulate_schedule
from minipar.teaching.ledger_tables import RECEIVES, group_sizes, sent_per_axis, wire_bytes
from minipar.teaching.load_plots import expert_load_figure, gantt_figure, series_style

AXIS_COLORS = {"dp": "tab:blue", "tp": "tab:orange", "pp": "tab:green", "ep": "tab:red",
               "edp": "tab:purple", "cp": "tab:brown", "world": "tab:gray"}
STATE_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
ACTIVATION_COLOR = "tab:red"


def save(figure: Figure, path: Path | str) -> Path:
    """Write `figure` as a PNG (folders made as needed); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


# ------------------------------------------------------------------- ledger
def busiest(records: Sequence[dict], sizes: Mapping[str, int]) -> dict[tuple[str, str], dict]:
    """Per (axis, op), the record of the rank that put the most bytes on the wire, with
    those bytes added under "wire" (a receive, which sends nothing, is left out)."""
    best: dict[tuple[str, str], dict] = {}
    for r in records:
        if r["op"] in RECEIVES:
            continue
        key, wire = (r["group"], r["op"]), wire_bytes(r, sizes)
        if key not in best or wire > best[key]["wire"]:
            best[key] = dict(r, wire=wire)
    return best


def ledger_figure(runs: dict[str, Sequence[dict]] | Sequence[dict], sizes: Mapping[str, int],
                  title: str = "") -> Figure:
    """The ledger of a step as bars: one group per (mesh axis, operation), one bar per
    run (`runs` maps a label to its records; or pass one run's records), height =
    bytes the busiest rank put on the wire for it (`wire_bytes`, ring formulas; the
    runs share the group sizes `sizes`; docs/design.md, "Communication"), the number of
    calls on top."""
    runs = runs if isinstance(runs, dict) else {"": runs}
    best = {label: busiest(records, sizes) for label, records in runs.items()}
    order = list(AXIS_COLORS)  # mesh axes in mesh order, then operations by name
    keys = sorted({key for per in best.values() for key in per},
                  key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[1]))
    top = max([r["wire"] for per in best.values() for r in per.values()] or [1]) or 1
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
            ax.bar(xi, record["wire"] / factor, width=width * 0.95, color=color)
            calls = record["calls"]
            ax.text(xi, record["wire"] / factor, f"{calls}\ncall{'s' * (calls != 1)}",
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)), [f"{op}\n{axis} axis" for axis, op in keys], fontsize=8)
    ax.set_ylim(0, (1.5 if len(runs) > 1 else 1.2) * top / factor)  # room for the legend
    ax.set_ylabel(f"{unit} on the wire per rank, last step\n(busiest rank; ring algorithms)")
    if len(runs) > 1:
        ax.legend(handles=[Patch(color=f"C{i}", label=label) for i, label in enumerate(runs)],
                  fontsize=8, loc="upper center", ncol=min(len(runs), 4))
    ax.set_title(fill(title or "the communication ledger", int(11 * width_inches)),
                 fontsize=10)
    return figure


def ledger_compare_figure(ledgers: dict[str, Sequence[dict]],
                          sizes: dict[str, Mapping[str, int]], title: str = "") -> Figure:
    """Several runs' ledgers side by side: one horizontal bar per run, cut by mesh
    axis, length = bytes the busiest rank of that axis put on the wire in the last
    step (`sent_per_axis`; `sizes[label]` are that run's group sizes)."""
    sent = {label: sent_per_axis(records, sizes[label]) for label, records in ledgers.items()}
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
    ax.set_xlabel(f"{unit} on the wire per rank in the last step (busiest rank of each axis; "
                  "ring algorithms)")
    axes_seen = {axis for per in sent.values() for axis in per}
    ax.legend(handles=[Patch(color=c, label=f"{a} axis") for a, c in AXIS_COLORS.items()
                       if a in axes_seen], fontsize=8, loc="center left",
              bbox_to_anchor=(1.01, 0.5))
    ax.set_title(fill(title or "what moved on the wire, by mesh axis", 90), fontsize=10)
    return figure


# ------------------------------------------------------------------- memory
def as_states(value: ModelStates | dict) -> ModelStates:
    """A `ModelStates`, or the dict of one (read back from JSON)."""
    return value if isinstance(value, ModelStates) else ModelStates(**value)


def memory_figure(runs: dict[str, Sequence[ModelStates | dict]],
                  marks: dict[str, ModelStates] | None = None,
                  mark_label: str = "formula (memory.zero_formula)", title: str = "",
                  relative: bool = False,
                  activations: dict[str, Sequence[float]] | None = None) -> Figure:
    """Bytes of model states each rank holds, one group of bars per run (a ZeRO
    stage, a mesh), one stacked bar per rank: parameters, gradients, optimizer
    state, and on top, if given, `activations[label][rank]`: the peak bytes of
    saved activations. A black line over a group marks `marks[label].total` (a
    formula, or what one process holds), named `mark_label`. With `relative`,
    every group is drawn in percent of its mark, so runs of different models compare."""
    states = {label: [as_states(s) for s in ranks] for label, ranks in runs.items()}
    acts = {label: np.asarray((activations or {}).get(label, np.zeros(len(ranks))), float)
            for label, ranks in states.items()}
    scale = {label: 100 / marks[label].total if relative else 1.0 for label in states}
    tops = [(s.total + a) * scale[k] for k, ranks in states.items()
            for s, a in zip(ranks, acts[k])]
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
        if activations:
            ax.bar(xs, acts[label] * scale[label] / factor, bottom=bottom,
                   color=ACTIVATION_COLOR, width=0.85)
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
    if activations:
        handles.append(Patch(color=ACTIVATION_COLOR, label="saved activations, peak"))
    if marks:
        handles.append(Patch(color="black", label=mark_label))
    ax.legend(handles=handles, fontsize=8, ncol=len(handles), loc="upper center")
    ax.set_title(fill(title or "model states per rank", int(11 * width_inches)), fontsize=10)
    return figure


# ------------------------------------------------------------------- losses


def loss_figure(runs: dict[str, Sequence[float]], references: dict[str, Sequence[float]],
                title: str = "", tolerances: dict[str, float] | None = None) -> Figure:
    """Each parallel run's step losses drawn over its single-process run (`runs` and
    `references` share labels), and beside it their relative difference per step on
    a log scale against its tolerance (an exact 0 is drawn at 1e-18): 1e-9, or the run's
    own from `tolerances` (a 16-bit run's derived bound, run/results.py mixed_tolerance),
    drawn dotted in the run's colour. Runs of different models (different references)
    get a loss panel each, with its own scale: on one axis, losses of 2.3 and 4.2 would
    squash every curve flat."""
    tolerances = tolerances or {}
    groups: dict[tuple, list[str]] = {}  # runs of one model share a reference
    for label in runs:
        groups.setdefault(tuple(np.round(references[label], 12)), []).append(label)
    rows = len(groups)
    figure = Figure(figsize=(12, max(4.0, 1.7 * rows)), layout="constrained")
    grid = figure.add_gridspec(rows, 2)
    lefts = [figure.add_subplot(grid[k, 0]) for k in range(rows)]
    right = figure.add_subplot(grid[:, 1])
    style_of = {label: series_style(i) for i, label in enumerate(runs)}
    worst = 1e-18
    for left, labels in zip(lefts, groups.values()):
        ref = np.asarray(references[labels[0]])
        steps = np.arange(1, len(ref) + 1)
        left.plot(steps, ref, color="0.5", lw=4, alpha=0.5)
        for label in labels:
            left.plot(steps, runs[label], ls="none", markersize=5, **style_of[label])
        if rows > 1:
            left.set_title(fill(", ".join(label.split(" (")[0] for label in labels), 70),
                           fontsize=8)
        left.xaxis.get_major_locator().set_params(integer=True)
    for label, losses in runs.items():
        ref = np.asarray(references[label])
        diff = np.maximum(np.abs(np.asarray(losses) - ref) / np.abs(ref), 1e-18)
        right.plot(np.arange(1, len(ref) + 1), diff, label=label, **style_of[label])
        worst = max(worst, float(diff.max()))
        if label in tolerances:
            right.axhline(tolerances[label], color=style_of[label]["color"], ls=":", lw=1.5,
                          label=f"{label}: its tolerance {tolerances[label]:.1e}")
            worst = max(worst, tolerances[label])
    lefts[-1].set_xlabel("step")
    lefts[rows // 2].set_ylabel("loss (before the step's update)")
    lefts[0].set_title(("one panel per model: " if rows > 1 else "")
                       + "parallel runs (marks) over the single-process run (grey)"
                       + ("\n" + lefts[0].get_title() if rows > 1 else ""), fontsize=10)
    right.axhline(1e-9, color="black", ls="--", lw=1)
    right.set_yscale("log")
    top = max(-6, int(np.ceil(np.log10(worst))) + 1)  # decades: 1e-18 (= 0) .. 1e{top}
    right.set_ylim(1e-19, 10.0 ** (top + 0.5))
    ticks = list(range(-18, top + 1, 2 if top <= -6 else 4))
    right.set_yticks([10.0 ** t for t in ticks], ["exactly 0"] + [f"1e{t}" for t in ticks[1:]])
    right.minorticks_off()
    right.set_xlabel("step")
    right.set_ylabel("|parallel - one process| / |one process|")
    right.set_title("relative difference of the loss (dashed: tolerance 1e-9"
                    + ("; dotted: a run's own" if tolerances else "") + ")", fontsize=10)
    right.xaxis.get_major_locator().set_params(integer=True)
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
    psi = sum(int(np.prod(shape)) for shape in canonical_shapes(cfg.model_config()).values())
    itemsize = np.dtype(cfg.dtype).itemsize
    return ModelStates(params=psi * itemsize, grads=psi * itemsize,
                       optimizer=psi * optimizer_bytes_per_param(cfg.optimizer, itemsize))


def short_label(stop: dict) -> str:
    """'TP (dp2 tp4)' from a tour stop's title and config."""
    cfg = stop["cfg"]
    mesh = " ".join(f"{axis}{getattr(cfg, axis)}" for axis in ("dp", "tp", "pp", "ep")
                    if getattr(cfg, axis) > 1
                    and not (axis == "ep" and not cfg.model_config().is_moe))
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
                               {k: group_sizes(s["cfg"].mesh_shape())
                                for k, s in zip(labels, stops)},
                               "the tour: bytes one rank put on the wire in the last step, "
                               "per axis (8 ranks, the mesh in brackets)"),
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
        timeline = stop["extras"]["timeline"]
        again = replay(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual, timeline)
        save(gantt_figure(sim, timeline, f"{label}: {cfg.schedule}, M = {cfg.microbatches} "
                          "microbatches", replayed=again, cores=cores()),
             folder / "tour_pipeline.png")
    routed = [(k, s) for k, s in zip(labels, stops) if s["extras"].get("expert_load")][:1]
    for label, stop in routed:  # block 1's load in the last microbatch
        save(expert_load_figure(stop["extras"]["expert_load"][0], f"{label}: block 1, "
                                f"{stop['cfg'].experts} experts, top-{stop['cfg'].top_k}"),
             folder / "tour_experts.png")
    return folder
