"""The flight recorder's files: reading `rank{r}.json` dumps, and refusing what is not one.

What this file teaches: a reader of files a user hands it validates before it uses
anything (docs/design.md, "Flight recorder and hangs"): the size and the nesting depth
first (a file of 100 000 brackets must not exhaust Python's stack), then every field a
dump must have, its type and range (a rank inside the world, a peer inside its group,
counts as long as the group), and the dumps of one run agreeing with each other (the
same world size, the same members for a group). Whatever fails is one line naming the
file and the field (`FlightError`), never a traceback. `parse` serves the timeline's
reader too (teaching/trace_report.py). flight.py writes the dumps; flight_report.py
lines them up and names the first disagreement.

    dumps = load("minipar-flight")          # {rank: dump} of the newest run in the folder
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FORMAT = "minipar-flight 1"     # the "format" field of every dump (flight.py writes them)
P2P_OPS = frozenset({"Send", "Recv", "Isend", "Irecv", "Sendrecv"})


class FlightError(ValueError):
    """A folder or file that is not a set of flight dumps (one line, for `fail`)."""


# ---------------------------------------------------------------- reading
_CALL_FIELDS = {"group": str, "axis": str, "seq": int, "op": str, "elements": int,
                "dtype": str, "site": str, "state": str, "t": (int, float)}
_DUMP_FIELDS = {"format": str, "run": str, "rank": int, "world": int, "reason": str,
                "detail": str, "doing": str, "groups": dict, "messages": dict, "calls": list,
                "time": (int, float)}


def run_of(path: Path) -> str | None:
    """The run id a dump file belongs to, or None if it is not (yet) a readable dump."""
    try:
        return json.loads(path.read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None


MAX_BYTES = 256 << 20   # a dump holds at most 1000 calls: far less than this
MAX_DEPTH = 8            # a dump nests objects and lists 4 deep (a call's peers)
MAX_WORLD = 1 << 20


def depth(data: object, limit: int) -> int:
    """How deep `data` nests lists and objects, counted up to `limit + 1` (no deeper:
    a crafted file of 100 000 brackets is judged without recursion)."""
    level, frontier = 0, [data]
    while frontier and level <= limit:
        frontier = [child for item in frontier if isinstance(item, (dict, list))
                    for child in (item.values() if isinstance(item, dict) else item)]
        level += 1
    return level - 1 if not frontier else level


def parse(path: Path, max_bytes: int, max_depth: int, error: type[Exception],
          what: str) -> object:
    """The JSON in `path`, or `error` naming the file and the flaw: unreadable, larger
    than `max_bytes`, not UTF-8 or JSON, nested deeper than `max_depth` (100 000
    brackets make Python's parser raise RecursionError: caught, and said so)."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path} is not {what}: {size} bytes, more than the {max_bytes} one "
                        "may have")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except RecursionError:
        raise error(f"{path} is not {what}: lists or objects nested more than "
                    f"{max_depth} deep") from None
    except (OSError, UnicodeDecodeError, ValueError) as flaw:
        if isinstance(flaw, error):
            raise
        said = str(flaw).splitlines()[0] if str(flaw) else type(flaw).__name__
        kind = "unreadable" if isinstance(flaw, OSError) else "truncated or not JSON"
        raise error(f"{path} is not {what}: {kind} ({said})") from None
    if depth(data, max_depth) > max_depth:
        raise error(f"{path} is not {what}: lists or objects nested more than "
                    f"{max_depth} deep")
    return data


def _number(value: object) -> bool:
    """A finite int or float (not a bool, not NaN or infinity, not beyond 1e15)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and abs(value) <= 1e15


def _int(value: object, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 1 << 53


def _check(path: Path, data: object) -> dict:
    """`data` if it is a well-formed dump, else a FlightError naming the first flaw."""
    def bad(what: str) -> FlightError:
        return FlightError(f"{path} is not a flight dump of minipar: {what}")

    if not isinstance(data, dict):
        raise bad("not a JSON object")
    for name, kind in _DUMP_FIELDS.items():
        if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool):
            raise bad(f"field {name!r} is missing or not a {getattr(kind, '__name__', 'number')}")
    if data["format"] != FORMAT:
        raise bad(f"format {data['format']!r}, expected {FORMAT!r}")
    if not 1 <= data["world"] <= MAX_WORLD:
        raise bad(f"field 'world' is {data['world']}, not between 1 and {MAX_WORLD}")
    if not 0 <= data["rank"] < data["world"] or path.name != f"rank{data['rank']}.json":
        raise bad(f"rank {data['rank']} of a world of {data['world']} in a file named "
                  f"{path.name}")
    if not _number(data["time"]):
        raise bad(f"field 'time' is {data['time']}, not a finite time")
    waiting = data.get("waiting")
    if waiting is not None and not (isinstance(waiting, dict) and isinstance(
            waiting.get("what"), str) and _number(waiting.get("seconds"))):
        raise bad("field 'waiting' is neither null nor {\"what\": text, \"seconds\": number}")
    for key, group in data["groups"].items():
        members = group.get("members") if isinstance(group, dict) else None
        if not (isinstance(members, list) and members and all(
                _int(m) and m < data["world"] for m in members)
                and len(set(members)) == len(members) and data["rank"] in members
                and _int(group.get("calls")) and _int(group.get("messages"))):
            raise bad(f"group {key!r} has no list of distinct members in the world, this "
                      "rank among them, and counts")
    for key, counts in data["messages"].items():
        if key not in data["groups"] or not isinstance(counts, dict) or not all(
                isinstance(n, int) and len(k.split()) == 3 for k, n in counts.items()):
            raise bad(f"the message counts of group {key!r} are malformed")
    for i, call in enumerate(data["calls"]):
        if not isinstance(call, dict):
            raise bad(f"call {i} is not an object")
        for name, kind in _CALL_FIELDS.items():
            if not isinstance(call.get(name), kind) or isinstance(call.get(name), bool):
                raise bad(f"call {i} has no {name!r} of the right kind")
        if not (_int(call["seq"], 1) and _int(call["elements"]) and _number(call["t"])):
            raise bad(f"call {i} has a 'seq' below 1, a negative 'elements' or a 't' that "
                      "is not a finite time")
        for name in ("step", "microbatch"):
            if call.get(name) is not None and not _int(call[name]):
                raise bad(f"call {i} has a {name!r} that is neither null nor a count")
        if call["group"] not in data["groups"]:
            raise bad(f"call {i} is on group {call['group']!r}, which the dump does not list")
        if call["state"] not in ("started", "completed", "posted"):
            raise bad(f"call {i} has the state {call['state']!r}")
        if call["op"] in P2P_OPS and not _peer_ok(call, len(data["groups"][call["group"]]
                                                            ["members"])):
            raise bad(f"call {i} ({call['op']}) has no valid peer, tag and message number")
        if call["op"] == "Alltoallv" and not _counts_ok(call, len(
                data["groups"][call["group"]]["members"])):
            raise bad(f"call {i} (Alltoallv) has counts that are not one per rank of its "
                      "group")
    return data


def _peer_ok(call: dict, size: int) -> bool:
    peer, nth = call.get("peer"), call.get("nth")
    if call["op"] == "Sendrecv":   # (dest, source) and the n-th message to / from each
        peers, nths = peer, nth
    else:
        peers, nths = [peer], [nth]
    return (isinstance(peers, list) and isinstance(nths, list)
            and len(peers) == len(nths) == (2 if call["op"] == "Sendrecv" else 1)
            and all(_int(p) and p < size for p in peers)
            and all(_int(n, 1) for n in nths) and _int(call.get("tag")))


def _counts_ok(call: dict, size: int) -> bool:
    if call.get("send_counts") is None and call.get("recv_counts") is None:
        return True   # an Alltoallv on plain buffers: no counts to compare
    return all(isinstance(call.get(name), list) and len(call[name]) == size
               and all(_int(c) for c in call[name])
               for name in ("send_counts", "recv_counts"))


def load(folder: Path | str, run: str | None = None) -> dict[int, dict]:
    """The dumps of one run in `folder`, by world rank: the run of the newest file
    unless `run` is given (older runs' files are left out). Raises FlightError on a
    folder that is missing or holds no dump, and on any file that is not one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FlightError(f"{folder} is not a folder of flight dumps "
                          f"({'a file' if folder.exists() else 'it does not exist'})")
    paths = sorted(folder.glob("rank*.json"))
    if not paths:
        raise FlightError(f"{folder} holds no flight dump (rank*.json): nothing hung, "
                          "aborted or was signalled with --flight pointing here")
    dumps = []
    for path in paths:
        data = parse(path, MAX_BYTES, MAX_DEPTH, FlightError, "a flight dump of minipar")
        dumps.append(_check(path, data))
    if run is None:
        run = max(dumps, key=lambda d: d["time"])["run"]
    mine = {d["rank"]: d for d in dumps if d["run"] == run}
    if not mine:
        raise FlightError(f"{folder} holds no flight dump of run {run}")
    worlds = {d["world"] for d in mine.values()}
    if len(worlds) > 1:
        raise FlightError(f"{folder}: the dumps of run {run} disagree on the world size "
                          f"({sorted(worlds)})")
    groups: dict[str, tuple[int, list[int]]] = {}
    for rank, dump in sorted(mine.items()):   # a group is the same ranks in every dump
        for key, group in dump["groups"].items():
            first, members = groups.setdefault(key, (rank, group["members"]))
            if group["members"] != members:
                raise FlightError(f"{folder}/rank{rank}.json is not a flight dump of this "
                                  f"run: group {key!r} has members {group['members']}, "
                                  f"rank{first}.json says {members}")
    return mine
