"""Lesson 14: mixed precision, 16-bit compute on top of 32-bit master weights.

    mpiexec -n 4 python lessons/14_mixed_precision.py
    mpiexec -n 4 python lessons/14_mixed_precision.py --plot figures   # + 14_*.png
    mpiexec -n 8 python lessons/14_mixed_precision.py   # section 4 on 2, 4 and 8 ranks
    mpiexec -n 2 python lessons/14_mixed_precision.py --quick

Large models train with 16-bit numbers (bfloat16 or float16) in the matmuls and the
collectives, and keep a master copy of every parameter, and the optimizer state, in
float32 (`train --mixed {bf16,fp16}`; docs/design.md, "Mixed precision";
minipar/core/precision.py, minipar/parallel/mixed.py, minipar/comm/low_precision.py).
Everything printed is measured on this run's ranks:

1. bytes per parameter each rank holds (`nbytes` of its arrays after a step) for
   float32, bf16 and fp16 under ZeRO 0-3, beside the formula the planner uses
   (memory.bytes_per_param) and the papers' tables: Megatron's 18 (2 + 4 + 4 + 8),
   its distributed optimizer's 6 + 12/N, the ZeRO paper's 16 (2 + 2 + 12);
2. bf16's resolution: 256 + 1 = 256; 0.01 added a thousand times to 1; a small
   update lost on a 16-bit weight and kept by a float32 master;
3. fp16's range: 70000 overflows, a gradient of 1e-8 underflows; the loss scaler
   of a real run backing off after overflows and growing after clean steps;
4. the error of a gradient Allreduce summed in 16 bits (the MPI.Op of
   comm/low_precision.py) against one summed in the master dtype, over groups of 2, 4
   and 8 ranks, as many as the job has (on 4 ranks: 2 and 4);
5. loss curves of float64, bf16 and fp16 training of the same model;
6. FP8 (`--fp8 {tensorwise,rowwise,blockwise}` on `--mixed bf16`; minipar/core/fp8.py):
   each recipe's error against float64 per layer (one process), what one outlier does
   to a tensorwise, a rowwise and a blockwise scale, and the bytes of ZeRO-3's 8-bit
   all-gather (`--fp8-allgather`) in the ledger beside its prediction.

MINIPAR_QUICK=1 (or --quick) trains fewer steps.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm import low_precision
from minipar.comm.collectives import Group, Ledger
from minipar.comm.job import run_collectively, verdict
from minipar.core import fp8, nn, precision
from minipar.core.byte_units import format_bytes
from minipar.core.memory import bytes_per_param, bytes_per_param_held
from minipar.run.results import (
    gather_decisions,
    mixed_tolerance,
    relative_difference,
    replayed_reference,
)
from minipar.run.train import train, train_reference
from minipar.settings.config import ConfigError, TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.teaching import ledger_tables
from minipar.teaching.lines import print  # the builtin, a line wider than the page wrapped

# the three recipes of section 1: (label, --mixed, --dtype of the masters)
RECIPES = (("fp32", None, "float32"), ("bf16", "bf16", "float32"), ("fp16", "fp16", "float32"))
STAGES = ("DP (0)", "ZeRO-1", "ZeRO-2", "ZeRO-3")


# ------------------------------------------------------------ 1. the bytes
def measure_bytes(base: dict, world: MPI.Comm) -> dict[str, list[list]]:
    """Every recipe and stage trained one step on dp = world: every rank's ModelStates."""
    n = world.Get_size()
    out: dict[str, list[list]] = {}
    for label, mixed, dtype in RECIPES:
        out[label] = []
        for stage in range(4):
            cfg = TrainConfig(**base, steps=1, dp=n, zero=stage, mixed=mixed,
                              dtype=dtype).resolved(n)
            out[label].append(world.gather(train(cfg, world).extras["memory"]))
    return out


def recipe(mixed: str | None, dtype: str) -> object:
    """memory.bytes_per_param of a recipe: what the planner prices too."""
    return bytes_per_param("adam", np.dtype(dtype).itemsize, 2 if mixed else None)


def bytes_table(measured: dict[str, list[list]], psi: int, n: int) -> dict[str, list[float]]:
    """Section 1: measured bytes per parameter beside the formula and the papers'."""
    print(f"\n=== 1. bytes per parameter on each of N = {n} ranks after one Adam step "
          f"(Psi = {psi} parameters, masters float32; measured = nbytes / Psi)", flush=True)
    print(f"{'recipe':>6} {'stage':>8} {'16-bit':>7} {'master':>7} {'grad':>7} "
          f"{'optim':>7} {'measured':>9} {'formula':>8}  every rank", flush=True)
    per_param: dict[str, list[float]] = {}
    for label, mixed, dtype in RECIPES:
        per_param[label] = []
        per = recipe(mixed, dtype)
        for stage, ranks in enumerate(measured[label]):
            mine = ranks[0]
            formula = bytes_per_param_held(per, n, stage)
            same = all(r.total == formula * psi for r in ranks)
            per_param[label].append(mine.total / psi)
            low = mine.params if mixed else 0.0
            master = mine.masters if mixed else mine.params
            print(f"{label:>6} {STAGES[stage]:>8} {low / psi:>7.3f} {master / psi:>7.3f} "
                  f"{mine.grads / psi:>7.3f} {mine.optimizer / psi:>7.3f} "
                  f"{mine.total / psi:>9.3f} {formula:>8.3f}  "
                  f"{verdict(same, '= formula', 'DIFFERS')}", flush=True)
    bf16 = per_param["bf16"]
    zero_paper = bytes_per_param("adam", 4, 2, main_grad_bytes=2)
    paper = [bytes_per_param_held(zero_paper, n, s) for s in range(4)]
    print(f"the papers: Megatron's table, bf16 with fp32 masters and fp32 main gradients, "
          f"18 bytes (measured {bf16[0]:g} {verdict(bf16[0] == 18)}); its distributed "
          f"optimizer 6 + 12/N = {6 + 12 / n:g} (measured, ZeRO-1: {bf16[1]:g} "
          f"{verdict(bf16[1] == 6 + 12 / n)})", flush=True)
    print(f"the ZeRO paper keeps 16-bit gradients: 2 + 2 + 12 = 16, then 4 + 12/N, 2 + 14/N, "
          f"16/N = {', '.join(f'{p:g}' for p in paper)} (memory.bytes_per_param with "
          f"main_grad_bytes=2; minipar's main gradients stay in the master dtype, "
          f"{bf16[0] - paper[0]:g} bytes more at stage 0)", flush=True)
    print(f"a 7 B model on one rank: fp32 {format_bytes(7e9 * per_param['fp32'][0], 0, 'MiB')}"
          f", bf16 {format_bytes(7e9 * bf16[0], 0, 'MiB')}: mixed precision saves compute "
          f"and wire bytes, not model-state memory, until ZeRO shards the masters "
          f"(bf16 ZeRO-3 on {n} ranks: {format_bytes(7e9 * bf16[3], 0, 'MiB')})", flush=True)
    return per_param


# ------------------------------------------------------------ 2. resolution
def resolution() -> dict[str, np.ndarray]:
    """Section 2: what 8 bits of significand keep and lose. Returns the running sums."""
    bf16 = precision.low_dtype("bf16")
    big = np.array(256.0, dtype=bf16) + np.array(1.0, dtype=bf16)
    print("\n=== 2. bfloat16 keeps 8 significant bits: u = 2^-8 = "
          f"{precision.unit_roundoff('bf16'):g}", flush=True)
    print(f"256 + 1 in bf16 = {float(big):g} (the numbers near 256 are 2 apart) "
          f"{verdict(float(big) == 256.0, 'lost', 'kept')}; in float32 "
          f"{float(np.float32(256) + np.float32(1)):g}", flush=True)
    sums = {}
    for name, dtype in (("bf16", bf16), ("fp16", precision.low_dtype("fp16")),
                        ("float32", np.dtype(np.float32))):
        total, step, path = np.array(1.0, dtype=dtype), np.array(0.01, dtype=dtype), []
        for _ in range(1000):   # a running sum: each addition rounded to the format
            total = (total + step).astype(dtype)
            path.append(float(total))
        sums[name] = np.array(path)
    print("1 + 0.01, a thousand times (exactly 11): " + ", ".join(
        f"{name} {path[-1]:.4g}" for name, path in sums.items())
          + f"; bf16 stops where half its spacing passes 0.01 (spacing at 4: "
          f"{4 * 2 * precision.unit_roundoff('bf16'):g})", flush=True)
    # why the update needs a master: w -= lr * g with lr * g far below w's spacing
    weight16 = np.array(1.0, dtype=bf16)
    master = np.float32(1.0)
    for _ in range(100):
        weight16 = (weight16 - np.array(1e-3, dtype=bf16)).astype(bf16)
        master = np.float32(master - np.float32(1e-3))
    print(f"100 updates of -0.001 to a weight of 1 (exactly 0.9): on the bf16 weight itself "
          f"{float(weight16):g} {verdict(float(weight16) == 1.0, 'lost', 'kept')}; on a "
          f"float32 master {float(master):.5f}, whose bf16 copy is "
          f"{float(np.array(master).astype(bf16)):g}: the master keeps what each step adds, "
          "the 16-bit copy rounds the sum once", flush=True)
    return sums


# ------------------------------------------------------------ 3. range, loss scaling
def loss_scaling(base: dict, world: MPI.Comm, steps: int) -> list[tuple[float, bool]]:
    """Section 3: fp16's range, and a real run's loss scale over its steps."""
    fp16 = precision.low_dtype("fp16")
    n = world.Get_size()
    cfg = TrainConfig(**base, steps=steps, dp=n, mixed="fp16", dtype="float32",
                      loss_scale=2.0 ** 24, loss_scale_window=8).resolved(n)
    history = train(cfg, world).extras["scale_history"]
    if world.Get_rank() != 0:
        return history
    tiny, scale = 1e-8, 65536.0
    print("\n=== 3. float16 keeps 11 bits and 5 exponent bits: max "
          f"{float(np.finfo(fp16).max):g}", flush=True)
    with np.errstate(over="ignore"):   # the overflow is the point
        inf = float(np.array(70000.0).astype(fp16))
    print(f"70000 in fp16 = {inf}; a gradient of {tiny:g} "
          f"in fp16 = {float(np.array(tiny).astype(fp16)):g} (flushed to 0); scaled by "
          f"S = {scale:g} first: {float(np.array(tiny * scale).astype(fp16)):.4g}, divided "
          f"back in float32: {float(np.float32(np.array(tiny * scale).astype(fp16)) / scale):.4g}",
          flush=True)
    skipped = [s for s, skip in history if skip]
    grown = sum(b == 2 * a for (a, _), (b, _) in zip(history, history[1:]))
    print(f"a run started at S = 2^24 (window {cfg.loss_scale_window}): the scaled gradients "
          f"overflow fp16, found_inf is voted over all {n} ranks, every rank skips together "
          f"and S halves: {len(skipped)} skipped steps of {steps}; S started at 2^"
          f"{int(np.log2(history[0][0]))}, fell as low as 2^"
          f"{int(np.log2(min(s for s, _ in history)))} and ended at 2^"
          f"{int(np.log2(history[-1][0]))}; S doubled {grown} times after "
          f"{cfg.loss_scale_window} clean steps "
          f"{verdict(bool(skipped) and grown > 0, 'backs off and grows', 'NEVER MOVED')}",
          flush=True)
    print("S per step: " + " ".join(f"2^{int(np.log2(s))}{'x' if skip else ''}"
                                     for s, skip in history) + "   (x: skipped)", flush=True)
    return history


# ------------------------------------------------------------ 4. 16-bit Allreduce
def allreduce_errors(world: MPI.Comm, size: int) -> dict[str, dict[int, float]]:
    """Section 4: each rank's float32 main gradient summed over groups of 2, 4, 8 ranks
    (sub-communicators of the world): as float32 (`--grad-reduce-dtype master`); as
    a 16-bit copy summed in 16 bits on the wire and in every partial sum
    (`--grad-reduce-dtype low`, low_precision.allreduce_low); as a 16-bit copy
    upcast, summed and rounded once (allreduce_upcast). The error against the
    float64 sum of the float32 inputs, relative in the 2-norm."""
    errors: dict[str, dict[int, float]] = {}
    rank, n = world.Get_rank(), world.Get_size()
    grad = np.random.default_rng(1000 + rank).standard_normal(size).astype(np.float32)
    for k in [k for k in (2, 4, 8) if k <= n]:
        comm = world.Split(rank // k, rank)
        group = Group(comm, f"groups of {k}", Ledger())
        exact = grad.astype(np.float64)
        comm.Allreduce(MPI.IN_PLACE, exact, op=MPI.SUM)   # my float32 values -> exact sum
        master = grad.copy()
        group.Allreduce(MPI.IN_PLACE, master, op=MPI.SUM)  # --grad-reduce-dtype master
        for name in ("bf16", "fp16"):
            low = precision.low_dtype(name)
            summed = {"16-bit sum": low_precision.allreduce_low(group, grad.astype(low)),
                      "upcast sum": low_precision.allreduce_upcast(group, grad.astype(low),
                                                                   np.dtype(np.float32))}
            if name == "fp16":
                summed = {**summed, "float32 master": master}
            for how, value in summed.items():
                error = float(np.linalg.norm(value.astype(np.float64) - exact)
                              / np.linalg.norm(exact))
                label = how if how == "float32 master" else f"{name} {how}"
                errors.setdefault(label, {})[k] = world.allreduce(error, op=MPI.MAX)
        comm.Free()
    if rank == 0:
        sizes = sorted(next(iter(errors.values())))
        print(f"\n=== 4. Allreduce of a float32 gradient of {size} numbers per rank, relative "
              f"error against the float64 sum (worst group), in units of u", flush=True)
        print(f"{'':>16} " + " ".join(f"{f'{k} ranks':>16}" for k in sizes), flush=True)
        for label, by_size in errors.items():
            u = precision.unit_roundoff(label.split()[0]) if label[0] != "f" or \
                label.startswith("fp16") else 2.0 ** -24
            print(f"{label:>16} " + " ".join(f"{by_size[k]:>9.2e} ({by_size[k] / u:>4.2f}u)"
                                             for k in sizes), flush=True)
        print("(u of the sum's own format: bf16 2^-8, fp16 2^-11, float32 2^-24)", flush=True)
        full = errors["float32 master"][sizes[-1]]
        for name in ("bf16", "fp16"):
            low, mid = errors[f"{name} 16-bit sum"], errors[f"{name} upcast sum"]
            grows = low[sizes[-1]] > low[sizes[0]]
            print(f"{name}: summing in 16 bits rounds every partial sum, so its error grows "
                  f"with the group ({low[sizes[0]]:.2e} -> {low[sizes[-1]]:.2e}, "
                  f"{verdict(grows, 'grows', 'DOES NOT GROW')}); upcast-reduce-round rounds "
                  f"the inputs and the result once ({mid[sizes[0]]:.2e} -> "
                  f"{mid[sizes[-1]]:.2e}); the float32 reduction of the main gradient: "
                  f"{full:.1e}. Half the wire bytes cost {low[sizes[-1]] / full:.0f}x the "
                  f"float32 error on {sizes[-1]} ranks", flush=True)
    return errors


# ------------------------------------------------------------ 5. loss curves
def loss_curves(base: dict, world: MPI.Comm, steps: int) -> dict[str, list[float]]:
    """Section 5: the same model, data and seed trained in float64, bf16 and fp16."""
    n = world.Get_size()
    runs = {"float64": TrainConfig(**base, steps=steps, dp=n),
            "bf16 (float32 masters)": TrainConfig(**base, steps=steps, dp=n, mixed="bf16",
                                                  dtype="float32"),
            "fp16 (float32 masters)": TrainConfig(**base, steps=steps, dp=n, mixed="fp16",
                                                  dtype="float32")}
    results, decisions = {}, {}
    for label, cfg in runs.items():   # each run's decisions (the fp16 skips) for its check
        results[label] = train(cfg.resolved(n), world)
        decisions[label] = gather_decisions(world, cfg.resolved(n), results[label], None)
    losses = {label: result.losses for label, result in results.items()}
    if world.Get_rank() != 0:
        return losses
    print(f"\n=== 5. {steps} steps of the same model (dp = {n}), loss at a few steps and "
          "against one process in the same precision (tolerance from u and the step count, "
          "run/results.py mixed_tolerance)", flush=True)
    marks = sorted({0, steps // 4, steps // 2, steps - 1})
    print("(columns: the loss at those steps; 'from float64': the largest relative "
          "difference of the step losses from the float64 run on this mesh; 'from one "
          "process': the same from a one-process run in the same precision, against its "
          "tolerance)", flush=True)
    print(f"{'':>24} " + " ".join(f"{f'step {s + 1}':>11}" for s in marks)
          + "  from float64  from one process", flush=True)
    said = []
    for label, cfg in runs.items():
        resolved = cfg.resolved(n)
        # one process in the same precision, under this run's discrete decisions (a step
        # the mesh skipped on an fp16 overflow is skipped there too: run/results.py)
        one, lines = replayed_reference(resolved, decisions[label])
        said += [f"{'':>24} {label.split(' ')[0]}, {line}" for line in lines]
        tol = mixed_tolerance(resolved)[0] if cfg.mixed else 1e-9
        diff = relative_difference(losses[label], one.losses)
        off = relative_difference(losses[label], losses["float64"])
        near = " (within 5% of its bound)" if 0.95 * tol < diff <= tol else ""
        print(f"{label:>24} " + " ".join(f"{losses[label][s]:>11.5f}" for s in marks)
              + f"  {off:>12.2e}  {diff:.2e} <= {tol:.2e} {verdict(diff <= tol)}{near}",
              flush=True)
    print("\n".join(said) or f"{'':>24} every step's decisions (the fp16 skips) the same "
          "as one process's", flush=True)
    return losses


# ------------------------------------------------------------ 6. FP8
FP8_BLOCK = 16   # --fp8-block at this size (DeepSeek-V3's 128 is the width of a large model)


def fp8_layers(base: dict, steps: int) -> dict[str, list[float]]:
    """Section 6a, one process (rank 0): the same model trained in float64, in bf16, and
    in bf16 with each FP8 recipe's 8-bit matmuls (`train_reference`). Per block, the
    difference of its fc1 and fc2 weights from the float64 run's, relative to how far
    float64 moved them: the error the recipe added to that layer."""
    runs = {"bf16 alone": dict(mixed="bf16", dtype="float32")}
    runs.update({f"fp8 {r}": dict(mixed="bf16", dtype="float32", fp8=r, fp8_block=FP8_BLOCK)
                 for r in fp8.RECIPES})
    exact = train_reference(TrainConfig(**base, steps=steps).resolved(1))
    layers = sorted({int(k.split(".")[1]) for k in exact.final if k.startswith("blocks.")})

    def stacked(params: dict, layer: int) -> np.ndarray:
        return np.concatenate([params[f"blocks.{layer}.{w}.weight"].astype(np.float64).ravel()
                               for w in ("fc1", "fc2")])

    moved = [np.linalg.norm(stacked(exact.final, i) - stacked(exact.init, i)) for i in layers]
    errors, losses = {}, {}
    for label, extra in runs.items():
        result = train_reference(TrainConfig(**base, steps=steps, **extra).resolved(1))
        errors[label] = [float(np.linalg.norm(stacked(result.final, i)
                                              - stacked(exact.final, i)) / m)
                         for i, m in zip(layers, moved)]
        losses[label] = abs(result.losses[-1] - exact.losses[-1]) / exact.losses[-1]
    print(f"\n=== 6. FP8: 8-bit matmuls (e4m3 forward, e5m2 gradients; docs/design.md, "
          f"\"FP8\"; minipar/core/fp8.py), block B = {FP8_BLOCK}", flush=True)
    print(f"a. {steps} SGD steps in one process: each block's fc1 and fc2 weights against the "
          "float64 run's, ||W - W64|| / ||W64 - W_init|| (the error over float64's "
          "movement), and the last loss's relative difference", flush=True)
    print(f"{'':>16} " + " ".join(f"{f'block {i}':>9}" for i in layers)
          + f" {'last loss':>10}", flush=True)
    for label, per_layer in errors.items():
        print(f"{label:>16} " + " ".join(f"{e:>9.2e}" for e in per_layer)
              + f" {losses[label]:>10.2e}", flush=True)
    worst = {label: max(e) for label, e in errors.items()}
    eight = {r: worst[f"fp8 {r}"] for r in fp8.RECIPES}
    print(f"every 8-bit recipe adds error to bf16's, 4 bits of significand against 8: "
          f"{verdict(min(eight.values()) > worst['bf16 alone'])}; the worst block: "
          + ", ".join(f"{r} {e:.2e}" for r, e in eight.items())
          + f", {min(eight.values()) / worst['bf16 alone']:.0f}x bf16's or more (their unit "
          "roundoffs: 2^-4 against 2^-8, 16x)", flush=True)
    return errors


def fp8_outlier(size: tuple[int, int] = (16, 128)) -> dict[str, object]:
    """Section 6b, one process: an activation of standard normals with ONE large value,
    quantized to e4m3 by each recipe (`fp8.fake_quantize`), the large value swept from 1
    to 10^6. e4m3's normals span 448 / 2^-6 = 28672; once the outlier, which sets
    tensorwise's only scale, is that far above the rest, they fall among the subnormals
    (few bits, then 0). Rowwise spoils the outlier's row, blockwise its 1 x B tile.
    Returns the sweep's errors and the per-element |Q(x) - x| / |x| at the largest."""
    x = np.random.default_rng(14).standard_normal(size).astype(np.float32)
    row, col = size[0] // 3, size[1] // 2 + 3
    others = np.ones(size, dtype=bool)
    others[row, col] = False
    tile = np.zeros(size, dtype=bool)
    tile[row, col // FP8_BLOCK * FP8_BLOCK:(col // FP8_BLOCK + 1) * FP8_BLOCK] = True
    outliers = 10.0 ** np.arange(0, 6.5, 0.5)
    sweep: dict[str, list[float]] = {r: [] for r in fp8.RECIPES}
    for outlier in outliers:
        x[row, col] = outlier
        for r in fp8.RECIPES:
            q = fp8.fake_quantize(x, r, "act", "e4m3", FP8_BLOCK)
            sweep[r].append(float(np.linalg.norm((q - x)[others])
                                  / np.linalg.norm(x[others])))
            if r == "tensorwise":
                zeros = int(np.sum((q == 0) & others))
    per_element = {r: np.abs(fp8.fake_quantize(x, r, "act", "e4m3", FP8_BLOCK) - x)
                   / np.abs(x) for r in fp8.RECIPES}
    big = float(outliers[-1])
    scale = float(fp8.scale_of(fp8.amax(x, "tensorwise", "act", FP8_BLOCK), "e4m3").ravel()[0])
    typical = float(np.median(np.abs(x[others])))
    print(f"b. one outlier: a {size[0]} x {size[1]} activation of standard normals, element "
          f"({row}, {col}) set to 1 ... {big:g}, quantized to e4m3; the relative 2-norm "
          f"error of the other {int(others.sum())} numbers", flush=True)
    marks = [0, len(outliers) // 2, len(outliers) - 4, len(outliers) - 1]
    print(f"{'outlier':>12} " + " ".join(f"{outliers[i]:>10.0e}" for i in marks), flush=True)
    for r in fp8.RECIPES:
        print(f"{r:>12} " + " ".join(f"{sweep[r][i]:>10.2e}" for i in marks), flush=True)
    print(f"tensorwise at {big:g}: s = amax / 448 = {scale:.3g}, so the median |x| = "
          f"{typical:.2f} becomes q = {typical / scale:.2g}, below e4m3's smallest normal "
          f"2^-6 = {2.0 ** -6:g} (subnormal steps of 2^-9): {zeros} of the other numbers "
          f"became 0", flush=True)
    print(f"rowwise spoils the outlier's row alone (that row's median element error "
          f"{np.median(per_element['rowwise'][row][others[row]]):.2e}, the other rows' "
          f"{np.median(per_element['rowwise'][np.arange(size[0]) != row]):.2e}); blockwise "
          f"its 1 x {FP8_BLOCK} tile alone (the tile's "
          f"{np.median(per_element['blockwise'][tile & others]):.2e}, the rest "
          f"{np.median(per_element['blockwise'][~tile]):.2e})", flush=True)
    print(f"at {big:g}: blockwise error below tensorwise's "
          f"{verdict(sweep['blockwise'][-1] < sweep['tensorwise'][-1])} and below rowwise's "
          f"{verdict(sweep['blockwise'][-1] < sweep['rowwise'][-1])}; tensorwise spoiled, "
          f"more than 10x its error at outlier 1 "
          f"{verdict(sweep['tensorwise'][-1] > 10 * sweep['tensorwise'][0])}; the outlier "
          f"itself exact in all three (its group's amax: q = 448) "
          f"{verdict(all(per_element[r][row, col] == 0 for r in fp8.RECIPES))}", flush=True)
    return {"outliers": outliers, "sweep": sweep, "per_element": per_element,
            "row": row, "col": col, "big": big}


def fp8_allgather(base: dict, world: MPI.Comm) -> None:
    """Section 6c, every rank: ZeRO-3 on dp = world with blockwise FP8 and
    `--fp8-allgather`, one step: the ledger's Allgatherv line (what each rank's call
    receives: every replica's slice, a weight element as its e4m3 byte, the rest as two
    bf16 bytes) against `ledger_tables.predicted_lines`, every rank, every line."""
    n = world.Get_size()
    cfg = TrainConfig(**base, steps=1, dp=n, zero=3, mixed="bf16", dtype="float32",
                      fp8="blockwise", fp8_block=FP8_BLOCK, fp8_allgather=True).resolved(n)
    result = train(cfg, world)
    if world.Get_rank() != 0:
        return
    got = {r["rank"]: r for r in result.ledger if (r["group"], r["op"]) == ("dp", "Allgatherv")}
    want = {rank: lines[("dp", "Allgatherv")]
            for rank, lines in ledger_tables.predicted_lines(cfg).items()}
    same = all((got[k]["calls"], got[k]["elements"], got[k]["bytes"])
               == (want[k].calls, want[k].elements, want[k].bytes) for k in want)
    mine = got[0]
    shapes = nn.canonical_shapes(cfg.model_config())
    psi = sum(int(np.prod(s)) for s in shapes.values())
    weights = sum(int(np.prod(s)) for k, s in shapes.items() if k.endswith(fp8.BLOCK_WEIGHTS))
    whole = weights + 2 * (psi - weights)   # one gather of the whole model, in bytes
    gathers = 2 * cfg.microbatches          # forward and backward, each microbatch
    wire = ledger_tables.wire_bytes(mine, {"dp": n})
    print(f"c. ZeRO-3 on dp = {n}, --fp8 blockwise --fp8-allgather, one step: rank 0's "
          f"Allgatherv line, {mine['calls']} calls, {mine['bytes']} bytes (the words travel "
          f"as MPI.BYTE: its elements are bytes); predicted {want[0].calls} calls, "
          f"{want[0].bytes} bytes ({want[0].dtype}); every rank "
          f"{verdict(same, 'as predicted', 'DIFFERS')}", flush=True)
    print(f"ledger bytes = what the calls' buffers receive (every replica's slice): one "
          f"gather of the model's {psi} parameters is {weights} block-weight elements x 1 "
          f"e4m3 byte + {psi - weights} others x 2 bf16 bytes = {whole} bytes, {gathers} "
          f"gathers a step (forward and backward of {cfg.microbatches} microbatch"
          f"{'es' if cfg.microbatches > 1 else ''}): {gathers * whole} "
          f"{verdict(mine['bytes'] == gathers * whole)}", flush=True)
    print(f"against the same gathers in float32 ({4 * gathers * psi} bytes): "
          f"{mine['bytes'] / (4 * gathers * psi):.3f} of them (bf16 words: 0.5); the block "
          f"weights alone, {weights / psi:.3f} of the parameters, move in "
          f"{(mine['bytes'] - gathers * 2 * (psi - weights)) / (4 * gathers * weights):.3f} "
          "of their float32 bytes (the ledger's bytes less the others' bf16 words)",
          flush=True)
    print(f"wire bytes (ring Allgather, (N - 1)/N of the buffer leaves each rank): "
          f"{wire:.0f} a rank in the step; the scales travel in no message of their own, "
          "every replica holds them after the step's amax Allreduce(MAX)", flush=True)
    differences = ledger_tables.ledger_differences(result.ledger, cfg)
    print("the whole ledger (the blocks' amax Allreduce over dp included, "
          "fp8_ledger.expected_ledger) against predicted_lines: "
          f"{verdict(not differences, 'every line', 'DIFFERS')}"
          + "".join(f"\n  {d}" for d in differences), flush=True)


# ------------------------------------------------------------ figures
def figures(per_param: dict, sums: dict, history: list, errors: dict, losses: dict,
            n: int, folder: Path) -> None:
    """Rank 0: one PNG per section, each series its own colour and marker."""
    from matplotlib.figure import Figure

    from minipar.teaching.load_plots import series_style
    from minipar.teaching.plots import save

    def panel() -> tuple[Figure, object]:
        fig = Figure(figsize=(9, 4.5), layout="constrained")
        return fig, fig.add_subplot()

    def finish(fig: Figure, ax: object, xlabel: str, ylabel: str, title: str,
               name: str) -> None:
        """Labels, the title, the legend right of the axes (over no data), the PNG."""
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
        print("figure:", save(fig, folder / name), flush=True)

    fig, ax = panel()
    stages = np.arange(4)
    for i, (label, values) in enumerate(per_param.items()):
        ax.plot(stages, values, label=f"{label}: measured", ls="-", markersize=8,
                **series_style(i))
    paper = bytes_per_param("adam", 4, 2, main_grad_bytes=2)
    ax.plot(stages, [bytes_per_param_held(paper, n, s) for s in range(4)], ls=":",
            label="ZeRO paper (16-bit grads): formula", **series_style(3))
    ax.axhline(18, color="0.5", ls="--", lw=1, label="Megatron's table: 18")
    ax.set_xticks(stages, STAGES)
    finish(fig, ax, "", "bytes per parameter on one rank",
           f"model states per parameter, Adam, dp = {n}\n(measured; each point equals "
           "memory.bytes_per_param_held; bf16 and fp16 coincide)", "14_bytes.png")

    fig, ax = panel()
    count = np.arange(1, 1001)
    ax.plot(count, 1 + 0.01 * count, color="0.5", lw=3, alpha=0.5, label="exact")
    for i, (label, path) in enumerate(sums.items()):
        ax.plot(count, path, label=label, markevery=50, **series_style(i))
    finish(fig, ax, "additions of 0.01", "running sum, each addition rounded",
           "1 + 0.01 + 0.01 + ...: bf16 stalls at 4, where 0.01 is under half its spacing",
           "14_resolution.png")

    fig, ax = panel()
    steps = np.arange(1, len(history) + 1)
    scale = np.log2([s for s, _ in history])
    skips = np.array([skip for _, skip in history])
    ax.plot(steps, scale, label="S the step ran with", **series_style(0))
    ax.plot(steps[skips], scale[skips], ls="none", markersize=12, label="skipped (overflow)",
            **series_style(1))
    finish(fig, ax, "step", "log2 S", "fp16 dynamic loss scale of a real run: halved on "
           "every overflow, doubled after a window of clean steps", "14_loss_scale.png")

    fig, ax = panel()
    for i, (label, by_size) in enumerate(errors.items()):
        sizes = sorted(by_size)
        ax.plot(sizes, [by_size[k] for k in sizes], label=label, **series_style(i))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(k) for k in sizes])
    finish(fig, ax, "ranks in the Allreduce", "relative error vs the float64 sum",
           "a gradient Allreduce: summed in 16 bits (MPI.Op.Create) vs in the master dtype\n"
           f"(groups of {' and '.join(str(k) for k in sizes)} ranks: as many as this job has)",
           "14_allreduce_error.png")

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    base = np.asarray(losses["float64"])
    every = max(1, len(base) // 15)
    for i, (label, values) in enumerate(losses.items()):
        steps = np.arange(1, len(values) + 1)
        if label == "float64":   # thin and black on top: the 16-bit curves lie close under it
            ax.plot(steps, values, label=label, color="black", lw=0.8, zorder=3)
        else:
            ax.plot(steps, values, label=label, lw=2.5, alpha=0.6, markevery=every,
                    **series_style(i))
        if label != "float64":
            right.plot(steps, np.maximum(np.abs(np.asarray(values) - base) / base, 1e-18),
                       lw=1, markevery=every, **series_style(i))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"one model, dp = {n}: float64 (thin, black) over bf16 and fp16",
                 fontsize=10)
    right.set_yscale("log")
    right.set_xlabel("step")
    right.set_ylabel("|loss - float64 loss| / float64 loss")
    right.set_title("how far the 16-bit runs drift", fontsize=10)
    fig.legend(loc="outside right center", fontsize=8, frameon=False)
    print("figure:", save(fig, folder / "14_losses.png"), flush=True)


def fp8_figures(layers: dict[str, list[float]], outlier: dict, folder: Path) -> None:
    """Rank 0: section 6's PNGs, the per-layer errors and the outlier."""
    from matplotlib.figure import Figure

    from minipar.teaching.load_plots import series_style
    from minipar.teaching.plots import save

    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for i, (label, errors) in enumerate(layers.items()):
        ax.plot(range(len(errors)), errors, label=label, markersize=8, **series_style(i))
    ax.set_yscale("log")
    ax.set_xticks(range(len(errors)), [f"block {i}" for i in range(len(errors))])
    ax.set_ylabel("||W - W_float64|| / ||W_float64 - W_init||")
    ax.set_title("fc1 and fc2 weights after the same steps, against float64 (one process):\n"
                 f"the three FP8 recipes (B = {FP8_BLOCK}) over bf16 alone", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    print("figure:", save(fig, folder / "14_fp8_layers.png"), flush=True)

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    row, col, big = outlier["row"], outlier["col"], outlier["big"]
    for i, r in enumerate(fp8.RECIPES):
        ax.plot(outlier["outliers"], outlier["sweep"][r], label=r, **series_style(i))
        right.plot(np.arange(len(outlier["per_element"][r][row])),
                   np.maximum(outlier["per_element"][r][row], 1e-4), lw=1,
                   markersize=(9, 5, 4)[i], **series_style(i))   # big under small: both seen
    ax.axvline(448 / 2.0 ** -6, color="0.5", ls="--", lw=1,
               label="448 / 2^-6: e4m3's normal range")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("the one outlier's value (the rest: standard normals)")
    ax.set_ylabel("relative error of the other numbers")
    ax.set_title("one outlier against each recipe's scale", fontsize=10)
    tile = col // FP8_BLOCK * FP8_BLOCK
    right.axvspan(tile - 0.5, tile + FP8_BLOCK - 0.5, color="0.85", zorder=0,
                  label=f"the outlier's 1 x {FP8_BLOCK} tile")
    right.set_yscale("log")
    right.set_xlabel(f"feature of row {row}, the outlier's (at {col})")
    right.set_ylabel("|Q(x) - x| / |x| (floored at 1e-4; 1 = flushed to 0)")
    right.set_title(f"the outlier's row, outlier = {big:g}: tensorwise and rowwise\n"
                    "flush the row's other numbers to 0 (error 1, together)", fontsize=10)
    fig.legend(loc="outside right center", fontsize=8, frameon=False)
    print("figure:", save(fig, folder / "14_fp8_outlier.png"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer training steps")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    quick = args.quick or os.environ.get("MINIPAR_QUICK", "0") not in ("", "0")
    world = MPI.COMM_WORLD
    n = world.Get_size()
    if n < 2:
        raise ConfigError("lesson 14 reduces over ranks: run it on 2 or more, "
                          "mpiexec -n 4 python lessons/14_mixed_precision.py")
    # 8 classes: Psi = 34472, which 2, 4 and 8 ranks divide (bytes per parameter exact)
    base = dict(layers=4, d_in=16, d_model=32, classes=8, batch=16 * n, optimizer="adam")
    measured = measure_bytes(base, world)
    per_param, sums = {}, {}
    if world.Get_rank() == 0:   # sections 1 and 2 print now; 3-5 need every rank
        cfg = TrainConfig(**base).resolved(1)
        psi = sum(int(np.prod(s)) for s in nn.canonical_shapes(cfg.model_config()).values())
        per_param = bytes_table(measured, psi, n)
        sums = resolution()
    history = loss_scaling(base, world, 30 if quick else 60)
    errors = allreduce_errors(world, 1024 if quick else 16384)
    # SGD: the derived tolerance holds for hundreds of steps (Adam's sign flips do not)
    losses = loss_curves(dict(base, optimizer="sgd"), world, 40 if quick else 300)
    layers, outlier = {}, {}
    if world.Get_rank() == 0:   # 6a and 6b in one process; 6c on every rank
        layers = fp8_layers(dict(base, optimizer="sgd"), 10 if quick else 20)
        outlier = fp8_outlier()
    fp8_allgather(base, world)
    if world.Get_rank() == 0 and args.plot:
        figures(per_param, sums, history, errors, losses, n, args.plot)
        fp8_figures(layers, outlier, args.plot)


if __name__ == "__main__":
    run_collectively(main)
