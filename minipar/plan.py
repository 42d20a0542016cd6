"""Planning a job at real scale: which (dp, tp, pp, cp, ep, ZeRO, M, recompute) to run.

What this file teaches: the source text's comparison of DP, TP, EP and PP ends in
rules of thumb -- TP inside a node (it "usually stops at 8-16 GPUs"), PP across
nodes (mind the bubble), EP for MoE (AllToAll is "very heavy"), DP for the rest.
Here they are checked, not believed: every mesh that fills the GPUs is priced by
the cost model (costmodel.py: ZeRO's memory, Megatron's activations; timemodel.py:
the ledger of every collective, the bubble formula, an alpha-beta network) and the plans
are ranked by step time; the ones that do not fit are counted by reason. The
levers: the mesh (tp, cp, pp, dp, and ep over the tp x cp x dp ranks of a stage: TP
for attention, EP for experts), the ZeRO stage, the microbatches, the recomputation
(none, selective, full) and the pipeline schedule (1F1B, interleaved). Models and
clusters come from presets.py (each with its source) or from flags; every size is
stated or derived, and printed.

    python -m minipar plan --preset llama3-405b --cluster h100 --gpus 8192 \\
        --global-batch 2048                          # rank every plan
    python -m minipar plan --preset llama3-405b --cluster h100 --global-batch 2048 \\
        --dp 64 --tp 8 --pp 16                       # price the one Llama 3 ran

The same arithmetic predicts minipar's own 8-rank runs exactly
(`minipar_workload`, tests/test_plan.py), which is what licenses it at 2048 GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import product
from pathlib import Path

import numpy as np

from minipar.config import ConfigError, TrainConfig, _Parser  # _Parser: raises, one line
from minipar.costmodel import (
    Block,
    Plan,
    RankShape,
    Workload,
    model_states,
    rank_shape,
    stage_activations,
)
from minipar.memory import ModelStates, optimizer_bytes_per_param, wire_elements
from minipar.nn import canonical_shapes
from minipar.parallel.pipeline_schedules import SCHEDULES, SIMULATED_ONLY, bubble_formula
from minipar.presets import CLUSTERS, MODELS, Cluster, Model
from minipar.timemodel import Hardware, Timing, group_layout, step_timing, traffic

GB = 1e9


# ------------------------------------------------------------ workloads
def layer_sizes(m: Model) -> dict[str, int]:
    """The widths a layer of `m` is built from: query and key+value widths, the norms'
    parameters, attention's parameters (multi-head: Q, K, V, O and, gpt style, their
    biases; or `m.attention`), and one FFN of width f as a function."""
    hd = m.head_dim or m.d_model // m.heads
    q_width, kv_width = m.heads * hd, 2 * (m.kv_heads or m.heads) * hd
    gpt, d = m.style == "gpt", m.d_model
    norm = 2 * d if gpt else d                      # LayerNorm: weight + bias; RMSNorm: weight
    attention = m.attention or (2 * d * q_width + d * kv_width
                                + (q_width + kv_width + d if gpt else 0))
    return dict(q_width=q_width, kv_width=kv_width, norm=norm, attention=attention,
                head_dim=hd)


def ffn_params(m: Model, width: int) -> int:
    """One FFN of `width`: ffn_matrices d x width matrices (and, gpt style, biases)."""
    biases = (m.ffn_matrices - 1) * width + m.d_model if m.style == "gpt" else 0
    return m.ffn_matrices * m.d_model * width + biases


def transformer(m: Model, batch: int, params: float | None = None) -> Workload:
    """`m` in bf16 with Adam (2 + 2 + 12 bytes a parameter), `batch` sequences a step.

    Per layer: two norms, attention (cut by tp), an FFN of ffn_matrices d x d_ff
    matrices, or from layer dense_layers on an MoE FFN: a router (d E), E routed experts
    and the shared ones. Embedding (and gpt style learned positions) on the first stage,
    the final norm and the head on the last, both vocabulary-parallel over tp. If
    `params` is given it must agree with the count the shapes define (within 5%: published
    counts are rounded), or a ValueError says by how much it does not.

    Activations, bytes per token and layer (Korthikanti et al. 2022, generalized): TP
    leaves whole the norms' inputs and outputs 8d (gpt style + 2d of dropout masks: the
    paper's 10d); it cuts Q, K, V and the attention output 4 q + 2 kv (8d for multi-head),
    the FFN's 2 d_ff ffn_matrices (16d for a 4d GELU MLP: the paper's 24d in all), the
    scores 5as with dropout, 2as without, nothing with FlashAttention-style attention
    (4a bytes of fp32 softmax statistics). An MoE layer keeps per routed copy 4d +
    2 fe ffn_matrices, and 2 fe ffn_matrices per shared expert. Selective recomputation
    drops the scores (Korthikanti et al.) and, llama style, what Megatron-Core and
    DeepSeek-V3 also recompute: the norms' outputs (4d) and the FFN's activation function
    (its 2 d_ff output): elementwise work, nearly free in FLOPs."""
    sizes, d, s = layer_sizes(m), m.d_model, m.seq_len
    gpt, flash = m.style == "gpt", m.style == "llama"
    q, kv = sizes["q_width"], sizes["kv_width"]
    norms, bias = (2 * sizes["norm"], False), ((d, False),) if gpt else ()
    attention = (sizes["attention"] - (d if gpt else 0), True)
    scores = 4 * m.heads if flash else (5 if gpt else 2) * m.heads * s
    base = dict(act_replicated=(10 if gpt else 8) * d, act_scores=scores, act_input=2 * d,
                kv_width=kv, attn_flops=4 * s * q, cheap_replicated=0 if gpt else 4 * d)
    attend = 4 * q + 2 * kv
    ffn = ffn_params(m, m.d_ff)
    dense = Block((norms, attention, *bias, (ffn - (d if gpt else 0), True), *bias),
                  act_split=attend + 2 * m.d_ff * m.ffn_matrices, tp_reductions=2,
                  cheap_split=0 if gpt else 2 * m.d_ff, **base)
    moe_layers = m.layers - m.dense_layers if m.experts else 0
    blocks = [dense] * (m.layers - moe_layers)
    if moe_layers:
        expert, fe = ffn_params(m, m.expert_d_ff), m.expert_d_ff
        routed = m.top_k * (4 * d + 2 * fe * m.ffn_matrices)
        shared = m.shared_experts * 2 * fe * m.ffn_matrices
        arrays = (norms, attention, *bias, (d * m.experts, False))
        arrays += ((m.shared_experts * expert, True),) if m.shared_experts else ()
        blocks += [Block(arrays, (expert,), m.experts, m.top_k,
                         tp_reductions=1 + (m.shared_experts > 0),
                         act_split=attend + routed + shared,
                         cheap_split=0 if gpt else 2 * fe * (m.top_k + m.shared_experts),
                         **base)] * moe_layers
    embed = ((m.vocab * d, True),) + (((s * d, False),) if gpt else ())
    head = ((m.vocab * d, True), (sizes["norm"], False))
    splits = (m.d_ff, m.heads, m.kv_heads or m.heads) + (
        (m.expert_d_ff,) if m.shared_experts else ())
    w = Workload(m.name, tuple(blocks), embed, head, d, batch, s, split_dims=splits,
                 lookup_embedding=True, tied_head=m.tied, logit_bytes=4 * m.vocab)
    if params is not None and abs(params / w.params - 1) > 0.05:
        raise ValueError(f"--params {params:.4g} disagrees with the {w.params:.4g} the shapes "
                         f"define ({params / w.params - 1:+.0%}); drop --params or fix a shape")
    return w


def minipar_workload(cfg: TrainConfig) -> Workload:
    """minipar's own model (nn.canonical_shapes) in its dtype and optimizer: the arrays
    exactly as its ranks hold them (fc1 and fc2's weight cut by tp, fc2's bias and the
    LayerNorm whole). Activations: its saved tensors counted by hand per row, 2d
    (h, LN(h)) whole and 2f (fc1's output, GELU's) cut by tp; per MoE assignment
    2d + 2fe; gpt-moe adds 6d per position (h, LN1, q, k, v, o) and its
    probabilities, H T per position: estimates. The dense transformer's block is
    exact: recompute.gpt_block_activation_bytes, every layout and recompute mode
    (tests/test_gpt_tensor_parallel.py). The transformer's rows are its B*T positions
    (seq_len = T)."""
    model = cfg.model_config()
    shapes = {name: math.prod(shape) for name, shape in canonical_shapes(model).items()}
    itemsize = np.dtype(cfg.dtype).itemsize
    cut = ("fc1.weight", "fc1.bias", "fc2.weight")
    if model.is_gpt:  # by heads: q, k, v columns with their biases, proj rows
        cut += tuple(f"attn.{part}.{kind}" for part in "qkv" for kind in ("weight", "bias"))
        cut += ("attn.proj.weight",)
    d, f, fe = cfg.d_model, cfg.d_ff, cfg.expert_d_ff
    attention = dict(act_scores=model.heads * model.seq_len * itemsize) if model.is_gpt else {}
    extra = 6 * d if model.is_gpt else 0
    # Megatron's reduction points per direction: the MLP block's FFN 1, the transformer's
    # attention 1 and dense FFN 1; the MoE FFN is not split over tp
    reductions = {"mlp": 1, "moe": 0, "gpt": 2, "gpt-moe": 1}[cfg.model]
    blocks = []
    for i in range(cfg.layers):
        mine = [n for n in shapes if n.startswith(f"blocks.{i}.") and ".experts." not in n]
        arrays = tuple((shapes[n], n.endswith(cut) and cfg.model in ("mlp", "gpt", "gpt-moe")
                        and ".experts." not in n) for n in mine)
        if model.is_moe:
            expert = tuple(shapes[n] for n in shapes if n.startswith(f"blocks.{i}.experts.0."))
            # under SP the MoE FFN gathers all positions first: only LN1 and proj's bias
            # (3d) see my positions alone
            blocks.append(Block(arrays, expert, cfg.experts, cfg.top_k, reductions,
                                act_replicated=(2 * d + extra + cfg.experts) * itemsize,
                                act_split=cfg.top_k * (2 * d + 2 * fe) * itemsize,
                                act_input=d * itemsize,
                                capacity=cfg.capacity_factor is not None,
                                sp_gathers=int(model.is_gpt), sp_partial=3 * d, **attention))
        elif model.is_gpt:  # exactly what its tape keeps (recompute.py counts it)
            blocks.append(Block(arrays, tp_reductions=reductions,
                                act_replicated=(8 * d + 2) * itemsize,
                                act_split=(4 * d + 3 * f) * itemsize,
                                act_scores=(d + model.heads * (model.seq_len + 1)) * itemsize,
                                act_input=d * itemsize, act_tp_whole=4 * d * itemsize,
                                act_sp_cut=2 * d * itemsize))
        else:
            blocks.append(Block(arrays, tp_reductions=reductions,
                                act_replicated=(2 * d + extra) * itemsize,
                                act_split=2 * f * itemsize, act_input=d * itemsize,
                                **attention))
    first = ("tok_embed.weight", "pos_embed.weight") if model.is_gpt else (
        "embed.weight", "embed.bias")
    last = ("ln_f.weight", "ln_f.bias", "head.weight", "head.bias") if model.is_gpt else (
        "head.weight", "head.bias")
    vocab = bool(cfg.vocab_parallel)  # tok rows and the head's columns over tp
    split = {"tok_embed.weight", "head.weight", "head.bias"} if vocab else set()
    sp = cfg.sp and vocab  # partial over tp: pos rows of my positions, ln_f on them
    return Workload(f"minipar {cfg.model}", tuple(blocks),
                    tuple((shapes[n], n in split) for n in first),
                    tuple((shapes[n], n in split) for n in last), d,
                    cfg.batch, model.seq_len if model.is_gpt else 1, itemsize, itemsize,
                    optimizer_bytes_per_param(cfg.optimizer, itemsize), itemsize, 8,
                    cfg.bucket_size, split_dims=(f,) if cfg.model == "mlp" else (),
                    lookup_embedding=model.is_gpt, vocab_parallel=vocab,
                    sp_partial_embed=shapes["pos_embed.weight"] if sp else 0,
                    sp_partial_head=2 * d if sp else 0, experts_over_tp=False)


def plan_of(cfg: TrainConfig) -> Plan:
    """The plan a resolved `python -m minipar train` config runs."""
    return Plan(cfg.dp, cfg.tp, cfg.pp, cfg.ep, cfg.zero, cfg.microbatches, cfg.sp,
                cfg.schedule, cfg.virtual, cfg.recompute, cfg.grad_sync, cfg.cp,
                cfg.cp_mode)


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
    return estimate



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
    """Every k that divides n, smallest first."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def mesh_problem(w: Workload, plan: Plan) -> str | None:
    """Why a mesh cannot run this workload at all (None if it can)."""
    moe = [b for b in w.blocks if b.moe]
    if w.batch % plan.dp:
        return "dp does not divide the global batch"
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


def meshes(w: Workload, world: int, fixed: dict[str, int]) -> list[tuple[int, ...]]:
    """Every (dp, tp, pp, cp, ep) with dp tp pp cp = world, ep | tp cp dp (1 for a dense
    model), that agrees with the `fixed` ones."""
    moe = any(b.moe for b in w.blocks)
    out = []
    for tp in divisors(world):
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                for ep in divisors(tp * cp * dp) if moe else [1]:
                    mesh = dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
                    if all(mesh[k] == v for k, v in fixed.items() if k in mesh):
                        out.append((dp, tp, pp, cp, ep))
    return out


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
    for (dp, tp, pp, cp, ep), (schedule, virtual) in product(meshes(w, world, fixed),
                                                              schedules):
        counts = divisors(w.batch // dp) if w.batch % dp == 0 else [1]
        if "microbatches" in fixed:
            counts = [m for m in counts if m == fixed["microbatches"]] or [fixed["microbatches"]]
        for m in counts:
            mesh = replace(template, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, microbatches=m,
                           sp=template.sp and tp > 1, schedule=schedule, virtual=virtual)
            problem = mesh_problem(w, mesh)
            if problem:
                found.rejected[problem] += len(zero_stages) * len(recomputes)
                continue
            for zero in zero_stages:
                for recompute in recomputes:
                    estimate = evaluate(w, hw, replace(mesh, zero=zero, recompute=recompute))
                    if estimate.timing is None:
                        found.rejected[f"needs more than {usable(hw) / GB:g} GB per GPU"] += 1
                        found.too_big.append(estimate)
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
                    cluster.latency_us * 1e-6, headroom * GB)


def usable(hw: Hardware) -> float:
    """Bytes a plan may use on one GPU: its memory less the framework's headroom."""
    return hw.gpu_memory - hw.headroom


# ------------------------------------------------------------ the report
# How far the step times may be off: the largest error against Megatron-LM's Table 1
# (tests/test_plan.py checks every row against it), rounded up.
STEP_TIME_ERROR = 0.25


def model_flops(w: Workload) -> float:
    """Model FLOPs of a step, without recomputation (PaLM's MFU count): per token 6 per
    parameter it multiplies by, and 3 x attention's QK^T and AV."""
    per_token = 6 * w.flop_params + 3 * sum(b.attn_flops for b in w.blocks)
    return per_token * w.batch * w.seq_len


def mfu(w: Workload, hw: Hardware, world: int, step: float) -> float:
    """Model FLOPs utilization: model FLOPs of a step over step x GPUs x peak."""
    return model_flops(w) / (step * world * hw.flops)


WIRE_AXES = ("tp", "cp", "dp", "edp", "pp", "ep")


def row(e: Estimate, w: Workload, hw: Hardware) -> str:
    p, s, t = e.plan, e.states, e.timing
    wire = " ".join(f"{e.wire.get(a, 0.0) / GB:6.1f}" for a in WIRE_AXES)
    return (f"{p.dp:5d} {p.tp:3d} {p.pp:3d} {p.cp:3d} {p.ep:3d} {p.zero:4d} {p.microbatches:5d}"
            f" {p.recompute[:4]:>4} {schedule_tag(p):>5} | {s.params / GB:6.1f} {s.grads / GB:6.1f}"
            f" {s.optimizer / GB:6.1f} {e.activations / GB:6.1f} {e.memory / GB:6.1f} |"
            f" {wire} | {e.bubble:6.1%} | {t.total:8.3f} {mfu(w, hw, p.world, t.total):5.1%}")


def schedule_tag(p: Plan) -> str:
    """1f1b, gpipe, zb-h1, or i<V> for the interleaved schedule with V chunks a rank."""
    return f"i{p.virtual}" if p.schedule == "interleaved" else p.schedule


def header() -> str:
    wire = " ".join(f"{a:>6}" for a in WIRE_AXES)
    return (f"{'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'zero':>4} {'M':>5} {'rc':>4} "
            f"{'sched':>5} | "
            f"{'params':>6} {'grads':>6} {'optim':>6} {'activ':>6} {'total':>6} | {wire} | "
            f"{'bubble':>6} | {'step s':>8} {'MFU':>5}")


def memory_line(e: Estimate, hw: Hardware) -> str:
    s = e.states
    return (f"  memory per GPU: params {s.params / GB:.2f} + grads {s.grads / GB:.2f} + "
            f"optimizer {s.optimizer / GB:.2f} + activations {e.activations / GB:.2f}"
            + (f" + one gathered piece {e.gathered / GB:.2f}" if e.gathered else "")
            + f" = {e.memory / GB:.2f} GB of the {usable(hw) / GB:g} usable "
            f"({hw.gpu_memory / GB:g} less {hw.headroom / GB:g} of headroom)")


def explain(e: Estimate, w: Workload, hw: Hardware) -> list[str]:
    """The numbers behind one plan, in words: memory, wire bytes per axis, time."""
    p = e.plan
    lines = [f"{p.label()}" + (" +SP" if p.sp else "") + f" ({p.schedule}, recompute "
             f"{p.recompute})", memory_line(e, hw)]
    t = e.timing
    if t is None:
        over = e.memory - usable(hw)
        biggest = max(("model states", e.states.total), ("activations", e.activations),
                      ("the gathered ZeRO piece", e.gathered), key=lambda kv: kv[1])
        return lines + [f"  does not fit: {over / GB:.2f} GB too much; the largest part is "
                        f"{biggest[0]} ({biggest[1] / GB:.2f} GB)"]
    wire = ", ".join(f"{axis} {e.wire[axis] / GB:.2f}" for axis in WIRE_AXES if axis in e.wire)
    inside = " + ".join(f"{axis} {sec:.3f}" for axis, sec in sorted(t.pipeline_comm.items()))
    after = " + ".join(f"{axis} {sec:.3f}" for axis, sec in sorted(t.step_comm.items()))
    return lines + [
        f"  wire GB per GPU per step: {wire or 'none'}",
        f"  step {t.total:.3f} s = busiest stage's compute {t.compute:.3f}"
        + (f" + communication in the pipeline ({inside})" if inside else "")
        + f", + bubble {t.bubble:.3f} ({e.bubble:.1%})"
        + (f", + after the pipeline ({after})" if after else "")
        + f"; MFU {mfu(w, hw, p.world, t.total):.1%}"]


def describe(w: Workload, m: Model, hw: Hardware, world: int) -> list[str]:
    """The job as the planner understood it: every size, stated or derived."""
    sizes, nodes = layer_sizes(m), math.ceil(world / hw.node_size)
    moe = (f"; MoE from layer {m.dense_layers}: {m.experts} experts of {m.expert_d_ff}, top "
           f"{m.top_k}, {m.shared_experts} shared" if m.experts else "")
    return [f"plan for {w.name}: {w.params / 1e9:.1f} B parameters "
            f"({w.active_params / 1e9:.1f} B active per token), {w.batch} x {w.seq_len} "
            "tokens per step",
            f"  {m.layers} layers, d {m.d_model}, {m.heads} heads of {sizes['head_dim']} "
            f"({m.kv_heads or m.heads} key/value heads), d_ff {m.d_ff} x {m.ffn_matrices} "
            f"matrices, vocabulary {m.vocab}{' (tied head)' if m.tied else ''}, {m.style} style"
            f" ({'FlashAttention' if m.style == 'llama' else 'stored scores'}){moe}",
            f"on {world} GPUs ({nodes} nodes of {hw.node_size}): {hw.gpu_memory / GB:g} GB "
            f"(plans may use {usable(hw) / GB:g}), {hw.flops / 1e12:g} TFLOP/s at "
            f"{hw.efficiency:.0%}, in-node {hw.intra_bw / GB:g} GB/s, between nodes "
            f"{hw.inter_bw / GB:g} GB/s, alpha {hw.latency * 1e6:g} us",
            f"  step times are estimates, good to about +-{STEP_TIME_ERROR:.0%} against "
            "Megatron-LM's published runs; no communication overlaps compute"]


def report(found: Search, w: Workload, m: Model, hw: Hardware, world: int, template: Plan,
           top: int = 10) -> str:
    """The ranking: the job, the fastest plan of each mesh, the top three explained, and
    the plans that cannot run counted by reason."""
    lines = describe(w, m, hw, world)
    lines.append(f"  SP {'on' if template.sp else 'off'} with tp > 1; rc: recomputation "
                 "(none, selective: the attention and elementwise parts, full: the layers); "
                 "sched: pipeline schedule (iV: interleaved, V chunks a rank)")
    fastest = distinct_meshes(found.feasible)
    lines += [f"{len(found.feasible)} plans fit on {len(fastest)} meshes; the fastest plan of "
              "each mesh, fastest first (memory GB per GPU; wire GB per GPU per step):",
              header()]
    lines += [row(e, w, hw) for e in fastest[:top]]
    if len(fastest) > top:
        lines.append(f"  ... {len(fastest) - top} more meshes (--top N shows N, --json all)")
    for rank, e in enumerate(fastest[:3], 1):
        first, *rest = explain(e, w, hw)
        lines += [f"#{rank}: {first}", *rest]
    lines.append(f"{sum(found.rejected.values())} plans cannot run:")
    lines += [f"  {count:7d}  {reason}" for reason, count in found.rejected.most_common()]
    if found.too_big:
        e = found.too_big[0]
        lines.append(f"  the closest miss: {e.plan.label()} needs {e.memory / GB:.1f} GB")
    return "\n".join(lines)


def named_report(found: Search, w: Workload, m: Model, hw: Hardware, world: int) -> str:
    """One named plan: the fastest variant that fits (or the smallest that does not),
    with its memory, wire bytes per axis, bubble and time, and the other variants."""
    lines = describe(w, m, hw, world)
    if found.feasible:
        best = found.feasible[0]
        lines += ["the plan you named fits; its fastest variant:", *explain(best, w, hw)]
    else:
        best = found.too_big[0]
        lines += ["the plan you named does not fit; its smallest variant:",
                  *explain(best, w, hw)]
    others = found.feasible[1:] + found.too_big[0 if found.feasible else 1:]
    if others:
        lines += [f"{len(others)} other variants (ZeRO stage, M, recomputation):", header()]
        for e in found.feasible[1:6]:
            lines.append(row(e, w, hw))
        lines += [f"  {e.plan.label()} recompute {e.plan.recompute}: needs "
                  f"{e.memory / GB:.1f} GB" for e in others if e.timing is None][:5]
    return "\n".join(lines)


def plan_record(e: Estimate, w: Workload, hw: Hardware) -> dict:
    """Every field of a table row, for `--json`: GB, GB on the wire, seconds."""
    p, t = e.plan, e.timing
    return {**{k: getattr(p, k) for k in (*MESH, "zero", "microbatches", "recompute", "sp",
                                          "schedule", "virtual")},
            "memory_gb": {"params": e.states.params / GB, "grads": e.states.grads / GB,
                          "optimizer": e.states.optimizer / GB,
                          "activations": e.activations / GB, "gathered": e.gathered / GB,
                          "total": e.memory / GB},
            "wire_gb": {axis: value / GB for axis, value in e.wire.items()},
            "bubble": e.bubble, "step_s": t.total, "compute_s": t.compute,
            "pipeline_comm_s": t.pipeline_comm, "step_comm_s": t.step_comm,
            "bubble_s": t.bubble, "mfu": mfu(w, hw, p.world, t.total)}


# ------------------------------------------------------------ the command
def count(text: str) -> float:
    """A number of parameters: 70e9, 70B, 671B, 1.5T (positive)."""
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    suffix = text[-1:].upper()
    try:
        value = float(text[:-1]) * units[suffix] if suffix in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of parameters (got {text!r}; "
                                         "try 70e9 or 70B)") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number (got {text})")
    return value


def number(kind: type, low: float, strict: bool = True) -> object:
    """An argparse type: a `kind` number above `low` (or at least, if not strict), finite."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a{' whole' if kind is int else ''} number (got {text!r})") from None
        if not (value > low if strict else value >= low) or not value < math.inf:
            raise argparse.ArgumentTypeError(
                f"must be {'more than' if strict else 'at least'} {low:g} (got {text})")
        return value
    parse.__name__ = kind.__name__
    return parse


POSITIVE, COUNT, AMOUNT = number(int, 0), number(int, 0, strict=False), number(float, 0)

MODEL_FLAGS = {  # flag field -> (type, help)
    "layers": (POSITIVE, "transformer layers"),
    "d_model": (POSITIVE, "model width d"),
    "heads": (POSITIVE, "attention (query) heads"),
    "kv_heads": (POSITIVE, "key/value heads (grouped-query attention; default: --heads)"),
    "head_dim": (POSITIVE, "width of a head (default: d / heads)"),
    "d_ff": (POSITIVE, "FFN width of a dense layer"),
    "vocab": (POSITIVE, "vocabulary size"),
    "seq_len": (POSITIVE, "tokens per sequence"),
    "ffn_matrices": (POSITIVE, "matrices per FFN: 2 (GELU MLP) or 3 (SwiGLU)"),
    "experts": (COUNT, "routed experts per MoE layer (0: a dense model)"),
    "top_k": (COUNT, "routed experts per token"),
    "expert_d_ff": (POSITIVE, "FFN width of one expert"),
    "shared_experts": (COUNT, "always-on experts per MoE layer"),
    "dense_layers": (COUNT, "leading layers with a dense FFN in an MoE model"),
    "attention": (POSITIVE, "parameters of one layer's attention, if it is not multi-head "
                            "(DeepSeek's MLA); default: from the heads"),
}
CLUSTER_FLAGS = {
    "gpu_memory": (AMOUNT, "GB per GPU"),
    "flops": (AMOUNT, "peak dense bf16 TFLOP/s per GPU"),
    "intra_bw": (AMOUNT, "GB/s per GPU and direction inside a node (NVLink)"),
    "inter_bw": (AMOUNT, "GB/s per GPU and direction between nodes (its NIC)"),
    "node_size": (POSITIVE, "GPUs per node"),
    "latency_us": (number(float, 0, strict=False), "alpha: microseconds per message step "
                                                   "(default 5)"),
}


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m minipar plan",
                     description="Rank every way to split a training step over the GPUs, "
                     "or price one plan you name.")
    add = parser.add_argument
    add("--preset", choices=sorted(MODELS), help="a published model (its sizes are the "
        "defaults of the model flags)")
    add("--cluster", choices=sorted(CLUSTERS), help="a published GPU and node (its numbers "
        "are the defaults of the hardware flags)")
    add("--params", type=count, help="total parameters (70e9, 671B): checked against the "
        "count the shapes define (5%%), which is used")
    for name, (kind, text) in MODEL_FLAGS.items():
        add(f"--{name.replace('_', '-')}" + ("-params" if name == "attention" else ""),
            dest=name, type=kind, help=text)
    add("--style", choices=("gpt", "llama"), help="gpt: LayerNorm, biases, learned positions, "
        "dropout, stored attention scores; llama: RMSNorm, no biases, rotary, no dropout, "
        "FlashAttention-style attention")
    add("--tied-head", action=argparse.BooleanOptionalAction, default=None,
        help="the output head shares the embedding's matrix")
    for name, (kind, text) in CLUSTER_FLAGS.items():
        add(f"--{name.replace('_', '-')}", type=kind, help=text)
    add("--efficiency", type=number(float, 0), default=0.5,
        help="fraction of peak FLOP/s the matrix products reach (default 0.5)")
    add("--memory-headroom", type=number(float, 0, strict=False),
        help="GB of each GPU left to the framework: CUDA context, NCCL buffers, allocator "
        "fragmentation (default 10%% of --gpu-memory)")
    add("--gpus", type=POSITIVE, help="GPUs in the job (default: the product of a named "
        "--dp --tp --pp --cp)")
    add("--global-batch", type=POSITIVE, required=True, help="sequences per step")
    # the V schedules (zb-v, dualpipev) and dualpipe are left out: the planner's time
    # model has no closed-form bubble for them (pipeline_schedules.bubble_formula)
    add("--schedule", choices=[s for s in SCHEDULES if s not in SIMULATED_ONLY],
        action="append", help="pipeline schedules to "
        "consider (repeat the flag; default 1f1b and interleaved)")
    add("--virtual", type=POSITIVE, action="append", help="model chunks per pipeline rank "
        "for --schedule interleaved (repeat the flag; default 2 and 4)")
    add("--no-sp", action="store_true", help="no sequence parallelism with tp > 1")
    for axis, text in (("dp", "data-parallel"), ("tp", "tensor-parallel"),
                       ("pp", "pipeline-parallel"), ("cp", "context-parallel"),
                       ("ep", "expert-parallel")):
        add(f"--{axis}", type=POSITIVE, help=f"fix the {text} degree (a named plan)")
    add("--microbatches", type=POSITIVE, help="fix the microbatches per step M")
    add("--zero", type=int, action="append", choices=(0, 1, 2, 3),
        help="ZeRO stages to consider (repeat the flag; default all)")
    add("--recompute", action="append", choices=RECOMPUTE,
        help="recomputations to consider (repeat the flag; default all three)")
    add("--top", type=POSITIVE, default=10, help="meshes to list (default 10)")
    add("--json", metavar="PATH", help="write every plan that fits, fastest first, with "
        "every field of the table (- for standard output, instead of the table)")
    return parser


def resolve_model(args: argparse.Namespace) -> tuple[Model | None, list[str]]:
    """The model: the preset's sizes, overridden by every model flag given."""
    given = {name: getattr(args, name) for name in (*MODEL_FLAGS, "style")
             if getattr(args, name) is not None}
    if args.tied_head is not None:
        given["tied"] = args.tied_head
    if args.preset:
        m = replace(MODELS[args.preset], **given)
    else:
        missing = [f"--{n.replace('_', '-')}" for n in ("layers", "d_model", "heads", "d_ff",
                                                        "vocab", "seq_len", "ffn_matrices",
                                                        "style") if n not in given]
        if missing:
            return None, [f"{', '.join(missing)} required (or name a --preset: "
                          f"{', '.join(sorted(MODELS))})"]
        m = Model("a transformer", **given)
    return m, model_problems(m)


def model_problems(m: Model) -> list[str]:
    """Every reason the sizes describe no model (each names its flag)."""
    out = []
    if m.ffn_matrices not in (2, 3):
        out.append(f"--ffn-matrices must be 2 (GELU MLP) or 3 (SwiGLU) (got {m.ffn_matrices})")
    if not m.head_dim and m.d_model % m.heads:
        out.append(f"--heads {m.heads} does not divide --d-model {m.d_model} (or give "
                   "--head-dim)")
    if m.kv_heads and m.heads % m.kv_heads:
        out.append(f"--kv-heads {m.kv_heads} does not divide --heads {m.heads}")
    if m.experts:
        if not 1 <= m.top_k <= m.experts:
            out.append(f"--top-k must be between 1 and --experts {m.experts} (got {m.top_k})")
        if not m.expert_d_ff:
            out.append("--experts needs an --expert-d-ff")
        if m.dense_layers >= m.layers:
            out.append(f"--dense-layers {m.dense_layers} leaves no MoE layer of {m.layers}")
    elif m.top_k or m.expert_d_ff or m.shared_experts or m.dense_layers:
        out.append("--top-k / --expert-d-ff / --shared-experts / --dense-layers need --experts")
    return out


def resolve_hardware(args: argparse.Namespace) -> tuple[Hardware | None, list[str]]:
    """The hardware: the cluster preset's numbers, overridden by every hardware flag."""
    given = {n: getattr(args, n) for n in CLUSTER_FLAGS if getattr(args, n) is not None}
    if args.cluster:
        c = replace(CLUSTERS[args.cluster], **given)
    else:
        missing = [f"--{n.replace('_', '-')}" for n in ("gpu_memory", "flops", "intra_bw",
                                                        "inter_bw") if n not in given]
        if missing:
            return None, [f"{', '.join(missing)} required (or name a --cluster: "
                          f"{', '.join(sorted(CLUSTERS))})"]
        c = Cluster("a cluster", **given)
    out = []
    if args.efficiency > 1:
        out.append(f"--efficiency is a fraction of peak: at most 1 (got {args.efficiency})")
    headroom = 0.1 * c.gpu_memory if args.memory_headroom is None else args.memory_headroom
    if headroom >= c.gpu_memory:
        out.append(f"--memory-headroom {headroom:g} leaves nothing of --gpu-memory "
                   f"{c.gpu_memory:g}")
    return hardware(c, args.efficiency, headroom), out


def run_problems(args: argparse.Namespace, m: Model) -> list[str]:
    """Every reason the run flags describe no job."""
    out = []
    named = [args.dp, args.tp, args.pp]
    if args.gpus is None and None in named:
        out.append("--gpus required (or name the whole mesh: --dp --tp --pp, and --cp)")
    elif args.gpus is None:
        args.gpus = math.prod(named) * (args.cp or 1)
    elif None not in named and math.prod(named) * (args.cp or 1) != args.gpus:
        out.append(f"--dp x --tp x --pp x --cp = {math.prod(named) * (args.cp or 1)} is not "
                   f"--gpus {args.gpus}")
    for axis in MESH:
        if getattr(args, axis) and args.gpus and args.gpus % getattr(args, axis):
            out.append(f"--{axis} {getattr(args, axis)} does not divide --gpus {args.gpus}")
    if args.ep and args.ep > 1 and not m.experts:
        out.append(f"--ep {args.ep} needs a model with --experts")
    schedules = args.schedule or ["1f1b", "interleaved"]
    if args.virtual and "interleaved" not in schedules:
        out.append(f"--virtual {args.virtual[0]} needs --schedule interleaved")
    if args.virtual and min(args.virtual) < 2:
        out.append("--virtual must be at least 2 (1 is --schedule 1f1b)")
    if args.microbatches and args.dp and args.global_batch % (args.dp * args.microbatches):
        out.append(f"--dp {args.dp} x --microbatches {args.microbatches} does not divide "
                   f"--global-batch {args.global_batch}")
    return out


def plan_command(argv: list[str]) -> int:
    """`python -m minipar plan ...`: print the ranking; a bad flag is one line, exit 2."""
    errors: list[str] = []
    try:
        args = make_parser().parse_args(argv)
        m, errors = resolve_model(args)
        if not errors:
            hw, errors = resolve_hardware(args)
        if not errors:
            errors = run_problems(args, m)
        if not errors:
            w = transformer(m, args.global_batch, args.params)
    except (ConfigError, ValueError) as error:
        errors = [str(error)]
    if errors:
        print(f"minipar: error: {errors[0]}", file=sys.stderr, flush=True)
        return 2
    template = Plan(1, sp=not args.no_sp)
    schedules = tuple((s, v) for s in dict.fromkeys(args.schedule or ["1f1b", "interleaved"])
                      for v in (sorted(set(args.virtual or [2, 4])) if s == "interleaved"
                                else [1]))
    fixed = {k: getattr(args, k) for k in (*MESH, "microbatches") if getattr(args, k)}
    named = all(k in fixed for k in ("dp", "tp", "pp"))
    if named:
        fixed.setdefault("cp", 1)
        fixed.setdefault("ep", 1)
        plan = replace(template, **{k: v for k, v in fixed.items() if k in MESH},
                       microbatches=fixed.get("microbatches", 1),
                       sp=template.sp and fixed["tp"] > 1)
        problem = mesh_problem(w, plan) if "microbatches" in fixed else mesh_problem(
            w, replace(plan, microbatches=plan.pp * (w.batch % (plan.dp * plan.pp) == 0)
                       or 1))
        if problem:
            print(f"minipar: error: the plan you named cannot run: {problem}",
                  file=sys.stderr, flush=True)
            return 2
    found = search(w, hw, args.gpus, template, tuple(sorted(set(args.zero or (0, 1, 2, 3)))),
                   tuple(dict.fromkeys(args.recompute or RECOMPUTE)), fixed, schedules)
    if args.json:
        records = [plan_record(e, w, hw) for e in found.feasible]
        text = json.dumps({"model": w.name, "gpus": args.gpus, "plans": records})
        if args.json == "-":
            print(text, flush=True)
            return 0
        Path(args.json).write_text(text + "\n")
    if named and (found.feasible or found.too_big):
        print(named_report(found, w, m, hw, args.gpus), flush=True)
    else:
        print(report(found, w, m, hw, args.gpus, template, args.top), flush=True)
    return 0
