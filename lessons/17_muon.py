"""Lesson 17: Muon -- an optimizer that needs whole matrices, on a mesh that cuts them.

    mpiexec -n 4 python lessons/17_muon.py
    mpiexec -n 4 python lessons/17_muon.py --plot figures   # + 17_modes.png, 17_loss.png
    mpiexec -n 4 python lessons/17_muon.py --quick          # fewer steps

Muon (Keller Jordan 2024; Moonlight 2025) updates each weight matrix by its momentum
made orthogonal with a few Newton-Schulz iterations: X <- a X + (b A + c A A) X with
A = X X^T. SGD and Adam are rules on single numbers, so ZeRO can hand them any slice;
Muon's A mixes every row of the matrix with every other. The sections:

  1. why: on one process, Adam on two column halves of a matrix IS Adam on the whole
     (bitwise), Newton-Schulz on the halves is not; but A = X X^T is the sum of the
     halves' own X_i X_i^T, so an iteration split by columns needs one sum per step;
  2. Megatron-LM's three ways over dp 2 x tp 2 (the transformer, float64), each
     checked against one process: the bytes Muon adds to a step (the ledger, against
     AdamW's run on the same mesh), the time of its matrix phase, and the
     Newton-Schulz work summed over the ranks against one process's (redundant compute):
       duplicated     every rank holding a piece gathers the matrix and runs it;
       distributed    TP shards stay, the Gram matrix Allreduced over tp per iteration;
       layer-sharded  one home rank per matrix gathers it, runs it, sends the pieces back;
  3. the same three priced for Llama 3 70B on 1024 H100s (tp 8 x dp 128, ZeRO-1),
     with the planner's cluster numbers;
  4. Adam against Muon on the transformer at toy size: the loss curves (one process).

The code behind it: minipar/core/muon.py (the rule, the plan), minipar/parallel/
muon_mesh.py (the pieces over the mesh), docs/design.md "Muon".
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.job import run_collectively, verdict, wait_for_rank0
from minipar.core import muon, nn, timing
from minipar.core.optim import Adam
from minipar.planner import muon_cost, presets
from minipar.run.results import relative_difference
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.teaching.lines import print  # the builtin, a line wider than the page wrapped

MESH = dict(model="gpt", layers=2, d_model=64, heads=4, seq_len=16, vocab=32, batch=8,
            optimizer="muon", lr=0.02, dp=2, tp=2)
TOY = dict(model="gpt", layers=2, d_model=32, heads=4, seq_len=16, vocab=32, batch=16)
MODES = ("duplicated", "distributed", "layer-sharded")
TIMES: dict[str, object] = {"seconds": []}   # this rank's matrix phase, every step


def say(*lines: str) -> None:
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(*lines, sep="\n", flush=True)


# ------------------------------------------------------------------- 1. why
def why_whole(rng: np.random.Generator) -> None:
    """Adam shards, Newton-Schulz does not, the Gram matrix sums."""
    say("=== 1. an elementwise rule shards, a matrix rule does not (one process)")
    w, g = rng.standard_normal((16, 48)), rng.standard_normal((16, 48))
    whole, halves = w.copy(), [w[:, :24].copy(), w[:, 24:].copy()]
    Adam(0.01).step([whole], [g])
    Adam(0.01).step(halves, [g[:, :24], g[:, 24:]])   # two ranks, two column slices
    same = np.array_equal(whole, np.hstack(halves))
    say(f"Adam on the whole (16, 48) matrix vs on its two column halves: bitwise equal "
        f"{verdict(same)}")
    x = muon.orthogonalize(g, 5)
    split = np.hstack([muon.orthogonalize(g[:, :24], 5), muon.orthogonalize(g[:, 24:], 5)])
    apart = relative_difference(split, x)
    say(f"Newton-Schulz on the whole vs on each half alone: relative difference {apart:.2f} "
        f"(each half comes out orthogonal, the matrix does not) "
        f"{verdict(apart > 0.1, good='as expected')}")
    u = g / np.linalg.norm(g)
    gram = u[:, :24] @ u[:, :24].T + u[:, 24:] @ u[:, 24:].T   # one Allreduce of 16 x 16
    close = relative_difference(gram, u @ u.T)
    say(f"A = X X^T as the sum of the halves' X_i X_i^T: relative difference {close:.1e} "
        f"{verdict(close < 1e-14)}: so each half can run the iteration with one sum of a "
        "16 x 16 matrix per step, and the norm's one number (--muon-mode distributed)")


# --------------------------------------------------------------- 2. the modes
def timed_phase() -> None:
    """Time Muon's matrix phase (pieces gathered, iterations, pieces back) per step."""
    original = muon.Muon.orthogonalize_all

    def timed(self: muon.Muon, *args: object) -> dict:
        start = time.perf_counter()
        out = original(self, *args)
        TIMES["seconds"].append(time.perf_counter() - start)
        TIMES["flops"] = self.ns_flops
        return out
    muon.Muon.orthogonalize_all = timed


def muon_bytes(ledger: list[dict], baseline: list[dict], ranks: int) -> list[int]:
    """Per rank, the bytes Muon adds to the last step: its pieces sent point to point,
    and the Allreduce bytes over tp beyond the same mesh's AdamW run (the Gram sums)."""
    def tp_allreduce(records: list[dict], rank: int) -> int:
        return sum(r["bytes"] for r in records if r["rank"] == rank and r["group"] == "tp"
                   and r["op"] == "Allreduce")
    return [sum(r["bytes"] for r in ledger if r["rank"] == rank and r["op"] == "Isend")
            + tp_allreduce(ledger, rank) - tp_allreduce(baseline, rank)
            for rank in range(ranks)]


def modes_side_by_side(world: MPI.Comm, steps: int) -> dict[str, dict]:
    """Each mode on dp 2 x tp 2: exact, bytes, time, redundant work."""
    say("", "=== 2. the three modes on dp 2 x tp 2 (transformer, d = 64, float64), "
        f"{steps} steps, every one against one process")
    fields = dict(MESH, steps=steps)
    timed_phase()
    baseline = train(TrainConfig(**dict(fields, optimizer="adam", lr=0.003))
                     .resolved(world.Get_size()), world)
    ref = None
    if world.Get_rank() == 0:
        ref = train_reference(TrainConfig(**fields).resolved(1))
    wait_for_rank0(world)
    cfg = TrainConfig(**fields).resolved(1)
    shapes = {k: s for k, s in nn.canonical_shapes(cfg.model_config()).items()
              if muon.is_matrix(k, len(s))}
    one = sum(muon.ns_flops(s, s, 5) for s in shapes.values())
    out = {}
    for mode in MODES:
        TIMES["seconds"] = []
        result = train(TrainConfig(**dict(fields, muon_mode=mode)).resolved(world.Get_size()),
                       world)
        seconds = world.gather(list(TIMES["seconds"]))
        flops = world.gather(TIMES.get("flops", 0))
        if world.Get_rank() == 0:
            rel = max(relative_difference(result.final[k], v, floor=1e-12)
                      for k, v in ref.final.items())
            bytes_ = muon_bytes(result.ledger, baseline.ledger, world.Get_size())
            # every rank's every step: the slowest rank of a step is the step's wait
            steps_max = [max(step) for step in zip(*seconds)]
            out[mode] = {"bytes": bytes_, "seconds": steps_max, "work": sum(flops) / one,
                         "rel": rel}
    if world.Get_rank() == 0:
        say("matrix ms: Muon's matrix phase of a step on its slowest rank, the median of the "
            "steps (their min..max)")
        say(f"{'mode':>14}  {'bytes/rank':>11}  {'matrix ms':>40}  "
            f"{'Newton-Schulz work':>18}  against one process")
        for mode, m in out.items():
            spread = timing.Spread.of(m["seconds"])
            say(f"{mode:>14}  {max(m['bytes']):>11,}  {spread.text():>40}  "
                f"{m['work']:>17.1f}x  rel {m['rel']:.1e} {verdict(m['rel'] <= 1e-9)}")
        say(f"(times {timing.where(world.Get_size())[1:-1]}; "
            + timing.verdict({mode: m["seconds"] for mode, m in out.items()}) + ")")
        say("duplicated moves the other half of each matrix to each tp rank and runs every "
            "iteration on all 4 ranks (4x the work); distributed moves no piece but sums a "
            "d x d Gram matrix per iteration -- as large as a shard at this size, and 72 "
            "small Allreduces a step, each a wait for every rank of its group -- its "
            "products split over tp, its A A on every rank, all repeated over dp; "
            "layer-sharded runs each matrix once (1x) and pays a gather and a scatter.")
    return out


# ------------------------------------------------------------- 3. at scale
def llama_price() -> list[tuple[str, float, float, float]]:
    """The three modes for Llama 3 70B on 1024 H100s, tp 8 (in a node) x dp 128 (ZeRO-1):
    per GPU and step, the most bytes any GPU moves for Muon, their time on the links
    (tp over NVLink, dp over InfiniBand), and the most Newton-Schulz time (bf16 at
    peak). Momentum in fp32 (4 bytes), the iteration in bf16 (2 bytes) as torch's.
    The arithmetic is the planner's (planner/muon_cost.py), which `plan --optimizer
    muon` adds to a step."""
    model, cluster = presets.MODELS["llama3-70b"], presets.CLUSTERS["h100"]
    prices = muon_cost.muon_modes(model, model.layers, tp=8, dp=128,
                                  flops=cluster.flops * 1e12, tp_bw=cluster.intra_bw * 1e9,
                                  dp_bw=cluster.inter_bw * 1e9)
    return [(p.mode, p.bytes, p.wire_seconds, p.compute_seconds) for p in prices]


def at_scale() -> list[tuple[str, float, float, float]]:
    say("", "=== 3. priced for Llama 3 70B on 1024 H100s: tp 8 x dp 128, ZeRO-1, the "
        "worst GPU per step (planner/presets.py's H100: 989 TFLOP/s bf16, NVLink 450 GB/s, "
        "InfiniBand 50 GB/s each way)")
    rows = llama_price()
    say(f"{'mode':>14}  {'GB moved':>9}  {'wire s':>7}  {'Newton-Schulz s':>15}")
    for mode, moved, wire, compute in rows:
        say(f"{mode:>14}  {moved / 1e9:>9.2f}  {wire:>7.2f}  {compute:>15.3f}")
    say("duplicated gathers all 68 B matrix weights on every GPU: seconds of InfiniBand "
        "and of iterations; distributed keeps the tp shard but sums an 8192 x 8192 Gram "
        "matrix 5 times per matrix -- more bytes than the shards, over NVLink; "
        "layer-sharded pays only for its largest matrix (8192 x 28672), once, on one GPU: "
        "560 matrices on 1024 GPUs, the homes spread by longest-processing-time.")
    return rows


# ------------------------------------------------------------- 4. the curves
def loss_curves(world: MPI.Comm, steps: int) -> dict[str, list[float]]:
    say("", f"=== 4. Adam against Muon on the transformer at toy size (d = 32, 2 layers, "
        f"the copy task), one process, {steps} steps")
    curves = {}
    if world.Get_rank() == 0:
        for label, extra in (("Adam lr 0.003", dict(optimizer="adam", lr=0.003)),
                             ("Muon lr 0.05", dict(optimizer="muon", lr=0.05))):
            curves[label] = train_reference(TrainConfig(**TOY, steps=steps, **extra)
                                            .resolved(1)).losses
            say(f"{label:>15}: loss {curves[label][0]:.3f} -> {curves[label][-1]:.3f}")
        say("(--optimizer adam, no decay, against Muon with AdamW for its embeddings, "
            "norms and biases; each at a learning rate that suits it; one task, one seed, "
            "toy size: a picture, not a benchmark)")
    wait_for_rank0(world)
    return curves


def plot(folder: Path, modes: dict, rows: list, curves: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = list(modes)
    axes[0].bar(names, [max(m["bytes"]) / 1024 for m in modes.values()], color="tab:blue")
    axes[0].set_title("dp 2 x tp 2: Muon's KiB per rank and step")
    axes[1].bar(names, [m["work"] for m in modes.values()], color="tab:orange")
    axes[1].set_title("Newton-Schulz work / one process's")
    axes[2].bar([r[0] for r in rows], [r[2] + r[3] for r in rows], color="tab:green")
    axes[2].set_title("Llama 3 70B, 1024 H100: s per step")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(folder / "17_modes.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("the transformer at toy size, one process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "17_loss.png", dpi=110)
    plt.close(fig)
    print(f"figures: {folder}/17_modes.png, {folder}/17_loss.png", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write 17_*.png there")
    args = lesson_arguments(parser)
    world = MPI.COMM_WORLD
    if world.Get_size() != 4:
        raise SystemExit("run it on 4 ranks: mpiexec -n 4 python lessons/17_muon.py")
    why_whole(np.random.default_rng(0))
    modes = modes_side_by_side(world, 2)
    rows = at_scale()
    curves = loss_curves(world, 20 if args.quick else 80)
    if args.plot is not None and world.Get_rank() == 0:
        plot(args.plot, modes, rows, curves)


if __name__ == "__main__":
    run_collectively(main)
