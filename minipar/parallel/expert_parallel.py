"""Expert parallelism: every rank holds some of the experts, and tokens travel to them.

What this file teaches (the source text's third strategy: 64 experts on 8 ranks, 8 each,
tokens dispatched by a router, communication by AllToAll), after GShard (Lepikhin et al.
2020) and the Switch Transformer (Fedus et al. 2021). One MoE block on a mesh, in order:

  1. route     each rank routes its own tokens: router logits, softmax, top-k (ties to
               the lower expert id), gates renormalized over the k chosen experts;
  2. dispatch  the (token, slot) assignments are sorted by the rank owning their expert;
               an Alltoall tells every rank how many rows it will receive for each of
               its experts, then an Alltoallv moves the rows themselves (d wide each);
  3. experts   the received rows are grouped per local expert with index arrays, and
               each expert runs once on its group;
  4. combine   an Alltoallv sends every result back to the rank its token lives on,
               which weights it by its gate and scatter-adds it into the token's row;
  5. backward  the conjugate exchanges (comm.alltoallv): a row's gradient goes back
               the way the row came, by an Alltoallv with the counts swapped. The
               backward of combine is a dispatch, the backward of dispatch a combine.

The mesh (mesh.py): tokens are split over ALL dp ranks; the experts are split over the
ep ranks of each ep group (runs of ep consecutive dp ranks; ep coordinate j holds experts
j E/ep .. (j+1) E/ep - 1); expert weights are replicated over the dp/ep ranks of the
expert-data-parallel group (edp), so their gradients are summed there (sync="edp"), while
the router and LayerNorm, replicated everywhere, are summed over dp (sync="dp"). The aux
loss is defined on the whole microbatch of the GLOBAL batch (docs/design.md, "The
reference model"): a count Allreduce (f) and the probability sums (P) over dp.

Beyond the source, each in a file of parallel/moe/ that the block's constructor composes
in from the config: capacity in the global token order, experts split over tp, shared
experts, load statistics; DeepSeek-V3's router, bias b and node-limited groups are
core/routing.py's.

Placements (`--check-placements`): tokens Shard(0) over dp, moved as whole rows; expert
gradients Partial over edp, the router's over dp; the aux Replicate (`sum_replicated`).

Run it: `mpiexec -n 8 python lessons/03_expert_parallel.py`, or
`mpiexec -n 8 python -m minipar train --model moe --dp 8 --ep 8 --experts 64 --check`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar import placement
from minipar.comm import collectives
from minipar.comm.collectives import Group
from minipar.comm.mesh import Mesh
from minipar.core import autograd as ag
from minipar.core import nn
from minipar.core import routing as moe_routing
from minipar.core.autograd import Tensor
from minipar.parallel import context_parallel
from minipar.parallel.moe import expert_tp, load_stats
from minipar.parallel.moe.capacity import Capacity
from minipar.parallel.moe.shared_experts import SharedExperts


# ------------------------------------------------------------------ 1. route
@dataclass
class Routing:
    """Where this rank's b local tokens go. Assignments are in token order, then slot."""

    probs: Tensor          # (b, E) router scores: softmax probabilities, or sigmoids
    chosen: np.ndarray     # (b, k) expert ids, best first
    gates: Tensor          # (b k,) gate of each assignment, renormalized over the top k
    token_of: np.ndarray   # (b k,) assignment -> local token row
    expert_of: np.ndarray  # (b k,) assignment -> expert id


def route(u: Tensor, router: Tensor, top_k: int, cfg: nn.ModelConfig | None = None,
          bias: np.ndarray | None = None) -> Routing:
    """The reference router on the local tokens (routing.py): softmax(u Wr) (or
    DeepSeek-V3's sigmoid(u Wr) chosen by s + b), top-k, gates renormalized over the k
    chosen. Row by row: a rank needs only its own rows (and b, whole everywhere)."""
    kind = "softmax" if cfg is None else cfg.router
    probs = moe_routing.scores(u, router, kind)                      # (b, d) @ (d, E) -> (b, E)
    groups, top = (1, None) if cfg is None else (cfg.route_groups, cfg.route_top_groups)
    chosen, token_of, expert_of, gates = moe_routing.route(probs, top_k, bias, groups, top)
    return Routing(probs, chosen, gates, token_of, expert_of)


# --------------------------------------------------------------- 2. dispatch
def plan_dispatch(expert_of: np.ndarray, kept: np.ndarray, experts: int, ep: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Sort the kept assignments by destination and count them. Returns

        order (S,)          the assignments in sending order: by expert, then token;
        send  (ep, E/ep)    send[j, l] = rows for local expert l of ep rank j.

    Experts are numbered contiguously per rank, so sorting by expert id sorts by
    destination rank too, and the rows for one rank arrive already grouped by expert.
    A stable sort keeps each expert's rows in token order."""
    kept_ids = np.flatnonzero(kept)
    order = kept_ids[np.argsort(expert_of[kept_ids], kind="stable")]
    send = np.bincount(expert_of[kept_ids], minlength=experts).reshape(ep, experts // ep)
    return order, send


def exchange_counts(send: np.ndarray, ep_group: Group) -> np.ndarray:
    """recv[i, l] = rows ep rank i will send me for my local expert l (one Alltoall)."""
    if ep_group.size == 1:
        return send.copy()
    # exercise: alltoall-dispatch
    recv = np.empty_like(send)
    # row j of my counts (E/ep per rank) -> ep rank j; row i of recv <- ep rank i
    ep_group.Alltoall(np.ascontiguousarray(send), recv)
    # end exercise
    return recv


def dispatch(u: Tensor, token_rows: np.ndarray, send: np.ndarray, recv: np.ndarray,
             ep_group: Group) -> Tensor:
    """The token rows, in sending order, to the ranks owning their experts.
    Returns (R, d): from source rank 0 first, each source's rows grouped by local expert."""
    # exercise: alltoall-dispatch
    rows = ag.take_rows(u, token_rows)                        # (S, d), one per assignment
    # tokens (S, d) -> the rank that owns their expert; (R, d) <- every rank of my ep group
    return collectives.alltoallv(rows, ep_group, send.sum(axis=1), recv.sum(axis=1))
    # end exercise


# ---------------------------------------------------------- 3. local experts
def run_local_experts(received: Tensor, recv: np.ndarray, experts: list[nn.ExpertFFN]
                      ) -> Tensor:
    """Run each local expert once on its rows; outputs come back in the received order.

    Every expert runs, even on zero rows, so its gradient is a zero array rather than
    missing (the edp gradient Allreduce must see every expert weight on every replica)."""
    local = len(experts)
    expert_of_row = np.repeat(np.tile(np.arange(local), recv.shape[0]), recv.ravel())  # (R,)
    by_expert = np.argsort(expert_of_row, kind="stable")      # rows grouped per expert
    bounds = np.cumsum(recv.sum(axis=0))[:-1]                 # where each expert's group ends
    outputs = [expert(ag.take_rows(received, rows))           # (n_e, d) -> (n_e, d)
               for expert, rows in zip(experts, np.split(by_expert, bounds))]
    stacked = ag.concat(outputs)                              # (R, d) in by_expert order
    back = np.empty_like(by_expert)
    back[by_expert] = np.arange(by_expert.size)               # inverse permutation
    return ag.take_rows(stacked, back)                        # (R, d) in received order


# ---------------------------------------------------------------- 4. combine
def combine(y: Tensor, routing: Routing, order: np.ndarray, send: np.ndarray,
            recv: np.ndarray, ep_group: Group, like: Tensor) -> Tensor:
    """Results back to their tokens' ranks, weighted by the gates, summed per token."""
    # expert outputs (R, d) -> the ranks their tokens came from; (S, d) in sending order
    returned = collectives.alltoallv(y, ep_group, recv.sum(axis=1), send.sum(axis=1))
    gate = ag.reshape(ag.take_rows(routing.gates, order), (-1, 1))   # (S, 1)
    zeros = Tensor(np.zeros_like(like.data))                  # (b, d)
    return ag.index_add(zeros, routing.token_of[order], returned * gate)


# ------------------------------------------------------- the aux loss, global
def global_aux(probs: Tensor, counts: np.ndarray, tokens: int, cfg: nn.ModelConfig,
               dp_group: Group) -> Tensor:
    """coef E sum_e f_e P_e over the whole microbatch (all dp ranks), as one process has it.

    f (`counts`, already summed over dp by a count Allreduce) carries no gradient.
    P is summed with `sum_replicated`: forward Allreduce, backward Allreduce. Why the
    backward sums: every one of the dp ranks adds this same aux to its own loss, and the
    DP step divides the summed gradients by dp (data_parallel.allreduce_gradients). The
    true gradient reaching my probabilities is d aux/d P once; the backward Allreduce
    hands each rank the dp identical seeds, dp d aux/d P, and the later /dp restores it.
    An identity backward would leave the router's aux gradient dp times too small."""
    f = (counts / (tokens * cfg.top_k)).astype(probs.dtype)                  # (E,)
    p_mean = collectives.sum_replicated(probs.sum(axis=0), dp_group) * (1.0 / tokens)  # (E,)
    return (p_mean * (cfg.aux_coef * cfg.experts * f)).sum()


# ------------------------------------------------------------------ the block
class ExpertParallelBlock(nn.Module):
    """h + sum_e g_e Expert_e(LN(h)) with this rank's E/ep experts: the MoEBlock on a mesh.

    Holds the LayerNorm and router (replicated, sync="dp") and experts
    j E/ep .. (j+1) E/ep - 1 for its ep coordinate j (sync="edp"). Expert gradients are
    not summed over dp: my ep group's other ranks hold *other* experts, and their tokens
    that chose mine ran here (the backward Alltoallv brings their gradients). Only the
    edp replicas hold the same weights: summing over them covers every token.

    Extensions (parallel/moe/), chosen from the config: `capacity` (under cp with the
    `layout`: which tokens of the global order are mine), experts split over tp
    (`split_over_tp`), `shared` experts, DeepSeek-V3's `balance`. `last_stats`: the
    load of the latest microbatch (moe/load_stats.py).
    """

    def __init__(self, full: dict[str, np.ndarray], index: int, cfg: nn.ModelConfig,
                 mesh: Mesh, ln: str = "ln", split_over_tp: bool = False,
                 layout: context_parallel.TokenLayout | None = None) -> None:
        p = f"blocks.{index}"
        self.cfg, self.prefix = cfg, p
        # tokens live on the dp ranks, and with context parallelism on dp x cp (mesh.dp_cp)
        self.dp_group, self.ep_group, self.tp_group = mesh.dp_cp, mesh.ep, mesh.tp
        self.ln = nn.LayerNorm(full, f"{p}.{ln}")
        self.router = nn.Parameter(full[f"{p}.router.weight"], f"{p}.router.weight", sync="dp")
        per_rank = cfg.experts // mesh.ep.size
        mine = range(mesh.coords["ep"] * per_rank, (mesh.coords["ep"] + 1) * per_rank)
        self.split = split_over_tp and mesh.tp.size > 1
        if self.split:  # expert tensor parallelism: each expert split over tp
            self.experts = [expert_tp.TensorParallelExpert(full, f"{p}.experts.{e}", mesh.tp)
                            for e in mine]
        else:
            self.experts = [nn.ExpertFFN(full, f"{p}.experts.{e}", sync="edp") for e in mine]
        self.shared = SharedExperts(full, p, cfg.shared_experts, mesh.tp, self.split) \
            if cfg.shared_experts else None
        self.capacity = None if cfg.capacity_factor is None else \
            Capacity(cfg, self.dp_group, layout)
        self.balance = moe_routing.balance_for(p, cfg.router, cfg.experts, full)
        self.last_stats: dict = {}

    def __call__(self, h: Tensor) -> tuple[Tensor, Tensor]:
        out, aux = self.ffn(nn.as_tokens(self.ln(h)))             # (b, d) tokens
        return h + (out if h.ndim == 2 else ag.reshape(out, h.shape, like=h)), aux

    def ffn(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """The routed FFN on this rank's b tokens u (b, d): b = B/(M dp) rows, or for the
        transformer b = B/(M dp) * T positions (row, then position: dp rank r's tokens
        come after rank r-1's in the global token order, as capacity needs)."""
        cfg, experts = self.cfg, self.cfg.experts
        routing = route(u, self.router, cfg.top_k, cfg,
                        None if self.balance is None else self.balance.value)
        if self.balance is not None:
            self.balance.count(routing.expert_of)   # my tokens' share of the step's load
        tokens = u.shape[0] * self.dp_group.size                  # the global microbatch
        kept, limit = (np.ones(routing.expert_of.shape, dtype=bool), None) \
            if self.capacity is None else self.capacity.kept(routing.expert_of, u.shape[0])
        # (E,) assignments per expert, every dp rank -> their sum (f; counts, no grad)
        counts = collectives.allreduce_sum(self.dp_group, self.assignment_counts(routing, kept))
        order, send = plan_dispatch(routing.expert_of, kept, experts, self.ep_group.size)
        recv = exchange_counts(send, self.ep_group)
        received = dispatch(u, routing.token_of[order], send, recv, self.ep_group)
        if self.split:
            y = expert_tp.run_local_experts_split(received, recv, self.experts, self.tp_group)
        else:
            y = run_local_experts(received, recv, self.experts)
        out = combine(y, routing, order, send, recv, self.ep_group, like=u)
        if self.shared is not None:
            out = out + self.shared(u)
        aux = global_aux(routing.probs, counts, tokens, cfg, self.dp_group)
        if placement.ON:
            aux.name = f"{self.prefix} aux loss"  # named in placement messages
        self.last_stats = load_stats.load_stats(counts, limit, kept, send, recv)
        self.last_stats.update(load_stats.group_stats(
            routing.token_of, routing.expert_of, kept, u.shape[0], cfg, self.ep_group.size))
        return out, aux

    def assignment_counts(self, routing: Routing, kept: np.ndarray) -> np.ndarray:
        """This rank's (token, slot) assignments per expert, for the aux loss's f: every
        routed one, whether capacity kept it or not (docs/design.md: drops still count)."""
        return np.bincount(routing.expert_of, minlength=self.cfg.experts)
