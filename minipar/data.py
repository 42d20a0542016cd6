"""Deterministic synthetic data, and how a global batch is cut across ranks.

What this file teaches: every rank can *compute* the whole global batch of a
step from (seed, step) alone, so no data ever has to be sent; a rank then keeps
its rows. The rule (docs/design.md, "The reference model"): the global batch of B rows is cut into M
contiguous microbatches, and each microbatch into dp contiguous pieces, piece r
to data-parallel rank r. With M = 1, rank r holds rows r*B/dp .. (r+1)*B/dp - 1,
as in the source text's example (1024 rows on 8 ranks: 128 each).

The task is learnable: labels come from a fixed random two-layer "teacher"
network, so the loss visibly falls over a few hundred steps.

The transformer's batches are token sequences x (B, T) with their next tokens y (B, T):
either the synthetic copy task (`make_sequences`: the second half of each sequence
repeats its first, so only attention that looks back can predict it), or windows of
T+1 bytes of a text file (`--data PATH`, V = 256), the window starts drawn from
(seed, step) alone. Both are as deterministic as the MLP's batches.
"""

from __future__ import annotations

import functools
import os

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


# ------------------------------------------------------------- sequences
def make_sequences(seed: int, step: int, batch: int, seq_len: int, vocab: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The copy task: x, y (B, T) token ids; y[:, t] = x[:, t + 1], the next token.

    Each sequence of T+1 tokens is a random first half (H = ceil((T+1)/2) uniform tokens)
    followed by the same tokens again. The positions t >= H-1 (`repeated_positions`)
    predict a token seen H positions earlier: their loss can fall below log V only once
    attention has learned to look back; the others stay at log V."""
    rng = np.random.default_rng([seed, step])
    half = (seq_len + 2) // 2
    first = rng.integers(0, vocab, size=(batch, half))
    sequence = np.concatenate([first, first], axis=1)[:, :seq_len + 1]   # (B, T+1)
    return sequence[:, :-1].astype(np.int64), sequence[:, 1:].astype(np.int64)


def repeated_positions(seq_len: int) -> np.ndarray:
    """(T,) booleans: the positions of the copy task whose next token repeats an earlier one."""
    return np.arange(seq_len) >= (seq_len + 2) // 2 - 1


@functools.lru_cache(maxsize=4)
def read_corpus(path: str) -> np.ndarray:
    """The bytes of a text file as token ids 0..255 (uint8), read once per process."""
    return np.fromfile(path, dtype=np.uint8)


def corpus_problem(path: str, seq_len: int) -> str | None:
    """Why `--data path` cannot give windows of T+1 bytes, or None if it can."""
    if not os.path.exists(path):
        return f"--data {path}: no such file"
    if not os.path.isfile(path):
        return f"--data {path}: not a file"
    size = os.path.getsize(path)
    if size == 0:
        return f"--data {path}: the file is empty"
    if size < seq_len + 1:
        return (f"--data {path}: {size} bytes is shorter than one window of --seq-len + 1 = "
                f"{seq_len + 1} bytes")
    return None


def make_text_windows(path: str, seed: int, step: int, batch: int, seq_len: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """B windows of T+1 consecutive bytes of the file, starts drawn from (seed, step):
    x = window[:, :T], y = window[:, 1:] (B, T), byte values as token ids (V = 256)."""
    corpus = read_corpus(path)
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, corpus.size - seq_len, size=batch)         # window fits
    windows = corpus[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]
