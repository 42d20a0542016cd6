"""Deterministic synthetic data, and how a global batch is cut across ranks.

What this file teaches: every rank can *compute* its rows of the global batch
of a step from (seed, step) alone, so no data ever has to be sent. Each row i of
the global batch is drawn from its own random stream (seed, step, i): a rank
draws only the rows it holds (`rows=`), without the rest, and gets exactly the
numbers those rows have in the global batch (docs/design.md, "The reference
model", Data). The rule (same section): the global batch of B rows is cut into M
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
import hashlib
import os

import numpy as np

_TEACHER_STREAM = 2**31 - 1  # a step number no run reaches: the teacher's own stream


@functools.lru_cache(maxsize=8)
def _teacher(seed: int, d_in: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, _TEACHER_STREAM])
    hidden = 2 * classes
    return (rng.normal(size=(d_in, hidden)) / np.sqrt(d_in),
            rng.normal(size=(hidden, classes)) / np.sqrt(hidden))


def _row_streams(seed: int, step: int, batch: int, rows: np.ndarray | None
                 ) -> list[np.random.Generator]:
    """One generator per requested row of the global batch: row i's stream is
    (seed, step, i), whoever draws it and whatever else is drawn with it."""
    wanted = range(batch) if rows is None else rows
    return [np.random.default_rng([seed, step, int(i)]) for i in wanted]


def make_batch(seed: int, step: int, batch: int, d_in: int, classes: int,
               dtype: np.dtype | str = np.float64, rows: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step` (0-based): x (B, d_in), integer labels y (B,);
    with `rows` (indices into the B rows) only those rows, in that order, bitwise
    equal to `make_batch(...)[0][rows]` -- each row has its own stream.

    Depends on (seed, step) only, so a resumed run sees the same data.
    """
    x = np.stack([rng.normal(size=d_in) for rng in _row_streams(seed, step, batch, rows)])
    w1, w2 = _teacher(seed, d_in, classes)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)  # row by row: the teacher's label of each row
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


def rank_rows(batch: int, microbatches: int, dp: int, dp_rank: int) -> np.ndarray:
    """Every row of the global batch that data-parallel rank `dp_rank` holds, microbatch
    after microbatch: (B/dp,) indices. Its rows of microbatch m are then the m-th run of
    B/(M dp) of them (`local_rows`)."""
    return np.concatenate([np.arange(batch)[shard_rows(batch, microbatches, dp, m, dp_rank)]
                           for m in range(microbatches)])


def local_rows(batch: int, microbatches: int, dp: int, microbatch: int) -> slice:
    """Where microbatch `microbatch` sits in a rank's own rows (those of `rank_rows`)."""
    size = batch // microbatches // dp
    return slice(microbatch * size, (microbatch + 1) * size)


# ------------------------------------------------------------- sequences
def make_sequences(seed: int, step: int, batch: int, seq_len: int, vocab: int,
                   rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The copy task: x, y (B, T) token ids; y[:, t] = x[:, t + 1], the next token.

    Each sequence of T+1 tokens is a random first half (H = ceil((T+1)/2) uniform tokens)
    followed by the same tokens again. The positions t >= H-1 (`repeated_positions`)
    predict a token seen H positions earlier: their loss can fall below log V only once
    attention has learned to look back; the others stay at log V. Each sequence has its
    own stream (seed, step, row), so `rows` gives only those rows, as in `make_batch`."""
    half = (seq_len + 2) // 2
    first = np.stack([rng.integers(0, vocab, size=half)
                      for rng in _row_streams(seed, step, batch, rows)])
    sequence = np.concatenate([first, first], axis=1)[:, :seq_len + 1]   # (B, T+1)
    return sequence[:, :-1].astype(np.int64), sequence[:, 1:].astype(np.int64)


def repeated_positions(seq_len: int) -> np.ndarray:
    """(T,) booleans: the positions of the copy task whose next token repeats an earlier one."""
    return np.arange(seq_len) >= (seq_len + 2) // 2 - 1


DATA_LIMIT = 16 * 2**30      # --data files beyond this are refused before any reading
MEMMAP_FROM = 64 * 2**20     # ... and from this size on mapped, not read: the windows a
                             # step takes touch a few pages, never the whole file


@functools.lru_cache(maxsize=4)
def read_corpus(path: str) -> np.ndarray:
    """The bytes of a text file as token ids 0..255 (uint8), read once per process; a
    large file is memory-mapped (`np.memmap`), so only the windows drawn are read."""
    if os.path.getsize(path) >= MEMMAP_FROM:
        return np.memmap(path, dtype=np.uint8, mode="r")
    return np.fromfile(path, dtype=np.uint8)


def corpus_digest(path: str) -> str:
    """The sha256 of the file's bytes (what a checkpoint records of `--data`, so a resume
    compares contents, not how the path was spelled); computed once per file version."""
    state = os.stat(path)
    return _digest(os.path.realpath(path), state.st_size, state.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def corpus_problem(path: str, seq_len: int) -> str | None:
    """Why `--data path` cannot give windows of T+1 bytes, or None if it can: no file, a
    dangling link, not a regular file, empty, shorter than one window, larger than
    DATA_LIMIT (checked by its size alone, before any byte is read)."""
    if not os.path.exists(path):
        if os.path.islink(path):
            return f"--data {path}: a link to {os.readlink(path)}, which does not exist"
        return f"--data {path}: no such file"
    if not os.path.isfile(path):
        return f"--data {path}: not a file"
    try:
        size = os.path.getsize(path)
        with open(path, "rb"):
            pass
    except OSError as error:
        return f"--data {path}: cannot be read ({error.strerror})"
    if size == 0:
        return f"--data {path}: the file is empty"
    if size > DATA_LIMIT:
        return (f"--data {path}: {size / 2**30:.3g} GiB is more than the "
                f"{DATA_LIMIT / 2**30:.3g} GiB minipar reads as a corpus: take a part of it "
                "(head -c)")
    if size < seq_len + 1:
        return (f"--data {path}: {size} bytes is shorter than one window of --seq-len + 1 = "
                f"{seq_len + 1} bytes")
    return None


def make_text_windows(path: str, seed: int, step: int, batch: int, seq_len: int,
                      rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """B windows of T+1 consecutive bytes of the file, starts drawn from (seed, step, row):
    x = window[:, :T], y = window[:, 1:] (B, T), byte values as token ids (V = 256);
    with `rows`, only those windows, as in `make_batch`."""
    corpus = read_corpus(path)
    starts = np.array([rng.integers(0, corpus.size - seq_len)            # window fits
                       for rng in _row_streams(seed, step, batch, rows)])
    windows = corpus[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]
