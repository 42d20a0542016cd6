"""Lesson 3: expert parallelism. 64 experts on 8 ranks, 8 each; tokens travel by Alltoall.

The source text's example (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021):
an MoE layer with 64 experts on 8 GPUs keeps 8 experts per GPU instead of copying the
model; a router sends each token to its top-k experts, wherever they live. Here one MoE
block runs on 8 ranks (dp=8: 32 tokens each; ep=8: rank j holds experts 8j..8j+7):

  1. who sends how many token rows to whom: the 8x8 matrix of the dispatch Alltoallv;
  2. the expert load: how many assignments each expert got, as a text histogram;
  3. capacity: each expert takes at most ceil(c k B / E) assignments, the rest dropped;
  4. the same block in one process: outputs, aux loss and every gradient agree;
  5. the ledger: the Alltoallv volume beside k x tokens x d per direction.

Run it: `mpiexec -n 8 python lessons/03_expert_parallel.py` (add `--plot DIR` for the
expert-load figures, 03_expert_load*.png)
(a whole training run: `mpiexec -n 8 python -m minipar train --model moe --dp 8 --ep 8
--experts 64 --check`).
"""

import argparse
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar import autograd as ag
from minipar import nn
from minipar.comm import Ledger
from minipar.log import run_collectively, verdict
from minipar.mesh import Mesh, MeshShape
from minipar.parallel.expert_parallel import ExpertParallelBlock, expected_alltoallv_elements
from minipar.results import relative_difference

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
EXPERTS, TOP_K, D_MODEL, TOKENS, CAPACITY = 64, 2, 16, 256, 1.0


def say(*lines: str) -> None:
    """Print from rank 0 only."""
    if rank == 0:
        print(*lines, sep="\n", flush=True)


def config(capacity: float | None) -> nn.ModelConfig:
    return nn.ModelConfig(model="moe", layers=1, d_in=8, d_model=D_MODEL, experts=EXPERTS,
                          top_k=TOP_K, expert_d_ff=2 * D_MODEL, capacity_factor=capacity)


def inputs() -> tuple[np.ndarray, np.ndarray]:
    """The residual stream h (B, d) entering the block, the same on every rank, and a
    fixed random R (B, d) so that loss = mean_b (out_b . R_b) + aux has a gradient.
    A shared direction in h makes tokens like the same experts, as real tokens do."""
    rng = np.random.default_rng(3)
    h = rng.normal(size=(TOKENS, D_MODEL)) + 0.7 * rng.normal(size=D_MODEL)
    return h, rng.normal(size=(TOKENS, D_MODEL))


def run_block(cfg: nn.ModelConfig, mesh: Mesh, full: dict, h: np.ndarray, r: np.ndarray
              ) -> list | None:
    """Forward and backward of the EP block on this rank's rows; gather to rank 0."""
    b = TOKENS // mesh.dp.size
    rows = slice(mesh.coords["dp"] * b, (mesh.coords["dp"] + 1) * b)
    block = ExpertParallelBlock(full, 0, cfg, mesh)
    x = ag.Tensor(h[rows], requires_grad=True)
    mesh.ledger.reset()
    out, aux = block(x)
    loss = (out * r[rows]).sum() * (1.0 / b) + aux   # this rank's local mean, as in training
    loss.backward()
    mesh.ledger.enabled = False  # what follows is for printing, not part of the model
    grads = {p.name: p.grad for p in block.parameters()}
    mine = (out.data, aux.item(), x.grad, grads, block.last_stats,
            mesh.ledger.total("Alltoallv", "ep"))
    gathered = mesh.world.gather(mine)  # every rank's results -> rank 0
    mesh.ledger.enabled = True
    return gathered


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return relative_difference(a, b)


def compare(cfg: nn.ModelConfig, full: dict, h: np.ndarray, r: np.ndarray,
            gathered: list) -> None:
    """The single-process MoEBlock on all B tokens against what the 8 ranks computed.
    Each rank's gradients are of its local mean loss: summed over the ranks holding a
    weight and divided by dp, as the data-parallel step does."""
    reference = nn.MoEBlock(full, 0, cfg)
    x = ag.Tensor(h, requires_grad=True)
    out, aux = reference(x)
    ((out * r).sum() * (1.0 / TOKENS) + aux).backward()
    outs, auxes, x_grads, grads = list(zip(*gathered))[:4]
    summed: dict[str, np.ndarray] = {}
    for rank_grads in grads:
        for name, g in rank_grads.items():
            summed[name] = summed.get(name, 0.0) + g / size
    worst = max(rel(summed[p.name], p.grad) for p in reference.parameters())
    diffs = {"outputs": rel(np.concatenate(outs), out.data),
             "aux": max(abs(a - aux.item()) for a in auxes) / aux.item(),
             "grads": worst, "x_grad": rel(np.concatenate(x_grads) / size, x.grad)}
    say(f"  outputs   (B, d)            max rel diff {diffs['outputs']:.2e}",
        f"  aux loss  {aux.item():.6f}         max rel diff {diffs['aux']:.2e}",
        f"  gradients ({len(summed)} tensors)   max rel diff {worst:.2e}",
        f"  input grad (B, d)           max rel diff {diffs['x_grad']:.2e}",
        f"  -> {verdict(max(diffs.values()) <= 1e-9)} (tolerance 1e-9)")


def show_dispatch(stats: list[dict], note: str = "") -> None:
    """The dispatch Alltoallv as a matrix: row i = what rank i sends to each rank."""
    say("tokens sent from rank (row) to rank (column), each row = one token copy of d floats:",
        "            " + "".join(f"{j:>6}" for j in range(size)) + " |  sent")
    for i, s in enumerate(stats):
        say(f"  from rank {i}:" + "".join(f"{n:>6}" for n in s["sent"])
            + f" | {sum(s['sent']):>5}")
    say("  received:   " + "".join(f"{sum(s['received']):>6}" for s in stats) + note)


def show_load(s: dict) -> None:
    """How many assignments each expert got, grouped by the rank that holds it."""
    routed = np.array(s["routed"])
    per = EXPERTS // size
    say("", f"expert load: assignments per expert (mean {routed.mean():.0f}, "
        f"max {routed.max()}, imbalance max/mean {s['imbalance']:.2f})")
    for j in range(size):
        counts = routed[j * per:(j + 1) * per]
        say(f"  rank {j} experts {j * per:>2}-{(j + 1) * per - 1:>2}: "
            + " ".join(f"{c:>3}" for c in counts) + f"  | {counts.sum():>4} "
            + "#" * int(round(counts.sum() / 4)))
    say(f"  histogram: how many experts received n assignments (mean {routed.mean():.0f})")
    edges = [0, 1, 5, 9, 17, 33, 65, routed.max() + 1]
    for low, high in zip(edges[:-1], edges[1:]):
        experts = int(((routed >= low) & (routed < high)).sum())
        label = f"{low}" if high == low + 1 else f"{low}-{high - 1}"
        say(f"    n = {label:>7}: {experts:>3} " + "*" * experts)


def plot_load(stats: dict, capacity: float | None, folder: Path) -> None:
    """Rank 0: the load of the block per expert and per rank, as a figure."""
    from minipar.plots import save
    from minipar.plots_load import expert_load_figure

    name = "no capacity" if capacity is None else f"capacity factor {capacity}"
    path = save(expert_load_figure(stats, f"{EXPERTS} experts on {size} ranks, top-{TOP_K}, "
                                          f"{TOKENS} tokens: {name}"),
                folder / f"03_expert_load{'' if capacity is None else '_capacity'}.png")
    say(f"figure: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = parser.parse_args()
    if size != 8:
        say("run with 8 ranks: mpiexec -n 8 python lessons/03_expert_parallel.py")
        sys.exit(2)
    mesh = Mesh(MeshShape(dp=8, ep=8), comm, Ledger())
    h, r = inputs()
    say(f"{EXPERTS} experts on {size} ranks, {EXPERTS // size} each; {TOKENS} tokens, "
        f"{TOKENS // size} per rank; top-{TOP_K} routing; d={D_MODEL}", "")
    for capacity in (None, CAPACITY):
        cfg = config(capacity)
        full = nn.init_params(cfg, seed=0)
        gathered = run_block(cfg, mesh, full, h, r)
        if rank != 0:
            continue
        stats = [g[4] for g in gathered]
        if capacity is None:
            show_dispatch(stats, f"   (each rank sends {TOKENS // size} tokens x k={TOP_K}"
                          f" = {TOP_K * TOKENS // size} rows; the diagonal stays home)")
            show_load(stats[0])
        else:
            s = stats[0]
            say("", f"capacity factor {capacity}: each expert takes at most "
                f"ceil({capacity} x {TOP_K} x {TOKENS} / {EXPERTS}) = {s['limit']} "
                "assignments, in global token order",
                f"  dropped by capacity: {s['dropped']} of {TOP_K * TOKENS} assignments "
                f"(a dropped token slot adds 0: the residual carries the token)",
                "  dropped on each rank (at the source, never sent; later ranks hold later "
                "tokens, which find their experts full): "
                + " ".join(str(g[4]["dropped_here"]) for g in gathered),
                "  over the limit: " + ", ".join(
                    f"e{e} {n}->{s['limit']}" for e, n in enumerate(s["routed"]) if n > s["limit"]))
            show_dispatch(stats)
        kept = sum(sum(g[4]["sent"]) for g in gathered)
        moved = sum(g[5] for g in gathered)
        say("", f"ledger: Alltoallv elements (all ranks, forward+backward): {moved} = "
            f"4 x kept {kept} x d {D_MODEL}"
            + (f"  (= 4 x k x tokens x d: {TOP_K} x {TOKENS} x {D_MODEL} per direction)"
               if capacity is None else ""),
            f"  formula agrees: {moved == expected_alltoallv_elements(kept, D_MODEL)}", "",
            f"one process, same block{' with capacity' if capacity else ''}:")
        compare(cfg, full, h, r, gathered)
        say("")
        if args.plot:
            plot_load(stats[0], capacity, args.plot)
    mesh.free()


if __name__ == "__main__":
    run_collectively(main)
