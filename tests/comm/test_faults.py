"""When a rank dies or the numbers blow up, the whole job ends, quickly and clearly.

A rank that raises, or leaves alone through SystemExit, is turned into `MPI_Abort`
for all (`minipar.__main__.run`); a rank killed by SIGKILL gets no chance to say
anything, and the launcher must end the others. Either way: a non-zero exit
within 30 s, the failing rank named.
A loss that becomes NaN or infinite stops every rank at the same step with one
line naming it. (A save cut short: tests/checkpoint/test_save_failures.py.) And the same
command run twice gives the same bits.

The failures are injected by `tests/harness/rank_faults.py` (the library has no hooks).

    python -m pytest tests/comm/test_faults.py
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from tests.harness.mpi import launch, minipar, train_dump

SMALL = ["--layers", "2", "--d-model", "16", "--d-in", "8", "--batch", "16"]


def faulty(n: int, spec: str, args: list[str]) -> tuple[object, float]:
    """Run `python -m minipar ARGS` on n ranks with one rank failing as `spec` says."""
    start = time.monotonic()
    job = launch(n, ["-m", "tests.harness.rank_faults", "fault", spec, *args], timeout=60)
    return job, time.monotonic() - start


@pytest.mark.parametrize("mode", ["raise", "kill", "exit"])
def test_a_dying_rank_ends_the_whole_job(mode):
    # --timeout 0: the watchdog is not what ends these, the dying rank's own exit is
    job, seconds = faulty(4, f"{mode}:2:3", ["train", "--dp", "4", "--steps", "5",
                                             "--timeout", "0", *SMALL])
    assert not job.timed_out and seconds < 30, job.explain()
    assert job.returncode != 0, job.explain()
    assert "rank 2: injected" in job.stderr, job.explain()        # the failing rank speaks
    if mode == "raise":   # its traceback, once, under the rank's name, then MPI_Abort
        assert "minipar: rank 2 failed" in job.stderr, job.explain()
        assert "RuntimeError: injected failure on rank 2 at step 3" in job.stderr
        assert job.stderr.count("Traceback") == 1, job.explain()
    if mode == "exit":    # a SystemExit on one rank alone: the others must not wait for it
        assert "minipar: rank 2 left on its own (SystemExit(3))" in job.stderr, job.explain()
    # nobody went past the failing step (output in flight when the job ends may be lost)
    steps_done = re.findall(r"^step +(\d+)", job.stdout, flags=re.M)
    assert all(int(step) < 3 for step in steps_done), job.explain()
    assert "done:" not in job.stdout


def test_a_diverging_loss_stops_every_rank_at_the_same_step(tmp_path):
    folder = tmp_path / "never"
    start = time.monotonic()
    job = minipar(2, ["train", "--dp", "2", "--steps", "6", "--lr", "1e100", *SMALL,
                      "--save", str(folder)], 60)
    assert not job.timed_out and time.monotonic() - start < 30, job.explain()
    assert job.returncode != 0 and job.returncode != 2, job.explain()   # not a bad setting
    errors = [line for line in job.stderr.splitlines() if line.startswith("minipar: error:")]
    assert len(errors) == 1 and "Traceback" not in job.stderr, job.explain()
    assert "Warning" not in job.stderr, job.explain()
    named = re.search(r"step (\d+) of 6: the loss is (nan|inf|-inf)", errors[0])
    assert named, errors[0]
    finite = re.findall(r"^step +(\d+)", job.stdout, flags=re.M)
    assert int(named.group(1)) == len(finite) + 1 and len(finite) < 6, job.explain()
    assert "done:" not in job.stdout
    assert not (folder / "latest").exists() and not list(folder.glob("step-*"))  # no save


@pytest.mark.parametrize("flags,named", [
    (["--dtype", "float32", "--lr", "1e39", "--steps", "1"], "--lr"),   # lr is inf in float32
    (["--zero", "3", "--optimizer", "adam", "--dtype", "float32", "--lr", "1e39", "--steps",
      "2"], "--lr"),
    (["--model", "moe", "--aux-coef", "1e308", "--steps", "2"], "--aux-coef"),
])
def test_non_finite_parameters_stop_the_run_at_that_step(tmp_path, flags, named):
    folder = tmp_path / "never"
    job = minipar(2, ["train", "--dp", "2", *SMALL, *flags, "--save", str(folder)], 60)
    assert job.returncode == 1 and not job.timed_out, job.explain()
    lines = [line for line in job.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, job.explain()          # no NumPy warnings burying the line
    assert lines[0].startswith("minipar: error: step 1 of ") and "nothing saved" in lines[0]
    assert f"try a smaller {named} than" in lines[0], lines[0]
    assert "done:" not in job.stdout and not folder.exists(), job.explain()   # no folder


def determinism_flags() -> tuple[int, list[str]]:
    """The busiest mesh built on 4 ranks: tensor- and data-parallel with microbatches."""
    mesh = ["--dp", "2", "--tp", "2"]
    return 4, [*mesh, "--microbatches", "2", "--optimizer", "adam", "--steps", "3", *SMALL]


def test_the_same_command_twice_gives_the_same_bits(tmp_path):
    n, flags = determinism_flags()
    runs = [train_dump(n, flags, tmp_path / str(i)) for i in range(2)]
    assert runs[0]["losses"] == runs[1]["losses"]                    # floats, compared exactly
    assert list(runs[0]["final"]) == list(runs[1]["final"])
    for name, value in runs[0]["final"].items():
        assert np.array_equal(value, runs[1]["final"][name]), name
        assert value.tobytes() == runs[1]["final"][name].tobytes(), name
