"""Lesson 0: the collectives every parallel strategy is made of.

    mpiexec -n 4 python lessons/00_collectives.py
    mpiexec -n 4 python -m mpi4py lessons/00_collectives.py   # an error on one rank stops all
    mpiexec -n 4 python lessons/00_collectives.py --plot figures   # + 00_alltoall.png

Each rank holds a small array with numbers that say where they came from, makes
one raw mpi4py call on MPI.COMM_WORLD, and prints what it holds afterwards, rank
by rank. The source text names three collectives:

1. Allreduce(SUM): everyone ends with the sum of everyone's array. Data
   parallelism sums its gradients this way (lesson 1).
2. Allgather: everyone ends with everyone's array, in rank order. Tensor
   parallelism joins the column blocks of Y = X W this way (lesson 2).
3. Alltoall, the source text's example: 4 GPUs each hold chunks [A1,A2,A3,A4];
   afterwards GPU j holds chunk j from every GPU. (The source writes the result
   as [A1_from_GPU1, A2_from_GPU2, ...]; what the call does, printed below, is
   that GPU j holds [Aj from GPU 1, Aj from GPU 2, ...].) Expert parallelism
   sends tokens to the rank that owns their expert this way (lesson 3).

Beyond the source (each part's header says so):

4. Reduce_scatter: the sum, cut into N pieces, piece j on rank j. An Allreduce
   is a Reduce_scatter followed by an Allgather (parts 5 and 6 build one that way).
5. The ring written by hand on Sendrecv (minipar/comm/ring.py; Patarasuk and
   Yuan 2009), watched: each rank's share arriving in every chunk.
6. That ring Allreduce beside MPI's own, with the bytes the ledger counted
   beside the ring formula 2(N-1)/N of the buffer.

Runs on any number of ranks; the source's example is 4.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm import ring
from minipar.comm.collectives import Group, Ledger
from minipar.comm.job import run_collectively, say_in_order, verdict
from minipar.settings.preflight import lesson_arguments


def banner(world: Group | MPI.Comm, title: str) -> None:
    if (world.rank if isinstance(world, Group) else world.Get_rank()) == 0:
        print(f"\n=== {title}", flush=True)


def show(values: np.ndarray, parts: int) -> str:
    """An array cut into `parts` chunks, chunks separated by |."""
    return "[" + " | ".join(" ".join(str(v) for v in chunk)
                            for chunk in np.array_split(values, parts)) + "]"


def allreduce(comm: MPI.Comm) -> None:
    banner(comm, "1. Allreduce(SUM): everyone gets the sum (the source's data parallelism)")
    x = 10 * comm.Get_rank() + np.array([1, 2, 3])
    total = np.empty_like(x)
    comm.Allreduce(x, total, op=MPI.SUM)          # x (3,) of every rank -> their sum, everywhere
    say_in_order(comm, f"holds {x}   after Allreduce(SUM): {total}")


def allgather(comm: MPI.Comm) -> None:
    banner(comm, "2. Allgather: everyone gets everyone's array, in rank order (the source's "
                 "tensor parallelism)")
    n = comm.Get_size()
    x = 10 * comm.Get_rank() + np.array([1, 2])
    gathered = np.empty((n, 2), dtype=x.dtype)
    comm.Allgather(x, gathered)                   # x (2,) of every rank -> (N, 2) on every rank
    say_in_order(comm, f"holds {x}   after Allgather: {show(gathered.ravel(), n)}")


def label(code: int) -> str:
    """Chunk `code` = 100 * rank + chunk number, as the source writes it: A2 from rank 3."""
    return f"A{code % 100} from rank {code // 100}"


def alltoall(comm: MPI.Comm, plot: Path | None = None) -> None:
    world = Group(comm, "world", Ledger())   # the same ranks, for ring.py's pairwise exchange
    banner(world, "3. Alltoall (the source's example): chunk j of every rank -> rank j")
    if world.rank == 0:
        print(f"{world.size} ranks, each with chunks [A1, ..., A{world.size}]; afterwards "
              "rank j holds chunk j+1 from every rank", flush=True)
    chunks = 100 * world.rank + np.arange(1, world.size + 1)  # [A1, A2, ...] of this rank
    received = np.empty_like(chunks)
    comm.Alltoall(chunks, received)  # my chunk j -> rank j; chunk (my rank) of rank i <- i
    by_hand = ring.pairwise_alltoall(world, chunks)
    names = ", ".join(f"A{c % 100}" for c in chunks)
    say_in_order(world, f"holds [{names}]   after Alltoall: "
                 f"[{', '.join(label(c) for c in received)}]"
                 + verdict(np.array_equal(by_hand, received), "", "   PAIRWISE BY HAND DIFFERS"))
    if world.rank == 0:
        print("(the same with the pairwise exchange by hand, ring.pairwise_alltoall:\n"
              " N-1 Sendrecv steps, step s trading with ranks r+s and r-s)", flush=True)
    if plot is not None:  # every rank's chunks before and after -> rank 0, for the figure
        before, after = world.gather(chunks), world.gather(received)
        if world.rank == 0:
            from minipar.teaching.plots import alltoall_figure, save

            path = save(alltoall_figure(np.array(before), np.array(after)),
                        plot / "00_alltoall.png")
            print(f"figure: {path}", flush=True)


def reduce_scatter(comm: MPI.Comm) -> None:
    banner(comm, "4. Beyond the source: Reduce_scatter, the sum cut in N pieces, piece j on "
                 "rank j")
    n = comm.Get_size()
    x = (comm.Get_rank() + 1) * np.arange(1, 2 * n + 1)
    mine = np.empty(2, dtype=x.dtype)
    comm.Reduce_scatter_block(x, mine, op=MPI.SUM)  # (N pieces of 2) summed -> my piece
    say_in_order(comm, f"holds {show(x, n)}   after Reduce_scatter: {mine}")


def watch_the_ring(world: Group) -> None:
    """Rank r adds 10^r to every chunk, so digit r of a number says rank r's share is in."""
    banner(world, "5. Beyond the source: the ring by hand. Rank k adds 10^k to every chunk, "
                  "so digit k\n(from the right) is 1 once rank k's share is in")
    n = world.size
    if n > 9:
        return
    flat = np.full(n, 10 ** world.rank, dtype=np.int64)
    offsets = ring.chunk_offsets(ring.even_counts(n, n))
    ring.reduce_scatter_in_ring(world, flat, offsets)  # N-1 steps: partial sums to the right
    after_reduce = " ".join(f"{v:0{n}d}" for v in flat)
    ring.allgather_in_ring(world, flat, offsets)  # N-1 steps: finished chunks to the right
    say_in_order(world, f"after reduce-scatter: {after_reduce}  (chunk {world.rank} complete)"
                 f"   after allgather: {' '.join(f'{v:0{n}d}' for v in flat)}")


def ring_beside_mpi(comm: MPI.Comm) -> None:
    ring_ledger, mpi_ledger = Ledger(), Ledger()
    by_hand, mpi = Group(comm, "world", ring_ledger), Group(comm, "world", mpi_ledger)
    n_ranks, me = by_hand.size, by_hand.rank
    banner(mpi, "6. Beyond the source: the ring Allreduce by hand beside MPI's Allreduce")
    for n in (100_000, 10):
        x = np.random.default_rng(me).standard_normal(n)
        ring_ledger.reset()
        mpi_ledger.reset()
        ours = ring.ring_allreduce(by_hand, x)
        theirs = np.empty_like(x)
        mpi.Allreduce(x, theirs, op=MPI.SUM)  # x of every rank -> their sum (MPI's algorithm)
        sent = ring_ledger.total("Sendrecv", field="bytes")
        calls = ring_ledger.total("Sendrecv", field="calls")
        exact = 8 * ring.ring_allreduce_elements(n, n_ranks, me)
        share = 2 * (n_ranks - 1) / n_ranks * 8 * n
        diff = float(np.max(np.abs(ours - theirs)))
        say_in_order(mpi, f"n = {n} float64 ({8 * n} bytes): ring sent {sent} bytes in "
                     f"{calls} Sendrecv\n  2(N-1)/N of the buffer = {share:.0f} bytes; "
                     f"exact, chunks c_i: 8 (2n - c_r - c_(r+1)) = {exact} bytes\n"
                     f"  max |ring - MPI| = {diff:.1e}")
    if me == 0:
        print(f"(MPI's own Allreduce is one ledger record of the whole buffer "
              f"({mpi_ledger.total('Allreduce', field='bytes')} bytes just now);\n its wire "
              "volume depends on the algorithm MPI picks. The sums agree to rounding "
              "only: the ring adds in ring order.\n When N does not divide n the chunks are "
              "uneven, each rank's share differs a little, and their average is exactly\n "
              "2(N-1)/N of the buffer.)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write the figure here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    comm = MPI.COMM_WORLD
    allreduce(comm)
    allgather(comm)
    alltoall(comm, args.plot)
    reduce_scatter(comm)
    watch_the_ring(Group(comm, "world", Ledger()))
    ring_beside_mpi(comm)


if __name__ == "__main__":
    run_collectively(main)
