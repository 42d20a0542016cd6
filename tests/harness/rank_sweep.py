"""Rank side of `tests.harness.mpi.sweep`: train several configs in one MPI job.

    mpiexec -n 8 python -m tests.harness.rank_sweep configs.json OUTDIR

A config {"cli": [argv...]} is a command line run through `python -m minipar`'s main
instead: rank 0 writes its exit code and output to OUTDIR/<i>/cli.json.
Rank 0 writes each run's dump to OUTDIR/<i>/, plus `memory.json`: every rank's
measured bytes of parameters, gradients and optimizer state (a list by world
rank; `RunResult.extras["memory"]`), `scores.json`: every rank's attention
score entries per block in the last forward (`extras["attention_scores"]`), and
`rank_gnorms.json`: every rank's global gradient norm of each step (`extras["gnorms"]`,
with --clip-grad-norm), and `rank_mixed.json`: every rank's loss scale, skipped steps and
per-step (S, skipped) history (--mixed; nulls without).
A ReplicaError (--mixed: raised on every rank at the same step) is written to
`replica_error.txt` in the run's folder, and the sweep goes on.
Any other exception on any rank aborts the job (as `python -m mpi4py` does) with that
rank's traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpi4py import MPI

from minipar.comm.job import abort_on_exception, wait_for_rank0
from minipar.run.agreement import ReplicaError
from minipar.run.results import dump
from minipar.run.train import problems, train
from minipar.settings.config import TrainConfig


def command_line(world: MPI.Comm, argv: list[str], folder: Path) -> None:
    """`python -m minipar <argv>` in this job (every rank); rank 0 writes its exit code and
    what it printed (stdout and stderr) to folder/cli.json."""
    import contextlib
    import io

    from minipar.__main__ import main as minipar_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = minipar_main(argv)
    if world.Get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cli.json").write_text(json.dumps({"code": code, "out": printed.getvalue()}))
    wait_for_rank0(world)


def main() -> None:
    world = MPI.COMM_WORLD
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for i, fields in enumerate(configs):
        if "cli" in fields:   # a command line, run as `python -m minipar` runs it
            command_line(world, fields["cli"], out / str(i))
            continue
        cfg = TrainConfig(**fields).resolved(world.Get_size())
        errors = problems(cfg, world.Get_size())
        if errors:
            raise SystemExit(f"config {i} {fields}: {errors[0]}")
        try:
            result = train(cfg, world)
        except ReplicaError as error:   # raised on every rank at the same step: all go on
            if world.Get_rank() == 0:
                (out / str(i)).mkdir(parents=True, exist_ok=True)
                (out / str(i) / "replica_error.txt").write_text(str(error))
            continue
        # every rank's measured model-state bytes -> rank 0, for memory.json
        memory = world.gather(vars(result.extras["memory"]))
        # every rank's attention score entries per block (context parallelism's work)
        scores = world.gather(result.extras["attention_scores"])
        # every rank's global gradient norm per step (--clip-grad-norm; [] without)
        norms = world.gather(result.extras["gnorms"])
        # --mixed: every rank's S, skipped steps and per-step (S, skipped) history
        mixed = world.gather({key: result.extras.get(key)
                              for key in ("loss_scale", "skipped", "scale_history")})
        if world.Get_rank() == 0:
            dump(out / str(i), cfg, result)
            (out / str(i) / "memory.json").write_text(json.dumps(memory))
            (out / str(i) / "scores.json").write_text(json.dumps(scores))
            (out / str(i) / "rank_gnorms.json").write_text(json.dumps(norms))
            (out / str(i) / "rank_mixed.json").write_text(json.dumps(mixed))
        wait_for_rank0(world)  # the others asleep while rank 0 writes (not spinning in the next)


if __name__ == "__main__":
    abort_on_exception(main)
