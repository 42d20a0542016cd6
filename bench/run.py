"""`make bench`: every performance figure as a ratio measured side by side in one run.

    make bench          (or: python -m bench.run)

Sections: the autograd against hand-written NumPy (bench/numpy_mlp.py) and,
when installed, PyTorch; the transformer's step against hand-written NumPy
(bench/numpy_gpt.py) and PyTorch eager (bench/torch_gpt.py); data-parallel speed-up
at a fixed global batch and against its limit; the hand-written ring collectives
against MPI's own; the pipeline's measured bubble against the formula; context
parallelism's four modes against one rank on the same sequences (bench/cp_rank.py);
the test suite's last wall time. Prints one table and
writes bench/results.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.numpy_gpt import numpy_gpt_step
from bench.numpy_mlp import numpy_step
from bench.timing import against, interleaved, ratio
from bench.torch_gpt import torch_gpt_step
from minipar import attention, gpt, nn
from minipar import autograd as ag
from minipar.data import make_batch, make_sequences
from minipar.optim import SGD

ROOT = Path(__file__).resolve().parent.parent
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
    NumPy work (fused.py, nn.py), the optimizer, NumPy's reductions called directly."""
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


def dp_scaling(ranks: list[int], steps: int) -> dict:
    """Step time of `train --dp N` at global batch 256 for each N (bench/dp_rank.py)."""
    results = {n: _mpi_json(n, "bench.dp_rank", [str(steps)]) for n in ranks}
    base = results[ranks[0]]["median"]
    out = {str(n): {**r, "speedup_vs_1": base / r["median"]} for n, r in results.items()}
    if _has_torch():  # the same model and batch under PyTorch DDP over gloo on loopback
        for n in (r for r in ranks if r in (2, 4)):
            ddp = _mpi_json(n, "bench.ddp_rank", [str(steps)])
            out[str(n)]["ddp"] = ddp
            out[str(n)]["ddp/minipar"] = ddp["median"] / out[str(n)]["median"]
    return out


def dp_limit(repeats: int) -> dict:
    """2-rank data parallelism against its limit, one rank's share (B/2) alone, measured
    side by side in one job (bench/dp_limit_rank.py). Per repetition the ratio of the
    slowest rank's step to the share's, and the speed-up over one process alone with the
    whole batch; their medians and ranges over the repetitions. Beside them the two
    limits of this machine: whole / share (the best speed-up, with ranks side by side
    sharing memory bandwidth and cache) and (share + a bare Allreduce) / share."""
    r = _mpi_json(2, "bench.dp_limit_rank", [str(repeats)])
    share, whole = np.array(r["share"]["steps"]), np.array(r["whole"]["steps"])
    for name, v in r.items():
        if isinstance(v, dict) and "steps" in v and name != "share":
            v["vs_share"] = _spread(np.array(v["steps"]) / share)
            if name not in ("whole", "allreduce"):  # one process alone / this step
                v["speedup"] = _spread(whole / np.array(v["steps"]))
    # the floor of a blocking sync: the step's limit plus the bare Allreduce of its bytes
    r["floor_vs_share"] = _spread((share + np.array(r["allreduce"]["steps"])) / share)
    bucketed = r["bucketed"]["sync"]["median"]
    for name in [n for n in r if n.startswith("overlapped")]:
        r[name]["hidden_fraction"] = 1.0 - r[name]["sync"]["median"] / bucketed
        r[name]["vs_bucketed"] = r[name]["step"]["median"] / r["bucketed"]["step"]["median"]
    return r


def _spread(values: np.ndarray) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": float(values.min()),
            "max": float(values.max())}


def cp_vs_one(repeats: int) -> dict:
    """Context parallelism on 2 ranks against one rank alone on the same sequences, in one
    job (bench/cp_rank.py): per repetition the slowest rank's cp step over the `one` step;
    1/cp would be perfect (each rank holds T/cp positions), above it the exchanges."""
    r = _mpi_json(2, "bench.cp_rank", [str(repeats)])
    one = np.array(r["one"]["steps"])
    for name, v in r.items():
        if isinstance(v, dict) and name != "one":
            v["vs_one"] = _spread(np.array(v["steps"]) / one)
    return r


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _mpi_json(n: int, module: str, args: list[str], bind: bool = False) -> dict:
    """Run `mpiexec -n n python -m module <args> OUT.json` and read OUT.json. `bind`: each
    rank bound to a core of its own (`-bind-to core`, the spelling of MPICH's and Open
    MPI's launchers), so the kernel never moves a rank away from its caches."""
    mpiexec = os.environ.get("MINIPAR_MPIEXEC", str(Path(sys.executable).parent / "mpiexec"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        binding = ["-bind-to", "core"] if bind else []
        subprocess.run([mpiexec, *binding, "-n", str(n), sys.executable, "-m", module, *args,
                        str(out)],
                       cwd=ROOT, check=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                                UCX_NET_DEVICES="lo"))
        return json.loads(out.read_text())


def suite_time() -> float | None:
    """The wall time `make test` wrote after its last run, if any."""
    path = ROOT / "bench" / "last_test_seconds"
    return float(path.read_text()) if path.exists() else None


def main() -> None:
    quick = "--quick" in sys.argv
    results: dict = {"autograd": {}}
    lines = ["minipar benchmarks (ratios of medians measured side by side; lower is faster)",
             f"{'what':<58} {'ratio':>8}  {'medians':>26}"]
    for label, shape in SHAPES.items():
        for dtype in ("float32", "float64"):
            r = autograd_vs_numpy(shape, dtype, repeats=5 if quick else 20)
            results["autograd"][f"{label} {dtype}"] = r
            t = r["times"]
            goal = " (goal <= 1.05)" if label.startswith("reference") else ""
            lines.append(f"{'autograd / numpy, ' + label + ' ' + dtype + goal:<58} "
                         f"{r['minipar/numpy']:>8.3f}  {t['minipar']['median'] * 1e3:>9.2f} ms "
                         f"vs {t['numpy']['median'] * 1e3:>8.2f} ms")
            if label.startswith("tiny"):
                lines.append(f"{'  the tape per step (minipar - numpy), us':<58} "
                             f"{(t['minipar']['median'] - t['numpy']['median']) * 1e6:>8.0f}")
            if "torch/numpy" in r:
                lines.append(f"{'  torch / numpy':<58} {r['torch/numpy']:>8.3f}")
    results["autograd_profile"] = {}
    for dtype in ("float32", "float64"):
        shares = results["autograd_profile"][dtype] = autograd_profile(dtype, 10 if quick else 50)
        lines.append(f"{'  profile, reference MLP ' + dtype + ' (own time by file)':<58} "
                     + ", ".join(f"{k} {v:.0%}" for k, v in list(shares.items())[:5]))
    results["gpt"] = {}
    for label, shape in GPT_SHAPES.items():
        for dtype in ("float32", "float64"):
            r = gpt_vs_numpy(shape, dtype, repeats=3 if quick else 10)
            results["gpt"][f"{label} {dtype}"] = r
            t = r["times"]
            lines.append(f"{'gpt step / numpy, ' + label + ' ' + dtype:<58} "
                         f"{r['minipar/numpy']:>8.3f}  {t['minipar']['median'] * 1e3:>9.2f} ms "
                         f"vs {t['numpy']['median'] * 1e3:>8.2f} ms")
            if "minipar/torch" in r:
                lines.append(f"{'  gpt step / PyTorch eager (same weights, same 1st loss)':<58} "
                             f"{r['minipar/torch']:>8.3f}  {t['torch']['median'] * 1e3:>9.2f} ms"
                             f" torch; torch / numpy {r['torch/numpy']:.3f}")
            a = attention_vs_matmuls(shape, dtype, repeats=5 if quick else 20)
            results["gpt"][f"{label} {dtype}"]["attention"] = a
            lines.append(f"{'  attention node / its matmuls alone':<58} "
                         f"{a['attention/matmuls']:>8.3f}  "
                         f"{a['times']['attention']['median'] * 1e3:>9.2f} ms vs "
                         f"{a['times']['matmuls']['median'] * 1e3:>8.2f} ms")
    ranks = [1, 2] if quick else [1, 2, 4, 8]
    results["dp"] = dp_scaling(ranks, steps=6 if quick else 12)
    for n, r in results["dp"].items():
        lines.append(f"{'DP speed-up, ' + n + ' ranks vs 1 (global batch 256, f64)':<58} "
                     f"{r['speedup_vs_1']:>8.3f}  {r['median'] * 1e3:>9.2f} ms/step")
        if "ddp/minipar" in r:
            lines.append(f"{'  PyTorch DDP (gloo) step / minipar DP step, ' + n + ' ranks':<58} "
                         f"{r['ddp/minipar']:>8.3f}  {r['ddp']['median'] * 1e3:>9.2f} ms/step")
    results["dp_limit"] = limit = dp_limit(repeats=4 if quick else 12)
    ms = lambda v: f"{v['median'] * 1e3:.0f}"  # noqa: E731
    for name in ["naive", "bucketed"] + [n for n in limit if n.startswith("overlapped")]:
        v = limit[name]
        q = v["vs_share"]
        lines.append(f"{'DP 2 ranks, ' + name + ' step / one rank share (goal <= 1.10)':<58} "
                     f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}] compute "
                     f"{ms(v['compute'])} sync {ms(v['sync'])} (waiting {ms(v['waiting'])}) "
                     f"opt {ms(v['optimizer'])} ms")
        if "hidden_fraction" in v:
            lines.append(f"{'  overlapped / bucketed step; sync hidden (1 - sync/bucketed)':<58} "
                         f"{v['vs_bucketed']:>8.3f}  hidden {v['hidden_fraction']:.2f}, "
                         f"{limit['buckets'][name]} buckets")
    lines.append(f"{'  one rank share step (B/2, no sync), ms':<58} "
                 f"{limit['share']['step']['median'] * 1e3:>8.1f}")
    sp, lim, floor = limit["bucketed"]["speedup"], limit["whole"]["vs_share"], \
        limit["floor_vs_share"]
    lines.append(f"{'DP 2 ranks, bucketed: speed-up over one process (goal >= 1.7)':<58} "
                 f"{sp['median']:>8.3f}  [{sp['min']:.2f}-{sp['max']:.2f}]; its limit here, "
                 f"one process alone / one rank share: {lim['median']:.2f} "
                 f"[{lim['min']:.2f}-{lim['max']:.2f}]")
    lines.append(f"{'  floor of a blocking sync: (share + bare Allreduce) / share':<58} "
                 f"{floor['median']:>8.3f}  [{floor['min']:.2f}-{floor['max']:.2f}], Allreduce "
                 f"of {ms(limit['allreduce']['sync'])} ms")
    results["ring"] = {n: _mpi_json(n, "bench.ring_rank", []) for n in ranks if n > 1}
    for n, r in results["ring"].items():
        for label in ("8 KB", "1 MB", "16 MB"):
            lines.append(f"{f'ring / MPI Allreduce, {label}, {n} ranks':<58} "
                         f"{r[label]['ring/mpi']:>8.3f}  bus {r[label]['ring_bus_GBps']:.2f} vs "
                         f"{r[label]['mpi_bus_GBps']:.2f} GB/s")
        lines.append(f"{'  (memcpy bandwidth of this machine, GB/s)':<58} {r['memcpy_GBps']:>8.2f}")
    results["pipeline"] = _mpi_json(2, "bench.pipeline_rank", ["3" if quick else "7"],
                                    bind=True)
    message = results["pipeline"].pop("message")
    for label, r in results["pipeline"].items():
        goal = " (goal <= 1.15)" if label.endswith("M=8") else ""
        q = r["measured/formula"]
        lines.append(f"{'pipeline bubble measured / formula, pp=2 ' + label + goal:<58} "
                     f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}]; replayed / formula "
                     f"{r['replayed/formula']['median']:.3f}, measured / replayed "
                     f"{r['measured/replayed']['median']:.3f}")
        lines.append(f"{'  per instruction: between / in Isend / in Recv; stage imbalance':<58} "
                     f"{r['between_per_instruction'] * 1e6:>6.1f}us  "
                     f"{r['send_per_instruction'] * 1e6:.1f} us / "
                     f"{r['recv_wait_per_instruction'] * 1e3:.2f} ms; slowest / fastest stage "
                     f"{r['imbalance_range']['median']:.3f}")
    results["pipeline"]["message"] = message
    lines.append(f"{'  one 64 KB hop: Isend / one-way, back to back (us)':<58} "
                 f"{message['isend back to back'] * 1e6:>6.1f}us  "
                 f"{message['one-way back to back'] * 1e6:.1f} us")
    lines.append(f"{'  the same right after 3 ms of matmuls (every hop of a pipeline)':<58} "
                 f"{message['isend after compute'] * 1e6:>6.1f}us  "
                 f"{message['one-way after compute'] * 1e6:.1f} us")
    results["cp"] = cp = cp_vs_one(repeats=3 if quick else 8)
    for mode in ("allgather", "ring", "zigzag", "ulysses"):
        q = cp[mode]["vs_one"]
        lines.append(f"{'gpt cp=2 ' + mode + ' step / one rank, same sequences (1/cp = 0.5)':<58} "
                     f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}] "
                     f"{cp[mode]['step']['median'] * 1e3:.0f} vs "
                     f"{cp['one']['step']['median'] * 1e3:.0f} ms")
    results["suite_seconds"] = suite_time()
    if results["suite_seconds"] is not None:
        lines.append(f"{'make test wall time, seconds (last run)':<58} "
                     f"{results['suite_seconds']:>8.1f}")
    print("\n".join(lines))
    (ROOT / "bench" / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
