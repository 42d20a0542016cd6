"""Ragged batches: one document a row, padded, and a loss over the valid positions only.

What this file teaches: real text comes in documents of different lengths. With
`--data PATH --documents` the file's documents (split at blank lines) are the rows
of a batch, each a window of at most T+1 bytes of one document; a shorter one is
padded with id 0 and its padded positions carry a loss mask of 0. The batch is now
ragged in *valid tokens*: two ranks, two microbatches, two halves of a sequence
over cp hold different numbers of them. The loss is

    L = sum over valid positions of CE  /  N,   N = valid positions of the GLOBAL batch

(every microbatch, every dp x cp rank). A rank knows only its own count
(`valid_positions`), so N costs one Allreduce of one number per step over the dp x cp
ranks, before backward (run/mesh_step.py, `train_step`). Dividing
by anything else -- each microbatch's own count, each rank's own count -- weights
the tokens of a short microbatch more than those of a long one: the classic silent
bug of gradient accumulation (`--inject-bug loss-mean-per-microbatch`, lesson 08).

How the mask travels: inside a run the labels of padded positions are `IGNORE`
(-1), so the mask rides along with y through every split (dp rows, cp positions,
pipeline microbatches) with no new plumbing; the cross-entropies (core/fused_layers.py,
vocab_parallel.py) give such positions zero loss and zero gradient, and take the
mean over *all* the positions they see. `loss_weight` turns that mean into the
masked one: a rank's CE term is multiplied by P / N (P the global batch's
positions, B T), which is exactly what makes the sum of every rank's share,
divided by dp cp as the gradient sync does, equal to L. `data.npz` of `--dump`
stores y padded with 0 and the mask beside it (`mask` (S, B, T)).
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np

from minipar.core.data import read_corpus, row_uniforms

IGNORE = -1   # the label of a padded position inside a run: no loss, no gradient
_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n")   # what separates two documents


@functools.lru_cache(maxsize=4)
def read_documents(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) in bytes of the file's documents of at least 2 bytes (one
    input and its next byte), in file order. Documents are split at blank lines
    (a line holding only spaces, tabs or carriage returns counts as blank); the
    newlines around them are not part of either document."""
    data = read_corpus(path).tobytes()
    starts, lengths, at = [], [], 0
    for gap in [*_BLANK_LINE.finditer(data), None]:   # once per document: read once
        end = len(data) if gap is None else gap.start()
        text = data[at:end]
        stripped = text.strip(b"\n")
        if len(stripped) >= 2:
            starts.append(at + text.index(stripped))
            lengths.append(len(stripped))
        at = end if gap is None else gap.end()
    return np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)


def documents_problem(path: str) -> str | None:
    """Why `--data path --documents` cannot give rows, or None if it can."""
    if not os.path.isfile(path):
        return f"--data {path}: no such file"
    if read_documents(path)[0].size == 0:
        return (f"--data {path} --documents: no document of at least 2 bytes (documents "
                "are separated by blank lines; each row needs an input and its next byte)")
    return None


def make_documents(path: str, seed: int, step: int, batch: int, seq_len: int,
                   rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """B rows, each a window of at most T+1 bytes of one document, both drawn from
    (seed, step, row): x (B, T) padded with id 0, y (B, T) the next bytes with
    `IGNORE` at the padded positions (a window of n bytes has n - 1 valid ones).
    With `rows`, only those rows, as in `data.make_batch`."""
    corpus = read_corpus(path)
    starts, lengths = read_documents(path)
    u = row_uniforms(seed, step, batch, rows, 2)          # (B, 2): the document, the offset
    doc = np.minimum((u[:, 0] * starts.size).astype(np.int64), starts.size - 1)
    size = np.minimum(lengths[doc], seq_len + 1)                       # (B,) window bytes
    room = lengths[doc] - size + 1                                     # window starts
    first = starts[doc] + np.minimum((u[:, 1] * room).astype(np.int64), room - 1)
    offsets = np.arange(seq_len + 1)
    inside = offsets < size[:, None]                                   # (B, T+1)
    where = np.minimum(first[:, None] + offsets, corpus.size - 1)
    windows = np.where(inside, corpus[where], 0).astype(np.int64)      # padded with id 0
    return windows[:, :-1], np.where(inside[:, 1:], windows[:, 1:], IGNORE)


def split_mask(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels with `IGNORE` -> (y padded with 0, mask of 0/1): what `data.npz` stores."""
    mask = y != IGNORE
    return np.where(mask, y, 0), mask.astype(np.int8)


def valid_positions(y: np.ndarray) -> int:
    """How many positions of these labels count in the loss."""
    return int(np.count_nonzero(y != IGNORE))


def expected_ledger(replicas: int) -> dict[tuple[str, str], tuple[int, int]]:
    """What the masked loss adds to a step's ledger on dp x cp = `replicas` ranks:
    (group, op) -> (calls, elements), one Allreduce of the count over dp x cp (which
    the ledger names "dp"); nothing on one replica."""
    return {("dp", "Allreduce"): (1, 1)} if replicas > 1 else {}


def loss_weight(labels: np.ndarray, step_positions: int, step_valid: int) -> float:
    """The factor of a microbatch's mean CE (over all its positions, padded ones
    contributing 0) that makes it the masked loss: P / N, the global batch's positions
    over its valid ones -- the same for every microbatch and rank. `labels` are the
    microbatch's (a rank's share); the right factor does not depend on them."""
    return step_positions / step_valid
