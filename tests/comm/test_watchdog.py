"""The watchdog: a rank stuck for --timeout seconds ends the whole job, naming where.

With real processes (`tests/harness/rank_faults.py` freezes one rank): a SIGSTOPped rank
and a rank that sleeps inside a step, on a data-parallel and a pipeline mesh;
the others wait in their collective or Recv until the watchdog ends the job with
one line naming the step and the call. `--timeout 0` waits as long as it takes.
Without MPI: the line itself, from the stamps.

    python -m pytest tests/comm/test_watchdog.py
"""

from __future__ import annotations

import re
import time

import pytest

from minipar.comm import watchdog
from tests.harness.mpi import launch

SMALL = ["--layers", "2", "--d-model", "16", "--d-in", "8", "--batch", "16", "--steps", "5"]
MESHES = {"dp": ["--dp", "2"], "pp": ["--pp", "2", "--microbatches", "2"]}


def frozen(spec: str, flags: list[str]) -> tuple[object, float]:
    start = time.monotonic()
    job = launch(2, ["-m", "tests.harness.rank_faults", "fault", spec, "train", *SMALL, *flags], 60)
    return job, time.monotonic() - start


@pytest.mark.parametrize("spec,mesh", [("stop:1:2", "dp"), ("sleep:1:2:60", "dp"),
                                       ("sleep:0:3:60", "pp")])
def test_a_stuck_rank_ends_the_job_within_the_timeout(spec, mesh):
    job, seconds = frozen(spec, [*MESHES[mesh], "--timeout", "2"])
    assert not job.timed_out and job.returncode != 0 and seconds < 20, job.explain()
    lines = [line for line in job.stderr.splitlines() if "watchdog" in line]
    assert lines and all(line.startswith("minipar: error: watchdog: rank ") for line in lines)
    step = spec.split(":")[2]
    named = re.search(rf"waited \d+ s in (\w+) .* at step {step} of 5 .*--timeout 2", lines[0])
    assert named, job.explain()
    assert named.group(1) in ("Allreduce", "Recv", "Send", "Waitall", "Wait"), lines[0]
    assert "done:" not in job.stdout and "Traceback" not in job.stderr, job.explain()


def test_timeout_zero_waits_for_a_slow_rank():
    """A rank 3 s late in a step: longer than the --timeout 2 that ends the jobs above."""
    job, seconds = frozen("sleep:1:2:3", [*MESHES["dp"], "--timeout", "0"])
    assert job.returncode == 0 and "done: 5 steps" in job.stdout, job.explain()
    assert seconds >= 3 and "watchdog" not in job.stderr


def test_the_line_names_the_call_and_the_step():
    watchdog.doing("step 2 of 5")
    with watchdog.waiting("Recv from pp rank 1"):
        now = time.monotonic()
        assert watchdog.overdue(3, now + 1) is None          # not yet
        line = watchdog.overdue(3, now + 4)
    assert line.startswith("waited 4 s in Recv from pp rank 1 at step 2 of 5"), line
    assert watchdog.overdue(3, time.monotonic() + 100) is None   # not waiting: no alarm
