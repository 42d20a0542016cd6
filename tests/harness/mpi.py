"""Launching MPI jobs from pytest without ever hanging the suite.

The pytest process never imports `mpi4py.MPI`. A test starts
`mpiexec -n N python -m ...` in a subprocess in its own session, with
`MPIEXEC_TIMEOUT` for the launcher and `communicate(timeout=...)` for us; on
expiry the whole session is killed (SIGTERM, then SIGKILL), so a deadlocked
rank fails its test in seconds instead of blocking CI.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def mpiexec() -> str:
    """The launcher: $MINIPAR_MPIEXEC, else the one beside this Python (PyPI's mpich)."""
    if os.environ.get("MINIPAR_MPIEXEC"):
        return os.environ["MINIPAR_MPIEXEC"]
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def rank_env(timeout: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               UCX_NET_DEVICES="lo", MPIEXEC_TIMEOUT=str(int(timeout)),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
               PYTHONFAULTHANDLER="1")
    return env


@dataclass
class Job:
    """A finished MPI job: exit code, output, and the command to rerun it by hand."""

    returncode: int
    stdout: str
    stderr: str
    command: str
    timed_out: bool = False

    def explain(self) -> str:
        state = "TIMED OUT" if self.timed_out else f"exit {self.returncode}"
        return (f"{state}\nrerun: {self.command}\n--- stdout ---\n{self.stdout[-4000:]}"
                f"\n--- stderr ---\n{self.stderr[-4000:]}")


def launch(n: int, python_args: list[str], timeout: float = 60) -> Job:
    """Run `mpiexec -n n python <python_args>` from the repository root, killing the
    whole job if it outlives `timeout` seconds."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, *python_args]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=rank_env(timeout), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout + 5)
        timed_out = False
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=3)
                break
            except subprocess.TimeoutExpired:
                continue
        out, err = proc.communicate()
        timed_out = True
    command = "OMP_NUM_THREADS=1 " + " ".join(shlex.quote(c) for c in cmd)
    log_launch(n, python_args, time.perf_counter() - started)
    return Job(proc.returncode, out, err, command, timed_out)


def log_launch(n: int, python_args: list[str], seconds: float) -> None:
    """With $MINIPAR_LAUNCH_LOG set, append one JSON line per MPI job (the test that
    launched it, ranks, arguments, wall seconds): where the suite's launches go."""
    if os.environ.get("MINIPAR_LAUNCH_LOG"):
        with open(os.environ["MINIPAR_LAUNCH_LOG"], "a") as log:
            log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "n": n,
                                  "args": python_args[:4], "seconds": round(seconds, 3)}) + "\n")


def minipar(n: int, args: list[str], timeout: float = 60) -> Job:
    """`mpiexec -n n python -m minipar <args>`."""
    return launch(n, ["-m", "minipar", *args], timeout)


def train_dump(n: int, flags: list[str], folder: Path, timeout: float = 90) -> dict:
    """Run `minipar train` with `--dump folder`; return what it wrote, asserting success."""
    job = minipar(n, ["train", *flags, "--dump", str(folder)], timeout)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    return read_dump(folder)


def read_dump(folder: Path) -> dict:
    """The files of a `--dump` folder as Python objects."""
    with np.load(folder / "final.npz") as final, np.load(folder / "init.npz") as init:
        return {"final": dict(final), "init": dict(init),
                "losses": json.loads((folder / "losses.json").read_text()),
                "config": json.loads((folder / "config.json").read_text()),
                "ledger": json.loads((folder / "ledger.json").read_text()),
                "job_folder": folder}


def sweep(n: int, configs: list[dict], folder: Path, timeout: float = 240) -> list[dict]:
    """Run several training configs in ONE mpiexec job (start-up paid once).

    Each config is a dict of TrainConfig fields; result i is read from folder/i
    (`{"replica_error": text}` for a --mixed run the replica check stopped), or
    {"cli": argv} for a `python -m minipar` command line (its `{"code", "out"}`).
    Placement checking is on (`check_placements`) unless a config says otherwise.
    """
    configs = [{"check_placements": True, **c} for c in configs]
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "configs.json"
    spec.write_text(json.dumps(configs))
    job = launch(n, ["-m", "tests.harness.rank_sweep", str(spec), str(folder)], timeout)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    return [{"replica_error": (folder / str(i) / "replica_error.txt").read_text()}
            if (folder / str(i) / "replica_error.txt").exists() else
            json.loads((folder / str(i) / "cli.json").read_text()) if "cli" in configs[i]
            else read_dump(folder / str(i)) for i in range(len(configs))]


_LESSON_RUNS: dict[tuple, tuple[Job, Path]] = {}
# flags a lesson's one test run takes beyond --quick, so that every test reading it asks
# for the same run ("{plot}" stands for its --plot folder)
LESSON_FLAGS = {"08_bugs.py": ("--json", "{plot}/findings.json")}


def lesson_run(n: int, script: str, *flags: str, timeout: float = 240) -> tuple[Job, Path]:
    """`mpiexec -n n python lessons/<script> <flags> --plot DIR`, run once per pytest
    session: tests/teaching/test_lessons.py (does it run and draw?) and a strategy's own tests
    (does it print what it should?) read the same run. Returns the job and DIR."""
    key = (n, script, flags)
    if key not in _LESSON_RUNS:
        folder = Path(tempfile.mkdtemp(prefix=f"minipar-{Path(script).stem}-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        args = [flag.replace("{plot}", str(folder)) for flag in flags]
        job = launch(n, [f"lessons/{script}", *args, "--plot", str(folder)], timeout)
        _LESSON_RUNS[key] = job, folder
    return _LESSON_RUNS[key]
