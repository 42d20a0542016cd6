"""Lesson 7: ZeRO, data parallelism that stops keeping N copies of the model states.

    mpiexec -n 4 python lessons/07_zero.py
    mpiexec -n 8 python lessons/07_zero.py --optimizer sgd
    mpiexec -n 4 python lessons/07_zero.py --plot figures   # + 07_memory.png, 07_ledger.png

Data parallelism keeps every parameter, gradient and Adam state on every rank.
ZeRO (Rajbhandari et al. 2020) gives each of the N ranks a 1/N slice of them:
stage 1 the optimizer state, stage 2 the gradients too, stage 3 the parameters
too. This lesson trains minipar's model with --zero 0, 1, 2, 3 and prints:

1. the bytes each rank holds after a step, measured (`nbytes` of its arrays),
   beside ZeRO's formulas (memory.py); minipar runs float64 with no master
   copy, so a parameter costs 8 + 8 bytes and Adam's K is 16 (m and v);
2. what each rank sent in the last step, from the ledger, beside the paper's
   count: DP = ZeRO-1 = ZeRO-2 = 2 (N-1)/N Psi on the wire, ZeRO-3 = 3 (N-1)/N Psi;
3. that every stage ends at the same parameters as one process;
4. the paper's worked example by the same formulas: 7.5 B parameters on 64
   GPUs with mixed-precision Adam (2 + 2 + K bytes, K = 12): 120 GB per GPU
   for DP, 31.4 with P_os, 16.6 with P_os+g, 1.9 with P_os+g+p.

The code behind it: minipar/parallel/zero.py and minipar/core/memory.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.job import run_collectively, verdict
from minipar.core import nn
from minipar.core.byte_units import KiB
from minipar.core.memory import (
    ModelStates,
    optimizer_bytes_per_param,
    paper_example,
    shard_counts,
    wire_elements,
    wire_formula,
    zero_formula,
)
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments

NAMES = ["DP (stage 0)", "P_os (1)", "P_os+g (2)", "P_os+g+p (3)"]


def row(cells: list[str]) -> str:
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, (13, 10, 10, 10, 10, 10)))


def memory_table(measured: list[list[ModelStates]], psi: int, n: int, optimizer: str) -> None:
    k = optimizer_bytes_per_param(optimizer, 8)
    print(f"\n=== 1. model states per rank, KiB (1 KiB = 1024 bytes): Psi = {psi} parameters, "
          f"N = {n}, float64: p = g = 8 bytes, K = {k}", flush=True)
    uneven = psi % n != 0
    print(row(["", "params", "grads", "optimizer", "total", "formula"]) + "  all ranks")
    for stage, ranks in enumerate(measured):
        mine = ranks[0]
        formula = zero_formula(psi, n, stage, 8, 8, k)
        same = all(r.total == formula.total for r in ranks)
        print(row([NAMES[stage]] + [f"{v / KiB:.3f}" for v in
                                    (mine.params, mine.grads, mine.optimizer, mine.total)]
                  + [f"{formula.total / KiB:.3f}"])
              + ("  = formula" if same else "  differ (uneven slices)"), flush=True)
    if uneven:
        counts = shard_counts(psi, n)
        print(f"(rank 0's numbers; N does not divide Psi, so slices hold {counts[0]} or "
              f"{counts[-1]} parameters: the ranks together hold exactly Psi)", flush=True)


def ledger_table(ledgers: list[list[dict]], psi: int, n: int) -> None:
    print(f"\n=== 2. communication of the last step on rank 0 (dp group of {n})", flush=True)
    for stage, records in enumerate(ledgers):
        mine = [r for r in records if r["rank"] == 0 and r["group"] == "dp"]
        wire = sum(wire_elements(r["op"], r["elements"], n) for r in mine)
        ops = ", ".join(f"{r['op']} {r['elements']} ({r['calls']} calls)" for r in mine)
        expect = wire_formula(psi, n, stage)
        print(f"{NAMES[stage]:>13}: {ops}\n{'':>13}  on the wire {wire:.0f} elements = "
              f"{wire / psi:.4f} Psi; the paper: {3 if stage == 3 else 2} (N-1)/N Psi = "
              f"{expect:.0f} -> {verdict(round(wire) == round(expect), 'matches', 'DIFFERS')}",
              flush=True)


def paper_table() -> None:
    print("\n=== 4. the paper's example: Psi = 7.5 B, N = 64, mixed-precision Adam "
          "(2 + 2 + 12 bytes per parameter),\nin the paper's decimal GB (1 GB = 1e9 bytes)",
          flush=True)
    print(row(["", "params GB", "grads GB", "optim GB", "total GB"]))
    for stage, states in enumerate(paper_example()):
        print(row([NAMES[stage]] + [f"{v / 1e9:.1f}" for v in
                                    (states.params, states.grads, states.optimizer,
                                     states.total)]), flush=True)


def figures(measured: list[list[ModelStates]], ledgers: list[list[dict]], psi: int, n: int,
            optimizer: str, folder: Path) -> None:
    """Rank 0: every rank's bytes per stage beside the formula, and each stage's ledger."""
    from minipar.comm.mesh import MeshShape
    from minipar.teaching.ledger_tables import group_sizes
    from minipar.teaching.plots import ledger_figure, memory_figure, save

    k = optimizer_bytes_per_param(optimizer, 8)
    formulas = {name: zero_formula(psi, n, stage, 8, 8, k) for stage, name in enumerate(NAMES)}
    print("figure:", save(memory_figure(
        dict(zip(NAMES, measured)), formulas, title=f"model states on each of {n} ranks, "
        f"Psi = {psi}, {optimizer}: measured (bars) and ZeRO's formula (lines)"),
        folder / "07_memory.png"), flush=True)
    print("figure:", save(ledger_figure(
        dict(zip(NAMES, ledgers)), group_sizes(MeshShape(dp=n)),
        f"the dp axis in the last step, dp = {n}, Psi = {psi} x 8 bytes = {8 * psi / 1024:.0f} "
        f"KiB: DP's Allreduce puts 2(N-1)/N Psi on the wire, ZeRO-1/2 (N-1)/N Psi each way, "
        f"ZeRO-3 (N-1)/N Psi three times (the paper's 2 Psi and 3 Psi)"),
        folder / "07_ledger.png"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    world = MPI.COMM_WORLD
    n = world.Get_size()
    # 8 classes: Psi = 34472, which 2, 4 and 8 ranks divide (try 3 ranks for uneven slices)
    base = dict(layers=4, d_in=16, d_model=32, classes=8, batch=16 * n, steps=2,
                optimizer=args.optimizer)
    measured, ledgers, finals = [], [], []
    for stage in range(4):
        cfg = TrainConfig(**base, dp=n, zero=stage).resolved(n)
        result = train(cfg, world)
        measured.append(world.gather(result.extras["memory"]))  # every rank's bytes -> 0
        ledgers.append(result.ledger)
        finals.append(result.final)
    if world.Get_rank() != 0:
        return
    psi = sum(int(np.prod(s)) for s in nn.canonical_shapes(cfg.model_config()).values())
    memory_table(measured, psi, n, args.optimizer)
    ledger_table(ledgers, psi, n)
    one = train_reference(TrainConfig(**base).resolved(1)).final
    print("\n=== 3. final parameters against one process (max relative difference)")
    for stage, final in enumerate(finals):
        worst = max(float(np.max(np.abs(final[k] - v)) / np.max(np.abs(v))) for k, v in one.items())
        print(f"{NAMES[stage]:>13}: {worst:.1e} -> {verdict(worst <= 1e-9)}", flush=True)
    paper_table()
    if args.plot:
        figures(measured, ledgers, psi, n, args.optimizer, args.plot)


if __name__ == "__main__":
    run_collectively(main)
