"""Planning a job at real scale: which (dp, tp, pp, ep, ZeRO, microbatches) to run.

What this file teaches: the source text's comparison of DP, TP, EP and PP ends in
rules of thumb -- TP inside a node (it "usually stops at 8-16 GPUs"), PP across
nodes (mind the bubble), EP for MoE (AllToAll is "very heavy"), DP for the rest.
Here they are checked, not believed: every mesh that fills the GPUs is priced by
the cost model (costmodel.py: ZeRO's memory, Megatron's activations; timemodel.py:
the ledger of every collective, the bubble formula, an alpha-beta network) and the plans
are ranked by step time; the ones that do not fit are counted by reason.

    python -m minipar plan --params 70e9 --layers 80 --d-model 8192 --d-ff 28672 \\
        --gpus 512 --gpu-memory 80 --flops 989 --intra-bw 450 --inter-bw 50 \\
        --global-batch 1024 --seq-len 4096

The same arithmetic predicts minipar's own 8-rank runs exactly
(`minipar_workload`, tests/test_plan.py), which is what licenses it at 2048 GPUs.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from minipar.config import ConfigError, TrainConfig, _Parser  # _Parser: raises, one line
from minipar.costmodel import Block, Plan, Workload, model_states, rank_shape, stage_activations
from minipar.memory import ModelStates, optimizer_bytes_per_param, wire_elements
from minipar.nn import canonical_shapes
from minipar.parallel.pipeline_schedules import SCHEDULES, V_SHAPED, bubble_formula
from minipar.timemodel import Hardware, Timing, group_layout, step_timing, traffic

GB = 1e9


# ------------------------------------------------------------ workloads
def transformer(name: str, params: float, layers: int, d_model: int, batch: int,
                seq_len: int, d_ff: int | None = None, heads: int | None = None,
                vocab: int = 0, experts: int = 0, top_k: int = 0, expert_d_ff: int = 0,
                shared_experts: int = 0, dense_layers: int = 0, ffn_matrices: int = 3
                ) -> Workload:
    """A transformer of `params` parameters in bf16 with Adam (2 + 2 + 12 bytes each).

    Per layer: two norms (2d), attention (whatever --params leaves over; cut by tp),
    an FFN of `ffn_matrices` d x d_ff matrices (3: SwiGLU), or from layer
    `dense_layers` on a MoE FFN: a router (d E), E routed experts and
    `shared_experts` always-on ones of `ffn_matrices` d x expert_d_ff matrices.
    Embedding and head: vocab x d each, vocabulary-parallel over tp. Activations:
    Megatron's bytes per token, 10d that TP leaves whole, 8d + 2 d_ff ffn_matrices it
    cuts (16d for a 4d-wide GELU MLP: the paper's 24d in all), 5as attention scores;
    in a MoE layer each of the k routed copies keeps 4d + 2 fe ffn_matrices."""
    d = d_model
    d_ff = d_ff or 4 * d
    heads = heads or max(1, d // 128)
    moe_layers = layers - dense_layers if experts else 0
    expert = ffn_matrices * d * expert_d_ff
    moe_ffn = experts * expert + shared_experts * expert + d * experts
    fixed = 2 * vocab * d + layers * 2 * d + (layers - moe_layers) * ffn_matrices * d * d_ff \
        + moe_layers * moe_ffn
    attention = int((params - fixed) / layers)
    if attention <= 0:
        raise ValueError(f"--params {params:.4g} is not more than the {fixed:.4g} the other "
                         "sizes already account for (no room left for attention)")
    base = dict(tp_reductions=2, act_replicated=10 * d, act_scores=5 * heads * seq_len,
                act_input=2 * d)
    dense = Block(((2 * d, False), (attention, True), (ffn_matrices * d * d_ff, True)),
                  act_split=8 * d + 2 * d_ff * ffn_matrices, **base)
    blocks = [dense] * (layers - moe_layers)
    if moe_layers:
        routed = top_k * (4 * d + 2 * expert_d_ff * ffn_matrices)
        always = shared_experts * 2 * expert_d_ff * ffn_matrices
        blocks += [Block(((2 * d, False), (attention, True), (d * experts, False),
                          (shared_experts * expert, True)), (expert,), experts, top_k,
                         act_split=8 * d + routed + always, **base)] * moe_layers
    embed = ((vocab * d, True),) if vocab else ()
    return Workload(name, tuple(blocks), embed, embed, d, batch, seq_len,
                    split_dims=(d_ff, heads), lookup_embedding=True)


def minipar_workload(cfg: TrainConfig) -> Workload:
    """minipar's own model (nn.canonical_shapes) in its dtype and optimizer: the arrays
    exactly as its ranks hold them (fc1 and fc2's weight cut by tp, fc2's bias and the
    LayerNorm whole). Activations: its saved tensors counted by hand per row, 2d
    (h, LN(h)) whole and 2f (fc1's output, GELU's) cut by tp; per MoE assignment
    2d + 2fe; the transformer adds 6d per position (h, LN1, q, k, v, o) and its
    probabilities, H T per position. An estimate: the test checks states and ledger,
    not activations. The transformer's rows are its B*T positions (seq_len = T)."""
    model = cfg.model_config()
    shapes = {name: math.prod(shape) for name, shape in canonical_shapes(model).items()}
    itemsize = np.dtype(cfg.dtype).itemsize
    cut = ("fc1.weight", "fc1.bias", "fc2.weight")
    d, f, fe = cfg.d_model, cfg.d_ff, cfg.expert_d_ff
    attention = dict(act_scores=model.heads * model.seq_len * itemsize) if model.is_gpt else {}
    extra = 6 * d if model.is_gpt else 0
    blocks = []
    for i in range(cfg.layers):
        mine = [n for n in shapes if n.startswith(f"blocks.{i}.") and ".experts." not in n]
        arrays = tuple((shapes[n], n.endswith(cut) and cfg.model == "mlp") for n in mine)
        if model.is_moe:
            expert = tuple(shapes[n] for n in shapes if n.startswith(f"blocks.{i}.experts.0."))
            blocks.append(Block(arrays, expert, cfg.experts, cfg.top_k,
                                act_replicated=(2 * d + extra + cfg.experts) * itemsize,
                                act_split=cfg.top_k * (2 * d + 2 * fe) * itemsize,
                                act_input=d * itemsize,
                                capacity=cfg.capacity_factor is not None, **attention))
        else:
            blocks.append(Block(arrays, act_replicated=(2 * d + extra) * itemsize,
                                act_split=2 * f * itemsize, act_input=d * itemsize,
                                **attention))
    first = ("tok_embed.weight", "pos_embed.weight") if model.is_gpt else (
        "embed.weight", "embed.bias")
    last = ("ln_f.weight", "ln_f.bias", "head.weight", "head.bias") if model.is_gpt else (
        "head.weight", "head.bias")
    return Workload(f"minipar {cfg.model}", tuple(blocks),
                    tuple((shapes[n], False) for n in first),
                    tuple((shapes[n], False) for n in last), d,
                    cfg.batch, model.seq_len if model.is_gpt else 1, itemsize, itemsize,
                    optimizer_bytes_per_param(cfg.optimizer, itemsize), itemsize, 8,
                    cfg.bucket_size, split_dims=(f,) if cfg.model == "mlp" else (),
                    lookup_embedding=model.is_gpt)


def plan_of(cfg: TrainConfig) -> Plan:
    """The plan a resolved `python -m minipar train` config runs."""
    return Plan(cfg.dp, cfg.tp, cfg.pp, cfg.ep, cfg.zero, cfg.microbatches, cfg.sp,
                cfg.schedule, cfg.virtual, "none", cfg.grad_sync)


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


def evaluate(w: Workload, hw: Hardware, plan: Plan) -> Estimate:
    """Memory first (a plan that does not fit is not timed), then the ledger of each
    representative rank, its wire bytes, and the step time."""
    shapes = [rank_shape(w, plan, s) for s in representative_stages(w, plan)]
    whole = w.param_bytes * (plan.zero >= 3) + w.grad_bytes * (plan.zero >= 2)
    states, activations, gathered = max(
        ((model_states(w, plan, shape), stage_activations(w, plan, shape),
          whole * max(shape.pieces)) for shape in shapes),
        key=lambda need: need[0].total + need[1] + need[2])
    bubble = bubble_formula(plan.schedule, plan.pp, plan.microbatches, plan.virtual)
    estimate = Estimate(plan, states, activations, gathered, bubble)
    if estimate.memory > hw.gpu_memory:
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
@dataclass
class Search:
    """Every plan considered: the ones that fit (fastest first), the ones that do not
    fit in memory, and the count of the others by the reason they cannot run."""

    feasible: list[Estimate]
    too_big: list[Estimate]
    rejected: Counter


def best_by(found: Search, axis: str) -> dict[int, Estimate]:
    """For each value of a plan field ("tp", "pp", "ep", "dp", "microbatches", "zero"):
    the fastest plan that fits, or if none fits, the one that needs the least memory."""
    out: dict[int, Estimate] = {}
    for estimate in found.feasible + found.too_big:  # fastest first, then smallest
        out.setdefault(getattr(estimate.plan, axis), estimate)
    return dict(sorted(out.items()))


def divisors(n: int) -> list[int]:
    """Every k that divides n, smallest first."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def mesh_problem(w: Workload, dp: int, tp: int, pp: int, ep: int, virtual: int) -> str | None:
    """Why a mesh cannot run this workload at all (None if it can)."""
    moe = [b for b in w.blocks if b.moe]
    if w.batch % dp:
        return "dp does not divide the global batch"
    if tp > 1 and moe:
        return "tp > 1 with experts (experts are split by ep here, as in minipar)"
    if any(dim % tp for dim in w.split_dims):
        return "tp does not divide d_ff or the attention heads"
    if any(b.experts % ep for b in moe):
        return "ep does not divide the experts"
    if pp * virtual > w.layers:
        return "more pipeline stages than layers"
    return None


def search(w: Workload, hw: Hardware, world: int, template: Plan | None = None,
           zero_stages: tuple[int, ...] = (0, 1, 2, 3)) -> Search:
    """Price every (dp, tp, pp, ep, zero, M) with dp tp pp = world, ep | dp, M | B/dp.
    `template` carries the options every plan shares (schedule, virtual, recompute;
    `sp=True` turns sequence parallelism on whenever tp > 1)."""
    template = template or Plan(1)
    found = Search([], [], Counter())
    moe = any(b.moe for b in w.blocks)
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            for ep in divisors(dp) if moe else [1]:
                counts = divisors(w.batch // dp) if w.batch % dp == 0 else [1]
                problem = mesh_problem(w, dp, tp, pp, ep, template.virtual)
                if problem:
                    found.rejected[problem] += len(zero_stages) * len(counts)
                    continue
                for zero in zero_stages:
                    for m in counts:
                        if template.schedule == "interleaved" and m % pp:
                            found.rejected["interleaving needs M divisible by pp"] += 1
                            continue
                        plan = replace(template, dp=dp, tp=tp, pp=pp, ep=ep, zero=zero,
                                       microbatches=m, sp=template.sp and tp > 1)
                        estimate = evaluate(w, hw, plan)
                        if estimate.timing is None:
                            found.rejected[f"needs more than {hw.gpu_memory / GB:g} GB "
                                           "per GPU"] += 1
                            found.too_big.append(estimate)
                        else:
                            found.feasible.append(estimate)
    found.feasible.sort(key=lambda e: (e.timing.total, e.memory))
    found.too_big.sort(key=lambda e: e.memory)
    return found


# ------------------------------------------------------------ the report
def mfu(w: Workload, hw: Hardware, world: int, step: float) -> float:
    """Model FLOPs utilization: 6 x parameters multiplied per token x tokens over peak."""
    return 6 * w.flop_params * w.batch * w.seq_len / (step * world * hw.flops)


def row(e: Estimate, w: Workload, hw: Hardware) -> str:
    p, s, t = e.plan, e.states, e.timing
    wire = " ".join(f"{e.wire.get(a, 0.0) / GB:7.2f}" for a in ("tp", "dp", "edp", "pp", "ep"))
    return (f"{p.dp:5d} {p.tp:3d} {p.pp:3d} {p.ep:3d} {p.zero:4d} {p.microbatches:5d} |"
            f" {s.params / GB:6.1f} {s.grads / GB:6.1f} {s.optimizer / GB:6.1f}"
            f" {e.activations / GB:6.1f} {e.memory / GB:6.1f} | {wire} | {e.bubble:6.1%} |"
            f" {t.total:8.3f} {mfu(w, hw, p.world, t.total):5.1%}")


def explain(e: Estimate, hw: Hardware) -> list[str]:
    """The numbers behind one plan, in words."""
    p, s, t = e.plan, e.states, e.timing
    inside = " + ".join(f"{axis} {sec:.3f}" for axis, sec in sorted(t.pipeline_comm.items()))
    after = " + ".join(f"{axis} {sec:.3f}" for axis, sec in sorted(t.step_comm.items()))
    return [f"{p.label()}" + (" +SP" if p.sp else "") + f" ({p.schedule}, recompute "
            f"{p.recompute})",
            f"  memory per GPU: params {s.params / GB:.2f} + grads {s.grads / GB:.2f} + "
            f"optimizer {s.optimizer / GB:.2f} + activations {e.activations / GB:.2f}"
            + (f" + one gathered piece {e.gathered / GB:.2f}" if e.gathered else "")
            + f" = {e.memory / GB:.2f} of {hw.gpu_memory / GB:g} GB",
            f"  step {t.total:.3f} s = busiest stage's compute {t.compute:.3f}"
            + (f" + communication in the pipeline ({inside})" if inside else "")
            + f", + bubble {t.bubble:.3f} ({e.bubble:.1%})"
            + (f", + after the pipeline ({after})" if after else "")]


def report(found: Search, w: Workload, hw: Hardware, world: int, template: Plan,
           top: int = 10) -> str:
    nodes = math.ceil(world / hw.node_size)
    lines = [f"plan for {w.name}: {w.params / 1e9:.1f} B parameters "
             f"({w.active_params / 1e9:.1f} B active per token), {w.layers} layers, "
             f"d {w.d_model}; {w.batch} x {w.seq_len} tokens per step",
             f"on {world} GPUs ({nodes} nodes of {hw.node_size}): {hw.gpu_memory / GB:g} GB, "
             f"{hw.flops / 1e12:g} TFLOP/s at {hw.efficiency:.0%}, in-node "
             f"{hw.intra_bw / GB:g} GB/s, between nodes {hw.inter_bw / GB:g} GB/s, "
             f"alpha {hw.latency * 1e6:g} us",
             "activations per layer (Korthikanti et al. 2022): sbh(34 + 5as/h) bytes; TP "
             "sbh(10 + 24/t + 5as/(ht)); TP+SP all / t; selective recompute drops 5as/h;",
             f"  a stage holds its microbatches in flight ({template.schedule}); "
             f"recompute={template.recompute}, SP {'on' if template.sp else 'off'} with tp > 1",
             f"{len(found.feasible)} plans fit, fastest first (memory GB per GPU; wire GB "
             "per GPU per step):",
             f"{'dp':>5} {'tp':>3} {'pp':>3} {'ep':>3} {'zero':>4} {'M':>5} | "
             f"{'params':>6} {'grads':>6} {'optim':>6} {'activ':>6} {'total':>6} | "
             f"{'tp':>7} {'dp':>7} {'edp':>7} {'pp':>7} {'ep':>7} | {'bubble':>6} | "
             f"{'step s':>8} {'MFU':>5}"]
    shown = found.feasible if top <= 0 else found.feasible[:top]
    lines += [row(e, w, hw) for e in shown]
    if len(shown) < len(found.feasible):
        lines.append(f"  ... {len(found.feasible) - len(shown)} more (--top 0 shows all)")
    for rank, e in enumerate(found.feasible[:3], 1):
        lines += [f"#{rank}: " + explain(e, hw)[0], *explain(e, hw)[1:]]
    lines.append(f"{sum(found.rejected.values())} plans cannot run:")
    lines += [f"  {count:6d}  {reason}" for reason, count in found.rejected.most_common()]
    if found.too_big:
        e = found.too_big[0]
        lines.append(f"  the closest miss: {e.plan.label()} needs {e.memory / GB:.1f} GB")
    return "\n".join(lines)


# ------------------------------------------------------------ the command
def count(text: str) -> float:
    """A number of parameters: 70e9, 70B, 671B, 1.5T."""
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    suffix = text[-1:].upper()
    return float(text[:-1]) * units[suffix] if suffix in units else float(text)


PLAN_HELP = {
    "layers": "transformer layers", "d_model": "model width", "gpus": "GPUs to split over",
    "global_batch": "sequences per step, over all GPUs",
    "d_ff": "FFN width (default 4 d_model)",
    "heads": "attention heads (default d_model / 128)", "vocab": "vocabulary size",
    "seq_len": "tokens per sequence", "experts": "routed experts per MoE layer (0: dense)",
    "top_k": "experts each token goes to", "expert_d_ff": "FFN width of one expert",
    "shared_experts": "experts every token goes to", "dense_layers": "leading dense layers",
    "ffn_matrices": "2 (GELU MLP) or 3 (SwiGLU)", "node_size": "GPUs per node",
    "virtual": "model chunks per pipeline rank (interleaved)", "top": "plans to print",
}


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m minipar plan",
                     description="Rank every way to split a training step over the GPUs.")
    add = parser.add_argument
    add("--params", type=count, required=True, help="total parameters (70e9, 671B)")
    for name in ("layers", "d_model", "gpus", "global_batch"):
        add(f"--{name.replace('_', '-')}", type=int, required=True, help=PLAN_HELP[name])
    for name, default in (("d_ff", None), ("heads", None), ("vocab", 0), ("seq_len", 4096),
                          ("experts", 0), ("top_k", 0), ("expert_d_ff", 0),
                          ("shared_experts", 0), ("dense_layers", 0), ("ffn_matrices", 3),
                          ("node_size", 8), ("virtual", 1), ("top", 10)):
        add(f"--{name.replace('_', '-')}", type=int, default=default, help=PLAN_HELP[name])
    for name in ("gpu_memory", "flops", "intra_bw", "inter_bw"):
        add(f"--{name.replace('_', '-')}", type=float, required=True,
            help={"gpu_memory": "GB", "flops": "peak TFLOP/s"}.get(name, "GB/s per GPU"))
    add("--efficiency", type=float, default=0.5, help="fraction of peak FLOP/s achieved")
    add("--latency-us", type=float, default=5.0, help="alpha: microseconds per message step")
    # the V schedules' chunks are half a stage: the memory model does not count them yet
    add("--schedule", choices=[s for s in SCHEDULES if s not in V_SHAPED], default="1f1b",
        help="the pipeline schedule")
    add("--recompute", choices=("none", "selective", "full"), default="selective",
        help="activation recomputation: none, attention only (selective), or every layer")
    add("--no-sp", action="store_true", help="no sequence parallelism with tp > 1")
    add("--zero", type=int, action="append", choices=(0, 1, 2, 3),
        help="ZeRO stages to consider (repeat the flag; default all)")
    return parser


def problems(args: argparse.Namespace) -> list[str]:
    """Every reason the flags describe no job (each names its flag)."""
    out = [f"--{name.replace('_', '-')} must be a positive number (got {getattr(args, name)})"
           for name in ("params", "layers", "d_model", "gpus", "global_batch", "seq_len",
                        "node_size", "virtual", "gpu_memory", "flops", "intra_bw",
                        "inter_bw", "efficiency")
           if not 0 < getattr(args, name) < math.inf]
    out += [f"--{name.replace('_', '-')} must be zero or positive"
            for name in ("vocab", "experts", "top_k", "expert_d_ff", "shared_experts",
                         "dense_layers", "latency_us") if not 0 <= getattr(args, name) < math.inf]
    out += [f"--{name.replace('_', '-')} must be a positive number (got {getattr(args, name)})"
            for name in ("d_ff", "heads", "top") if getattr(args, name) is not None
            and getattr(args, name) < 1]
    if args.efficiency > 1:
        out.append(f"--efficiency is a fraction of peak: at most 1 (got {args.efficiency})")
    if args.ffn_matrices not in (2, 3):
        out.append("--ffn-matrices must be 2 (GELU MLP) or 3 (SwiGLU)")
    if args.experts and not (1 <= args.top_k <= args.experts and args.expert_d_ff > 0):
        out.append("--experts needs --top-k between 1 and --experts and an --expert-d-ff")
    if not args.experts and (args.top_k or args.expert_d_ff or args.shared_experts):
        out.append("--top-k / --expert-d-ff / --shared-experts need --experts")
    if args.dense_layers >= args.layers > 0 and args.experts:
        out.append(f"--dense-layers {args.dense_layers} leaves no MoE layer of {args.layers}")
    if args.virtual > 1 and args.schedule != "interleaved":
        out.append(f"--virtual {args.virtual} needs --schedule interleaved")
    return out


def plan_command(argv: list[str]) -> int:
    """`python -m minipar plan ...`: print the ranking; a bad flag is one line, exit 2."""
    try:
        args = make_parser().parse_args(argv)
        errors = problems(args)
        if not errors:
            name = "an MoE transformer" if args.experts else "a dense transformer"
            w = transformer(name, args.params, args.layers, args.d_model,
                            args.global_batch, args.seq_len, args.d_ff, args.heads,
                            args.vocab, args.experts, args.top_k, args.expert_d_ff,
                            args.shared_experts, args.dense_layers, args.ffn_matrices)
    except (ConfigError, ValueError) as error:
        errors = [str(error)]
    if errors:
        print(f"minipar: error: {errors[0]}", file=sys.stderr, flush=True)
        return 2
    hw = Hardware(args.gpu_memory * GB, args.flops * 1e12, args.efficiency,
                  args.intra_bw * GB, args.inter_bw * GB, args.node_size,
                  args.latency_us * 1e-6)
    template = Plan(1, schedule=args.schedule, virtual=args.virtual,
                    recompute=args.recompute, sp=not args.no_sp)
    found = search(w, hw, args.gpus, template, tuple(sorted(set(args.zero or (0, 1, 2, 3)))))
    print(report(found, w, hw, args.gpus, template, args.top), flush=True)
    return 0
