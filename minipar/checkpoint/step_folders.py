"""A checkpoint folder that survives a failed save: step folders, a `latest` pointer, a lock.

What this file teaches: the one rule that makes a save safe to interrupt is
*never write over the checkpoint you would fall back to*. Like Megatron-LM's
`iter_0000004/` folders with `latest_checkpointed_iteration.txt`, or PyTorch
Distributed Checkpoint's per-step folders, every save of `--save DIR` goes to
a new folder, and only a complete, verified one is ever pointed at:

    DIR/.lock                      one job at a time writes DIR (pid, host, token)
    DIR/.staging-000004-<token>/   the save in progress: shards, then manifest.json
    DIR/step-000004/               renamed into place once complete and verified
    DIR/latest                     "step-000004": switched by an atomic os.replace
    DIR/step-000002/               an older one, kept (--keep N, default 2)

A save that dies at any point (an exception, a killed rank, a full disk,
Ctrl-C) leaves at worst a `.staging-*` folder that nothing points at, and
`latest` still names the previous checkpoint. The next save sweeps the debris.

Two jobs writing one folder at once are refused: the first takes `DIR/.lock`
(created with O_EXCL, so exactly one creator wins) for its whole run; the second
sees a live owner and stops before its first step. A lock left by a job that
was killed (its pid no longer runs on this host) is stale and taken over. Just
before switching `latest`, the saver checks the lock still holds its own token.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path

from minipar.checkpoint import owner

LATEST = "latest"
LOCK = ".lock"
STEP_FOLDER = re.compile(r"^step-\d{6,}(-[0-9a-f]+)?$")

_HELD: dict[Path, str] = {}  # the folders whose lock this process holds -> its token
_MADE: set[Path] = set()     # ... of them, those `acquire` created (removed again if empty)


class FolderError(Exception):
    """A checkpoint folder that cannot be read or written; the message is one line."""


# ------------------------------------------------------------- atomic files
def fsync_folder(folder: Path) -> None:
    """Make a rename inside `folder` durable (the directory entry itself is data)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new, never half."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())  # the bytes are on disk before a name points at them
        os.replace(temporary, path)    # atomic on POSIX: readers see the old or the new file
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk must not keep a half file around
        raise
    fsync_folder(path.parent)


# ------------------------------------------------------------------- the lock
def _owner(root: Path) -> dict | None:
    """The lock's contents, or None when there is no lock (or it is unreadable)."""
    try:
        owner = json.loads((root / LOCK).read_text())
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def _is_stale(owner: dict | None) -> bool:
    """A lock is stale when its writer is gone: no readable owner, or a pid of this host
    that no longer runs. A lock from another host cannot be judged, so it holds."""
    if owner is None:
        return True
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner.get("pid", -1)), 0)  # signal 0: "does it exist?", sends nothing
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, OverflowError):
        return False
    return False


def holder(root: Path) -> str | None:
    """Who else is saving to `root` right now (one line), or None: a pure read, so every
    rank can ask before the first step and all reach the same verdict."""
    root = Path(root)
    if root in _HELD or not (root / LOCK).exists():
        return None
    owner = _owner(root)
    if _is_stale(owner):
        return None
    return (f"{root}: another job is saving here (pid {owner.get('pid')} on "
            f"{owner.get('host')} since {owner.get('since')}); wait for it, or remove "
            f"{root / LOCK} if it is gone")


def acquire(root: Path) -> str:
    """Take the lock of `root` for this process; returns its token. Raises FolderError
    naming the owner when another live job holds it."""
    root = Path(root)
    if root in _HELD:
        return _HELD[root]
    if not root.exists():
        _MADE.add(root)
    root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(6)
    body = json.dumps({"token": token, "pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
    for _ in range(2):  # a second try after removing a stale lock
        try:
            fd = os.open(root / LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            taken = holder(root)
            if taken:
                raise FolderError(taken) from None
            (root / LOCK).unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
        _HELD[root] = token
        return token
    raise FolderError(f"{root}: could not take {LOCK} (another job keeps taking it)")


def release(root: Path) -> None:
    """Give the lock back, if this process holds it and it is still ours."""
    root = Path(root)
    token = _HELD.pop(root, None)
    if token is not None and (_owner(root) or {}).get("token") == token:
        (root / LOCK).unlink(missing_ok=True)
    if root in _MADE:   # a run that saved nothing (it diverged, it failed) leaves no folder
        _MADE.discard(root)
        with contextlib.suppress(OSError):
            root.rmdir()  # only if empty


def still_ours(root: Path, token: str) -> bool:
    """Whether the lock of `root` still carries `token` (nobody broke in meanwhile)."""
    return (_owner(root) or {}).get("token") == token


# -------------------------------------------------------- the folders inside
def staging_folder(root: Path, step: int, token: str) -> Path:
    """Where a save of `step` writes before it is complete (nothing points here)."""
    return root / f".staging-{step:06d}-{token}"


def publish(root: Path, staging: Path, step: int, token: str, keep: int) -> str:
    """Move a complete, verified save into place and point `latest` at it: rename the
    staging folder to `step-NNNNNN` (a new name when that step was saved before), then
    replace `latest` atomically. Older checkpoints of the same run beyond `keep` are
    removed after. `latest` never moves back to an older step (checkpoint/owner.py)."""
    if not still_ours(root, token):
        raise FolderError(f"{root}: its {LOCK} was taken by another job during this save; "
                          "latest left as it was")
    pointer = root / LATEST
    current = pointer.read_text(errors="replace").strip() if pointer.is_file() else ""
    if (owner.step_of(current) or 0) > step:
        raise FolderError(f"{root}: {LATEST} names {current[:40]}, newer than step {step}: "
                          "latest left as it was")
    name = f"step-{step:06d}"
    if (root / name).exists():           # the same step saved again: never overwrite it
        name = f"{name}-{token}"
    os.rename(staging, root / name)
    fsync_folder(root)
    atomic_write(root / LATEST, f"{name}\n".encode())   # the switch: one atomic rename
    prune(root, keep, name, owner.run_of(root / name))
    return name


def latest(root: Path) -> Path:
    """The step folder `root/latest` names; FolderError when there is none."""
    pointer = root / LATEST
    if not root.is_dir():
        raise FolderError(f"{root}: no such checkpoint folder")
    if not pointer.is_file():
        started = any(root.glob(".staging-*"))
        raise FolderError(f"{root}: no complete checkpoint ("
                          + ("a save started here but never finished" if started
                             else f"no {LATEST} file: not a checkpoint folder") + ")")
    name = pointer.read_text(errors="replace").strip()
    if not STEP_FOLDER.match(name):
        raise FolderError(f"{root}: {LATEST} holds {name[:40]!r}, not a step folder name")
    if not (root / name).is_dir():
        raise FolderError(f"{root}: {LATEST} names {name}, which is missing")
    return root / name


def step_folders(root: Path) -> list[Path]:
    """The complete checkpoints in `root`, oldest first (by when each was published)."""
    found = [p for p in root.iterdir() if p.is_dir() and STEP_FOLDER.match(p.name)]

    def published(folder: Path) -> tuple[int, str]:
        manifest = folder / "manifest.json"   # written last: its time is the save's
        return (manifest.stat().st_mtime_ns if manifest.exists() else 0, folder.name)

    return sorted(found, key=published)


def prune(root: Path, keep: int, current: str, run: str | None = None) -> None:
    """Keep the newest `keep` checkpoints of the run `run` (always the one `latest` names);
    remove its others, and the staging folders of saves that died (the lock says none is
    running). Step folders of any other run, or whose run cannot be read, are kept."""
    older = [p for p in step_folders(root) if p.name != current and owner.run_of(p) == run]
    for stale in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(stale, ignore_errors=True)
    for debris in root.glob(".staging-*"):   # ours was renamed: any other one is dead
        shutil.rmtree(debris, ignore_errors=True)
