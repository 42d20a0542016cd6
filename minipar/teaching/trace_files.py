"""A `--trace` folder read back: the merged trace, refused unless it is whole.

What this file teaches: a reader of files a user hands it validates before it uses
anything (docs/design.md, "Timelines"): the size and the nesting depth first
(comm/flight_files.py `parse`), then the run record (ranks, the mesh and steps of its
config, one host, clock offset, group table and coords per rank) and every event (its
kind, a finite start and duration, a rank among the ranks, the args the readers use).
Whatever fails is one line naming the file and the field (`TraceError`), never a
KeyError, an IndexError or a report of "nan s". trace.py writes the files;
trace_report.py measures and draws what passes.

    doc = load("/tmp/t")          # the merged trace.json of `train --trace /tmp/t`
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from minipar.comm.flight_files import parse
from minipar.comm.trace import FILES

PIPELINE = ("forward", "backward", "backward (B)", "backward (W)", "F&B")


class TraceError(Exception):
    """A folder `trace` cannot read; the message is one line."""


# ---------------------------------------------------------------- reading
def load(folder: str | Path) -> dict:
    """The merged trace of a `--trace` folder, checked to be whole: raises TraceError for
    a missing folder or file, a truncated or non-JSON file, or JSON that is no trace."""
    path = Path(folder)
    if not path.is_dir():
        raise TraceError(f"{folder}: not a folder (give the --trace DIR of a run)")
    merged = path / FILES
    if not merged.is_file():
        ranks = sorted(p.name for p in path.glob("rank*.json"))
        raise TraceError(f"{folder}: no {FILES}" + (
            f" (only {ranks[0]}...: the run did not finish)" if ranks else
            " (not the --trace DIR of a run)"))
    doc = parse(merged, MAX_BYTES, MAX_DEPTH, TraceError, "a minipar trace")
    other = doc.get("otherData") if isinstance(doc, dict) else None
    info = other.get("minipar") if isinstance(other, dict) else None
    if not isinstance(doc.get("traceEvents") if isinstance(doc, dict) else None, list) \
            or not isinstance(info, dict) or "ranks" not in info:
        raise TraceError(f"{merged}: not a minipar trace (no traceEvents and run record)")
    check(merged, doc)
    return doc


MAX_BYTES = 2 << 30     # a long run's trace is tens of MB; far beyond: not one
MAX_DEPTH = 8           # a trace nests 5 deep (a Wait's list of [axis, seq] requests)
MAX_RANKS = 1 << 20


def is_number(value: object, low: float = -1e15) -> bool:
    """A finite number from `low` to 1e15 (microseconds: 31 years), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and low <= value <= 1e15


def is_count(value: object, low: int = 0) -> bool:
    """A whole number from `low` up, not a bool (a JSON count)."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 1 << 53


def check(path: Path, doc: dict) -> None:
    """Raise TraceError naming `path` and the first field that is not what `train
    --trace` writes (trace.py): the run record (ranks, the config's mesh and steps, one
    host, clock offset, group table and coords per rank) and every event (its kind, a
    finite start and duration, a rank among the ranks, what the readers here use of its
    args). A trace that passes is one `measure`, `report`, `figure` and `simulated` can
    read without a KeyError, an IndexError or a "nan s"."""
    def bad(field: str, what: str) -> TraceError:
        return TraceError(f"{path}: field {field} {what}")

    info = doc["otherData"]["minipar"]
    ranks = info["ranks"]
    if not is_count(ranks, 1) or ranks > MAX_RANKS:
        raise bad("otherData.minipar.ranks", f"is {ranks!r}, not a count of ranks from 1 "
                  f"to {MAX_RANKS}")
    if not isinstance(info.get("run"), str):
        raise bad("otherData.minipar.run", "is missing or not text")
    cfg = info.get("config")
    if not isinstance(cfg, dict):
        raise bad("otherData.minipar.config", f"is {_short(cfg)}, not an object")
    for name in ("dp", "tp", "pp", "steps", "cp", "virtual", "microbatches"):
        if (name in cfg or name in ("dp", "tp", "pp", "steps")) and \
                not is_count(cfg.get(name), 1):
            raise bad(f"otherData.minipar.config.{name}", f"is {cfg.get(name)!r}, not a "
                      "count of at least 1")
    if cfg["pp"] > 1 and not isinstance(cfg.get("schedule"), str):
        raise bad("otherData.minipar.config.schedule", "is missing or not text (--pp 2+)")
    if info.get("cores") is not None and not is_count(info["cores"], 1):
        raise bad("otherData.minipar.cores", f"is {info['cores']!r}, not a count")
    per_rank = {"hosts": lambda v: isinstance(v, str),
                "clock_offsets_us": is_number,
                "groups": lambda v: isinstance(v, dict) and all(
                    isinstance(m, list) and all(is_count(r) and r < ranks for r in m)
                    for m in v.values()),
                "coords": lambda v: isinstance(v, dict) and all(is_count(c) for c in v.values())}
    for name, fits in per_rank.items():
        values = info.get(name)
        if not isinstance(values, list) or len(values) != ranks:
            raise bad(f"otherData.minipar.{name}", f"is not a list of one entry per rank "
                      f"({ranks})")
        for r, value in enumerate(values):
            if not fits(value):
                raise bad(f"otherData.minipar.{name}[{r}]", f"is {_short(value)}, not what "
                          "trace.py writes")
    for i, event in enumerate(doc["traceEvents"]):
        where = f"traceEvents[{i}]"
        if not isinstance(event, dict) or not isinstance(event.get("ph"), str):
            raise bad(where, "is not an event (an object with a 'ph')")
        phase = event["ph"]
        if phase not in ("X", "s", "f", "M", "C"):
            continue   # other kinds: no reader here uses them
        if not (is_count(event.get("pid")) and event["pid"] < ranks):
            raise bad(f"{where}.pid", f"is {_short(event.get('pid'))}, not a rank of the "
                      f"{ranks}")
        if phase != "M" and not is_number(event.get("ts")):
            raise bad(f"{where}.ts", f"is {_short(event.get('ts'))}, not a finite time in "
                      "microseconds")
        if phase in ("X", "M", "C") and not isinstance(event.get("args"), dict):
            raise bad(f"{where}.args", "is missing or not an object")
        if phase == "M":
            if not isinstance(event.get("name"), str) or (event["name"] == "process_name"
                                                          and not isinstance(
                                                              event["args"].get("name"), str)):
                raise bad(f"{where}.name", "is not a metadata event's name")
        elif phase in ("s", "f"):
            if not isinstance(event.get("id"), (int, str)) or isinstance(event["id"], bool):
                raise bad(f"{where}.id", "is not a flow's id")
        elif phase == "X":
            _check_span(event, where, bad)


def _check_span(event: dict, where: str, bad: Callable[[str, str], TraceError]) -> None:
    """One complete event ("X"): its name, category, duration and the args it needs."""
    for name in ("name", "cat"):
        if not isinstance(event.get(name), str):
            raise bad(f"{where}.{name}", "is missing or not text")
    if not is_number(event.get("dur"), 0):
        raise bad(f"{where}.dur", f"is {_short(event.get('dur'))}, not a finite duration")
    args = event["args"]
    if event["cat"] == "comm":
        if not (isinstance(args.get("axis"), str) and is_count(args.get("seq"))
                and isinstance(args.get("op"), str)):
            raise bad(f"{where}.args", "is not a call's (an axis, a seq, an op)")
        for name in ("dest", "source"):
            if name in args and not is_count(args[name]):
                raise bad(f"{where}.args.{name}", f"is {_short(args[name])}, not a rank")
    if event["cat"] == "wait" and "requests" in args and not (
            isinstance(args["requests"], list) and all(
                isinstance(r, list) and len(r) == 2 and isinstance(r[0], str)
                and is_count(r[1]) for r in args["requests"])):
        raise bad(f"{where}.args.requests", "is not a list of [axis, seq]")
    if event["name"] in PIPELINE:
        for name in ("step", "microbatch", "chunk"):
            if args.get(name) is not None and not is_count(args[name]):
                raise bad(f"{where}.args.{name}", f"is {_short(args[name])}, not a count")
        if "kind" in args and not isinstance(args["kind"], str):
            raise bad(f"{where}.args.kind", "is not text")


def _short(value: object) -> str:
    """A value in a refusal, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
