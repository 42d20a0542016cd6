"""A second, independent Muon: docs/design.md's "Muon" rule typed in from the formulas.

What this file teaches: the optimizer's ground truth, written without minipar's
optimizer code. It takes its gradients from the independent models of this folder
(independent.py, independent_gpt.py: backward by hand), so a one-process
`--optimizer muon` run is checked against numbers that share no code with it but
the batches. The Newton-Schulz iteration is written as the polynomial it is,
p(X) = a X + b X X^T X + c X X^T X X^T X, on the short side of the matrix.
"""

from __future__ import annotations

import math

import numpy as np

from minipar.settings.config import TrainConfig
from tests.reference import independent, independent_gpt

A, B, C = 3.4445, -4.7750, 2.0315
BETA1, BETA2, EPSILON = 0.9, 0.999, 1e-8


def takes_muon(name: str, value: np.ndarray) -> bool:
    """The blocks' 2-D weights, the routers excepted."""
    parts = name.split(".")
    return (value.ndim == 2 and parts[0] == "blocks" and parts[-1] == "weight"
            and parts[-2] != "router")


def newton_schulz(u: np.ndarray, steps: int) -> np.ndarray:
    """The quintic iteration on U / ||U||_F, run on the wide orientation."""
    wide = u if u.shape[0] <= u.shape[1] else u.T
    x = wide / max(math.sqrt(float((wide ** 2).sum())), 1e-7)
    for _ in range(steps):
        xxt = x @ x.T
        x = A * x + B * (xxt @ x) + C * (xxt @ (xxt @ x))
    return x if u.shape[0] <= u.shape[1] else x.T


def update(params: dict, grads: dict, state: dict, cfg: TrainConfig, t: int) -> None:
    """One step of Muon on the blocks' matrices and AdamW elsewhere, in place."""
    lr, wd, mu = cfg.lr, cfg.weight_decay, cfg.momentum
    for name, g in grads.items():
        p = params[name]
        if takes_muon(name, p):
            buf = state.setdefault(name, np.zeros_like(g))
            buf[...] = mu * buf + (1 - mu) * g
            u = (1 - mu) * g + mu * buf if cfg.nesterov else buf
            x = newton_schulz(u, cfg.ns_steps)
            params[name] = p * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(p.shape)) * x
            continue
        m, v = state.setdefault(name, (np.zeros_like(g), np.zeros_like(g)))
        m[...] = BETA1 * m + (1 - BETA1) * g
        v[...] = BETA2 * v + (1 - BETA2) * g * g
        decayed = p * (1 - lr * wd)
        params[name] = decayed - lr * (m / (1 - BETA1 ** t)) / (
            np.sqrt(v / (1 - BETA2 ** t)) + EPSILON)


def train(cfg: TrainConfig) -> independent.Run:
    """`cfg.steps` steps of the MLP models or the transformer, updated by `update`."""
    gpt = cfg.model in ("gpt", "gpt-moe")
    module = independent_gpt if gpt else independent
    params = module.init_params(cfg, cfg.seed, cfg.dtype)
    run = independent.Run([], {k: v.copy() for k, v in params.items()}, params)
    state: dict = {}
    size = cfg.batch // cfg.microbatches
    for step in range(cfg.steps):
        if gpt:
            x, y = independent_gpt.batch(cfg, step)
            total, grads = 0.0, {k: np.zeros_like(v) for k, v in params.items()}
            for m in range(cfg.microbatches):
                rows = slice(m * size, (m + 1) * size)
                loss, micro, _ = independent_gpt.loss_and_grads(params, cfg, x[rows], y[rows],
                                                                {}, {})
                total += loss / cfg.microbatches
                for k, g in micro.items():
                    grads[k] += g / cfg.microbatches
        else:
            total, grads, _ = independent.step_gradient(params, cfg, step)
        update(params, grads, state, cfg, step + 1)
        run.losses.append(total)
    run.final = params
    return run
