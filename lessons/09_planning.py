"""Lesson 9: the source text's rules of thumb, checked at real scale by the planner.

    mpiexec -n 1 python lessons/09_planning.py      (one process, no MPI needed:)
    python lessons/09_planning.py --plot figures
    python lessons/09_planning.py --quick           (smaller searches: see below)

The source text closes its comparison with rules of thumb: TP splits every layer and
talks in every forward and backward, so it is kept inside a node ("scaling is
limited, usually 8-16 GPUs"); PP passes only activations, so it can cross nodes, but
it has a bubble; EP is for MoE models, and its AllToAll is "very heavy"; data
parallelism takes the rest. `minipar.planner.plan` prices every way to split one training
step over the GPUs (`python -m minipar plan ...`) with the arithmetic that predicts
minipar's own 8-rank runs exactly (tests/planner/test_plan.py): ZeRO's model states,
Megatron's activations, the ledger of every collective, the bubble formula. Here
it is asked the source's questions about two models:

  - a dense 70B: the `llama3-70b` preset (80 layers, d 8192, d_ff 28672, 64 heads,
    SwiGLU, vocabulary 128256) with 16 key/value heads instead of 8, so that tp = 16
    can be tried, and sequences of 4096: batch 1024 x 4096 tokens, on 512 GPUs;
  - a 671B MoE: the `deepseek-v3` preset (61 layers of which the first 3 dense with
    d_ff 18432, d 7168, latent attention, 256 routed experts top-8 + 1 shared, expert
    d_ff 2048, vocabulary 129280), batch 8192 x 4096, on 2048 GPUs.

and last, the planner's whole report for Llama 3 405B on 8192 H100s, next to the mesh the
Llama 3 paper ran (TP 8, PP 16, DP 64).

Assumptions, said once: the `h100` cluster preset, nodes of 8 GPUs of 80 GB (of which
8 are left to the framework) and 989 TFLOP/s (bf16, dense), of which 50% is reached;
450 GB/s per GPU inside a node (NVLink), 50 GB/s per GPU between nodes (a 400 Gb/s
NIC each), 5 us per message step; bf16 weights and activations, Adam in mixed
precision (16 bytes per parameter); SP with TP; selective recomputation for the dense
model, full recomputation for the MoE; balanced routing; 1F1B; cp = 1 in sections 1-4
(context parallelism is a lever for long sequences); no overlap of communication with
compute (real systems hide part of it, so the communication shares below are upper
bounds).

`--quick` (for the tests) prices fewer plans, and says so where it prints: the MoE only
with ZeRO-1, the 405B only with cp = 1 (the full search also tries context parallelism).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from minipar.planner.memory_cost import Plan, Workload, rank_shape
from minipar.planner.plan_table import mfu
from minipar.planner.presets import CLUSTERS, MODELS
from minipar.planner.search import (
    GB,
    Estimate,
    best_by,
    divisors,
    evaluate,
    hardware,
    search,
    usable,
)
from minipar.planner.time_cost import Timing, ledger_of, traffic
from minipar.planner.workloads import transformer
from minipar.settings.preflight import folder_problems
from minipar.teaching.lines import fit

H100 = hardware(CLUSTERS["h100"], efficiency=0.5)
USABLE = usable(H100)  # what a plan may use: the GPU's memory less the framework's headroom


def room() -> str:
    """`72 usable GB of 80`: the line a plan must stay under, in the planner's words."""
    return f"{USABLE / GB:g} usable GB of {H100.gpu_memory / GB:g}"
ONE_CONTEXT = {"cp": 1}
TIME_COLORS = {"compute": "0.55", "tp": "tab:orange", "pp": "tab:green", "ep": "tab:red",
               "dp": "tab:blue", "bubble": "0.85"}
MEMORY_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green",
                 "activations": "tab:purple", "ZeRO buffer": "tab:pink"}


def dense_70b(batch: int = 1024) -> Workload:
    model = replace(MODELS["llama3-70b"], name="a dense 70B", kv_heads=16, seq_len=4096)
    return transformer(model, batch)


def moe_671b(batch: int = 8192) -> Workload:
    return transformer(replace(MODELS["deepseek-v3"], name="a 671B MoE"), batch)


DENSE = Plan(1, sp=True)


def dense_search(w: Workload, gpus: int) -> object:
    """The 70B's plans on `gpus` GPUs: selective recomputation, one context rank."""
    return search(w, H100, gpus, DENSE, recomputes=("selective",), fixed=ONE_CONTEXT)


# ------------------------------------------------------------------ the numbers
def time_parts(t: Timing) -> dict[str, float]:
    """Seconds of a step by cause: compute, each axis's communication, the bubble."""
    def axis(name: str) -> float:
        names = ("dp", "edp") if name == "dp" else (name,)
        return sum(t.pipeline_comm.get(n, 0.0) + t.step_comm.get(n, 0.0) for n in names)
    return {"compute": t.compute, **{a: axis(a) for a in ("tp", "pp", "ep", "dp")},
            "bubble": t.bubble}


def memory_parts(e: Estimate) -> dict[str, float]:
    return {"params": e.states.params, "grads": e.states.grads,
            "optimizer": e.states.optimizer, "activations": e.activations,
            "ZeRO buffer": e.gathered}


def axis_table(best: dict[int, Estimate], axis: str) -> list[str]:
    """One line per degree of `axis`: its best plan, memory, step time and what it is made of."""
    lines = [f"  {axis:>4} | best plan with it                     | GB/GPU | step s | "
             + " ".join(f"{k:>7}" for k in TIME_COLORS)]
    for degree, e in best.items():
        head = f"  {degree:4d} | {e.plan.label():37s} | {e.memory / GB:6.1f} |"
        if e.timing is None:
            lines.append(head + f"  does not fit in the {room()}")
            continue
        parts = time_parts(e.timing)
        lines.append(head + f" {e.timing.total:6.2f} | "
                     + " ".join(f"{parts[k]:7.2f}" for k in TIME_COLORS))
    return lines


def say(*lines: str) -> None:
    """Print, a line wider than the page wrapped (teaching/lines.py)."""
    print(fit("\n".join(lines)), flush=True)


def tensor_parallel() -> dict[int, Estimate]:
    w = dense_70b()
    best = best_by(dense_search(w, 512), "tp")
    fits = {tp: e for tp, e in best.items() if e.timing}
    top = min(fits, key=lambda tp: fits[tp].timing.total)
    inside, across = fits[H100.node_size], fits[2 * H100.node_size]
    say("=== 1. TP inside a node: the 70B on 512 GPUs, the best plan for each tp",
        *axis_table(best, "tp"),
        (f"   tp=1 fits only as {best[1].plan.label()}: {best[1].memory / GB:.1f} GB of the "
         f"{room()}, of which activations {best[1].activations / GB:.0f} GB (TP+SP cut them "
         f"by tp), and its step takes {best[1].timing.total:.0f} s."
         if best[1].timing else
         f"   tp=1 does not fit: {best[1].memory / GB:.1f} GB against the {room()}, of which "
         f"activations {best[1].activations / GB:.0f} GB (TP+SP cut them by tp)."),
        f"   The fastest plan uses tp={top}. Inside a node TP costs "
        f"{time_parts(inside.timing)['tp']:.2f} s of {inside.timing.total:.2f} s at tp=8; at "
        f"tp=16 a tp group spans 2 nodes, its Allreduces run at "
        f"{H100.inter_bw / GB:g} instead of {H100.intra_bw / GB:g} GB/s: "
        f"{time_parts(across.timing)['tp']:.2f} s, a step "
        f"{across.timing.total / inside.timing.total:.1f}x longer. TP stops at the node.", "")
    return best


def pipeline_parallel() -> tuple[dict[int, Estimate], list[Estimate]]:
    w = dense_70b()
    found = dense_search(w, 512)
    best = best_by(found, "pp")
    piped = min((e for pp, e in best.items() if pp > 1 and e.timing),
                key=lambda e: e.timing.total)            # the fastest pipeline
    say("=== 2. PP across nodes: the same 70B, the best plan for each pp", *axis_table(best, "pp"),
        f"   The fastest pipeline {piped.plan.label()}"
        + (f" ({piped.timing.total / best[1].timing.total - 1:+.0%} against the best "
           "without one)" if best[1].timing else "")
        + f": its pp groups stride over {piped.plan.tp * piped.plan.dp} ranks, so every "
        f"stage boundary crosses nodes, yet a stage passes only (b, d): "
        f"{piped.wire.get('pp', 0) / GB:.1f} GB per GPU per step against TP's "
        f"{piped.wire.get('tp', 0) / GB:.0f} GB inside the node.")
    mesh = best[8].plan  # pp = 8: its bubble (pp-1)/(M+pp-1) against M, memory aside
    roomy = replace(H100, gpu_memory=float("inf"))
    sweep = [evaluate(w, roomy, replace(mesh, microbatches=m))
             for m in divisors(w.batch // mesh.dp)]
    say(f"   {mesh.label()[:-5]}: the bubble against the microbatches M (each replica has "
        f"{w.batch // mesh.dp} sequences of the global batch, so M <= {w.batch // mesh.dp}):")
    for e in sweep:
        over = e.memory > USABLE
        say(f"     M={e.plan.microbatches:3d}: bubble {e.bubble:6.1%}, step "
            f"{e.timing.total:6.2f} s, {e.memory / GB:6.1f} GB per GPU"
            + ("  (does not fit: b = B/(dp M) sequences in flight)" if over else ""))
    say("   Few microbatches: a long bubble and big ones in flight; many: the bubble shrinks "
        "as (pp-1)/(M+pp-1), as far as the global batch allows.", "")
    return best, sweep


def expert_parallel(quick: bool = False) -> dict[int, Estimate]:
    """The MoE's best plan for each ep on 2048 GPUs (`quick`: ZeRO-1 plans only)."""
    w = moe_671b()
    stages = (1,) if quick else (0, 1, 2, 3)
    best = best_by(search(w, H100, 2048, DENSE, zero_stages=stages, recomputes=("full",),
                          fixed=ONE_CONTEXT), "ep")
    say(f"=== 3. EP for the MoE: {w.params / 1e9:.0f} B parameters, {w.active_params / 1e9:.1f} B "
        "active per token, on 2048 GPUs, the best plan for each ep"
        + (" (--quick: ZeRO-1 plans only)" if quick else ""), *axis_table(best, "ep"))
    none, node, far = best[1], best[H100.node_size], best[64]
    share = time_parts(far.timing)["ep"] / far.timing.compute
    say(f"   Without EP the experts fit only in a deep pipeline (pp={none.plan.pp}): "
        f"{none.timing.total:.1f} s. With ep=8 the AllToAll stays in a node: "
        f"{time_parts(node.timing)['ep']:.2f} s of {node.timing.total:.1f} s. At ep=64 "
        f"(8 nodes) 7/8 of every token's k copies leave the node: "
        f"{time_parts(far.timing)['ep']:.1f} s, {share:.0%} of the compute time: the "
        "bottleneck the source warns of. (DeepSeek-V3's report puts cross-node EP at a "
        "computation-to-communication ratio of about 1:1, and hides the AllToAll behind "
        "compute with its DualPipe schedule: an overlap this planner does not model.)", "")
    return best


def data_parallel() -> list[tuple[int, Estimate]]:
    w = dense_70b()
    rows = [(gpus, dense_search(w, gpus).feasible[0]) for gpus in
            (64, 128, 256, 512, 1024, 2048, 4096)]
    say("=== 4. DP for the rest: the 70B on more and more GPUs (global batch fixed at 1024 x 4096)")
    for gpus, e in rows:
        say(f"  {gpus:5d} GPUs: {e.plan.label():37s} step {e.timing.total:7.2f} s, "
            f"MFU {mfu(w, H100, gpus, e.timing.total):5.1%}, bubble {e.bubble:5.1%}")
    (low, first), (high, last) = rows[0], rows[-1]
    say("   tp and pp settle where the model fits; the other GPUs become dp replicas. From "
        f"{low} to {high} GPUs the step is {first.timing.total / last.timing.total:.0f}x "
        f"shorter for {high // low}x the GPUs: each replica's share of the fixed batch falls "
        f"to {w.batch // last.plan.dp} sequences, the bubble grows to {last.bubble:.0%}, and "
        "the gradient sync stays while the compute shrinks.", "")
    return rows


def small_scale() -> None:
    """The same functions on minipar's own mesh dp=2 tp=2 pp=2: what rank 0 will hold and
    send, which tests/planner/test_plan.py compares with a real 8-rank run, exactly."""
    from minipar.core.byte_units import format_bytes
    from minipar.planner.memory_cost import model_states
    from minipar.planner.workloads import minipar_workload, plan_of
    from minipar.settings.config import TrainConfig

    cfg = TrainConfig(layers=4, d_model=16, d_in=8, batch=16, optimizer="adam",
                      microbatches=2, dp=2, tp=2, pp=2).resolved(8)
    w, plan = minipar_workload(cfg), plan_of(cfg)
    say("=== 5. The same arithmetic at minipar's scale: train --dp 2 --tp 2 --pp 2 "
        "--microbatches 2 --optimizer adam, pipeline stage 0 and 1 of dp rank 0")
    for stage in (0, 1):
        shape = rank_shape(w, plan, stage)
        states = model_states(w, plan, shape)
        ledger = ", ".join(f"{group} {op} {calls}x ({elements} elements)" for (group, op),
                           (calls, elements) in sorted(ledger_of(traffic(w, plan, shape)).items()))
        held = {name: f"{n} bytes ({format_bytes(n)})" for name, n in
                (("params", states.params), ("grads", states.grads),
                 ("optimizer", states.optimizer))}
        say(f"  stage {stage}: params {held['params']}, grads {held['grads']}, optimizer "
            f"{held['optimizer']}; ledger: {ledger}")
    say("  tests/planner/test_plan.py runs such meshes (DP with buckets, TP+PP, SP with ZeRO-1, "
        "ZeRO-3, interleaved ZeRO-2, MoE with EP and PP) on 8 ranks: every rank holds and "
        "sends exactly this.", "")


def llama3_405b(quick: bool = False) -> None:
    """The planner's report for the Llama 3 paper's 8192-GPU run, and where the mesh the
    paper ran (TP 8, PP 16, DP 64) comes in it (`quick`: only the plans with cp = 1)."""
    from minipar.planner.plan_table import explain, report
    from minipar.planner.search import RECOMPUTE, distinct_meshes

    model = MODELS["llama3-405b"]
    w = transformer(model, 2048)
    schedules = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4))
    found = search(w, H100, 8192, DENSE, recomputes=RECOMPUTE, schedules=schedules,
                   fixed=ONE_CONTEXT if quick else None)
    say("=== 6. Llama 3 405B on 8192 H100s, 2048 x 8192 tokens a step: python -m minipar plan "
        "--preset llama3-405b --cluster h100 --gpus 8192 --global-batch 2048"
        + (" (--quick: the plans with cp = 1 only)" if quick else ""),
        report(found, w, model, H100, 8192, DENSE, top=5))
    meshes = distinct_meshes(found.feasible)
    rank = next(i for i, e in enumerate(meshes)
                if (e.plan.dp, e.plan.tp, e.plan.pp, e.plan.cp) == (64, 8, 16, 1))
    published, fastest = meshes[rank], meshes[0]
    first, *rest = explain(published, w, H100)
    say(f"   The paper's mesh comes {rank + 1} of {len(meshes)}, "
        f"{published.timing.total / fastest.timing.total - 1:.0%} slower than the fastest "
        "(inside the planner's stated error): " + first, *rest,
        "   (--quick searched cp = 1 only: run without --quick for the plans with context "
        "parallelism.)" if quick else
        "   The planner's faster plans add context parallelism: it lets each replica run "
        "more, smaller microbatches, so the bubble shrinks; the paper kept cp = 1 at 8K "
        "tokens and used it for the 128K-token phase (python -m minipar plan --preset "
        "llama3-405b --cluster h100 --gpus 16384 --global-batch 128 --seq-len 131072).", "")


# ------------------------------------------------------------------ the pictures
def draw_time(ax: object, bars: dict[str, Estimate], xlabel: str,
              scale: dict[str, float] | None = None) -> None:
    """Stacked bars of a step's seconds by cause, one bar per plan (times `scale[name]`);
    a plan that does not fit is marked in red (with its step, if it was timed anyway)."""
    x, bottom = np.arange(len(bars)), np.zeros(len(bars))
    for part, color in TIME_COLORS.items():
        values = np.array([time_parts(e.timing)[part] * (scale or {}).get(name, 1.0)
                           if e.timing else 0.0 for name, e in bars.items()])
        if values.any():
            ax.bar(x, values, bottom=bottom, color=color, width=0.7, label=part,
                   hatch="//" if part == "bubble" else None, edgecolor="white", lw=0.3)
        bottom += values
    for i, e in enumerate(bars.values()):
        over = e.memory > USABLE
        lines = [f"{bottom[i]:.0f}" if bottom[i] >= 100 else f"{bottom[i]:.3g}"] * bool(e.timing)
        lines += [f"{e.memory / GB:.0f} GB:", "does not fit"] * over
        ax.text(i, bottom[i], "\n".join(lines), ha="center", va="bottom", fontsize=8,
                color="tab:red" if over else "black", zorder=5,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set_xticks(x, list(bars))
    ax.set_xlabel(xlabel)
    ax.set_ylim(0, 1.3 * max(bottom.max(), 1e-9))
    ax.grid(axis="y", alpha=0.3)


def draw_memory(ax: object, bars: dict[str, Estimate], xlabel: str) -> None:
    """Stacked bars of bytes per GPU by kind, and the GPU's memory as a dashed line."""
    x, bottom = np.arange(len(bars)), np.zeros(len(bars))
    for part, color in MEMORY_COLORS.items():
        values = np.array([memory_parts(e)[part] / GB for e in bars.values()])
        if values.any():
            ax.bar(x, values, bottom=bottom, color=color, width=0.7, label=part)
        bottom += values
    ax.axhline(H100.gpu_memory / GB, color="0.5", ls=":", lw=1.0,
               label=f"{H100.gpu_memory / GB:g} GB per GPU")
    ax.axhline(USABLE / GB, color="black", ls="--", lw=1.2,
               label=f"{USABLE / GB:g} GB usable: a plan fits under it")
    ax.set_xticks(x, list(bars))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("GB per GPU (its busiest rank)")
    ax.set_ylim(0, 1.3 * max(bottom.max(), H100.gpu_memory / GB))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4)
    ax.grid(axis="y", alpha=0.3)


def node_boundary(ax: object, degrees: list[int]) -> None:
    """A dotted line where a group of this many ranks stops fitting in one node."""
    inside = sum(1 for d in degrees if d <= H100.node_size)
    if 0 < inside < len(degrees):
        ax.axvline(inside - 0.5, color="tab:red", ls=":", lw=1.5)
        ax.text(inside - 0.4, ax.get_ylim()[1] * 0.97, "groups span\nseveral nodes \u2192",
                color="tab:red", fontsize=8, ha="left", va="top")


def axis_figure(best: dict[int, Estimate], axis: str, title: str, limit: int = 10**9
                ) -> Figure:
    """Step time (by cause) and memory per GPU of the fastest plan for each degree of
    `axis` (of the least hungry one where none fits)."""
    degrees = [d for d in best if d <= limit]
    bars = {str(d): best[d] for d in degrees}
    figure = Figure(figsize=(12, 4.8), layout="constrained")
    left, right = figure.subplots(1, 2)
    draw_time(left, bars, axis)
    left.set_ylabel("seconds per step")
    left.set_title("step time of the fastest plan, by cause", fontsize=10)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=6)
    draw_memory(right, bars, axis)
    right.set_title("memory per GPU of the same plan", fontsize=10)
    if axis in ("tp", "ep"):
        node_boundary(left, degrees)
        node_boundary(right, degrees)
    figure.suptitle(title, fontsize=11)
    return figure


def pp_figure(best: dict[int, Estimate], sweep: list[Estimate]) -> Figure:
    """Left: the fastest plan per pp. Right: one mesh's step and bubble against M."""
    figure = Figure(figsize=(12, 4.8), layout="constrained")
    left, right = figure.subplots(1, 2)
    draw_time(left, {str(pp): e for pp, e in best.items()}, "pp")
    left.set_ylabel("seconds per step")
    left.set_title("step time of the fastest plan for each pp, by cause", fontsize=10)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=6)
    draw_time(right, {str(e.plan.microbatches): e for e in sweep}, "microbatches per step M")
    right.set_ylabel("seconds per step")
    mesh = sweep[0].plan
    right.set_title(f"dp={mesh.dp} tp={mesh.tp} pp={mesh.pp}: the bubble (hatched) against M",
                    fontsize=10)
    # the bars in the lower 55% of the panel, the bubble line (its own % axis on the
    # right) in the band above them: the line crosses no bar label
    right.set_ylim(0, right.get_ylim()[1] / 0.55 * 0.8)
    top, low, band = right.get_ylim()[1], 0.62, 0.35
    right.plot(np.arange(len(sweep)), [top * (low + band * e.bubble) for e in sweep], "o-",
               color="black", zorder=4, label="bubble (pp-1)/(M+pp-1), % (right axis)")
    percent = right.secondary_yaxis("right", functions=(
        lambda s: 100 * (s / top - low) / band, lambda q: top * (low + band * q / 100)))
    percent.set_yticks(np.arange(0, 101, 25))
    percent.set_ylabel("bubble, % of the pipeline's time (the line)")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    figure.suptitle("PP across nodes: the 70B on 512 GPUs", fontsize=11)
    return figure


def dp_figure(rows: list[tuple[int, Estimate]]) -> Figure:
    """GPU-seconds per step (flat = perfect scaling) by cause, and MFU, against GPUs."""
    w = dense_70b()
    figure = Figure(figsize=(9, 4.6), layout="constrained")
    ax = figure.subplots()
    bars = {str(gpus): e for gpus, e in rows}
    draw_time(ax, bars, "GPUs (tp and pp as the model needs, the rest dp)",
              scale={str(gpus): float(gpus) for gpus, _ in rows})
    ax.set_ylabel("GPU-seconds per step (flat = perfect scaling)")
    twin = ax.twinx()
    twin.plot(np.arange(len(rows)), [100 * mfu(w, H100, g, e.timing.total) for g, e in rows],
              "D-", color="black")
    # the MFU line in a band above the bars and their labels, so it crosses no number:
    # the bars' axis grows by a third, the MFU axis's 0..50% fills its upper 35%
    ax.set_ylim(0, 1.35 * ax.get_ylim()[1])
    top = 100 * H100.efficiency
    span = top / (0.97 - 0.65)              # 0% at 65% of the height, 50% at 97%
    twin.set_ylim(-0.65 * span, 0.35 * span)
    twin.set_yticks(np.arange(0, top + 1, 10))
    twin.set_ylabel("MFU, % (the line; at most the 50% efficiency)")
    figure.suptitle("DP for the rest: the 70B, global batch 1024 x 4096 tokens", fontsize=11)
    handles, _ = ax.get_legend_handles_labels()   # one legend, under the plot
    ax.legend(handles=[*handles, Line2D([], [], color="black", marker="D",
                                        label="MFU (right axis)")],
              fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=6)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", metavar="DIR", help="write the figures as PNG files here")
    parser.add_argument("--quick", action="store_true",
                        help="smaller searches for sections 3 and 6 (for the tests)")
    args = parser.parse_args()
    unwritable = folder_problems(args.plot) if args.plot is not None else []
    if unwritable:   # now, not after every section has run
        print(f"minipar: error: --plot {unwritable[0]}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    say(f"Assumptions: {H100.node_size} GPUs a node, {H100.gpu_memory / GB:g} GB of which "
        f"{USABLE / GB:g} usable (decimal GB, as the hardware sheet), "
        f"{H100.flops / 1e12:g} TFLOP/s at {H100.efficiency:.0%}, {H100.intra_bw / GB:g} "
        f"GB/s in a node, {H100.inter_bw / GB:g} GB/s between nodes, "
        f"{H100.latency * 1e6:g} us a message (seconds in the tables: compute, each axis's "
        "communication, the bubble)", "")
    tp = tensor_parallel()
    pp, sweep = pipeline_parallel()
    ep = expert_parallel(args.quick)
    dp = data_parallel()
    small_scale()
    llama3_405b(args.quick)
    if args.plot:
        from minipar.teaching.plots import save

        figures = {"09_tp.png": axis_figure(tp, "tp", "TP inside a node: the 70B on 512 GPUs",
                                            limit=32),
                   "09_pp.png": pp_figure(pp, sweep),
                   "09_ep.png": axis_figure(ep, "ep", "EP for the 671B MoE on 2048 GPUs "
                                            "(full recomputation)"),
                   "09_dp.png": dp_figure(dp)}
        for name, figure in figures.items():
            say(f"wrote {save(figure, Path(args.plot) / name)}")


if __name__ == "__main__":
    main()
