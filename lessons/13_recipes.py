"""Lesson 13: the big recipes at toy scale -- Llama 3's layout and DeepSeek-V3's, on 8 ranks.

    mpiexec -n 8 python lessons/13_recipes.py
    mpiexec -n 8 python lessons/13_recipes.py --plot figures   # + 13_recipes.png

The published deployments combine every axis of the earlier lessons. Llama 3 405B
(Llama Team 2024, section 3.3.2) trains on 16384 GPUs as TP 8 x CP x PP 16 x DP: for
its 8K-token pre-training sequences CP 1 and DP 128, for the long-context phase
(sequences of 128K tokens) CP 16 and DP 8 -- the context-parallel axis takes the
data-parallel ranks (16 x 8 = 128), so a step still holds 16M tokens. DeepSeek-V3
(DeepSeek-AI 2024, section 3.2) trains on 2048 GPUs as PP 16 x EP 64 x ZeRO-1 DP, and
no TP at all: experts split by EP, attention replicated.

Scaled to 8 ranks, each axis keeps its place in the mesh (tp fastest, then cp, then
dp, then pp) and its role. 8 = 2 x 2 x 2 holds three axes of size 2, not four; so the
two Llama phases keep what the real ones keep -- tp and pp -- and trade dp for cp as
the real long-context phase does (DP 128 -> 8 while CP 1 -> 16 becomes dp 2 -> 1 while
cp 1 -> 2); DeepSeek's DP and EP are 4 (its EP spans its data-parallel ranks, as EP 64
spans 8 nodes of 8):

    Llama-like, 8K     --model gpt      tp 2 x pp 2 x dp 2 (cp 1), ZeRO-1, heads and
                                        vocabulary over tp
    Llama-like, 128K   --model gpt      tp 2 x cp 2 x pp 2 (dp 1), ZeRO-1 over the
                                        dp x cp ranks, --cp-mode allgather (Llama 3's
                                        own: K and V Allgathered over cp), heads and
                                        vocabulary over tp, each cp rank's T/cp
                                        positions of its tp rank's heads
    DeepSeek-like      --model gpt-moe  pp 2 x dp 4, ep 4 (2 of 8 experts per rank, top 2),
                                        ZeRO-1 (dense weights over dp, experts over edp),
                                        no tp

(Llama's FSDP shards more than the optimizer state; here ZeRO-1 stands for it. The toy
sequence is 16 positions in both Llama phases: what scales at 128K is T itself, which
the toy keeps small, and the sequence split, which it keeps.) For
each: the run against one process (float64, relative 1e-9), its ledger per mesh axis
(the bytes one rank puts on the wire in a step, on every axis of more than one
rank), the model-state bytes per rank, the pipeline bubble (the formula beside the
measured idle share), and next to it what the planner (`python -m minipar plan`)
predicts for the real model on the real cluster and mesh (in the hardware's decimal GB).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from minipar.comm.job import run_collectively, verdict, wait_for_rank0
from minipar.core import timing
from minipar.core.byte_units import KiB, format_bytes
from minipar.parallel.pipeline.schedules import bubble_formula
from minipar.parallel.pipeline.simulator import measured_bubble
from minipar.planner import plan_table, presets, search, workloads
from minipar.planner.memory_cost import Plan
from minipar.run.results import max_differences
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.teaching.ledger_tables import group_sizes, wire_bytes
from minipar.teaching.lines import print  # the builtin, a line wider than the page wrapped

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TINY = dict(layers=4, d_model=16, heads=4, seq_len=16, vocab=16, batch=16, d_ff=32,
            steps=3, optimizer="adam", lr=0.01, microbatches=4, schedule="1f1b")
# (name, minipar's run, the real model, its sequence length, cluster, global batch in
# sequences, the real plan). Llama 3: 16M tokens a step, 2048 x 8K or 128 x 128K, 16
# sequences per replica; DeepSeek-V3: 15360 x 4K, 120 per replica, and a zero-bubble
# schedule standing for its DualPipe.
RECIPES = [
    ("Llama 3 405B, 8K phase", dict(TINY, model="gpt", tp=2, pp=2, dp=2, zero=1),
     "llama3-405b", 8192, "h100", 2048, Plan(dp=128, tp=8, pp=16, zero=1, microbatches=16,
                                       sp=True, schedule="interleaved", virtual=2,
                                       recompute="selective")),
    ("Llama 3 405B, 128K phase", dict(TINY, model="gpt", tp=2, cp=2, pp=2, dp=1, zero=1,
                                      cp_mode="allgather"),
     "llama3-405b", 131072, "h100", 128, Plan(dp=8, tp=8, pp=16, cp=16, zero=1,
                                         microbatches=16, sp=True, schedule="interleaved",
                                         virtual=2, recompute="selective")),
    ("DeepSeek-V3", dict(TINY, model="gpt-moe", pp=2, dp=4, ep=4, zero=1, experts=8,
                         top_k=2, expert_d_ff=16, aux_coef=0.01),
     "deepseek-v3", 4096, "h800", 15360, Plan(dp=128, pp=16, ep=64, zero=1,
                                              microbatches=120, schedule="zb-h1",
                                              recompute="full")),
]


def ledger_per_axis(records: list[dict], rank: int, cfg: TrainConfig) -> dict[str, float]:
    """Bytes this rank put on the wire in the last step (ring formulas,
    `report.wire_bytes`), per mesh axis that has more than one rank. With cp > 1 the
    gradient sync the ledger names "dp" runs over the dp x cp replicas, and is named so."""
    sizes = group_sizes(cfg.mesh_shape())
    out: dict[str, float] = defaultdict(float)
    for r in records:
        if r["rank"] == rank and sizes[r["group"]] > 1:
            axis = f"{r['group']} x cp" if cfg.cp > 1 and r["group"] in ("dp", "edp") \
                else r["group"]
            out[axis] += wire_bytes(r, sizes)
    return dict(out)


def predicted(model: str, seq_len: int, cluster: str, batch: int, real: Plan) -> list[str]:
    """The planner's estimate of the real run: memory per GPU, wire volume, step time."""
    w = workloads.transformer(replace(presets.MODELS[model], seq_len=seq_len), batch)
    hw = search.hardware(presets.CLUSTERS[cluster])
    estimate = search.evaluate(w, hw, real)
    return [f"  planner, {presets.MODELS[model].name} on {real.world} x "
            f"{presets.CLUSTERS[cluster].name}, sequences of {seq_len}:"] + [
        "  " + line for line in plan_table.explain(estimate, w, hw)]


def recipe_figure(rows: list[tuple[str, dict[str, float]]]) -> Figure:
    """Bars of the wire bytes rank 0 put on each mesh axis in one step, a group per recipe
    (`rows`: (recipe name, ledger_per_axis)); the notebook draws the same figure. (Imported
    here: the ranks that draw nothing import no matplotlib.)"""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.5), layout="constrained")
    ax = fig.subplots()
    axes = sorted({axis for _, per in rows for axis in per})
    width = 0.8 / len(rows)
    for i, (name, per) in enumerate(rows):
        ax.bar([j + i * width for j in range(len(axes))],
               [per.get(a, 0) / KiB for a in axes], width, label=name, color=f"C{i}",
               hatch=("", "//", "..")[i % 3], edgecolor="white")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(axes))], axes)
    ax.set(ylabel="KiB on the wire, rank 0, one step",
           title="the recipes at toy scale: communication per mesh axis (axes of size > 1)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    if n != 8:
        if rank == 0:
            print("lesson 13 runs on 8 ranks: mpiexec -n 8 python lessons/13_recipes.py")
        raise SystemExit(2)
    rows = []
    for part, (name, fields, model, seq_len, cluster, batch, real) in enumerate(RECIPES, 1):
        wait_for_rank0(world)  # the others asleep while rank 0 reran the last one alone
        cfg = TrainConfig(**fields).resolved(n)
        result = train(cfg, world)
        memory = world.gather(vars(result.extras["memory"]))
        if rank != 0:
            continue
        mesh = " x ".join(f"{axis} {getattr(cfg, axis)}" for axis in ("tp", "cp", "pp", "dp")
                          if getattr(cfg, axis, 1) > 1)
        print(f"\n=== {part}. {name}: --model {cfg.model}, {mesh}"
              + (f", ep {cfg.ep}" if cfg.ep > 1 else "")
              + (f", --cp-mode {cfg.cp_mode}" if cfg.cp > 1 else "")
              + f", ZeRO-{cfg.zero}", flush=True)
        one = train_reference(cfg)
        _, losses, _ = max_differences({"losses": np.array(result.losses)},
                                       {"losses": np.array(one.losses)})
        _, params, where = max_differences(result.final, one.final)
        print(f"  against one process, {cfg.steps} steps: losses rel {losses:.1e}, params "
              f"rel {params:.1e} ({where}) -> {verdict(max(losses, params) <= 1e-9)}")
        per = ledger_per_axis(result.ledger, 0, cfg)
        print("  rank 0 on the wire per axis of more than one rank (one step): "
              + ", ".join(f"{axis} {format_bytes(b)}" for axis, b in sorted(per.items())))
        totals = [sum(m.values()) for m in memory]
        print("  model states per rank (params + grads + optimizer): "
              + " ".join(format_bytes(t) for t in totals))
        formula = bubble_formula(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual)
        timeline = result.extras.get("timeline") or []
        seen = (f", measured {measured_bubble(timeline):.2f} (wall clock, "
                f"{timing.where(n)[1:-1]})" if timeline else "")
        print(f"  bubble: formula {formula:.2f} ({cfg.schedule}, pp {cfg.pp}, M "
              f"{cfg.microbatches}){seen}")
        print("\n".join(predicted(model, seq_len, cluster, batch, real)), flush=True)
        rows.append((name, per))
    if rank == 0 and args.plot:
        from minipar.teaching.plots import save

        print("figure:", save(recipe_figure(rows), args.plot / "13_recipes.png"), flush=True)


if __name__ == "__main__":
    run_collectively(main)
