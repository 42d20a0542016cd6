"""The cost model behind `python -m minipar plan`, part two: what moves, and how long it takes.

What this file teaches. Once a plan fits (planner/memory_cost.py: what each rank holds), the
planner ranks it by the seconds of one step: what each rank sends, priced on the
network, plus its compute and the time its pipeline idles. Each term is a formula
this project checks against real runs:

  communication  the ledger a minipar run writes, entry by entry: TP's Allreduce of (b, d)
                 per block and direction, EP's 4 Alltoallv of (b k, d), PP's Send/Recv of
                 (b, d), DP's buckets, ZeRO's `memory.ledger_formula`; on the wire by the
                 ring formulas (`memory.wire_elements`).
  bubble         (pp-1)/(M+pp-1), interleaved (pp-1)/(VM+pp-1)
                 (`schedules.bubble_formula`; the simulator reproduces it).
  time           6 x parameters x tokens FLOPs at a stated fraction of peak, plus
                 alpha ceil(log2 n) + wire bytes / bandwidth per collective: in-node
                 bandwidth if the group fits in a node, else the network's (a ring goes
                 at its slowest link). Nothing overlaps.

Ranks are placed as mesh.py places them: tp fastest, then cp, then dp, then pp.
Tested by `python -m pytest tests/planner/test_plan.py`; used by `python -m minipar plan` and by
`python -m minipar train --ledger` (each ledger line beside its prediction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from minipar.core.memory import ledger_formula, wire_elements
from minipar.parallel.pipeline.schedules import TWO_WAY, V_SHAPED, bubble_formula
from minipar.planner.memory_cost import (
    Array,
    Plan,
    RankShape,
    Workload,
    chunks_per_rank,
    tokens_per_microbatch,
    virtual_stages,
)


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links: bytes, FLOP/s, bytes/s per GPU, seconds per message step;
    `hbm_bw` bytes/s of the GPU's memory (decode's price: planner/serving.py)."""

    gpu_memory: float
    flops: float
    efficiency: float
    intra_bw: float
    inter_bw: float
    node_size: int
    latency: float
    headroom: float = 0.0  # bytes of each GPU left to the framework (CUDA, NCCL, allocator)
    hbm_bw: float = 0.0
    fp8_flops: float = 0.0  # FLOP/s of FP8 matmuls (0: none)


@dataclass(frozen=True)
class Traffic:
    """One predicted ledger entry of a rank: `calls` calls of `op` on `group` defined on
    `elements` numbers in all. `phase`: "pipeline" (inside the microbatch loop, on the
    pipeline's critical path) or "step" (once per step, after the pipeline drains)."""

    group: str
    op: str
    calls: int
    elements: int
    bytes: int
    phase: str = "pipeline"


# ------------------------------------------------------------ what moves
def bucket_count(arrays: list[int], bucket_size: int) -> int:
    """Gradient buckets of data_parallel.make_buckets, on sizes: walk the arrays from
    the last, start a new bucket when the next array would overflow this one."""
    buckets, filled = 0, 0
    for size in reversed(arrays):
        if filled and filled + size > bucket_size:
            buckets, filled = buckets + 1, 0
        filled += size
    return buckets + (1 if filled else 0)


def traffic(w: Workload, plan: Plan, shape: RankShape) -> list[Traffic]:
    """Every ledger entry one rank of pipeline rank `shape.stage` writes in one step."""
    entries = (tp_traffic(w, plan, shape) + cp_traffic(w, plan, shape)
               + pp_traffic(w, plan, shape) + moe_traffic(w, plan, shape)
               + dp_traffic(w, plan, shape))
    if plan.schedule in TWO_WAY and plan.pp > 1:  # DualPipe: a block of one copy sees M/2
        entries = [replace(t, calls=t.calls // 2, elements=t.elements // 2,
                           bytes=t.bytes // 2) if t.phase == "pipeline" and t.group != "pp"
                   else t for t in entries]
    return entries


def tp_traffic(w: Workload, plan: Plan, shape: RankShape) -> list[Traffic]:
    """Megatron: per reduction point and microbatch an Allreduce of (b, d) forward (g)
    and one backward (f); with SP each becomes an Allgather on the way into the split
    region and a Reduce_scatter on the way out, in both directions, plus the residual
    stream's split after the embedding and gather before the head, and one Allreduce
    per step of the gradients SP leaves partial (the blocks' replicated arrays). An MoE
    block under tp splits its attention (and shared experts) only. Full recomputation
    runs each block's forward collectives twice. A vocabulary-parallel embedding adds
    its Allreduce of (b, d) (SP: a Reduce_scatter), the head its entry's (SP: an
    Allgather and a Reduce_scatter) and the parallel cross-entropy's two: the row
    maxima (b) and the sums of exps with the target logits (2b)."""
    blocks = {block: n for block, n in shape.kinds.items()   # each kind, its count
              if block.tp_reductions or block.sp_gathers}
    if plan.tp == 1 or not (blocks or w.vocab_parallel):
        return []
    m = plan.microbatches
    tokens = tokens_per_microbatch(w, plan)
    stream = tokens * w.d_model                               # (b, d)
    passes = 3 if plan.recompute == "full" else 2             # forward, (again,) backward
    calls = passes * sum(n * block.tp_reductions for block, n in blocks.items()) * m
    embed, head = (w.vocab_parallel and shape.first), (w.vocab_parallel and shape.last)
    out = []
    if not plan.sp:
        calls += m * (int(embed) + int(head))                 # the embedding's g, the head's f
        if calls:
            out.append(Traffic("tp", "Allreduce", calls, calls * stream,
                               calls * stream * w.act_bytes))
    else:
        edges = m * (int(shape.first) + int(shape.last))
        gathers = calls + edges + passes * m * sum(n * block.sp_gathers
                                                   for block, n in blocks.items())
        scatters = calls + m * (int(embed) + int(head))
        out += [Traffic("tp", "Allgather", gathers, gathers * stream,
                        gathers * stream * w.act_bytes),
                Traffic("tp", "Reduce_scatter", scatters, scatters * stream,
                        scatters * stream * w.act_bytes)]
    if head:  # the parallel cross-entropy: max, then (sum of exps, target) of b rows
        out.append(Traffic("tp", "Allreduce", 2 * m, 3 * tokens * m,
                           3 * tokens * m * w.act_bytes))
    partial = sum(n * (block.sp_partial if block.sp_partial is not None
                       else sum(size for size, split in block.arrays if not split))
                  for block, n in blocks.items())
    partial += (w.sp_partial_embed * int(shape.first) + w.sp_partial_head * int(shape.last))
    if plan.sp and partial:  # LayerNorm and row-parallel bias gradients of my rows
        out.append(Traffic("tp", "Allreduce", 1, partial, partial * w.grad_bytes, "step"))
    return ledger_merged(out)


def ledger_merged(items: list[Traffic]) -> list[Traffic]:
    """Entries of one (group, op, phase) added up into one."""
    out: dict[tuple[str, str, str], Traffic] = {}
    for t in items:
        key = (t.group, t.op, t.phase)
        if key in out:
            old = out[key]
            t = Traffic(t.group, t.op, old.calls + t.calls, old.elements + t.elements,
                        old.bytes + t.bytes, t.phase)
        out[key] = t
    return list(out.values())


def pp_traffic(w: Workload, plan: Plan, shape: RankShape) -> list[Traffic]:
    """Per microbatch and virtual stage: Recv the input activation and Isend the input's
    gradient back (unless first); Isend the output and Recv its gradient (unless last).
    A message is (b, d), or (b/tp, d) with SP. DualPipe: each of its two chains (stages
    of a pp-stage model) carries M/2 microbatches, and after the backward the rank
    trades the gradients of both copies with its mirror rank (one Sendrecv)."""
    if plan.pp == 1:
        return []
    rows = tokens_per_microbatch(w, plan) // (plan.tp if plan.sp else 1)
    if plan.schedule in TWO_WAY:
        ends = sum(int(k > 0) + int(k < plan.pp - 1) for k in virtual_stages(plan, shape.stage))
        calls = ends * plan.microbatches // 2
        size = calls * rows * w.d_model
        psi = sum(shape.dp_arrays) + sum(shape.edp_arrays)
        return [Traffic("pp", op, calls, size, size * w.act_bytes) for op in ("Isend", "Recv")
                ] + [Traffic("pp", "Sendrecv", 1, psi, psi * w.grad_bytes, "step")]
    last = plan.pp * chunks_per_rank(plan) - 1
    crossing = [b for b in range(last)  # the V's bottom (pp-1 | pp) stays inside a rank
                if not (plan.schedule in V_SHAPED and b == plan.pp - 1)]
    boundaries = sum(int(v - 1 in crossing) + int(v in crossing)
                     for v in virtual_stages(plan, shape.stage))
    calls = boundaries * plan.microbatches
    size = calls * rows * w.d_model
    return [Traffic("pp", op, calls, size, size * w.act_bytes) for op in ("Isend", "Recv")]


def moe_traffic(w: Workload, plan: Plan, shape: RankShape) -> list[Traffic]:
    """Per MoE block and microbatch (expert_parallel.py): one Alltoall of the E routing
    counts, four Alltoallv of the b k rows of d (dispatch, combine, and their conjugates
    in the backward; balanced routing assumed: each rank receives what it sends), and
    over dp three Allreduce of E numbers (counts f, probability sums P both ways), and
    with a capacity one Exscan of E counts (how many earlier tokens took each expert).
    Balanced by a routing bias instead (`w.routing_bias`, DeepSeek-V3; routing.py's
    `global_load`): no aux-loss Allreduces, one Allreduce a step of every MoE block's E
    counts at once.
    Full recomputation runs the forward ones twice: 2 Alltoall, 6 Alltoallv, 5 Allreduce
    (f twice, P forward twice and backward once), 2 Exscan."""
    moe = [block for block in shape.blocks if block.moe]
    if not moe or plan.replicas * (plan.tp if w.experts_over_tp else 1) == 1:
        return []
    again = 2 if plan.recompute == "full" else 1                # forwards per backward
    m = plan.microbatches  # experts over tp: each tp rank routes its SP share of tokens
    tokens = tokens_per_microbatch(w, plan) // (plan.tp if w.experts_over_tp else 1)
    dp = "dp"   # every replica: dp x cp ranks (mesh.py's dp_cp, named dp in the ledger)
    experts = sum(block.experts for block in moe) * m
    out = []
    if plan.ep > 1:
        rows = (2 * again + 2) * tokens * sum(block.top_k for block in moe) * m
        out += [Traffic("ep", "Alltoall", again * len(moe) * m, again * experts,
                        again * experts * w.count_bytes),
                Traffic("ep", "Alltoallv", (2 * again + 2) * len(moe) * m, rows * w.d_model,
                        rows * w.d_model * w.act_bytes)]
    if plan.replicas == 1:
        return out
    if w.routing_bias:   # DeepSeek-V3: the experts' load of the step, summed once, after it
        load = sum(block.experts for block in moe)
        out.append(Traffic(dp, "Allreduce", 1, load, load * w.count_bytes, "step"))
    else:
        stats = (2 * again + 1) * experts
        out.append(Traffic(dp, "Allreduce", (2 * again + 1) * len(moe) * m, stats,
                           again * experts * w.count_bytes
                           + (again + 1) * experts * w.act_bytes))
    capped = [block for block in moe if block.capacity]
    if capped and plan.cp == 1:
        counts = again * sum(block.experts for block in capped) * m
        out.append(Traffic(dp, "Exscan", again * len(capped) * m, counts,
                           counts * w.count_bytes))
    elif capped:  # under cp: everyone's expert ids, the global order rebuilt (k per token)
        ids = again * sum(block.top_k for block in capped) * tokens * m * plan.dp * plan.cp
        out.append(Traffic(dp, "Allgather", again * len(capped) * m, ids,
                           ids * w.count_bytes))
    return out


def dp_traffic(w: Workload, plan: Plan, shape: RankShape) -> list[Traffic]:
    """The gradient sync over each weight's replicas. ZeRO 0: one Allreduce per bucket
    (per array with --grad-sync naive). ZeRO 1-3: memory.ledger_formula's Reduce_scatter
    and Allgather of Psi, once per step (stage 1), or per piece and microbatch (stage 2's
    Reduce_scatter, stage 3's both; stage 3 gathers twice: forward and backward). With
    --fp8 under ZeRO-3 the gathers move FP8 (1 byte: weights cast before the gather, as
    TorchTitan's FSDP2 float8 all-gather) and one Allreduce a step brings every FP8
    weight its global amax (its scale)."""
    out = []
    moe_pieces = sum(n for block, n in shape.kinds.items() if block.moe)
    edp = (plan.tp if w.experts_over_tp else 1) * plan.replicas // plan.ep
    for group, size, arrays, pieces in (("dp", plan.replicas, shape.dp_arrays,
                                         len(shape.pieces)),
                                        ("edp", edp, shape.edp_arrays, moe_pieces)):
        psi = sum(arrays)
        if size == 1 or psi == 0:
            continue
        if plan.zero == 0:
            calls = (len(arrays) if plan.grad_sync == "naive"
                     else bucket_count(arrays, w.bucket_size))
            op = "Iallreduce" if plan.grad_sync == "overlapped" else "Allreduce"
            out.append(Traffic(group, op, calls, psi, psi * w.grad_bytes, "step"))
            continue
        for op, elements in ledger_formula(psi, plan.zero).items():
            each = plan.zero == 3 or (plan.zero == 2 and op == "Reduce_scatter")
            times = plan.microbatches if each else 1
            calls = elements // psi * times * (pieces if each else 1)
            itemsize = w.param_bytes if op == "Allgatherv" else w.grad_bytes
            if op == "Allgatherv" and plan.fp8 and plan.zero == 3:
                itemsize = 1     # ZeRO-3's gathers for the matmuls, cast to FP8 first
            out.append(Traffic(group, op, calls, elements * times,
                               elements * times * itemsize, "pipeline" if each else "step"))
        if plan.fp8 and plan.zero == 3 and group == "dp":
            # each FP8 weight's scale from its global amax: one Allreduce(MAX) a step of
            # one fp32 number per weight array of at least d x d (the planner keeps a
            # block's attention, and its FFN, as one array each: a lower bound of the
            # count; the call is priced by its latency)
            matrices = sum(n * sum(1 for size, _ in b.arrays if size >= w.d_model ** 2)
                           for b, n in shape.kinds.items())
            if matrices:
                out.append(Traffic(group, "Allreduce", 1, matrices, 4 * matrices, "step"))
    return out


def ledger_of(items: list[Traffic]) -> dict[tuple[str, str], tuple[int, int]]:
    """(group, op) -> (calls, elements): the shape of a rank's ledger.json records."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for t in items:
        calls, elements = out.get((t.group, t.op), (0, 0))
        out[(t.group, t.op)] = (calls + t.calls, elements + t.elements)
    return out


# ------------------------------------------------------------ what it costs
def group_layout(plan: Plan, group: str) -> tuple[int, int]:
    """(ranks, stride between them) of a group, with tp fastest, then cp, then dp, then
    pp (Megatron's order); "dp" is every replica of a weight (dp x cp ranks); an ep group
    is ep consecutive ranks (of a tp group, then of the replicas: TP for attention, EP
    for experts), an edp group every ep-th one."""
    if group == "tp":
        return plan.tp, 1
    if group == "cp":
        return plan.cp, plan.tp
    if group == "dp":
        return plan.dp * plan.cp, plan.tp
    if group == "pp":
        return plan.pp, plan.tp * plan.dp * plan.cp
    if group == "ep":
        return plan.ep, 1
    if group == "edp":
        return plan.tp * plan.dp * plan.cp // plan.ep, plan.ep
    raise KeyError(group)


def members_per_node(size: int, stride: int, node: int) -> int:
    """How many ranks of one group share a node: all of them if the group's span of
    size x stride ranks fits in an aligned node, else node/stride (at least 1)."""
    span = size * stride
    if span <= node and node % span == 0:
        return size
    return max(1, min(size - 1, node // stride))


def seconds(t: Traffic, plan: Plan, hw: Hardware) -> float:
    """Alpha-beta price of one ledger entry. Latency: alpha per call and tree level
    (alpha ceil(log2 n)), alpha per message for Send/Recv; bandwidth: the ring's wire
    bytes (memory.wire_elements) at intra-node speed if the group is inside one node,
    else at inter-node speed; an Alltoall sends its in-node and off-node shares at
    once. A message is paid by its receiver (Isend returns at once)."""
    n, stride = group_layout(plan, t.group)
    if n == 1 or t.elements == 0 or t.op in ("Isend", "Send"):
        return 0.0
    local = members_per_node(n, stride, hw.node_size)
    wire = wire_elements(t.op, t.elements, n) * (t.bytes / t.elements)
    bandwidth = hw.intra_bw if local == n else hw.inter_bw
    if t.op in ("Recv", "Irecv"):
        return t.calls * hw.latency + wire / bandwidth
    latency = t.calls * hw.latency * math.ceil(math.log2(n))
    if t.op in ("Alltoall", "Alltoallv"):
        near = (local - 1) / (n - 1)
        return latency + max(wire * near / hw.intra_bw, wire * (1 - near) / hw.inter_bw)
    return latency + wire / bandwidth


def compute_seconds(w: Workload, plan: Plan, shape: RankShape, hw: Hardware) -> float:
    """A block's forward costs 2 FLOPs per parameter and token plus its attention's
    QK^T and AV (cut by tp); the backward twice the forward; full recomputation runs
    the forward again, selective only the attention part. The routed experts of one token
    cost 2 top_k x an expert, on the tp rank that holds the token (SP). The head's
    3 passes are never recomputed. With `plan.fp8` the blocks' matmuls run at the FP8
    rate, attention and the head at BF16's. Over this rank's tokens: B s / (dp cp). A small
    microbatch runs less efficiently: each costs `w.microbatch_overhead` tokens more
    (Megatron-LM's measured 1.3x at b = 1: workloads.small_microbatch_tokens)."""
    def cut(arrays: tuple[Array, ...]) -> int:
        return sum(size // plan.tp if split else size for size, split in arrays)

    passes = 4 if plan.recompute == "full" else 3
    again = 1 if plan.recompute == "selective" else 0
    matmuls = sum(n * passes * (2 * cut(b.arrays) + 2 * b.top_k * sum(b.expert) / plan.tp)
                  for b, n in shape.kinds.items())  # most layers: one BlockShape, repeated
    attention = sum(n * (passes + again) * b.attn_flops / plan.tp
                    for b, n in shape.kinds.items())
    ends = cut(w.embed) if shape.first and not w.lookup_embedding else 0
    ends += cut(w.head) if shape.last else 0
    tokens = w.batch * w.seq_len / plan.replicas
    small = 1.0 + w.microbatch_overhead / tokens_per_microbatch(w, plan)  # b's efficiency
    # --fp8 (DeepSeek-V3's recipe, its report section 3.3: the blocks' linear layers in
    # FP8; attention, the embedding and the head kept in BF16): the matmuls at the FP8 rate
    fast = hw.fp8_flops if plan.fp8 else hw.flops
    return small * tokens * (matmuls / fast + (attention + 6 * ends) / hw.flops) \
        / hw.efficiency


@dataclass(frozen=True)
class Timing:
    """One step's seconds: compute, communication by axis (inside the pipeline and after
    it), the bubble, the total. Taken on the busiest pipeline rank."""

    compute: float
    pipeline_comm: dict[str, float]
    step_comm: dict[str, float]
    bubble: float
    total: float


def axis_seconds(entries: list[Traffic], phase: str, plan: Plan, hw: Hardware
                 ) -> dict[str, float]:
    """Seconds per mesh axis of one rank's ledger entries of one phase."""
    out: dict[str, float] = {}
    for t in entries:
        if t.phase == phase:
            out[t.group] = out.get(t.group, 0.0) + seconds(t, plan, hw)
    return out


def step_timing(w: Workload, plan: Plan, hw: Hardware, shapes: list[RankShape],
                items: list[list[Traffic]]) -> Timing:
    """The busiest stage runs M microbatches, each its compute plus the collectives
    inside the microbatch loop; with bubble fraction beta the pipeline lasts
    busy / (1 - beta) (for 1F1B: M + pp - 1 microbatch slots). The once-per-step
    collectives (the gradient sync) follow. Nothing overlaps."""
    busiest: tuple[float, float, dict[str, float]] = (-1.0, 0.0, {})
    for shape, entries in zip(shapes, items):
        inside = axis_seconds(entries, "pipeline", plan, hw)
        compute = compute_seconds(w, plan, shape, hw)
        busy = compute + sum(inside.values())
        if busy > busiest[0]:
            busiest = (busy, compute, inside)
    busy, compute, inside = busiest
    after = max((axis_seconds(entries, "step", plan, hw) for entries in items),
                key=lambda axes: sum(axes.values()))
    beta = bubble_formula(plan.schedule, plan.pp, plan.microbatches, plan.virtual)
    makespan = busy / (1.0 - beta)
    return Timing(compute, inside, after, makespan - busy, makespan + sum(after.values()))


def cp_traffic(w: Workload, plan: Plan, shape: RankShape) -> list[Traffic]:
    """Context parallelism as Llama 3 runs it: a rank holds s/cp of each sequence and,
    per block and microbatch, Allgathers the K and V of the whole sequence before its
    attention (again in the backward, and a third time with full recomputation), then
    Reduce_scatters their gradients back to the rank that owns each piece."""
    if plan.cp == 1 or not shape.blocks:
        return []
    if plan.cp_mode != "llama3":  # a minipar run: its own modes, exactly
        return minipar_cp_traffic(w, plan, shape)
    width = sum(n * block.kv_width for block, n in shape.kinds.items()) // plan.tp
    if not width:
        return []
    whole = tokens_per_microbatch(w, plan) * plan.cp * width * plan.microbatches
    layers = len(shape.blocks) * plan.microbatches
    gathers = 3 if plan.recompute == "full" else 2
    return [Traffic("cp", "Allgather", gathers * layers, gathers * whole,
                    gathers * whole * w.act_bytes),
            Traffic("cp", "Reduce_scatter", layers, whole, whole * w.grad_bytes)]


def minipar_cp_traffic(w: Workload, plan: Plan, shape: RankShape) -> list[Traffic]:
    """Context parallelism as minipar runs it (--cp-mode; context_parallel.py), per
    transformer layer and microbatch, a block of K or V being the rank's (b, s/cp, d/tp)
    (its positions of its tp rank's heads):
    allgather 2 Allgathers of (b, s, d/tp) forward and 2 Reduce_scatters backward; ring and
    zigzag 2 (cp-1) Isend/Irecv pairs of a block forward (K, V, posted under the compute),
    backward 2 (cp-1) more (K, V) and 2 (cp-1) Sendrecv (dK, dV follow) and 2 more (dK,
    dV home); Ulysses 4 Alltoalls of a block forward (q, k, v, the output) and 4
    backward. --recompute selective or full runs the forward exchange
    once more in the backward (the gathered keys are not kept: docs/design.md)."""
    times = len(shape.blocks) * plan.microbatches
    block = tokens_per_microbatch(w, plan) * w.d_model // plan.tp   # (b, s/cp, d/tp)
    forwards = 1 if plan.recompute == "none" else 2
    if plan.cp_mode == "allgather":
        return [Traffic("cp", op, 2 * n * times, 2 * n * times * plan.cp * block,
                        2 * n * times * plan.cp * block * w.act_bytes)
                for op, n in (("Allgather", forwards), ("Reduce_scatter", 1))]
    if plan.cp_mode == "ulysses":
        calls = times * (4 * forwards + 4)
        return [Traffic("cp", "Alltoall", calls, calls * block, calls * block * w.act_bytes)]
    posted = times * (2 * (plan.cp - 1) * forwards + 2 * (plan.cp - 1))   # K, V ahead
    following = times * (2 * (plan.cp - 1) + 2)                            # dK, dV
    return [Traffic("cp", op, n, n * block, n * block * w.act_bytes)
            for op, n in (("Isend", posted), ("Irecv", posted), ("Sendrecv", following))]
