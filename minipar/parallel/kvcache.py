"""The KV cache: attention for one new token without recomputing the prefix.

What this file teaches. A causal transformer's keys and values at position p depend on
tokens 0..p only, so once computed they never change. Generating token t+1, only the
newest position's q, k, v are new; the keys and values of the earlier positions are
read from the cache (Pope et al. 2022, "Efficiently Scaling Transformer Inference"):

    prefill   all P prompt positions at once: K, V of every position into the cache,
              attention as in training (causal by position)
    decode    one position p: q_p, k_p, v_p from the new token only; k_p, v_p appended;
              o_p = softmax(q_p K[0..p]^T / sqrt(dh)) V[0..p]

Per layer the cache holds K and V of shape (B, H, positions, dh): 2 L B H positions dh
numbers, the memory that grows with every token served. How the mesh splits it:

    tp   by heads: each rank holds its H/tp heads' K and V (the heads it computes)
    pp   by layers: each stage holds its L/pp layers' cache
    dp   by rows: each rank its B/dp sequences
    cp   by positions: each rank holds some positions; a query attends to each part
         alone, giving (o_r, lse_r), and the parts merge by log-sum-exp, exactly
         (the online softmax of Ring Attention and FlashAttention):
             L = logaddexp_r lse_r        o = sum_r exp(lse_r - L) o_r

`cached_attention` runs one transformer block's attention half (gpt.Attention or
tensor_parallel.TensorParallelAttention, whose own LayerNorm and linears it calls) on
the new positions, with the cache instead of the full prefix. Everything here runs
under autograd.no_grad: inference keeps no tape.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from minipar.core import attention, fused_layers
from minipar.core.autograd import Tensor

if TYPE_CHECKING:  # comm/collectives.py loads mpi4py.MPI; the one-process cache needs none
    from minipar.comm.collectives import Group


class LayerCache:
    """K and V of one layer for b rows: (b, heads, capacity, dh) arrays filled in order,
    with the global position of every slot (under cp a rank's positions are not 0..n-1).

    `capacity` is exactly the number of positions this rank will ever hold, so `nbytes`
    is the cache's full size, allocated once before the prompt."""

    def __init__(self, rows: int, heads: int, capacity: int, dh: int, dtype: np.dtype
                 ) -> None:
        self.k = np.zeros((rows, heads, capacity, dh), dtype=dtype)
        self.v = np.zeros((rows, heads, capacity, dh), dtype=dtype)
        self.positions = np.full(capacity, -1, dtype=np.int64)
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """Store K, V (b, heads, t, dh) of `positions` (t,) after the ones held."""
        t = k.shape[2]
        if self.length + t > self.k.shape[2]:
            raise ValueError(f"the cache holds {self.k.shape[2]} positions; "
                             f"{self.length} + {t} do not fit")
        where = slice(self.length, self.length + t)
        self.k[:, :, where], self.v[:, :, where] = k, v
        self.positions[where] = positions
        self.length += t

    def held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(K, V, positions) of the positions stored so far (views, no copy)."""
        n = self.length
        return self.k[:, :, :n], self.v[:, :, :n], self.positions[:n]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def cache_bytes(layers: int, rows: int, heads: int, positions: int, dh: int,
                itemsize: int) -> int:
    """The formula: K and V, per layer, of (rows, heads, positions, dh) numbers."""
    return 2 * layers * rows * heads * positions * dh * itemsize


def attend(Q: np.ndarray, K: np.ndarray, V: np.ndarray, q_positions: np.ndarray,
           k_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """softmax(mask(Q K^T / sqrt(dh))) V over the keys held, and each row's log-sum-exp.

    Q (b, H, tq, dh), K and V (b, H, tk, dh); the causal mask compares global positions
    (attention.allowed). A row that may see none of these keys gives o = 0 and
    lse = -inf, so merging it with other parts changes nothing."""
    scale = 1.0 / math.sqrt(Q.shape[-1])
    keep = attention.allowed(q_positions, k_positions)            # (tq, tk)
    S = np.where(keep, (Q @ np.swapaxes(K, -1, -2)) * scale, -np.inf)
    row_max = S.max(axis=-1, keepdims=True) if S.shape[-1] else \
        np.full(S.shape[:-1] + (1,), -np.inf)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    E = np.exp(S - row_max)
    total = E.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(total))[..., 0]                   # (b, H, tq)
    return (E @ V) / np.where(total > 0, total, 1.0), lse


def merge(outs: np.ndarray, lses: np.ndarray) -> np.ndarray:
    """The log-sum-exp merge of parts attended alone: outs (parts, b, H, t, dh), lses
    (parts, b, H, t) -> o (b, H, t, dh) = sum_r exp(lse_r - L) o_r, L = logaddexp_r lse_r."""
    total = np.logaddexp.reduce(lses, axis=0)
    safe = np.where(np.isfinite(total), total, 0.0)
    return (np.exp(lses - safe)[..., None] * outs).sum(axis=0)


def merge_over(group: Group, o: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """Decode under context parallelism: every cp rank attended the same query to its
    own positions; one Allgather of (o | lse), (b, H, t, dh + 1) per rank, and each
    rank merges all parts (the same sum on every rank, in the same order)."""
    packed = np.concatenate([o, lse[..., None]], axis=-1)
    parts = np.empty((group.size, *packed.shape), dtype=packed.dtype)
    group.Allgather(np.ascontiguousarray(packed), parts)   # my (o | lse) -> every cp rank
    return merge(parts[..., :-1], parts[..., -1])


def cached_attention(attn: object, h: Tensor, cache: LayerCache, positions: np.ndarray,
                     store: bool = True, cp: Group | None = None,
                     ring: object | None = None) -> Tensor:
    """h + proj(attention(LN1(h))) for the new positions of h (b, t, d), their keys and
    values added to `cache` (when `store`: under cp only the rank that owns a decoded
    position keeps it), attention over everything cached.

    `attn` is the block's attention half: its `ln`, `enter` (tp: Megatron's f), `q`,
    `k`, `v` and `proj` linears are called as in training, so tensor parallelism's
    split by heads (and proj's Allreduce) come with it; `attn.heads` are this rank's.
    Under context parallelism the prefill runs `ring` (the cp strategy's attention,
    context_parallel.ContextParallelAttention) on this rank's positions, and a decoded
    position attends to every rank's part of the cache, merged (`merge_over` on `cp`)."""
    heads = attn.heads
    a = attn.enter(attn.ln(h))                                    # (b, t, d)
    q, v = attn.q(a), attn.v(a)                                   # (b, t, H dh) each
    k = fused_layers.linear(a, attn.k.weight)                            # bk: added below
    keys = k.data + attn.k.bias.data                              # as attention.py does
    if store:
        cache.append(attention.split_heads(keys, heads), attention.split_heads(v.data, heads),
                     positions)
    if ring is not None:                                          # cp prefill: the ring
        o = ring(q, k, v, heads, key_bias=attn.k.bias).data       # (b, t, H dh)
    else:
        K, V, held = cache.held()
        part, lse = attend(attention.split_heads(q.data, heads), K, V, positions, held)
        if cp is not None and cp.size > 1:                        # cp decode: merge parts
            part = merge_over(cp, part, lse)
        o = attention.merge_heads(part)
    return h + attn.proj(Tensor(o))                               # (b, t, d)
