"""Every reason a run's settings cannot run: `problems(cfg, world_size)`, before any step.

What this file teaches: a parallel job must refuse an impossible setting
*before the first collective*, on every rank, with the same verdict. Because
`problems()` is a pure function of the flags and the world size, every rank
computes it alone and all agree without talking; rank 0 prints it, all exit 2.
Each line names the flag and the fix. The order matters: `size_problems` first
(numbers out of range, a mesh that does not fill the world), and only when those pass
the divisibility and each strategy's own flags (`routing_problems`, `muon_problems`,
`diloco_problems`, `mixed_problems`). The settings themselves, and their defaults, are
config.py's `TrainConfig`.
"""

from __future__ import annotations

import math

from minipar.comm.mesh import CP_MODES
from minipar.core import fp8
from minipar.core.data import corpus_problem
from minipar.core.documents import documents_problem
from minipar.core.nn import GPT_MODELS
from minipar.core.routing import ROUTERS
from minipar.parallel.pipeline.schedules import V_SHAPED
from minipar.settings.config import (
    GRAD_REDUCE_DTYPES,
    GRAD_SYNCS,
    MIXED,
    MUON_DEFAULTS,
    OUTERS,
    RECOMPUTE,
    TrainConfig,
)


def _dualpipe_problems(cfg: TrainConfig) -> list[str]:
    """DualPipe: two mirrored halves of the pipeline, half the microbatches fed from each
    end, two copies of the model whose gradients the mirror ranks add
    (parallel/pipeline/v_schedules.py)."""
    out = []
    if cfg.pp < 2 or cfg.pp % 2:
        out.append(f"--schedule dualpipe needs an even --pp, 2 or more (got {cfg.pp}): ranks "
                   "r and pp-1-r mirror each other")
    elif cfg.microbatches % 2 or cfg.microbatches < 2 * cfg.pp:
        out.append(f"--schedule dualpipe needs an even --microbatches, at least 2 x --pp = "
                   f"{2 * cfg.pp} (got {cfg.microbatches}): half enter at each end")
    if cfg.zero or cfg.grad_sync != "bucketed":
        out.append("--schedule dualpipe sums its two model copies' gradients after the "
                   "backward: it runs with --zero 0 and --grad-sync bucketed only")
    if cfg.save or cfg.resume:
        out.append("--schedule dualpipe holds each stage twice: --save and --resume are "
                   "not supported with it (dualpipev trains the same model, once)")
    return out


def problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """Every reason the flags of `cfg` cannot run on `world_size` ranks; empty if they can.
    `cfg` must be `resolved`. Pure: every rank reaches the same list. A run also checks
    the bug `--inject-bug` names and the `--save`/`--resume` folders: `train.problems`."""
    out = size_problems(cfg, world_size)
    if out:
        return out  # the divisibility below is meaningless with such sizes
    out += _divisibility(cfg)
    out += _data_parallel_problems(cfg)
    out += routing_problems(cfg)
    out += muon_problems(cfg)
    out += diloco_problems(cfg)
    return out


def diloco_problems(cfg: TrainConfig) -> list[str]:
    """--outer diloco and its flags (parallel/diloco.py): H >= 1 dividing --steps, P
    dividing H and --layers, eta > 0, mu in [0, 1); the flags without --outer refused, and
    what DiLoCo does not run with: ZeRO (a worker keeps its whole optimizer state), expert
    parallelism (experts borrow the dp axis the workers are), the sigmoid-bias router (its
    bias is no parameter the outer step averages), --inject-bug, --trace."""
    names = ("inner_steps", "outer_lr", "outer_momentum", "fragments")
    if cfg.outer is None:
        return [f"--{name.replace('_', '-')} applies to --outer diloco only"
                for name in names if getattr(cfg, name) is not None]
    if cfg.outer not in OUTERS:
        return [f"--outer must be one of {', '.join(OUTERS)} (got {cfg.outer})"]
    h, p = cfg.inner_steps, cfg.fragments
    out = []
    if h is None:
        out.append("--outer diloco needs --inner-steps H (the inner steps each worker takes "
                   "alone between two outer steps)")
    elif h < 1:
        out.append(f"--inner-steps must be at least 1 (got {h})")
    elif cfg.steps % h:
        out.append(f"--steps {cfg.steps} is not a multiple of --inner-steps {h} (every run "
                   "ends on an outer step of fragment 0)")
    if p < 1:
        out.append(f"--fragments must be at least 1 (got {p})")
    elif cfg.layers % p:
        out.append(f"--fragments {p} does not divide --layers {cfg.layers} (fragment p is "
                   "the blocks [p L/P, (p+1) L/P))")
    elif h is not None and h >= 1 and h % p:
        out.append(f"--fragments {p} does not divide --inner-steps {h} (fragment p syncs "
                   "p H / P steps after fragment 0)")
    if not (math.isfinite(cfg.outer_lr) and cfg.outer_lr > 0):
        out.append(f"--outer-lr must be a positive, finite number (got {cfg.outer_lr})")
    if not (math.isfinite(cfg.outer_momentum) and 0 <= cfg.outer_momentum < 1):
        out.append(f"--outer-momentum must be in [0, 1) (got {cfg.outer_momentum})")
    if cfg.zero:
        out.append(f"--outer diloco with --zero {cfg.zero} is not built: each worker keeps its "
                   "own whole optimizer state, which ZeRO would shard over the workers")
    if cfg.ep > 1:
        out.append(f"--outer diloco with --ep {cfg.ep} is not built: expert parallelism "
                   "splits the experts over the dp axis, and the dp ranks are the workers")
    if cfg.router == "sigmoid-bias":
        out.append("--outer diloco with --router sigmoid-bias is not built: the bias b is no "
                   "parameter, so the outer step would not average it")
    if cfg.check_placements:
        out.append("--outer diloco with --check-placements is not built")
    for name, flag in (("inject_bug", "--inject-bug"), ("trace", "--trace")):
        if getattr(cfg, name) is not None:
            out.append(f"--outer diloco with {flag} is not built")
    return out


def muon_problems(cfg: TrainConfig) -> list[str]:
    """--optimizer muon's flags (core/muon.py): mu in [0, 1), at least one Newton-Schulz
    step, a finite decay of zero or more; none of them with another optimizer."""
    if cfg.optimizer != "muon":
        return [f"--{name.replace('_', '-')} applies to --optimizer muon only"
                for name in MUON_DEFAULTS if getattr(cfg, name) is not None]
    out = []
    if not (math.isfinite(cfg.momentum) and 0 <= cfg.momentum < 1):
        out.append(f"--momentum must be in [0, 1) (got {cfg.momentum})")
    if not 1 <= cfg.ns_steps <= 1000:   # 10^9 would be a step that never ends; past a few,
        # each iteration only keeps the singular values in the polynomial's band
        out.append(f"--ns-steps must be between 1 and 1000 (got {cfg.ns_steps})")
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        out.append(f"--weight-decay must be zero or a positive finite number (got "
                   f"{cfg.weight_decay})")
    return out


def routing_problems(cfg: TrainConfig) -> list[str]:
    """The DeepSeek-V3 routing flags (routing.py). What runs: --router softmax with the aux
    loss (any --aux-coef, default 0.01); --router sigmoid-bias with the bias alone (its
    --aux-coef is 0, the default; an explicit positive one is refused: the bias replaces
    the loss); --bias-rate with sigmoid-bias only; groups that cut E evenly, M <= G, and
    k experts to be found inside M groups. Everything on every mesh that runs MoE,
    except sigmoid-bias under --schedule dualpipe (two copies of each block)."""
    moe = cfg.model in ("moe", "gpt-moe")
    out = []
    if cfg.router not in ROUTERS:
        return [f"--router must be one of {', '.join(ROUTERS)} (got {cfg.router})"]
    if not moe:
        out += [f"--{name.replace('_', '-')} applies to --model moe/gpt-moe only"
                for name, default in (("shared_experts", 0), ("router", "softmax"),
                                      ("bias_rate", None), ("route_groups", 1))
                if getattr(cfg, name) != default]
        return out
    if cfg.shared_experts < 0:
        out.append(f"--shared-experts must be zero or more (got {cfg.shared_experts})")
    if cfg.bias_rate is not None and cfg.router != "sigmoid-bias":
        out.append("--bias-rate applies to --router sigmoid-bias only (softmax balances "
                   "with the aux loss, --aux-coef)")
    elif cfg.bias_rate is not None and not (math.isfinite(cfg.bias_rate)
                                            and cfg.bias_rate >= 0):
        out.append(f"--bias-rate must be zero or a positive finite number (got "
                   f"{cfg.bias_rate})")
    if cfg.router == "sigmoid-bias" and cfg.aux_coef:
        out.append(f"--aux-coef {cfg.aux_coef:g} with --router sigmoid-bias: the bias b "
                   "balances the load instead of a loss (drop --aux-coef, or --aux-coef 0; "
                   "the aux loss runs with --router softmax)")
    if cfg.router == "sigmoid-bias" and cfg.schedule == "dualpipe" and cfg.pp > 1:
        out.append("--router sigmoid-bias with --schedule dualpipe is not built: each block "
                   "has two copies there, each seeing half the load of b (use dualpipev)")
    groups, top = cfg.route_groups, cfg.route_top_groups
    if groups < 1:
        return out + [f"--route-groups must be at least 1 (got {groups})"]
    if cfg.experts % groups:
        out.append(f"--route-groups {groups} does not divide --experts {cfg.experts} "
                   "(every group holds E/G experts)")
    elif top is not None and not 1 <= top <= groups:
        out.append(f"--route-top-groups {top} must be between 1 and --route-groups {groups}")
    elif top is not None and cfg.top_k > top * (cfg.experts // groups):
        out.append(f"--top-k {cfg.top_k} is more than the {top * (cfg.experts // groups)} "
                   f"experts of --route-top-groups {top} groups of {cfg.experts // groups}")
    return out


def size_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """The first checks of `problems`: numbers out of range, and a mesh that does not fill
    the world. Only when these pass do divisibility and other checks mean anything."""
    out: list[str] = []
    positive = ["layers", "d_in", "d_model", "d_ff", "classes", "experts", "top_k",
                "expert_d_ff", "batch", "microbatches", "steps", "virtual"]
    for name in positive:
        if getattr(cfg, name) < 1:
            out.append(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(cfg, name)})")
    for name in ("lr", "aux_coef", "capacity_factor"):
        value = getattr(cfg, name)
        if value is not None and not math.isfinite(value):
            out.append(f"--{name.replace('_', '-')} must be a finite number (got {value})")
    if math.isfinite(cfg.lr) and cfg.lr <= 0:
        out.append(f"--lr must be positive (got {cfg.lr})")
    if math.isfinite(cfg.aux_coef) and cfg.aux_coef < 0:
        out.append(f"--aux-coef must be zero or positive (got {cfg.aux_coef})")
    if cfg.capacity_factor is not None and math.isfinite(cfg.capacity_factor) \
            and cfg.capacity_factor <= 0:
        out.append(f"--capacity-factor must be positive (got {cfg.capacity_factor})")
    if cfg.keep < 1:
        out.append(f"--keep must be at least 1 checkpoint (got {cfg.keep})")
    if not math.isfinite(cfg.timeout) or cfg.timeout < 0:
        out.append(f"--timeout must be 0 (no watchdog) or a positive number of seconds "
                   f"(got {cfg.timeout})")
    for name in ("save", "resume"):
        if getattr(cfg, name) == "":
            out.append(f"--{name} needs a folder name (got an empty one)")
    if cfg.seed < 0:
        out.append(f"--seed must be zero or positive (got {cfg.seed})")
    if cfg.classes == 1:
        out.append("--classes must be at least 2 for a classification loss")
    if cfg.zero not in (0, 1, 2, 3):
        out.append(f"--zero must be 0, 1, 2 or 3 (got {cfg.zero})")
    if cfg.grad_sync not in GRAD_SYNCS:
        out.append(f"--grad-sync must be one of {', '.join(GRAD_SYNCS)} (got {cfg.grad_sync})")
    if cfg.bucket_size < 1:
        out.append(f"--bucket-size must be at least 1 element (got {cfg.bucket_size})")
    out += _transformer_problems(cfg)
    out += mixed_problems(cfg)
    out += fp8.problems(cfg)   # --fp8 (core/fp8.py): recipe, --mixed bf16, blocks vs shards
    out += _recompute_problems(cfg)
    out += _clip_problems(cfg)
    if out:
        return out  # sizes below are meaningless with non-positive numbers
    if cfg.top_k > cfg.experts:
        out.append(f"--top-k {cfg.top_k} is more than --experts {cfg.experts}")
    out += cfg.mesh_shape().problems(world_size)
    return out


def _transformer_problems(cfg: TrainConfig) -> list[str]:
    """The transformer's own flags: sizes, --data, and the flags of the other family."""
    defaults = TrainConfig()
    if cfg.model not in GPT_MODELS:
        return [f"--{name.replace('_', '-')} applies to --model gpt/gpt-moe only"
                for name in ("vocab", "seq_len", "heads", "data", "cp", "cp_mode",
                             "documents")
                if getattr(cfg, name) != getattr(defaults, name)] + (
            ["--vocab-parallel applies to --model gpt/gpt-moe only"] if cfg.vocab_parallel
            else [])
    out = [f"--{name.replace('_', '-')} does not apply to --model {cfg.model} (it reads "
           "token ids: see --vocab and --data)"
           for name in ("d_in", "classes") if getattr(cfg, name) != getattr(defaults, name)]
    if cfg.vocab < 2:
        out.append(f"--vocab must be at least 2 (got {cfg.vocab})")
    if cfg.seq_len < 2:
        out.append(f"--seq-len must be at least 2 (got {cfg.seq_len})")
    if cfg.heads < 1:
        out.append(f"--heads must be at least 1 (got {cfg.heads})")
    elif cfg.d_model >= 1 and cfg.d_model % cfg.heads:
        out.append(f"--heads {cfg.heads} does not divide --d-model {cfg.d_model} "
                   "(each head takes d_model/heads columns of q, k and v)")
    if cfg.vocab_parallel and cfg.tp == 1:
        out.append("--vocab-parallel splits the vocabulary over tp: it needs --tp 2 or more")
    out += _context_parallel_problems(cfg)
    if cfg.data is not None:
        if cfg.vocab != 256:
            out.append(f"--vocab {cfg.vocab} with --data: a text file is read byte by byte, "
                       "so the vocabulary is 256 (drop --vocab)")
        problem = documents_problem(cfg.data) if cfg.documents else \
            corpus_problem(cfg.data, max(cfg.seq_len, 1))
        out += [problem] if problem else []
    elif cfg.documents:
        out.append("--documents reads the documents of a text file: it needs --data PATH")
    return out


def _clip_problems(cfg: TrainConfig) -> list[str]:
    """--clip-grad-norm C: a positive, finite norm (clip.py)."""
    c = cfg.clip_grad_norm
    if c is not None and (not math.isfinite(c) or c <= 0):
        return [f"--clip-grad-norm must be a positive, finite number (got {c}): the "
                "gradient is scaled by min(1, C / norm)"]
    return []


def _context_parallel_problems(cfg: TrainConfig) -> list[str]:
    """--cp N --cp-mode: the sequence must cut into equal pieces (2 cp for zigzag), and
    Ulysses hands every rank whole heads."""
    if cfg.cp_mode not in CP_MODES:
        return [f"--cp-mode must be one of {', '.join(CP_MODES)} (got {cfg.cp_mode})"]
    if cfg.cp <= 1 or cfg.seq_len < 2 or cfg.heads < 1:
        return []
    out = []
    pieces = 2 * cfg.cp if cfg.cp_mode == "zigzag" else cfg.cp
    if cfg.seq_len % pieces:
        why = (f"2 x --cp = {pieces} chunks, rank r holding chunks r and 2cp-1-r"
               if cfg.cp_mode == "zigzag" else "every cp rank holds T/cp positions")
        out.append(f"--seq-len {cfg.seq_len} is not divisible by {pieces} for --cp {cfg.cp} "
                   f"--cp-mode {cfg.cp_mode} ({why})")
    local_heads = cfg.heads // max(cfg.tp, 1)
    if cfg.cp_mode == "ulysses" and local_heads % cfg.cp:
        out.append(f"--cp {cfg.cp} does not divide the {local_heads} heads (--heads / --tp) "
                   "for --cp-mode ulysses (each rank attends with heads/cp whole heads)")
    return out


def _divisibility(cfg: TrainConfig) -> list[str]:
    out = []
    if cfg.batch % cfg.dp:
        out.append(f"--batch {cfg.batch} is not divisible by --dp {cfg.dp} "
                   "(every data-parallel rank takes an equal slice)")
    elif (cfg.batch // cfg.dp) % cfg.microbatches:
        out.append(f"--microbatches {cfg.microbatches} does not divide the per-rank batch "
                   f"{cfg.batch // cfg.dp} (= --batch / --dp)")
    if cfg.model == "mlp" and cfg.d_ff % cfg.tp:
        out.append(f"--tp {cfg.tp} does not divide --d-ff {cfg.d_ff} "
                   "(each tensor-parallel rank holds d_ff/tp columns of fc1)")
    moe = cfg.model in ("moe", "gpt-moe")
    if moe and cfg.experts % cfg.ep:
        out.append(f"--ep {cfg.ep} does not divide --experts {cfg.experts}")
    if cfg.model == "moe" and cfg.expert_d_ff % cfg.tp:
        out.append(f"--tp {cfg.tp} does not divide --expert-d-ff {cfg.expert_d_ff} "
                   "(with --model moe, --tp splits each expert: fc1 by columns, fc2 by rows)")
    if cfg.model == "moe" and cfg.sp:
        out.append("--sp with --model moe is not built: sequence parallelism splits the rows "
                   "of dense blocks; the experts' rows are split by the router")
    if cfg.model in GPT_MODELS and cfg.tp > 1:
        out += _transformer_tp_problems(cfg)
    if not moe and cfg.ep > 1:
        out.append(f"--ep needs --model moe or gpt-moe (--model {cfg.model} has no experts)")
    if cfg.virtual > 1 and cfg.schedule != "interleaved":
        out.append(f"--virtual {cfg.virtual} needs --schedule interleaved")
    if cfg.virtual > 1 and cfg.pp == 1:
        out.append(f"--virtual {cfg.virtual} needs --pp 2 or more (chunks interleave a pipeline)")
    elif cfg.virtual > 1 and cfg.microbatches % cfg.pp:
        out.append(f"--schedule interleaved --virtual {cfg.virtual} needs --microbatches "
                   f"divisible by --pp {cfg.pp} (got {cfg.microbatches}): each chunk takes "
                   "the microbatches in groups of pp")
    if cfg.schedule in V_SHAPED and cfg.pp == 1:
        out.append(f"--schedule {cfg.schedule} needs --pp 2 or more (its two chunks per "
                   "rank sit in a V across the pipeline)")
    elif cfg.schedule in V_SHAPED and cfg.layers % (2 * cfg.pp):
        out.append(f"--schedule {cfg.schedule} needs --layers divisible by 2 x --pp "
                   f"{cfg.pp} (got {cfg.layers}): each rank holds two equal chunks")
    if cfg.schedule == "dualpipev" and cfg.pp > 1 and cfg.microbatches < 2 * cfg.pp:
        out.append(f"--schedule dualpipev needs --microbatches at least 2 x --pp = "
                   f"{2 * cfg.pp} (got {cfg.microbatches}): its steady state needs them")
    if cfg.schedule == "dualpipe":
        out += _dualpipe_problems(cfg)
    if cfg.layers % (cfg.pp * cfg.virtual):
        out.append(f"--layers {cfg.layers} is not divisible by --pp {cfg.pp} x --virtual "
                   f"{cfg.virtual} (each pipeline stage holds an equal run of blocks)")
    if cfg.sp and cfg.tp == 1:
        out.append("--sp (sequence parallelism) needs --tp 2 or more")
    elif cfg.sp and cfg.model in GPT_MODELS:
        if cfg.cp == 1 and cfg.seq_len % cfg.tp:
            out.append(f"--sp needs --tp {cfg.tp} to divide --seq-len {cfg.seq_len} (each "
                       "tensor-parallel rank holds T/tp positions of the residual stream)")
        elif cfg.cp > 1 and not cfg.seq_len % cfg.cp and (cfg.seq_len // cfg.cp) % cfg.tp:
            out.append(f"--sp needs --tp {cfg.tp} to divide the {cfg.seq_len // cfg.cp} "
                       f"positions (--seq-len / --cp {cfg.cp}) of a context-parallel rank "
                       "(each tensor-parallel rank holds T/(cp tp) of the residual stream)")
    elif cfg.sp and not (cfg.batch // cfg.dp // max(cfg.microbatches, 1)) % cfg.tp == 0:
        out.append(f"--sp needs --tp {cfg.tp} to divide the rows of a microbatch on a rank "
                   f"({cfg.batch // cfg.dp // cfg.microbatches})")
    return out


def _transformer_tp_problems(cfg: TrainConfig) -> list[str]:
    """The transformer on a tp group: whole heads, whole FFN columns and (vocab-parallel)
    whole vocabulary rows on every rank."""
    out = []
    if cfg.heads % cfg.tp:
        out.append(f"--tp {cfg.tp} does not divide --heads {cfg.heads} (each "
                   "tensor-parallel rank holds heads/tp whole attention heads)")
    if cfg.model == "gpt" and cfg.d_ff % cfg.tp:
        out.append(f"--tp {cfg.tp} does not divide --d-ff {cfg.d_ff} "
                   "(each tensor-parallel rank holds d_ff/tp columns of fc1)")
    if cfg.vocab_parallel and cfg.vocab % cfg.tp:
        out.append(f"--tp {cfg.tp} does not divide --vocab {cfg.vocab} (each rank holds "
                   "vocab/tp rows of the embedding and columns of the head; or "
                   "--no-vocab-parallel)")
    return out


def mixed_problems(cfg: TrainConfig) -> list[str]:
    """--mixed and its flags: known values, a power-of-two loss scale, a window of at
    least one step, the scaling flags with fp16 only, a 16-bit reduction with --mixed
    only, no full-precision bug of lesson 08 (docs/design.md, "Mixed precision"). Every
    model and strategy runs under it."""
    out = []
    defaults = TrainConfig()
    if cfg.mixed is not None and cfg.mixed not in MIXED:
        out.append(f"--mixed must be one of {', '.join(MIXED)} (got {cfg.mixed})")
    if cfg.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        out.append(f"--grad-reduce-dtype must be one of {', '.join(GRAD_REDUCE_DTYPES)} "
                   f"(got {cfg.grad_reduce_dtype})")
    if not (cfg.loss_scale > 0 and math.isfinite(cfg.loss_scale)) or \
            math.frexp(cfg.loss_scale)[0] != 0.5:
        out.append(f"--loss-scale must be a positive power of two, so scaling is exact "
                   f"(got {cfg.loss_scale:g})")
    if cfg.loss_scale_window < 1:
        out.append(f"--loss-scale-window must be at least 1 step (got {cfg.loss_scale_window})")
    if cfg.mixed is None:
        if cfg.grad_reduce_dtype == "low":
            out.append("--grad-reduce-dtype low reduces a 16-bit copy of the gradients: it "
                       "needs --mixed bf16 or fp16")
        for name in ("loss_scale", "loss_scale_window"):   # else ignored without a word
            if getattr(cfg, name) != getattr(defaults, name):
                out.append(f"--{name.replace('_', '-')} applies to --mixed fp16 only (without "
                           "--mixed nothing is scaled)")
        return out
    if cfg.inject_bug is not None and not cfg.inject_bug.startswith(("mp-", "fp8-")):
        out.append(f"--inject-bug {cfg.inject_bug} is one of lesson 08's full-precision "
                   f"bugs: run it without --mixed (the mixed-precision bugs are named "
                   f"mp-*)")
    if cfg.mixed == "bf16":
        for name in ("loss_scale", "loss_scale_window"):
            if getattr(cfg, name) != getattr(defaults, name):
                out.append(f"--{name.replace('_', '-')} applies to --mixed fp16 only (bf16 "
                           "has float32's range: it trains with S = 1)")
    return out


def _recompute_problems(cfg: TrainConfig) -> list[str]:
    """--recompute: a known mode; selective needs attention."""
    if cfg.recompute not in RECOMPUTE:
        return [f"--recompute must be one of {', '.join(RECOMPUTE)} (got {cfg.recompute})"]
    if cfg.recompute == "selective" and cfg.model not in GPT_MODELS:
        return [f"--recompute selective recomputes the attention core: --model {cfg.model} "
                "has no attention (use --recompute full)"]
    return []


def _data_parallel_problems(cfg: TrainConfig) -> list[str]:
    """Combinations of --grad-sync / --zero with other strategies that are not built."""
    out = []
    if cfg.zero and cfg.grad_sync != "bucketed":
        out.append(f"--grad-sync {cfg.grad_sync} is plain data parallelism's sync: with --zero "
                   f"{cfg.zero} gradients are Reduce_scattered instead (drop --grad-sync)")
    hooked = None  # these take each block's gradients from inside the backward
    if cfg.grad_sync == "overlapped":
        hooked = "--grad-sync overlapped"
    elif cfg.zero >= 2:
        hooked = f"--zero {cfg.zero}"
    if hooked and cfg.sp:
        out.append(f"{hooked} takes each block's gradients when its backward ends, before "
                   "--sp sums LayerNorm gradients over tp: use --zero 0/1 without overlap")
    return out
