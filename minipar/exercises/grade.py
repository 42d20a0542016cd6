"""Rank side of `python -m minipar exercise check`: run the exercises' checks in one job.

    mpiexec -n 4 python minipar/exercises/sealed.py NAME [NAME ...]   (from the student's folder;
    sealed.py, the grading package's own, runs this file's `main`)

Each check returns None or one sentence a student can act on: which tensor, which
rank, by how much, which collective's count differs. Ranks agree on every verdict
before the next check. A check that raises on some ranks (a stub's
NotImplementedError, a student's bug) becomes that verdict on the ranks that raised;
if their partners are stuck in a collective meanwhile, a raising rank gives up
waiting for them after `AGREE_SECONDS` and ends the job with its verdict, and the
watchdog names the call any rank sits in for longer than `STUCK_SECONDS`.
Rank 0 prints one `exercise NAME: passed` or `exercise NAME: FAILED` line per
exercise, then the sentence.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import numpy as np
from mpi4py import MPI

import minipar
from minipar import exercises
from minipar.comm import watchdog
from minipar.comm.job import abort_all
from minipar.exercises import units, units_attention
from minipar.run import agreement
from minipar.run import train as training
from minipar.run.reference import RunResult
from minipar.run.results import (
    TOLERANCE,
    mixed_tolerance,
    moved_difference,
    relative_difference,
)
from minipar.settings.config import TrainConfig
from minipar.teaching.ledger_tables import predicted_ledgers

AGREE_SECONDS = 20.0
STUCK_SECONDS = 30.0
DEADLINE_SECONDS = float(os.environ.get("MINIPAR_EXERCISE_DEADLINE", "40"))  # one check at
# most (tiny shapes take seconds); then the job ends, saying where it is stuck
VERDICT = "minipar: exercise verdict: "  # how command.py finds a verdict in an ended job
UNITS = {**units.UNITS, **units_attention.UNITS}   # unit check kind -> check(world)


def flags(fields: dict) -> str:
    """The `train` command line of a check's config (for the report)."""
    small = {**exercises.SMALL, **exercises.SMALL_GPT}
    shown = {k: v for k, v in fields.items() if k == "model" or k not in small}
    return "train " + " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                               for k, v in shown.items())


# ------------------------------------------------------------ training checks
@contextlib.contextmanager
def held_pieces() -> Iterator[list]:
    """While in the block, `agreement.gather_full_params` also keeps what this rank holds at
    the end: (name, full_index, copy of data) of each parameter, in the list yielded."""
    pieces: list = []
    original = agreement.gather_full_params

    def recording(mesh, params, cfg, values=None):  # noqa: ANN001, ANN202 (same signature)
        if values is None:  # the final parameters (the init call passes values)
            pieces[:] = [(p.name, p.full_index, np.array(p.data)) for p in params]
        return original(mesh, params, cfg, values)
    agreement.gather_full_params = recording
    try:
        yield pieces
    finally:
        agreement.gather_full_params = original


def compare_params(pieces: list, reference: dict, tolerance: float) -> list[tuple]:
    """(name, relative, absolute) for each piece this rank holds that differs."""
    bad = []
    for name, index, data in pieces:
        ref = reference[name] if index is None else reference[name][index]
        rel = relative_difference(data, ref, floor=1e-12)
        if not rel <= tolerance:  # NaN counts as different
            bad.append((name, rel, float(np.max(np.abs(data - ref))) if ref.size else 0.0))
    return bad


def compare_ledger(records: list[dict], cfg: TrainConfig) -> str | None:
    """The first (rank, group, op) whose calls or elements differ from the formulas."""
    predicted = predicted_ledgers(cfg)
    for rank in sorted(predicted):
        measured = {(r["group"], r["op"]): (r["calls"], r["elements"])
                    for r in records if r["rank"] == rank}
        for key in sorted(set(measured) | set(predicted[rank])):
            got, want = measured.get(key, (0, 0)), predicted[rank].get(key, (0, 0))
            same = got[0] == want[0] and (key[1] == "Alltoallv" or got[1] == want[1])
            if not same:
                return (f"the ledger of the last step differs: rank {rank} made {got[0]} "
                        f"{key[1]} call(s) over {key[0]} moving {got[1]} elements; the "
                        f"formulas say {want[0]} call(s), {want[1]} elements")
    return None


def check_train(fields: dict, world: MPI.Comm) -> str | None:
    """Train `fields` on the mesh and in one process; compare losses, every rank's
    parameters, the replicas, and the ledger."""
    cfg = TrainConfig(**fields).resolved(world.Get_size())
    errors = training.problems(cfg, world.Get_size())
    if errors:
        return f"the check's own config is refused: {errors[0]}"
    with held_pieces() as pieces:
        result = training.train(cfg, world)
    reference = training.train_reference(cfg)  # tiny: every rank runs its own
    if cfg.mixed:   # 16 bits: not 1e-9, the derived tolerance (run/results.py)
        return world.bcast(mixed_verdict(cfg, result, reference)
                           if world.Get_rank() == 0 else None)
    tolerance = TOLERANCE[cfg.dtype]
    first_loss = relative_difference(result.losses[:1], reference.losses[:1])
    bad = compare_params(pieces, reference.final, tolerance)
    verdicts = world.allgather(bad)
    if first_loss > tolerance:
        return (f"the loss of step 1 is {result.losses[0]:.12g}, one process says "
                f"{reference.losses[0]:.12g} (relative {first_loss:.2e}): the forward pass "
                "already differs, before any gradient or update")
    for rank, rank_bad in enumerate(verdicts):
        if rank_bad:
            name, rel, diff = rank_bad[0]
            count = len({b[0] for v in verdicts for b in v})
            return (f"after {cfg.steps} steps the parameter {name} on rank {rank} differs "
                    f"from one process by {rel:.2e} relative (max abs {diff:.2e}; tolerance "
                    f"{tolerance:g}); {count} parameter(s) differ. The loss of step 1 agrees, "
                    "so look at the backward pass and the gradient synchronization")
    if world.Get_rank() == 0:
        disagree = result.extras.get("replica_disagreements", [])
        verdict = (f"replicas disagree: {disagree[0]}" if disagree
                   else compare_ledger(result.ledger, cfg))
    else:
        verdict = None
    return world.bcast(verdict)


def mixed_verdict(cfg: TrainConfig, result: RunResult,
                  reference: RunResult) -> str | None:
    """A --mixed check on rank 0: S and the skipped steps equal to one process's, losses
    and the parameters' movement within the derived tolerance, then the ledger. (A
    replica that differs, S above all, has stopped the run already: ReplicaError.)"""
    got = (result.extras["loss_scale"], result.extras["skipped"])
    want = (reference.extras["loss_scale"], reference.extras["skipped"])
    if got != want:
        return (f"after {cfg.steps} steps S is {got[0]:g} with {got[1]} step(s) skipped; one "
                f"process says S {want[0]:g} with {want[1]} skipped: look at the scaler's "
                "rule (halve and skip on an overflow, double after a window of clean steps)")
    loss_tol, param_tol = mixed_tolerance(cfg)
    loss_rel = relative_difference(result.losses, reference.losses)
    if loss_rel > loss_tol:
        return (f"the losses differ from one process by {loss_rel:.2e} relative, beyond the "
                f"derived tolerance {loss_tol:.2e} of {cfg.mixed}")
    moved, where = moved_difference(result.final, reference.final, reference.init)
    if moved > param_tol:
        return (f"after {cfg.steps} steps {where} differs from one process by {moved:.2e} of "
                f"its movement, beyond the derived tolerance {param_tol:.2e}: was a step "
                "taken that one process skipped, or skipped that it took?")
    return compare_ledger(result.ledger, cfg)


# ------------------------------------------------------------------ the driver
def run_check(kind: str, fields: dict, world: MPI.Comm) -> str | None:
    """One check on this rank: its verdict, or the exception it raised, in words."""
    try:
        if kind == "train":
            return check_train(fields, world)
        return UNITS[kind](world)
    except SystemExit as leaving:   # sys.exit in a check's code: say so, in plain words
        frames = traceback.extract_tb(leaving.__traceback__)
        ours = [f for f in frames if "/minipar/" in f.filename] or frames
        where = f"{ours[-1].filename.split('/minipar/')[-1]}:{ours[-1].lineno}"
        return (f"rank {world.Get_rank()} called sys.exit({leaving.code!r}) at {where}: the "
                "code must return its result, not end the process")
    except Exception as error:  # a stub, or a student's bug: the verdict, not a crash
        frames = traceback.extract_tb(error.__traceback__)
        ours = [f for f in frames if "/minipar/" in f.filename] or frames  # not numpy's
        where = f"{ours[-1].filename.split('/minipar/')[-1]}:{ours[-1].lineno}"
        return f"rank {world.Get_rank()} raised {type(error).__name__} at {where}: {error}"


def agree(world: MPI.Comm, verdict: str | None) -> str | None:
    """Every rank's verdict -> the first one that is not None, on every rank. A rank
    whose partners never arrive (stuck in a collective it left) ends the job."""
    request = world.Ibarrier()
    deadline = time.monotonic() + AGREE_SECONDS
    while not request.Test():
        if verdict is not None and time.monotonic() > deadline:
            abort_all(f"{VERDICT}{verdict} (the other ranks did not finish the check: they "
                      "wait in a collective this rank left)\n")
        time.sleep(0.005)
    return next((v for v in world.allgather(verdict) if v is not None), None)


def where_stuck(rank: int, seconds: float) -> str:
    """The timeout's verdict: the step and the call (the watchdog's stamps), and the line
    of the package the main thread is on (its innermost frame in minipar/)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    line = "?"
    while frame is not None:
        if "/minipar/" in frame.f_code.co_filename and "exercises/" not in \
                frame.f_code.co_filename:
            line = (f"{frame.f_code.co_filename.split('/minipar/')[-1]}:{frame.f_lineno} in "
                    f"{frame.f_code.co_name}")
            break
        frame = frame.f_back
    stamp = watchdog._waiting
    call = f"waiting in {stamp[1]}" if stamp else "in no MPI call (computing, or a loop)"
    return (f"timeout: after {seconds:g} s rank {rank} is still at {watchdog._doing}, {call}, "
            f"at {line}: a loop that never ends, or a call its partners never make")


def start_deadline(seconds: float, rank: int) -> threading.Timer:
    """End the job with `where_stuck`'s verdict unless cancelled within `seconds`."""
    def expire() -> None:
        abort_all(f"{VERDICT}{where_stuck(rank, seconds)}\n")
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def main(names: list[str], seal: Callable[[str], str] = str) -> int:
    """Grade each exercise in turn; returns 0 if all passed, 1 otherwise. `seal` marks each
    exercise's verdict line (exercises/sealed.py: the run's secret word, which no line the
    student's code prints carries)."""
    world = MPI.COMM_WORLD
    watchdog.start(STUCK_SECONDS, world.Get_rank(), abort_all)
    failed = 0
    for name in names:
        exercise = exercises.get(name)
        verdict = None
        for number, (kind, fields) in enumerate(exercise.checks, 1):
            what = flags(fields) if kind == "train" else f"the {kind} check"
            deadline = start_deadline(DEADLINE_SECONDS, world.Get_rank())
            verdict = agree(world, run_check(kind, fields, world))
            deadline.cancel()
            if verdict is not None:
                verdict = f"check {number} of {len(exercise.checks)} ({what}): {verdict}"
                break
        failed += verdict is not None
        if world.Get_rank() == 0:
            line = "passed" if verdict is None else "FAILED"
            print(seal(f"exercise {name}: {line} ({len(exercise.checks)} checks on "
                       f"{world.Get_size()} ranks, code from "
                       f"{minipar.__file__.rsplit('/', 2)[0]})")
                  + ("" if verdict is None else f"\n  {verdict}"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
