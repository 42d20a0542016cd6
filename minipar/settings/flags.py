"""The `python -m minipar train` command line: every flag, its default and its help,
and the TrainConfig a parsed command line becomes.

What this file teaches: one dataclass, many doors. Each flag is a field of
`config.TrainConfig` under its long name (dashes as underscores) with the field's
default, so the command line, a lesson calling `TrainConfig(...)` and `--dump`'s
config.json spell a run alike; `generate` reuses the flags it needs
(`add_train_flags` onto its own parser). `Parser` raises a `ConfigError` instead of
printing, so only rank 0 speaks (docs/design.md, "The train command").
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from minipar.comm.mesh import CP_MODES
from minipar.core.routing import ROUTERS
from minipar.parallel.pipeline.schedules import SCHEDULES
from minipar.settings.config import (
    GRAD_REDUCE_DTYPES,
    GRAD_SYNCS,
    MIXED,
    MODELS,
    MUON_MODES,
    OUTERS,
    RECOMPUTE,
    ConfigError,
    TrainConfig,
)


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing, so only rank 0 speaks."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


TRAIN_HELP = {
    "layers": "blocks in the model", "d_in": "input features", "d_model": "model width",
    "d_ff": "hidden width of a dense block (default 4 d_model)", "classes": "output classes",
    "experts": "MoE: experts per block", "top_k": "MoE: experts each token goes to",
    "expert_d_ff": "MoE: hidden width of an expert (default 2 d_model)",
    "batch": "rows per step, over all data-parallel ranks",
    "microbatches": "gradient accumulation: pieces of each rank's rows",
    "steps": "total steps (also when resuming)", "seed": "seeds the model and the data",
    "dp": "data-parallel ranks (default: world / (tp pp cp))",
    "tp": "tensor-parallel ranks (with --model moe: each expert split over them)",
    "pp": "pipeline stages", "ep": "MoE: expert-parallel ranks (divides dp)",
    "virtual": "model chunks per pipeline rank (--schedule interleaved)",
    "zero": "ZeRO stage 0-3: shard optimizer state, gradients, parameters over dp "
            "(expert weights over their edp group)",
    "cp": "transformer: context-parallel ranks, each holding T/cp positions of every "
          "sequence",
}


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of the train command, with its default (docs/design.md, "The train
    command")."""
    d = TrainConfig()
    add = parser.add_argument
    add("--model", choices=MODELS, default=d.model,
        help="mlp and moe: residual MLPs on feature rows; gpt and gpt-moe: a transformer "
             "on token sequences (its FFN dense or MoE)")
    for name in ("layers", "d_in", "d_model", "d_ff", "classes", "experts", "top_k",
                 "expert_d_ff", "batch", "microbatches", "steps", "seed",
                 "dp", "tp", "pp", "ep", "virtual", "zero", "cp"):
        add(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
            help=TRAIN_HELP[name])
    add("--capacity-factor", type=float, default=None,
        help="MoE: tokens an expert takes, as a multiple of an even share (default: all)")
    add("--aux-coef", type=float, default=None,
        help="MoE: weight of the load-balancing loss (default 0.01; 0 with --router "
             "sigmoid-bias)")
    add("--shared-experts", type=int, default=d.shared_experts,
        help="MoE: always-on experts every token goes through, beside the routed ones")
    add("--router", choices=ROUTERS, default=d.router,
        help="MoE: softmax top-k with the aux loss, or sigmoid scores chosen by score + a "
             "balancing bias (DeepSeek-V3, no aux loss)")
    add("--bias-rate", type=float, default=None,
        help="--router sigmoid-bias: b_e += rate * sign(mean load - load_e) after every "
             "step (default 1e-3)")
    add("--route-groups", type=int, default=d.route_groups,
        help="MoE: experts in G equal groups (nodes) for node-limited routing")
    add("--route-top-groups", type=int, default=None,
        help="MoE: each token keeps its M best groups, then its top-k inside them")
    add("--lr", type=float, default=d.lr, help="learning rate")
    add("--optimizer", choices=("sgd", "adam", "muon"), default=d.optimizer,
        help="the update rule (muon: Muon on the blocks' matrices, AdamW on the rest)")
    add("--momentum", type=float, default=None,
        help="--optimizer muon: the momentum mu of its buffer (default 0.95)")
    add("--nesterov", action=argparse.BooleanOptionalAction, default=None,
        help="--optimizer muon: Nesterov momentum (default on)")
    add("--ns-steps", type=int, default=None,
        help="--optimizer muon: Newton-Schulz iterations per step (default 5)")
    add("--weight-decay", type=float, default=None,
        help="--optimizer muon: decoupled weight decay, W *= 1 - lr wd (default 0.1)")
    add("--muon-mode", choices=MUON_MODES, default=None,
        help="--optimizer muon over a mesh: each matrix on one home rank (layer-sharded), "
             "TP shards kept with the Gram matrix Allreduced (distributed), or every "
             "matrix on every rank that holds a piece (duplicated)")
    add("--dtype", choices=("float64", "float32"), default=d.dtype,
        help="the numbers of parameters, data and activations")
    add("--schedule", choices=SCHEDULES, default=d.schedule,
        help="the pipeline schedule (--pp 2 or more)")
    add("--grad-sync", choices=GRAD_SYNCS, default=d.grad_sync,
        help="plain data parallelism: one Allreduce per parameter, per bucket, or per "
             "bucket overlapped with backward")
    add("--bucket-size", type=int, default=d.bucket_size,
        help="elements per gradient bucket (--grad-sync bucketed/overlapped)")
    add("--sp", action="store_true", help="sequence parallelism inside the tp group")
    add("--save", metavar="DIR", help="write a sharded checkpoint at the end")
    add("--resume", metavar="DIR", help="start from a checkpoint saved on any mesh")
    add("--keep", type=int, default=d.keep, metavar="N",
        help="step folders --save keeps (the newest N; a failed save never removes one)")
    add("--timeout", type=float, default=d.timeout, metavar="SECONDS",
        help="end the job when a rank waits this long in one collective or receive "
             "(0: wait forever)")
    add("--vocab", type=int, default=None,
        help="transformer: tokens in the vocabulary (default 64; 256 with --data)")
    add("--seq-len", type=int, default=d.seq_len,
        help="transformer: positions T per sequence (--batch counts sequences)")
    add("--heads", type=int, default=d.heads,
        help="transformer: attention heads H (H divides --d-model)")
    add("--data", metavar="PATH", default=None,
        help="transformer: train on windows of --seq-len + 1 bytes of this text file "
             "(byte-level, V = 256) instead of the synthetic copy task")
    add("--vocab-parallel", action=argparse.BooleanOptionalAction, default=None,
        help="transformer with --tp: embedding rows and head columns split over tp, "
             "the loss by a parallel cross-entropy (default with --tp 2 or more); "
             "--no-vocab-parallel keeps them replicated on every tp rank")
    add("--recompute", choices=RECOMPUTE, default=d.recompute,
        help="activation recomputation: none, selective (the attention core is "
             "computed again in the backward) or full (every block's forward is)")
    add("--cp-mode", choices=CP_MODES, default=d.cp_mode,
        help="transformer with --cp N: how attention sees the other ranks' positions "
             "(allgather K/V, ring, zigzag ring, ulysses Alltoall)")
    add("--trace", metavar="DIR", default=None,
        help="write every rank's timeline (DIR/rank{r}.json) and the merged DIR/trace.json "
             "for Perfetto or chrome://tracing; `python -m minipar trace DIR` reads it")
    add("--clip-grad-norm", type=float, default=None, metavar="C",
        help="scale every gradient by min(1, C / norm), the norm of the whole model's "
             "gradient over every rank (clip.py); the step line prints it (gnorm)")
    add("--documents", action="store_true",
        help="transformer with --data: the file's documents (split at blank lines) are "
             "the rows, padded to --seq-len + 1 bytes; the loss is the mean over the "
             "valid positions of the global batch")
    add("--mixed", choices=MIXED, default=None,
        help="compute in 16 bits (bf16 or fp16) over master weights and optimizer state "
             "in --dtype; 16-bit activations on the wire (core/precision.py)")
    add("--grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES, default=d.grad_reduce_dtype,
        help="--mixed: the DP/ZeRO gradient reduction in the master dtype, or on a 16-bit "
             "copy summed in 16 bits (half the bytes)")
    add("--loss-scale", type=float, default=d.loss_scale, metavar="S",
        help="--mixed fp16: the initial loss scale, a power of two (halved on overflow)")
    add("--loss-scale-window", type=int, default=d.loss_scale_window, metavar="N",
        help="--mixed fp16: clean steps after which the loss scale doubles")
    add("--fp8", default=None, metavar="RECIPE",
        help="--mixed bf16: the blocks' matmuls on 8-bit operands scaled tensorwise, "
             "rowwise or blockwise (core/fp8.py)")
    add("--fp8-block", type=int, default=d.fp8_block, metavar="B",
        help="--fp8 blockwise: 1 x B tiles of activations and gradients, B x B of weights")
    add("--fp8-grad", default=d.fp8_grad, metavar="FORMAT",
        help="--fp8: the output gradients' format, e5m2 or e4m3")
    add("--fp8-allgather", action="store_true",
        help="--fp8 --zero 3: gather the 8-bit weights as 1-byte words (their scales "
             "agreed before), the rest in bf16")
    add("--outer", choices=OUTERS, default=None,
        help="diloco: each dp replica (a worker: its own tp x pp x cp mesh) trains alone "
             "and the workers average what they learned every --inner-steps steps "
             "(parallel/diloco.py)")
    add("--inner-steps", type=int, default=None, metavar="H",
        help="--outer diloco: inner steps between two outer steps of a fragment")
    add("--outer-lr", type=float, default=None,
        help="--outer diloco: the outer Nesterov SGD's learning rate (default 0.7)")
    add("--outer-momentum", type=float, default=None,
        help="--outer diloco: the outer Nesterov SGD's momentum (default 0.9)")
    add("--fragments", type=int, default=None, metavar="P",
        help="--outer diloco: streaming fragments of blocks, syncing H/P steps apart "
             "(default 1)")
    add("--inject-bug", metavar="NAME", default=None,
        help="break one thing on purpose (lesson 08); `python -m minipar bugs` lists them")
    add("--check-placements", action="store_true",
        help="every op and collective checks whether its tensors are replicated, sharded "
             "or partial sums over each mesh axis; a violation stops the run with one line")


def make_parser(prog: str = "python -m minipar train") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description="Train the reference model on a mesh of ranks.")
    add_train_flags(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig fields out of parsed arguments (other attributes are ignored)."""
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
