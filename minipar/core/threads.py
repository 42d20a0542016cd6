"""One BLAS thread per rank, set in code, so no launch line has to remember it.

What this file teaches: NumPy's matrix products run in a BLAS library (OpenBLAS,
MKL) that starts one thread per core by default. Under `mpiexec -n 4` on a
2-core machine that is 4 ranks x 2 threads fighting for 2 cores, and every
timing a lesson prints measures the fight, not the schedule (a 1F1B step
measured 8x slower that way). Each rank is one worker: it gets one thread.

Setting `OMP_NUM_THREADS=1` from Python only works before NumPy is first
imported (the BLAS reads it once, when it loads); by the time `import minipar`
runs, NumPy is usually loaded already. So `one_blas_thread` does both:
threadpoolctl changes the limit of the BLAS that is loaded now, and the
variables are set for any process this one starts. It runs when `minipar` is
imported, which every entry point does first (`python -m minipar`, the lessons,
the notebooks' ranks, bench).

    MINIPAR_BLAS_THREADS=2 python -m minipar train ...   # to measure with more
"""

from __future__ import annotations

import os

VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def one_blas_thread() -> int:
    """Limit every loaded BLAS/OpenMP pool of this process to $MINIPAR_BLAS_THREADS
    threads (default 1) and export the same limit to child processes. Returns it."""
    threads = int(os.environ.get("MINIPAR_BLAS_THREADS", "1"))
    for name in VARIABLES:
        os.environ[name] = str(threads)
    from threadpoolctl import threadpool_limits  # imports NumPy's BLAS info lazily

    threadpool_limits(limits=threads)  # not a `with`: the limit stays for the process
    return threads


def blas_threads() -> dict[str, int]:
    """The thread count of each BLAS/OpenMP library loaded in this process, by name:
    {'openblas': 1} when `one_blas_thread` has run."""
    from threadpoolctl import threadpool_info

    return {f"{info['internal_api']} ({os.path.basename(info['filepath'])})":
            info["num_threads"] for info in threadpool_info()}


def cores() -> int:
    """Cores this process may run on (its CPU affinity; `os.cpu_count()` where the
    platform has no affinity): with more ranks than this, wall-clock times measure
    the sharing, not the work."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
