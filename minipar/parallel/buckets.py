"""Gradients in contiguous buckets: one collective moves many parameters' gradients.

What this file teaches: a collective pays a latency per call, so many small gradients
are copied into one flat buffer (`pack`), moved by one call, and copied back scaled
(`unpack`). Bucketed and overlapped data parallelism (data_parallel.py) cut the
parameters into buckets of about `--bucket-size` elements in the order backward
finishes them (`make_buckets`); tensor parallelism (tensor_parallel.py) packs the
gradients replicated over tp for its one Allreduce the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minipar.core import precision
from minipar.core.nn import Parameter


def grad_or_zeros(p: Parameter) -> np.ndarray:
    """p.grad, or zeros if backward never reached p on this rank: every replica must
    send the same buffers, or the collectives of different ranks would not match."""
    if p.grad is None:
        p.grad = np.zeros(p.data.shape, dtype=precision.grad_dtype(p.data.dtype))
    return p.grad


def make_buckets(params: Sequence[Parameter], bucket_size: int) -> list[list[Parameter]]:
    """Cut the parameters into buckets of at most `bucket_size` elements (a larger
    parameter gets a bucket of its own), in reverse order: the last layer's
    gradients are ready first. A bucket holds parameters of one sync group."""
    buckets: list[list[Parameter]] = []
    for sync in ("dp", "edp"):
        current: list[Parameter] = []
        count = 0
        for p in reversed([p for p in params if p.sync == sync]):
            if current and count + p.data.size > bucket_size:
                buckets.append(current)
                current, count = [], 0
            current.append(p)
            count += p.data.size
        if current:
            buckets.append(current)
    return buckets


def flat_buffers(buckets: Sequence[Sequence[Parameter]]) -> list[np.ndarray | None]:
    """One flat buffer per bucket, allocated once and reused every step (no new
    allocation per step; a bucket's buffer is in flight at most once per step). A bucket
    of one parameter needs none: its gradient is already one contiguous array (`pack`)."""
    return [None if len(bucket) == 1 else
            np.empty(sum(p.data.size for p in bucket),   # --mixed: the main gradients'
                     dtype=precision.grad_dtype(np.result_type(*(p.data.dtype
                                                                 for p in bucket))))
            for bucket in buckets]


def pack(bucket: Sequence[Parameter], out: np.ndarray | None = None) -> np.ndarray:
    """The bucket's gradients, copied one after another into one flat buffer: `out`
    (from `flat_buffers`, reused) or a new one. One copy per gradient, no temporary.
    A bucket of one parameter is its gradient itself, seen flat: no copy at all (the
    large weights, a bucket each, cost the Allreduce alone)."""
    if len(bucket) == 1 and grad_or_zeros(bucket[0]).flags.c_contiguous:
        return bucket[0].grad.reshape(-1)                   # a view of p.grad
    if out is None:
        return np.concatenate([grad_or_zeros(p).ravel() for p in bucket])
    start = 0
    for p in bucket:
        grad = grad_or_zeros(p)
        out[start:start + grad.size].reshape(grad.shape)[...] = grad  # a view: one copy
        start += grad.size
    return out


def unpack(bucket: Sequence[Parameter], flat: np.ndarray, scale: float) -> None:
    """`scale * flat` back into the bucket's gradients (the inverse of `pack`), written
    straight into each p.grad: one pass, no temporary array (in place when `flat` is a
    view of the one gradient)."""
    if len(bucket) == 1 and np.shares_memory(flat, bucket[0].grad):
        if scale != 1.0:
            bucket[0].grad *= scale
        return
    start = 0
    for p in bucket:
        np.multiply(flat[start:start + p.grad.size].reshape(p.grad.shape), scale, out=p.grad)
        start += p.grad.size
