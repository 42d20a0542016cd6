"""Rank side of the reliability tests: break one rank on purpose, or try many bad settings.

    mpiexec -n 2 python -m tests.harness.rank_faults fault raise:1:2 train --dp 2 --steps 4
    mpiexec -n 2 python -m tests.harness.rank_faults fault kill:1:2 train --dp 2 --steps 4
    mpiexec -n 2 python -m tests.harness.rank_faults fault killsave:1 train --dp 2 --save DIR
    mpiexec -n 4 python -m tests.harness.rank_faults settings cases.json OUTDIR

`fault MODE:RANK[:STEP[:SECONDS]] ARGS...` runs `python -m minipar ARGS...` through its
real entry point (`minipar.__main__.run`, which aborts every rank on an exception),
with world rank RANK made to fail when it fetches the batch of step STEP (1-based):
`raise` raises an exception, `exit` raises SystemExit(3) (a rank leaving alone),
`kill` sends itself SIGKILL (no Python cleanup, no MPI_Abort: the launcher must
notice), `stop` sends itself SIGSTOP (alive but frozen: only a watchdog can tell),
`sleep` sleeps SECONDS (default 60) inside the step. During a save: `killsave`,
`raisesave` and `interruptsave` (KeyboardInterrupt, what Ctrl-C raises) hit RANK
while it writes its checkpoint shard, `killmanifest` while rank 0 writes the
manifest, `slowsave` makes RANK take SECONDS to write its shard, and `holdsave`
(`holdsave:RANK:FILE`) holds RANK there until FILE exists (at most 60 s). The failing
rank first prints one line naming itself. The patching happens here, in the test
helper: the library has no fault hooks.

`settings cases.json OUTDIR` calls `minipar.__main__.main(["train", *flags])` for
every case in the file (a list of flag lists) in this one process, capturing what
each prints, and writes `OUTDIR/rank<r>.json` with each case's exit code, stdout,
stderr and seconds: many refusals for one mpiexec start-up.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

from mpi4py import MPI

from minipar.checkpoint import shard_files
from minipar.comm.job import abort_on_exception


def die(mode: str, rank: int, where: str, seconds: float = 60) -> None:
    """Fail the way `mode` says, after one line saying who and where."""
    print(f"rank {rank}: injected {mode} {where}", file=sys.stderr, flush=True)
    if mode == "raise":
        raise RuntimeError(f"injected failure on rank {rank} {where}")
    if mode in ("exit", "exit0"):   # exit0: a rank that leaves alone "successfully"
        raise SystemExit(0 if mode == "exit0" else 3)
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "sleep":
        time.sleep(seconds)
        return
    os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)


def inject(spec: str) -> None:
    """Patch the library so that world rank RANK fails as `spec` = MODE:RANK[:STEP] says."""
    from minipar.checkpoint import save_load
    from minipar.run import diloco_train, mesh_step

    mode, rank, *step = spec.split(":")
    if int(rank) != MPI.COMM_WORLD.Get_rank():
        return
    if mode in ("killsave", "raisesave", "interruptsave", "slowsave", "holdsave"):
        write = shard_files.write_shard

        def write_shard(*args: object, **kwargs: object) -> dict:
            if mode == "slowsave":
                time.sleep(float(step[0]))
                return write(*args, **kwargs)
            if mode == "holdsave":   # until the test says: FILE (a path without ':')
                deadline = time.monotonic() + 60
                while not os.path.exists(step[0]) and time.monotonic() < deadline:
                    time.sleep(0.02)
                return write(*args, **kwargs)
            die(mode.removesuffix("save"), int(rank), "while writing its checkpoint shard")
        save_load.write_shard = write_shard
        return
    if mode == "killmanifest":
        def write_manifest(*args: object, **kwargs: object) -> None:
            die("kill", int(rank), "while writing the manifest")
        save_load.write_manifest = write_manifest
        return
    original = mesh_step.step_batch

    def step_batch(cfg: object, index: int, *rows: object) -> object:
        if index + 1 == int(step[0]):
            die(mode, int(rank), f"at step {index + 1}", *(float(s) for s in step[1:]))
        return original(cfg, index, *rows)
    mesh_step.step_batch = step_batch   # a mesh step's rows,
    diloco_train.step_batch = step_batch  # and a DiLoCo worker's


def settings(cases_file: str, out: str) -> None:
    """Run every case's `train` flags in this process; record what each returned and printed."""
    from minipar.__main__ import main

    results = []
    for flags in json.loads(Path(cases_file).read_text()):
        stdout, stderr = io.StringIO(), io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["train", *flags])
        results.append({"flags": flags, "code": code, "stdout": stdout.getvalue(),
                        "stderr": stderr.getvalue(), "seconds": time.perf_counter() - start})
    rank = MPI.COMM_WORLD.Get_rank()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "fault":
        inject(sys.argv[2])
        from minipar.__main__ import run

        sys.argv = ["minipar", *sys.argv[3:]]
        run()
    else:
        # one rank's surprise must not leave the others waiting
        abort_on_exception(lambda: settings(sys.argv[2], sys.argv[3]))
