"""Capacity (`--capacity-factor c`): an expert takes at most ceil(c k B / E) assignments
of a microbatch, the first ones in the GLOBAL token order (docs/design.md, "The
reference model"), as one process keeps them (GShard, Lepikhin et al. 2020; Switch,
Fedus et al. 2021). A dropped assignment is never sent: it contributes 0, the residual
carries its token.

Tokens are split over the dp ranks, so "the first ones" needs what the earlier ranks
routed: an exclusive prefix sum of the per-expert counts (Exscan over dp,
`within_capacity`). Under context parallelism the positions of a row are spread over
cp and a rank's tokens are no contiguous run of that order; every rank's routing is
gathered instead (`within_capacity_in_global_order`).

Run it: `mpiexec -n 4 python -m minipar train --model moe --dp 4 --ep 2
--capacity-factor 1.0 --check`.
"""

from __future__ import annotations

import numpy as np

from minipar.comm.collectives import Group
from minipar.core import nn
from minipar.parallel import context_parallel


class Capacity:
    """The block's capacity layer: `kept(expert_of, rows)` says which of my (token, slot)
    assignments survive, and the limit it applied (None: every one)."""

    def __init__(self, cfg: nn.ModelConfig, dp_group: Group,
                 layout: context_parallel.TokenLayout | None = None) -> None:
        self.cfg, self.dp_group, self.layout = cfg, dp_group, layout

    def kept(self, expert_of: np.ndarray, rows: int) -> tuple[np.ndarray, int | None]:
        """My `rows` tokens' assignments (b k,) -> kept (b k,) bool, and the limit."""
        cfg = self.cfg
        tokens = rows * self.dp_group.size                          # the global microbatch
        limit = nn.capacity(cfg.capacity_factor, cfg.top_k, tokens, cfg.experts)
        if self.layout is None:
            return within_capacity(expert_of, cfg.experts, limit, self.dp_group), limit
        # positions spread over cp: the global order from everyone's routing
        mine, every = self.layout.tokens(rows)
        return within_capacity_in_global_order(expert_of, cfg.experts, limit, self.dp_group,
                                               mine, every), limit


def within_capacity(expert_of: np.ndarray, experts: int, limit: int | None,
                    dp_group: Group) -> np.ndarray:
    """Which local assignments survive capacity, decided in GLOBAL token order.

    The tokens of dp rank r come after those of ranks 0..r-1, so an assignment of mine
    is kept if its expert took fewer than `limit` assignments before it: those of the
    earlier ranks (an exclusive prefix sum, Exscan) plus my own earlier ones. This holds
    even when ep < dp and the earlier tokens went to another replica of the expert: the
    limit is per microbatch of the global batch, as in one process."""
    if limit is None:
        return np.ones(expert_of.shape, dtype=bool)
    mine = np.bincount(expert_of, minlength=experts)          # (E,) my assignments
    earlier = np.zeros_like(mine)
    if dp_group.size > 1:
        # (E,) counts of every dp rank -> on rank r, the sum over ranks 0..r-1
        dp_group.Exscan(mine, earlier)
        if dp_group.rank == 0:
            earlier[:] = 0  # MPI leaves rank 0's Exscan result undefined
    return nn.keep_within_capacity(expert_of, experts, limit, already=earlier)


def within_capacity_in_global_order(expert_of: np.ndarray, experts: int, limit: int | None,
                                     group: Group, mine: np.ndarray,
                                     others: list[np.ndarray]) -> np.ndarray:
    """Which of my (token, slot) assignments survive capacity, in GLOBAL token order
    (row, then position, then slot) when the positions of a row are spread over cp.

    A rank's tokens are not one contiguous run of that order any more, so a prefix count
    cannot say what came before. Every rank's routing (k small ints per token) is
    gathered instead; `others[g]` are the global token indices of dp_cp rank g
    (`mine` = mine), so each rank rebuilds the whole microbatch's order and keeps its own.
    """
    if limit is None:
        return np.ones(expert_of.shape, dtype=bool)
    top_k = expert_of.size // mine.size
    routed = np.empty((group.size, expert_of.size), dtype=np.int64)
    group.Allgather(expert_of.astype(np.int64), routed)  # my expert ids -> every rank
    slots = np.arange(top_k)
    where = np.concatenate([(t[:, None] * top_k + slots).ravel() for t in others])
    everything = np.empty(where.size, dtype=np.int64)
    everything[where] = routed.ravel()                       # global assignment order
    kept = nn.keep_within_capacity(everything, experts, limit)
    return kept[(mine[:, None] * top_k + slots).ravel()]
