"""Muon priced (`plan --optimizer muon --muon-mode ...`): the bytes and the seconds Muon adds.

What this file teaches. Muon (docs/design.md "Muon") updates each block matrix by its
momentum made orthogonal: 5 Newton-Schulz iterations of A = X X^T, X <- a X + (b A +
c A A) X, on the WHOLE matrix. A mesh that cuts the matrix (tp's shards, ZeRO's slices
over dp) must pay for that in one of three ways, priced here per GPU and step:

  duplicated     every GPU gathers every matrix of its stage whole (fp32, over dp) and
                 runs every iteration itself;
  distributed    the tp shard is gathered over dp, then each iteration Allreduces the
                 Gram matrix over tp (a ring: 2 (tp - 1)/tp of it per GPU, bf16), and
                 the products are split over tp (A A is not);
  layer-sharded  one home GPU per matrix (longest-processing-time first) receives it
                 whole and sends the pieces back: the busiest home pays.

Momentum in fp32 (4 bytes), the iteration in bf16 (2 bytes), as torch runs it. The
wire bytes go to the plan's 'muon' wire column and, with the Newton-Schulz seconds at
the GPU's peak, after the pipeline (planner/search.py). Lesson 17 prints the three for
Llama 3 70B on 1024 H100s with `muon_modes`; the planner calls the same function.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from minipar.planner.presets import ModelShape

MODES = ("layer-sharded", "distributed", "duplicated")
NS_STEPS = 5          # Newton-Schulz iterations (core/muon.py)
MOMENTUM_BYTES = 4    # what is gathered: the fp32 momentum
GRAM_BYTES = 2        # what is summed: the bf16 Gram matrix

Matrix = tuple[tuple[int, int], bool]   # (rows, cols), columns split over tp?


@dataclass(frozen=True)
class MuonPrice:
    """One mode on the busiest GPU of a step: bytes it moves, their seconds on the
    links, the Newton-Schulz seconds at peak."""

    mode: str
    bytes: float
    wire_seconds: float
    compute_seconds: float


def layer_matrices(m: ModelShape) -> list[Matrix]:
    """One layer's block matrices as Muon sees them, (shape, columns split over tp):
    Q, K, V (column-parallel), the attention output (row-parallel), then the FFN's
    ffn_matrices - 1 column-parallel d x d_ff and its row-parallel d_ff x d."""
    hd = m.head_dim or m.d_model // m.heads
    d, q, kv = m.d_model, m.heads * hd, (m.kv_heads or m.heads) * hd
    ffn = [((d, m.d_ff), True)] * (m.ffn_matrices - 1) + [((m.d_ff, d), False)]
    return [((d, q), True), ((d, kv), True), ((d, kv), True), ((q, d), False), *ffn]


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """Newton-Schulz on a whole rows x cols matrix, run on its short side s (long l):
    per iteration X X^T (2 s s l), A A (2 s^3), (b A + c A A) X (2 s s l)."""
    short, long = min(rows, cols), max(rows, cols)
    return 2 * steps * (2 * short ** 2 * long + short ** 3)


def busiest_home(mats: list[Matrix], homes: int) -> list[Matrix]:
    """Layer-sharded: the matrices of the busiest home when `homes` GPUs take them
    largest first, each to the least loaded (longest-processing-time)."""
    if not mats:
        return []
    load: list[tuple[float, int]] = [(0.0, h) for h in range(min(homes, len(mats)))]
    held: dict[int, list[Matrix]] = {}
    for mat in sorted(mats, key=lambda x: -ns_flops(*x[0])):
        work, h = heapq.heappop(load)
        held.setdefault(h, []).append(mat)
        heapq.heappush(load, (work + ns_flops(*mat[0]), h))
    return held[max(load)[1]]


def muon_price(mats: list[Matrix], mode: str, tp: int, dp: int, flops: float, tp_bw: float,
               dp_bw: float, steps: int = NS_STEPS) -> MuonPrice:
    """`mode` for the block matrices `mats` of one pipeline stage, held by tp x dp GPUs
    (dp: all the stage's replicas), at `flops` FLOP/s and tp_bw, dp_bw bytes/s per GPU
    and direction. Raises ValueError for an unknown mode."""
    elems = sum(r * c for (r, c), _ in mats)
    if mode == "duplicated":   # every GPU receives every matrix (but its own piece)
        moved = MOMENTUM_BYTES * elems
        return MuonPrice(mode, moved, moved / dp_bw,
                         sum(ns_flops(*s, steps) for s, _ in mats) / flops)
    if mode == "distributed":
        gram = work = 0.0
        for (r, c), cols in mats:
            short, long = min(r, c), max(r, c)
            g = short if cols != (r > c) else long   # the Gram side the tp cut leaves whole
            gram += steps * 2 * (tp - 1) / tp * g * g * GRAM_BYTES
            work += 2 * steps * (2 * g * g * (short * long // g) / tp + g ** 3)
        shard = MOMENTUM_BYTES * elems / tp * (dp - 1) / dp
        return MuonPrice(mode, shard + gram, shard / dp_bw + gram / tp_bw, work / flops)
    if mode == "layer-sharded":   # the busiest home: its matrices in, their pieces out
        mine = busiest_home(mats, tp * dp)
        moved = 2 * MOMENTUM_BYTES * sum(r * c for (r, c), _ in mine)
        return MuonPrice(mode, moved, moved / dp_bw,
                         sum(ns_flops(*s, steps) for s, _ in mine) / flops)
    raise ValueError(f"--muon-mode must be one of {', '.join(MODES)} (got {mode!r})")


def muon_modes(m: ModelShape, layers: int, tp: int, dp: int, flops: float, tp_bw: float,
               dp_bw: float) -> list[MuonPrice]:
    """The three modes for `layers` layers of `m` on tp x dp GPUs (lesson 17's table)."""
    mats = layer_matrices(m) * layers
    return [muon_price(mats, mode, tp, dp, flops, tp_bw, dp_bw)
            for mode in ("duplicated", "distributed", "layer-sharded")]


def matrix_params(m: ModelShape) -> int:
    """Parameters of one layer's block matrices: those whose state is Muon's 1 number."""
    return sum(r * c for (r, c), _ in layer_matrices(m))
