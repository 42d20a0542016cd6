"""Deterministic synthetic data, and how a global batch is cut across ranks.

What this file teaches: every rank can *compute* its rows of the global batch of a step
from (seed, step) alone, so no data ever has to be sent. Every number of the global
batch is a hash of (seed, step, row, column) -- counter-based, no generator state -- so
a rank draws only the rows it holds (`rows=`), all of them in one vectorized pass, and
gets exactly the numbers those rows have in the global batch (docs/design.md, "The
reference model", Data). The rule (same section): the global batch of B rows is cut into
M contiguous microbatches, and each microbatch into dp contiguous pieces, piece r to
data-parallel rank r. With M = 1, rank r holds rows r*B/dp .. (r+1)*B/dp - 1, as in the
source text's example (1024 rows on 8 ranks: 128 each).

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


# ------------------------------------------------- counter-based random numbers
# docs/design.md, Data: every number is a hash of (seed, step, row, column), so a
# rank computes the rows it holds -- all of them at once, vectorized -- and gets
# the bits they have in the global batch, whatever else it draws.
_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15          # the Weyl increment of splitmix64
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix_int(z: int) -> int:
    """splitmix64's finalizer on one Python integer (mod 2^64): the scalar keys."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """The same finalizer on a uint64 array, in place (products wrap mod 2^64)."""
    tmp = np.empty_like(z)
    np.right_shift(z, _S30, out=tmp)
    z ^= tmp
    z *= _M1
    np.right_shift(z, _S27, out=tmp)
    z ^= tmp
    z *= _M2
    np.right_shift(z, _S31, out=tmp)
    z ^= tmp
    return z


def _row_bits(seed: int, step: int, batch: int, rows: np.ndarray | None, count: int
              ) -> np.ndarray:
    """(rows, count) uint64: column c of row i is a hash of (seed, step, i, c) alone.

    Row i's key is mix(key(seed, step) + (i + 1) G); its column c is
    mix(row key + (c + 1) G) -- splitmix64's stream started at the row's key, every
    row computed at once."""
    base = _mix_int(_mix_int(seed * _GOLDEN + 1) + (step + 1) * _GOLDEN)
    wanted = np.arange(batch) if rows is None else np.asarray(rows)
    keys = wanted.astype(np.uint64) + np.uint64(1)
    keys *= np.uint64(_GOLDEN)
    keys += np.uint64(base)
    _mix(keys)
    columns = np.arange(1, count + 1, dtype=np.uint64)
    columns *= np.uint64(_GOLDEN)
    return _mix(keys[:, None] + columns)


def row_uniforms(seed: int, step: int, batch: int, rows: np.ndarray | None, count: int
                 ) -> np.ndarray:
    """(rows, count) float64 uniforms in [0, 1): the top 53 bits of each hash * 2^-53."""
    bits = _row_bits(seed, step, batch, rows, count)
    bits >>= np.uint64(11)
    uniforms = bits.astype(np.float64)
    uniforms *= 2.0**-53
    return uniforms


def row_integers(seed: int, step: int, batch: int, rows: np.ndarray | None, count: int,
                 high: int | np.ndarray) -> np.ndarray:
    """(rows, count) int64 in [0, high): floor(u * high) of `row_uniforms`; `high` one
    bound, or one per row ((rows, 1)). The bias is below high / 2^53."""
    scaled = row_uniforms(seed, step, batch, rows, count) * high
    return np.minimum(scaled.astype(np.int64), np.asarray(high) - 1)


def row_normals(seed: int, step: int, batch: int, rows: np.ndarray | None, count: int
                ) -> np.ndarray:
    """(rows, count) float64 standard normals by Box-Muller: columns 2k and 2k+1 of a row
    are r cos(theta) and r sin(theta) of ONE hash, counter k: its top 32 bits give
    u1 in (0, 1), r = sqrt(-2 ln u1); its low 32 bits u2, theta = 2 pi u2. The logarithm
    and the sine and cosine are evaluated in float32 (docs/design.md, Data: float64's are
    many times slower here), so each normal carries float32's relative precision, about
    1e-7 -- noise the synthetic task never sees."""
    pairs = (count + 1) // 2
    bits = _row_bits(seed, step, batch, rows, pairs)
    low = (bits & np.uint64(0xFFFFFFFF)).astype(np.float32)
    bits >>= np.uint64(32)
    radius = bits.astype(np.float32)
    radius += np.float32(0.5)
    radius *= np.float32(2.0**-32)                               # u1 in (0, 1]
    np.log(radius, out=radius)
    radius *= np.float32(-2.0)
    np.sqrt(radius, out=radius)
    low *= np.float32(2.0**-32 * 2 * np.pi)                      # theta in [0, 2 pi)
    out = np.empty((bits.shape[0], pairs, 2))
    np.multiply(radius, np.cos(low), out=out[..., 0])
    np.multiply(radius, np.sin(low), out=out[..., 1])
    return out.reshape(bits.shape[0], 2 * pairs)[:, :count]


def make_batch(seed: int, step: int, batch: int, d_in: int, classes: int,
               dtype: np.dtype | str = np.float64, rows: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step` (0-based): x (B, d_in), integer labels y (B,);
    with `rows` (indices into the B rows) only those rows, in that order, bitwise
    equal to `make_batch(...)[0][rows]` -- each row has its own stream.

    Depends on (seed, step) only, so a resumed run sees the same data.
    """
    x = row_normals(seed, step, batch, rows, d_in)
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
    first = row_integers(seed, step, batch, rows, half, vocab)
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
    starts = row_integers(seed, step, batch, rows, 1, corpus.size - seq_len)[:, 0]  # fits
    windows = corpus[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]
