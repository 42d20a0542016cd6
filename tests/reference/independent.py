"""A second, independent implementation of docs/design.md's model: plain NumPy, backward by hand.

What this file teaches: how to trust a reference. minipar's single-process run
(autograd.py + nn.py) is the ground truth every parallel strategy is compared with;
this file is the ground truth *for that*. It is written from docs/design.md's formulas only,
with no `minipar.core.autograd` and no `minipar.core.nn`: every gradient is the chain rule worked
out on paper and typed in, layer by layer, in reverse. Only the batches come from
`minipar.core.data` (they are an input, not math under test).

It follows the papers docs/design.md follows: pre-LayerNorm residual MLP blocks, top-k routed
experts with renormalized gates and a capacity limit (GShard), the load-balancing loss
`alpha * E * sum_e f_e P_e` (Switch Transformer), Adam with bias correction (Kingma & Ba),
and DeepSeek-V3's routing (docs/design.md, "MoE routing, DeepSeek-V3 style"): sigmoid scores
chosen by s + b, b moved by rate * sign(mean load - load) after each step, node-limited
choice inside the M groups of largest top-2 sum, shared experts added to every token.
The MoE is vectorized per expert: each expert gathers its tokens with one index array.

Used by `python -m pytest tests/core/test_reference.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from minipar.core.data import make_batch
from minipar.settings.config import TrainConfig

LN_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8

Params = dict[str, np.ndarray]


# ------------------------------------------------------------------ init
def init_params(cfg: TrainConfig, seed: int, dtype: str = "float64") -> Params:
    """docs/design.md's init rule: one generator seeded with `seed`, weights drawn in canonical
    name order, N(0, 0.02) except fc2 weights N(0, 0.02 / sqrt(2L)); biases 0, LN 1 and 0."""
    rng = np.random.default_rng(seed)
    d = cfg.d_model
    params: Params = {}

    def draw(name: str, shape: tuple[int, ...], std: float = 0.02) -> None:
        params[name] = rng.standard_normal(shape) * std

    def ffn(prefix: str, width: int) -> None:
        draw(f"{prefix}.fc1.weight", (d, width))
        params[f"{prefix}.fc1.bias"] = np.zeros(width)
        draw(f"{prefix}.fc2.weight", (width, d), 0.02 / math.sqrt(2 * cfg.layers))
        params[f"{prefix}.fc2.bias"] = np.zeros(d)

    draw("embed.weight", (cfg.d_in, d))
    params["embed.bias"] = np.zeros(d)
    for i in range(cfg.layers):
        params[f"blocks.{i}.ln.weight"] = np.ones(d)
        params[f"blocks.{i}.ln.bias"] = np.zeros(d)
        if cfg.model == "moe":
            draw(f"blocks.{i}.router.weight", (d, cfg.experts))
            for e in range(cfg.experts):
                ffn(f"blocks.{i}.experts.{e}", cfg.expert_d_ff)
            for e in range(cfg.shared_experts):
                ffn(f"blocks.{i}.shared_experts.{e}", cfg.expert_d_ff)
        else:
            ffn(f"blocks.{i}", cfg.d_ff)
    draw("head.weight", (d, cfg.classes))
    params["head.bias"] = np.zeros(cfg.classes)
    return {name: value.astype(dtype) for name, value in params.items()}


# ----------------------------------------------------- layers, by hand
def layer_norm(h: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, tuple]:
    """Forward of LN over the last axis (biased variance); returns (out, cache)."""
    mu = h.mean(axis=1, keepdims=True)
    var = ((h - mu) ** 2).mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    x_hat = (h - mu) * rstd
    return x_hat * gamma + beta, (x_hat, rstd)


def layer_norm_backward(dy: np.ndarray, gamma: np.ndarray, cache: tuple
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d/dh of LN, from x_hat = (h - mu) rstd: dh = rstd/n (n dx - sum dx - x_hat sum dx x_hat)
    with dx = dy gamma. Returns (dh, dgamma, dbeta)."""
    x_hat, rstd = cache
    n = x_hat.shape[1]
    dx_hat = dy * gamma
    dh = rstd / n * (n * dx_hat - dx_hat.sum(axis=1, keepdims=True)
                     - x_hat * (dx_hat * x_hat).sum(axis=1, keepdims=True))
    return dh, (dy * x_hat).sum(axis=0), dy.sum(axis=0)


def gelu(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """0.5 a (1 + tanh(c (a + 0.044715 a^3))); returns the value and the tanh (for backward)."""
    t = np.tanh(GELU_C * (a + 0.044715 * a * a * a))
    return 0.5 * a * (1.0 + t), t


def gelu_slope(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """d GELU / da = 0.5 (1 + t) + 0.5 a (1 - t^2) c (1 + 3 * 0.044715 a^2)."""
    return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * a * a)


def softmax_rows(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def ffn(params: Params, prefix: str, u: np.ndarray) -> tuple[np.ndarray, tuple]:
    """GELU(u W1 + b1) W2 + b2 (a dense block's FFN, or one expert)."""
    a = u @ params[f"{prefix}.fc1.weight"] + params[f"{prefix}.fc1.bias"]   # (n, f)
    z, t = gelu(a)
    return z @ params[f"{prefix}.fc2.weight"] + params[f"{prefix}.fc2.bias"], (u, a, t, z)


def ffn_backward(params: Params, prefix: str, dy: np.ndarray, cache: tuple, grads: Params
                 ) -> np.ndarray:
    """Adds the FFN's weight gradients to `grads`; returns d/du."""
    u, a, t, z = cache
    da = (dy @ params[f"{prefix}.fc2.weight"].T) * gelu_slope(a, t)          # (n, f)
    grads[f"{prefix}.fc2.weight"] += z.T @ dy
    grads[f"{prefix}.fc2.bias"] += dy.sum(axis=0)
    grads[f"{prefix}.fc1.weight"] += u.T @ da
    grads[f"{prefix}.fc1.bias"] += da.sum(axis=0)
    return da @ params[f"{prefix}.fc1.weight"].T


# ----------------------------------------------------------------- MoE
def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """The k largest probabilities per row, ties to the lower expert id: argmax returns the
    first maximum; the winner is then masked out and the next pass finds the runner-up."""
    remaining = probs.copy()
    rows = np.arange(probs.shape[0])
    picks = []
    for _ in range(k):                      # k passes over all tokens at once
        best = np.argmax(remaining, axis=1)
        picks.append(best)
        remaining[rows, best] = -np.inf
    return np.stack(picks, axis=1)          # (B, k)


def within_capacity(chosen: np.ndarray, experts: int, limit: int | None) -> np.ndarray:
    """(B, k) mask of the assignments an expert accepts: the first `limit` of its
    assignments in (token, slot) order, i.e. row-major order of `chosen`."""
    if limit is None:
        return np.ones(chosen.shape, dtype=bool)
    flat = chosen.reshape(-1)
    keep = np.zeros(flat.shape, dtype=bool)
    for e in range(experts):                # a running count per expert, vectorized
        mine = flat == e
        keep |= mine & (np.cumsum(mine) <= limit)
    return keep.reshape(chosen.shape)


def best_groups(selection: np.ndarray, groups: int, keep: int) -> np.ndarray:
    """(B, E) mask of the experts in each token's `keep` groups of largest affinity, the
    affinity of a group being the sum of its two largest selection scores; ties to the
    lower group (argmax passes, as `top_k`)."""
    B, E = selection.shape
    per = E // groups
    affinity = np.empty((B, groups))
    for g in range(groups):                  # a loop over groups, not tokens
        block = selection[:, g * per:(g + 1) * per]
        two = top_k(block, min(2, per))
        affinity[:, g] = np.take_along_axis(block, two, axis=1).sum(axis=1)
    mask = np.zeros((B, E), dtype=bool)
    for g in top_k(affinity, keep).T:        # each pass: one more kept group per token
        for j in range(per):
            mask[np.arange(B), g * per + j] = True
    return mask


def moe_ffn(params: Params, prefix: str, u: np.ndarray, cfg: TrainConfig,
            bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """sum_{e in top-k} g_e Expert_e(u) (+ the shared experts) and the aux loss
    alpha E sum_e f_e P_e. `bias`: the sigmoid-bias router's b, for the choice only."""
    B, E, k = u.shape[0], cfg.experts, cfg.top_k
    logits = u @ params[f"{prefix}.router.weight"]
    sigmoid = getattr(cfg, "router", "softmax") == "sigmoid-bias"
    probs = 1.0 / (1.0 + np.exp(-logits)) if sigmoid else softmax_rows(logits)  # (B, E)
    selection = probs if bias is None else probs + bias
    groups = getattr(cfg, "route_groups", 1)
    keep_groups = getattr(cfg, "route_top_groups", None) or groups
    if keep_groups < groups:
        selection = np.where(best_groups(selection, groups, keep_groups), selection, -np.inf)
    chosen = top_k(selection, k)                                         # (B, k)
    picked = np.take_along_axis(probs, chosen, axis=1)
    total = picked.sum(axis=1, keepdims=True)
    gates = picked / total                                               # (B, k)
    limit = None if cfg.capacity_factor is None else \
        math.ceil(cfg.capacity_factor * k * B / E)
    keep = within_capacity(chosen, E, limit)
    out = np.zeros_like(u)
    runs = []
    for e in range(E):
        token, slot = np.nonzero((chosen == e) & keep)    # row-major: global token order
        y, cache = ffn(params, f"{prefix}.experts.{e}", u[token])
        out[token] += gates[token, slot][:, None] * y     # a token meets expert e at most once
        runs.append((token, slot, y, cache))
    shared = []
    for e in range(getattr(cfg, "shared_experts", 0)):
        y, run = ffn(params, f"{prefix}.shared_experts.{e}", u)
        out += y
        shared.append(run)
    f = np.bincount(chosen.reshape(-1), minlength=E) / (B * k)   # counted before any drop
    aux = cfg.aux_coef * E * np.sum(f * probs.mean(axis=0))
    cache = {"probs": probs, "chosen": chosen, "gates": gates, "total": total, "f": f,
             "runs": runs, "dropped": int((~keep).sum()), "sigmoid": sigmoid,
             "shared": shared, "load": np.bincount(chosen.reshape(-1), minlength=E)}
    return out, aux, cache


def moe_ffn_backward(params: Params, prefix: str, u: np.ndarray, dout: np.ndarray,
                     aux_weight: float, cache: dict, cfg: TrainConfig, grads: Params
                     ) -> np.ndarray:
    """Backward of `moe_ffn`, given d loss/d out and d loss/d aux; returns d/du."""
    probs, chosen, gates = cache["probs"], cache["chosen"], cache["gates"]
    du = np.zeros_like(u)
    dgates = np.zeros_like(gates)
    for e, (token, slot, y, run) in enumerate(cache["runs"]):
        dgates[token, slot] = (dout[token] * y).sum(axis=1)
        dy = gates[token, slot][:, None] * dout[token]
        du[token] += ffn_backward(params, f"{prefix}.experts.{e}", dy, run, grads)
    # gates = picked / total: d picked_j = (d gate_j - sum_i d gate_i gate_i) / total
    dpicked = (dgates - (dgates * gates).sum(axis=1, keepdims=True)) / cache["total"]
    dprobs = np.zeros_like(probs)
    np.put_along_axis(dprobs, chosen, dpicked, axis=1)        # the k experts differ per row
    # aux = alpha E sum_e f_e mean_b p_be: d aux / d p_be = alpha E f_e / B (f is a count)
    dprobs += aux_weight * cfg.aux_coef * cfg.experts * cache["f"] / u.shape[0]
    for e, run in enumerate(cache.get("shared", [])):
        du += ffn_backward(params, f"{prefix}.shared_experts.{e}", dout, run, grads)
    if cache.get("sigmoid"):                  # d sigmoid(z) / dz = s (1 - s), per entry
        dlogits = dprobs * probs * (1.0 - probs)
    else:
        dlogits = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
    grads[f"{prefix}.router.weight"] += u.T @ dlogits
    return du + dlogits @ params[f"{prefix}.router.weight"].T


# --------------------------------------------------------------- model
def loss_and_grads(params: Params, cfg: TrainConfig, x: np.ndarray, y: np.ndarray,
                   biases: Params | None = None, loads: Params | None = None
                   ) -> tuple[float, Params, int]:
    """Mean CE + sum of aux losses on one (micro)batch, every gradient, and how many
    MoE assignments capacity dropped. `biases`: each block's b by name (sigmoid-bias);
    `loads`: each block's assignments per expert are added there."""
    h = x @ params["embed.weight"] + params["embed.bias"]
    tape, aux_total, dropped = [], 0.0, 0
    for i in range(cfg.layers):
        p = f"blocks.{i}"
        u, ln_cache = layer_norm(h, params[f"{p}.ln.weight"], params[f"{p}.ln.bias"])
        if cfg.model == "moe":
            name = f"{p}.router.bias_balance"
            out, aux, cache = moe_ffn(params, p, u, cfg, (biases or {}).get(name))
            aux_total, dropped = aux_total + aux, dropped + cache["dropped"]
            if loads is not None:
                loads[name] = loads.get(name, 0) + cache["load"]
        else:
            out, cache = ffn(params, p, u)
        tape.append((u, ln_cache, cache))
        h = h + out
    logits = h @ params["head.weight"] + params["head.bias"]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(y))
    loss = -log_probs[rows, y].mean() + aux_total

    grads = {name: np.zeros_like(value) for name, value in params.items()}
    dlogits = np.exp(log_probs)
    dlogits[rows, y] -= 1.0
    dlogits /= len(y)                                   # d mean CE / d logits
    grads["head.weight"] += h.T @ dlogits
    grads["head.bias"] += dlogits.sum(axis=0)
    dh = dlogits @ params["head.weight"].T
    for i in reversed(range(cfg.layers)):               # the residual: dh passes straight by
        p = f"blocks.{i}"
        u, ln_cache, cache = tape[i]
        if cfg.model == "moe":
            du = moe_ffn_backward(params, p, u, dh, 1.0, cache, cfg, grads)
        else:
            du = ffn_backward(params, p, dh, cache, grads)
        dh_ln, dgamma, dbeta = layer_norm_backward(du, params[f"{p}.ln.weight"], ln_cache)
        grads[f"{p}.ln.weight"] += dgamma
        grads[f"{p}.ln.bias"] += dbeta
        dh = dh + dh_ln
    grads["embed.weight"] += x.T @ dh
    grads["embed.bias"] += dh.sum(axis=0)
    return float(loss), grads, dropped


# ----------------------------------------------------------- training
@dataclass
class Run:
    """What `train` produced, in the shape of minipar's RunResult, plus drop counts."""

    losses: list[float]
    init: Params
    final: Params
    dropped: list[int] = field(default_factory=list)


def step_gradient(params: Params, cfg: TrainConfig, step: int, biases: Params | None = None,
                  loads: Params | None = None) -> tuple[float, Params, int]:
    """Loss and gradient of one step: the mean over M contiguous microbatches."""
    x, y = make_batch(cfg.seed, step, cfg.batch, cfg.d_in, cfg.classes, cfg.dtype)
    size = cfg.batch // cfg.microbatches
    total, dropped = 0.0, 0
    grads = {name: np.zeros_like(value) for name, value in params.items()}
    for m in range(cfg.microbatches):
        rows = slice(m * size, (m + 1) * size)
        loss, micro_grads, micro_dropped = loss_and_grads(params, cfg, x[rows], y[rows],
                                                          biases, loads)
        total += loss / cfg.microbatches
        dropped += micro_dropped
        for name, g in micro_grads.items():
            grads[name] += g / cfg.microbatches
    return total, grads, dropped


def update(params: Params, grads: Params, state: dict, cfg: TrainConfig, t: int) -> None:
    """SGD `p -= lr g`, or Adam with bias correction, step t (1-based), in place."""
    for name, g in grads.items():
        if cfg.optimizer == "sgd":
            params[name] -= cfg.lr * g
            continue
        m, v = state.setdefault(name, (np.zeros_like(g), np.zeros_like(g)))
        m[...] = ADAM_B1 * m + (1 - ADAM_B1) * g
        v[...] = ADAM_B2 * v + (1 - ADAM_B2) * g * g
        m_hat, v_hat = m / (1 - ADAM_B1 ** t), v / (1 - ADAM_B2 ** t)
        params[name] -= cfg.lr * m_hat / (np.sqrt(v_hat) + ADAM_EPS)


def train(cfg: TrainConfig) -> Run:
    """`cfg.steps` steps from docs/design.md's init; losses are taken before each update."""
    params = init_params(cfg, cfg.seed, cfg.dtype)
    run = Run([], {name: value.copy() for name, value in params.items()}, params)
    state: dict = {}
    balanced = cfg.model == "moe" and cfg.router == "sigmoid-bias"
    biases = {f"blocks.{i}.router.bias_balance": np.zeros(cfg.experts)
              for i in range(cfg.layers)} if balanced else {}
    for step in range(cfg.steps):
        loads: Params = {}
        loss, grads, dropped = step_gradient(params, cfg, step, biases, loads)
        update(params, grads, state, cfg, step + 1)
        for name in biases:  # b_e += rate sign(mean load - load_e), the step's whole batch
            biases[name] = biases[name] + cfg.bias_rate * np.sign(
                loads[name].sum() / cfg.experts - loads[name])
        run.losses.append(loss)
        run.dropped.append(dropped)
    run.final = {**params, **biases}
    return run
