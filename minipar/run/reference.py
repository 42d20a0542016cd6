"""The one-process run: the ground truth every mesh is compared against.

What this file teaches: a training step with no communication at all. Every rank (or
one process alone) computes the step's global batch from (seed, step) (data.py); the
model is the whole one of nn.py or gpt.py; each microbatch's loss is scaled by 1/M and
its gradients add up in `.grad`; one optimizer step follows (optim.py). With --mixed the
same steps in 16 bits (core/precision.py): master copies updated, the loss scaled by S.

`train_one_process` is that loop; `reference_step` its one step, which the DiLoCo
reference (diloco_train.py) runs once per worker. run/train.py's `train_reference`
picks the loop a run's flags call for; `--check` and the test suite compare every mesh
against it:

    python -m minipar train --dp 2 --check      # a mesh run, then this one, compared
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from minipar.compose import clip
from minipar.core import documents, gpt, nn, precision, routing
from minipar.core.data import (
    make_batch,
    make_sequences,
    make_text_windows,
    microbatch_rows,
)
from minipar.core.optim import held_whole, make_optimizer
from minipar.settings.config import TrainConfig


@dataclass
class RunResult:
    """What a run produced. On a mesh, `init`, `final` and `ledger` are filled on rank 0."""

    losses: list[float]
    init: dict[str, np.ndarray] | None = None
    final: dict[str, np.ndarray] | None = None
    ledger: list[dict] = field(default_factory=list)
    extras: dict = field(default_factory=dict)


def step_batch(cfg: TrainConfig, step: int, rows: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step`: the same on every rank, from (seed, step) alone.
    MLP models: x (B, d_in), y (B,); the transformer: token ids x, y (B, T). With
    `rows`, only those rows of it (data.rank_rows: a rank's own), drawn without the rest.
    With --documents, y is `documents.IGNORE` at the padded positions."""
    if cfg.data is not None and cfg.documents:
        return documents.make_documents(cfg.data, cfg.seed, step, cfg.batch, cfg.seq_len, rows)
    if cfg.data is not None:
        return make_text_windows(cfg.data, cfg.seed, step, cfg.batch, cfg.seq_len, rows)
    if cfg.model_config().is_gpt:
        return make_sequences(cfg.seed, step, cfg.batch, cfg.seq_len, cfg.vocab, rows)
    return make_batch(cfg.seed, step, cfg.batch, cfg.d_in, cfg.classes, cfg.dtype, rows)


def build_reference(cfg: TrainConfig, full: dict[str, np.ndarray]) -> nn.Model:
    """The single-process model: the MLP models of nn.py or the transformer of gpt.py."""
    model_cfg = cfg.model_config()
    return (gpt.build_reference if model_cfg.is_gpt else nn.build_reference)(model_cfg, full)


def train_one_process(cfg: TrainConfig, on_step: Callable[[int, float], None] | None
                     ) -> RunResult:
    """The one-process loop of `train_reference` (run/train.py), under the precision
    policy of `cfg` already in force: `cfg.steps` steps of `reference_step`."""
    full = nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)
    init = {k: v.copy() for k, v in full.items()}
    model = build_reference(cfg, full)
    params = model.parameters()
    optimizer = make_optimizer(cfg.optimizer, cfg.lr, **cfg.optimizer_rule())
    losses, norms = [], []
    # --mixed: the optimizer updates the masters; each p.data is the 16-bit copy
    masters = [p.data for p in params] if cfg.mixed else None
    if masters is not None:
        for p in params:
            p.data = precision.to_low(p.data)
    scaler = precision.make_scaler(cfg.mixed, cfg.loss_scale, cfg.loss_scale_window)
    for step in range(cfg.steps):
        losses.append(reference_step(cfg, model, optimizer, masters, scaler, norms,
                                     *step_batch(cfg, step)))
        if on_step is not None:
            step_done(on_step, step, losses[-1], norms, scaler if cfg.mixed else None)
    final = masters if masters is not None else [p.data for p in params]
    return RunResult(losses, init, {**{p.name: m.copy() for p, m in zip(params, final)},
                                    **routing.bias_values(model)},
                     extras={"gnorms": norms, "loss_scale": scaler.scale,
                             "skipped": scaler.skipped})


def reference_step(cfg: TrainConfig, model: nn.Model, optimizer: object,
                   masters: list[np.ndarray] | None, scaler: precision.LossScaler,
                   norms: list[float], x: np.ndarray, y: np.ndarray) -> float:
    """One step of the one-process run on the batch `x, y` (its M microbatches): forward,
    backward, the optimizer's update of the parameters (of `masters` under --mixed, the
    16-bit copies cast from them; fp16 skips an overflowing step); returns the step loss.
    With --clip-grad-norm the step's gradient norm is appended to `norms`."""
    params = model.parameters()
    model.zero_grad()
    if precision.FP8 is not None:  # --fp8: this step's weight amaxes (core/fp8.py)
        precision.FP8.begin_step(params)
    total = 0.0
    # --documents: CE over the valid positions / N, the batch's valid positions
    valid = documents.valid_positions(y) if cfg.documents else None
    batch = len(x)
    for m in range(cfg.microbatches):
        rows = microbatch_rows(batch, cfg.microbatches, m)
        weight = 1.0 if valid is None else documents.loss_weight(y[rows], y.size, valid)
        loss = nn.loss_fn(model, x[rows], y[rows], weight) * (1.0 / cfg.microbatches)
        loss.backward(scaler.scale)   # S = 1 but for fp16
        total += loss.item()
    if masters is not None and not scaler.static:  # fp16: unscale, skip on overflow
        grads = [p.grad if p.grad is not None else np.zeros_like(m)
                 for p, m in zip(params, masters)]
        for g in grads:
            g *= 1.0 / scaler.scale
        if scaler.update(precision.nonfinite(grads)):
            return total
    if cfg.clip_grad_norm is not None:  # the whole gradient's norm, then the scale
        norms.append(clip.clip_reference([p.grad for p in params], cfg.clip_grad_norm))
    if masters is None:
        optimizer.step([p.data for p in params], [p.grad for p in params],
                       held_whole(params))
    else:  # the masters, then the 16-bit copies cast from them
        optimizer.step(masters, [p.grad for p in params], held_whole(params))
        for p, master in zip(params, masters):
            p.data = precision.to_low(master)
    if cfg.router == "sigmoid-bias":  # b moves against the step's load (routing.py)
        routing.update_biases(model, None, cfg.bias_rate)
    return total


def step_done(on_step: Callable[..., None], step: int, loss: float, norms: list[float],
              scaler: precision.LossScaler | None = None) -> None:
    """Report a step: `on_step(step, loss)`, and with --clip-grad-norm also
    `gnorm=` the step's global gradient norm (before clipping); with --mixed also
    `scale=` the loss scale S after the step and `skipped=` the steps skipped so far."""
    extra = {} if scaler is None else {"scale": scaler.scale, "skipped": scaler.skipped}
    if norms:
        on_step(step, loss, gnorm=norms[-1], **extra)
    else:
        on_step(step, loss, **extra)

