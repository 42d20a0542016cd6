"""The MPI test harness fails fast and says where: a rank that raises, a rank that hangs.

`tests.harness.rank_tests` runs check functions on every rank; these tests inject the two
ways an MPI program goes wrong and time how long the suite takes to notice.
"""

from __future__ import annotations

import time

from tests.harness.mpi import launch
from tests.harness.rank_tests import run_checks

OK = "tests.run.test_harness:check_allreduce_works"
RAISES = "tests.run.test_harness:check_one_rank_raises"
SKIPS = "tests.run.test_harness:check_one_rank_skips_a_collective"
BROKEN_RANK = 2


# ------------------------------------------------------------- rank side checks
def check_allreduce_works(comm):
    """A healthy check: the sum of the ranks is n(n-1)/2 on every rank."""
    total = comm.allreduce(comm.Get_rank())
    size = comm.Get_size()
    assert total == size * (size - 1) // 2, total


def check_one_rank_raises(comm):
    """Rank 2 raises while the others enter a collective it will never join."""
    if comm.Get_rank() == BROKEN_RANK:
        raise RuntimeError(f"injected failure on rank {BROKEN_RANK}")
    comm.allreduce(1)


def check_one_rank_skips_a_collective(comm):
    """Rank 2 skips the Allreduce; the others wait for it forever (a deadlock)."""
    if comm.Get_rank() != BROKEN_RANK:
        comm.allreduce(1)


# ------------------------------------------------------------------ the tests
def test_an_exception_on_one_rank_fails_within_seconds(tmp_path):
    started = time.perf_counter()
    report = run_checks(4, [OK, RAISES], tmp_path, timeout=60, stuck_after=30)
    elapsed = time.perf_counter() - started
    assert report.problem(OK) is None, report.problem(OK)
    story = report.problem(RAISES)
    assert story is not None, "an injected exception went unnoticed"
    assert report.job.returncode != 0 and not report.job.timed_out, report.job.explain()
    assert elapsed < 15, f"took {elapsed:.1f} s to notice one failing rank"
    assert report.verdicts[BROKEN_RANK][RAISES].status == "fail"
    assert f"--- rank {BROKEN_RANK}: FAIL" in story
    assert f"RuntimeError: injected failure on rank {BROKEN_RANK}" in story
    assert f"-n 4 {report.rerun(RAISES).split(' -n 4 ')[1]}" in story
    assert "-m tests.harness.rank_tests" in report.rerun(RAISES) and RAISES in report.rerun(RAISES)


def test_a_deadlock_fails_via_the_timeout_instead_of_hanging(tmp_path):
    started = time.perf_counter()
    report = run_checks(4, [OK, SKIPS], tmp_path, timeout=60, stuck_after=2)
    elapsed = time.perf_counter() - started
    assert report.problem(OK) is None, report.problem(OK)
    story = report.problem(SKIPS)
    assert story is not None, "a deadlock went unnoticed"
    assert not report.job.timed_out, "the outer kill ended the job, not the rank watchdog"
    assert report.job.returncode != 0
    assert elapsed < 15, f"took {elapsed:.1f} s to notice a deadlock"
    stuck = [rank for rank, v in enumerate(report.verdicts) if v[SKIPS].status == "stuck"]
    assert stuck, story
    # the dumped stack shows the line where a waiting rank sits
    assert "check_one_rank_skips_a_collective" in report.verdicts[stuck[0]][SKIPS].text
    assert f"--- rank {stuck[0]}: STUCK" in story and "rerun:" in story


def test_a_lesson_check_failing_on_one_rank_makes_every_rank_exit_1():
    """`log.verdict` remembers a failed check; `run_collectively` makes all ranks agree."""
    code = ("from mpi4py import MPI\n"
            "from minipar.comm.job import run_collectively, verdict\n"
            "def main():\n"
            "    print(verdict(MPI.COMM_WORLD.Get_rank() != 1), flush=True)\n"
            "run_collectively(main)\n")
    job = launch(3, ["-c", code], timeout=60)
    assert job.returncode == 1 and not job.timed_out, job.explain()
    assert job.stdout.count("MISMATCH") == 1 and job.stdout.count("OK") == 2, job.explain()
    assert "1 check(s) failed" in job.stderr, job.explain()
    healthy = launch(3, ["-c", code.replace("!= 1", ">= 0")], timeout=60)
    assert healthy.returncode == 0, healthy.explain()
