"""Mixed precision: 16-bit compute on top of master weights (`train --mixed {bf16,fp16}`).

What this file teaches (docs/design.md, "Mixed precision"). A 16-bit float keeps 8
(bfloat16) or 11 (float16) bits of significand, so every value it stores is the
exact value times (1 + d) with |d| <= u, the unit roundoff:

    bf16   u = 2^-8    8 exponent bits: float32's range, so no loss scaling
    fp16   u = 2^-11   5 exponent bits: max 65504, gradients below 6e-8 flush to 0

Training keeps the *master* copy of every parameter (and the optimizer state) in
`--dtype` and computes with a 16-bit copy cast from it after each update. The rules
every op of the model follows under the policy set here (`use`):

- a matmul takes 16-bit operands, accumulates in the master dtype and rounds the
  result once (`matmul`: NumPy has no bfloat16 BLAS, so the operands are upcast,
  multiplied, and the result cast: what a tensor core does in hardware);
- an elementwise op on 16-bit values rounds its output (`round_low`);
- LayerNorm statistics, softmax, log-sum-exp and cross-entropy run in the master
  dtype on upcast inputs (`upcast`), their outputs rounded where they feed a matmul;
- a parameter's gradient is accumulated over microbatches in the master dtype (the
  *main gradient*, `grad_dtype`).

With no policy set (`LOW is None`, the default) every helper here is the identity
or the plain `@`, so float64/float32 runs are bit for bit what they were.

fp16's narrow range needs loss scaling: `LossScaler` multiplies the loss by S before
backward; if a gradient overflows, every rank skips the step together and S halves;
after `window` clean steps S doubles (Micikevicius et al. 2018).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

LOW_NAMES = ("bf16", "fp16")
UNIT_ROUNDOFF: dict[str, float] = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}

LOW: np.dtype | None = None      # the compute dtype while a policy is on, else None
MASTER: np.dtype | None = None   # the master dtype (--dtype) while a policy is on
FP8 = None    # --fp8: the recipe (core/fp8.py) the blocks' matmuls quantize with, else None


def low_dtype(name: str) -> np.dtype:
    """`bf16` -> ml_dtypes.bfloat16, `fp16` -> numpy.float16. ml_dtypes is imported here,
    on first use, so a run without bf16 never loads it (setup.cfg keeps it below 0.7, whose
    import takes most of a second of CPU, against 5 ms for 0.6, in every rank)."""
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name == "fp16":
        return np.dtype(np.float16)
    raise KeyError(name)


def unit_roundoff(name: str) -> float:
    """u of the 16-bit format: half the distance from 1 to the next number."""
    return UNIT_ROUNDOFF[name]


BY_TYPE_NAME = {"float16": "fp16", "bfloat16": "bf16"}   # the 16-bit type's class -> --mixed name


def name_of(dtype: np.dtype) -> str | None:
    """The --mixed name of a 16-bit dtype (`bf16`, `fp16`), None for any other.
    Asked of every array a collective or a gradient accumulation meets, so it looks at
    the type's class name (bfloat16 only exists once ml_dtypes is loaded, `low_dtype`),
    not at `dtype.name`, which NumPy builds anew on every call (about 2 us)."""
    dtype = np.dtype(dtype)
    return BY_TYPE_NAME.get(dtype.type.__name__) if dtype.itemsize == 2 else None


EXPONENT_BITS = {"bf16": 0x7F80, "fp16": 0x7C00}   # a 16-bit word's exponent field


def count_nonfinite(a: np.ndarray) -> int:
    """How many numbers of `a` are inf or NaN. A 16-bit float is not finite exactly
    when its exponent bits are all ones, so a 16-bit array is counted on its words
    (`EXPONENT_BITS`), two integer passes: `np.isfinite` on ml_dtypes' bfloat16 calls a
    function per element, 20x slower (512 x 512: 936 us against 44; asked of every
    parameter after every --mixed step, by `nonfinite_count`). Any other
    dtype: `np.isfinite`."""
    name = name_of(a.dtype)
    if name is None:
        return int(np.count_nonzero(~np.isfinite(a)))
    mask = EXPONENT_BITS[name]
    return int(np.count_nonzero((a.view(np.uint16) & mask) == mask))


def is_low(dtype: np.dtype) -> bool:
    """Is `dtype` one of the 16-bit compute dtypes?"""
    return name_of(dtype) is not None


def wire(x: np.ndarray) -> np.ndarray:
    """What MPI is handed: a 16-bit array as its uint16 view (the same memory, no copy);
    any other array as it is. MPI has no bfloat16, but a collective that only moves
    bytes does not need one (comm/low_precision.py; collectives.py's array helpers do
    the same for the collectives inside the model)."""
    return x.view(np.uint16) if is_low(x.dtype) else x


@contextlib.contextmanager
def use(mixed: str | None, master: np.dtype | str, fp8: object = None) -> Iterator[None]:
    """Inside this block the model's ops follow the mixed-precision rules with
    `mixed` (`bf16`, `fp16`) as the compute dtype and `master` as the master dtype, and
    with `fp8` (a core/fp8.py Recipe, --fp8) the blocks' matmuls quantize their operands.
    `mixed=None` leaves everything as it is (no policy)."""
    global LOW, MASTER, FP8
    previous = LOW, MASTER, FP8
    if mixed is not None:
        LOW, MASTER, FP8 = low_dtype(mixed), np.dtype(master), fp8
    try:
        yield
    finally:
        LOW, MASTER, FP8 = previous


# ------------------------------------------------------------------ casts
def to_low(x: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """x rounded to the 16-bit dtype (round to nearest even); a 16-bit x is returned
    as it is. `dtype` defaults to the policy's."""
    dtype = LOW if dtype is None else dtype
    x = np.asarray(x)
    return x if x.dtype == dtype else x.astype(dtype)


def round_low(x: np.ndarray) -> np.ndarray:
    """The output rule of an op: rounded to 16 bits under the policy, untouched
    without one."""
    return x if LOW is None else to_low(x)


def upcast(x: np.ndarray) -> np.ndarray:
    """x in the master dtype (exact: every 16-bit number is a float32/float64 one)
    under the policy, untouched without one. For statistics and softmax."""
    return x if LOW is None else widen(np.asarray(x), MASTER)


def widen(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x as `dtype` (exact when x is 16-bit), one cast straight into the new array.
    bfloat16 is the top half of a float32, and ml_dtypes' cast does just that: its
    result has the same bits as shifting the 16-bit words into the high half of 32-bit
    ones (checked on all 65536 words, NaNs included), at the speed of a copy -- 2.5x
    faster than the shift written in NumPy, which needs two passes (measured on a
    256 x 512 array with ml_dtypes 0.6: 11 us against 27 us; to float64 31 us
    against 585 us through a float32 temporary)."""
    return x if x.dtype == dtype else x.astype(dtype)


class Widened:
    """Values already in the master dtype, handed to `matmul` to multiply as they are:
    16-bit words widened once (`widened_once`), or, as core/fp8.py's subclass `Exact`,
    an 8-bit operand's dequantized values. Code that asks "is this operand 8-bit?"
    (bugs/detours.py) asks for `Exact`, which a plain Widened is not."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    @property
    def T(self) -> Widened:  # noqa: N802  (as ndarray.T)
        """The transpose, of the same kind."""
        return type(self)(self.values.T)

    @property
    def dtype(self) -> np.dtype:
        """The values' dtype."""
        return self.values.dtype


def widened_once(operand: object, words: np.ndarray, wide: np.ndarray) -> object:
    """A matmul operand whose widening is already done: a fused node that uses the 16-bit
    `words` in two products and a sum (an output gradient: dX, dW and db) widens them
    once, to `wide`, and hands this to `matmul`, which multiplies it as it is instead of
    widening the words again for each product. `operand` is what `block_operand` made of
    the words: the words themselves (then `wide`, as `Widened`), or under --fp8 their
    8-bit form, returned as it is. The values are those `matmul` would have widened: no
    number changes, a pass over the tensor per product goes."""
    return Widened(wide) if operand is words else operand


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b. Under the policy: both operands rounded to 16 bits, the products summed
    in the master dtype; the result is left in the master dtype, for the caller to
    add a bias and then round once (`round_low`). An operand `block_operand` already
    quantized to 8 bits (--fp8) is multiplied as it is (its dequantized values)."""
    if LOW is None:
        return a @ b
    return _operand(a) @ _operand(b)


def _operand(x: object) -> np.ndarray:
    """What a matmul multiplies: an 8-bit operand's dequantized values or a `Widened`'s
    values, else x rounded to 16 bits and widened to the master dtype."""
    values = getattr(x, "values", None)    # a Widened (core/fp8.py's Exact is one)
    return values if values is not None else widen(to_low(x), MASTER)


def block_operand(x: np.ndarray, kind: str, weight: object) -> object:
    """An operand of a block layer's matmul (`kind`: `x` its input, `dy` its output
    gradient, `weight` the weight itself): x as it is, or under --fp8, when the recipe
    covers `weight`, Q(x) (core/fp8.py: quantized with its group's scale, dequantized)."""
    if FP8 is None or not FP8.covers(weight):
        return x
    return FP8.operand(x, kind, weight)


def grad_dtype(data_dtype: np.dtype) -> np.dtype:
    """The dtype of a parameter's (main) gradient: the master dtype under the policy,
    else the parameter's own."""
    return np.dtype(data_dtype) if LOW is None else MASTER


# -------------------------------------------------------------- loss scaling
class LossScaler:
    """Dynamic loss scaling for fp16 (pure bookkeeping, no communication).

    The loss is multiplied by `scale` before backward, so small gradients stay
    above fp16's smallest number; the main gradients are divided by it before the
    optimizer. `update(found_inf)` is called once per step with the verdict every
    rank agreed on:

        found_inf  -> skip this step, scale /= 2, the clean-step count restarts
        clean      -> take it; after `window` clean steps in a row, scale *= 2

    Scales stay powers of two, so multiplying and dividing by them is exact.
    `LossScaler(1.0, window=0)` (bf16) never changes: `static=True`."""

    def __init__(self, scale: float = 65536.0, window: int = 1000,
                 static: bool = False) -> None:
        if scale <= 0 or not is_power_of_two(scale):
            raise ValueError(f"the loss scale must be a positive power of two, not {scale}")
        self.scale = float(scale)
        self.window = window
        self.static = static
        self.skipped = 0        # steps skipped so far
        self.clean = 0          # clean steps since the last overflow or growth

    def update(self, found_inf: bool) -> bool:
        """Record this step's verdict; True means: skip this step's update."""
        if self.static:
            return False
        # exercise: loss-scaler
        if found_inf:
            self.skipped += 1
            self.clean = 0
            self.scale = max(self.scale / 2.0, 2.0 ** -24)
            return True
        self.clean += 1
        if self.window > 0 and self.clean >= self.window:
            self.scale *= 2.0
            self.clean = 0
        return False
        # end exercise

    def state(self) -> dict:
        """What a checkpoint keeps: the scale, the skips, the clean-step count."""
        return {"scale": self.scale, "skipped": self.skipped, "clean": self.clean}

    def load(self, state: dict) -> None:
        """Continue from `state()` of a saved run."""
        self.scale = float(state["scale"])
        self.skipped = int(state["skipped"])
        self.clean = int(state["clean"])


class ReplayedScaler(LossScaler):
    """The one-process reference's scaler under `--check` (docs/design.md, "Mixed
    precision"): it takes another run's skip decisions instead of its own, so the two
    runs are compared under the same discrete decisions. Its own verdict of each step
    is kept in `own` beside the decision it followed, and the largest finite scaled
    gradient it saw in `largest` (the margin: how close to fp16's 65504)."""

    def __init__(self, scale: float, window: int, decisions: list[bool]) -> None:
        super().__init__(scale, window)
        self.decisions = list(decisions)
        self.own: list[bool] = []
        self.largest: list[float] = []

    def update(self, found_inf: bool) -> bool:
        """Record this step's own verdict, then follow the other run's decision (its own
        verdict past the decisions it was handed)."""
        step = len(self.own)
        self.own.append(bool(found_inf))
        self.largest.append(_LARGEST[0] * self.scale)   # nonfinite's latest, scaled back
        return super().update(self.decisions[step] if step < len(self.decisions)
                              else found_inf)


_REPLAY: list[list[bool] | None] = [None]   # `replaying`: the decisions make_scaler hands on
_MADE: list[list[ReplayedScaler]] = [[]]     # and the scalers it made with them
_LARGEST = [0.0]     # the largest finite |g| of the latest `nonfinite` call (under a replay)


@contextlib.contextmanager
def replaying(decisions: list[bool] | None) -> Iterator[list[ReplayedScaler]]:
    """Inside the block, `make_scaler` builds fp16's scaler as a `ReplayedScaler` that
    follows `decisions` (each step's skip: True = skipped) -- results.check's one-process
    reference replays a mesh run's. None: the plain scaler. Yields the list of the
    scalers made inside (to read their own verdicts after)."""
    _REPLAY.append(decisions)
    _MADE.append([])
    try:
        yield _MADE[-1]
    finally:
        _REPLAY.pop()
        _MADE.pop()


def make_scaler(mixed: str | None, scale: float = 65536.0, window: int = 1000
                ) -> LossScaler:
    """The scaler `train` uses: dynamic for fp16, S = 1 for ever for bf16 and full
    precision (bf16 has float32's range: nothing to rescue). Inside `replaying`, fp16's
    follows the decisions it was handed (`ReplayedScaler`)."""
    if mixed == "fp16" and _REPLAY[-1] is not None:
        _MADE[-1].append(ReplayedScaler(scale, window, _REPLAY[-1]))
        return _MADE[-1][-1]
    if mixed == "fp16":
        return LossScaler(scale, window)
    return LossScaler(1.0, 0, static=True)


def is_power_of_two(x: float) -> bool:
    """Is x = 2^k for an integer k (k may be negative)?"""
    mantissa, _ = np.frexp(float(x))
    return float(x) > 0 and np.isfinite(x) and mantissa == 0.5


def nonfinite(arrays: list[np.ndarray]) -> bool:
    """Does any of the arrays hold an inf or a NaN? (this rank's verdict, before the
    MAX-Allreduce that makes it every rank's). Under `replaying`, the largest finite
    |value| is kept too, for the `ReplayedScaler`'s margin."""
    if _REPLAY[-1] is not None:
        _LARGEST[0] = largest_finite(arrays)
    return any(a.size and not np.isfinite(a).all() for a in arrays)


def largest_finite(arrays: list[np.ndarray]) -> float:
    """The largest |value| among the finite numbers of the arrays (0 if none): how far a
    gradient was from overflowing, once multiplied by S."""
    out = 0.0
    for a in arrays:
        finite = np.abs(a[np.isfinite(a)]) if a.size else a
        if finite.size:
            out = max(out, float(np.max(finite)))
    return out
