"""Context parallelism: every sequence split over the cp ranks of a group, four ways.

What this file teaches. Every layer of the transformer but attention is position-wise,
so a rank holding T/cp of each sequence's positions runs them alone. Attention needs
the keys and values of every earlier position; four ways to bring them (docs/design.md,
"Context parallelism"):

  allgather  (Llama 3, Dubey et al. 2024) Allgather K and V over cp, attend locally;
             backward: Reduce_scatter their gradients. 2 Allgathers per layer.
  ring       (Ring Attention, Liu et al. 2023) K, V blocks travel the ring, one
             neighbour step at a time, cp - 1 steps; the next block's Isend/Irecv are
             posted before the current block is computed and waited after it, so the
             traffic hides under the compute (`Passing`; `train --trace` shows how
             much); each rank merges its partial results with the log-sum-exp rule of
             online softmax; blocks the causal mask hides entirely are skipped; in
             backward K, V go ahead the same way, dK, dV follow once complete
             (Sendrecv) and take one last step home.
  zigzag     the ring on 2 cp chunks, rank r holding chunks r and 2cp-1-r: an early and
             a late piece, so every rank skips the same number of masked blocks.
  ulysses    (DeepSpeed-Ulysses, Jacobs et al. 2023) an Alltoall turns q, k, v from
             (B, T/cp, H dh) into (B, T, H/cp dh): whole sequences, some heads; attention
             as on one process; an Alltoall back. 4 Alltoalls forward, 4 backward.

Positions (the embedding's rows, the causal mask) are the global positions a rank holds
(`positions`); the mask compares positions, never array indices (attention.py).

With tensor parallelism the heads are split over tp first: each call sees this tp
rank's H/tp heads, so every exchange above moves (B, T/cp, H/tp dh) blocks inside the cp
group of its tp coordinate. Under recomputation (recompute.py) the forward runs again
in the backward, exchange included: nothing gathered is kept (docs/design.md).

Placements over cp (placement/__init__.py, `--check-placements`; docs/design.md, "Placements"):
activations are Shard(1), sharded along T. The Allgather makes K and V Replicate with
their gradient summed (its backward Reduce_scatter); the ring node takes q, k, v all
Shard(1) -- the block a rank holds at step s is rank r - s's shard, still sharded along
T, its owner rotating -- and gives Shard(1); Ulysses' Alltoall turns Shard(1) (T) into
Shard(2) (heads) and back. Weights are Replicate over cp, their gradients Partial over
dp x cp, summed by the dp_cp sync.

Run it: `mpiexec -n 4 python -m minipar train --model gpt --cp 4 --cp-mode ring --check`,
or the lesson `mpiexec -n 4 python lessons/12_context_parallel.py`.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from minipar import placement
from minipar.comm import trace
from minipar.comm.collectives import Group
from minipar.comm.mesh import CP_MODES as MODES
from minipar.core import attention, precision
from minipar.core.autograd import Tensor
from minipar.placement import Replicate, Shard


# ------------------------------------------------------------ who holds what
def chunks(seq_len: int, cp: int, rank: int, mode: str) -> list[np.ndarray]:
    """The global positions cp rank `rank` holds, as contiguous runs: one run of T/cp
    (positions r T/cp .. (r+1) T/cp - 1), or for zigzag the runs r and 2cp-1-r of T/2cp."""
    if mode == "zigzag":
        size = seq_len // (2 * cp)
        return [np.arange(c * size, (c + 1) * size) for c in (rank, 2 * cp - 1 - rank)]
    size = seq_len // cp
    return [np.arange(rank * size, (rank + 1) * size)]


def positions(seq_len: int, cp: int, rank: int, mode: str) -> np.ndarray:
    """(T/cp,) the global positions of rank `rank`, in the order it stores them."""
    return np.concatenate(chunks(seq_len, cp, rank, mode))


def token_index(rows: np.ndarray, seq_len: int, cp: int, rank: int, mode: str) -> np.ndarray:
    """(rows * T/cp,) the global token index (row T + position) of every token a rank
    holds, in its own order (row, then stored position): what MoE capacity sorts by."""
    return (rows[:, None] * seq_len + positions(seq_len, cp, rank, mode)[None, :]).ravel()


# ------------------------------------------------------------- 1. allgather
def gather_sequence(x: Tensor, group: Group) -> Tensor:
    """Forward: Allgather along T. Backward: Reduce_scatter along T.

    (B, T/cp, w) -> (B, T, w) with the ranks' positions in rank order; backward, every
    rank's gradient of all T positions is summed and each rank keeps its own T/cp."""
    b, t, w = x.shape
    cp = group.size
    gathered = np.empty((cp, b, t, w), dtype=x.dtype)
    group.Allgather(np.ascontiguousarray(x.data), gathered)  # my (B, T/cp, w) -> all ranks
    out = gathered.transpose(1, 0, 2, 3).reshape(b, cp * t, w)

    def backward(g: np.ndarray) -> None:
        low = precision.is_low(g.dtype)   # --mixed: summed in the master dtype, rounded once
        wide = precision.widen(g, precision.MASTER) if low else g
        blocks = np.ascontiguousarray(wide.reshape(b, cp, t, w).transpose(1, 0, 2, 3))
        mine = np.empty((b, t, w), dtype=blocks.dtype)
        # (cp, B, T/cp, w) gradients of every rank's positions -> summed, mine to me
        group.Reduce_scatter_block(blocks, mine, op=MPI.SUM)
        x.accumulate(mine.astype(g.dtype) if low else mine, fresh=True)
    result = Tensor.from_op(out, (x,), backward)
    return placement.transition("the Allgather along T", x, group, Shard(1),
                                Replicate(grad_summed=True), result) if placement.ON else result


def allgather_attention(cp_attention: ContextParallelAttention, q: Tensor, k: Tensor, v: Tensor,
                        heads: int, key_bias: Tensor | None) -> Tensor:
    """Every rank gathers all keys and values, then attends with its own queries."""
    # (B, T, .)
    keys, values = gather_sequence(k, cp_attention.group), gather_sequence(v, cp_attention.group)
    cp_attention.count(q.shape[0] * heads * q.shape[1] * keys.shape[1])
    return attention.attention(q, keys, values, heads, q_positions=cp_attention.positions,
                               k_positions=cp_attention.gathered_positions, key_bias=key_bias)


# --------------------------------------------------------------- 4. ulysses
def sequence_to_heads(x: np.ndarray, group: Group) -> np.ndarray:
    """(B, T/cp, H dh) -> (B, T, H/cp dh) by one Alltoall: heads out, positions in."""
    b, t, w = x.shape
    cp = group.size
    send = np.ascontiguousarray(x.reshape(b, t, cp, w // cp).transpose(2, 0, 1, 3))
    recv = np.empty_like(send)
    # heads j H/cp .. of my positions -> rank j; recv[i]: rank i's positions of my heads
    group.Alltoall(send, recv)
    return recv.transpose(1, 0, 2, 3).reshape(b, cp * t, w // cp)


def heads_to_sequence(x: np.ndarray, group: Group) -> np.ndarray:
    """(B, T, H/cp dh) -> (B, T/cp, H dh) by one Alltoall: the inverse of the above."""
    b, full, w = x.shape
    cp = group.size
    send = np.ascontiguousarray(x.reshape(b, cp, full // cp, w).transpose(1, 0, 2, 3))
    recv = np.empty_like(send)
    # my heads at rank j's positions -> rank j; recv[i]: my positions of rank i's heads
    group.Alltoall(send, recv)
    return recv.transpose(1, 2, 0, 3).reshape(b, full // cp, cp * w)


def to_heads(x: Tensor, group: Group) -> Tensor:
    """Forward: Alltoall sequence -> heads. Backward: Alltoall heads -> sequence.
    Placement: Shard(1) (positions) -> Shard(2) (heads)."""
    out = Tensor.from_op(sequence_to_heads(x.data, group), (x,), lambda g: x.accumulate(
        heads_to_sequence(g, group), fresh=True))
    return placement.transition("the Alltoall sequence -> heads", x, group, Shard(1),
                                Shard(2), out) if placement.ON else out


def to_sequence(x: Tensor, group: Group) -> Tensor:
    """Forward: Alltoall heads -> sequence. Backward: Alltoall sequence -> heads.
    Placement: Shard(2) (heads) -> Shard(1) (positions)."""
    out = Tensor.from_op(heads_to_sequence(x.data, group), (x,), lambda g: x.accumulate(
        sequence_to_heads(g, group), fresh=True))
    return placement.transition("the Alltoall heads -> sequence", x, group, Shard(2),
                                Shard(1), out) if placement.ON else out


def ulysses_attention(cp_attention: ContextParallelAttention, q: Tensor, k: Tensor, v: Tensor,
                      heads: int, key_bias: Tensor | None) -> Tensor:
    """Swap the sequence split for a head split, attend on whole sequences, swap back."""
    group, cp = cp_attention.group, cp_attention.group.size
    q_h, k_h, v_h = (to_heads(t, group) for t in (q, k, v))    # (B, T, H/cp dh) each
    width = q_h.shape[2]                                          # my heads' columns
    bias = None if key_bias is None else key_bias[group.rank * width:(group.rank + 1) * width]
    if placement.ON and bias is not None:  # my heads' slice of the key bias: a split
        placement.place(bias, group, Shard(0))
    cp_attention.count(q.shape[0] * (heads // cp) * q_h.shape[1] ** 2)
    o = attention.attention(q_h, k_h, v_h, heads // cp, q_positions=cp_attention.gathered_positions,
                            k_positions=cp_attention.gathered_positions, key_bias=bias)
    return to_sequence(o, group)                                  # (B, T/cp, H dh)


# ------------------------------------------------------- 2-3. ring, zigzag
def pass_along(group: Group, block: np.ndarray) -> np.ndarray:
    """One ring step: send my block to the next rank, receive the previous rank's."""
    # exercise: ring-attention
    received = np.empty(block.shape, dtype=block.dtype)
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    # (B, H, T/cp, dh) block -> rank r+1; the block of rank r-1 -> me
    group.Sendrecv(np.ascontiguousarray(block), nxt, received, prev)
    return received
    # end exercise


class Passing:
    """Blocks on their way round the ring: Isend to the next rank and Irecv from the
    previous one, posted before the current block is computed and waited after it
    (`arrived`), so the traffic runs under the compute (Liu et al.'s overlap)."""

    def __init__(self, group: Group, blocks: tuple[np.ndarray, ...]) -> None:
        nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        self.sent = [np.ascontiguousarray(block) for block in blocks]  # kept until sent
        self.received = [np.empty(block.shape, dtype=block.dtype) for block in blocks]
        # block i (B, H, T/cp, dh) -> rank r+1 and rank r-1's block i -> me, tag i
        self.requests = [group.Isend(block, nxt, tag=i) for i, block in enumerate(self.sent)]
        self.requests += [group.Irecv(buf, prev, tag=i)
                          for i, buf in enumerate(self.received)]

    def arrived(self) -> list[np.ndarray]:
        """Wait for every send and receive; the previous rank's blocks."""
        trace.wait(self.requests, "Waitall of the ring's K, V blocks over cp")
        return self.received


def _block_forward(Q: np.ndarray, K: np.ndarray, V: np.ndarray, keep: np.ndarray,
                   scale: float) -> tuple[np.ndarray, np.ndarray]:
    """softmax(mask(Q K^T scale)) V of one block of keys, and its row log-sum-exp."""
    S = np.where(keep, (Q @ np.swapaxes(K, -1, -2)) * scale, -np.inf)
    m = S.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)          # a row that sees none of these keys
    E = np.exp(S - m)
    total = E.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]         # -inf for such a row
    return (E @ V) / np.where(total > 0, total, 1.0), lse


def _merge(Out: np.ndarray, L: np.ndarray, o: np.ndarray, lse: np.ndarray) -> None:
    """Online softmax, in place: Out, L (all keys so far) absorb o, lse (one more block).
    L' = logaddexp(L, lse); Out' = Out exp(L - L') + o exp(lse - L')."""
    # exercise: ring-attention
    new = np.logaddexp(L, lse)
    safe = np.where(np.isfinite(new), new, 0.0)
    Out[...] = Out * np.exp(L - safe)[..., None] + o * np.exp(lse - safe)[..., None]
    L[...] = new
    # end exercise


def ring_attention(cp_attention: ContextParallelAttention, q: Tensor, k: Tensor, v: Tensor,
                   heads: int, key_bias: Tensor | None) -> Tensor:
    """Ring attention as ONE node: K, V go round the ring in forward; K, V and their
    gradients dK, dV go round again in backward (FlashAttention's backward per block:
    P = exp(S - L), dV += P^T G, dS = P (G V^T - rowsum(G O)), dQ += dS K, dK += dS^T Q)."""
    group, cp, me = cp_attention.group, cp_attention.group.size, cp_attention.group.rank
    keys = k.data if key_bias is None else k.data + key_bias.data
    Q, K, V = (attention.split_heads(t, heads) for t in (q.data, keys, v.data))  # (B, H, T/cp, dh)
    scale = 1.0 / math.sqrt(Q.shape[-1])   # a Python float: float32 stays float32
    Out = np.zeros_like(Q)
    L = np.full(Q.shape[:-1], -np.inf, dtype=Q.dtype)           # (B, H, T/cp) row lse
    for step in range(cp):
        # the block I use goes on while I use it; the previous rank's arrives meanwhile
        passing = Passing(group, (K, V)) if step + 1 < cp else None
        for a, b, keep in cp_attention.visible_blocks((me - step) % cp):    # masked blocks skipped
            o, lse = _block_forward(Q[:, :, a], K[:, :, b], V[:, :, b], keep, scale)
            _merge(Out[:, :, a], L[:, :, a], o, lse)
            cp_attention.count(Q.shape[0] * heads * (a.stop - a.start) * (b.stop - b.start))
        if passing is not None:
            K, V = passing.arrived()

    def backward(g: np.ndarray) -> None:
        G = attention.split_heads(g, heads)
        D = (G * Out).sum(axis=-1)                       # rowsum(dP * P) = G . O
        dQ = np.zeros_like(Q)
        Kb, Vb = (attention.split_heads(t, heads) for t in (keys, v.data))
        dK, dV = np.zeros_like(Kb), np.zeros_like(Vb)
        ahead: Passing | None = None
        for step in range(cp):
            if ahead is not None:  # the block's gradient so far follows it, complete now
                dK, dV = pass_along(group, dK), pass_along(group, dV)
                Kb, Vb = ahead.arrived()
            # K, V go on ahead while this step computes (their gradients cannot: they
            # are being added to)
            ahead = Passing(group, (Kb, Vb)) if step + 1 < cp else None
            for a, b, keep in cp_attention.visible_blocks((me - step) % cp):
                S = (Q[:, :, a] @ np.swapaxes(Kb[:, :, b], -1, -2)) * scale
                P = np.exp(np.where(keep, S - L[:, :, a, None], -np.inf))  # masked: 0
                dV[:, :, b] += np.swapaxes(P, -1, -2) @ G[:, :, a]
                dS = P * (G[:, :, a] @ np.swapaxes(Vb[:, :, b], -1, -2) - D[:, :, a, None])
                dQ[:, :, a] += dS @ Kb[:, :, b] * scale
                dK[:, :, b] += np.swapaxes(dS, -1, -2) @ Q[:, :, a] * scale
        # the block I hold belongs to the next rank: its finished dK, dV go home
        dK, dV = pass_along(group, dK), pass_along(group, dV)
        q.accumulate(attention.merge_heads(dQ), fresh=True)
        k.accumulate(attention.merge_heads(dK), fresh=True)
        v.accumulate(attention.merge_heads(dV), fresh=True)
        if key_bias is not None:  # softmax ignores q . bk, the same for every key: 0
            key_bias.accumulate(np.zeros_like(key_bias.data), fresh=True)
    parents = tuple(t for t in (q, k, v, key_bias) if t is not None)
    out = Tensor.from_op(attention.merge_heads(Out), parents, backward)
    return placement.follow(out, placement.ring_attention("ring attention", q, k, v, group),
                            q.name) if placement.ON else out


def visible_blocks(held: list[list[np.ndarray]], me: int, source: int
                   ) -> list[tuple[slice, slice, np.ndarray]]:
    """(my query run, source's key run, mask) for every pair of runs (`held[r]`: rank r's
    runs of positions, one each or two with zigzag) that the causal mask does not hide
    entirely: what rank `me` computes when the keys of rank `source` are with it. The
    slices index the local arrays (the runs stacked in order); pure, no MPI."""
    out = []
    for i, qpos in enumerate(held[me]):
        for j, kpos in enumerate(held[source]):
            # exercise: ring-attention
            keep = attention.allowed(qpos, kpos)
            if keep.any():
                out.append((slice(i * qpos.size, (i + 1) * qpos.size),
                            slice(j * kpos.size, (j + 1) * kpos.size), keep))
            # end exercise
    return out


# ------------------------------------------------------------ the strategy
class ContextParallelAttention:
    """The attention of one block under context parallelism: called as
    `cp_attention(q, k, v, heads, key_bias)` on this rank's (B, T/cp, H dh) in place of
    attention.attention (gpt.Attention's `core`). `last_scores` counts the score
    entries (query, key pairs x B x heads) its latest forward computed."""

    def __init__(self, group: Group, mode: str, seq_len: int) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown context-parallel mode {mode!r}; one of {MODES}")
        self.group, self.mode, cp = group, mode, group.size
        self.chunks = [chunks(seq_len, cp, r, mode) for r in range(cp)]
        self.positions = np.concatenate(self.chunks[group.rank])
        self.gathered_positions = np.concatenate([np.concatenate(c) for c in self.chunks])
        self.scores = 0
        self.last_scores = 0

    def count(self, entries: int) -> None:
        self.scores += entries

    def visible_blocks(self, source: int) -> list[tuple[slice, slice, np.ndarray]]:
        """The work of the ring step that brings the keys of rank `source`."""
        return visible_blocks(self.chunks, self.group.rank, source)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, heads: int,
                 key_bias: Tensor | None = None) -> Tensor:
        self.scores = 0
        run = {"allgather": allgather_attention, "ring": ring_attention,
               "zigzag": ring_attention, "ulysses": ulysses_attention}[self.mode]
        out = run(self, q, k, v, heads, key_bias)
        self.last_scores = self.scores
        return out


# ------------------------------------------------- MoE capacity, global order
class TokenLayout:
    """Where the tokens of one microbatch live on the dp x cp ranks: dp rank d holds rows
    d b .. (d+1) b - 1 of it, cp rank c the positions `positions(T, cp, c, mode)` of each."""

    def __init__(self, seq_len: int, cp: int, mode: str, dp: int, dp_rank: int,
                 cp_rank: int) -> None:
        self.seq_len, self.cp, self.mode, self.dp = seq_len, cp, mode, dp
        self.me = dp_rank * cp + cp_rank         # my rank in dp_cp (cp fastest, mesh.py)

    def tokens(self, local_tokens: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Global token indices of my `local_tokens` tokens, and those of every dp_cp rank."""
        b = local_tokens // (self.seq_len // self.cp)  # rows per dp rank in the microbatch
        every = [token_index(np.arange(d * b, (d + 1) * b), self.seq_len, self.cp, c, self.mode)
                 for d in range(self.dp) for c in range(self.cp)]
        return every[self.me], every
