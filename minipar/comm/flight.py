"""A flight recorder on every rank: the last 1000 communication calls, dumped when it hangs.

What this file teaches: when a distributed job hangs, the question is not
"where is this rank stuck" (the watchdog says that) but "which rank disagrees":
one rank entered an Allreduce the others never reach, two pipeline stages both
wait to receive, a call went to the wrong communicator, counts differ. No single
rank can answer it; every rank's recent history, lined up side by side, can.
PyTorch keeps such a history per process (its NCCL "flight recorder"); minipar
keeps one a student can read:

- `record` (called by `comm.Group._log`, the one layer every MPI call of minipar
  goes through) appends one tuple per call to a ring of the last 1000: the group
  (its axis and world ranks), a sequence number per group, the op, elements and
  dtype, the call site (the first frame outside comm/collectives.py and autograd.py: the
  strategy code that made the call), the step and microbatch, the start time;
  for point-to-point the peer, tag and how many messages this rank sent to /
  received from that peer so far; for Alltoallv both count vectors. Nothing is
  formatted until a dump: a call costs a couple of microseconds (`make bench`).
  A call is *completed* unless it is the last one and the rank is still inside
  it (the watchdog's stamp says so at dump time).
- `arm` (the train command) decides where dumps go (`--flight DIR`, default
  `minipar-flight/`), learns every rank's host and pid (one allgather at
  start-up) and installs a SIGUSR1 handler that works even while the main thread
  is blocked inside MPI: Python runs signal handlers only between bytecodes, so the
  C-level handler's wake-up byte (`signal.set_wakeup_fd`) is read by a thread of
  our own, which writes the dump.
- When one rank's watchdog fires or any rank aborts (`log.abort_all` calls
  `before_abort`): that rank writes its `rank{r}.json`, sends SIGUSR1 to every
  other rank on its host, waits a short grace for their files (not for a rank
  of this host that is stopped or gone: it writes none), reads them all
  (flight_report.py), and ends its error line with the verdict before MPI_Abort
  ends the job. Only the first rank to get there speaks (an O_EXCL lock, which
  becomes DIR/verdict.txt holding its line); a second one dumps and waits to be
  ended. A --flight folder holding another job's files is never written over: the
  dumps go beside it (`DIR-2`, named in the line); the default `minipar-flight/`
  keeps the last job's. Across hosts, SIGUSR1 reaches only
  this host's ranks: a rank on another host dumps when its own watchdog fires
  (the ranks of a hung job all sit in some call, so all their watchdogs fire
  within about a --timeout of each other, inside the grace), and the verdict
  sees it only if DIR is on a shared file system (otherwise copy the files into
  one folder and run `python -m minipar flight DIR`).

    mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --inject-bug hang-wrong-group \
        --timeout 3                      # the watchdog's line ends with the verdict
    python -m minipar flight minipar-flight          # the verdict again; --all: the table
    kill -USR1 <mpiexec's pid>           # a live job: every rank dumps, and runs on
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from minipar.comm import watchdog
from minipar.comm.flight_files import FORMAT, P2P_OPS, FlightError, run_of
from minipar.comm.flight_report import verdict_of_folder

CAPACITY = 1000                 # calls kept per rank
GRACE = 2.0                     # seconds the first aborting rank waits for the others' files
SETTLE = 1.0                    # seconds a signalled rank waits to settle inside a call
DEFAULT_FOLDER = "minipar-flight"

_PACKAGE = Path(__file__).parent.parent  # minipar/, spelled as the code objects spell it
_SKIP = frozenset(str(_PACKAGE / name) for name in ("comm/collectives.py", "core/autograd.py",
                                                    "comm/flight.py"))


def site_of(path: str) -> str:
    """A call site's file as a learner finds it: its path inside the package
    (`parallel/tensor_parallel.py`), or the file's name for code outside it (a lesson)."""
    inside = os.path.relpath(path, _PACKAGE)
    return os.path.basename(path) if inside.startswith("..") else inside


NONBLOCKING = frozenset({"Isend", "Irecv", "Iallreduce"})   # posted, completed at a Wait
P2P = " p2p"                                # suffix of a group's message counter

# the ring: one tuple per call, oldest first (see `_FIELDS`)
_ring: deque = deque(maxlen=CAPACITY)
_FIELDS = ("group", "seq", "op", "elements", "dtype", "file", "line", "doing", "microbatch",
           "t", "peer", "tag", "nth", "counts", "counted")
_seq: dict[str, int] = {}                   # group key -> calls made on it so far
_messages: dict[tuple, int] = {}            # (group key, "sent"/"received", peer, tag) -> n
_microbatch: int | None = None


class _State:
    """Where dumps go and who the other ranks are; set by `arm`."""

    folder: Path | None = None
    rank = 0
    world = 1
    run = ""
    peers: list[tuple[str, int]] = []       # (host, pid) of every world rank
    dumped: str | None = None               # the reason of this rank's last dump


STATE = _State()


# ----------------------------------------------------------------- recording
def group_key(comm: object, name: str) -> str:
    """`"dp{0,2}"`: the axis and the world ranks of a communicator, the same string on
    every member (communicators have no names MPI would share across ranks)."""
    from mpi4py import MPI  # here: flight_report and the CLI read dumps without MPI

    try:
        members = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                            MPI.COMM_WORLD.Get_group())
    except MPI.Exception:  # a communicator outside COMM_WORLD: its own ranks
        members = list(range(comm.Get_size()))
    return f"{name}{{{','.join(str(m) for m in members)}}}"


def set_microbatch(m: int | None) -> None:
    """Say which microbatch the calls that follow belong to (run/mesh_step.py, the pipeline)."""
    global _microbatch
    _microbatch = m


def record(group: object, op: str, elements: int, itemsize_or_dtype: object,
           detail: Sequence = ()) -> None:
    """Append one call of `group` (a comm.Group) to the ring. `detail`: for Send / Recv /
    Isend / Irecv `(peer, tag)` in the group's ranks, for Sendrecv `(dest, source, tag)`,
    for Alltoallv `(send_counts, recv_counts)`. Cheap: a frame walk of a few steps, a
    tuple, no formatting."""
    key = group.__dict__.get("_flight_key")
    if key is None:  # once per Group: its axis and world ranks
        key = group._flight_key = group_key(group.comm, group.name)
    # collectives count on the group's key, messages apart: stages send different numbers
    seq_key = key + P2P if op in P2P_OPS else key
    seq = _seq[seq_key] = _seq.get(seq_key, 0) + 1
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename in _SKIP:
        frame = frame.f_back
    peer = tag = nth = counts = None
    if detail:
        if op == "Alltoallv":  # the count arrays only: never keep the buffers alive
            counts = (_counts_of(detail[0]), _counts_of(detail[1]))
        elif op == "Sendrecv":
            peer, tag = (detail[0], detail[1]), detail[2]
            nth = (_count(key, "sent", detail[0], tag), _count(key, "received", detail[1], tag))
        else:
            peer, tag = detail
            nth = _count(key, "sent" if op in ("Send", "Isend") else "received", peer, tag)
    _ring.append((key, seq, op, elements, itemsize_or_dtype, frame.f_code.co_filename,
                  frame.f_lineno, watchdog._doing, _microbatch, time.monotonic(), peer, tag,
                  nth, counts, group.ledger.enabled))


def _count(key: str, direction: str, peer: int, tag: int) -> int:
    index = (key, direction, peer, tag)
    n = _messages[index] = _messages.get(index, 0) + 1
    return n


def _step_of(doing: str) -> int | None:
    """3 from the watchdog's "step 3 of 5"; None elsewhere (start-up, the end)."""
    words = doing.split()
    return int(words[1]) if len(words) >= 2 and words[0] == "step" and words[1].isdigit() \
        else None


def _counts_of(spec: object) -> object:
    """The per-rank counts of an mpi4py buffer spec `[array, counts, displs, type]` (or
    `[array, (counts, displs), type]`), as given; None for a plain buffer."""
    if isinstance(spec, (list, tuple)) and len(spec) > 1:
        return spec[1][0] if isinstance(spec[1], tuple) else spec[1]
    return None


def _counts_list(counts: object) -> list[int] | None:
    """Counts as a list of ints for the dump (None if there are none)."""
    try:
        return [int(c) for c in counts]
    except TypeError:
        return None


def records() -> list[dict]:
    """The ring as dicts, oldest first, each with its state: every call is completed
    except the last blocking one while this rank is still inside it (the watchdog's stamp
    is set and no newer than the call); nonblocking calls are "posted"."""
    for _ in range(5):  # another thread may append while we copy
        try:
            ring = list(_ring)
            break
        except RuntimeError:
            continue
    stamp = watchdog._waiting
    out = []
    last_blocking = max((i for i, r in enumerate(ring) if r[2] not in NONBLOCKING),
                        default=None)
    for i, row in enumerate(ring):
        r = dict(zip(_FIELDS, row))
        state = "posted" if r["op"] in NONBLOCKING else "completed"
        if i == last_blocking and stamp is not None and stamp[0] >= r["t"] - 1e-6 \
                and i == len(ring) - 1:
            state = "started"
        dtype = r["dtype"]
        counts = r.pop("counts")
        out.append({
            "group": r["group"], "axis": r["group"].split("{")[0], "seq": r["seq"],
            "op": r["op"], "elements": int(r["elements"]),
            "dtype": dtype if isinstance(dtype, str) else f"{int(dtype)}-byte",
            "site": f"{site_of(r['file'])}:{r['line']}",
            "step": _step_of(r["doing"]), "microbatch": r["microbatch"], "state": state,
            "t": round(r["t"], 6), "peer": list(r["peer"]) if isinstance(r["peer"], tuple)
            else r["peer"], "tag": r["tag"], "nth": list(r["nth"])
            if isinstance(r["nth"], tuple) else r["nth"],
            "send_counts": _counts_list(counts[0]) if counts else None,
            "recv_counts": _counts_list(counts[1]) if counts else None,
            "counted": bool(r["counted"])})
    return out


def snapshot(reason: str, detail: str = "") -> dict:
    """This rank's dump: who it is, why it dumps, where it is, and its records."""
    stamp = watchdog._waiting
    groups: dict[str, dict] = {}
    for key, calls in list(_seq.items()):
        base = key.removesuffix(P2P)
        name, members = base.split("{")
        entry = groups.setdefault(base, {"axis": name, "calls": 0, "messages": 0, "members": [
            int(m) for m in members.rstrip("}").split(",")]})
        entry["messages" if key.endswith(P2P) else "calls"] = calls
    messages: dict[str, dict[str, int]] = {}
    for (key, direction, peer, tag), n in list(_messages.items()):
        messages.setdefault(key, {})[f"{direction} {peer} {tag}"] = n
    return {"format": FORMAT, "run": STATE.run, "rank": STATE.rank, "world": STATE.world,
            "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
            "detail": detail, "time": time.time(), "doing": watchdog._doing,
            "waiting": None if stamp is None else
            {"what": stamp[1], "seconds": round(time.monotonic() - stamp[0], 3)},
            "groups": groups, "messages": messages, "calls": records()}


def write(folder: Path | str, reason: str, detail: str = "") -> Path:
    """Write `folder/rank{r}.json` (made here: only when there is something to write),
    atomically: a reader never sees half a file."""
    folder = Path(folder)
    with _writing:  # the signal thread and the watchdog may both dump at once
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"rank{STATE.rank}.json"
        partial = folder / f".rank{STATE.rank}.json.{os.getpid()}"
        partial.write_text(json.dumps(snapshot(reason, detail)))
        os.replace(partial, target)
        STATE.dumped = reason
    return target


_writing = threading.Lock()


def reset() -> None:
    """Forget every record and count (a test, or a notebook starting over)."""
    _ring.clear()
    _seq.clear()
    _messages.clear()
    set_microbatch(None)


# ------------------------------------------------------------------- arming
def arm(folder: str | None, world: object) -> None:
    """Make this rank dump into `folder` (or beside it, `fresh_folder`; default
    `minipar-flight/`) on SIGUSR1, on the watchdog or on an abort. A collective over
    `world` (MPI.COMM_WORLD): every rank's host and pid, and rank 0's run id (so a
    verdict never mixes in files of an earlier run)."""
    STATE.rank, STATE.world = world.Get_rank(), world.Get_size()
    me = (socket.gethostname(), os.getpid())
    STATE.peers = world.allgather(me)           # (host, pid) of every rank, on every rank
    STATE.run = f"{STATE.peers[0][0]}:{STATE.peers[0][1]}:{int(time.time())}"
    # rank 0 picks the folder: the one asked for, or beside it when it holds another job's
    # files (never written over); the default one, minipar's own, keeps the last job's
    STATE.run, chosen = world.bcast(
        (STATE.run, DEFAULT_FOLDER if folder is None else str(fresh_folder(Path(folder))))
        if STATE.rank == 0 else None, root=0)
    STATE.folder = Path(chosen)
    STATE.dumped = None
    _listen()


VERDICT = "verdict.txt"    # the first aborting rank's line, and its run


def held_files(folder: Path) -> list[str]:
    """The files of a job in `folder` that a new job must not write over: dumps
    (rank{r}.json), a verdict, a trace (trace.json), an older speaker's lock."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name in (VERDICT, "trace.json")
                  or p.name.startswith((".speaker-", ".verdict-"))
                  or (p.name.startswith("rank") and p.suffix == ".json"))


def fresh_folder(folder: Path) -> Path:
    """`folder` if it holds no other job's files, else the first of `folder-2`,
    `folder-3`, ... that holds none: a second hang goes beside the first one's dumps."""
    n, chosen = 1, folder
    while held_files(chosen):
        n += 1
        chosen = folder.with_name(f"{folder.name}-{n}")
    return chosen


def disarm() -> None:
    """Stop dumping (the run is over): an abort after it writes no records."""
    STATE.folder = None


_listening = False


def _listen() -> None:
    """A SIGUSR1 handler that works while the main thread is stuck in MPI: the C-level
    handler writes the signal's number to a pipe (`set_wakeup_fd`); our thread reads it
    and writes the dump. The Python-level handler itself does nothing."""
    global _listening
    if _listening or threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # someone else listens (asyncio): leave theirs in place
        signal.set_wakeup_fd(previous)
        return
    _listening = True

    def listen() -> None:
        while True:
            select.select([read_end], [], [])
            got = os.read(read_end, 64)
            if signal.SIGUSR1 in got and STATE.folder is not None:
                # a rank signalled by one that aborts is usually on its way into the call
                # where it will wait: a moment's grace shows that call, not the one before
                deadline = time.monotonic() + SETTLE
                while time.monotonic() < deadline and not _settled():
                    time.sleep(0.01)
                try:
                    write(STATE.folder, "SIGUSR1")
                except OSError as error:
                    sys.stderr.write(f"minipar: rank {STATE.rank}: flight dump failed: "
                                     f"{error}\n")
    threading.Thread(target=listen, name="minipar-flight", daemon=True).start()


def _settled(seconds: float = 0.2) -> bool:
    """Inside one blocking call for `seconds` already: where this rank waits."""
    stamp = watchdog._waiting
    return stamp is not None and time.monotonic() - stamp[0] >= seconds


def _signal_local_peers() -> None:
    """SIGUSR1 to every other rank of the job on this host (the launcher forwards it to
    no one here; ranks on other hosts are beyond a signal)."""
    host = socket.gethostname()
    for rank, (peer_host, pid) in enumerate(STATE.peers):
        if rank != STATE.rank and peer_host == host:
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:   # gone already: it will leave no record, and that is named
                pass


def _wait_for_dumps(deadline: float) -> None:
    """Until every rank's file of this run is in the folder, or the deadline; a rank of
    this host that can write none (stopped, or gone) is not waited for."""
    while time.monotonic() < deadline:
        if all(run_of(STATE.folder / f"rank{r}.json") == STATE.run or _cannot_dump(r)
               for r in range(STATE.world)):
            return
        time.sleep(0.05)


def _cannot_dump(rank: int) -> bool:
    """A rank of this host whose process is gone, a zombie, or stopped (SIGSTOP: state
    T in /proc/<pid>/stat) writes no file however long we wait. Anything else, and
    every rank on another host, may still write one (a rank a debugger holds, state t,
    is let go again)."""
    host, pid = STATE.peers[rank]
    if rank == STATE.rank or host != socket.gethostname() or not os.path.exists("/proc/self"):
        return False
    try:   # the state follows the command's closing parenthesis: "pid (comm) S ..."
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in ("T", "Z", "X")


def before_abort(text: str) -> str:
    """What `log.abort_all` does first: when armed, dump this rank, make the other ranks
    dump, and return `text` with the verdict appended (or "" for a rank that is not the
    first to abort: it waits, and the first one's MPI_Abort ends it). Unarmed: `text`."""
    folder = STATE.folder
    if folder is None:
        return text
    reason = "watchdog" if "watchdog:" in text else "abort"
    lines = text.strip().splitlines() or [""]
    # a traceback's last line says what failed; any other text is one line
    detail = lines[-1] if "Traceback" in text else lines[0]
    try:
        write(folder, reason, detail)
        if not _elected(folder):   # another rank speaks: wait for its abort to end us
            # a traceback, a rank leaving: still said; the watchdog's line and MPI's error
            # (one per rank of the group it hit) are the speaker's alone
            if "Traceback" in text or (reason == "abort" and " MPI error: " not in text):
                sys.stderr.write(text)
                sys.stderr.flush()
            time.sleep(GRACE + 5)
            return ""
        _signal_local_peers()
        _wait_for_dumps(time.monotonic() + GRACE)
        try:
            sentence = verdict_of_folder(folder, run=STATE.run)
        except FlightError as error:
            sentence = f"no verdict ({error})"
        said = text.rstrip("\n") + f"; flight ({folder}): {sentence}\n"
        _leave_verdict(folder, said.splitlines()[-1])
    except OSError as error:
        return text.rstrip("\n") + f" (flight: no dump in {folder}: {error})\n"
    return said


def _lock(folder: Path) -> Path:
    return folder / f".verdict-{STATE.run.replace(':', '-')}"


def _spoken(folder: Path) -> bool:
    """DIR/verdict.txt is this run's: a rank of this job spoke already."""
    try:
        return (folder / VERDICT).read_text().splitlines()[-1] == f"run {STATE.run}"
    except (OSError, IndexError, UnicodeDecodeError):
        return False


def _elected(folder: Path) -> bool:
    """Whether this rank is the first of its job to abort, and so the one that speaks: it
    makes DIR/.verdict-<run> (O_EXCL: one rank wins, on every host of a shared folder).
    The lock becomes DIR/verdict.txt once the line is in it (`_leave_verdict`), so a
    rank whose watchdog fires later finds either the lock or this run's verdict.txt --
    checked after taking the lock too, since the rename may fall between the two."""
    if _spoken(folder):
        return False
    try:
        os.close(os.open(_lock(folder), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    if _spoken(folder):
        _lock(folder).unlink(missing_ok=True)
        return False
    return True


def _leave_verdict(folder: Path, line: str) -> None:
    """Write the speaker's line and the run into the lock, and make it DIR/verdict.txt
    (atomically); then remove what earlier jobs left in a reused folder and this job
    will not replace: dumps of ranks beyond this world, older locks."""
    lock = _lock(folder)
    lock.write_text(f"{line}\nrun {STATE.run}\n")
    os.replace(lock, folder / VERDICT)
    for path in folder.iterdir():
        stale = path.name.startswith((".speaker-", ".verdict-")) or (
            path.name.startswith("rank") and path.suffix == ".json"
            and path.stem[4:].isdigit() and int(path.stem[4:]) >= STATE.world)
        if stale:
            path.unlink(missing_ok=True)
