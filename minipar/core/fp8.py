"""FP8 matmuls by hand: `train --mixed bf16 --fp8 {tensorwise,rowwise,blockwise}`.

What this file teaches (docs/design.md, "FP8"). An 8-bit float keeps 4 (e4m3) or 3
(e5m2) bits of significand and a tiny range, so a tensor is stored as q = round(x / s)
with a *scale* s chosen so its largest magnitude lands on the format's largest number:

    e4m3  max 448     u = 2^-4   activations and weights (forward inputs)
    e5m2  max 57344   u = 2^-3   output gradients in backward (--fp8-grad e4m3 keeps e4m3)

    s = amax / fmax over a *scaling group* (s = 1 where amax is 0)
    Q(x) = s * saturate(round(x / s))          (quantize, then dequantize)

The blocks' matmuls (q/k/v/proj, fc1/fc2, the experts') run on Q of their operands,
Y = Q(X) Q(W), dX = Q(dY) Q(W)^T, dW = Q(X)^T Q(dY), with the products summed in the
master dtype and rounded to bf16 as `--mixed` does (an FP8 tensor core with fp32
accumulation). The groups (`RECIPES`):

    tensorwise  one s for the whole tensor                      (torchtitan's default)
    rowwise     one s per row of X or dY, per output column of W
    blockwise   one s per 1 x B tile of X or dY along the contraction dimension,
                per B x B block of W                            (DeepSeek-V3, B = 128)

A group is one of the *unsharded* tensor: over a mesh, a group that spans shards gets
its amax by an Allreduce(MAX) over the axis that cuts it (`Recipe.agree`); all of a
step's weight amaxes travel in one call (`Recipe.begin_step`). A blockwise block never
spans a shard: every shard size must be a multiple of B (`block_problems`).

Everything here is vectorized: a group's amax is a max over an axis of a reshaped view.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from minipar.core import precision
from minipar.core.divisors import divisors as factored_divisors

RECIPES = ("tensorwise", "rowwise", "blockwise")
GRAD_FORMATS = ("e5m2", "e4m3")
FMAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
UNIT_ROUNDOFF: dict[str, float] = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
# the layers whose matmuls run in 8 bits (DeepSeek-V3's list); embedding, head, router stay
BLOCK_WEIGHTS = ("q.weight", "k.weight", "v.weight", "proj.weight", "fc1.weight", "fc2.weight")


def fp8_dtype(fmt: str) -> np.dtype:
    """`e4m3` -> ml_dtypes.float8_e4m3fn, `e5m2` -> ml_dtypes.float8_e5m2."""
    import ml_dtypes

    return np.dtype({"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt])


# ------------------------------------------------------------ the groups
def group_view(x: np.ndarray, recipe: str, kind: str, block: int) -> np.ndarray:
    """x (2-D) reshaped so that each scaling group is the set of elements sharing the
    indices of the axes `group_axes` leaves: a view, no copy.

    kind `act` (X or dY, (rows, features)): rowwise (rows, features); blockwise
    (rows, features / B, B). kind `weight` (W, (in, out)): rowwise (in, out), each
    output column a group; blockwise (in / B, B, out / B, B). A size that is not a
    multiple of B is padded with zeros first (a copy; zeros change no amax)."""
    if recipe != "blockwise":
        return x
    if kind == "act":
        x = _pad(x, (x.shape[0], -(-x.shape[1] // block) * block))
        return x.reshape(x.shape[0], x.shape[1] // block, block)
    x = _pad(x, tuple(-(-n // block) * block for n in x.shape))
    return x.reshape(x.shape[0] // block, block, x.shape[1] // block, block)


def _pad(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """x with zeros appended up to `shape` (x itself when it has that shape)."""
    if x.shape == shape:
        return x
    out = np.zeros(shape, dtype=x.dtype)
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def group_axes(recipe: str, kind: str) -> tuple[int, ...]:
    """The axes of `group_view` that a group's amax is taken over."""
    if recipe == "tensorwise":
        return (0, 1)
    if recipe == "rowwise":
        return (1,) if kind == "act" else (0,)
    return (2,) if kind == "act" else (1, 3)


def amax(x: np.ndarray, recipe: str, kind: str, block: int) -> np.ndarray:
    """The largest |x| of every scaling group of x, in float32, shaped to broadcast
    against `group_view(x)` (keepdims)."""
    view = group_view(x, recipe, kind, block)
    if not view.size:   # a shard holding nothing of the tensor: its amax counts as 0
        shape = [1 if a in group_axes(recipe, kind) else n for a, n in enumerate(view.shape)]
        return np.zeros(shape, dtype=np.float32)
    return np.abs(view).max(axis=group_axes(recipe, kind), keepdims=True).astype(np.float32)


def scale_of(amaxes: np.ndarray, fmt: str) -> np.ndarray:
    """s = amax / fmax (float32), and 1 where amax is 0 (an all-zero group)."""
    amaxes = np.asarray(amaxes, dtype=np.float32)
    return np.where(amaxes > 0, amaxes / np.float32(FMAX[fmt]), np.float32(1.0))


def quantize(x: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
    """q = round(x / s) in the 8-bit format, saturating at +-fmax (ml_dtypes would turn
    an e4m3 overflow into NaN). x and s broadcast (s: per group, `group_view`'s shape)."""
    top = np.float32(FMAX[fmt])
    return np.clip(x.astype(np.float32) / scale, -top, top).astype(fp8_dtype(fmt))


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q * s in float32: what the matmul multiplies."""
    return widened(q) * scale


@functools.cache
def _values(dtype: np.dtype) -> np.ndarray:
    """The float32 value of each of an 8-bit format's 256 codes (ml_dtypes' own cast)."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def widened(q: np.ndarray) -> np.ndarray:
    """8-bit numbers as float32, exactly: each byte looked up among its format's 256
    values (the same bits as ml_dtypes' cast, which converts element by element and
    takes about three times as long)."""
    return _values(q.dtype)[q.view(np.uint8)]


def fake_quantize(x: np.ndarray, recipe: str, kind: str, fmt: str, block: int,
                  amaxes: np.ndarray | None = None) -> np.ndarray:
    """Q(x): x quantized group by group and dequantized (float32, x's shape). `amaxes`:
    the groups' agreed amax (over a mesh), else x's own."""
    view = group_view(x, recipe, kind, block)
    amaxes = amax(x, recipe, kind, block) if amaxes is None else amaxes
    scale = scale_of(amaxes, fmt)
    out = dequantize(quantize(view, scale, fmt), scale)
    a, b, *rest = view.shape    # back to 2-D (padded): (N, F) or (in, out); N may be 0
    shape = {2: (a, b), 3: (a, b * (rest or [1])[0]), 4: (a * b, int(np.prod(rest)))}
    return out.reshape(shape[view.ndim])[:x.shape[0], :x.shape[1]]


# ------------------------------------------------------------ the recipe
class Exact(precision.Widened):
    """An operand already in the form a matmul multiplies (a dequantized FP8 tensor):
    precision.matmul takes its `values` as they are, without rounding them to bf16."""

    __slots__ = ()


Agree = Callable[[np.ndarray, str], np.ndarray]   # (amaxes, axis) -> their MAX over the axis


@dataclass
class Recipe:
    """One run's FP8 recipe: the scaling groups (`name`, `block`), the gradients' format,
    and over a mesh how amaxes are agreed (`agree`, the axes each operand is cut along).

    A strategy never asks "is this fp8?": it hands the recipe the axis that cuts a
    tensor's groups (`cut_axis`: from the weight's place, a Parameter's `full_index`),
    and `agree` does the Allreduce(MAX) over that axis (None in one process)."""

    name: str
    block: int = 128
    grad_format: str = "e5m2"
    agree: Agree | None = None
    weight_amax: dict[str, np.ndarray] = field(default_factory=dict)
    allgather: bool = False  # --fp8-allgather: ZeRO-3 gathers the weights in 8 bits

    def covers(self, weight: object) -> bool:
        """Is `weight` (a Parameter) one whose matmuls run in 8 bits?"""
        return getattr(weight, "name", "").endswith(BLOCK_WEIGHTS)

    def begin_step(self, weights: Iterable[object]) -> None:
        """The step's weight amaxes, every group that spans a shard agreed in ONE
        Allreduce(MAX) over the axis cutting them (tp): called once a step before the
        forward, the weights fixed until the update."""
        # (ZeRO-3 drops a weight between its uses: it is whole when gathered, and its
        # amax is then taken from the whole, in `operand`)
        mine = [w for w in weights if self.covers(w) and w.data is not None
                and w.data.ndim == 2 and w.data.size]
        self.weight_amax = {w.name: amax(w.data, self.name, "weight", self.block)
                            for w in mine}
        spans = [w for w in mine if self.weight_spans(w)]
        if self.agree is None or not spans:
            return
        flat = np.concatenate([self.weight_amax[w.name].ravel() for w in spans])
        flat = self.agree(flat, "tp")
        at = 0
        for w in spans:
            n = self.weight_amax[w.name].size
            self.weight_amax[w.name] = flat[at:at + n].reshape(self.weight_amax[w.name].shape)
            at += n

    def begin_sliced_step(self, spaces: Iterable[tuple[list, list, Agree]]) -> None:
        """ZeRO-3's weights, once a step: each rank holds only a flat slice of them, cut
        anywhere -- a group (even a B x B block) may straddle two slices, or lie in
        another rank's. Each `(params, pieces, agree)` of `spaces` is one flat vector:
        its parameters, the boxes of them my slice holds as (param, box, |values|), and
        the MAX over its replicas (dp; experts' edp). A group's amax from my part of it
        (0 where I hold none), then ONE Allreduce(MAX) a vector: my tp shard's. Under tp
        a shard is itself a piece of the weight: the groups spanning the tp shards
        (`weight_spans`) then take ONE more Allreduce(MAX) over tp, all weights in it, as
        in `begin_step`: the unsharded weight's."""
        self.weight_amax = {}
        spans = []
        for params, pieces, agree in spaces:
            mine = [p for p in params if self.covers(p)]
            if not mine:
                continue
            held = {p.name: np.zeros(p.shape, dtype=np.float32) for p in mine}
            for p, box, values in pieces:
                if p.name in held:
                    held[p.name][box] = values
            amaxes = {name: amax(whole, self.name, "weight", self.block)
                      for name, whole in held.items()}
            flat = agree(np.concatenate([a.ravel() for a in amaxes.values()]))
            at = 0
            for name, a in amaxes.items():
                self.weight_amax[name] = flat[at:at + a.size].reshape(a.shape)
                at += a.size
            spans += [p.name for p in mine if self.weight_spans(p)]
        if self.agree is None or not spans:
            return
        flat = self.agree(np.concatenate([self.weight_amax[n].ravel() for n in spans]), "tp")
        at = 0
        for name in spans:
            n = self.weight_amax[name].size
            self.weight_amax[name] = flat[at:at + n].reshape(self.weight_amax[name].shape)
            at += n

    def weight_spans(self, weight: object) -> bool:
        """Does a scaling group of this weight span its tp shards? Tensorwise: whenever
        it is cut; rowwise (output columns): when its rows (inputs) are cut; blockwise:
        never (a shard is a multiple of B)."""
        in_cut, out_cut = cuts(weight)
        if self.name == "tensorwise":
            return in_cut or out_cut
        return self.name == "rowwise" and in_cut

    def operand(self, x: np.ndarray, kind: str, weight: object) -> Exact:
        """Q(x) of one operand of `weight`'s matmuls: kind `x` (the input), `dy` (the
        output gradient) or `weight`, in the master dtype for the product."""
        fmt = self.grad_format if kind == "dy" else "e4m3"
        if kind == "weight":   # the step's agreed amaxes (else, one process: its own)
            agreed = self.weight_amax.get(weight.name)
            out = fake_quantize(x, self.name, "weight", fmt, self.block, agreed)
            return Exact(precision.widen(out, precision.MASTER))
        in_cut, out_cut = cuts(weight)
        features_cut = in_cut if kind == "x" else out_cut   # X (N, in), dY (N, out)
        groups = None
        if self.agree is not None and self.name != "blockwise":  # a 1 x B tile: in a shard
            groups = amax(x, self.name, "act", self.block)
            if features_cut:   # a row (or the tensor) spans the tp shards of its features
                groups = self.agree(groups, "tp")
            if self.name == "tensorwise":   # the rows: the batch's positions, cut over
                # the weight's replicas -- dp (an expert's edp) and cp, which cuts each
                # sequence's positions (mesh.py's dp_cp, edp_cp: dp's ranks without cp)
                groups = self.agree(groups, (getattr(weight, "sync", None) or "dp") + "_cp")
        out = fake_quantize(x, self.name, "act", fmt, self.block, groups)
        return Exact(precision.widen(out, precision.MASTER))


def cuts(weight: object) -> tuple[bool, bool]:
    """(in cut, out cut): does this rank hold only some rows / some columns of the
    weight (its `full_index`, tensor_parallel.py's column and row shards)?"""
    index = getattr(weight, "full_index", None)
    if index is None or len(index) != 2:
        return False, False
    return index[0] != slice(None), index[1] != slice(None)


# ------------------------------------------------------------ refusals
def tiled_sizes(cfg: object) -> dict[str, int]:
    """The sizes a blockwise recipe tiles on each rank: every dimension of an 8-bit
    matmul's local weight shard (a B x B block) and so of its X and dY (1 x B tiles)."""
    tp = getattr(cfg, "tp", 1)
    sizes = {"d_model": cfg.d_model}
    if cfg.model in ("gpt", "gpt-moe"):
        sizes["d_model / tp (the attention's heads)"] = cfg.d_model // tp
    if cfg.model in ("mlp", "gpt"):
        sizes["d_ff / tp"] = cfg.d_ff // tp
    elif cfg.model == "moe" and tp > 1:   # the MLP MoE splits each expert over tp
        sizes["expert_d_ff / tp"] = cfg.expert_d_ff // tp
    else:   # every block of an MoE model is one (routed and shared experts alike)
        sizes["expert_d_ff"] = cfg.expert_d_ff
    return sizes


def nearest_blocks(sizes: Iterable[int], block: int) -> list[int]:
    """The block sizes nearest to `block` (one below, one above) that divide every size:
    from the divisors of their gcd by its prime factors (core/divisors.py), not by trying
    every b up to it (a width of 10^12 took seconds). Past 2^53 (no machine's width,
    refused by its size anyway) none is named."""
    g = math.gcd(*(int(n) for n in sizes))
    if not 0 < g <= 2**53:
        return []
    divisors = factored_divisors(g)
    below = [b for b in divisors if b < block]
    above = [b for b in divisors if b > block]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def block_problems(cfg: object) -> list[str]:
    """--fp8 blockwise: every size it tiles must be a multiple of --fp8-block (a block
    spanning two shards would have no owner)."""
    if getattr(cfg, "fp8", None) != "blockwise":
        return []
    sizes = tiled_sizes(cfg)
    bad = {name: n for name, n in sizes.items() if n % cfg.fp8_block}
    if not bad:
        return []
    works = " or ".join(str(b) for b in nearest_blocks(sizes.values(), cfg.fp8_block))
    what = ", ".join(f"{name} = {n}" for name, n in bad.items())
    return [f"--fp8-block {cfg.fp8_block} does not divide {what}: a block would straddle a "
            "shard" + (f"; the nearest sizes that work: --fp8-block {works}" if works else "")]


def problems(cfg: object) -> list[str]:
    """--fp8 and its flags: a known recipe, on top of --mixed bf16, a positive block that
    divides every shard, a known gradient format, and strategies this round supports."""
    out = []
    if cfg.fp8_allgather and (cfg.fp8 is None or cfg.zero != 3):
        out.append("--fp8-allgather gathers ZeRO-3's weights in 8 bits: it needs --fp8 and "
                   f"--zero 3 (got {'no --fp8' if cfg.fp8 is None else f'--zero {cfg.zero}'})")
    if cfg.fp8 is None:
        for flag, default in (("fp8_block", 128), ("fp8_grad", "e5m2")):
            if getattr(cfg, flag) != default:
                out.append(f"--{flag.replace('_', '-')} applies to --fp8 only")
        return out
    if cfg.fp8 not in RECIPES:
        return [f"--fp8 must be one of {', '.join(RECIPES)} (got {cfg.fp8})"]
    if cfg.mixed != "bf16":
        return [f"--fp8 {cfg.fp8} runs on top of --mixed bf16 (got "
                f"{'no --mixed' if cfg.mixed is None else '--mixed ' + cfg.mixed})"]
    if cfg.fp8_grad not in GRAD_FORMATS:
        return [f"--fp8-grad must be one of {', '.join(GRAD_FORMATS)} (got {cfg.fp8_grad})"]
    if cfg.fp8_block < 1:
        return [f"--fp8-block must be at least 1 (got {cfg.fp8_block})"]
    return out + block_problems(cfg)


def recipe_of(cfg: object) -> Recipe | None:
    """The one-process recipe of a run (None without --fp8): no mesh, nothing agreed."""
    return None if getattr(cfg, "fp8", None) is None else \
        Recipe(cfg.fp8, cfg.fp8_block, cfg.fp8_grad, allgather=cfg.fp8_allgather)


# ------------------------------------------------------- 8-bit words on the wire
def word_bytes(recipe: Recipe, names: list[str], layout: object) -> np.ndarray:
    """Bytes each element of a ZeRO flat vector takes on the wire under --fp8-allgather:
    1 (an e4m3 word) for the 8-bit weights' elements, 2 (bf16) for the rest (biases,
    norms, embeddings, the head, routers)."""
    out = np.full(layout.total, 2, dtype=np.int64)
    for name, offset, size in zip(names, layout.offsets, layout.sizes):
        if name.endswith(BLOCK_WEIGHTS):
            out[offset:offset + size] = 1
    return out


def element_scales(recipe: Recipe, names: list[str], layout: object, a: int, b: int
                   ) -> np.ndarray:
    """The scale of every element of the flat range [a, b) (float32; 1 where the element
    is not an 8-bit weight's): its group's, from the step's agreed amaxes."""
    out = np.ones(b - a, dtype=np.float32)
    for name, offset, size, shape in zip(names, layout.offsets, layout.sizes, layout.shapes):
        lo, hi = max(a, offset), min(b, offset + size)
        if lo >= hi or not name.endswith(BLOCK_WEIGHTS):
            continue
        scales = scale_of(recipe.weight_amax[name], "e4m3")
        rows, cols = np.divmod(np.arange(lo - offset, hi - offset), shape[1])
        if recipe.name == "tensorwise":
            picked = np.broadcast_to(scales.ravel()[0], rows.shape)
        elif recipe.name == "rowwise":
            picked = scales.reshape(-1)[cols]
        else:
            picked = scales[rows // recipe.block, 0, cols // recipe.block, 0]
        out[lo - a:hi - a] = picked
    return out


def encode(values: np.ndarray, widths: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """16-bit values as wire bytes: an element of width 1 quantized to one e4m3 byte with
    its scale, one of width 2 as its two bf16 bytes (little end first)."""
    out = np.empty(int(widths.sum()), dtype=np.uint8)
    at = np.cumsum(widths) - widths
    eight = widths == 1
    out[at[eight]] = quantize(values[eight].astype(np.float32), scales[eight],
                              "e4m3").view(np.uint8)
    words = values[~eight].view(np.uint16)
    out[at[~eight]] = (words & 0xFF).astype(np.uint8)
    out[at[~eight] + 1] = (words >> 8).astype(np.uint8)
    return out


def decode(data: np.ndarray, widths: np.ndarray, scales: np.ndarray, dtype: np.dtype
           ) -> np.ndarray:
    """`encode`'s inverse into `dtype` (bf16): an e4m3 byte dequantized (q s, rounded to
    bf16: requantized with the same s it gives q back), two bytes the bf16 itself."""
    out = np.empty(len(widths), dtype=dtype)
    at = np.cumsum(widths) - widths
    eight = widths == 1
    q = widened(data[at[eight]].view(fp8_dtype("e4m3")))
    out[eight] = (q * scales[eight]).astype(dtype)
    words = data[at[~eight]].astype(np.uint16) | (data[at[~eight] + 1].astype(np.uint16) << 8)
    out[~eight] = words.view(dtype)
    return out
