"""Rank side of the collectives benchmark: hand-written ring Allreduce vs MPI's own.

    mpiexec -n N python -m bench.ring_rank OUT.json

For each buffer size, the two are timed in alternation (same buffers, a barrier
before each call); rank 0 writes medians, ranges and the bus bandwidth
2(N-1)/N * bytes / time, beside this machine's memcpy bandwidth.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Group, Ledger
from minipar.comm.ring import ring_allreduce

SIZES = {"8 KB": 8 * 1024, "1 MB": 1024 * 1024, "16 MB": 16 * 1024 * 1024}


def timed(world: MPI.Comm, fn: object) -> float:
    world.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = np.array([time.perf_counter() - start])
    world.Allreduce(MPI.IN_PLACE, elapsed, op=MPI.MAX)  # the slowest rank decides
    return float(elapsed[0])


def memcpy_bandwidth(nbytes: int) -> float:
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    best = min(_copy_time(src, dst) for _ in range(5))
    return nbytes / best


def _copy_time(src: np.ndarray, dst: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def main() -> None:
    world = MPI.COMM_WORLD
    group = Group(world, "world", Ledger())
    n = world.Get_size()
    results = {}
    for label, nbytes in SIZES.items():
        x = np.random.default_rng(world.Get_rank()).normal(size=nbytes // 8)
        out = np.empty_like(x)
        repeats = 30 if nbytes < 2**20 else 8
        ring, mpi = [], []
        for _ in range(repeats):
            ring.append(timed(world, lambda x=x: ring_allreduce(group, x)))
            mpi.append(timed(world, lambda x=x, out=out: world.Allreduce(x, out, op=MPI.SUM)))
        bus = 2 * (n - 1) / n * nbytes
        results[label] = {"ring": float(np.median(ring)), "mpi": float(np.median(mpi)),
                          "ring_range": [min(ring), max(ring)], "mpi_range": [min(mpi), max(mpi)],
                          "ring/mpi": float(np.median(ring) / np.median(mpi)),
                          "ring_bus_GBps": bus / float(np.median(ring)) / 1e9,
                          "mpi_bus_GBps": bus / float(np.median(mpi)) / 1e9}
    if world.Get_rank() == 0:
        results["memcpy_GBps"] = memcpy_bandwidth(16 * 2**20) / 1e9
        with open(sys.argv[1], "w") as f:
            json.dump({"ranks": n, **results}, f)


if __name__ == "__main__":
    main()
