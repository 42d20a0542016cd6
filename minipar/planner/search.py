"""Pricing one plan, and searching every plan that fills the GPUs.

What this file teaches: a plan (dp, tp, pp, cp, ep, the ZeRO stage, the microbatches,
the recomputation, the pipeline schedule) is priced on its busiest ranks: memory
first (planner/memory_cost.py: ZeRO's model states, Megatron's activations; a plan that does
not fit is not timed), then the ledger of every collective and the step time
(planner/time_cost.py: an alpha-beta network, the bubble formula). `search` prices every
mesh whose degrees multiply to the GPUs, every ZeRO stage, microbatch count,
recomputation and schedule, ranks the plans that fit by step time, and counts the
others by the reason they cannot run (`mesh_problem`, or the memory they need).
The workload comes from planner/workloads.py; planner/plan_table.py prints the result.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import product

from minipar.core.divisors import divisors as factored_divisors
from minipar.core.memory import ModelStates, wire_elements
from minipar.parallel.pipeline.schedules import bubble_formula
from minipar.planner.memory_cost import (
    Plan,
    RankShape,
    Workload,
    model_states,
    rank_shape,
    stage_activations,
)
from minipar.planner.muon_cost import muon_price
from minipar.planner.presets import Cluster
from minipar.planner.time_cost import (
    Hardware,
    Timing,
    group_layout,
    members_per_node,
    step_timing,
    traffic,
)

GB = 1e9


# ------------------------------------------------------------ pricing a plan
@dataclass
class Estimate:
    """A plan priced on its busiest ranks: memory per GPU (model states + activations),
    bytes each GPU puts on the wire per step by axis, the bubble, the step time (only
    for plans that fit)."""

    plan: Plan
    states: ModelStates
    activations: float
    gathered: float  # ZeRO-2/3: one piece's full gradient (and parameters) for a moment
    bubble: float
    wire: dict[str, float] = field(default_factory=dict)
    timing: Timing | None = None

    @property
    def memory(self) -> float:
        return self.states.total + self.activations + self.gathered


def representative_stages(w: Workload, plan: Plan) -> list[int]:
    """Pipeline ranks whose load can differ: the first (embedding, most microbatches in
    flight), the second, the first with one block fewer, the last two (the head)."""
    extra = w.layers % (plan.pp * plan.virtual)
    return sorted({s for s in (0, 1, extra, plan.pp - 2, plan.pp - 1) if 0 <= s < plan.pp})


@lru_cache(maxsize=65536)
def shape_of(w: Workload, tp: int, pp: int, ep: int, virtual: int, stage: int) -> RankShape:
    """rank_shape, which depends on these fields of a plan only, once per search."""
    return rank_shape(w, Plan(1, tp=tp, pp=pp, ep=ep, virtual=virtual), stage)


def states_floor(w: Workload, plan: Plan) -> float:
    """The least memory any microbatch count or recomputation of `plan`'s mesh and ZeRO
    stage can need: its busiest rank's model states (and ZeRO-2/3's gathered piece),
    activations left out. Above the GPU's memory, `search` prices none of them."""
    whole = w.param_bytes * (plan.zero >= 3) + w.grad_bytes * (plan.zero >= 2)
    return max(model_states(w, plan, shape).total + whole * max(shape.pieces)
               for shape in (shape_of(w, plan.tp, plan.pp, plan.ep, plan.virtual, s)
                             for s in representative_stages(w, plan)))


def evaluate(w: Workload, hw: Hardware, plan: Plan) -> Estimate:
    """Memory first (a plan that does not fit is not timed), then the ledger of each
    representative rank, its wire bytes, and the step time."""
    shapes = [shape_of(w, plan.tp, plan.pp, plan.ep, plan.virtual, s)
              for s in representative_stages(w, plan)]
    whole = w.param_bytes * (plan.zero >= 3) + w.grad_bytes * (plan.zero >= 2)
    states, activations, gathered = max(
        ((model_states(w, plan, shape), stage_activations(w, plan, shape),
          whole * max(shape.pieces)) for shape in shapes),
        key=lambda need: need[0].total + need[1] + need[2])
    bubble = bubble_formula(plan.schedule, plan.pp, plan.microbatches, plan.virtual)
    estimate = Estimate(plan, states, activations, gathered, bubble)
    if estimate.memory > hw.gpu_memory - hw.headroom:
        return estimate
    items = [traffic(w, plan, shape) for shape in shapes]
    for entries in items:
        sent: dict[str, float] = {}
        for t in entries:
            if t.op != "Recv" and t.elements:  # a message counts once, at its sender
                n, _ = group_layout(plan, t.group)
                sent[t.group] = sent.get(t.group, 0.0) + wire_elements(
                    t.op, t.elements, n) * t.bytes / t.elements
        for axis, value in sent.items():
            estimate.wire[axis] = max(estimate.wire.get(axis, 0.0), value)
    estimate.timing = step_timing(w, plan, hw, shapes, items)
    if plan.optimizer == "muon":
        add_muon(w, hw, plan, estimate)
    return estimate


def add_muon(w: Workload, hw: Hardware, plan: Plan, estimate: Estimate) -> None:
    """Muon's price (planner/muon_cost.py) for the busiest stage's block matrices over
    its tp x (dp cp) GPUs: the bytes into the 'muon' wire column, their seconds and the
    Newton-Schulz seconds at peak after the pipeline (after the gradient sync)."""
    layers = -(-w.layers // plan.pp)
    tp_bw = hw.intra_bw if members_per_node(plan.tp, 1, hw.node_size) == plan.tp \
        else hw.inter_bw
    n, stride = group_layout(plan, "dp")
    dp_bw = hw.intra_bw if members_per_node(n, stride, hw.node_size) == n else hw.inter_bw
    price = muon_price(list(w.muon_matrices) * layers, plan.muon_mode, plan.tp,
                       plan.replicas, hw.flops, tp_bw, dp_bw)
    estimate.wire["muon"] = price.bytes
    t = estimate.timing
    after = {**t.step_comm, "muon": price.wire_seconds,
             "newton-schulz": price.compute_seconds}
    estimate.timing = replace(t, step_comm=after, total=t.total + price.wire_seconds
                              + price.compute_seconds)


# ------------------------------------------------------------ the search
MESH = ("dp", "tp", "pp", "cp", "ep")
RECOMPUTE = ("none", "selective", "full")


@dataclass
class Search:
    """Every plan considered: the ones that fit (fastest first), the ones that do not
    fit in memory, and the count of the others by the reason they cannot run."""

    feasible: list[Estimate]
    too_big: list[Estimate]
    rejected: Counter
    bounded: str = ""   # how the search was bounded (`BUDGET`), "" when it priced all


def best_by(found: Search, axis: str) -> dict[int, Estimate]:
    """For each value of a plan field ("tp", "pp", "ep", "dp", "cp", "microbatches",
    "zero"): the fastest plan that fits, or if none fits, the one needing least memory."""
    out: dict[int, Estimate] = {}
    for estimate in found.feasible + found.too_big:  # fastest first, then smallest
        out.setdefault(getattr(estimate.plan, axis), estimate)
    return dict(sorted(out.items()))


def distinct_meshes(estimates: list[Estimate]) -> list[Estimate]:
    """The first (fastest) plan of each mesh (dp, tp, pp, cp, ep), in order: the other
    ZeRO stages, microbatch counts and recomputations of a mesh are its variants."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for e in estimates:
        mesh = tuple(getattr(e.plan, axis) for axis in MESH)
        if mesh not in seen:
            seen.add(mesh)
            out.append(e)
    return out


def divisors(n: int) -> list[int]:
    """Every k that divides n, smallest first (by its prime factors: core/divisors.py, in
    milliseconds for a batch of 10^15 where trying every k up to sqrt(n) takes minutes)."""
    return list(factored_divisors(n))


def mesh_problem(w: Workload, plan: Plan) -> str | None:
    """Why a mesh cannot run this workload at all (None if it can)."""
    moe = [b for b in w.blocks if b.moe]
    if w.batch % plan.dp:
        return "dp does not divide the global batch"
    if (w.batch // plan.dp) % plan.microbatches:
        return "M does not divide the sequences of a dp rank"
    if w.seq_len % plan.cp:
        return "cp does not divide the sequence length"
    if any(dim % plan.tp for dim in w.split_dims):
        return "tp does not divide d_ff or the attention (or key/value) heads"
    if plan.tp > 1 and moe and not plan.sp:
        return "tp > 1 with experts needs sequence parallelism (each tp rank routes its share)"
    if any(b.experts % plan.ep for b in moe):
        return "ep does not divide the experts"
    if (plan.tp * plan.replicas) % plan.ep:
        return "ep does not divide tp x cp x dp (the ranks that share a stage's experts)"
    if plan.pp * plan.virtual > w.layers:
        return "more pipeline stages than layers"
    if plan.schedule == "interleaved" and (plan.pp == 1 or plan.microbatches % plan.pp):
        return "interleaving needs pp > 1 and M divisible by pp"
    return None


PRUNED = ("meshes whose dp does not divide the batch, cp the sequence, tp the split sizes, "
          "ep the experts, or with more stages than layers, are not enumerated: each "
          "degree is drawn from the divisors of what it must divide")


def small_divisors(n: int) -> tuple[int, ...]:
    """`divisors(n)`, cached (core/divisors.py): the meshes below ask for the same numbers
    often."""
    return factored_divisors(n)


def meshes(w: Workload, world: int, fixed: dict[str, int]) -> list[tuple[int, ...]]:
    """Every (dp, tp, pp, cp, ep) with dp tp pp cp = world, ep | tp cp dp (1 for a dense
    model), that agrees with the `fixed` ones and could run at all (`PRUNED`).

    Never a loop over the divisors of `world` (a highly composite count like 735134400
    has 1344, and the triples of them are millions): dp is drawn from the divisors of
    gcd(world, batch), cp of the sequence length, pp counts up to the layers, and tp is
    what is left, kept only if it divides every split size. So the work is bounded by
    the model's sizes, whatever the GPU count; pp is drawn from the divisors of what is
    left (never counted up to the layers one by one)."""
    moe = [b for b in w.blocks if b.moe]
    splits = math.gcd(*w.split_dims) if w.split_dims else 0     # 0: tp divides anything
    experts = math.gcd(*(b.experts for b in moe)) if moe else 1
    out = []
    for dp in small_divisors(math.gcd(world, w.batch)):
        for cp in small_divisors(math.gcd(world // dp, w.seq_len)):
            rest = world // (dp * cp)
            for pp in small_divisors(rest):
                if pp > w.layers:
                    break
                tp = rest // pp
                if splits and splits % tp:
                    continue
                for ep in small_divisors(math.gcd(tp * cp * dp, experts)) if moe else (1,):
                    mesh = dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
                    if all(mesh[k] == v for k, v in fixed.items() if k in mesh):
                        out.append((dp, tp, pp, cp, ep))
    return sorted(out, key=lambda m: (m[1], m[3], m[2], m[4]))   # tp, cp, pp, ep


BUDGET = 25_000   # plans one search prices at most (a few seconds of pricing)
SKIP_FROM = 1000  # from this many plans on, a mesh too big for its model states is skipped


def microbatch_counts(w: Workload, dp: int, fixed: dict[str, int], ladder: bool
                      ) -> list[int]:
    """The M a mesh with this dp is priced with: every divisor of B/dp, or with `ladder`
    a geometric ladder of them (the first, each next at least twice the last, the last)."""
    counts = divisors(w.batch // dp) if w.batch % dp == 0 else [1]
    if "microbatches" in fixed:
        return [m for m in counts if m == fixed["microbatches"]] or [fixed["microbatches"]]
    if not ladder:
        return counts
    kept = [counts[0]]
    for m in counts[1:-1]:
        if m >= 2 * kept[-1]:
            kept.append(m)
    return kept + [counts[-1]] if counts[-1] != kept[-1] else kept


def bounded_plans(w: Workload, template: Plan, mesh_list: list[tuple[int, ...]],
                  schedules: tuple[tuple[str, int], ...], fixed: dict[str, int], per_m: int,
                  rejected: Counter) -> tuple[list[Plan], str]:
    """The plans (mesh, schedule, M) to price, each `per_m` times (ZeRO stages x
    recomputations), at most BUDGET in all, and a sentence saying how they were bounded
    ("" when none was left out). The ones that cannot run are counted in `rejected`.
    Past the budget, first the microbatch counts become a ladder; then the meshes are
    taken in order of the cheapest wire (tp within a node first, then fewer cp, pp and
    ep ranks) until the budget is spent."""
    def runnable(ladder: bool, count: bool) -> list[Plan]:
        out = []
        for (dp, tp, pp, cp, ep), (schedule, virtual) in product(mesh_list, schedules):
            for m in microbatch_counts(w, dp, fixed, ladder):
                plan = replace(template, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=m,
                               sp=template.sp and tp > 1, schedule=schedule, virtual=virtual)
                problem = mesh_problem(w, plan)
                if problem is None:
                    out.append(plan)
                elif count:
                    rejected[problem] += per_m
        return out

    upper = per_m * len(schedules) * sum(len(microbatch_counts(w, mesh[0], fixed, False))
                                         for mesh in mesh_list)   # before any rejection
    if upper <= 8 * BUDGET:   # sorting out the ones that cannot run is cheap: do it first
        everything = runnable(False, count=True)
        if len(everything) * per_m <= BUDGET:
            return everything, ""
    plans = runnable(True, count=upper > 8 * BUDGET)
    note = (f"the search was bounded: up to {upper} plans were too many to price in "
            "seconds, so the microbatch counts were a ladder (each at least twice the last)")
    if len(plans) * per_m <= BUDGET:
        return plans, note
    plans.sort(key=lambda p: (p.tp > 8, p.cp, p.pp, p.ep, p.tp))
    kept = plans[:BUDGET // per_m]
    meshes_kept = len({(p.dp, p.tp, p.pp, p.cp, p.ep) for p in kept})
    meshes_all = len({(p.dp, p.tp, p.pp, p.cp, p.ep) for p in plans})
    return kept, (f"{note}, and only {meshes_kept} of the {meshes_all} meshes, those with "
                  "the least wire (tp within 8, then fewer cp, pp, ep ranks), were priced: "
                  "fix a degree (--tp, --pp, --cp, --ep) or --microbatches to search the rest")


def search(w: Workload, hw: Hardware, world: int, template: Plan | None = None,
           zero_stages: tuple[int, ...] = (0, 1, 2, 3),
           recomputes: tuple[str, ...] = ("selective",),
           fixed: dict[str, int] | None = None,
           schedules: tuple[tuple[str, int], ...] | None = None) -> Search:
    """Price every (dp, tp, pp, cp, ep, zero, M, recompute, schedule) with dp tp pp cp =
    world and M | B/dp, that agrees with `fixed` (any of dp, tp, pp, cp, ep,
    microbatches). `schedules` lists (schedule, virtual) pairs (default: the template's);
    `template` carries the options every plan shares (`sp=True` turns sequence
    parallelism on whenever tp > 1)."""
    template, fixed = template or Plan(1), fixed or {}
    schedules = schedules or ((template.schedule, template.virtual),)
    found = Search([], [], Counter())
    plans, found.bounded = bounded_plans(w, template, meshes(w, world, fixed), schedules,
                                         fixed, len(zero_stages) * len(recomputes),
                                         found.rejected)
    floors: dict[tuple, float] = {}   # (mesh, schedule, ZeRO stage) -> model states alone
    closest = math.inf                # the least memory of a plan priced too big so far
    skip = len(plans) * len(zero_stages) * len(recomputes) > SKIP_FROM
    too_big = f"needs more than {usable(hw) / GB:g} GB per GPU"
    for mesh in plans:
        for zero in zero_stages:
            key = (replace(mesh, microbatches=1), zero)
            if skip and key not in floors:
                floors[key] = states_floor(w, replace(mesh, zero=zero))
            if skip and usable(hw) < floors[key] and closest <= floors[key]:
                # too big before any activation, for every M and recomputation of this
                # mesh, and no closer a miss than one priced already: none is priced
                found.rejected[too_big] += len(recomputes)
                continue
            for recompute in recomputes:
                estimate = evaluate(w, hw, replace(mesh, zero=zero, recompute=recompute))
                if estimate.timing is None:
                    found.rejected[too_big] += 1
                    found.too_big.append(estimate)
                    closest = min(closest, estimate.memory)
                else:
                    found.feasible.append(estimate)
    found.feasible.sort(key=lambda e: (e.timing.total, e.memory))
    found.too_big.sort(key=lambda e: e.memory)
    return found


def hardware(cluster: Cluster, efficiency: float = 0.5, headroom: float | None = None
             ) -> Hardware:
    """A cluster preset as the cost model's Hardware: bytes, FLOP/s, bytes/s, seconds;
    `headroom` GB per GPU left to the framework (default 10% of its memory)."""
    headroom = 0.1 * cluster.gpu_memory if headroom is None else headroom
    return Hardware(cluster.gpu_memory * GB, cluster.flops * 1e12, efficiency,
                    cluster.intra_bw * GB, cluster.inter_bw * GB, cluster.node_size,
                    cluster.latency_us * 1e-6, headroom * GB, cluster.hbm_bw * GB,
                    cluster.fp8_flops * 1e12)


def usable(hw: Hardware) -> float:
    """Bytes a plan may use on one GPU: its memory less the framework's headroom."""
    return hw.gpu_memory - hw.headroom

