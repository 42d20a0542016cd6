"""Lesson 18: DiLoCo -- data parallelism that talks every H steps instead of every step.

    mpiexec -n 4 python lessons/18_diloco.py
    mpiexec -n 4 python lessons/18_diloco.py --plot figures   # + 18_loss_wire.png,
                                                             #   18_fragments.png, 18_sites.png

Plain data parallelism Allreduces the gradients after every step. DiLoCo (Douillard et
al. 2023; used to train INTELLECT-1 across continents) lets each dp replica -- a worker
-- train alone for H inner steps with its own optimizer, then averages what the workers
learned with one Allreduce of the parameters and applies it with an outer optimizer
(SGD with Nesterov momentum, eta 0.7, mu 0.9). The sections:

  1. the same model (an MLP of 4 blocks, float64) on the same data, four workers:
     DP, and DiLoCo at H = 1 (eta 1, mu 0), 4 and 16; each against one process, its
     loss, and the bytes it put on the wire;
  2. H = 1 with eta 1 and mu 0 IS data parallelism (to 1e-9: the mean of the parameters
     instead of the mean of the gradients);
  3. the wire bytes each step, measured against the formula: a ring Allreduce of the
     parameters, 2 (K-1)/K of them, on the steps that talk;
  4. streaming DiLoCo: P = 1, 2, 4 fragments at H = 16, the same bytes in all, the
     peak of a step about 1/P of the model;
  5. a worker is a mesh: K = 2 workers of tp 2, against one process;
  6. priced at real scale (the planner's `plan --sites`): Llama 3 70B over two sites
     joined by 100 Gb/s, the seconds a step spends on the slow link.

The code behind it: minipar/parallel/diloco.py (the workers, the outer step, the
fragments), minipar/run/diloco_train.py (`train_workers`), minipar/planner/diloco_cost.py
(docs/design.md "DiLoCo priced").
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.job import run_collectively, verdict
from minipar.core.byte_units import byte_unit, format_bytes
from minipar.core.memory import wire_elements
from minipar.parallel import diloco
from minipar.planner import diloco_cost, presets
from minipar.planner.memory_cost import Plan
from minipar.planner.search import RECOMPUTE, hardware, search
from minipar.planner.workloads import transformer
from minipar.run.results import relative_difference
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.teaching.ledger_tables import wire_bytes

K = 4                # workers: the dp replicas of a 4-rank job
STEPS = 64           # a multiple of every H below
MODEL = dict(model="mlp", layers=4, d_model=32, batch=64, lr=0.2, optimizer="sgd",
             steps=STEPS)
RUNS = {  # label -> the flags of `python -m minipar train` beyond MODEL
    "DP": {},
    "DiLoCo H=1 eta 1 mu 0": dict(outer="diloco", inner_steps=1, outer_lr=1.0,
                                  outer_momentum=0.0),
    "DiLoCo H=4": dict(outer="diloco", inner_steps=4),
    "DiLoCo H=16": dict(outer="diloco", inner_steps=16),
}
STREAMING = {f"P={p}": dict(outer="diloco", inner_steps=16, fragments=p) for p in (1, 2, 4)}


def say(*lines: str) -> None:
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(*lines, sep="\n", flush=True)


def tell(text: str, indent: str = "") -> None:
    """A sentence of prose, wrapped at 110 characters (rank 0)."""
    say(*textwrap.wrap(text, 110, initial_indent=indent, subsequent_indent=indent))


def runs_of(world: MPI.Comm, setups: dict[str, dict]) -> dict[str, dict] | None:
    """Train each setup (TrainConfig fields) on the world's ranks, then each one again in
    one process, the references shared out over the ranks (rank r runs setups r, r + 4,
    ...). Rank 0 gets, per setup: the losses, theta, the relative difference to one
    process, and every rank's wire bytes over dp at every step (the gradient sync, or the
    outer step's); the other ranks None."""
    cfgs = {label: TrainConfig(**fields).resolved(world.Get_size())
            for label, fields in setups.items()}
    out = {}
    for label, cfg in cfgs.items():
        result = train(cfg, world)
        if world.Get_rank() == 0:
            sizes = {"dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp, "pp": cfg.pp}
            wire = np.zeros((world.Get_size(), cfg.steps))   # rank x step
            if cfg.outer is None:    # plain DP: every step's ledger is the last step's
                for r in result.ledger:
                    if r["group"] == "dp":
                        wire[r["rank"], :] += wire_bytes(r, sizes)
            else:
                for r in result.extras["ledger_steps"]:
                    if r["group"] == "dp":
                        wire[r["rank"], r["step"] - 1] += wire_bytes(r, sizes)
            out[label] = dict(cfg=cfg, losses=result.losses, final=result.final, wire=wire,
                              fragment_sizes=result.extras.get("fragment_sizes"))
    mine = {}
    for i, (label, cfg) in enumerate(cfgs.items()):
        if i % world.Get_size() == world.Get_rank():
            ref = train_reference(cfg)
            mine[label] = (ref.losses, ref.final)
    gathered = world.gather(mine, root=0)
    if world.Get_rank() != 0:
        return None
    for label, (losses, final) in {k: v for part in gathered for k, v in part.items()}.items():
        r = out[label]
        r["rel"] = max([relative_difference(r["final"][k], v, floor=1e-12)
                        for k, v in final.items()]
                       + [relative_difference(r["losses"], losses)])
    return out


# ------------------------------------------------------------ 1. the four runs
def four_runs(world: MPI.Comm) -> dict[str, dict]:
    say(f"=== 1. DP and DiLoCo at H = 1, 4, 16: {STEPS} steps of the same batches, {K} workers")
    tell("the model: an MLP of 4 blocks (d 32, float64), SGD lr 0.2 inside each worker; DiLoCo's "
         "outer step Nesterov SGD with eta 0.7, mu 0.9 (the paper's), but at H = 1 eta 1, mu 0")
    runs = runs_of(world, {label: dict(MODEL, dp=K, **extra) for label, extra in RUNS.items()})
    if world.Get_rank() == 0:
        say("wire: the bytes one rank put on the wire over the whole run (ring Allreduce: "
            "2 (K-1)/K of the buffer)",
            f"{'run':>22}  {'loss first -> last':>18}  {'steps that talk':>15}  "
            f"{'wire per rank':>13}  against one process")
        for label, r in runs.items():
            talk = int(np.count_nonzero(r["wire"][0]))
            say(f"{label:>22}  {r['losses'][0]:8.3f} -> {r['losses'][-1]:6.3f}  {talk:>15}  "
                f"{format_bytes(r['wire'][0].sum()):>13}  rel {r['rel']:.1e} "
                f"{verdict(r['rel'] <= 1e-9)}")
        tell("(one task, one seed, toy size: a picture, not a benchmark -- here the outer "
             "momentum speeds up plain SGD, and H = 16 lets the workers drift apart for 16 steps)")
    return runs


# --------------------------------------------------------- 2. H = 1 is DP
def h1_is_dp(runs: dict[str, dict]) -> None:
    say("", "=== 2. H = 1, eta = 1, mu = 0 is data parallelism")
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    dp, h1 = runs["DP"], runs["DiLoCo H=1 eta 1 mu 0"]
    losses = relative_difference(h1["losses"], dp["losses"])
    final = max(relative_difference(h1["final"][k], v, floor=1e-12) for k, v in dp["final"].items())
    bitwise = all(np.array_equal(h1["final"][k], v) for k, v in dp["final"].items())
    same_wire = np.array_equal(h1["wire"], dp["wire"])
    say(f"losses: relative difference {losses:.1e}; final parameters {final:.1e} "
        f"({'bitwise equal' if bitwise else 'not bitwise'}) {verdict(max(losses, final) <= 1e-9)}",
        "  DP:     theta - lr (1/K) sum_k g_k            (the mean of the gradients)",
        "  DiLoCo: theta - (theta - (1/K) sum_k (theta - lr g_k))  (the mean of the parameters)",
        f"the same bytes on the wire every step (an Allreduce of as many numbers): "
        f"{verdict(same_wire)}")


# -------------------------------------------------------- 3. the bytes
def bytes_by_formula(runs: dict[str, dict]) -> None:
    say("", "=== 3. the bytes of every step and rank, measured against the formula")
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    params = sum(runs["DiLoCo H=4"]["fragment_sizes"][0])
    ring = wire_elements("Allreduce", params, K) * 8           # float64
    tell(f"the model: {params:,} parameters; one ring Allreduce of them over {K} workers puts "
         f"2 (K-1)/K x {params:,} x 8 bytes = {format_bytes(ring)} on each rank's wire")
    for label, r in runs.items():
        h = r["cfg"].inner_steps or 1
        formula = np.array([ring if (s + 1) % h == 0 else 0.0 for s in range(STEPS)])
        ok = all(np.allclose(r["wire"][rank], formula, rtol=1e-12, atol=0)
                 for rank in range(K))
        say(f"{label:>22}: every {h:>2} step(s) {format_bytes(ring)}, {STEPS // h:>2} times: "
            f"{format_bytes(formula.sum()):>9} in all, 1/{h} of DP's {verdict(ok)}")


# ------------------------------------------------------ 4. streaming
def streaming(world: MPI.Comm) -> dict[str, dict]:
    say("", "=== 4. streaming DiLoCo at H = 16: P = 1, 2, 4 fragments")
    tell("fragment p: blocks [p L/P, (p+1) L/P), the embedding and the head in fragment 0; "
         "fragment p talks after steps p H/P + H, p H/P + 2H, ...")
    runs = runs_of(world, {label: dict(MODEL, dp=K, **extra)
                           for label, extra in STREAMING.items()})
    if world.Get_rank() == 0:
        say(f"{'P':>4}  {'fragments (numbers)':>28}  {'talks after steps':>30}  "
            f"{'peak step':>10}  {'in all':>9}  formula / one process")
        for r in runs.values():
            p = r["cfg"].fragments
            sizes = r["fragment_sizes"][0]
            formula = np.array([wire_elements("Allreduce", diloco.dp_allreduce_elements(
                sizes, 16, p, s + 1), K) * 8 for s in range(STEPS)])
            ok = all(np.allclose(r["wire"][rank], formula, rtol=1e-12, atol=0)
                     for rank in range(K)) and r["rel"] <= 1e-9
            steps = [s + 1 for s in range(STEPS) if r["wire"][0][s]]
            shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
            say(f"{p:>4}  {str(sizes):>28}  {shown:>30}  {format_bytes(r['wire'][0].max()):>10}"
                f"  {format_bytes(r['wire'][0].sum()):>9}  rel {r['rel']:.1e} {verdict(ok)}")
        total = {label: r["wire"][0].sum() for label, r in runs.items()}
        tell("each fragment talks once per H steps, so a long run sends the same bytes whatever "
             "P; in these 64 steps the later fragments start later and talk once less: "
             f"{', '.join(format_bytes(v) for v in total.values())}. The peak step falls by "
             "about P -- fragment 0 is the largest: its blocks plus the embedding and head.")
    return runs


# ------------------------------------------------------ 5. a worker is a mesh
def worker_mesh(world: MPI.Comm) -> None:
    say("", "=== 5. a worker is a mesh: K = 2 workers, each tp 2 (H = 4, 16 steps)")
    r = (runs_of(world, {"mesh": dict(MODEL, dp=2, tp=2, outer="diloco", inner_steps=4,
                                      steps=16)}) or {}).get("mesh")
    if world.Get_rank() == 0:
        talk = [s + 1 for s in range(16) if r["wire"][0][s]]
        say(f"theta and losses against one process (2 one-process workers, the outer rule): "
            f"rel {r['rel']:.1e} {verdict(r['rel'] <= 1e-9)}")
        tell(f"each rank's dp Allreduce carries its tp half of the parameters, after steps "
             f"{talk}: {format_bytes(r['wire'][0].max())} each; inside a worker tp's own "
             "traffic runs every step, as on any tp mesh")


# ------------------------------------------------------- 6. at scale
def sites() -> list:
    say("", "=== 6. priced at real scale: Llama 3 70B, two sites joined by one 100 Gb/s link")
    tell("512 H100s, dp 16 x tp 8 x pp 4, 8 dp replicas in each site (inside a site 400 Gb/s "
         "per GPU); the planner's `plan --sites 2` (minipar/planner/diloco_cost.py)")
    w = transformer(presets.MODELS["llama3-70b"], 1024)
    hw = hardware(presets.CLUSTERS["h100"])
    found = search(w, hw, 512, Plan(1, sp=True), (0,), RECOMPUTE, dict(dp=16, tp=8, pp=4),
                   (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)))
    prices = diloco_cost.site_prices(w, hw, found.feasible, 2, 100.0,
                                     [(4, 1), (16, 1), (16, 4), (64, 4)])
    tell("link: seconds a step spends on the slow link, on average and on its worst step (the "
         f"model's {2 * w.params / 1e9:.0f} GB of bf16 numbers cross once each way per "
         "Allreduce); step: with the rest of the step priced (compute, pipeline, tp)")
    say(f"{'strategy':>17}  {'link GB/step':>12}  {'link s/step':>11}  {'worst step s':>12}  "
        f"{'step s':>7}  {'worst step s':>12}")
    for p in prices:
        say(f"{p.label:>17}  {p.average_bytes / 1e9:>12.2f}  {p.link_average:>11.3f}  "
            f"{p.link_worst:>12.3f}  {p.step_average:>7.3f}  {p.step_worst:>12.3f}")
    tell("DP waits on the link every step; DiLoCo waits 1/H as often, but the step that talks "
         "still waits for the whole model -- unless it streams (P = 4: a quarter of the blocks "
         "and the embedding and head). `python -m minipar plan ... --sites 2` prints the same "
         "table for any named plan.")
    return prices


def plot(folder: Path, runs: dict, streams: dict, prices: list) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    top = max(r["wire"][0].sum() for r in runs.values())
    factor, unit = byte_unit(top)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    styles = {"DP": dict(lw=3, alpha=0.5), "DiLoCo H=1 eta 1 mu 0": dict(ls="--", lw=1.5)}
    for label, r in runs.items():
        steps = np.arange(1, STEPS + 1)
        left.plot(steps, r["losses"], label=label, **styles.get(label, {}))
        right.step(steps, np.cumsum(r["wire"][0]) / factor, where="post", label=label,
                   **styles.get(label, {}))
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.set_title(f"the same batches, {K} workers (H = 1, eta 1, mu 0 lies on DP)")
    right.set_xlabel("step")
    right.set_ylabel(f"{unit} on the wire, one rank, so far")
    right.set_title("wire bytes (ring Allreduce), summed over the steps")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "18_loss_wire.png", dpi=110)
    plt.close(fig)

    factor, unit = byte_unit(max(r["wire"][0].max() for r in streams.values()))
    fig, axes = plt.subplots(len(streams), 1, figsize=(10, 5.5), sharex=True, sharey=True)
    for ax, (label, r) in zip(axes, streams.items()):
        ax.bar(np.arange(1, STEPS + 1), r["wire"][0] / factor, width=0.8,
               color="tab:blue")
        ax.set_ylabel(f"{unit}")
        ax.set_title(f"{label}: peak {format_bytes(r['wire'][0].max())}, "
                     f"in all {format_bytes(r['wire'][0].sum())}", fontsize=9)
    axes[-1].set_xlabel("step")
    fig.suptitle("streaming DiLoCo, H = 16: wire bytes of one rank at each step")
    fig.tight_layout()
    fig.savefig(folder / "18_fragments.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [p.label for p in prices]
    x = np.arange(len(prices))
    ax.bar(x - 0.2, [p.link_average for p in prices], 0.4, label="average step")
    ax.bar(x + 0.2, [p.link_worst for p in prices], 0.4, label="worst step")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("seconds on the 100 Gb/s link")
    ax.set_title("Llama 3 70B, dp 16 over two sites: a step's wait on the slow link (priced)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "18_sites.png", dpi=110)
    plt.close(fig)
    for name in ("18_loss_wire.png", "18_fragments.png", "18_sites.png"):
        print(f"figure: {folder / name}", flush=True)


def main() -> None:
    from minipar.settings.preflight import lesson_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write 18_*.png there")
    args = lesson_arguments(parser)
    world = MPI.COMM_WORLD
    if world.Get_size() != 4:
        raise SystemExit("run it on 4 ranks: mpiexec -n 4 python lessons/18_diloco.py")
    runs = four_runs(world)
    h1_is_dp(runs)
    bytes_by_formula(runs)
    streams = streaming(world)
    worker_mesh(world)
    prices = sites() if world.Get_rank() == 0 else []
    if args.plot is not None and world.Get_rank() == 0:
        plot(args.plot, runs, streams, prices)


if __name__ == "__main__":
    run_collectively(main)
