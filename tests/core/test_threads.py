"""Every rank runs its BLAS on one thread, whatever the launch line set.

A rank of `mpiexec -n 2` starts NumPy with 2 BLAS threads (the variables set
before NumPy loads, as on a 2-core machine without them); after `import minipar`
threadpoolctl must report 1 thread for every BLAS library it finds, and the
variables passed to child processes must say 1.
"""

from __future__ import annotations

import json

from tests.harness.mpi import launch


def test_each_rank_runs_one_blas_thread():
    job = launch(2, ["-m", "tests.harness.rank_threads"], timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    lines = [line for line in job.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 1, job.explain()
    reports = json.loads(lines[0])
    assert sorted(r["rank"] for r in reports) == [0, 1], job.explain()
    for report in reports:
        assert report["before"], "no BLAS found: the test would prove nothing"
        assert max(report["before"].values()) == 2, report  # the test can fail
        assert report["after"] and set(report["after"].values()) == {1}, report
        assert report["env"] == "1", report
