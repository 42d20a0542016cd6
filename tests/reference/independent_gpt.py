"""A second, independent implementation of the transformer of docs/design.md, by hand.

What this file teaches: how to trust the transformer of minipar (gpt.py + attention.py
+ autograd). It is written from docs/design.md's formulas, "The transformer", with no
`minipar.core.autograd`, `minipar.core.nn` or `minipar.core.gpt`: attention is computed head by head
from the column blocks of Wq, Wk, Wv exactly as the formula reads
(q_h = a Wq[:, h dh:(h+1) dh] + bq[...]), and every gradient is the chain rule worked
out on paper. The position-wise layers (LayerNorm, the dense FFN, the MoE FFN, Adam) are
those of `tests/reference/independent.py`, applied to the B*T positions as rows. Only the batches
come from `minipar.core.data` (an input, not math under test).

The attention backward, per head, with P = softmax(S), G = d loss / d o:
    dV = P^T G,  dP = G V^T,  dS = P * (dP - rowsum(dP * P)),
    dQ = dS K / sqrt(dh),  dK = dS^T Q / sqrt(dh).
The key bias: S_ij gains q_i . bk, the same for every j, and the softmax over j ignores
it, so d loss / d bk = sum_i rowsum(dS)_i q_i = 0 exactly (the rows of P sum to 1).

Used by `python -m pytest tests/core/test_gpt_reference.py`.
"""

from __future__ import annotations

import math

import numpy as np

from minipar.core.data import make_sequences, make_text_windows
from minipar.settings.config import TrainConfig
from tests.reference.independent import (
    Params,
    Run,
    ffn,
    ffn_backward,
    layer_norm,
    layer_norm_backward,
    moe_ffn,
    moe_ffn_backward,
    update,
)


# ------------------------------------------------------------------ init
def init_params(cfg: TrainConfig, seed: int, dtype: str = "float64") -> Params:
    """docs/design.md's init, in canonical order: embeddings and weights N(0, 0.02), the
    residual outputs (attn.proj, fc2, expert fc2) N(0, 0.02 / sqrt(2L)), biases 0, LN 1, 0."""
    rng = np.random.default_rng(seed)
    d, small = cfg.d_model, 0.02 / math.sqrt(2 * cfg.layers)
    params: Params = {}

    def draw(name: str, shape: tuple[int, ...], std: float = 0.02) -> None:
        params[name] = rng.standard_normal(shape) * std

    def norm(name: str) -> None:
        params[f"{name}.weight"], params[f"{name}.bias"] = np.ones(d), np.zeros(d)

    def ffn_weights(prefix: str, width: int) -> None:
        draw(f"{prefix}.fc1.weight", (d, width))
        params[f"{prefix}.fc1.bias"] = np.zeros(width)
        draw(f"{prefix}.fc2.weight", (width, d), small)
        params[f"{prefix}.fc2.bias"] = np.zeros(d)

    draw("tok_embed.weight", (cfg.vocab, d))
    draw("pos_embed.weight", (cfg.seq_len, d))
    for i in range(cfg.layers):
        p = f"blocks.{i}"
        norm(f"{p}.ln1")
        for part in ("q", "k", "v", "proj"):
            draw(f"{p}.attn.{part}.weight", (d, d), small if part == "proj" else 0.02)
            params[f"{p}.attn.{part}.bias"] = np.zeros(d)
        norm(f"{p}.ln2")
        if cfg.model == "gpt-moe":
            draw(f"{p}.router.weight", (d, cfg.experts))
            for e in range(cfg.experts):
                ffn_weights(f"{p}.experts.{e}", cfg.expert_d_ff)
            for e in range(cfg.shared_experts):
                ffn_weights(f"{p}.shared_experts.{e}", cfg.expert_d_ff)
        else:
            ffn_weights(p, cfg.d_ff)
    norm("ln_f")
    draw("head.weight", (d, cfg.vocab))
    params["head.bias"] = np.zeros(cfg.vocab)
    return {name: value.astype(dtype) for name, value in params.items()}


# ------------------------------------------------------------- attention
def attention(params: Params, p: str, a: np.ndarray, heads: int) -> tuple[np.ndarray, tuple]:
    """concat_h softmax(causal(q_h k_h^T / sqrt(dh))) v_h @ Wo + bo, head by head.
    a (B, T, d) -> (B, T, d)."""
    B, T, d = a.shape
    dh = d // heads
    future = ~np.tril(np.ones((T, T), dtype=bool))           # j > i: masked
    outputs, per_head = [], []
    for h in range(heads):
        cols = slice(h * dh, (h + 1) * dh)
        q, k, v = (a @ params[f"{p}.attn.{n}.weight"][:, cols] + params[f"{p}.attn.{n}.bias"][cols]
                   for n in ("q", "k", "v"))               # (B, T, dh) each
        s = np.einsum("bid,bjd->bij", q, k) / math.sqrt(dh)
        s[:, future] = -np.inf
        e = np.exp(s - s.max(axis=2, keepdims=True))
        prob = e / e.sum(axis=2, keepdims=True)              # (B, T, T)
        outputs.append(np.einsum("bij,bjd->bid", prob, v))
        per_head.append((q, k, v, prob))
    o = np.concatenate(outputs, axis=2)                       # (B, T, d)
    out = o @ params[f"{p}.attn.proj.weight"] + params[f"{p}.attn.proj.bias"]
    return out, (a, o, per_head)


def attention_backward(params: Params, p: str, dout: np.ndarray, cache: tuple, heads: int,
                       grads: Params) -> np.ndarray:
    """Adds the attention weights' gradients to `grads`; returns d loss / d a (B, T, d)."""
    a, o, per_head = cache
    d = a.shape[2]
    dh = d // heads
    rows, drows = a.reshape(-1, d), dout.reshape(-1, d)
    grads[f"{p}.attn.proj.weight"] += o.reshape(-1, d).T @ drows
    grads[f"{p}.attn.proj.bias"] += drows.sum(axis=0)
    do = dout @ params[f"{p}.attn.proj.weight"].T             # (B, T, d)
    da = np.zeros_like(a)
    for h, (q, k, v, prob) in enumerate(per_head):
        cols = slice(h * dh, (h + 1) * dh)
        g = do[:, :, cols]                                    # (B, T, dh)
        dv = np.einsum("bij,bid->bjd", prob, g)
        dprob = np.einsum("bid,bjd->bij", g, v)
        ds = prob * (dprob - (dprob * prob).sum(axis=2, keepdims=True))
        dq = np.einsum("bij,bjd->bid", ds, k) / math.sqrt(dh)
        dk = np.einsum("bij,bid->bjd", ds, q) / math.sqrt(dh)
        for name, dx in (("q", dq), ("k", dk), ("v", dv)):
            grads[f"{p}.attn.{name}.weight"][:, cols] += rows.T @ dx.reshape(-1, dh)
            if name != "k":                                   # d bk = 0 exactly (see top)
                grads[f"{p}.attn.{name}.bias"][cols] += dx.sum(axis=(0, 1))
            da += dx @ params[f"{p}.attn.{name}.weight"][:, cols].T
    return da


# --------------------------------------------------------------- model
def loss_and_grads(params: Params, cfg: TrainConfig, x: np.ndarray, y: np.ndarray,
                   biases: Params | None = None, loads: Params | None = None
                   ) -> tuple[float, Params, int]:
    """Mean next-token CE over all B*T positions + the aux losses, every gradient, and
    how many MoE assignments capacity dropped. x, y (B, T) token ids. `biases`: each
    block's b (sigmoid-bias), for the choice; `loads`: each block's assignments per
    expert are added there."""
    B, T = x.shape
    d = cfg.d_model
    h = params["tok_embed.weight"][x] + params["pos_embed.weight"][None, :T]   # (B, T, d)
    tape, aux_total, dropped = [], 0.0, 0
    for i in range(cfg.layers):
        p = f"blocks.{i}"
        a, ln1 = layer_norm(h.reshape(-1, d), params[f"{p}.ln1.weight"], params[f"{p}.ln1.bias"])
        att, att_cache = attention(params, p, a.reshape(B, T, d), cfg.heads)
        h = h + att
        u, ln2 = layer_norm(h.reshape(-1, d), params[f"{p}.ln2.weight"], params[f"{p}.ln2.bias"])
        if cfg.model == "gpt-moe":                            # the B*T positions are tokens
            name = f"{p}.router.bias_balance"
            out, aux, ffn_cache = moe_ffn(params, p, u, cfg, (biases or {}).get(name))
            aux_total, dropped = aux_total + aux, dropped + ffn_cache["dropped"]
            if loads is not None:
                loads[name] = loads.get(name, 0) + ffn_cache["load"]
        else:
            out, ffn_cache = ffn(params, p, u)
        tape.append((ln1, att_cache, u, ln2, ffn_cache))
        h = h + out.reshape(B, T, d)
    z, lnf = layer_norm(h.reshape(-1, d), params["ln_f.weight"], params["ln_f.bias"])
    logits = z @ params["head.weight"] + params["head.bias"]                 # (N, V)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    labels, n = y.reshape(-1), y.size
    loss = -log_probs[np.arange(n), labels].mean() + aux_total

    grads = {name: np.zeros_like(value) for name, value in params.items()}
    dlogits = np.exp(log_probs)
    dlogits[np.arange(n), labels] -= 1.0
    dlogits /= n                                              # mean over all B*T positions
    grads["head.weight"] += z.T @ dlogits
    grads["head.bias"] += dlogits.sum(axis=0)
    dh, dgamma, dbeta = layer_norm_backward(dlogits @ params["head.weight"].T,
                                            params["ln_f.weight"], lnf)
    grads["ln_f.weight"] += dgamma
    grads["ln_f.bias"] += dbeta
    for i in reversed(range(cfg.layers)):                     # dh (N, d) passes each residual
        p = f"blocks.{i}"
        ln1, att_cache, u, ln2, ffn_cache = tape[i]
        if cfg.model == "gpt-moe":
            du = moe_ffn_backward(params, p, u, dh, 1.0, ffn_cache, cfg, grads)
        else:
            du = ffn_backward(params, p, dh, ffn_cache, grads)
        dh_ln, dgamma, dbeta = layer_norm_backward(du, params[f"{p}.ln2.weight"], ln2)
        grads[f"{p}.ln2.weight"] += dgamma
        grads[f"{p}.ln2.bias"] += dbeta
        dh = dh + dh_ln
        da = attention_backward(params, p, dh.reshape(B, T, d), att_cache, cfg.heads, grads)
        dh_ln, dgamma, dbeta = layer_norm_backward(da.reshape(-1, d),
                                                   params[f"{p}.ln1.weight"], ln1)
        grads[f"{p}.ln1.weight"] += dgamma
        grads[f"{p}.ln1.bias"] += dbeta
        dh = dh + dh_ln
    np.add.at(grads["tok_embed.weight"], x.reshape(-1), dh)  # repeated tokens add up
    grads["pos_embed.weight"][:T] += dh.reshape(B, T, d).sum(axis=0)
    return float(loss), grads, dropped


# ----------------------------------------------------------- training
def batch(cfg: TrainConfig, step: int) -> tuple[np.ndarray, np.ndarray]:
    if cfg.data is not None:
        return make_text_windows(cfg.data, cfg.seed, step, cfg.batch, cfg.seq_len)
    return make_sequences(cfg.seed, step, cfg.batch, cfg.seq_len, cfg.vocab)


def train(cfg: TrainConfig) -> Run:
    """`cfg.steps` steps; each step's loss and gradient the mean over M contiguous
    microbatches of sequences; losses taken before each update."""
    params = init_params(cfg, cfg.seed, cfg.dtype)
    run = Run([], {name: value.copy() for name, value in params.items()}, params)
    state: dict = {}
    size = cfg.batch // cfg.microbatches
    balanced = cfg.model == "gpt-moe" and cfg.router == "sigmoid-bias"
    biases = {f"blocks.{i}.router.bias_balance": np.zeros(cfg.experts)
              for i in range(cfg.layers)} if balanced else {}
    for step in range(cfg.steps):
        x, y = batch(cfg, step)
        total, dropped = 0.0, 0
        grads = {name: np.zeros_like(value) for name, value in params.items()}
        loads: Params = {}
        for m in range(cfg.microbatches):
            rows = slice(m * size, (m + 1) * size)
            loss, micro, micro_dropped = loss_and_grads(params, cfg, x[rows], y[rows],
                                                        biases, loads)
            total += loss / cfg.microbatches
            dropped += micro_dropped
            for name, g in micro.items():
                grads[name] += g / cfg.microbatches
        update(params, grads, state, cfg, step + 1)
        for name in biases:  # b_e += rate sign(mean load - load_e), the step's whole batch
            biases[name] = biases[name] + cfg.bias_rate * np.sign(
                loads[name].sum() / cfg.experts - loads[name])
        run.losses.append(total)
        run.dropped.append(dropped)
    run.final = {**params, **biases}
    return run
