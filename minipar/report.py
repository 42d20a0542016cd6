"""Turning the ledger into tables a learner can read.

What this file teaches: a ledger record says how big a buffer an operation was
defined on; what crosses the wire per rank depends on the algorithm. With ring
algorithms an Allreduce of N elements over n ranks sends 2(n-1)/n N from each
rank, an Allgather or Reduce_scatter (n-1)/n N (`comm.wire_elements`).
"""

from __future__ import annotations

from collections import defaultdict

from minipar.config import TrainConfig

# Mesh axis -> the flag that sets its size (edp is dp/ep).
_AXIS_SIZE = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep"}


def group_size(cfg: TrainConfig, group: str) -> int:
    """How many ranks a group of this axis has under `cfg`."""
    if group == "edp":
        return cfg.dp // cfg.ep
    if group == "world":
        return cfg.dp * cfg.tp * cfg.pp
    return getattr(cfg, _AXIS_SIZE[group])


def ledger_table(records: list[dict], cfg: TrainConfig) -> str:
    """One line per (group, op): calls, elements and bytes per rank (max over ranks),
    and the ring-algorithm wire volume per rank."""
    from minipar.comm import wire_elements

    per: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        per[(r["group"], r["op"])].append(r)
    lines = [f"ledger of the last step ({len(records)} records from "
             f"{len({r['rank'] for r in records})} ranks)",
             f"{'group':>6} {'op':>15} {'ranks':>5} {'calls/rank':>10} {'elements/rank':>14} "
             f"{'bytes/rank':>12} {'wire bytes/rank':>16}"]
    for (group, op), rows in sorted(per.items()):
        worst = max(rows, key=lambda r: r["bytes"])
        itemsize = worst["bytes"] / worst["elements"] if worst["elements"] else 0
        wire = wire_elements(op, worst["elements"], group_size(cfg, group)) * itemsize
        lines.append(f"{group:>6} {op:>15} {len(rows):>5} {worst['calls']:>10} "
                     f"{worst['elements']:>14} {worst['bytes']:>12} {wire:>16.0f}")
    if len(lines) == 2:
        lines.append("  (no communication: a mesh of one rank)")
    return "\n".join(lines)
