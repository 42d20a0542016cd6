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
the router and LayerNorm, replicated everywhere, are summed over dp (sync="dp").

Capacity and the aux loss are defined on the whole microbatch of the GLOBAL batch
(docs/design.md, "The reference model"), so a few small collectives over dp make
every rank see global counts: a count Allreduce (f), an Exscan (how many earlier
assignments each expert already took) and the probability sums (P). The result equals
one process to rounding.

Expert tensor parallelism (`--tp` with `--model moe`): each expert is itself split
Megatron's way over the tp group, fc1 by columns and fc2 by rows (`TensorParallelExpert`).
The ranks of a tp group hold the same tokens, route them alike, and each is in its own
ep group (one per tp coordinate), so every tp rank receives the same rows for the same
local experts. Each runs its column shard of every local expert on them; one Allreduce
over tp of the (R, d) partial outputs (`reduce_from`) sums the shares before the biases
of fc2 are added and the results go back; in the backward one Allreduce of (R, d) sums the
input gradients (`copy_to`). Everything outside the experts is replicated over tp.

DeepSeek-V3's routing (routing.py) changes step 1 only: sigmoid scores chosen by score
+ b (`--router sigmoid-bias`; b is whole on every rank, its load counted here and summed
over dp x cp once per step by routing.update_biases), node-limited choice
(`--route-groups G --route-top-groups M`; `group_stats` is the routing ledger: what
each rank sends to each group). Shared experts (`--shared-experts S`) run on every
rank's own tokens beside the exchange, replicated over ep (sync="dp"), split over tp
like the routed experts when those are. Dispatch, experts and combine stay as above.

Placements (placement/__init__.py, `--check-placements`): the tokens u are Shard(0) over dp;
the dispatch and combine Alltoallv move whole rows (refusing a partial sum) and keep
them a row shard; the router and LayerNorm are Replicate over dp, so their gradients
are Partial over dp (summed by the dp sync), and an expert's weights, used on the
rows of its ep group, get gradients Partial over edp (summed by the edp sync). The
router's column sums P are Partial over dp until `sum_replicated` makes them whole,
so the aux loss added to every rank's loss is Replicate.

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
from minipar.core import fused_layers, nn
from minipar.core import routing as moe_routing
from minipar.core.autograd import Tensor
from minipar.parallel import context_parallel
from minipar.placement import Shard


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
    """The reference router on the local tokens (routing.py): softmax(u Wr), or
    sigmoid(u Wr) chosen by s + b; top-k (inside the token's best groups when
    node-limited); gates renormalized over the k chosen scores.

    Routing is row by row, so a rank needs nothing but its own rows (and b, which every
    rank holds whole): no communication."""
    kind = "softmax" if cfg is None else cfg.router
    probs = moe_routing.scores(u, router, kind)                      # (b, d) @ (d, E) -> (b, E)
    groups, top = (1, None) if cfg is None else (cfg.route_groups, cfg.route_top_groups)
    chosen, token_of, expert_of, gates = moe_routing.route(probs, top_k, bias, groups, top)
    return Routing(probs, chosen, gates, token_of, expert_of)


def within_capacity(expert_of: np.ndarray, experts: int, limit: int | None,
                    dp_group: Group) -> np.ndarray:
    """Which local assignments survive capacity, decided in GLOBAL token order.

    The tokens of dp rank r come after those of ranks 0..r-1, so an assignment of mine
    is kept if its expert took fewer than `limit` assignments before it: those of the
    earlier ranks (an exclusive prefix sum, Exscan) plus my own earlier ones. This holds
    even when ep < dp and the earlier tokens went to another replica of the expert: the
    limit is per microbatch of the global batch, as in one process. Dropped assignments
    are never sent (they contribute 0; the residual carries the token)."""
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


class TensorParallelExpert(nn.Module):
    """Expert e split over tp: rank t holds fc1's W1[:, cols_t], b1[cols_t] and fc2's
    W2[rows_t, :] (the same f_e/tp slice), and all of fc2's bias b2. `partial` gives this
    rank's share GELU(u W1[:, cols_t] + b1[cols_t]) W2[rows_t, :] of the expert's output
    before b2: the shares of the tp ranks sum to Expert_e(u) - b2 (GELU is elementwise,
    so it runs on the column shard as it stands)."""

    def __init__(self, full: dict[str, np.ndarray], name: str, tp: Group,
                 sync: str = "edp") -> None:
        width = full[f"{name}.fc1.weight"].shape[1]
        part = slice(tp.rank * width // tp.size, (tp.rank + 1) * width // tp.size)
        self.fc1_weight = nn.Parameter(full[f"{name}.fc1.weight"][:, part],
                                       f"{name}.fc1.weight",
                                       full_index=(slice(None), part), sync=sync)
        self.fc1_bias = nn.Parameter(full[f"{name}.fc1.bias"][part], f"{name}.fc1.bias",
                                     full_index=(part,), sync=sync)
        self.fc2_weight = nn.Parameter(full[f"{name}.fc2.weight"][part], f"{name}.fc2.weight",
                                       full_index=(part, slice(None)), sync=sync)
        self.fc2_bias = nn.Parameter(full[f"{name}.fc2.bias"], f"{name}.fc2.bias", sync=sync)
        placement.place(self.fc1_weight, tp, Shard(1))   # my columns of W1 (d, f_e)
        placement.place(self.fc1_bias, tp, Shard(0))     # and of b1 (f_e,)
        placement.place(self.fc2_weight, tp, Shard(0))   # my rows of W2 (f_e, d); b2 whole

    def partial(self, u: Tensor) -> Tensor:
        """(n, d) rows -> (n, d), this rank's share of the output (b2 not added)."""
        z = fused_layers.gelu(fused_layers.linear(u, self.fc1_weight, self.fc1_bias))  # (n, f_e/tp)
        return fused_layers.linear(z, self.fc2_weight)                           # (n, d), a share


def run_local_experts_split(received: Tensor, recv: np.ndarray,
                            experts: list[TensorParallelExpert], tp: Group) -> Tensor:
    """`run_local_experts` with every expert split over tp: the same rows on every tp rank,
    each rank's share of every expert, one Allreduce of the shares, then each row's b2."""
    local = len(experts)
    expert_of_row = np.repeat(np.tile(np.arange(local), recv.shape[0]), recv.ravel())  # (R,)
    by_expert = np.argsort(expert_of_row, kind="stable")      # rows grouped per expert
    bounds = np.cumsum(recv.sum(axis=0))[:-1]
    x = collectives.copy_to(received, tp)     # f: nothing moves; backward Allreduce of (R, d)
    shares = ag.concat([expert.partial(ag.take_rows(x, rows))
                        for expert, rows in zip(experts, np.split(by_expert, bounds))])
    summed = collectives.reduce_from(shares, tp)   # g: (R, d) shares of every tp rank -> their sum
    biases = ag.concat([ag.reshape(expert.fc2_bias, (1, -1)) for expert in experts])  # (l, d)
    picked = ag.take_rows(biases, expert_of_row[by_expert])  # (R, d): each row's own b2
    if placement.ON:  # placed as the rows it is added to; b2's gradient partial there
        placement.follow(picked, placement.picked_for("each row's fc2 bias", biases, summed))
    stacked = summed + picked
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
    f = (counts / (tokens * cfg.top_k)).astype(probs.dtype)              # (E,)
    p_sum = collectives.sum_replicated(probs.sum(axis=0), dp_group)            # (E,) over all ranks
    p_mean = p_sum * (1.0 / tokens)
    return (p_mean * (cfg.aux_coef * cfg.experts * f)).sum()


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


# ------------------------------------------------------------------ the block
class ExpertParallelBlock(nn.Module):
    """h + sum_e g_e Expert_e(LN(h)) with this rank's E/ep experts: the MoEBlock on a mesh.

    Holds the LayerNorm and router (replicated, sync="dp") and experts
    j E/ep .. (j+1) E/ep - 1 for its ep coordinate j (sync="edp"). Why expert gradients
    are not summed over dp: the other ranks of my ep group hold *other* experts, and
    every token of theirs that chose one of mine was already run here, its gradient
    delivered by the backward Alltoallv. Only the edp replicas (other ep groups, other
    tokens) hold the same weights; summing over them covers every token, and the DP
    step's /dp turns each rank's local-mean gradient into the global mean.

    With `split_over_tp` (the MLP model's `--tp`), every local expert is split over
    `mesh.tp` (`TensorParallelExpert`); otherwise each tp rank holds its experts whole.

    `last_stats` holds the load of the latest call (one microbatch, see `load_stats`).
    """

    def __init__(self, full: dict[str, np.ndarray], index: int, cfg: nn.ModelConfig,
                 mesh: Mesh, ln: str = "ln", split_over_tp: bool = False,
                 layout: context_parallel.TokenLayout | None = None) -> None:
        p = f"blocks.{index}"
        self.cfg, self.prefix = cfg, p
        # tokens live on the dp ranks, and with context parallelism on dp x cp (mesh.dp_cp);
        # `layout` (context_parallel.TokenLayout) then says which tokens of the global order
        self.dp_group, self.ep_group, self.layout = mesh.dp_cp, mesh.ep, layout
        self.tp_group = mesh.tp
        self.ln = nn.LayerNorm(full, f"{p}.{ln}")
        self.router = nn.Parameter(full[f"{p}.router.weight"], f"{p}.router.weight", sync="dp")
        per_rank = cfg.experts // mesh.ep.size
        self.first_expert = mesh.coords["ep"] * per_rank
        mine = range(self.first_expert, self.first_expert + per_rank)
        self.split = split_over_tp and mesh.tp.size > 1
        if self.split:  # expert tensor parallelism: each expert split over tp
            self.experts = [TensorParallelExpert(full, f"{p}.experts.{e}", mesh.tp)
                            for e in mine]
        else:
            self.experts = [nn.ExpertFFN(full, f"{p}.experts.{e}", sync="edp") for e in mine]
        # shared experts: every rank runs them on its own tokens, so they are replicated
        # over ep like the router (sync="dp"); split over tp when the routed ones are
        shared = [f"{p}.shared_experts.{s}" for s in range(cfg.shared_experts)]
        self.shared = [TensorParallelExpert(full, name, mesh.tp, sync="dp") for name in shared] \
            if self.split else [nn.ExpertFFN(full, name, sync="dp") for name in shared]
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
        limit = nn.capacity(cfg.capacity_factor, cfg.top_k, tokens, experts)
        if self.layout is None:
            kept = within_capacity(routing.expert_of, experts, limit, self.dp_group)
        else:  # positions spread over cp: the global order from everyone's routing
            mine, every = self.layout.tokens(u.shape[0])
            kept = within_capacity_in_global_order(routing.expert_of, experts, limit,
                                                    self.dp_group, mine, every)
        # (E,) assignments per expert, every dp rank -> their sum (f; counts, no grad)
        counts = collectives.allreduce_sum(self.dp_group, self.assignment_counts(routing, kept))
        order, send = plan_dispatch(routing.expert_of, kept, experts, self.ep_group.size)
        recv = exchange_counts(send, self.ep_group)
        received = dispatch(u, routing.token_of[order], send, recv, self.ep_group)
        if self.split:
            y = run_local_experts_split(received, recv, self.experts, self.tp_group)
        else:
            y = run_local_experts(received, recv, self.experts)
        out = combine(y, routing, order, send, recv, self.ep_group, like=u)
        if self.shared:
            out = out + self.shared_ffn(u)
        aux = global_aux(routing.probs, counts, tokens, cfg, self.dp_group)
        if placement.ON:
            aux.name = f"{self.prefix} aux loss"  # named in placement messages
        self.last_stats = load_stats(counts, limit, kept, send, recv)
        self.last_stats.update(group_stats(routing, kept, u.shape[0], cfg, self.ep_group.size))
        return out, aux

    def shared_ffn(self, u: Tensor) -> Tensor:
        """sum_s Shared_s(u) on my tokens u (b, d), no gate, no communication; split over
        tp (each rank its columns of fc1 and rows of fc2, one Allreduce of the (b, d)
        shares, then the fc2 biases), or whole on every rank."""
        if not self.split:
            total = self.shared[0](u)
            for expert in self.shared[1:]:
                total = total + expert(u)
            return total
        x = collectives.copy_to(u, self.tp_group)        # backward: Allreduce of (b, d) over tp
        share = self.shared[0].partial(x)
        for expert in self.shared[1:]:
            share = share + expert.partial(x)
        total = collectives.reduce_from(share, self.tp_group)  # the tp shares -> their sum (b, d)
        for expert in self.shared:
            total = total + expert.fc2_bias
        return total

    def assignment_counts(self, routing: Routing, kept: np.ndarray) -> np.ndarray:
        """This rank's (token, slot) assignments per expert, for the aux loss's f: every
        routed one, whether capacity kept it or not (docs/design.md: drops still count)."""
        return np.bincount(routing.expert_of, minlength=self.cfg.experts)


def group_stats(routing: Routing, kept: np.ndarray, tokens: int, cfg: nn.ModelConfig,
                ep: int) -> dict:
    """The routing ledger of one microbatch on this rank: the groups are node-limited
    routing's G groups (or, without them, the ep ranks: one group per node). Per group,
    `tokens_to_group[g]` = my tokens sending it at least one row through the dispatch
    Alltoallv, `rows_to_group[g]` = the rows themselves; `most_groups` = the most groups
    any one token reaches (at most --route-top-groups when node-limited)."""
    groups = cfg.route_groups if cfg.route_groups > 1 else ep
    ids = np.flatnonzero(kept)
    reached = moe_routing.groups_reached(routing.token_of[ids], routing.expert_of[ids], tokens,
                                     cfg.experts, groups)
    per = cfg.experts // groups
    return {"groups": groups,
            "tokens_to_group": reached.sum(axis=0).tolist(),
            "rows_to_group": np.bincount(routing.expert_of[ids] // per,
                                         minlength=groups).tolist(),
            "most_groups": int(reached.sum(axis=1).max()) if tokens else 0}


def expected_alltoallv_elements(kept_assignments: int, d_model: int) -> int:
    """Alltoallv elements of one block and microbatch, summed over all ranks and both
    passes: each kept (token, slot) row of d crosses four times (dispatch and combine
    forward, their conjugates backward), k x tokens x d per direction without drops.
    (Each rank's own rows count too: the ledger records what a rank hands to MPI.)"""
    return 4 * kept_assignments * d_model
