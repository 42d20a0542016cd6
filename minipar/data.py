"""Deterministic synthetic data, and how a global batch is cut across ranks.

What this file teaches: every rank can *compute* the whole global batch of a
step from (seed, step) alone, so no data ever has to be sent; a rank then keeps
its rows. The rule (docs/design.md, "The reference model"): the global batch of B rows is cut into M
contiguous microbatches, and each microbatch into dp contiguous pieces, piece r
to data-parallel rank r. With M = 1, rank r holds rows r*B/dp .. (r+1)*B/dp - 1,
as in the source text's example (1024 rows on 8 ranks: 128 each).

The task is learnable: labels come from a fixed random two-layer "teacher"
network, so the loss visibly falls over a few hundred steps.
"""

from __future__ import annotations

import numpy as np

_TEACHER_STREAM = 2**31 - 1  # a step number no run reaches: the teacher's own stream


def _teacher(seed: int, d_in: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, _TEACHER_STREAM])
    hidden = 2 * classes
    return (rng.normal(size=(d_in, hidden)) / np.sqrt(d_in),
            rng.normal(size=(hidden, classes)) / np.sqrt(hidden))


def make_batch(seed: int, step: int, batch: int, d_in: int, classes: int,
               dtype: np.dtype | str = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step` (0-based): x (B, d_in), integer labels y (B,).

    Depends on (seed, step) only, so a resumed run sees the same data.
    """
    rng = np.random.default_rng([seed, step])
    x = rng.normal(size=(batch, d_in))
    w1, w2 = _teacher(seed, d_in, classes)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
    return x.astype(dtype), y.astype(np.int64)


def microbatch_rows(batch: int, microbatches: int, microbatch: int) -> slice:
    """Rows of the global batch in microbatch `microbatch` (contiguous)."""
    size = batch // microbatches
    return slice(microbatch * size, (microbatch + 1) * size)


def shard_rows(batch: int, microbatches: int, dp: int, microbatch: int, dp_rank: int) -> slice:
    """Rows of the global batch that data-parallel rank `dp_rank` holds in `microbatch`."""
    size = batch // microbatches // dp
    start = microbatch * (batch // microbatches) + dp_rank * size
    return slice(start, start + size)
