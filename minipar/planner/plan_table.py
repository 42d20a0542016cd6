"""The planner's printing: the ranking table, one plan explained, the JSON records.

What this file teaches: a plan is only useful with the numbers behind it. Each row
says the mesh, the memory per GPU by part (parameters, gradients, optimizer,
activations), the bytes each GPU puts on the wire per step by axis, the bubble, the
step time and the MFU; `explain` spells out one plan in words (what fills its memory,
what its step time is made of, or by how much it does not fit), and `describe` every
size the planner used, stated or derived. The plans come from planner/search.py.
"""

from __future__ import annotations

import math

from minipar.planner.memory_cost import Plan, Workload
from minipar.planner.presets import ModelShape
from minipar.planner.search import GB, MESH, PRUNED, Estimate, Search, distinct_meshes, usable
from minipar.planner.time_cost import Hardware
from minipar.planner.workloads import layer_sizes

# How far the step times may be off: the largest error against Megatron-LM's Table 1
# (tests/planner/test_plan.py checks every row against it), rounded up.
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
    wire = " ".join(f"{e.wire.get(a, 0.0) / GB:6.1f}" for a in WIRE_AXES
                    + (("muon",) if "muon" in e.wire else ()))
    return (f"{p.dp:5d} {p.tp:3d} {p.pp:3d} {p.cp:3d} {p.ep:3d} {p.zero:4d} {p.microbatches:5d}"
            f" {p.recompute[:4]:>4} {schedule_tag(p):>5} | {s.params / GB:6.1f} {s.grads / GB:6.1f}"
            f" {s.optimizer / GB:6.1f} {e.activations / GB:6.1f} {e.memory / GB:6.1f} |"
            f" {wire} | {e.bubble:6.1%} | {t.total:8.3f} {mfu(w, hw, p.world, t.total):5.1%}")


def schedule_tag(p: Plan) -> str:
    """1f1b, gpipe, zb-h1, or i<V> for the interleaved schedule with V chunks a rank."""
    return f"i{p.virtual}" if p.schedule == "interleaved" else p.schedule


def header(muon: bool = False) -> str:
    """The table's column names; `muon`: a last wire column, the bytes Muon adds."""
    wire = " ".join(f"{a:>6}" for a in WIRE_AXES + (("muon",) if muon else ()))
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
    lines = [f"{p.label()}" + (" +SP" if p.sp else "") + (" +FP8" if p.fp8 else "")
             + f" ({p.schedule}, recompute {p.recompute})", memory_line(e, hw)]
    t = e.timing
    if t is None:
        over = e.memory - usable(hw)
        biggest = max(("model states", e.states.total), ("activations", e.activations),
                      ("the gathered ZeRO piece", e.gathered), key=lambda kv: kv[1])
        return lines + [f"  does not fit: {over / GB:.2f} GB too much; the largest part is "
                        f"{biggest[0]} ({biggest[1] / GB:.2f} GB)"]
    wire = ", ".join(f"{axis} {e.wire[axis] / GB:.2f}" for axis in (*WIRE_AXES, "muon")
                     if axis in e.wire)
    inside = " + ".join(f"{axis} {sec:.3f}" for axis, sec in sorted(t.pipeline_comm.items()))
    after = " + ".join(f"{axis} {sec:.3f}" for axis, sec in sorted(t.step_comm.items()))
    return lines + [
        f"  wire GB per GPU per step: {wire or 'none'}",
        f"  step {t.total:.3f} s = busiest stage's compute {t.compute:.3f}"
        + (f" + communication in the pipeline ({inside})" if inside else "")
        + f", + bubble {t.bubble:.3f} ({e.bubble:.1%})"
        + (f", + after the pipeline ({after})" if after else "")
        + f"; MFU {mfu(w, hw, p.world, t.total):.1%}"]


def describe(w: Workload, m: ModelShape, hw: Hardware, world: int) -> list[str]:
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


def report(found: Search, w: Workload, m: ModelShape, hw: Hardware, world: int, template: Plan,
           top: int = 10) -> str:
    """The ranking: the job, the fastest plan of each mesh, the top three explained, and
    the plans that cannot run counted by reason."""
    lines = describe(w, m, hw, world)
    if template.fp8:
        lines.append(f"  --fp8: the blocks' matmuls at {hw.fp8_flops / 1e12:g} TFLOP/s (FP8) "
                     f"x {hw.efficiency:.0%}, attention and the head at BF16's; ZeRO-3 gathers "
                     "FP8 weights (1 byte) and Allreduces their amax once a step; MFU against "
                     "the BF16 peak")
    if template.optimizer == "muon":
        lines.append(f"  --optimizer muon --muon-mode {template.muon_mode}: the block matrices "
                     "keep K = 8 bytes (fp32 master, momentum), the rest AdamW's 12; the "
                     "'muon' wire column is what Muon adds (planner/muon_cost.py), and "
                     "Newton-Schulz runs after the pipeline at peak")
    lines.append(f"  SP {'on' if template.sp else 'off'} with tp > 1; rc: recomputation "
                 "(none, selective: the attention and elementwise parts, full: the layers); "
                 "sched: pipeline schedule (iV: interleaved, V chunks a rank)")
    fastest = distinct_meshes(found.feasible)
    lines += [f"{len(found.feasible)} plans fit on {len(fastest)} meshes; the fastest plan of "
              "each mesh, fastest first (memory GB per GPU; wire GB per GPU per step):",
              header(template.optimizer == "muon")]
    lines += [row(e, w, hw) for e in fastest[:top]]
    if len(fastest) > top:
        lines.append(f"  ... {len(fastest) - top} more meshes (--top N shows N, --json all)")
    for rank, e in enumerate(fastest[:3], 1):
        first, *rest = explain(e, w, hw)
        lines += [f"#{rank}: {first}", *rest]
    lines.append(f"{sum(found.rejected.values())} plans cannot run ({PRUNED}):")
    lines += [f"  {count:7d}  {reason}" for reason, count in found.rejected.most_common()]
    if found.bounded:
        lines.append(f"note: {found.bounded}")
    if found.too_big:
        e = found.too_big[0]
        lines.append(f"  the closest miss: {e.plan.label()} needs {e.memory / GB:.1f} GB")
    return "\n".join(lines)


def named_report(found: Search, w: Workload, m: ModelShape, hw: Hardware, world: int) -> str:
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
        lines += [f"{len(others)} other variants (ZeRO stage, M, recomputation):",
                  header(best.plan.optimizer == "muon")]
        for e in found.feasible[1:6]:
            lines.append(row(e, w, hw))
        lines += [f"  {e.plan.label()} recompute {e.plan.recompute}: needs "
                  f"{e.memory / GB:.1f} GB" for e in others if e.timing is None][:5]
    return "\n".join(lines)


def plan_record(e: Estimate, w: Workload, hw: Hardware) -> dict:
    """Every field of a table row, for `--json`: GB, GB on the wire, seconds."""
    p, t = e.plan, e.timing
    return {**{k: getattr(p, k) for k in (*MESH, "zero", "microbatches", "recompute", "sp",
                                          "schedule", "virtual", "fp8",
                                          "optimizer", "muon_mode")},
            "memory_gb": {"params": e.states.params / GB, "grads": e.states.grads / GB,
                          "optimizer": e.states.optimizer / GB,
                          "activations": e.activations / GB, "gathered": e.gathered / GB,
                          "total": e.memory / GB},
            "wire_gb": {axis: value / GB for axis, value in e.wire.items()},
            "bubble": e.bubble, "step_s": t.total, "compute_s": t.compute,
            "pipeline_comm_s": t.pipeline_comm, "step_comm_s": t.step_comm,
            "bubble_s": t.bubble, "mfu": mfu(w, hw, p.world, t.total)}

