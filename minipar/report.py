"""Turning the ledger into tables a learner can read.

What this file teaches: a ledger record says how big a buffer an operation was
defined on; what crosses the wire per rank depends on the algorithm. With ring
algorithms an Allreduce of N elements over n ranks sends 2(n-1)/n N from each
rank, an Allgather or Reduce_scatter (n-1)/n N (`memory.wire_elements`).
"""

from __future__ import annotations

from collections import defaultdict

from minipar.config import TrainConfig
from minipar.costmodel import rank_shape
from minipar.memory import wire_elements
from minipar.plan import minipar_workload, plan_of
from minipar.timemodel import ledger_of, traffic

# Mesh axis -> the flag that sets its size (edp is dp/ep).
_AXIS_SIZE = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep"}


def group_size(cfg: TrainConfig, group: str) -> int:
    """How many ranks a group of this axis has under `cfg`."""
    if group == "edp":
        return cfg.dp // cfg.ep
    if group == "world":
        return cfg.dp * cfg.tp * cfg.pp
    return getattr(cfg, _AXIS_SIZE[group])


def predicted_ledgers(cfg: TrainConfig) -> dict[int, dict[tuple[str, str], tuple[int, int]]]:
    """Every rank's ledger as the formulas predict it (minipar.timemodel, the planner's
    arithmetic): rank -> (group, op) -> (calls, elements)."""
    workload, plan, mesh = minipar_workload(cfg), plan_of(cfg), cfg.mesh_shape()
    return {rank: ledger_of(traffic(workload, plan, rank_shape(workload, plan,
                                                               mesh.coords(rank)["pp"])))
            for rank in range(mesh.world)}


def ledger_table(records: list[dict], cfg: TrainConfig) -> str:
    """One line per (group, op) for the busiest rank: calls, elements and bytes, the
    ring-algorithm wire volume, and what the formulas predict for that rank (the
    planner's cost model; Alltoallv elements follow the router, so only calls are
    predicted for them, and so do the tp Allreduces of split experts: --tp with --model
    moe sums the rows an expert rank received)."""
    predicted = predicted_ledgers(cfg)
    per: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        per[(r["group"], r["op"])].append(r)
    lines = [f"ledger of the last step ({len(records)} records from "
             f"{len({r['rank'] for r in records})} ranks; the busiest rank of each line)",
             f"{'group':>6} {'op':>15} {'rank':>4} {'calls':>6} {'elements':>10} "
             f"{'bytes':>10} {'wire bytes':>11}  predicted calls, elements"]
    for (group, op), rows in sorted(per.items()):
        worst = max(rows, key=lambda r: (r["bytes"], -r["rank"]))
        itemsize = worst["bytes"] / worst["elements"] if worst["elements"] else 0
        wire = wire_elements(op, worst["elements"], group_size(cfg, group)) * itemsize
        calls, elements = predicted[worst["rank"]].get((group, op), (None, None))
        if calls is None:
            verdict = "-"
        elif cfg.model == "moe" and cfg.tp > 1 and group == "edp":
            verdict = "- (experts split over tp: the planner's MoE keeps them whole)"
        elif op == "Alltoallv" or (cfg.model == "moe" and group == "tp"):
            verdict = f"{calls}, (router) {'ok' if calls == worst['calls'] else 'DIFFERS'}"
        else:
            same = (calls, elements) == (worst["calls"], worst["elements"])
            verdict = f"{calls}, {elements} {'ok' if same else 'DIFFERS'}"
        lines.append(f"{group:>6} {op:>15} {worst['rank']:>4} {worst['calls']:>6} "
                     f"{worst['elements']:>10} {worst['bytes']:>10} {wire:>11.0f}  {verdict}")
    if len(lines) == 2:
        lines.append("  (no communication: a mesh of one rank)")
    return "\n".join(lines)
