"""A save that fails, however it fails, leaves the previous checkpoint loadable.

With real processes: a good checkpoint at step 2, then a run resumed from it that
dies while saving step 4 (a rank killed or raising while it writes its shard,
rank 0 killed while it writes the manifest, Ctrl-C's KeyboardInterrupt, a disk
that fills up on a small tmpfs mount). Each time the job ends non-zero within
seconds, `latest` still names step 2, it verifies, and a run resumes from it.
Two jobs saving into one folder at once: the second is refused before its first
step. Without MPI: the lock, the switch, `--keep` and the debris of dead saves.

    python -m pytest tests/checkpoint/test_save_failures.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minipar.checkpoint import save_load, shard_files
from minipar.checkpoint import step_folders as folders
from tests.harness.mpi import ROOT, launch, minipar, mpiexec, rank_env

SMALL = ["--layers", "2", "--d-model", "16", "--d-in", "8", "--batch", "16",
         "--optimizer", "adam", "--dp", "2"]


def save_two_steps(folder: Path) -> None:
    job = minipar(2, ["train", *SMALL, "--steps", "2", "--save", str(folder)], 60)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    assert shard_files.resolve(folder).name == "step-000002"


def faulty_save(folder: Path, spec: str) -> tuple[object, float]:
    """Resume from `folder` and save step 4 into it, with the fault `spec` injected."""
    start = time.monotonic()
    job = launch(2, ["-m", "tests.harness.rank_faults", "fault", spec, "train", *SMALL,
                     "--steps", "4", "--resume", str(folder), "--save", str(folder)], 60)
    return job, time.monotonic() - start


def assert_step_two_survived(folder: Path) -> None:
    assert shard_files.verify(folder) == []
    assert shard_files.resolve(folder).name == "step-000002"
    assert save_load.load(folder).step == 2
    assert [p.name for p in folder.glob("step-*")] == ["step-000002"]   # no half switch


@pytest.mark.parametrize("spec", ["killsave:1", "raisesave:1", "interruptsave:0",
                                  "killmanifest:0"])
def test_a_save_cut_short_keeps_the_previous_checkpoint(tmp_path, spec):
    folder = tmp_path / "ckpt"
    save_two_steps(folder)
    job, seconds = faulty_save(folder, spec)
    assert job.returncode != 0 and not job.timed_out and seconds < 30, job.explain()
    assert "done:" not in job.stdout, job.explain()
    if spec == "interruptsave:0":   # Ctrl-C is one line, not a traceback
        assert job.returncode == 130 and "Traceback" not in job.stderr, job.explain()
        assert job.stderr.count("minipar: rank 0 interrupted (Ctrl-C)") == 1, job.explain()
    assert_step_two_survived(folder)
    if spec == "killsave:1":   # and training goes on from it (the next save sweeps debris)
        job = minipar(2, ["train", *SMALL, "--steps", "3", "--resume", str(folder),
                          "--save", str(folder)], 60)
        assert job.returncode == 0, job.explain()
        assert shard_files.resolve(folder).name == "step-000003"
        assert not list(folder.glob(".staging-*"))
        assert sorted(p.name for p in folder.glob("step-*")) == ["step-000002", "step-000003"]


def test_ctrl_c_during_the_save_keeps_the_previous_checkpoint(tmp_path):
    """A real SIGINT to the whole job (what Ctrl-C in a terminal sends) while rank 0 is
    slowly writing its shard of step 4."""
    folder = tmp_path / "ckpt"
    save_two_steps(folder)
    job = subprocess.Popen(
        [mpiexec(), "-n", "2", sys.executable, "-m", "tests.harness.rank_faults", "fault",
         "slowsave:0:5",
         "train", *SMALL, "--steps", "4", "--resume", str(folder), "--save", str(folder)],
        cwd=ROOT, env=rank_env(60), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not list(folder.glob(".staging-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(folder.glob(".staging-*")), "the save never started"
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0 and "interrupted" in err, err
    assert_step_two_survived(folder)


@pytest.fixture
def small_disk(tmp_path):
    """A 160 KiB tmpfs: room for one checkpoint of SMALL (about 110 KiB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_keeps_the_previous_checkpoint(small_disk):
    folder = small_disk / "ckpt"
    save_two_steps(folder)
    job, seconds = faulty_save(folder, "none:99")   # no fault: the disk is the fault
    assert job.returncode == 1 and not job.timed_out and seconds < 30, job.explain()
    errors = [line for line in job.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("minipar: error: --save"), job.explain()
    assert "No space left on device" in errors[0] and "previous checkpoint is kept" in errors[0]
    assert_step_two_survived(folder)
    assert not list(folder.glob(".staging-*"))      # the failed save cleaned up after itself


def test_two_jobs_saving_into_one_folder_the_second_is_refused(tmp_path):
    """The first job holds its save (rank 0 inside its shard) until the second has been
    refused: the two overlap however slow the machine is."""
    folder, release = tmp_path / "ckpt", tmp_path / "release"
    first = subprocess.Popen(
        [mpiexec(), "-n", "2", sys.executable, "-m", "tests.harness.rank_faults", "fault",
         f"holdsave:0:{release}", "train", *SMALL, "--steps", "2", "--save", str(folder)],
        cwd=ROOT, env=rank_env(60), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (folder / folders.LOCK).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = minipar(2, ["train", *SMALL, "--steps", "3", "--save", str(folder)], 60)
        release.touch()
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.explain()
    assert "another job is saving here" in lines[0] and "step" not in second.stdout
    assert shard_files.verify(folder) == [] and save_load.load(folder).step == 2
    assert not (folder / folders.LOCK).exists()      # released when the first job ended


# ------------------------------------------------------------- without MPI
def fake_save(root: Path, step: int, token: str) -> Path:
    staging = folders.staging_folder(root, step, token)
    staging.mkdir(parents=True)
    (staging / "manifest.json").write_text(json.dumps({"step": step}))
    return staging


def test_publish_switches_latest_and_keeps_the_newest(tmp_path):
    token = folders.acquire(tmp_path)
    try:
        for step in (1, 2, 3, 3):          # step 3 twice: the second gets its own folder
            name = folders.publish(tmp_path, fake_save(tmp_path, step, token), step, token,
                                   keep=2)
            assert folders.latest(tmp_path).name == name
            time.sleep(0.01)
        kept = sorted(p.name for p in folders.step_folders(tmp_path))
        assert kept == ["step-000003", f"step-000003-{token}"]
        fake_save(tmp_path, 9, "dead")     # a save that died: swept by the next publish
        folders.publish(tmp_path, fake_save(tmp_path, 4, token), 4, token, keep=1)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest",
                                                               "step-000004"]
    finally:
        folders.release(tmp_path)
    assert not (tmp_path / folders.LOCK).exists()


def test_the_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path):
    lock = tmp_path / folders.LOCK
    lock.write_text(json.dumps({"token": "x", "pid": os.getppid(),
                                "host": socket.gethostname(), "since": "now"}))
    assert "another job is saving here" in folders.holder(tmp_path)
    with pytest.raises(folders.FolderError, match="another job"):
        folders.acquire(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()                             # a pid that ran and ended: a killed job's lock
    lock.write_text(json.dumps({"token": "x", "pid": gone.pid,
                                "host": socket.gethostname(), "since": "then"}))
    assert folders.holder(tmp_path) is None
    token = folders.acquire(tmp_path)
    assert json.loads(lock.read_text())["token"] == token
    lock.write_text(json.dumps({"token": "thief", "pid": os.getppid(),
                                "host": socket.gethostname(), "since": "now"}))
    with pytest.raises(folders.FolderError, match="taken by another job"):
        folders.publish(tmp_path, fake_save(tmp_path, 5, token), 5, token, keep=2)
    assert not (tmp_path / folders.LATEST).exists()   # no switch
    folders.release(tmp_path)
    assert lock.exists()                    # not ours any more: left to its owner


def test_latest_pointing_nowhere_is_one_line(tmp_path):
    for content, expected in (("step-000007", "missing"), ("../../etc", "not a step folder")):
        (tmp_path / folders.LATEST).write_text(content)
        errors = shard_files.verify(tmp_path)
        assert len(errors) == 1 and expected in errors[0], errors
