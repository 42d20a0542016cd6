"""Rank side of test_threads: a BLAS started with 2 threads, then `import minipar`.

    mpiexec -n 2 python -m tests.harness.rank_threads

The variables are set to 2 before NumPy loads, as a launch line without them
would leave OpenBLAS on a 2-core machine; each rank reports
its BLAS thread counts before and after importing minipar, gathered to rank 0
and printed there as one JSON list.
"""

import json
import os

for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[name] = "2"
os.environ.pop("MINIPAR_BLAS_THREADS", None)

import numpy as np  # noqa: E402  (after the variables: the BLAS reads them when it loads)
from threadpoolctl import threadpool_info  # noqa: E402

np.ones((64, 64)) @ np.ones((64, 64))  # the BLAS is loaded and has run
before = {info["internal_api"]: info["num_threads"] for info in threadpool_info()}

from mpi4py import MPI  # noqa: E402

import minipar  # noqa: E402, F401  (what every entry point imports first)
from minipar.core.threads import blas_threads  # noqa: E402

after = blas_threads()
mine = {"rank": MPI.COMM_WORLD.Get_rank(), "before": before, "after": after,
        "env": os.environ["OMP_NUM_THREADS"]}
everyone = MPI.COMM_WORLD.gather(mine)  # one line from rank 0: ranks' prints can interleave
if everyone is not None:
    print(json.dumps(everyone), flush=True)
