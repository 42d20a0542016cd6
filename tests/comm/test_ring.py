"""Hand-written ring and pairwise collectives (minipar/comm/ring.py) against MPI's own.

On 1, 2, 3, 4 and 8 ranks, for buffers whose sizes do and do not divide by the
number of ranks (including fewer elements than ranks), each hand-written
collective must give MPI's answer, and send exactly its formula's volume as the
ledger counts its Sendrecv calls. Moves without arithmetic (Allgather, Alltoall)
must match exactly; sums match to rounding only (allclose, rtol 1e-12), because
the ring adds the ranks' numbers in ring order and MPI in an order of its own
choosing; with integer-valued data both orders are exact, and they must agree
bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness.rank_tests import RANK_COUNTS, agree, suite_report

SIZES = (1, 5, 7, 8, 13, 64, 1001)  # elements per buffer: odd, even, fewer than ranks
CHECKS = ("check_ring_allreduce", "check_ring_reduce_scatter", "check_ring_allgather",
          "check_pairwise_alltoall", "check_pairwise_alltoallv")


@pytest.mark.parametrize("n", RANK_COUNTS)
@pytest.mark.parametrize("check", CHECKS)
def test_hand_written_collective_equals_mpi_and_sends_its_formula(n, check):
    suite_report(n).assert_passed(f"tests.comm.test_ring:{check}")


def chunk_sizes(n: int, ranks: int) -> list[int]:
    """The formula's chunks, written out independently of ring.py: n elements in
    `ranks` chunks, the first n mod ranks of them one longer."""
    return [n // ranks + (1 if i < n % ranks else 0) for i in range(ranks)]


def test_chunk_sizes_and_the_average_ring_volume():
    from minipar.comm.ring import even_counts, ring_allreduce_elements

    for ranks in range(1, 9):
        for n in (*SIZES, 0):
            c = chunk_sizes(n, ranks)
            assert list(even_counts(n, ranks)) == c and sum(c) == n
            per_rank = [2 * n - c[r] - c[(r + 1) % ranks] for r in range(ranks)]
            assert [ring_allreduce_elements(n, ranks, r) for r in range(ranks)] == per_rank
            # averaged over the ranks the ring sends exactly 2(N-1)/N of the buffer
            assert sum(per_rank) == 2 * (ranks - 1) * n
            if n % ranks == 0:
                assert per_rank == [2 * (ranks - 1) * n // ranks] * ranks


# ------------------------------------------------------------- rank side
def groups(comm):
    """The group the ring code uses (its ledger counts the Sendrecv calls) and one for
    MPI's own collective, on the same communicator."""
    from minipar.comm.collectives import Group, Ledger

    ring_ledger = Ledger()
    return Group(comm, "ring", ring_ledger), Group(comm, "mpi", Ledger()), ring_ledger


def sent(ledger, dtype=np.float64) -> tuple[int, int, int]:
    """(calls, elements, bytes) of the Sendrecv calls since the last reset."""
    entry = ledger.entries.get(("Sendrecv", "ring"))
    return (0, 0, 0) if entry is None else (entry.calls, entry.elements, entry.bytes)


def volume(label: str, got: tuple[int, int, int], calls: int, elements: int,
           itemsize: int = 8) -> list[str]:
    want = (calls, elements, elements * itemsize)
    return [] if got == want else [f"{label}: Sendrecv (calls, elements, bytes) {got}, "
                                   f"formula {want}"]


def check_ring_allreduce(comm):
    """Sum = MPI's Allreduce; rank r sends 2n - c_r - c_(r+1) in 2(N-1) Sendrecv calls."""
    from minipar.comm.ring import ring_allreduce

    ring, mpi, ledger = groups(comm)
    size, me = ring.size, ring.rank
    rng = np.random.default_rng(10 + me)
    problems = []
    for n in SIZES:
        for label, x in (("random", rng.standard_normal(n)),
                         ("integers", rng.integers(-9, 9, n).astype(np.float64)),
                         ("float32 (3, n)", rng.standard_normal((3, n)).astype(np.float32))):
            ledger.reset()
            mine = ring_allreduce(ring, x)
            theirs = np.empty_like(x)
            mpi.Allreduce(x, theirs)
            tolerance = 1e-12 if x.dtype == np.float64 else 1e-5
            same = np.array_equal(mine, theirs) if label == "integers" else np.allclose(
                mine, theirs, rtol=tolerance, atol=tolerance)
            if not same or mine.shape != x.shape or mine.dtype != x.dtype:
                problems.append(f"{label} n={n}: ring sum differs from MPI's")
            c = chunk_sizes(x.size, size)
            problems += volume(f"{label} n={n}", sent(ledger), 2 * (size - 1),
                               2 * x.size - c[me] - c[(me + 1) % size], x.itemsize)
    agree(mpi, problems)


def check_ring_reduce_scatter(comm):
    """My chunk of the sum = MPI's Reduce_scatter; rank r sends n - c_r in N-1 calls."""
    from minipar.comm.ring import ring_reduce_scatter

    ring, mpi, ledger = groups(comm)
    size, me = ring.size, ring.rank
    rng = np.random.default_rng(20 + me)
    problems = []
    uneven = [(i * 3) % 4 for i in range(size)]  # chosen counts, zeros included
    for counts in [chunk_sizes(n, size) for n in SIZES] + [uneven]:
        x = rng.standard_normal(sum(counts))
        ledger.reset()
        mine = ring_reduce_scatter(ring, x, counts if counts is uneven else None)
        theirs = np.empty(counts[me])
        mpi.Reduce_scatter(x, theirs, recvcounts=counts)
        if mine.shape != theirs.shape or not np.allclose(mine, theirs, rtol=1e-12, atol=1e-12):
            problems.append(f"counts {counts}: ring Reduce_scatter differs from MPI's")
        problems += volume(f"counts {counts}", sent(ledger), size - 1, x.size - counts[me])
    agree(mpi, problems)


def check_ring_allgather(comm):
    """Every block in rank order = MPI's Allgather; each rank sends (N-1) blocks."""
    from minipar.comm.ring import ring_allgather

    ring, mpi, ledger = groups(comm)
    size, me = ring.size, ring.rank
    problems = []
    for shape in [(n,) for n in SIZES] + [(2, 3), (0,)]:
        x = np.random.default_rng(30 + me).standard_normal(shape)
        ledger.reset()
        mine = ring_allgather(ring, x)
        theirs = np.empty((size, *shape))
        mpi.Allgather(x, theirs)
        if not np.array_equal(mine, theirs):
            problems.append(f"block {shape}: ring Allgather differs from MPI's")
        problems += volume(f"block {shape}", sent(ledger), size - 1, (size - 1) * x.size)
    agree(mpi, problems)


def check_pairwise_alltoall(comm):
    """out[i] = rank i's chunk for me = MPI's Alltoall; each rank sends all but its own."""
    from minipar.comm.ring import pairwise_alltoall

    ring, mpi, ledger = groups(comm)
    size, me = ring.size, ring.rank
    problems = []
    for chunk in [(), (1,), (7,), (2, 3)]:
        x = 100.0 * me + np.arange(size * int(np.prod(chunk)), dtype=np.float64)
        x = x.reshape(size, *chunk)
        ledger.reset()
        mine = pairwise_alltoall(ring, x)
        theirs = np.empty_like(x)
        mpi.Alltoall(x, theirs)
        if not np.array_equal(mine, theirs):
            problems.append(f"chunk {chunk}: pairwise Alltoall differs from MPI's")
        problems += volume(f"chunk {chunk}", sent(ledger), size - 1, x.size - x[me].size)
    agree(mpi, problems)


def check_pairwise_alltoallv(comm):
    """Uneven rows (zeros included) = comm.alltoallv_rows (MPI's Alltoallv); each rank
    sends every row except those it keeps for itself."""
    from minipar.comm.collectives import alltoallv_rows
    from minipar.comm.ring import pairwise_alltoallv

    ring, mpi, ledger = groups(comm)
    size, me = ring.size, ring.rank
    problems = []
    for width, spread in ((1, 3), (5, 4), (2, 1)):
        rows = np.array([[(i * 7 + j * 3) % spread for j in range(size)] for i in range(size)])
        send, recv = rows[me], rows[:, me]  # rows[i, j]: rows rank i sends rank j
        x = np.random.default_rng(40 + me).standard_normal((int(send.sum()), width))
        ledger.reset()
        mine = pairwise_alltoallv(ring, x, send, recv)
        theirs = alltoallv_rows(mpi, x, send, recv)
        if not np.array_equal(mine, theirs):
            problems.append(f"width {width}: pairwise Alltoallv differs from MPI's")
        problems += volume(f"width {width}", sent(ledger), size - 1,
                           (int(send.sum()) - int(send[me])) * width)
    agree(mpi, problems)


# ------------------------------------------------------------- the lesson
def test_lesson_00_collectives_on_four_ranks():
    """`mpiexec -n 4 python lessons/00_collectives.py` prints what each collective leaves
    on each rank; every key line is recomputed here from the definitions."""
    import re

    from tests.harness.mpi import launch

    n = 4
    job = launch(n, ["-m", "mpi4py", "lessons/00_collectives.py"], timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    out = job.stdout.splitlines()
    ranks = range(n)
    total = sum(10 * q + np.array([1, 2, 3]) for q in ranks)
    gathered = " | ".join(f"{10 * q + 1} {10 * q + 2}" for q in ranks)
    for r in ranks:
        assert f"[rank {r}] holds {10 * r + np.array([1, 2, 3])}   after Allreduce(SUM): " \
               f"{total}" in out
        assert f"[rank {r}] holds {10 * r + np.array([1, 2])}   after Allgather: " \
               f"[{gathered}]" in out
        piece = sum((q + 1) * np.arange(1, 2 * n + 1) for q in ranks)[2 * r:2 * r + 2]
        assert any(line.startswith(f"[rank {r}] holds [") and
                   line.endswith(f"after Reduce_scatter: {piece}") for line in out)
        # the source's example: rank r ends with chunk A(r+1) of every rank
        assert f"[rank {r}] holds [A1, A2, A3, A4]   after Alltoall: [" + ", ".join(
            f"A{r + 1} from rank {q}" for q in ranks) + "]" in out
        assert any(line.startswith(f"[rank {r}] after reduce-scatter:") and
                   line.endswith("after allgather: " + " ".join(["1" * n] * n)) for line in out)
        c = chunk_sizes(10, n)  # the uneven buffer: chunks 3 3 2 2
        for size, sent_elements in ((100_000, 2 * (n - 1) * 100_000 // n),
                                    (10, 20 - c[r] - c[(r + 1) % n])):
            assert any(line.startswith(f"[rank {r}] n = {size} float64 ({8 * size} bytes): "
                                       f"ring sent {8 * sent_elements} bytes in "
                                       f"{2 * (n - 1)} Sendrecv") for line in out), size
    # say_in_order: each part prints rank 0, 1, 2, 3 in order, whatever the timing
    allreduce_lines = [line for line in out if "after Allreduce(SUM)" in line]
    assert [line.split("]")[0] for line in allreduce_lines] == [f"[rank {r}" for r in ranks]
    differences = [float(d) for d in re.findall(r"max \|ring - MPI\| = (\S+)", job.stdout)]
    assert len(differences) == 2 * n and max(differences) < 1e-12
    assert "DIFFERS" not in job.stdout
