"""The failure cases of a hostile pass, each a clean refusal or handled.

A clean refusal is one line from rank 0 (`minipar: error: ...`), exit 2, before the
first step; most cases here are one process (`python -m minipar` without a launcher,
or a pure function in this process), the MPI ones grouped into few launches.

    python -m pytest tests/test_hostile_cases.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minipar import checkpoint
from minipar import checkpoint_folder as folders
from tests.mpi import ROOT, rank_env

SMALL = ["--layers", "2", "--d-model", "16", "--d-in", "8", "--batch", "16",
         "--optimizer", "adam"]


def cli(*args: str, timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m minipar ARGS` as one process (no launcher)."""
    return subprocess.run([sys.executable, "-m", "minipar", *args], cwd=cwd,
                          env=rank_env(timeout), capture_output=True, text=True,
                          timeout=timeout)


def refused(job: subprocess.CompletedProcess, *words: str) -> str:
    """Assert `job` is a clean refusal naming `words`; returns its line."""
    lines = [line for line in job.stderr.splitlines() if line.strip()]
    assert job.returncode == 2 and len(lines) == 1, (job.returncode, job.stdout, job.stderr)
    assert lines[0].startswith("minipar: error: "), lines
    assert "Traceback" not in job.stderr and "step    1" not in job.stdout, job.stdout
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------- 1. checkpoints belong to one run
def test_a_folder_of_checkpoints_belongs_to_one_run(tmp_path):
    """Another run, another model, an older resume or reshard into it: refused, and the
    folder keeps every step; the run itself continues and prunes only its own steps."""
    ck = tmp_path / "ck"
    assert cli("train", *SMALL, "--steps", "2", "--save", str(ck)).returncode == 0
    run = checkpoint.read_manifest(ck)["run"]
    refused(cli("train", *SMALL, "--steps", "2", "--save", str(ck)), "another run", run)
    refused(cli("train", *SMALL, "--layers", "3", "--steps", "2", "--save", str(ck)),
            "another model")
    job = cli("train", *SMALL, "--steps", "4", "--resume", str(ck), "--save", str(ck))
    assert job.returncode == 0, job.stderr                    # the same run, continued
    assert checkpoint.read_manifest(ck)["run"] == run
    refused(cli("train", *SMALL, "--steps", "3", "--resume", str(ck / "step-000002"),
                "--save", str(ck)), "newer", "step-000004")
    refused(cli("reshard", str(ck / "step-000002"), str(ck)), "DST", "newer")
    assert folders.latest(ck).name == "step-000004"
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000002", "step-000004"]
    assert checkpoint.verify(ck) == []


def fake_save(root: Path, step: int, token: str, run: str | None) -> Path:
    staging = folders.staging_folder(root, step, token)
    staging.mkdir(parents=True)
    (staging / "manifest.json").write_text(json.dumps({"step": step, "run": run}))
    return staging


def test_keep_prunes_only_the_writing_runs_steps_and_latest_never_moves_back(tmp_path):
    token = folders.acquire(tmp_path)
    try:
        for step, run in ((1, "other"), (2, None), (3, "mine"), (4, "mine"), (5, "mine")):
            folders.publish(tmp_path, fake_save(tmp_path, step, token, run), step, token,
                            keep=1)
            time.sleep(0.01)
        assert sorted(p.name for p in folders.step_folders(tmp_path)) == [
            "step-000001", "step-000002", "step-000005"]        # the others' steps kept
        with pytest.raises(folders.FolderError, match="newer than step 4"):
            folders.publish(tmp_path, fake_save(tmp_path, 4, token, "mine"), 4, token, keep=1)
        assert folders.latest(tmp_path).name == "step-000005"
    finally:
        folders.release(tmp_path)


# ------------------------------------------------- 2. --data compared by its bytes
GPT = ["--model", "gpt", "--layers", "1", "--d-model", "8", "--heads", "2", "--seq-len", "8",
       "--batch", "4", "--optimizer", "adam"]


def test_resume_compares_the_data_by_its_bytes_not_its_spelling(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the same text, read byte by byte, window after window. " * 8)
    ck = tmp_path / "ck"
    assert cli("train", *GPT, "--data", str(text), "--steps", "1", "--save", str(ck),
               ).returncode == 0
    assert checkpoint.read_manifest(ck)["data_sha256"]
    job = cli("train", *GPT, "--data", "text.txt", "--steps", "2", "--resume", str(ck),
              cwd=tmp_path)                               # the same file, spelled relatively
    assert job.returncode == 0, job.stderr
    text.write_text("another text entirely, of the same kind and about as long.. " * 8)
    refused(cli("train", *GPT, "--data", str(text), "--steps", "2", "--resume", str(ck)),
            "--data", "bytes differ")
