"""The transformer's own tape nodes: embedding lookup, the causal mask, and attention.

What this file teaches: a sequence model needs three ops the MLP never did, each one
node with its backward written beside it (as in core/fused_layers.py):

    embedding   out[b, t] = W[ids[b, t]]                  dW[v] = sum of g where ids == v
    causal_mask S[i, j] = -inf where key j comes after query i     dS = g where kept, else 0
    attention   O = softmax(mask(Q K^T / sqrt(dh))) V, all heads at once (B, H, T, dh)

`attention` is ONE node: the scores, the mask, the softmax and the weighted sum, with
the backward derived by hand (P the probabilities, G the gradient of O):

    dV = P^T G      dP = G V^T      dS = P * (dP - rowsum(dP * P))
    dQ = dS K / sqrt(dh)            dK = dS^T Q / sqrt(dh)

The mask is built from *global positions*, not from array indices: query i may see key
j when position(j) <= position(i). A rank that holds only some of the positions (context
parallelism) passes the positions it holds, and the same node stays correct. For the
same reason `attention_lse` gives the log-sum-exp of every score row, the number an
online softmax needs to merge the results of several blocks of keys (Ring Attention,
Liu et al. 2023; FlashAttention, Dao et al. 2022). A row that may see no key at all
(every key in its future) gives output 0 and log-sum-exp -inf, so such a merge is exact.

The key bias bk is taken by the node itself (`key_bias`): it adds q_i . bk to every
score of query row i, the same number for every key j, which the softmax ignores. So
d loss / d bk = 0 exactly, and the node says so. Left to the k linear, the gradient
would be a sum of terms that cancel -- rounding noise near 1e-17, different on every
mesh, which Adam would turn into updates.

Heads are an axis, never a Python loop: q, k, v arrive as (B, T, H*dh) -- the output of
the q, k, v linears -- and are viewed as (B, H, T, dh) inside the node.

The finite-difference checks of `tests/core/test_autograd.py` cover every op here.
"""

from __future__ import annotations

import math

import numpy as np

from minipar import placement as _pl
from minipar.core import precision as _mp
from minipar.core.autograd import Tensor


def _as16(x: np.ndarray) -> np.ndarray:
    """Under --mixed (core/precision.py): x rounded to 16 bits and held in the master
    dtype, a matmul operand whose products then sum in the master dtype. x itself
    without the policy."""
    return x if _mp.LOW is None else _mp.to_low(x).astype(_mp.MASTER)


# ------------------------------------------------------------- embedding
def rows_summed_by_id(rows: np.ndarray, ids: np.ndarray, like: np.ndarray) -> np.ndarray:
    """dW of a lookup: an array shaped like `like` (V, d) whose row v is the sum of the
    `rows` (N, d) whose `ids` (N,) equal v. Vectorized: sort by id, then one
    `np.add.reduceat` sums each run of equal ids (no loop over tokens)."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    full = np.zeros_like(like)
    if ids.size:
        full[sorted_ids[starts]] = np.add.reduceat(rows[order], starts, axis=0)
    return full


def embedding(weight: Tensor, ids: Tensor | np.ndarray) -> Tensor:
    """weight[ids]: one row of `weight` (V, d) per id; ids of any shape -> ids.shape + (d,).

    Backward: the rows' gradients are scatter-added into dW, an id seen twice getting the
    sum. Vectorized: sort the positions by id, then one `np.add.reduceat` sums each run of
    equal ids (no loop over tokens). Integer ids have no gradient; given as a Tensor they
    receive zeros, which tells whoever watches the ids' node (dp_hooks.Piece's
    marker on a piece's input) that the lookup's backward has run."""
    given = ids if isinstance(ids, Tensor) else None
    ids = np.asarray(ids.data if given is not None else ids)
    out = weight.data[ids]

    def backward(g: np.ndarray) -> None:
        flat_ids = ids.reshape(-1)
        # --mixed: the rows summed in the master dtype, the sum rounded once
        weight.accumulate(_mp.round_low(rows_summed_by_id(
            _mp.upcast(g).reshape(flat_ids.size, -1), flat_ids, _mp.upcast(weight.data))),
            fresh=True)
        if given is not None:
            given.accumulate(np.zeros(ids.shape, dtype=given.dtype), fresh=True)
    parents = (weight,) if given is None else (weight, given)
    result = Tensor.from_op(out, parents, backward)
    if _pl.ON:  # rows picked by ids sharded over dp stay sharded
        _pl.follow(result, _pl.embedding(f"the lookup in {weight.name}", weight, given)
                   if given is not None else {}, f"{weight.name.removesuffix('.weight')} output")
    return result


# ------------------------------------------------------------ the mask
def allowed(q_positions: np.ndarray, k_positions: np.ndarray) -> np.ndarray:
    """(Tq, Tk) booleans: query i may attend to key j when position(j) <= position(i)."""
    return np.asarray(k_positions)[None, :] <= np.asarray(q_positions)[:, None]


def causal_mask(scores: Tensor, q_positions: np.ndarray, k_positions: np.ndarray) -> Tensor:
    """scores (..., Tq, Tk) with -inf where the key comes after the query (by position).
    Backward: the gradient passes where a score was kept and is 0 where it was masked."""
    keep = allowed(q_positions, k_positions)
    out = np.where(keep, scores.data, -np.inf)

    def backward(g: np.ndarray) -> None:
        scores.accumulate(np.where(keep, g, 0.0), fresh=True)
    return Tensor.from_op(out, (scores,), backward)


# ------------------------------------------------------------- attention
def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, T, H*dh) -> (B, H, T, dh): the heads become a batch axis (also the layout of
    the ring's blocks and of the KV cache)."""
    b, t, width = x.shape
    return x.reshape(b, t, heads, width // heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(B, H, T, dh) -> (B, T, H*dh): concat_h(o_h)."""
    b, h, t, dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * dh)


def _forward(q: Tensor, k: Tensor, v: Tensor, heads: int, q_positions: np.ndarray | None,
             k_positions: np.ndarray | None, key_bias: Tensor | None) -> dict:
    """Scores, mask and softmax of every head at once; what both backward rules need."""
    keys = k.data if key_bias is None else _mp.round_low(k.data + key_bias.data)
    # --mixed: 16-bit Q, K, V in the master dtype; scores, softmax and lse in the master
    # dtype, P rounded to 16 bits where it meets V (`_as16`; plain arrays without it)
    Q, K, V = (split_heads(_as16(t), heads) for t in (q.data, keys, v.data))  # (B,H,T,dh)
    scale = 1.0 / math.sqrt(Q.shape[-1])   # a Python float: float32 stays float32
    q_positions = np.arange(Q.shape[2]) if q_positions is None else q_positions
    k_positions = np.arange(K.shape[2]) if k_positions is None else k_positions
    keep = allowed(q_positions, k_positions)                   # (Tq, Tk)
    S = np.where(keep, (Q @ np.swapaxes(K, -1, -2)) * scale, -np.inf)   # (B, H, Tq, Tk)
    row_max = S.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)     # a row that sees no key
    E = np.exp(S - row_max)
    total = E.sum(axis=-1, keepdims=True)
    P = E / np.where(total > 0, total, 1.0)                    # such a row is all zeros
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(total))[..., 0]                # (B, H, Tq); -inf if empty
    return {"Q": Q, "K": K, "V": V, "P": P, "lse": lse, "scale": scale, "P16": _as16(P)}


def _accumulate_qk(q: Tensor, k: Tensor, c: dict, dS: np.ndarray, key_bias: Tensor | None
                   ) -> None:
    """dQ = dS K * scale, dK = dS^T Q * scale, back in the (B, T, H*dh) layout; the key
    bias gets its exact gradient, 0."""
    if key_bias is not None:
        key_bias.accumulate(np.zeros_like(key_bias.data), fresh=True)
    dS = _as16(dS)             # --mixed: a 16-bit operand of the two matmuls below
    if q.requires_grad:
        q.accumulate(_mp.round_low(merge_heads(dS @ c["K"] * c["scale"])), fresh=True)
    if k.requires_grad:
        k.accumulate(_mp.round_low(merge_heads(np.swapaxes(dS, -1, -2) @ c["Q"]
                                               * c["scale"])), fresh=True)


def _parents(q: Tensor, k: Tensor, v: Tensor | None, key_bias: Tensor | None
             ) -> tuple[Tensor, ...]:
    return tuple(t for t in (q, k, v, key_bias) if t is not None)


def attention(q: Tensor, k: Tensor, v: Tensor, heads: int,
              q_positions: np.ndarray | None = None,
              k_positions: np.ndarray | None = None,
              key_bias: Tensor | None = None) -> Tensor:
    """Causal multi-head attention, one node: q (B, Tq, H dh), k, v (B, Tk, H dh) ->
    concat_h softmax_j(q_h (k_h + bk_h)^T / sqrt(dh), causal by position) v_h, (B, Tq, H dh).

    Positions default to 0..T-1 (the whole sequence on one rank); `key_bias` (H dh,) is
    the k linear's bias. Backward: dV = P^T G, dS = P (G V^T - rowsum(P G V^T)),
    dQ = dS K/sqrt(dh), dK = dS^T Q/sqrt(dh), d key_bias = 0 (softmax ignores it)."""
    c = _forward(q, k, v, heads, q_positions, k_positions, key_bias)
    P = c["P"]

    def backward(g: np.ndarray) -> None:
        G = split_heads(_as16(g), heads)                            # (B, H, Tq, dh)
        if v.requires_grad:
            v.accumulate(_mp.round_low(merge_heads(np.swapaxes(c["P16"], -1, -2) @ G)),
                         fresh=True)
        dP = G @ np.swapaxes(c["V"], -1, -2)                   # (B, H, Tq, Tk)
        dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
        _accumulate_qk(q, k, c, dS, key_bias)
    out = Tensor.from_op(_mp.round_low(merge_heads(c["P16"] @ c["V"])),
                         _parents(q, k, v, key_bias), backward)
    return _pl.follow(out, _pl.attention("attention", q, k, v, key_bias), q.name) \
        if _pl.ON else out


def attention_lse(q: Tensor, k: Tensor, heads: int, q_positions: np.ndarray | None = None,
                  k_positions: np.ndarray | None = None, key_bias: Tensor | None = None
                  ) -> Tensor:
    """The log-sum-exp of every masked score row, (B, H, Tq): log sum_j exp(S_ij).

    One node. An online softmax merges two blocks of keys with it: weights
    exp(lse_a - lse) and exp(lse_b - lse), lse = logaddexp(lse_a, lse_b).
    Backward: d lse_i / d S_ij = P_ij, so dS = P * g[..., None], then as `attention`
    (here the key bias does move lse, by q_i . bk: d key_bias = sum_i g_i q_i / sqrt(dh))."""
    c = _forward(q, k, k, heads, q_positions, k_positions, key_bias)

    def backward(g: np.ndarray) -> None:
        _accumulate_qk(q, k, c, c["P"] * g[..., None], None)
        if key_bias is not None:  # lse_i = ... + q_i . bk / sqrt(dh), per head
            dq = (g[..., None] * c["Q"] * c["scale"]).sum(axis=(0, 2))   # (H, dh)
            key_bias.accumulate(dq.reshape(-1), fresh=True)
    out = Tensor.from_op(c["lse"], _parents(q, k, None, key_bias), backward)
    return _pl.follow(out, _pl.attention("attention (lse)", q, k, k, key_bias), q.name) \
        if _pl.ON else out
