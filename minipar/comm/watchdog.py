"""A watchdog for stuck ranks: a job waits for a dead partner no longer than --timeout.

What this file teaches: a collective cannot tell a slow partner from a dead
one. A rank that is SIGSTOPped, sleeps, or loops forever leaves every other
rank of its group waiting inside Allreduce or Recv, and MPI itself never gives
up. NCCL's answer (PyTorch's `NCCL_TIMEOUT` watchdog) is a second thread per
process that watches the first: the main thread stamps the time and the name of
every blocking call it enters (`waiting`), and the watchdog thread, waking every
fraction of a second, ends the whole job with MPI_Abort when one call has
lasted longer than the timeout, with a line that says where it was:

    minipar: error: watchdog: rank 0 waited 3 s in Allreduce over dp at step 2 of 5
    (a rank of that group is stuck, stopped or dead; --timeout 3)

The stamps cost two attribute writes per call; with `--timeout 0` no thread runs
and `waiting` still only stamps. `comm.Group` stamps every call it makes; code
that waits on requests (`MPI.Request.Waitall`) stamps with `waiting` itself.

    mpiexec -n 2 python -m minipar train --dp 2 --timeout 30
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

# (since when, what) of the blocking call the main thread is in; None between calls.
# One tuple, replaced whole: the watchdog thread reads a consistent pair without a lock.
_waiting: tuple[float, str] | None = None
_doing = "start-up"          # where the run is: "step 3 of 5", "the checkpoint save", ...
_stop = threading.Event()


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
    """Stamp a blocking call (`"Allreduce over dp"`) for the watchdog while it runs."""
    global _waiting
    _waiting = (time.monotonic(), what)
    try:
        yield
    except BaseException as error:
        # an error MPI raised inside the call keeps where it happened, for its one line
        # (comm/job.py `mpi_error_line`): the stamp itself is gone once we leave
        with contextlib.suppress(AttributeError, TypeError):
            error.minipar_call = (what, _doing)
        raise
    finally:
        _waiting = None


def doing(where: str) -> None:
    """Say where the run is (named in the watchdog's line): `"step 2 of 5"`."""
    global _doing
    _doing = where


def overdue(timeout: float, now: float | None = None) -> str | None:
    """The watchdog's line when the current call has waited longer than `timeout`, else
    None. Pure given the stamps, so it is tested without threads or MPI."""
    stamp = _waiting
    now = time.monotonic() if now is None else now
    if stamp is None or now - stamp[0] <= timeout:
        return None
    return (f"waited {now - stamp[0]:.0f} s in {stamp[1]} at {_doing} (a rank of that "
            f"group is stuck, stopped or dead; --timeout {timeout:g})")


def start(timeout: float, rank: int, abort: Callable[[str], None]) -> None:
    """Watch this process from a daemon thread: when one call outlasts `timeout` seconds,
    hand the line to `abort` (log.abort_all: print it, MPI_Abort the whole job); any
    waiting rank may be the one that notices. `timeout = 0` watches nothing."""
    if timeout <= 0:
        return
    _stop.clear()

    def watch() -> None:
        while not _stop.wait(min(1.0, timeout / 4)):
            line = overdue(timeout)
            if line is not None:
                abort(f"minipar: error: watchdog: rank {rank} {line}\n")
    threading.Thread(target=watch, name="minipar-watchdog", daemon=True).start()


def stop() -> None:
    """End the watching (the run is over; the thread leaves within a poll)."""
    _stop.set()
    doing("start-up")
    sys.stderr.flush()
