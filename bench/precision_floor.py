"""One process: the 16-bit and 8-bit emulations against their floors, Muon's Newton-Schulz
against its matmuls.

    python -m bench.precision_floor [--quick]    (`make bench` calls `floor_rows`, `muon_rows`)

**The floor of an emulated low-precision step.** NumPy multiplies in float32 whatever
the recipe says, so a `--mixed bf16 --dtype float32` step does the float32 step's
work plus, at the very least, one rounding pass over every tensor the recipe rounds.
That sum is the floor: nothing a cleverer emulation does can go below it. Measured
here, in one process, on the MLP of bench/mixed_rank.py's SHAPE (dp = 1, SGD), each
run built and stepped as `train` builds and steps it (bench/dp_limit_rank.py `build`,
run/mesh_step.py `train_step`, under `precision.use` and the fp8 recipe `train` makes):

    floor      the float32 step, then one rounding pass over arrays of the real shapes:
               `dst[...] = src` into a preallocated 16-bit array (ml_dtypes' cast, no
               temporary), one per rounding the census found
    bf16       the bf16 step (goal: at most 1.10 x the floor)

**How the roundings are counted** (`census`): not by reading the code, by one step
with the rounding helpers instrumented. Every call of core/precision.py's `to_low`
whose input is not 16-bit already (every op's output rule, `round_low`, and a matmul
operand rounded in `matmul` all go through it) is one rounding of an array of that
shape; parallel/mixed.py's `cast_copies` (each master -> its 16-bit copy after the
update) is one per parameter. A call on an array that is 16-bit already is no
rounding and is not counted. Under `--fp8` each call of core/fp8.py's
`fake_quantize` is one quantize-dequantize pass; its floor (`qdq_pass`) is the
group amax (|x| and its max over each group), x / s clipped, cast to 8 bits and
back, times s, every step into preallocated arrays. (A weight's amax is taken once a
step by the recipe but counted once per use here: the floor is, if anything, a little
high for the 8-bit rows.) The fp8 floor is the float32 step + the fp8 step's own
roundings to bf16 + its quantize-dequantize passes.

Not in any floor, and so part of what a step pays above it: widening 16-bit operands
back to float32 before a product (no bf16 BLAS), the main gradients' additions, and
the replica check every `--mixed` step runs (run/agreement.py `replica_check`, its CRC-32
timed alone beside the rows).

Each ratio is of two steps timed side by side: alternating repetitions (the order
flipping), the ratio per repetition, its median and range (bench/timing.py). The
fp8 step / bf16 step row is the 8-bit emulation's own cost (quantize, dequantize and
their amaxes; no 8-bit product is faster here, NumPy has none), stated as such.

**Muon** (`muon_vs_matmuls`): `muon.orthogonalize` (its Newton-Schulz: normalize, then
per iteration A = X X^T, B = b A + c A A, X = a X + B X) on the update of every matrix
a Muon step of the same MLP orthogonalizes, against the same three matmuls per
iteration alone (`np.matmul(..., out=)` into preallocated arrays of the same shapes);
goal at most 1.10: the rest (the norm, the scalings and sums) is elementwise.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
from mpi4py import MPI

from bench.dp_limit_rank import build
from bench.mixed_rank import SHAPE
from bench.timing import spread
from minipar.core import fp8, muon, precision
from minipar.parallel import fp8_scales, mixed
from minipar.run.agreement import replica_check
from minipar.run.mesh_step import train_step
from minipar.settings.config import TrainConfig

RUNS = {"float32": dict(dtype="float32"),
        "bf16": dict(dtype="float32", mixed="bf16"),
        "fp8 tensorwise": dict(dtype="float32", mixed="bf16", fp8="tensorwise"),
        "fp8 blockwise": dict(dtype="float32", mixed="bf16", fp8="blockwise")}


class Run:
    """One configuration of the MLP, built as `train` builds it, stepped as it steps."""

    def __init__(self, extra: dict) -> None:
        self.cfg = TrainConfig(**SHAPE, **extra, dp=1).resolved(1)
        with precision.use(self.cfg.mixed, self.cfg.dtype):
            _, self.mesh, self.chunks, self.updater = build(self.cfg, MPI.COMM_SELF)
        # the recipe `train` hands precision.use, made once a run (it keeps the amaxes)
        self.recipe = fp8_scales.over_mesh(fp8.recipe_of(self.cfg), self.mesh)
        self.steps = 0

    @contextlib.contextmanager
    def policy(self) -> Iterator[None]:
        """The precision policy `train` runs its steps under (and its errstate)."""
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"), \
                precision.use(self.cfg.mixed, self.cfg.dtype, self.recipe):
            yield

    def step(self) -> None:
        """One training step, the next one of this run's data."""
        with self.policy():
            train_step(self.cfg, self.mesh, self.chunks, self.updater, self.steps, [])
        self.steps += 1


@contextlib.contextmanager
def counting(found: list[tuple]) -> Iterator[None]:
    """Inside the block, every rounding to 16 bits and every quantize-dequantize pass
    is appended to `found` as ("round", shape) or ("qdq", shape, recipe, kind, format,
    block). The helpers are swapped in their modules and put back after."""
    to_low, fake, casts = precision.to_low, fp8.fake_quantize, mixed.cast_copies

    def counted_to_low(x: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
        target = precision.LOW if dtype is None else dtype
        if np.asarray(x).dtype != target:
            found.append(("round", np.shape(x)))
        return to_low(x, dtype)

    def counted_fake(x: np.ndarray, recipe: str, kind: str, fmt: str, block: int,
                     amaxes: np.ndarray | None = None) -> np.ndarray:
        found.append(("qdq", np.shape(x), recipe, kind, fmt, block))
        return fake(x, recipe, kind, fmt, block, amaxes)

    def counted_casts(masters: list[np.ndarray], copies: list[np.ndarray]) -> None:
        found.extend(("round", np.shape(m)) for m in masters)
        casts(masters, copies)

    precision.to_low, fp8.fake_quantize, mixed.cast_copies = \
        counted_to_low, counted_fake, counted_casts
    try:
        yield
    finally:
        precision.to_low, fp8.fake_quantize, mixed.cast_copies = to_low, fake, casts


def census(run: Run) -> list[tuple]:
    """What one step of `run` rounds and quantizes (see the module's docstring)."""
    found: list[tuple] = []
    with counting(found):
        run.step()
    return found


def rounding_pass(found: list[tuple], rng: np.random.Generator) -> Callable[[], None]:
    """The floor's extra work: one rounding to bf16 per ("round", shape) of `found`, each
    from a float32 array into a preallocated bf16 array (no temporary), and one
    `qdq_pass` per ("qdq", ...). One pair of arrays per distinct shape, reused by every
    rounding of that shape: each pass reads an array in the caches, as a rounding in the
    step reads the tensor its op has just written (distinct cold arrays would make the
    floor higher, the ratio kinder)."""
    low = precision.low_dtype("bf16")
    pairs: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    qdqs: dict[tuple, Callable[[], None]] = {}
    order: list[Callable[[], None]] = []
    for item in found:
        if item[0] == "round":
            if item[1] not in pairs:
                pairs[item[1]] = (rng.standard_normal(item[1]).astype(np.float32),
                                  np.empty(item[1], low))
            src, dst = pairs[item[1]]
            order.append(lambda src=src, dst=dst: dst.__setitem__(Ellipsis, src))
        else:
            if item[1:] not in qdqs:
                qdqs[item[1:]] = qdq_pass(rng.standard_normal(item[1]).astype(np.float32),
                                          *item[2:])
            order.append(qdqs[item[1:]])

    def passes() -> None:
        for one in order:
            one()
    return passes


def qdq_pass(x: np.ndarray, recipe: str, kind: str, fmt: str, block: int
             ) -> Callable[[], None]:
    """The least a quantize-dequantize of x must do, into preallocated arrays: each
    group's amax, s = amax / fmax, x / s clipped to +-fmax, cast to 8 bits (ml_dtypes)
    and back, times s (core/fp8.py's groups: `group_view`, `group_axes`). Back from 8
    bits by a table of the format's 256 values indexed by the bytes: exact, and about 10x
    faster than ml_dtypes' cast (7.5 ns an element here), so the floor is the lower."""
    group = "act" if kind in ("x", "dy") else "weight"
    view = fp8.group_view(x, recipe, group, block)
    axes = fp8.group_axes(recipe, group)
    work = np.empty_like(view)
    eight = np.empty(view.shape, fp8.fp8_dtype(fmt))
    table = np.arange(256, dtype=np.uint8).view(fp8.fp8_dtype(fmt)).astype(np.float32)
    top = np.float32(fp8.FMAX[fmt])

    def one() -> None:
        np.abs(view, out=work)
        scale = work.max(axis=axes, keepdims=True) / top
        np.divide(view, scale, out=work)
        np.clip(work, -top, top, out=work)
        eight[...] = work
        np.take(table, eight.view(np.uint8), out=work)
        np.multiply(work, scale, out=work)
    return one


def paired(a: Callable[[], object], b: Callable[[], object], repeats: int,
           warmup: int = 2) -> tuple[list[float], list[float]]:
    """Seconds of `a` and of `b` per repetition, the two alternating and the order
    flipping each repetition (bench/timing.py's rule, kept per repetition so that the
    ratio has a range)."""
    ta: list[float] = []
    tb: list[float] = []
    for rep in range(repeats + warmup):
        order = ((a, ta), (b, tb)) if rep % 2 == 0 else ((b, tb), (a, ta))
        for fn, out in order:
            start = time.perf_counter()
            fn()
            if rep >= warmup:
                out.append(time.perf_counter() - start)
    return ta, tb


def _ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """num / den per repetition: median and range."""
    return spread([n / d for n, d in zip(num, den)])


def floor_rows(repeats: int = 12, blockwise: bool = True) -> dict:
    """The 16-bit and 8-bit steps against their floors, fp8 against bf16 (see above)."""
    runs = {name: Run(extra) for name, extra in RUNS.items()
            if blockwise or name != "fp8 blockwise"}
    base = runs["float32"]
    rng = np.random.default_rng(0)
    out: dict = {}
    bf16_steps: list[float] = []
    for name, run in runs.items():
        if name == "float32":
            continue
        found = census(run)
        passes = rounding_pass(found, rng)

        def floor(passes: Callable[[], None] = passes) -> None:
            base.step()
            passes()
        step_t, floor_t = paired(run.step, floor, repeats)
        alone = [_time(passes) for _ in range(repeats)]   # the passes by themselves
        rounded = [item[1] for item in found if item[0] == "round"]
        out[name] = {
            "step": spread(step_t), "floor": spread(floor_t), "passes": spread(alone),
            f"{name}/floor": _ratio(step_t, floor_t),
            "roundings": len(rounded),
            "rounded_elements": int(sum(int(np.prod(s)) for s in rounded)),
            "qdq_passes": sum(1 for item in found if item[0] == "qdq")}
        if name == "bf16":
            bf16_steps = step_t
    for name in [n for n in runs if n.startswith("fp8")]:   # the 8-bit emulation's cost
        eight, sixteen = paired(runs[name].step, runs["bf16"].step, repeats)
        out[name][f"{name}/bf16"] = _ratio(eight, sixteen)
    bf16 = runs["bf16"]   # the replica check every --mixed step runs, alone
    checks = [_time(lambda: replica_check(bf16.mesh, bf16.chunks, bf16.updater, 0))
              for _ in range(repeats)]
    out["replica check"] = spread(checks)
    out["bf16 step"] = spread(bf16_steps)
    return out


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def muon_vs_matmuls(repeats: int = 12) -> dict:
    """Muon's Newton-Schulz on every matrix of a Muon step of the MLP against the same
    matmuls alone (see the module's docstring)."""
    cfg = TrainConfig(**{**SHAPE, "optimizer": "muon"}, dp=1).resolved(1)
    _, mesh, chunks, updater = build(cfg, MPI.COMM_SELF)
    updates: list[np.ndarray] = []
    real = muon.orthogonalize

    def kept(u: np.ndarray, steps: int) -> np.ndarray:
        updates.append(u.copy())
        return real(u, steps)
    muon.orthogonalize = kept
    try:
        train_step(cfg, mesh, chunks, updater, 0, [])
    finally:
        muon.orthogonalize = real
    steps = cfg.optimizer_rule()["ns_steps"]
    bare = [_bare_matmuls(u, steps) for u in updates]

    def newton_schulz() -> None:
        for u in updates:
            real(u, steps)

    def matmuls() -> None:
        for one in bare:
            one()
    ns, mm = paired(newton_schulz, matmuls, repeats)
    return {"newton_schulz": spread(ns), "matmuls": spread(mm),
            "ns/matmuls": _ratio(ns, mm), "matrices": [list(u.shape) for u in updates],
            "ns_steps": steps, "dtype": str(updates[0].dtype) if updates else None}


def _bare_matmuls(u: np.ndarray, steps: int) -> Callable[[], None]:
    """The three products of `steps` Newton-Schulz iterations on U's shape, nothing else:
    X X^T, A A, B X into preallocated arrays (X: the short side first, as orthogonalize
    turns it, normalized as it is: the values, not only the shapes, of the first step)."""
    x = (u.T if u.shape[0] > u.shape[1] else u) / max(float(np.linalg.norm(u)), muon.EPS)
    g = x.shape[0]
    gram, square, new = np.empty((g, g), x.dtype), np.empty((g, g), x.dtype), np.empty_like(x)

    def one() -> None:
        for _ in range(steps):
            np.matmul(x, x.T, out=gram)
            np.matmul(gram, gram, out=square)
            np.matmul(square, x, out=new)
    return one


def lines(floors: dict, ns: dict) -> list[str]:
    """The rows of bench/run.py's table."""
    out = []
    ms = lambda v: v["median"] * 1e3  # noqa: E731
    rng = lambda q: f"[{q['min']:.2f}-{q['max']:.2f}]"  # noqa: E731
    for name in [n for n in floors if n in RUNS]:
        r = floors[name]
        q = r[f"{name}/floor"]
        goal = " (goal <= 1.10)" if name == "bf16" else ""
        out.append(f"{name + ' step / its floor, MLP 1 process' + goal:<58} "
                   f"{q['median']:>8.3f}  {rng(q)} {ms(r['step']):.1f} vs {ms(r['floor']):.1f} "
                   f"ms; floor = float32 step + {r['roundings']} roundings "
                   f"({r['rounded_elements'] / 1e6:.2f} M elements)"
                   + (f" + {r['qdq_passes']} quantize-dequantize passes" if r['qdq_passes']
                      else "") + f", those passes alone {ms(r['passes']):.1f} ms")
        if f"{name}/bf16" in r:
            q = r[f"{name}/bf16"]
            out.append(f"{'  ' + name + ' step / bf16 step (the 8-bit emulation cost)':<58} "
                       f"{q['median']:>8.3f}  {rng(q)}")
    out.append(f"{'  the replica check of every --mixed step, alone, ms':<58} "
               f"{ms(floors['replica check']):>8.1f}  of a {ms(floors['bf16 step']):.1f} ms "
               f"bf16 step")
    q = ns["ns/matmuls"]
    shapes = ", ".join("x".join(map(str, s)) for s in ns["matrices"])
    out.append(f"{'Muon Newton-Schulz / its matmuls alone (goal <= 1.10)':<58} "
               f"{q['median']:>8.3f}  {rng(q)} {ms(ns['newton_schulz']):.1f} vs "
               f"{ms(ns['matmuls']):.1f} ms; {ns['ns_steps']} steps on {shapes} "
               f"({ns['dtype']})")
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    floors = floor_rows(4 if quick else 12, blockwise=not quick)
    ns = muon_vs_matmuls(4 if quick else 12)
    print("\n".join(lines(floors, ns)))


if __name__ == "__main__":
    main()
