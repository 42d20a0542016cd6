"""The transformer of docs/design.md in PyTorch eager (CPU, one thread): a yardstick.

The same weights (minipar's parameter names), the same math as bench/numpy_gpt.py:
token plus position embedding, pre-LayerNorm blocks of causal multi-head attention and
a tanh-GELU MLP, a final LayerNorm, the head, the mean cross-entropy over all B*T
positions, one SGD step. `bench/run.py` times it beside minipar's step and checks that
its first loss equals minipar's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def torch_gpt_step(full: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, layers: int,
                   heads: int, lr: float) -> Callable[[], float] | None:
    """A closure doing one forward, backward and SGD update in PyTorch, returning the
    loss; None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    fn = torch.nn.functional
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in full.items()}
    tx, ty = torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)
    B, T = x.shape
    d = full["tok_embed.weight"].shape[1]
    dh = d // heads
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    opt = torch.optim.SGD(list(tp.values()), lr=lr)

    def ln(h: torch.Tensor, name: str) -> torch.Tensor:
        return fn.layer_norm(h, (d,), tp[f"{name}.weight"], tp[f"{name}.bias"], 1e-5)

    def heads_of(t: torch.Tensor) -> torch.Tensor:     # (B, T, d) -> (B, H, T, dh)
        return t.view(B, T, heads, dh).transpose(1, 2)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        h = tp["tok_embed.weight"][tx] + tp["pos_embed.weight"][:T]
        for i in range(layers):
            p = f"blocks.{i}"
            a = ln(h, f"{p}.ln1")
            q, k, v = (heads_of(a @ tp[f"{p}.attn.{n}.weight"] + tp[f"{p}.attn.{n}.bias"])
                       for n in ("q", "k", "v"))
            s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dh))
            o = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1) @ v
            o = o.transpose(1, 2).reshape(B, T, d)
            h = h + o @ tp[f"{p}.attn.proj.weight"] + tp[f"{p}.attn.proj.bias"]
            z = fn.gelu(ln(h, f"{p}.ln2") @ tp[f"{p}.fc1.weight"] + tp[f"{p}.fc1.bias"],
                        approximate="tanh")
            h = h + z @ tp[f"{p}.fc2.weight"] + tp[f"{p}.fc2.bias"]
        logits = ln(h, "ln_f") @ tp["head.weight"] + tp["head.bias"]
        loss = fn.cross_entropy(logits.reshape(B * T, -1), ty.reshape(-1))
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step
