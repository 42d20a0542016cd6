"""What a job is to the planner: a model's sizes turned into the cost model's Workload.

What this file teaches: every number the planner prices follows from a few sizes of
the model (layers, d, heads, d_ff, vocabulary, sequence length, experts), written out
here as formulas: the parameters of each array and whether tensor parallelism cuts
it, the activation bytes a token leaves per layer (Korthikanti et al. 2022,
generalized to grouped-query attention, SwiGLU, MoE and FlashAttention-style
attention), the FLOPs of attention. `transformer` builds the Workload of a published
model (presets.py) in bf16 with Adam; `minipar_workload` builds minipar's own, exactly
as its ranks hold it, which is how tests/planner/test_plan.py checks the formulas against an
8-rank run; `plan_of` is the Plan a `python -m minipar train` config runs. The rest of
the planner: planner/search.py (price and search the plans), planner/plan_table.py (print
them), plan.py (the command).
"""

from __future__ import annotations

import math

import numpy as np

from minipar.core.memory import bytes_per_param
from minipar.core.nn import canonical_shapes
from minipar.planner.memory_cost import BlockShape, Plan, Workload
from minipar.planner.muon_cost import layer_matrices
from minipar.planner.presets import ModelShape
from minipar.settings.config import TrainConfig

# Narayanan et al. 2021 (Megatron-LM, SC21), section 3.4 and its Figure 7: a GPT of
# hidden size 4096 with sequences of 2048 runs "up to 1.3x" faster per GPU with large
# microbatches than with b = 1 (one A100). As a cost per microbatch: each costs the
# compute of 0.3 of those sequences beyond its own (b = 1: 1.3x; b = 4: 1.075x).
PAPER_OVERHEAD_TOKENS, PAPER_WIDTH = 0.3 * 2048, 4096


def small_microbatch_tokens(d_model: int) -> float:
    """Tokens of compute a microbatch costs beyond its own on a GPU (docs/design.md,
    "Microbatch size"): the paper's 0.3 x 2048 at width 4096, taken as a fixed time per
    layer and microbatch, against a token's FLOPs per layer that grow as d^2."""
    return PAPER_OVERHEAD_TOKENS * (PAPER_WIDTH / d_model) ** 2


def layer_sizes(m: ModelShape) -> dict[str, int]:
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


def ffn_params(m: ModelShape, width: int) -> int:
    """One FFN of `width`: ffn_matrices d x width matrices (and, gpt style, biases)."""
    biases = (m.ffn_matrices - 1) * width + m.d_model if m.style == "gpt" else 0
    return m.ffn_matrices * m.d_model * width + biases


def transformer(m: ModelShape, batch: int, params: float | None = None) -> Workload:
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
    dense = BlockShape((norms, attention, *bias, (ffn - (d if gpt else 0), True), *bias),
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
        blocks += [BlockShape(arrays, (expert,), m.experts, m.top_k,
                         tp_reductions=1 + (m.shared_experts > 0),
                         act_split=attend + routed + shared,
                         cheap_split=0 if gpt else 2 * fe * (m.top_k + m.shared_experts),
                         **base)] * moe_layers
    embed = ((m.vocab * d, True),) + (((s * d, False),) if gpt else ())
    head = ((m.vocab * d, True), (sizes["norm"], False))
    splits = (m.d_ff, m.heads, m.kv_heads or m.heads) + (
        (m.expert_d_ff,) if m.shared_experts else ())
    w = Workload(m.name, tuple(blocks), embed, head, d, batch, s, split_dims=splits,
                 lookup_embedding=True, tied_head=m.tied, logit_bytes=4 * m.vocab,
                 microbatch_overhead=small_microbatch_tokens(d),
                 routing_bias=m.routing_bias, muon_matrices=tuple(layer_matrices(m)))
    if params is not None and abs(params / w.params - 1) > 0.05:
        raise ValueError(f"--params {params:.4g} disagrees with the {w.params:.4g} the shapes "
                         f"define ({params / w.params - 1:+.0%}); drop --params or fix a shape")
    return w


def minipar_workload(cfg: TrainConfig) -> Workload:
    """minipar's own model (nn.canonical_shapes) in its dtype and optimizer: the arrays
    exactly as its ranks hold them (fc1 and fc2's weight cut by tp, fc2's bias and the
    LayerNorm whole; a shared expert cut so in the MLP MoE, whole in gpt-moe, whose
    MoE FFN tp does not split; the routed experts whole: the ledger's
    teaching/ledger_tables.py `split_experts_shape` cuts the MLP MoE's). Activations:
    its saved tensors counted by hand per row, 2d (h, LN(h)) whole and 2f (fc1's
    output, GELU's) cut by tp; per MoE assignment 2d + 2fe; gpt-moe adds 6d per
    position (h, LN1, q, k, v, o) and its probabilities, H T per position: estimates.
    The dense transformer's block is exact: recompute.gpt_block_activation_bytes, every
    layout and recompute mode (tests/parallel/test_gpt_tensor_parallel.py). The
    transformer's rows are its B*T positions (seq_len = T)."""
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
        # a shared expert is cut over tp as the routed ones are: the MLP MoE's under --tp,
        # gpt-moe's never (compose/parallelize.py `make_ffn_block`, expert_parallel.py)
        arrays = tuple((shapes[n], n.endswith(cut) and (
            cfg.model == "moe" if ".shared_experts." in n
            else cfg.model in ("mlp", "gpt", "gpt-moe"))) for n in mine)
        if model.is_moe:
            expert = tuple(shapes[n] for n in shapes if n.startswith(f"blocks.{i}.experts.0."))
            # under SP the MoE FFN gathers all positions first: only LN1 and proj's bias
            # (3d) see my positions alone
            blocks.append(BlockShape(arrays, expert, cfg.experts, cfg.top_k, reductions,
                                act_replicated=(2 * d + extra + cfg.experts) * itemsize,
                                act_split=cfg.top_k * (2 * d + 2 * fe) * itemsize,
                                act_input=d * itemsize,
                                capacity=cfg.capacity_factor is not None,
                                sp_gathers=int(model.is_gpt), sp_partial=3 * d, **attention))
        elif model.is_gpt:  # exactly what its tape keeps (recompute.py counts it)
            blocks.append(BlockShape(arrays, tp_reductions=reductions,
                                act_replicated=(7 * d + 2) * itemsize,
                                act_tp_replicated=d * itemsize,
                                act_split=(4 * d + 3 * f) * itemsize,
                                act_scores=(d + model.heads * (model.seq_len + 1)) * itemsize,
                                act_input=d * itemsize, act_tp_whole=4 * d * itemsize,
                                act_sp_cut=2 * d * itemsize))
        else:
            blocks.append(BlockShape(arrays, tp_reductions=reductions,
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
    # bytes per parameter: memory.bytes_per_param, the formula the memory report uses
    per = bytes_per_param(cfg.optimizer, itemsize, 2 if cfg.mixed else None)
    return Workload(f"minipar {cfg.model}", tuple(blocks),
                    tuple((shapes[n], n in split) for n in first),
                    tuple((shapes[n], n in split) for n in last), d,
                    cfg.batch, model.seq_len if model.is_gpt else 1, per.params, per.grads,
                    per.optimizer, itemsize, 8, cfg.bucket_size, master_bytes=per.masters,
                    split_dims=(f,) if cfg.model == "mlp" else (),
                    lookup_embedding=model.is_gpt, vocab_parallel=vocab,
                    sp_partial_embed=shapes["pos_embed.weight"] if sp else 0,
                    sp_partial_head=2 * d if sp else 0, experts_over_tp=False)


def plan_of(cfg: TrainConfig) -> Plan:
    """The plan a resolved `python -m minipar train` config runs."""
    return Plan(cfg.dp, cfg.tp, cfg.pp, cfg.ep, cfg.zero, cfg.microbatches, cfg.sp,
                cfg.schedule, cfg.virtual, cfg.recompute, cfg.grad_sync, cfg.cp,
                cfg.cp_mode)

