"""`python -m minipar ...`: the command line.

    mpiexec -n 8 python -m minipar train --dp 2 --tp 2 --pp 2 --check
    python -m minipar mesh --dp 2 --tp 2 --pp 2
    python -m minipar bugs             (the bugs --inject-bug NAME breaks a run with)
    python -m minipar exercise list    (self-grading exercises: start, hint, check)
    python -m minipar trace DIR        (where each rank's time went in a `train --trace DIR`)
    mpiexec -n 2 python -m minipar reshard CHECKPOINT NEW --tp 2   (one rank: the full state)

Failures are collective. A bad setting is found by every rank alone (a pure
check of the flags, before any communication); rank 0 prints one line and
every rank exits 2. An exception on any one rank after that aborts the whole
job (`MPI_Abort`, as `python -m mpi4py` does), so no rank waits forever in a
collective its dead partner will never join.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from minipar.bugs.catalog import injected, listing
from minipar.checkpoint import save_load, shard_files
from minipar.checkpoint.owner import NEW_RUN, ownership_problems
from minipar.checkpoint.save_load import FolderInUseError, holding
from minipar.checkpoint.shard_files import CheckpointError
from minipar.comm import watchdog
from minipar.comm.mesh import MeshShape
from minipar.core import routing
from minipar.placement import PlacementError
from minipar.run.agreement import DivergedError, ReplicaError
from minipar.run.diloco_train import train_workers
from minipar.run.mesh_step import train_on_mesh
from minipar.run.results import check, dump, gather_decisions
from minipar.run.resume_check import check_problems
from minipar.run.train import problems
from minipar.settings import preflight
from minipar.settings.config import ConfigError
from minipar.settings.flags import Parser, config_from_args, make_parser


def _world():
    from mpi4py import MPI  # here: `plan`, `bugs`, `mesh` and the tests run without MPI

    return MPI.COMM_WORLD


def fail(rank: int, message: str, code: int = 2) -> int:
    """One line from rank 0; the same exit code on every rank."""
    if rank == 0:
        print(f"minipar: error: {message}", file=sys.stderr, flush=True)
    return code


# ------------------------------------------------------------------- train
def train_command(argv: list[str]) -> int:
    world = _world()
    rank = world.Get_rank()
    parser = make_parser()
    parser.add_argument("--check", action="store_true",
                        help="also run the single-process reference and compare")
    parser.add_argument("--dump", metavar="DIR", help="write init/final params, data, losses")
    parser.add_argument("--ledger", action="store_true",
                        help="print the communication ledger of the last step")
    parser.add_argument("--flight", metavar="DIR", default=None,
                        help="where every rank writes its last calls (rank{r}.json) when the "
                        "watchdog fires, on an abort or on SIGUSR1 (default minipar-flight/, "
                        "made only then); `python -m minipar flight DIR` reads them")
    try:
        args = parser.parse_args(argv)
        cfg = config_from_args(args).resolved(world.Get_size())
        errors = problems(cfg, world.Get_size())
        if not errors:   # the --dump folder too (preflight.py), still no talking
            errors = preflight.dump_problems(args.dump, "train") + \
                preflight.flight_problems(args.flight, cfg.trace)
        if not errors and args.check:   # a resumed run checked against its own flags
            errors = check_problems(cfg)
    except ConfigError as error:
        errors = [str(error)]
    from minipar.comm.job import agreed  # every rank's refusal reaches every rank (job.py)

    errors = agreed(world, errors, ["train", *argv])
    if errors:
        return fail(rank, errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))

    def progress(step: int, loss: float, gnorm: float | None = None,
                 scale: float | None = None, skipped: int | None = None) -> None:
        if rank == 0:  # gnorm: --clip-grad-norm's global gradient norm, before clipping
            print(f"step {step + 1:4d}  loss {loss:.6f}"
                  + ("" if gnorm is None else f"  gnorm {gnorm:.6f}")
                  # --mixed: the loss scale after this step and the steps skipped so far
                  + ("" if scale is None else f"  S {scale:g}  skipped {skipped}"),
                  flush=True)

    if world.Get_size() > 1:   # the flight recorder's dumps (flight.py): on a hang, an
        from minipar.comm import flight  # abort or SIGUSR1 (here: arming it talks over MPI)

        flight.arm(args.flight, world)
    if cfg.timeout and world.Get_size() > 1:   # a rank stuck in one call that long ends
        from minipar.comm.job import abort_all  # the job (here: comm/job.py loads mpi4py.MPI)

        watchdog.start(cfg.timeout, rank, abort_all)
    try:
        # --check: the routing choices recorded, to replay them in one process (results.py)
        # run/train.py's `train` less its check of problems() (made above, agreed by every
        # rank): --inject-bug swaps one piece for a broken one (lesson 08), --outer diloco
        # trains every dp replica as a worker of its own (diloco_train.py)
        loop = train_workers if cfg.outer == "diloco" else train_on_mesh
        with holding(world, cfg.save), routing.recording(args.check) as chosen, \
                injected(cfg.inject_bug) if cfg.inject_bug else nullcontext():
            result = loop(replace(cfg, inject_bug=None), world, on_step=progress)
    except CheckpointError as error:   # on every rank alike: the folder is taken (before the
        return fail(rank, str(error), code=2 if isinstance(error, FolderInUseError) else 1)  # first
        # step, exit 2), or a save failed (the previous checkpoint kept, exit 1)
    except (DivergedError, ReplicaError) as error:  # raised on every rank at the same step:
        return fail(rank, str(error), code=1)       # no abort needed
    except PlacementError as error:  # --check-placements: every rank of a stage runs the
        # same ops, so without a pipeline every rank raises it at the same op; a pipeline's
        # other stages may be waiting for this one: one line from its first rank, then abort
        if cfg.pp == 1:
            return fail(rank, str(error), code=1)
        coords = cfg.mesh_shape().coords(rank)
        from minipar.comm.job import abort_all  # here: comm/job.py loads mpi4py.MPI

        abort_all(f"minipar: error: {error}\n" if coords["dp"] == coords["tp"] == 0 else "")
    finally:
        watchdog.stop()
    if world.Get_size() > 1:   # (an exception keeps it armed: the abort that follows dumps)
        from minipar.comm import flight

        flight.disarm()
    if args.ledger and rank == 0:
        from minipar.teaching.ledger_tables import ledger_table  # loads the planner: only here

        history = result.extras.get("scale_history") or [(1.0, False)]   # fp16's last skip
        print(ledger_table(result.ledger, cfg, skipped=bool(history[-1][1])), flush=True)
    if args.dump and rank == 0:
        dump(Path(args.dump), cfg, result)
    verdict = 0
    if args.check:
        from minipar.comm.job import wait_for_rank0  # here: comm/job.py loads mpi4py.MPI
        from minipar.teaching.ledger_tables import check_ledger  # the planner's formulas

        decisions = gather_decisions(world, cfg, result, chosen)   # every rank: one gather
        verdict = check(cfg, result, decisions, check_ledger) if rank == 0 else 0
        wait_for_rank0(world)  # the others asleep while rank 0 reruns the job alone
        verdict = world.bcast(verdict, root=0)
    if rank == 0:
        print(f"done: {cfg.steps} steps on dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}"
              + (f" ep={cfg.ep}" if cfg.model_config().is_moe else "")
              + (f" cp={cfg.cp} ({cfg.cp_mode})" if cfg.cp > 1 else "")
              + f", final loss {result.losses[-1]:.6f}"
              + (f" (with the bug {cfg.inject_bug} injected)" if cfg.inject_bug else ""),
              flush=True)
    return verdict


# -------------------------------------------------------------------- mesh
MESH_TABLE_LIMIT = 4096


def mesh_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar mesh",
                                     description="Print which rank is in which group.")
    for axis in ("dp", "tp", "pp", "ep", "cp"):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks the mesh must fill (default: dp*cp*tp*pp)")
    args = parser.parse_args(argv)
    shape = MeshShape(args.dp, args.tp, args.pp, args.ep, args.cp)
    errors = shape.problems(shape.world if args.world is None else args.world)
    if not errors and shape.world > MESH_TABLE_LIMIT:   # one row per rank: keep it readable
        errors = [f"the mesh dp*tp*pp = {shape.world} ranks is more rows than a table can "
                  f"show (at most {MESH_TABLE_LIMIT}): the same shape with smaller sizes "
                  "shows the same pattern"]
    if errors:
        return fail(0, errors[0])
    print(shape.table())
    return 0


def generate_command(argv: list[str]) -> int:
    """`python -m minipar generate ...`: prefill and decode with a KV cache (generate.py)."""
    from minipar.run.generate import command  # here: the ranks talk (mpi4py.MPI)

    return command(argv, _world())


def tour_command(argv: list[str]) -> int:
    from minipar.teaching.tour import main as tour  # here: a `train` rank never loads it

    return tour(argv)


def reshard_command(argv: list[str]) -> int:
    """`python -m minipar reshard SRC DST [--dp --tp --pp --ep --virtual --cp]`: rewrite a
    checkpoint for another mesh without training (one rank, no flags: the full state)."""
    from minipar.run.reshard import (
        reshard,  # here: loads mpi4py.MPI, which `plan`/`bugs` never need
    )
    from minipar.settings.validation import size_problems as config_size_problems

    world = _world()
    rank, size = world.Get_rank(), world.Get_size()
    parser = Parser(prog="python -m minipar reshard",
                    description="Rewrite a checkpoint for the mesh of this job.")
    for axis, default in (("dp", None), ("tp", 1), ("pp", 1), ("ep", 1), ("virtual", 1),
                          ("cp", 1)):
        parser.add_argument(f"--{axis}", type=int, default=default,
                            help=f"the new mesh's {axis} (default: dp fills the job)"
                            if axis == "dp" else f"the new mesh's {axis}")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per step on the new mesh (default: the saved "
                        "run's, or the least the new mesh's schedule needs)")
    parser.add_argument("source", metavar="SRC", help="the checkpoint folder to read")
    parser.add_argument("destination", metavar="DST", help="the checkpoint folder to write")
    try:
        args = parser.parse_args(argv)
    except ConfigError as error:   # (the other ranks meet this allgather further down)
        from minipar.comm.job import agreed

        return fail(rank, (agreed(world, [str(error)], ["reshard", *argv]) or [""])[0])
    errors = [f"SRC {message}" for message in preflight.path_problems(args.source)
              or shard_files.verify(args.source)]
    if not errors:
        mesh = {axis: getattr(args, axis) for axis in ("dp", "tp", "pp", "ep", "virtual", "cp",
                                                         "microbatches")}
        manifest = shard_files.read_manifest(Path(args.source))
        cfg = shard_files.config_for(manifest, **mesh).resolved(size)
        if args.microbatches is None and not config_size_problems(cfg, size):
            cfg = shard_files.for_mesh(cfg)   # derive what the new mesh needs
        errors = problems(cfg, size) + [f"DST {message}" for message in
                                         preflight.folder_problems(args.destination)]
        if not errors:   # DST holds only this run's older steps (checkpoint/owner.py)
            errors = ownership_problems(args.destination, manifest.get("run") or NEW_RUN,
                                        save_load.model_of(cfg), manifest["step"], "DST")
    from minipar.comm.job import agreed  # every rank's refusal reaches every rank (job.py)

    errors = agreed(world, errors, ["reshard", *argv])
    if errors:
        return fail(rank, errors[0])
    reshard(cfg, world, args.source, args.destination)
    if rank == 0:
        print(f"resharded {args.source} (step {manifest['step']}, saved on "
              f"{manifest['mesh']['world']} ranks) -> {args.destination} for dp={cfg.dp} "
              f"tp={cfg.tp} pp={cfg.pp} ep={cfg.ep}" + (f" cp={cfg.cp}" if cfg.cp > 1 else "")
              + f" ({size} shard files)", flush=True)
    return 0


def bugs_command(argv: list[str]) -> int:
    """`python -m minipar bugs`: the bugs `train --inject-bug NAME` can inject (no MPI)."""
    argparse.ArgumentParser(prog="python -m minipar bugs",
                            description="List the bugs of lesson 08.").parse_args(argv)
    print(listing())
    return 0


def plan_command(argv: list[str]) -> int:
    """`python -m minipar plan ...`: rank the ways to split a job at real scale (no MPI)."""
    from minipar.planner.plan import plan_command  # here: a `train` rank never loads it

    return plan_command(argv)


def flight_command(argv: list[str]) -> int:
    """`python -m minipar flight DIR [--all]`: the first disagreement among the ranks' last
    calls (flight_report.py, no MPI); bad input is one line and exit 2."""
    from minipar.comm.flight_files import FlightError, load
    from minipar.comm.flight_report import table, verdict

    parser = Parser(prog="python -m minipar flight",
                     description="Line up the flight recorder's dumps of a hung or aborted "
                     "job and name the first disagreement.")
    parser.add_argument("folder", metavar="DIR", help="the --flight folder (rank{r}.json)")
    parser.add_argument("--all", action="store_true", help="also print the aligned table")
    try:
        args = parser.parse_args(argv)
        dumps = load(args.folder)
    except (ConfigError, FlightError) as error:
        return fail(0, str(error))
    if args.all:
        print(table(dumps))
    print(verdict(dumps))
    return 0


def trace_command(argv: list[str]) -> int:
    """`python -m minipar trace DIR [--plot FILE] [--simulated FILE]`: read a --trace run."""
    from minipar.teaching.trace_report import main as trace_report  # matplotlib only when drawing

    return trace_report(argv)


def exercise_command(argv: list[str]) -> int:
    """`exercise list | start NAME DIR | hint NAME | solution NAME | check NAME [DIR]`."""
    from minipar.exercises.command import main as exercise  # MPI-free; only its job talks

    return exercise(argv)


COMMANDS = {"train": train_command, "mesh": mesh_command, "tour": tour_command,
            "reshard": reshard_command, "bugs": bugs_command, "plan": plan_command,
            "exercise": exercise_command, "generate": generate_command,
            "flight": flight_command, "trace": trace_command}


def launcher_rank() -> str:
    """This process's rank as the launcher tells it (no MPI needed to read it)."""
    return os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


def main(argv: list[str]) -> int:
    """Run one command (`main(["train", "--dp", "2"])`) and return its exit code; `run` is
    the same with the job's handling of what leaves it."""
    return chosen(argv)(argv[1:])


def chosen(argv: list[str]) -> Callable[[list[str]], int]:
    """The command `argv` names, or one that prints the usage and returns 2. With --help,
    every rank parses and rank 0 alone prints."""
    if {"-h", "--help"} & set(argv[1:]) and launcher_rank() != "0":
        sys.stdout = open(os.devnull, "w")
    return COMMANDS[argv[0]] if argv and argv[0] in COMMANDS else usage


def usage(argv: list[str]) -> int:
    """No command, or one we do not know: the usage line, exit 2."""
    print(f"usage: python -m minipar {{{','.join(COMMANDS)}}} [flags]  "
          "(add --help after a command)", file=sys.stderr)
    return 2


# Commands whose ranks talk: a rank that leaves on its own strands the others.
TALKING = ("train", "reshard", "tour", "generate")


def run() -> None:
    """Entry point: the command, and the one handler of what may leave it.

    Like `python -m mpi4py`, an exception on one rank of a job aborts every rank (its
    traceback first; Ctrl-C is one line, exit 130). A SystemExit inside a command whose
    ranks talk is one rank leaving on its own, whatever its code, 0 included (ranks that
    leave alike return an exit code instead; only --help leaves by SystemExit on every
    rank): it ends the job too, or its partners would wait forever. When the reader of
    our output has left (`python -m minipar plan ... | head`), we stop quietly, exit 0.
    One process has no partner to strand: a traceback and exit 1 suffice."""
    argv = sys.argv[1:]
    command = chosen(argv)
    try:
        code = command(argv[1:])
    except BaseException as error:   # each kind of leaving in turn (`leave`)
        leave(error, argv)
    sys.exit(code)


def leave(error: BaseException, argv: list[str]) -> NoReturn:
    """End this process (and, on a rank of a job that talks, the job) for `error`."""
    many = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))) > 1
    if isinstance(error, BrokenPipeError):   # our reader left: leave as if with exit 0
        sys.stderr.close()
        error = SystemExit(0)
    if isinstance(error, SystemExit):
        helping = error.code in (None, 0) and {"-h", "--help"} & set(argv[1:])
        if not many or helping or argv[:1] not in [[name] for name in TALKING]:
            raise error from None
        from minipar.comm.job import abort_all  # here: comm/job.py loads mpi4py.MPI

        if sys.stderr.closed:   # our reader left (a closed pipe): end the job quietly
            _world().Abort(0)
        abort_all(f"minipar: rank {launcher_rank()} left on its own "
                  f"(SystemExit({error.code!r})) while its partners ran on: ending the job\n",
                  error.code if isinstance(error.code, int) and error.code else 1)
        raise error from None
    if many:
        from minipar.comm.job import abort_for  # here: comm/job.py loads mpi4py.MPI

        abort_for(error, label="minipar: ")
    if isinstance(error, KeyboardInterrupt):
        sys.stderr.write("minipar: interrupted (Ctrl-C)\n")
        raise SystemExit(130) from None
    sys.stderr.write(f"minipar: rank 0 failed:\n{traceback.format_exc()}")
    raise SystemExit(1) from None


if __name__ == "__main__":
    run()
