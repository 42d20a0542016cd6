"""Turning the ledger into tables a learner can read.

What this file teaches: a ledger record says how big a buffer an operation was
defined on; what crosses the wire per rank depends on the algorithm. With ring
algorithms an Allreduce of N elements over n ranks sends 2(n-1)/n N from each
rank, an Allgather or Reduce_scatter (n-1)/n N (`memory.wire_elements`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from minipar.comm.mesh import MeshShape
from minipar.core.memory import wire_elements
from minipar.planner.memory_cost import rank_shape
from minipar.planner.time_cost import ledger_of, traffic
from minipar.planner.workloads import minipar_workload, plan_of
from minipar.settings.config import TrainConfig

# Mesh axis -> the flag that sets its size (edp is dp/ep).
_AXIS_SIZE = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "cp": "cp"}
AXES = ["dp", "tp", "pp", "ep", "edp", "cp", "world"]  # the ledger's group names, mesh order


def group_size(cfg: TrainConfig, group: str) -> int:
    """How many ranks a group of this axis has under `cfg`."""
    if group == "edp":  # with context parallelism: every cp coordinate's too
        return cfg.dp // cfg.ep * cfg.cp
    if group == "dp":   # the replicas of a weight: dp x cp ranks (mesh.py)
        return cfg.dp * cfg.cp
    if group == "world":
        return cfg.dp * cfg.cp * cfg.tp * cfg.pp
    return getattr(cfg, _AXIS_SIZE[group])


RECEIVES = ("Recv", "Irecv")  # the sender's record counts the message; the receiver puts none


def group_sizes(shape: MeshShape) -> dict[str, int]:
    """Ranks per group of each mesh axis, by the ledger's group names: dp, cp, tp, pp,
    ep, edp (the dp ranks that hold the same experts, dp/ep) and world. With context
    parallelism the gradient sync runs over the dp x cp replicas, which the ledger
    names `dp` (and `edp`): those groups count their cp ranks too."""
    return {"dp": shape.dp * shape.cp, "cp": shape.cp, "tp": shape.tp, "pp": shape.pp,
            "ep": shape.ep, "edp": shape.dp // shape.ep * shape.cp, "world": shape.world}


def wire_bytes(record: dict, sizes: Mapping[str, int]) -> float:
    """Bytes one ledger record's rank put on the wire, by the ring formulas
    (`memory.wire_elements`: Allreduce 2(N-1)/N of the buffer, Allgather and
    Reduce_scatter (N-1)/N, Alltoall(v) (N-1)/N, Send the message; a receive 0).
    `sizes` maps the record's group to its rank count (`group_sizes`)."""
    if record["op"] in RECEIVES or not record["elements"]:
        return 0.0
    itemsize = record["bytes"] / record["elements"]
    return wire_elements(record["op"], record["elements"], sizes[record["group"]]) * itemsize


def sent_per_axis(records: Sequence[dict], sizes: Mapping[str, int]) -> dict[str, float]:
    """Bytes the busiest rank of each axis put on the wire in the step (`wire_bytes`,
    summed over its operations on that axis), axes in mesh order: dp, tp, pp, ep, edp."""
    per_axis: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        if r["op"] not in RECEIVES:
            per_axis[r["group"]][r["rank"]] += wire_bytes(r, sizes)
    return {axis: max(per_axis[axis].values()) for axis in
            sorted(per_axis, key=lambda a: AXES.index(a) if a in AXES else len(AXES))}


def predicted_ledgers(cfg: TrainConfig) -> dict[int, dict[tuple[str, str], tuple[int, int]]]:
    """Every rank's ledger as the formulas predict it (minipar.planner.time_cost, the planner's
    arithmetic): rank -> (group, op) -> (calls, elements)."""
    workload, plan, mesh = minipar_workload(cfg), plan_of(cfg), cfg.mesh_shape()
    out = {rank: ledger_of(traffic(workload, plan, rank_shape(workload, plan,
                                                              mesh.coords(rank)["pp"])))
           for rank in range(mesh.world)}
    if cfg.mixed == "fp16" and mesh.world > 1:   # the loss scaler's found_inf vote: one
        for ledger in out.values():              # MAX-Allreduce of one flag a step
            ledger[("world", "Allreduce")] = (1, 1)   # (parallel/mixed.py)
    return out


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
        wire = wire_bytes(worst, {group: group_size(cfg, group)})  # a receive: 0
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
