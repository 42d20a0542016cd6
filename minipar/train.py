"""Training: the single-process reference, and the same steps on a mesh of ranks.

What this file teaches: the skeleton every strategy plugs into. One step is

    1. every rank computes the step's global batch from (seed, step) and keeps
       its rows (data.py);
    2. forward and backward over the microbatches: a plain loop, or the
       pipeline schedule when pp > 1 (pipeline_parallel.py); tensor- and
       expert-parallel blocks talk inside the model (comm.py);
    3. gradients summed over the replicas of each weight and divided by dp
       (data_parallel.py);
    4. the optimizer updates what this rank holds (optim.py).

`train_reference` is the same loop with one process and no communication: the
ground truth that `--check` and the test suite compare every mesh against.

Loss bookkeeping: each rank's microbatch loss is its local mean cross-entropy
plus the MoE aux loss, times 1/M; gradients are then summed over the dp ranks
and divided by dp (the source text's g = 1/8 sum_i g_i). The reported loss of
a step is taken before its update, averaged the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from minipar import autograd as ag
from minipar import nn
from minipar.config import TrainConfig
from minipar.data import make_batch, microbatch_rows, shard_rows
from minipar.optim import make_optimizer


@dataclass
class RunResult:
    """What a run produced. On a mesh, `init`, `final` and `ledger` are filled on rank 0."""

    losses: list[float]
    init: dict[str, np.ndarray] | None = None
    final: dict[str, np.ndarray] | None = None
    ledger: list[dict] = field(default_factory=list)
    extras: dict = field(default_factory=dict)


def step_batch(cfg: TrainConfig, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step`: the same on every rank, from (seed, step) alone."""
    return make_batch(cfg.seed, step, cfg.batch, cfg.d_in, cfg.classes, cfg.dtype)


# ------------------------------------------------------------ the reference
def train_reference(cfg: TrainConfig, on_step: Callable[[int, float], None] | None = None
                    ) -> RunResult:
    """Train with one process: the ground truth for every parallel run.

    Gradient accumulation: each microbatch's loss is scaled by 1/M and its
    gradients add up in `.grad`; one optimizer step follows.
    """
    full = nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)
    init = {k: v.copy() for k, v in full.items()}
    model = nn.build_reference(cfg.model_config(), full)
    params = model.parameters()
    optimizer = make_optimizer(cfg.optimizer, cfg.lr)
    losses = []
    for step in range(cfg.steps):
        x, y = step_batch(cfg, step)
        model.zero_grad()
        total = 0.0
        for m in range(cfg.microbatches):
            rows = microbatch_rows(cfg.batch, cfg.microbatches, m)
            loss = nn.loss_fn(model, x[rows], y[rows]) * (1.0 / cfg.microbatches)
            loss.backward()
            total += loss.item()
        optimizer.step([p.data for p in params], [p.grad for p in params])
        losses.append(total)
        if on_step is not None:
            on_step(step, total)
    return RunResult(losses, init, {p.name: p.data.copy() for p in params})


# ----------------------------------------------------------- the mesh run
def build_rank_model(cfg: TrainConfig, mesh: object, full: dict[str, np.ndarray]
                     ) -> list[nn.Model]:
    """The model pieces this rank holds: one `Model` per pipeline chunk it runs.

    Pipeline rank s with V virtual chunks holds virtual stages s, s+pp, ...;
    virtual stage v holds blocks [v L/(pp V), (v+1) L/(pp V)); the embedding
    sits on virtual stage 0 and the head on the last. Blocks are the reference
    blocks, or their tensor-/expert-parallel versions when the mesh asks.
    """
    model_cfg = cfg.model_config()
    stages = cfg.pp * cfg.virtual
    per_stage = cfg.layers // stages
    chunks = []
    for chunk in range(cfg.virtual):
        v = chunk * cfg.pp + mesh.coords["pp"]
        blocks = [make_block(cfg, model_cfg, mesh, full, i)
                  for i in range(v * per_stage, (v + 1) * per_stage)]
        chunks.append(nn.Model(nn.Embed(full) if v == 0 else None, blocks,
                               nn.Head(full) if v == stages - 1 else None))
    return chunks


def make_block(cfg: TrainConfig, model_cfg: nn.ModelConfig, mesh: object,
               full: dict[str, np.ndarray], index: int) -> nn.Module:
    """Block `index` as this mesh needs it (reference, tensor- or expert-parallel)."""
    if cfg.model == "moe":
        return nn.MoEBlock(full, index, model_cfg)
    return nn.DenseBlock(full, index)


def microbatch_loss(chunk: nn.Model, x: np.ndarray, y: np.ndarray, scale: float) -> ag.Tensor:
    """scale * (local mean CE + aux) for a chunk that holds the whole model."""
    return nn.loss_fn(chunk, x, y) * scale


def forward_backward(cfg: TrainConfig, mesh: object, chunks: list[nn.Model],
                     x: np.ndarray, y: np.ndarray) -> float:
    """Forward and backward of every microbatch of this rank's rows; returns this
    rank's share of the step loss (sum over microbatches of loss/M). With pp > 1
    the pipeline schedule decides the order (pipeline_parallel.py)."""
    dp_rank = mesh.coords["dp"]
    slices = [shard_rows(cfg.batch, cfg.microbatches, cfg.dp, m, dp_rank)
              for m in range(cfg.microbatches)]
    total = 0.0
    for rows in slices:  # gradient accumulation: grads add up in .grad
        loss = microbatch_loss(chunks[0], x[rows], y[rows], 1.0 / cfg.microbatches)
        loss.backward()
        total += loss.item()
    return total


def train(cfg: TrainConfig, world: object, on_step: Callable[[int, float], None] | None = None
          ) -> RunResult:
    """Train `cfg` on the mesh it describes over the `world` communicator.

    `cfg` must be resolved and free of `config.problems`: nothing here checks
    sizes again. Every rank returns the losses; rank 0 also the full parameters
    (init and final) and the ledger of the last step gathered from every rank.
    """
    from minipar.comm import Ledger
    from minipar.mesh import Mesh
    from minipar.parallel import data_parallel

    ledger = Ledger()
    mesh = Mesh(cfg.mesh_shape(), world, ledger)
    full = nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)
    chunks = build_rank_model(cfg, mesh, full)
    params = [p for chunk in chunks for p in chunk.parameters()]
    init, _ = gather_full_params(mesh, params, cfg)
    optimizer = make_optimizer(cfg.optimizer, cfg.lr)
    losses = []
    for step in range(cfg.steps):
        ledger.reset()
        x, y = step_batch(cfg, step)
        for p in params:
            p.grad = None
        local = forward_backward(cfg, mesh, chunks, x, y)
        # data parallelism: sum each weight's gradient over its replicas, divide by dp
        data_parallel.allreduce_gradients(params, mesh)
        optimizer.step([p.data for p in params], [p.grad for p in params])
        ledger.enabled = False  # reporting the loss is not part of training's traffic
        losses.append(report_loss(mesh, local))
        ledger.enabled = True
        if on_step is not None:
            on_step(step, losses[-1])
    last_ledger = ledger.records(mesh.rank)
    ledger.enabled = False
    gathered = mesh.world.gather(last_ledger)
    final, disagreements = gather_full_params(mesh, params, cfg)
    mesh.free()
    return RunResult(losses, init, final,
                     [r for rank in gathered for r in rank] if gathered else [],
                     {"replica_disagreements": disagreements})


def report_loss(mesh: object, local: float) -> float:
    """The step loss on every rank: stage shares summed over pp, averaged over dp."""
    from minipar.comm import allreduce_sum

    value = allreduce_sum(mesh.pp, np.array([local]))
    return float(allreduce_sum(mesh.dp, value)[0] / mesh.shape.dp)


def gather_full_params(mesh: object, params: list[nn.Parameter], cfg: TrainConfig
                       ) -> tuple[dict[str, np.ndarray] | None, list[str]]:
    """Assemble the full canonical parameters on world rank 0 from every rank's pieces.

    Each rank sends `(name, full_index, array)` for what it holds; rank 0 writes
    each piece into its place (the first rank's copy wins). Replicas (the same
    piece on several ranks) must agree: each disagreement is a strategy that
    forgot to synchronize, and is listed in the second return value.
    """
    pieces = [(p.name, p.full_index, p.data) for p in params]
    everything = mesh.world.gather(pieces)
    if everything is None:
        return None, []
    shapes = nn.canonical_shapes(cfg.model_config())
    full: dict[str, np.ndarray] = {}
    disagreements: list[str] = []
    for rank, rank_pieces in enumerate(everything):
        for name, index, data in rank_pieces:
            target = full.setdefault(name, np.full(shapes[name], np.nan, dtype=data.dtype))
            where = slice(None) if index is None else index
            seen = target[where]
            if np.isnan(seen).all():
                target[where] = data
            elif not np.array_equal(seen, data):
                diff = float(np.nanmax(np.abs(seen - data)))
                disagreements.append(f"{name}: rank {rank} differs from an earlier replica "
                                     f"by {diff:.3g}")
    missing = sorted(set(shapes) - set(full))
    if missing or any(np.isnan(v).any() for v in full.values()):
        raise RuntimeError(f"parameters not held by any rank: {missing[:3]}")
    return full, disagreements
