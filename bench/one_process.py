"""The figures one process measures alone: minipar's step against the same math by hand.

The autograd on the MLPs against hand-written NumPy (bench/numpy_mlp.py) and, when
installed, PyTorch; where its time goes (cProfile, by file); the transformer's step
against hand-written NumPy (bench/numpy_gpt.py) and PyTorch eager (bench/torch_gpt.py);
the attention node against its matmuls alone. `bench/run.py` calls these and prints
them beside the figures of the MPI jobs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.numpy_gpt import numpy_gpt_step
from bench.numpy_mlp import numpy_step
from bench.timing import against, interleaved, ratio
from bench.torch_gpt import torch_gpt_step
from minipar.core import attention, gpt, nn
from minipar.core import autograd as ag
from minipar.core.data import make_batch, make_sequences
from minipar.core.optim import SGD

SHAPES = {"reference MLP (B=64, d=64, L=8)": dict(d_in=32, d_model=64, d_ff=256, layers=8,
                                                  classes=10, batch=64),
          # NumPy's work is next to nothing here: the difference is the tape's own cost
          "tiny MLP (B=2, d=2, L=8)": dict(d_in=2, d_model=2, d_ff=8, layers=8, classes=10,
                                           batch=2),
          "MLP 784-1024-1024-10 (B=256)": dict(d_in=784, d_model=1024, d_ff=1024, layers=1,
                                               classes=10, batch=256)}
GPT_SHAPES = {"gpt defaults (B=64, T=32, d=64, L=8, H=4)": dict(
                  layers=8, d_model=64, d_ff=256, heads=4, seq_len=32, vocab=64, batch=64),
              "gpt larger (B=16, T=128, d=256, L=4, H=4)": dict(
                  layers=4, d_model=256, d_ff=1024, heads=4, seq_len=128, vocab=64, batch=16)}


def autograd_vs_numpy(shape: dict, dtype: str, repeats: int) -> dict:
    """One SGD step through minipar's autograd vs the same math by hand."""
    batch = shape["batch"]
    cfg = nn.ModelConfig(**{k: v for k, v in shape.items() if k != "batch"})
    full = nn.init_params(cfg, 0, dtype)
    x, y = make_batch(0, 0, batch, cfg.d_in, cfg.classes, dtype)
    model = nn.build_reference(cfg, full)
    params = model.parameters()
    sgd = SGD(1e-3)
    by_hand = {k: v.copy() for k, v in full.items()}

    def minipar_step() -> None:
        for p in params:
            p.grad = None
        nn.loss_fn(model, x, y).backward()
        sgd.step([p.data for p in params], [p.grad for p in params])

    candidates = {"minipar": minipar_step,
                  "numpy": lambda: numpy_step(by_hand, x, y, cfg.layers, 1e-3)}
    torch_step = _torch_step(cfg, full, x, y, dtype)
    if torch_step is not None:
        candidates["torch"] = torch_step
    times, ratios = against("numpy", candidates, repeats=repeats)
    out = {"times": times, **ratios}
    if "torch" in times:  # both against the same yardstick, each in its own pair
        out["minipar/torch"] = out["minipar/numpy"] / out["torch/numpy"]
    return out


def autograd_profile(dtype: str, steps: int) -> dict[str, float]:
    """Where a step of the reference MLP spends its time (cProfile's own time per
    function, summed by file): the tape's bookkeeping (autograd.py), the fused nodes'
    NumPy work (core/fused_layers.py, nn.py), the optimizer, NumPy's reductions called directly."""
    import cProfile
    import pstats

    shape = SHAPES["reference MLP (B=64, d=64, L=8)"]
    cfg = nn.ModelConfig(**{k: v for k, v in shape.items() if k != "batch"})
    full = nn.init_params(cfg, 0, dtype)
    x, y = make_batch(0, 0, shape["batch"], cfg.d_in, cfg.classes, dtype)
    model = nn.build_reference(cfg, full)
    params, sgd = model.parameters(), SGD(1e-3)
    profile = cProfile.Profile()
    for _ in range(steps):
        profile.enable()
        for p in params:
            p.grad = None
        nn.loss_fn(model, x, y).backward()
        sgd.step([p.data for p in params], [p.grad for p in params])
        profile.disable()
    shares: dict[str, float] = {}
    for (path, _, _), (_, _, own, _, _) in pstats.Stats(profile).stats.items():
        where = Path(path).name if "minipar" in path else "numpy and builtins"
        shares[where] = shares.get(where, 0.0) + own
    total = sum(shares.values())
    return {k: v / total for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


def gpt_vs_numpy(shape: dict, dtype: str, repeats: int) -> dict:
    """One SGD step of the transformer through minipar vs the same math by hand
    (bench/numpy_gpt.py, heads batched) and, when installed, PyTorch eager
    (bench/torch_gpt.py), whose first loss must equal minipar's (the same model)."""
    cfg = nn.ModelConfig(model="gpt", **{k: v for k, v in shape.items() if k != "batch"})
    full = nn.init_params(cfg, 0, dtype)
    x, y = make_sequences(0, 0, shape["batch"], cfg.seq_len, cfg.vocab)
    model = gpt.build_reference(cfg, full)
    params = model.parameters()
    sgd = SGD(1e-3)
    by_hand = {k: v.copy() for k, v in full.items()}
    torch_step = torch_gpt_step({k: v.copy() for k, v in full.items()}, x, y, cfg.layers,
                                cfg.heads, 1e-3)

    def minipar_step() -> float:
        for p in params:
            p.grad = None
        loss = nn.loss_fn(model, x, y)
        loss.backward()
        sgd.step([p.data for p in params], [p.grad for p in params])
        return float(loss.data)

    candidates = {"minipar": minipar_step, "numpy": lambda: numpy_gpt_step(
        by_hand, x, y, cfg.layers, cfg.heads, 1e-3)}
    out: dict = {}
    if torch_step is not None:
        first = (minipar_step(), torch_step())   # the same weights: the same first loss
        out["first_loss_rel_diff"] = abs(first[0] - first[1]) / abs(first[0])
        if out["first_loss_rel_diff"] > (1e-4 if dtype == "float32" else 1e-9):
            raise AssertionError(f"PyTorch's gpt is not minipar's: losses {first}")
        candidates["torch"] = torch_step
    times, ratios = against("numpy", candidates, repeats=repeats)
    out.update(times=times, **ratios)
    if "torch" in times:  # both against the same yardstick, each in its own pair
        out["minipar/torch"] = out["minipar/numpy"] / out["torch/numpy"]
    return out


def attention_vs_matmuls(shape: dict, dtype: str, repeats: int) -> dict:
    """The attention node's forward and backward (attention.attention) against its six
    batched matmuls alone (Q K^T, P V; P^T G, G V^T, dS K, dS^T Q) on the same shapes:
    what the softmax, the mask, the head reshapes and the tape add."""
    rng = np.random.default_rng(0)
    b, t, d, h = shape["batch"], shape["seq_len"], shape["d_model"], shape["heads"]
    q, k, v = (ag.Tensor(rng.normal(size=(b, t, d)).astype(dtype), requires_grad=True)
               for _ in range(3))
    g = rng.normal(size=(b, t, d)).astype(dtype)
    Q, K, V, G = (a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3).copy()
                  for a in (q.data, k.data, v.data, g))
    P = rng.random(size=(b, h, t, t)).astype(dtype)

    def node() -> None:
        for tensor in (q, k, v):
            tensor.grad = None
        ag.backward_from([(attention.attention(q, k, v, h), g)])

    def matmuls() -> None:
        _ = Q @ np.swapaxes(K, -1, -2), P @ V                            # forward
        _ = np.swapaxes(P, -1, -2) @ G, G @ np.swapaxes(V, -1, -2)       # backward
        _ = P @ K, np.swapaxes(P, -1, -2) @ Q

    times = interleaved({"attention": node, "matmuls": matmuls}, repeats=repeats)
    return {"times": times, "attention/matmuls": ratio(times, "attention", "matmuls")}


def _torch_step(cfg: nn.ModelConfig, full: dict, x: np.ndarray, y: np.ndarray, dtype: str):
    """The same model in PyTorch (CPU, one thread), if torch is installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in full.items()}
    tx, ty = torch.tensor(x), torch.tensor(y)
    opt = torch.optim.SGD(list(tp.values()), lr=1e-3)
    fn = torch.nn.functional

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        h = tx @ tp["embed.weight"] + tp["embed.bias"]
        for i in range(cfg.layers):
            p = f"blocks.{i}"
            u = fn.layer_norm(h, (cfg.d_model,), tp[f"{p}.ln.weight"], tp[f"{p}.ln.bias"], 1e-5)
            z = fn.gelu(u @ tp[f"{p}.fc1.weight"] + tp[f"{p}.fc1.bias"], approximate="tanh")
            h = h + z @ tp[f"{p}.fc2.weight"] + tp[f"{p}.fc2.bias"]
        fn.cross_entropy(h @ tp["head.weight"] + tp["head.bias"], ty).backward()
        opt.step()
    return step
