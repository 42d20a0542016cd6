"""The load of an MoE block, per microbatch: what the expert-parallel block
(parallel/expert_parallel.py) keeps in `last_stats` and `train` returns as
`extras["expert_load"]` (docs/design.md: the routing ledger). No communication: the
counts are the ones the block already summed over dp for the aux loss.

Lesson 03 draws them: `mpiexec -n 8 python lessons/03_expert_parallel.py --plot DIR`.
"""

from __future__ import annotations

import numpy as np

from minipar.core import nn
from minipar.core import routing as moe_routing


def load_stats(counts: np.ndarray, limit: int | None, kept_here: np.ndarray,
               send: np.ndarray, recv: np.ndarray) -> dict:
    """Load of one microbatch: global per expert and per ep coordinate, local per rank.

    routed[e]  assignments that chose e (all dp ranks); kept[e] = min(routed[e], limit),
    since capacity keeps the first `limit` in global order; dropped = their difference;
    rank_load[j] = kept assignments for the experts of ep coordinate j (all ep groups);
    imbalance = max/mean of routed (1.0 is perfect balance); sent[j] / received[i] =
    rows this rank sends to / receives from ep rank j / i in the dispatch Alltoallv."""
    kept = counts if limit is None else np.minimum(counts, limit)
    rank_load = kept.reshape(send.shape[0], -1).sum(axis=1)
    mean = counts.mean()
    return {"routed": counts.tolist(), "kept": kept.tolist(),
            "dropped": int(counts.sum() - kept.sum()), "limit": limit,
            "dropped_here": int(kept_here.size - kept_here.sum()),
            "rank_load": rank_load.tolist(),
            "imbalance": float(counts.max() / mean) if mean > 0 else 1.0,
            "rank_imbalance": float(rank_load.max() / rank_load.mean())
            if rank_load.sum() > 0 else 1.0,
            "sent": send.sum(axis=1).tolist(), "received": recv.sum(axis=1).tolist()}


def group_stats(token_of: np.ndarray, expert_of: np.ndarray, kept: np.ndarray, tokens: int,
                cfg: nn.ModelConfig, ep: int) -> dict:
    """The routing ledger of one microbatch on this rank: the groups are node-limited
    routing's G groups (or, without them, the ep ranks: one group per node). Per group,
    `tokens_to_group[g]` = my tokens sending it at least one row through the dispatch
    Alltoallv, `rows_to_group[g]` = the rows themselves; `most_groups` = the most groups
    any one token reaches (at most --route-top-groups when node-limited)."""
    groups = cfg.route_groups if cfg.route_groups > 1 else ep
    ids = np.flatnonzero(kept)
    reached = moe_routing.groups_reached(token_of[ids], expert_of[ids], tokens,
                                         cfg.experts, groups)
    per = cfg.experts // groups
    return {"groups": groups,
            "tokens_to_group": reached.sum(axis=0).tolist(),
            "rows_to_group": np.bincount(expert_of[ids] // per, minlength=groups).tolist(),
            "most_groups": int(reached.sum(axis=1).max()) if tokens else 0}


def expected_alltoallv_elements(kept_assignments: int, d_model: int) -> int:
    """Alltoallv elements of one block and microbatch, summed over all ranks and both
    passes: each kept (token, slot) row of d crosses four times (dispatch and combine
    forward, their conjugates backward), k x tokens x d per direction without drops.
    (Each rank's own rows count too: the ledger records what a rank hands to MPI.)"""
    return 4 * kept_assignments * d_model
