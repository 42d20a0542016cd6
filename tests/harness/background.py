"""Work that runs beside the suite on the core the suite leaves idle.

The suite alternates between MPI jobs (8 ranks on 2 cores: every core busy, and a rank
waiting in a collective spins) and work inside the pytest process (references, the
planner, figures: one core busy, the other idle). A `Background` job is a process and
all it starts (a notebook kernel, its MPI ranks: they leave the job's process group,
so the tree is walked, not the group) that runs only in the second kind of moment: a
referee thread stops every process of the tree (SIGSTOP) whenever the pytest process
has a child of its own (an mpiexec, a CLI run), or `held()` says a job is starting, and
lets them go on (SIGCONT) when it has none, or when a test is waiting for the job, or
for BREATHE seconds after LONGEST_STOP seconds stopped. The tree also runs at the
lowest priority (nice 19), so the pytest process keeps its core. (Where /proc has no
`children` lists, no child is seen and the job is never stopped: slower, not wrong.)

Measured here: a low-priority job that is not stopped slows an MPI-heavy stretch of the
suite by as much as the job's own CPU time (waiting ranks yield their core to it, and it
to them), which is why the referee stops it instead of trusting priorities.

tests/teaching/test_notebooks.py runs the notebooks this way; its tests wait for each
notebook's result. Wall-clock deadlines inside a stopped job (a cell's timeout) keep
running while it is stopped: `stopped_seconds` says how long it was, for a failure's
message.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

POLL = 0.02  # seconds between the referee's looks at the pytest process's children
# The longest stretch a job stays stopped, then it runs BREATHE seconds whatever the suite
# does: a deadline inside it (an exercise check's 20 s to agree on a verdict) never sees a
# stop longer than this. Jobs with shorter deadlines (a 2 s watchdog) do not belong here.
LONGEST_STOP = 10.0
BREATHE = 0.2


def children(pid: int) -> list[int]:
    """The direct children of `pid` (of any of its threads)."""
    out = []
    for listing in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            out += [int(child) for child in Path(listing).read_text().split()]
        except OSError:   # the thread ended between the glob and the read
            continue
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants, parents before their children."""
    out, i = [pid], 0
    while i < len(out):
        out += children(out[i])
        i += 1
    return out


_HELD = [0]   # > 0 while the suite is starting or running a job of its own (`held`)
_JOBS: list[Background] = []


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Every background job stopped now, and kept stopped inside the block (an MPI job
    the suite starts: the referee would notice it, but only POLL seconds later)."""
    _HELD[0] += 1
    try:
        for job in _JOBS:
            job.referee_now()
        yield
    finally:
        _HELD[0] -= 1


def foreground_children(exclude: set[int]) -> bool:
    """Has this process (any of its threads) a live child not in `exclude`?"""
    for pid in children(os.getpid()):
        if pid in exclude:
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":   # a child exited and not yet reaped does not count
            return True
    return False


class Background:
    """`cmd` started in its own process group at nice 19, stopped while the pytest
    process runs a child process of its own (see the module docstring)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=lambda: os.nice(19))
        self.stopped_seconds = 0.0
        self._waiting = 0          # tests waiting on the job: it runs, whatever the suite does
        self._stopped_at: float | None = None
        self._breathe_until = 0.0  # it runs until then, whatever the suite does
        self._closing = threading.Event()
        self._lock = threading.Lock()
        _JOBS.append(self)
        self._thread = threading.Thread(target=self._referee, daemon=True)
        self._thread.start()

    def _signal(self, stop: bool) -> None:
        """SIGSTOP (or SIGCONT) to every process of the job's tree, parents first."""
        for pid in tree(self.proc.pid):
            try:
                os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)
            except ProcessLookupError:
                continue
        now = time.monotonic()
        if stop and self._stopped_at is None:
            self._stopped_at = now
        elif not stop and self._stopped_at is not None:
            self.stopped_seconds += now - self._stopped_at
            self._stopped_at = None

    def referee_now(self) -> None:
        """Stop or resume the job as the suite's state asks (also once every POLL s).
        While stopped, the signal goes again to the whole tree: a process started just
        before the stop is caught at the next look."""
        with self._lock:
            if self.proc.poll() is not None:
                return
            now = time.monotonic()
            if self._stopped_at is not None and now - self._stopped_at > LONGEST_STOP:
                self._breathe_until = now + BREATHE
            stop = (not self._waiting and now > self._breathe_until
                    and (_HELD[0] > 0 or foreground_children({job.proc.pid for job in _JOBS})))
            if stop or self._stopped_at is not None:
                self._signal(stop)

    def _referee(self) -> None:
        while not self._closing.wait(POLL) and self.proc.poll() is None:
            self.referee_now()
        with self._lock:
            if self._stopped_at is not None:
                self._signal(False)

    def wait_for(self, done: Path, timeout: float) -> bool:
        """Let the job run unhindered until `done` exists (True), the job has ended, or
        `timeout` seconds passed (False)."""
        with self._lock:
            self._waiting += 1
        self.referee_now()
        try:
            deadline = time.monotonic() + timeout
            while not done.exists():
                if self.proc.poll() is not None and not done.exists():
                    return False
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
            return True
        finally:
            with self._lock:
                self._waiting -= 1

    def close(self) -> None:
        """End the job and everything it started (the end of the session)."""
        self._closing.set()
        self._thread.join()
        _JOBS.remove(self)
        everyone = tree(self.proc.pid)
        for sig in (signal.SIGCONT, signal.SIGTERM):
            for pid in everyone:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            for pid in tree(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
