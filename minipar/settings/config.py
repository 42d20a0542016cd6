"""The run's settings: `TrainConfig` (every flag of `train`), its defaults, and a DiLoCo worker's.

What this file teaches: a run is one frozen record of flags. Some defaults depend
on others (d_ff on d_model, dp on the world size, Muon's and DiLoCo's on the
optimizer and --outer): `resolved` fills them once, so every rank holds the same
record. The command line that fills a TrainConfig is flags.py; every reason one
cannot run (checked before the first collective) is validation.py's `problems`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from minipar.comm.mesh import MeshShape
from minipar.core.nn import GPT_MODELS, ModelConfig
from minipar.core.refusal import RefusalError
from minipar.core.routing import DEFAULT_AUX_COEF, DEFAULT_BIAS_RATE

MODELS = ("mlp", "moe", *GPT_MODELS)
MOE_MODELS = ("moe", "gpt-moe")
RECOMPUTE = ("none", "selective", "full")
GRAD_SYNCS = ("naive", "bucketed", "overlapped")
MUON_MODES = ("layer-sharded", "distributed", "duplicated")
MIXED = ("bf16", "fp16")
GRAD_REDUCE_DTYPES = ("master", "low")
OUTERS = ("diloco",)
DILOCO_DEFAULTS = {"outer_lr": 0.7, "outer_momentum": 0.9, "fragments": 1}
MUON_DEFAULTS = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "weight_decay": 0.1,
                 "muon_mode": "layer-sharded"}


class ConfigError(RefusalError):
    """A setting that cannot run; its message is one line naming the flag and the fix."""


@dataclass(frozen=True)
class TrainConfig:
    """Every flag of `python -m minipar train` under its long name (dashes as underscores).

    `dp = None` means "whatever fills the world": world / (tp * pp)."""

    model: str = "mlp"
    layers: int = 8
    d_in: int = 32
    d_model: int = 64
    d_ff: int | None = None           # default 4 * d_model
    classes: int = 10
    experts: int = 8
    top_k: int = 2
    expert_d_ff: int | None = None    # default 2 * d_model
    capacity_factor: float | None = None
    aux_coef: float | None = None     # default 0.01 (softmax), 0 (sigmoid-bias: routing.py)
    batch: int = 64
    microbatches: int = 1
    steps: int = 5
    lr: float = 0.05
    optimizer: str = "sgd"
    # --optimizer muon (core/muon.py): filled by `resolved`, None with sgd and adam
    momentum: float | None = None     # mu, 0.95
    nesterov: bool | None = None      # on
    ns_steps: int | None = None       # Newton-Schulz iterations, 5
    weight_decay: float | None = None  # decoupled, 0.1 (Muon's matrices and AdamW's rest)
    muon_mode: str | None = None      # layer-sharded, distributed or duplicated
    seed: int = 0
    dtype: str = "float64"
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    zero: int = 0
    grad_sync: str = "bucketed"       # plain DP's gradient sync (data_parallel.py)
    bucket_size: int = 65536          # elements per gradient bucket
    sp: bool = False
    # checkpoint folder written at the end (checkpoint/save_load.py)
    save: str | None = None
    resume: str | None = None         # checkpoint folder to start from, on any mesh
    # --save keeps this many step folders (checkpoint/save_load.py)
    keep: int = 2
    timeout: float = 300.0            # seconds a rank may wait in one call (watchdog.py)
    inject_bug: str | None = None     # lesson 08: run with one deliberate bug (bugs/catalog.py)
    # every op checks replicated/sharded/partial (placement/__init__.py)
    check_placements: bool = False
    vocab: int | None = None          # the transformer's V: default 64, or 256 with --data
    seq_len: int = 32                 # T positions per sequence
    heads: int = 4                    # H attention heads, dividing d_model
    data: str | None = None           # a text file: byte windows instead of the copy task
    vocab_parallel: bool | None = None  # tok rows / head columns over tp (default: tp > 1)
    recompute: str = "none"           # none, selective (the attention core), full (blocks)
    cp: int = 1                       # context parallelism: each sequence over cp ranks
    cp_mode: str = "zigzag"           # allgather, ring, zigzag or ulysses
    shared_experts: int = 0           # MoE (routing.py): S always-on experts, --expert-d-ff wide
    router: str = "softmax"           # softmax, or sigmoid-bias (a balancing bias b)
    bias_rate: float | None = None    # sigmoid-bias: b's step per update (default 1e-3)
    route_groups: int = 1             # node-limited routing: G groups of experts,
    route_top_groups: int | None = None  # M of them per token (default G: no limit)
    trace: str | None = None          # a folder for every rank's timeline (trace.py)
    clip_grad_norm: float | None = None  # clip the global gradient norm to this (clip.py)
    documents: bool = False           # --data: one document a row, padded and masked
    mixed: str | None = None          # bf16 or fp16 compute over --dtype masters (precision.py)
    grad_reduce_dtype: str = "master"  # --mixed: DP/ZeRO reduce main grads, or a 16-bit copy
    loss_scale: float = 65536.0       # --mixed fp16: the initial loss scale S (a power of 2)
    loss_scale_window: int = 1000     # --mixed fp16: clean steps before S doubles
    fp8: str | None = None            # --mixed bf16: the blocks' matmuls in 8 bits (fp8.py)
    fp8_block: int = 128              # --fp8 blockwise: the tile / block size B
    fp8_grad: str = "e5m2"            # --fp8: the output gradients' format (or e4m3)
    fp8_allgather: bool = False       # --fp8 --zero 3: the weights gathered in 8 bits
    # --outer diloco (parallel/diloco.py): the dp replicas train alone, meeting every H steps
    outer: str | None = None          # diloco, or None (plain data parallelism)
    inner_steps: int | None = None    # H: inner steps between two outer steps of a fragment
    outer_lr: float | None = None     # eta of the outer Nesterov SGD (default 0.7)
    outer_momentum: float | None = None  # mu of the outer Nesterov SGD (default 0.9)
    fragments: int | None = None      # P: streaming fragments (default 1: the whole model)

    def resolved(self, world_size: int) -> TrainConfig:
        """Fill the defaults that depend on other flags (d_ff, expert_d_ff, dp)."""
        values = asdict(self)
        if self.d_ff is None:
            values["d_ff"] = 4 * self.d_model
        if self.expert_d_ff is None:
            values["expert_d_ff"] = 2 * self.d_model
        if self.dp is None:
            values["dp"] = max(1, world_size // max(1, self.tp * self.pp * self.cp))
        if self.vocab is None and self.model in GPT_MODELS:
            values["vocab"] = 256 if self.data is not None else 64
        if self.aux_coef is None:  # the bias balances sigmoid-bias: no aux loss by default
            values["aux_coef"] = DEFAULT_AUX_COEF.get(self.router, 0.01)
        if self.bias_rate is None and self.router == "sigmoid-bias" and self.model in MOE_MODELS:
            values["bias_rate"] = DEFAULT_BIAS_RATE
        if self.route_top_groups is None:
            values["route_top_groups"] = self.route_groups
        if self.optimizer == "muon":  # Muon's defaults (core/muon.py)
            for name, default in MUON_DEFAULTS.items():
                if values[name] is None:
                    values[name] = default
        if self.outer == "diloco":  # DiLoCo's defaults (parallel/diloco.py)
            for name, default in DILOCO_DEFAULTS.items():
                if values[name] is None:
                    values[name] = default
        if self.vocab_parallel is None:  # the transformer on a tp group splits its vocabulary
            values["vocab_parallel"] = self.model in GPT_MODELS and self.tp > 1
        return TrainConfig(**values)

    def model_config(self) -> ModelConfig:
        return ModelConfig(model=self.model, layers=self.layers, d_in=self.d_in,
                           d_model=self.d_model, d_ff=self.d_ff, classes=self.classes,
                           experts=self.experts, top_k=self.top_k,
                           expert_d_ff=self.expert_d_ff, capacity_factor=self.capacity_factor,
                           aux_coef=DEFAULT_AUX_COEF.get(self.router, 0.01)
                           if self.aux_coef is None else self.aux_coef,
                           vocab=self.vocab or 64, seq_len=self.seq_len, heads=self.heads,
                           shared_experts=self.shared_experts, router=self.router,
                           route_groups=self.route_groups,
                           route_top_groups=self.route_top_groups)

    def optimizer_rule(self) -> dict:
        """The keyword arguments of `optim.make_optimizer` beyond the name and lr."""
        if self.optimizer != "muon":
            return {}
        return {"momentum": self.momentum, "nesterov": self.nesterov,
                "ns_steps": self.ns_steps, "weight_decay": self.weight_decay,
                "mode": self.muon_mode}

    def mesh_shape(self) -> MeshShape:
        return MeshShape(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp)

    def as_json(self) -> dict:
        """`config.json` of `--dump`: every flag under its long name."""
        return asdict(self)


def worker_config(cfg: TrainConfig) -> TrainConfig:
    """The flags one DiLoCo worker runs with (parallel/diloco.py): a mesh of dp 1 on its
    B/K rows of every step, its own inner steps and no outer ones."""
    return replace(cfg, dp=1, batch=cfg.batch // cfg.dp, outer=None, inner_steps=None,
                   outer_lr=None, outer_momentum=None, fragments=None, save=None,
                   resume=None)
