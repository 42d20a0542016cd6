"""Printing from many ranks without a scramble.

What this file teaches: every rank of an MPI job writes to the same terminal,
and lines from different processes arrive in whatever order the operating
system delivers them. A lesson that wants "rank 0, then rank 1, then ..." must
make it so: every rank sends its text to one rank, which prints them in order.

    say(rank, "holds", x)              # one line, now, prefixed "[rank 3]"
    say_in_order(mesh.world, text)     # every rank's text, in rank order
    verdict(ok)                        # "OK" or "MISMATCH", and a failed check is counted
    run_collectively(main)             # a lesson's entry: one failing rank stops them all,
                                       # and a failed check makes every rank exit 1
    agreed(world, errors, argv)        # a command's refusal on any rank reaches all of them
    abort_on_exception(main)           # any rank program: one failing rank stops them all
                                       # (abort_for: what `python -m minipar` calls itself);
                                       # an error MPI raises is one line and the verdict

Used by the lessons: `mpiexec -n 4 python lessons/00_collectives.py`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

from mpi4py import MPI

from minipar.core.refusal import RefusalError

if TYPE_CHECKING:
    from minipar.comm.collectives import Group

T = TypeVar("T")


def prefix(rank: int) -> str:
    """The tag in front of every line a rank prints."""
    return f"[rank {rank}]"


def say(rank: int, *args: object) -> None:
    """Print one line tagged with `rank`, at once (lines of different ranks may interleave)."""
    print(prefix(rank), *args, flush=True)


def say_in_order(comm: Group | MPI.Comm, text: str) -> None:
    """Print every rank's `text` in rank order, each line tagged with its world rank.

    A collective: every rank of `comm` must call it. The texts are gathered to
    the group's rank 0, which prints them all in one write. When `comm` is a
    `comm.Group`, its ledger is paused: printing is not the model's traffic.
    """
    ledger = getattr(comm, "ledger", None)
    was_enabled = ledger.enabled if ledger is not None else False
    if ledger is not None:
        ledger.enabled = False
    try:
        # (world rank, text) of every rank -> the group's rank 0
        texts = comm.gather((MPI.COMM_WORLD.Get_rank(), text), root=0)
    finally:
        if ledger is not None:
            ledger.enabled = was_enabled
    if texts is None:
        return
    lines = [f"{prefix(rank)} {line}" for rank, block in texts for line in block.split("\n")]
    print("\n".join(lines), flush=True)


_FAILED: list[str] = []  # the checks this process saw fail (see `verdict`)
_PASSED: list[str] = []  # and the ones it saw pass


def verdict(ok: bool, good: str = "OK", bad: str = "MISMATCH") -> str:
    """The word a lesson prints after a check, and the check remembered: when a lesson
    run through `run_collectively` saw any check fail, every rank exits 1, so a lesson
    that stops proving what it claims fails `make course` and the tests."""
    (_PASSED if ok else _FAILED).append(good if ok else bad)
    return good if ok else bad


def refuse_together(main: Callable[[], object]) -> Callable[[], object]:
    """`main`, where a RefusalError (a setting every rank finds alike: the flags, the world
    size, `train`'s own checks; config.ConfigError is one) is one line from rank 0 and
    exit 2 on every rank."""
    def refusing() -> object:
        try:
            return main()
        except RefusalError as error:
            if MPI.COMM_WORLD.Get_rank() == 0:
                print(f"minipar: error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    return refusing


def agreed(world: MPI.Comm, errors: list[str], settings: object) -> list[str]:
    """The refusals of a command after every rank parsed its flags, the same verdict on
    every rank: one allgather over `world`, the first collective of the command.

    Each rank checks its own flags and files alone (a `--data` path present on one host
    only, a launch whose ranks were given different flags): without this, a rank that
    refuses leaves, and the ones that accepted wait forever in their first collective.
    Here every rank hands in its first refusal and its `settings` (the command line);
    if any rank refused, or a rank's settings differ from rank 0's, every rank gets a
    non-empty list back (so every rank exits 2) whose first line is what rank 0 prints:
    its own refusal, else "rank 1 refused: --layers must be at least 1", else the rank
    whose settings differ, by name. On one rank: `errors`, no communication."""
    if world.Get_size() == 1:
        return errors
    mine = None if not errors else errors[0] + (
        f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
    everyone = world.allgather((mine, settings))
    if errors and world.Get_rank() == 0:
        return errors                      # rank 0's own refusal, said as on one rank
    refusing = [(r, said) for r, (said, _) in enumerate(everyone) if said is not None]
    if refusing:
        r, said = refusing[0]
        others = f" (and {len(refusing) - 1} more rank(s))" if len(refusing) > 1 else ""
        return [f"rank {r} refused: {said}{others}"]
    differ = [r for r, (_, theirs) in enumerate(everyone) if theirs != everyone[0][1]]
    if differ:
        r = differ[0]
        return [f"rank {r} was launched with other settings than rank 0 (every rank of a "
                f"job runs the same command): rank {r}: {_shown(everyone[r][1])}; rank 0: "
                f"{_shown(everyone[0][1])}"]
    return []


def _shown(settings: object, limit: int = 160) -> str:
    """A command line in a refusal, cut to `limit` characters."""
    text = " ".join(settings) if isinstance(settings, (list, tuple)) else str(settings)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_collectively(main: Callable[[], object]) -> None:
    """Run a lesson's `main` so that one failing rank takes the whole job down.

    An exception on one rank prints that rank's traceback and calls MPI_Abort,
    which ends every rank (as `python -m mpi4py` does); without it, the other
    ranks would wait forever in a collective their partner never joins.
    `SystemExit` passes through untouched: every rank decides it alike (from the
    flags and the world size), so all leave together. After `main`, the ranks agree
    on whether any `verdict` failed; if one did, every rank exits 1. A ConfigError,
    raised on every rank alike (`refuse_together`), is one line from rank 0, exit 2."""
    abort_on_exception(refuse_together(main))
    wait_for_rank0(MPI.COMM_WORLD)  # asleep while rank 0 finishes alone (figures, reruns)
    # failed checks on any rank -> their count on every rank, so all exit alike
    failed = MPI.COMM_WORLD.allreduce(len(_FAILED))
    passed = MPI.COMM_WORLD.allreduce(len(_PASSED), op=MPI.MAX)  # the rank that checked most
    if MPI.COMM_WORLD.Get_rank() == 0:   # the line `make course` counts (tests/course.py)
        print(f"lesson checks: {passed} passed, {failed} failed", flush=True)
    if failed:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"{failed} check(s) failed", file=sys.stderr, flush=True)
        raise SystemExit(1)


def abort_on_exception(main: Callable[[], T], label: str = "") -> T:
    """`main()`, except that an exception on this rank ends every rank of the job.

    The rank's traceback goes to stderr (after `label`), then MPI_Abort ends them all
    (as `python -m mpi4py` does): without it the other ranks would wait forever in a
    collective their partner never joins. Ctrl-C's KeyboardInterrupt is one line and exit
    130. `SystemExit` passes through untouched: every rank decides it alike (from the
    flags and the world size), so all leave together."""
    try:
        return main()
    except SystemExit:
        raise
    except BaseException as error:
        abort_for(error, label)


def abort_for(error: BaseException, label: str = "") -> NoReturn:
    """End every rank of the job for `error`, caught on this rank (call it in an `except`).

    Ctrl-C's KeyboardInterrupt is one line and exit 130; an error MPI raised inside a call
    is one line (`mpi_error_line`); any other exception is this rank's traceback after
    `label`. Then MPI_Abort ends them all."""
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C reaches every rank: one line each
        abort_all(f"{label}rank {MPI.COMM_WORLD.Get_rank()} interrupted (Ctrl-C): ending the "
                  "job\n", 130)
        raise SystemExit(130) from None
    if isinstance(error, MPI.Exception):  # MPI's own error inside a call: a verdict
        shown = traceback.format_exc() if os.environ.get("MINIPAR_TRACEBACK") == "1" else ""
        abort_all(shown + mpi_error_line(error, MPI.COMM_WORLD.Get_rank()) + "\n")
        raise SystemExit(1) from None
    abort_all(f"{label}rank {MPI.COMM_WORLD.Get_rank()} failed:\n{traceback.format_exc()}")
    # MPI_Abort may return before the launcher ends this rank: leave without letting
    # Python print the same traceback a second time
    raise SystemExit(1) from None


def mpi_error_line(error: BaseException, rank: int) -> str:
    """The one line of an exception MPI raised inside a call (a message truncated, counts
    that differ): `minipar: error: MPI error: rank 2 in Alltoallv over ep at step 1 of 1:
    Message truncated ...`. The call and the step come from the watchdog's stamps, kept on
    the exception as it left the call (watchdog.waiting); `abort_all` ends the line with
    the flight verdict, as it does the watchdog's. MINIPAR_TRACEBACK=1 adds the traceback."""
    from minipar.comm import watchdog

    what, where = getattr(error, "minipar_call", ("an MPI call", watchdog._doing))
    return f"minipar: error: MPI error: rank {rank} in {what} at {where}: {mpi_error_text(error)}"


def mpi_error_text(error: BaseException) -> str:
    """What MPI says went wrong, in one line, with the error class's name. MPICH reports a
    failed message of a collective as MPI_ERR_IN_STATUS ("See the MPI_ERROR field ..."),
    which a program cannot read back from mpi4py's collectives: in minipar it means a
    message longer than its receive, counts that differ."""
    try:
        kind = error.Get_error_class()
        said = error.Get_error_string()
    except (AttributeError, MPI.Exception):
        return str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    names = [name for name in dir(MPI) if name.startswith("ERR_") and name != "ERR_LASTCODE"
             and getattr(MPI, name) == kind]
    name = f"MPI_{names[0]}" if names else f"MPI error class {kind}"
    if kind == MPI.ERR_IN_STATUS:
        said = "Message truncated or mismatched (counts differ between sender and receiver)"
    first = said.strip().splitlines()[0] if said.strip() else "no text"
    return f"{first} ({name})"


def abort_all(text: str, code: int = 1) -> None:
    """Write `text` to stderr, then end every rank of the job with MPI_Abort.

    The short pause lets the launcher forward the text before it kills the
    processes: without it, the failing rank's own explanation is sometimes lost.
    First the flight recorder, when armed, has every rank write its last calls and
    appends the verdict to `text` (flight.py)."""
    from minipar.comm import flight

    text = flight.before_abort(text)
    sys.stderr.write(text)
    sys.stderr.flush()
    time.sleep(0.5)
    MPI.COMM_WORLD.Abort(code)


def wait_for_rank0(comm: MPI.Comm, poll: float = 0.002) -> None:
    """Every rank of `comm` waits here until rank 0 arrives, the others asleep meanwhile.

    While rank 0 works alone (a one-process rerun to compare with, a figure), the other
    ranks would wait in their next collective; MPICH's blocking calls spin while they
    wait, so on a machine with more ranks than cores 7 spinning ranks take the cores from
    the one working. An Ibarrier polled with short sleeps leaves them idle instead."""
    request = comm.Ibarrier()
    if comm.Get_rank() == 0:
        request.Wait()
        return
    while not request.Test():
        time.sleep(poll)
