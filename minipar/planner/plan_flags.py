"""The command line of `python -m minipar plan`: its flags, and the refusal of absurd sizes.

What this file teaches: a planner prices whatever it is told, so the first place to stop an
absurd job is where its numbers come in. Every size flag is parsed by an argparse type
that refuses, in one line naming the flag, what no machine has: a count that is not a
whole positive number (`number`, `POSITIVE`, `COUNT`, `AMOUNT`), anything past 2^53
(`LIMIT`: the last integer a float64 holds exactly, and the cost model's arithmetic is in
floats), more layers or experts than the cost model lists one by one (`listed`, `LISTED`),
a parameter count that is not one (`count`: 70e9, 70B, 1.5T). `MODEL_FLAGS` and
`CLUSTER_FLAGS` name the flags that override a preset's sizes and a cluster's numbers
(planner/presets.py); `make_parser` is the whole command line, the training plan's flags,
`--serve`'s (planner/serving.py) and `--sites`' (planner/diloco_cost.py).

What a flag means together with the others (a mesh that does not divide the GPUs, a
serving flag in a training plan) is checked after parsing, in planner/plan.py, the command.
"""

from __future__ import annotations

import argparse
import math

from minipar.parallel.pipeline.schedules import SCHEDULES, SIMULATED_ONLY
from minipar.planner.diloco_cost import DEFAULT_INNER_STEPS, DEFAULT_LINK_GBPS
from minipar.planner.presets import CLUSTERS, MODELS
from minipar.planner.search import RECOMPUTE
from minipar.settings.flags import Parser  # Parser: raises, one line


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
    if value > LIMIT:
        raise argparse.ArgumentTypeError(f"must be at most 2^53 = {LIMIT} (got {text})")
    return value


# The largest count or amount a flag takes: 2^53, the last integer a float64 holds exactly
# (the cost model's arithmetic is in floats). A width, batch or GPU count past it is no
# machine's, and would make the search factor numbers of 300 digits or overflow a float.
LIMIT = 2**53


def number(kind: type, low: float, strict: bool = True) -> object:
    """An argparse type: a `kind` number above `low` (or at least, if not strict), finite,
    at most `LIMIT`."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            if kind is int and text.strip().lower().lstrip("+").replace(".", "", 1).replace(
                    "e", "", 1).isdigit():   # 1e21: a whole number written as a float
                raise argparse.ArgumentTypeError(
                    f"not a whole number (got {text!r}; write it out in digits)") from None
            raise argparse.ArgumentTypeError(
                f"not a{' whole' if kind is int else ''} number (got {text!r})") from None
        if not (value > low if strict else value >= low) or not value < math.inf:
            raise argparse.ArgumentTypeError(
                f"must be {'more than' if strict else 'at least'} {low:g} (got {text})")
        if value > LIMIT:
            raise argparse.ArgumentTypeError(
                f"must be at most 2^53 = {LIMIT} (got {text}): no machine's size, and past "
                "what a float counts exactly")
        return value
    parse.__name__ = kind.__name__
    return parse


POSITIVE, COUNT, AMOUNT = number(int, 0), number(int, 0, strict=False), number(float, 0)
# the cost model lists every layer and every expert, and prices every stage count up to the
# layers: 4096 of either is 30 times the deepest published model's layers (126) and 16 times
# the most experts (256), and keeps a search in seconds
LISTED = 4096


def listed(kind: object) -> object:
    """`kind`, at most `LISTED` (the layers and experts the workload lists one by one)."""
    def parse(text: str) -> int:
        value = kind(text)
        if value > LISTED:
            raise argparse.ArgumentTypeError(f"must be at most {LISTED} (got {text}): the "
                                             "cost model lists each one")
        return value
    parse.__name__ = "int"
    return parse


MODEL_FLAGS = {  # flag field -> (type, help)
    "layers": (listed(POSITIVE), "transformer layers"),
    "d_model": (POSITIVE, "model width d"),
    "heads": (POSITIVE, "attention (query) heads"),
    "kv_heads": (POSITIVE, "key/value heads (grouped-query attention; default: --heads)"),
    "head_dim": (POSITIVE, "width of a head (default: d / heads)"),
    "d_ff": (POSITIVE, "FFN width of a dense layer"),
    "vocab": (POSITIVE, "vocabulary size"),
    "seq_len": (POSITIVE, "tokens per sequence"),
    "ffn_matrices": (POSITIVE, "matrices per FFN: 2 (GELU MLP) or 3 (SwiGLU)"),
    "experts": (listed(COUNT), "routed experts per MoE layer (0: a dense model)"),
    "top_k": (COUNT, "routed experts per token"),
    "expert_d_ff": (POSITIVE, "FFN width of one expert"),
    "shared_experts": (listed(COUNT), "always-on experts per MoE layer"),
    "dense_layers": (listed(COUNT), "leading layers with a dense FFN in an MoE model"),
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
    "hbm_bw": (AMOUNT, "GB/s of each GPU's memory (what --serve reads weights and cache at)"),
    "fp8_flops": (AMOUNT, "peak dense FP8 TFLOP/s per GPU (what --fp8 runs the matmuls at)"),
}


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m minipar plan",
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
    add("--global-batch", type=POSITIVE, help="sequences per step (required, but with --serve)")
    # the V schedules (zb-v, dualpipev) and dualpipe are left out: the planner's time
    # model has no closed-form bubble for them (schedules.bubble_formula)
    add("--schedule", choices=[s for s in SCHEDULES if s not in SIMULATED_ONLY],
        action="append", help="pipeline schedules to "
        "consider (repeat the flag; default 1f1b and interleaved)")
    add("--virtual", type=POSITIVE, action="append", help="model chunks per pipeline rank "
        "for --schedule interleaved (repeat the flag; default 2 and 4)")
    add("--no-sp", action="store_true", help="no sequence parallelism with tp > 1")
    add("--fp8", action="store_true", help="FP8 training (DeepSeek-V3's recipe): the blocks' "
        "matmuls at the GPU's FP8 rate, ZeRO-3's weight gathers in 8 bits and their amax "
        "Allreduce")
    add("--optimizer", choices=("adam", "muon"), default="adam",
        help="adam (default; K = 12 bytes: fp32 master, m, v) or muon: the block matrices "
        "keep one momentum (K = 8), priced with its --muon-mode (planner/muon_cost.py)")
    add("--muon-mode", help="with --optimizer muon: layer-sharded "
        "(default), distributed or duplicated (docs/design.md \"Muon\")")
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
    add("--serve", action="store_true", help="price decoding, not training: every tp x pp "
        "(x ep) layout of --gpus per generated token (planner/serving.py)")
    add("--prompt-len", type=POSITIVE, help="--serve: tokens of each prompt")
    add("--new-tokens", type=POSITIVE, help="--serve: tokens generated after it")
    add("--batch", type=POSITIVE, help="--serve: rows decoding together (default 1)")
    add("--sites", type=number(int, 1), help="the named plan's dp replicas over this many "
        "sites joined by one slow link: DP against DiLoCo, the seconds a step spends on "
        "the link (planner/diloco_cost.py)")
    add("--slow-link-gbps", type=AMOUNT, help="--sites: Gb/s each way of the link between "
        f"the sites, shared by all their GPUs (default {DEFAULT_LINK_GBPS:g})")
    add("--inner-steps", type=POSITIVE, action="append", help="--sites: DiLoCo's H, inner "
        "steps between outer steps (repeat the flag; default "
        f"{', '.join(map(str, DEFAULT_INNER_STEPS))})")
    add("--fragments", type=POSITIVE, action="append", help="--sites: streaming DiLoCo's "
        "fragments P, each dividing the layers and every H (repeat the flag; default 1 and "
        "the largest of 4 and 2 that does)")
    return parser
