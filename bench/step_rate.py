"""Three figures of one process, each measured side by side in one run, with its goal.

(a) the counter-based data (core/data.py, `row_normals`) against one
    `np.random.Generator` drawing as many normals: a 256x256 batch; goal <= 1.2x.
(b) the reference MLP step (L 2, d 512, d_ff 2048, B 256, d_in 256, float64) as a
    fraction of this machine's DGEMM rate at the step's own shapes: the same list of
    matrix products alone, on arrays of those shapes, against the whole step (forward,
    backward, SGD); the fraction is the products' time over the step's, which is the
    step's FLOP rate over DGEMM's; goal >= 0.75.
(c) the same step against PyTorch eager of the same model (when torch is installed);
    goal <= 1.00.

Timings with one BLAS thread (threadpoolctl, else the environment's OPENBLAS_NUM_THREADS).
"""

from __future__ import annotations

import contextlib

import numpy as np

from bench.timing import interleaved
from minipar.core import data, nn
from minipar.core.data import make_batch
from minipar.core.optim import SGD

STEP_SHAPE = {"d_in": 256, "d_model": 512, "d_ff": 2048, "layers": 2, "classes": 10,
              "batch": 256}


def one_blas_thread() -> contextlib.AbstractContextManager:
    """threadpoolctl's limit to one BLAS thread, or nothing if it is not installed."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def data_vs_generator(repeats: int) -> dict:
    """(a): seconds per 256x256 batch of normals, both ways, and per-repeat ratios."""
    counter = {"step": 0}

    def ours() -> None:
        counter["step"] += 1
        data.row_normals(0, counter["step"], 256, None, 256)

    def generator() -> None:
        np.random.default_rng([0, counter["step"]]).normal(size=(256, 256))
    times = interleaved({"counter-based": ours, "Generator": generator}, repeats=repeats)
    return {"times": times, "ratio": times["counter-based"]["median"]
            / times["Generator"]["median"], "goal": "<= 1.2"}


def step_products(shape: dict) -> tuple[list[tuple[tuple[int, int], tuple[int, int]]], float]:
    """The matrix products one SGD step of the reference MLP does, as (A shape, B shape)
    pairs, and their FLOP count (2 m k n each): per linear (in, out) on B rows the
    forward x W (B,in)(in,out), the input gradient g W^T (B,out)(out,in) -- not for the
    first, whose input needs none -- and the weight gradient x^T g (in,B)(B,out)."""
    b, d_in, d, f, c = (shape[k] for k in ("batch", "d_in", "d_model", "d_ff", "classes"))
    linears = [(d_in, d)] + [(d, f), (f, d)] * shape["layers"] + [(d, c)]
    products = []
    for i, (n_in, n_out) in enumerate(linears):
        products.append(((b, n_in), (n_in, n_out)))
        if i > 0:
            products.append(((b, n_out), (n_out, n_in)))
        products.append(((n_in, b), (b, n_out)))
    flop = float(sum(2 * a[0] * a[1] * w[1] for a, w in products))
    return products, flop


def step_vs_dgemm(repeats: int) -> dict:
    """(b) and (c): the reference step against its products alone, and against torch."""
    shape = STEP_SHAPE
    cfg = nn.ModelConfig(**{k: v for k, v in shape.items() if k != "batch"})
    full = nn.init_params(cfg, 0, "float64")
    x, y = make_batch(0, 0, shape["batch"], cfg.d_in, cfg.classes, "float64")
    model = nn.build_reference(cfg, full)
    params, sgd = model.parameters(), SGD(1e-4)

    def step() -> None:
        for p in params:
            p.grad = None
        nn.loss_fn(model, x, y).backward()
        sgd.step([p.data for p in params], [p.grad for p in params])

    products, flop = step_products(shape)
    rng = np.random.default_rng(0)
    operands = [(rng.normal(size=a), rng.normal(size=w)) for a, w in products]
    outs = [np.empty((a.shape[0], w.shape[1])) for a, w in operands]

    def dgemm() -> None:
        for (a, w), out in zip(operands, outs):
            np.matmul(a, w, out=out)

    times = interleaved({"step": step, "DGEMM": dgemm}, repeats=repeats, warmup=2)
    result = {"flop": flop, "times": times,
              "fraction": times["DGEMM"]["median"] / times["step"]["median"],
              "fraction_range": [times["DGEMM"]["min"] / times["step"]["max"],
                                 times["DGEMM"]["max"] / times["step"]["min"]],
              "step_gflops": flop / times["step"]["median"] / 1e9,
              "dgemm_gflops": flop / times["DGEMM"]["median"] / 1e9, "goal": ">= 0.75"}
    from bench.one_process import _torch_step
    torch_step = _torch_step(cfg, full, x, y, "float64")
    if torch_step is not None:
        pair = interleaved({"step": step, "torch": torch_step}, repeats=repeats, warmup=2)
        result["torch"] = {"times": pair, "goal": "<= 1.00",
                           "minipar/torch": pair["step"]["median"] / pair["torch"]["median"]}
    return result


def lines(a: dict, b: dict) -> list[str]:
    """The table rows of (a), (b) and (c): ratio, medians and min..max, goal."""
    def ms(t: dict) -> str:
        return f"{t['median'] * 1e3:.2f} ms ({t['min'] * 1e3:.2f}..{t['max'] * 1e3:.2f})"
    ta, tb = a["times"], b["times"]
    out = [(f"{'data 256x256 normals / one Generator (goal <= 1.2)':<58} {a['ratio']:>8.3f}  "
            f"{ms(ta['counter-based'])} vs {ms(ta['Generator'])}"),
           (f"{'reference MLP step FLOP rate / DGEMM (goal >= 0.75)':<58} "
            f"{b['fraction']:>8.3f}  {ms(tb['DGEMM'])} vs step {ms(tb['step'])}; range "
            f"{b['fraction_range'][0]:.2f}..{b['fraction_range'][1]:.2f}; "
            f"{b['step_gflops']:.2f} vs {b['dgemm_gflops']:.2f} GFLOP/s")]
    if "torch" in b:
        tc = b["torch"]["times"]
        out.append(f"{'reference MLP step minipar / torch eager (goal <= 1.00)':<58} "
                   f"{b['torch']['minipar/torch']:>8.3f}  {ms(tc['step'])} vs {ms(tc['torch'])}")
    else:
        out.append(f"{'reference MLP step minipar / torch eager (goal <= 1.00)':<58} "
                   "  torch not installed: not measured")
    return out


def main(repeats: int = 9) -> dict:
    """Measure (a), (b), (c) with one BLAS thread; print the rows; return the figures."""
    with one_blas_thread():
        a = data_vs_generator(repeats=5 * repeats)
        b = step_vs_dgemm(repeats=repeats)
    print("\n".join(lines(a, b)))
    return {"data_vs_generator": a, "step_vs_dgemm": b}


if __name__ == "__main__":
    main()
