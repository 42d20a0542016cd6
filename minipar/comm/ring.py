"""Collectives written by hand on Sendrecv: the ring and the pairwise exchange.

What this file teaches: how an Allreduce can cost each rank only 2(N-1)/N of
its buffer on the wire, no matter how many ranks there are. The ranks stand in
a ring (rank r sends to r+1 and receives from r-1) and the buffer is cut into N
chunks. In N-1 steps of *reduce-scatter* every chunk travels once around the
ring collecting one addend per rank, until rank r holds the full sum of chunk r;
in N-1 steps of *allgather* the finished chunks travel around again, until
every rank holds all of them (Patarasuk and Yuan 2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations"; the algorithm Horovod and
NCCL made popular). Alltoall needs no ring: in step s rank r trades directly
with ranks r+s and r-s (the pairwise exchange of Thakur, Rabenseifner and Gropp
2005, "Optimization of collective communication operations in MPICH").

Every message goes through `comm.Group.Sendrecv`, so the ledger counts each
step, and the tests check the counts against these formulas, per rank r, with
the buffer of n elements cut into chunks of c_i elements (the first n mod N
chunks one element longer, as `np.array_split` does):

    ring_reduce_scatter   n - c_r                    (every chunk but my own)
    ring_allgather        (N-1) b                    (b = my block; every block but mine)
    ring_allreduce        2n - c_r - c_{(r+1) mod N} (= 2(N-1)/N n when N divides n;
                                                      summed over the ranks: 2(N-1) n)
    pairwise_alltoall(v)  what I send minus what I keep for myself

Run: `mpiexec -n 4 python lessons/00_collectives.py` shows them beside MPI's own;
`pytest tests/comm/test_ring.py` checks them for 1 to 8 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minipar.comm.collectives import Group


def chunk_offsets(counts: Sequence[int]) -> np.ndarray:
    """Where each chunk starts, plus the end: counts (2, 3) -> offsets (0, 2, 5)."""
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))


def even_counts(n: int, parts: int) -> np.ndarray:
    """Cut n elements into `parts` chunks as evenly as possible, longer ones first."""
    counts = np.full(parts, n // parts, dtype=np.int64)
    counts[: n % parts] += 1
    return counts


# --------------------------------------------------------------- the two ring phases
def reduce_scatter_in_ring(group: Group, flat: np.ndarray, offsets: np.ndarray) -> None:
    """Phase 1, in place: afterwards chunk r of `flat` holds the sum over all ranks.

    In step s rank r passes its running sum of chunk r-s-1 to the right and adds
    the left neighbour's running sum of chunk r-s-2 into its own. A chunk starts
    on rank r+1 and, N-1 hops later, arrives complete at rank r."""
    n_ranks, me = group.size, group.rank
    # exercise: ring-allreduce
    right, left = (me + 1) % n_ranks, (me - 1) % n_ranks
    scratch = np.empty(int(np.max(np.diff(offsets))), dtype=flat.dtype)
    for step in range(n_ranks - 1):
        send, recv = (me - step - 1) % n_ranks, (me - step - 2) % n_ranks
        incoming = scratch[: offsets[recv + 1] - offsets[recv]]
        # partial sum of chunk `send` -> right neighbour; partial sum of chunk `recv` <- left
        group.Sendrecv(flat[offsets[send]:offsets[send + 1]], right, incoming, left)
        flat[offsets[recv]:offsets[recv + 1]] += incoming
    # end exercise


def allgather_in_ring(group: Group, flat: np.ndarray, offsets: np.ndarray) -> None:
    """Phase 2, in place: rank r starts with chunk r right; afterwards every rank has all.

    In step s rank r passes chunk r-s (finished) to the right and receives chunk
    r-s-1 from the left, straight into its place."""
    n_ranks, me = group.size, group.rank
    # exercise: ring-allreduce
    right, left = (me + 1) % n_ranks, (me - 1) % n_ranks
    for step in range(n_ranks - 1):
        send, recv = (me - step) % n_ranks, (me - step - 1) % n_ranks
        # finished chunk `send` -> right neighbour; finished chunk `recv` <- left
        group.Sendrecv(flat[offsets[send]:offsets[send + 1]], right,
                       flat[offsets[recv]:offsets[recv + 1]], left)
    # end exercise


# ------------------------------------------------------------- the collectives
def ring_allreduce(group: Group, x: np.ndarray) -> np.ndarray:
    """The sum of every rank's `x`, as a new array: reduce-scatter, then allgather.

    Equal to `Allreduce(SUM)` up to rounding: the additions happen in ring
    order, not in the order MPI's own algorithm chooses."""
    flat = np.array(x, copy=True).reshape(-1)
    offsets = chunk_offsets(even_counts(flat.size, group.size))
    reduce_scatter_in_ring(group, flat, offsets)
    allgather_in_ring(group, flat, offsets)
    return flat.reshape(np.shape(x))


def ring_reduce_scatter(group: Group, x: np.ndarray,
                        counts: Sequence[int] | None = None) -> np.ndarray:
    """My chunk of the sum of every rank's flattened `x` (like MPI's `Reduce_scatter`).

    `counts[i]` is how many elements rank i keeps (default: as even as possible)."""
    flat = np.array(x, copy=True).reshape(-1)
    counts = even_counts(flat.size, group.size) if counts is None else counts
    offsets = chunk_offsets(counts)
    reduce_scatter_in_ring(group, flat, offsets)
    return flat[offsets[group.rank]:offsets[group.rank + 1]].copy()


def ring_allgather(group: Group, x: np.ndarray) -> np.ndarray:
    """Every rank's `x` stacked in rank order, shape (N, *x.shape) (like MPI's `Allgather`)."""
    block = np.asarray(x)
    flat = np.empty(group.size * block.size, dtype=block.dtype)
    offsets = np.arange(group.size + 1, dtype=np.int64) * block.size
    flat[offsets[group.rank]:offsets[group.rank + 1]] = block.reshape(-1)
    allgather_in_ring(group, flat, offsets)
    return flat.reshape(group.size, *block.shape)


def pairwise_alltoall(group: Group, x: np.ndarray) -> np.ndarray:
    """Chunk x[j] goes to rank j; out[i] is the chunk rank i sent me (like `Alltoall`).

    In step s (1..N-1) rank r sends to r+s and receives from r-s: every pair of
    ranks meets exactly once, and nobody waits for a ring to come round."""
    n_ranks, me = group.size, group.rank
    send = np.ascontiguousarray(x)
    out = np.empty_like(send)
    out[me] = send[me]  # my own chunk stays home (slices below keep 1-D chunks as arrays)
    for step in range(1, n_ranks):
        dest, source = (me + step) % n_ranks, (me - step) % n_ranks
        # my chunk for rank `dest` -> dest; rank `source`'s chunk for me <- source
        group.Sendrecv(send[dest:dest + 1], dest, out[source:source + 1], source)
    return out


def pairwise_alltoallv(group: Group, x: np.ndarray, send_counts: np.ndarray,
                       recv_counts: np.ndarray) -> np.ndarray:
    """Rows of `x` in rank order, `send_counts[j]` of them to rank j; rows from rank i
    stacked in rank order, `recv_counts[i]` of them (like `comm.alltoallv_rows`)."""
    n_ranks, me = group.size, group.rank
    send = np.ascontiguousarray(x)
    out = np.empty((int(np.sum(recv_counts)), *send.shape[1:]), dtype=send.dtype)
    send_at, recv_at = chunk_offsets(send_counts), chunk_offsets(recv_counts)
    out[recv_at[me]:recv_at[me + 1]] = send[send_at[me]:send_at[me + 1]]
    for step in range(1, n_ranks):
        dest, source = (me + step) % n_ranks, (me - step) % n_ranks
        # my rows for rank `dest` -> dest; rank `source`'s rows for me <- source
        group.Sendrecv(send[send_at[dest]:send_at[dest + 1]], dest,
                       out[recv_at[source]:recv_at[source + 1]], source)
    return out


def ring_allreduce_elements(n: int, n_ranks: int, rank: int) -> int:
    """Elements rank `rank` sends in `ring_allreduce` of n elements over `n_ranks` ranks."""
    counts = even_counts(n, n_ranks)
    return int(2 * n - counts[rank] - counts[(rank + 1) % n_ranks])
