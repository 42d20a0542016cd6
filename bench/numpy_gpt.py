"""The yardstick for the transformer: one training step of `--model gpt` as plain NumPy.

Forward and backward by hand, all heads batched as an axis (B, H, T, dh), no tape, no
closures: the fastest honest way to run docs/design.md's transformer on one thread.
`bench/run.py` times minipar's step (autograd + attention.py + gpt.py) against this.
"""

from __future__ import annotations

import math

import numpy as np

C = math.sqrt(2.0 / math.pi)


def _layer_norm(h: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> tuple:
    mu = h.mean(axis=-1, keepdims=True)
    xc = h - mu
    inv = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + 1e-5)
    xh = xc * inv
    return xh * gamma + beta, (xh, inv)


def _layer_norm_back(du: np.ndarray, gamma: np.ndarray, cache: tuple) -> tuple:
    xh, inv = cache
    gh = du * gamma
    dx = (gh - gh.mean(axis=-1, keepdims=True) - xh * (gh * xh).mean(axis=-1, keepdims=True))
    return dx * inv, (du * xh).reshape(-1, xh.shape[-1]).sum(0), du.reshape(-1, xh.shape[-1]).sum(0)


def _mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(B, T, in) @ (in, out) as one (B*T, in) @ (in, out) BLAS call."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def _split(x: np.ndarray, heads: int) -> np.ndarray:
    b, t, d = x.shape
    return x.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)


def _merge(x: np.ndarray) -> np.ndarray:
    b, h, t, dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * dh)


def numpy_gpt_step(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, layers: int,
                   heads: int, lr: float) -> float:
    """Forward, backward and an SGD update of the dense transformer, in place; the loss."""
    B, T = x.shape
    d = params["tok_embed.weight"].shape[1]
    scale = 1.0 / math.sqrt(d // heads)
    future = np.triu(np.ones((T, T), dtype=bool), 1)
    h = params["tok_embed.weight"][x] + params["pos_embed.weight"][:T]
    saved = []
    for i in range(layers):
        p = f"blocks.{i}"
        a, ln1 = _layer_norm(h, params[f"{p}.ln1.weight"], params[f"{p}.ln1.bias"])
        q, k, v = (_split(_mm(a, params[f"{p}.attn.{n}.weight"]) + params[f"{p}.attn.{n}.bias"],
                          heads) for n in ("q", "k", "v"))
        s = q @ k.transpose(0, 1, 3, 2) * scale
        s[..., future] = -np.inf
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        prob = e / e.sum(axis=-1, keepdims=True)
        o = _merge(prob @ v)
        h = h + _mm(o, params[f"{p}.attn.proj.weight"]) + params[f"{p}.attn.proj.bias"]
        u, ln2 = _layer_norm(h, params[f"{p}.ln2.weight"], params[f"{p}.ln2.bias"])
        pre = _mm(u, params[f"{p}.fc1.weight"]) + params[f"{p}.fc1.bias"]
        t = np.tanh(C * (pre + 0.044715 * pre * pre * pre))
        z = 0.5 * pre * (1.0 + t)
        h = h + _mm(z, params[f"{p}.fc2.weight"]) + params[f"{p}.fc2.bias"]
        saved.append((a, ln1, q, k, v, prob, o, u, ln2, pre, t, z))
    zf, lnf = _layer_norm(h, params["ln_f.weight"], params["ln_f.bias"])
    logits = zf.reshape(B * T, d) @ params["head.weight"] + params["head.bias"]
    shifted = logits - logits.max(axis=1, keepdims=True)
    ex = np.exp(shifted)
    total = ex.sum(axis=1, keepdims=True)
    rows, labels = np.arange(B * T), y.reshape(-1)
    loss = float(-(shifted[rows, labels] - np.log(total[:, 0])).mean())
    dlog = ex / total
    dlog[rows, labels] -= 1.0
    dlog /= B * T
    grads = {"head.weight": zf.reshape(B * T, d).T @ dlog, "head.bias": dlog.sum(axis=0)}
    dh, grads["ln_f.weight"], grads["ln_f.bias"] = _layer_norm_back(
        (dlog @ params["head.weight"].T).reshape(B, T, d), params["ln_f.weight"], lnf)
    for i in reversed(range(layers)):
        p = f"blocks.{i}"
        a, ln1, q, k, v, prob, o, u, ln2, pre, t, z = saved[i]
        flat = dh.reshape(B * T, d)
        grads[f"{p}.fc2.weight"] = z.reshape(B * T, -1).T @ flat
        grads[f"{p}.fc2.bias"] = flat.sum(axis=0)
        dpre = _mm(dh, params[f"{p}.fc2.weight"].T) * (
            0.5 * (1.0 + t) + 0.5 * pre * (1.0 - t * t) * C * (1.0 + 3 * 0.044715 * pre * pre))
        dflat = dpre.reshape(B * T, -1)
        grads[f"{p}.fc1.weight"] = u.reshape(B * T, d).T @ dflat
        grads[f"{p}.fc1.bias"] = dflat.sum(axis=0)
        dx, grads[f"{p}.ln2.weight"], grads[f"{p}.ln2.bias"] = _layer_norm_back(
            _mm(dpre, params[f"{p}.fc1.weight"].T), params[f"{p}.ln2.weight"], ln2)
        dh = dh + dx
        flat = dh.reshape(B * T, d)
        grads[f"{p}.attn.proj.weight"] = o.reshape(B * T, d).T @ flat
        grads[f"{p}.attn.proj.bias"] = flat.sum(axis=0)
        do = _split(_mm(dh, params[f"{p}.attn.proj.weight"].T), heads)
        dv = prob.transpose(0, 1, 3, 2) @ do
        dprob = do @ v.transpose(0, 1, 3, 2)
        ds = prob * (dprob - (dprob * prob).sum(axis=-1, keepdims=True))
        dq, dk = ds @ k * scale, ds.transpose(0, 1, 3, 2) @ q * scale
        arows = a.reshape(B * T, d)
        da = np.zeros_like(a)
        for name, g in (("q", dq), ("k", dk), ("v", dv)):
            g = _merge(g)
            grads[f"{p}.attn.{name}.weight"] = arows.T @ g.reshape(B * T, d)
            grads[f"{p}.attn.{name}.bias"] = (g.reshape(B * T, d).sum(axis=0) if name != "k"
                                              else np.zeros(d, dtype=g.dtype))
            da += _mm(g, params[f"{p}.attn.{name}.weight"].T)
        dx, grads[f"{p}.ln1.weight"], grads[f"{p}.ln1.bias"] = _layer_norm_back(
            da, params[f"{p}.ln1.weight"], ln1)
        dh = dh + dx
    tok = np.zeros_like(params["tok_embed.weight"])
    np.add.at(tok, x.reshape(-1), dh.reshape(B * T, d))
    grads["tok_embed.weight"] = tok
    grads["pos_embed.weight"] = dh.sum(axis=0)
    for name, g in grads.items():
        params[name] -= lr * g
    return loss
