"""Serving priced: one decode step of a published model on tp x pp (x ep) GPUs.

What this file teaches. Generating a token reads every weight of the model and every
row's KV cache once, for 2 FLOPs per weight and row (Pope et al. 2022, "Efficiently
Scaling Transformer Inference"; docs/design.md, "Serving priced"). On a GPU that does
~300 FLOPs in the time it reads one byte of its memory (an H100: 989 TFLOP/s against
3.35 TB/s), a step of a few rows is bounded by the reads, not the FLOPs. So each GPU's
share of a step costs

    max(bytes it reads / HBM bandwidth, FLOPs it does / (peak x efficiency))

and the mesh adds its waits:

  tp   splits every weight and the cache by heads: each GPU reads 1/tp of them, and pays
       2 Allreduces of (rows, d) per layer (attention's output projection, the FFN's
       down projection: Megatron's two reduction points);
  pp   splits the layers: each GPU reads 1/pp of them, but a token crosses all pp stages
       one after the other, so a token still waits for all of the model's reads; the
       B rows ride the pipeline as M = min(B, pp) microbatches, and a step of all rows
       lasts max(M, pp) stage times. A stage passes (rows, d) to the next (a Recv);
  ep   (an MoE) holds each routed expert whole on one of ep ranks of a tp group, the
       tokens sent to it and back by 2 Alltoallv of (rows k, d) per MoE layer instead
       of the FFN's Allreduce. A step reads only the experts its rows chose: of E
       experts, B rows of k choices touch E (1 - (1 - k/E)^B) on average.

Collectives and messages are priced by time_cost.seconds (the planner's alpha-beta
network, in a node or across nodes by where mesh.py places the ranks). Memory per GPU:
its share of the bf16 weights and of the cache of all B rows at the full context.

Used by `python -m minipar plan --serve` (planner/plan.py) and by lesson 16, which
prints the same numbers; tested in tests/planner/test_serving.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.planner.memory_cost import Plan
from minipar.planner.presets import ModelShape
from minipar.planner.search import divisors, usable
from minipar.planner.time_cost import Hardware, Traffic, seconds
from minipar.planner.workloads import ffn_params, layer_sizes, transformer

WORD = 2  # bytes: bf16 weights, activations and cache


@dataclass(frozen=True)
class DecodePrice:
    """One decode step of `batch` rows at `context` positions on tp x pp GPUs (ep of the
    tp ranks sharing the experts), in seconds and bytes per GPU.

    latency      one row's wait for its next token: pp stage times
    step         all rows advance one token: max(M, pp) stage times
    reads        the token's time reading weights and cache (or computing, if slower)
    waits        the token's time in collectives and messages (tp, ep, pp)
    weights      bf16 weight bytes a GPU holds
    cache        KV-cache bytes a GPU holds: all B rows at the full context"""

    tp: int
    pp: int
    ep: int
    batch: int
    context: int
    latency: float
    step: float
    reads: float
    waits: float
    weights: float
    cache: float

    @property
    def throughput(self) -> float:
        """Tokens a second over all rows: B per step."""
        return self.batch / self.step

    @property
    def memory(self) -> float:
        """Bytes per GPU: its weights and its cache."""
        return self.weights + self.cache

    def label(self) -> str:
        return f"tp {self.tp} x pp {self.pp}" + (f" x ep {self.ep}" if self.ep > 1 else "")


def touched_experts(experts: int, top_k: int, rows: float) -> float:
    """Routed experts a decode step of `rows` rows reads, on average over uniform
    routing: each expert is missed by a row with probability 1 - k/E."""
    if not experts:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def decode_price(m: ModelShape, hw: Hardware, tp: int, pp: int, batch: int, context: int,
                 ep: int = 1) -> DecodePrice:
    """One decode step of `m`, priced (the module docstring's formulas). The embedding
    is a lookup (B rows read, not the matrix); the head's matrix is read whole."""
    sizes, d = layer_sizes(m), m.d_model
    whole = transformer(m, 1).params - m.vocab * d              # all but the lookup
    moe_layers = m.layers - m.dense_layers if m.experts else 0
    expert = ffn_params(m, m.expert_d_ff) if m.experts else 0
    routed = moe_layers * m.experts * expert                     # every routed expert
    M = min(batch, pp)                                           # microbatches in flight
    rows = batch / M                                             # rows per microbatch
    read_params = whole - routed + moe_layers * touched_experts(m.experts, m.top_k,
                                                                rows) * expert
    active = whole - routed + moe_layers * m.top_k * expert      # FLOPs per row
    kv = sizes["kv_width"] * WORD                                # bytes a position, layer
    cache_read = m.layers * rows * context * kv
    flops = 2 * active * rows + 4 * m.layers * sizes["q_width"] * context * rows
    gpus = tp * pp
    per_gpu = max((read_params * WORD + cache_read) / gpus / hw.hbm_bw,
                  flops / gpus / (hw.flops * hw.efficiency))
    plan = Plan(dp=1, tp=tp, pp=pp, ep=ep)
    stream = int(rows * d)                                       # (rows, d)
    my_layers = m.layers / pp
    my_moe = moe_layers / pp
    reductions = 2 * my_layers - (my_moe if ep > 1 else 0)      # ep: no FFN Allreduce
    waits = 0.0
    if tp > 1:
        calls = round(reductions)
        waits += seconds(Traffic("tp", "Allreduce", calls, calls * stream,
                                 calls * stream * WORD), plan, hw)
    if ep > 1 and my_moe:
        calls = round(2 * my_moe)
        moved = int(calls * rows * m.top_k * d)
        waits += seconds(Traffic("ep", "Alltoallv", calls, moved, moved * WORD), plan, hw)
    if pp > 1:
        waits += seconds(Traffic("pp", "Recv", 1, stream, stream * WORD), plan, hw)
    stage = per_gpu + waits                                      # one microbatch, one stage
    weights = (whole + m.vocab * d) * WORD / gpus
    cache = m.layers * batch * context * kv / gpus
    return DecodePrice(tp, pp, ep, batch, context, pp * stage, max(M, pp) * stage,
                       pp * per_gpu, pp * waits, weights, cache)


def serve_problem(m: ModelShape, tp: int, pp: int, ep: int) -> str | None:
    """Why a serving layout cannot run `m` (None if it can)."""
    if m.heads % tp or (m.kv_heads or m.heads) % tp:
        return "tp does not divide the (key/value) heads"
    if m.d_ff % tp or (m.experts and m.expert_d_ff % tp):
        return "tp does not divide the FFN width"
    if pp > m.layers:
        return "more pipeline stages than layers"
    if ep > 1 and (not m.experts or m.experts % ep or tp % ep):
        return "ep must divide the experts and tp (the ranks that share them)"
    return None


def layouts(m: ModelShape, hw: Hardware, gpus: int, batch: int, context: int
            ) -> tuple[list[DecodePrice], list[DecodePrice], dict[str, int]]:
    """Every tp x pp = gpus (and ep | tp for an MoE) priced: (the ones that fit, lowest
    latency first; the ones that do not fit in memory; the others counted by reason)."""
    fit, too_big, refused = [], [], {}
    for tp in divisors(gpus):
        pp = gpus // tp
        for ep in (divisors(tp) if m.experts else [1]):
            problem = serve_problem(m, tp, pp, ep)
            if problem:
                refused[problem] = refused.get(problem, 0) + 1
                continue
            price = decode_price(m, hw, tp, pp, batch, context, ep)
            (fit if price.memory <= usable(hw) else too_big).append(price)
    fit.sort(key=lambda p: (p.latency, -p.throughput))
    too_big.sort(key=lambda p: p.memory)
    return fit, too_big, refused


# ------------------------------------------------------------ the report
def serve_header() -> str:
    return (f"{'tp':>4} {'pp':>3} {'ep':>3} | {'weights':>7} {'cache':>6} {'total':>6} | "
            f"{'reads':>6} {'waits':>6} | {'ms/token':>8} {'step ms':>8} {'tokens/s':>9}")


def serve_row(p: DecodePrice) -> str:
    return (f"{p.tp:4d} {p.pp:3d} {p.ep:3d} | {p.weights / 1e9:7.1f} {p.cache / 1e9:6.1f} "
            f"{p.memory / 1e9:6.1f} | {p.reads * 1e3:6.2f} {p.waits * 1e3:6.2f} | "
            f"{p.latency * 1e3:8.2f} {p.step * 1e3:8.2f} {p.throughput:9.0f}")


def serve_report(m: ModelShape, hw: Hardware, gpus: int, batch: int, prompt: int, new: int,
                 fixed: dict[str, int], top: int) -> str:
    """The table of `plan --serve`: every layout of `gpus` that agrees with `fixed` (tp,
    pp, ep), lowest latency first, priced at the last token's context (prompt + new:
    the longest cache, the slowest step), and the ones that do not fit or cannot run."""
    context = prompt + new
    fit, too_big, refused = layouts(m, hw, gpus, batch, context)
    agree = [p for p in fit if all(getattr(p, k) == v for k, v in fixed.items())]
    big = [p for p in too_big if all(getattr(p, k) == v for k, v in fixed.items())]
    rows = "1 row" if batch == 1 else f"{batch} rows decoding together"
    lines = [f"serving {m.name} on {gpus} GPUs: B = {rows}, each a prompt of {prompt} tokens "
             f"and {new} new ones; each decode step "
             f"priced at the last token's context ({context}), bf16",
             f"  a GPU: {hw.gpu_memory / 1e9:g} GB (layouts may use {usable(hw) / 1e9:g}), "
             f"HBM {hw.hbm_bw / 1e12:g} TB/s, {hw.flops / 1e12:g} TFLOP/s at "
             f"{hw.efficiency:.0%}; in-node {hw.intra_bw / 1e9:g} GB/s, between nodes "
             f"{hw.inter_bw / 1e9:g} GB/s, alpha {hw.latency * 1e6:g} us",
             "  GB per GPU (weights, KV cache of all rows); ms of one token: reads (weights "
             "and cache at HBM speed, or compute if slower) and waits (tp Allreduces, ep "
             "Alltoallv, pp messages); a step moves every row one token",
             serve_header()]
    lines += [serve_row(p) for p in agree[:top]]
    if len(agree) > top:
        lines.append(f"  ... {len(agree) - top} more layouts (--top N shows N)")
    if agree:
        most = max(agree, key=lambda p: p.throughput)
        lines.append(f"lowest latency: {agree[0].label()} ({agree[0].latency * 1e3:.2f} ms a "
                     f"token); most tokens/s: {most.label()} ({most.throughput:.0f})")
    else:
        lines.append("no layout fits")
    if big:
        lines.append(f"{len(big)} layouts need more than {usable(hw) / 1e9:g} GB per GPU "
                     f"(the closest: {big[0].label()}, {big[0].memory / 1e9:.1f} GB)")
    for reason, n in sorted(refused.items(), key=lambda kv: -kv[1]):
        lines.append(f"{n} layouts cannot run: {reason}")
    return "\n".join(lines)


def serve_record(p: DecodePrice) -> dict:
    """One layout as `plan --serve --json` writes it (seconds and bytes)."""
    return {"tp": p.tp, "pp": p.pp, "ep": p.ep, "batch": p.batch, "context": p.context,
            "latency_s": p.latency, "step_s": p.step, "reads_s": p.reads, "waits_s": p.waits,
            "tokens_per_s": p.throughput, "weights_bytes": p.weights,
            "cache_bytes": p.cache}
