"""Reading the flight recorder's dumps: every rank's calls lined up, the first disagreement.

What this file teaches: how to find the rank that disagrees in a hung job from
the last calls of every rank (flight.py writes them, `rank{r}.json` each). MPI
matches the calls of one communicator by their order, so two ranks' calls on
the same group with the same sequence number are the same collective -- or
should be. Lined up by (group, sequence number), the records show the first
place where the ranks part:

- a collective some member never entered: one rank is in call 9 over dp while
  the others' count on dp stops at 8 (they are somewhere else: say where);
- a message never sent: a Recv waits for the n-th message from a peer that has
  sent n - 1 (two stages that both receive first wait for each other);
- a Send nobody receives: the peer never entered its Recv;
- counts or dtypes that differ in the same call (an Alltoallv whose sender
  sends fewer elements than the receiver expects hangs the receiver);
- a rank that left no record (it exited, was killed, or is stopped), and one
  that left on its own or failed while the others waited for it.

`verdict` names the earliest of them in one sentence; `table` prints the
records aligned (`python -m minipar flight DIR --all`). Pure: no MPI, no clock. The
dumps arrive read and validated (flight_files.py `load`).

    python -m minipar flight minipar-flight
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from minipar.comm.flight_files import P2P_OPS, load


# ------------------------------------------------------------- describing
def ranks_text(ranks: Iterable[int]) -> str:
    """"rank 3", "ranks 0-2", "ranks 0,2", "ranks 0-2,5"."""
    ranks = sorted(set(ranks))
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else
                     f"{ranks[i]},{ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def _be(ranks: Iterable[int]) -> str:
    return "is" if len(set(ranks)) == 1 else "are"


def call_text(call: dict) -> str:
    """`Allreduce over dp (call 9, step 1, data_parallel.py:167)`, `Recv from pp rank 0
    (call 3, step 2, microbatch 1, parallel/pipeline/executor.py:208)`."""
    op, axis = call["op"], call["axis"]
    if op in ("Send", "Isend"):
        what = f"{op} to {axis} rank {call['peer']}"
    elif op in ("Recv", "Irecv"):
        what = f"{op} from {axis} rank {call['peer']}"
    elif op == "Sendrecv":
        what = f"Sendrecv with {axis} ranks {call['peer'][0]}/{call['peer'][1]}"
    else:
        what = f"{op} over {axis}"
    where = [f"call {call['seq']}"]
    if call.get("step") is not None:
        where.append(f"step {call['step']}")
    if call.get("microbatch") is not None:
        where.append(f"microbatch {call['microbatch']}")
    return f"{what} ({', '.join([*where, call['site']])})"


def stuck(dump: dict) -> dict | None:
    """The call this rank is inside (its last record, still started), or None."""
    calls = dump["calls"]
    return calls[-1] if calls and calls[-1]["state"] == "started" else None


def position(dump: dict) -> str:
    """Where a rank is, in words: inside a call, waiting on requests, or in no call."""
    call = stuck(dump)
    if call is not None:
        return f"in {call_text(call)}"
    if dump.get("waiting"):
        return f"in {dump['waiting']['what']}"
    if dump["reason"] == "abort" and dump["detail"]:   # the rank that ends the job: its
        why = re.sub(r"^minipar: (error: )?|: ending the job$", "", dump["detail"])  # own words
        return f"ending the job ({why})"
    return "in no call (computing, or past its last call)"


def positions_text(dumps: dict[int, dict], ranks: Iterable[int]) -> str:
    """"ranks 0,1 are in Allreduce over dp (...), rank 3 is in no call ..."; ranks at the
    same place (the same text) are named together."""
    by_place: dict[str, list[int]] = {}
    for r in sorted(set(ranks)):
        by_place.setdefault(position(dumps[r]), []).append(r)
    return ", ".join(f"{ranks_text(rs)} {_be(rs)} {place}" for place, rs in by_place.items())


# --------------------------------------------------------------- analysing
def _members(dumps: dict[int, dict], key: str) -> list[int]:
    return next(d["groups"][key]["members"] for d in dumps.values() if key in d["groups"])


def _made(dump: dict, key: str, what: str) -> int:
    """How many collectives (`calls`) or messages this rank made on group `key`."""
    return dump["groups"].get(key, {}).get(what, 0)


def _messages(dump: dict, key: str, direction: str, peer: int, tag: int) -> int:
    return dump["messages"].get(key, {}).get(f"{direction} {peer} {tag}", 0)


def _mismatches(dumps: dict[int, dict]) -> list[tuple[float, str]]:
    """(when, sentence) of every aligned collective whose members disagree on the op, the
    counts or the dtype."""
    found = []
    table: dict[tuple[str, int], dict[int, dict]] = {}
    for rank, dump in dumps.items():
        for call in dump["calls"]:
            if call["op"] not in P2P_OPS:
                table.setdefault((call["group"], call["seq"]), {})[rank] = call
    for (key, _), calls in table.items():
        if len(calls) < 2:
            continue
        when = max(c["t"] for c in calls.values())
        first = calls[min(calls)]
        ops = _split(calls, lambda c: c["op"])
        if len(ops) > 1:
            found.append((when, f"the ranks of {first['axis']} disagree on its call "
                          f"{first['seq']}: " + "; ".join(
                              f"{ranks_text(rs)} {_be(rs)} in {call_text(calls[rs[0]])}"
                              for rs in ops.values())))
            continue
        if first["op"] == "Alltoallv":
            sentence = _alltoallv_mismatch(calls, _members(dumps, key))
            if sentence:
                found.append((when, sentence))
            continue
        for field, label in (("elements", "counts"), ("dtype", "dtypes")):
            split = _split(calls, lambda c, f=field: c[f])
            if len(split) > 1:
                found.append((when, f"{label} differ in {call_text(first)}: " + ", ".join(
                    f"{ranks_text(rs)} {'has' if len(rs) == 1 else 'have'} "
                    f"{calls[rs[0]][field]}{' elements' if field == 'elements' else ''}"
                    for value, rs in split.items())))
                break
        else:  # the same op and sizes from different lines: MPI paired two different calls
            sites = _split(calls, lambda c: c["site"])
            if len(sites) > 1:
                step = f", step {first['step']}" if first.get("step") is not None else ""
                found.append((when, f"MPI paired different calls as {first['op']} over "
                              f"{first['axis']} (call {first['seq']}{step}): " + ", ".join(
                                  f"{ranks_text(rs)} made it at {site}"
                                  for site, rs in sites.items())
                              + "; from there on they are a call apart"))
    return found


def _split(calls: dict[int, dict], value: object) -> dict[object, list[int]]:
    out: dict[object, list[int]] = {}
    for rank, call in sorted(calls.items()):
        out.setdefault(value(call), []).append(rank)
    return out


def _alltoallv_mismatch(calls: dict[int, dict], members: list[int]) -> str | None:
    """Rank i sends send_counts[j] elements to group rank j, which expects recv_counts[i]."""
    if any(c["send_counts"] is None for c in calls.values()):
        return None
    for i, sender in sorted(calls.items()):
        for j, receiver in sorted(calls.items()):
            a, b = members.index(i), members.index(j)
            sent, expected = sender["send_counts"][b], receiver["recv_counts"][a]
            if sent != expected:
                return (f"counts differ in {call_text(sender)}: rank {i} sends {sent} "
                        f"elements to rank {j}, which expects {expected} from it")
    return None


def _never_entered(dumps: dict[int, dict]) -> list[tuple[float, str, str, set[int], set[int]]]:
    """(when, kind, description, the stuck rank, the ranks it waits for in vain) of every
    rank inside a call that a partner with a record never reached."""
    found = []
    for rank, dump in dumps.items():
        call = stuck(dump)
        if call is None:
            found += _posted_in_vain(dumps, rank)
            continue
        key = call["group"]
        members = _members(dumps, key)
        me = members.index(rank)
        if call["op"] not in P2P_OPS:
            absent = {q for q in members if q in dumps and q != rank
                      and _made(dumps[q], key, "calls") < call["seq"]}
            if absent:
                found.append((call["t"], "collective", call_text(call), {rank}, absent))
            continue
        sends = call["op"] in ("Send", "Isend") or call["op"] == "Sendrecv"
        receives = call["op"] in ("Recv", "Irecv") or call["op"] == "Sendrecv"
        peers = call["peer"] if call["op"] == "Sendrecv" else [call["peer"]] * 2
        nths = call["nth"] if call["op"] == "Sendrecv" else [call["nth"]] * 2
        if sends and members[peers[0]] in dumps and _messages(
                dumps[members[peers[0]]], key, "received", me, call["tag"]) < nths[0]:
            found.append((call["t"], "unreceived", call_text(call), {rank},
                          {members[peers[0]]}))
        recv_peer = peers[1] if call["op"] == "Sendrecv" else peers[0]
        recv_nth = nths[1] if call["op"] == "Sendrecv" else nths[0]
        if receives and members[recv_peer] in dumps and _messages(
                dumps[members[recv_peer]], key, "sent", me, call["tag"]) < recv_nth:
            found.append((call["t"], "unsent", call_text(call), {rank}, {members[recv_peer]}))
    return found


def _posted_in_vain(dumps: dict[int, dict], rank: int) -> list[tuple]:
    """For a rank waiting on requests (a Waitall): its posted Isend, Irecv or Iallreduce
    that a partner never matched, as `_never_entered` entries."""
    dump = dumps[rank]
    if not dump.get("waiting"):
        return []
    found = []
    for call in dump["calls"]:
        if call["state"] != "posted":
            continue
        key = call["group"]
        members = _members(dumps, key)
        what = f"{dump['waiting']['what']}, for its {call_text(call)}"
        if call["op"] == "Iallreduce":
            absent = {q for q in members if q in dumps and q != rank
                      and _made(dumps[q], key, "calls") < call["seq"]}
            if absent:
                found.append((call["t"], "collective", what, {rank}, absent))
            continue
        peer = members[call["peer"]]
        if peer not in dumps:
            continue
        me = members.index(rank)
        sends = call["op"] == "Isend"
        counted = _messages(dumps[peer], key, "received" if sends else "sent", me, call["tag"])
        if counted < call["nth"]:
            found.append((call["t"], "unreceived" if sends else "unsent", what, {rank},
                          {peer}))
    return found


def verdict(dumps: dict[int, dict]) -> str:
    """The first disagreement among the dumps of one run, in one sentence."""
    world = next(iter(dumps.values()))["world"]
    present = set(dumps)
    missing = set(range(world)) - present
    everyone_else = sorted(present)
    if missing:
        return (f"{ranks_text(missing)} left no record (it exited, was killed or is "
                f"stopped); {positions_text(dumps, everyone_else)}")
    gone = {r: d for r, d in dumps.items()
            if d["reason"] == "abort" and "left on its own" in d["detail"]}
    if gone:
        r = min(gone)
        last = gone[r]["calls"][-1] if gone[r]["calls"] else None
        at = (f" at step {last['step']}" if last and last.get("step") else "") + (
            f", after {call_text(last)}" if last else "")
        said = re.search(r"left on its own \((.*?)\)(?: while|$)", gone[r]["detail"])
        why = said.group(1) if said else "no reason given"
        return (f"rank {r} left the job on its own ({why}){at}; "
                f"{positions_text(dumps, sorted(present - {r}))}")
    candidates = [(when, 0, sentence) for when, sentence in _mismatches(dumps)]
    entered = _never_entered(dumps)
    if entered:
        # A rank that never entered a call because it waits in another call, one that a
        # partner of its own never entered, is not the cause: the chain of waits ends at the
        # cause. Started first is no guide alone (on shared cores the cause's own partner
        # may be the last to be scheduled); when every wait is part of a cycle, all count.
        causes = [e for e in entered
                  if not e[4] <= set().union(*(o[3] for o in entered if o is not e))]
        when, kind, text, _, _ = min(causes or entered, key=lambda e: e[0])
        same = [e for e in entered if e[1] == kind and e[2] == text]
        waiting = set().union(*(e[3] for e in same))
        absent = set().union(*(e[4] for e in same)) - waiting
        verb = {"collective": "never entered it", "unsent": "never sent that message",
                "unreceived": "never entered the matching Recv"}[kind]
        sentence = f"{ranks_text(waiting)} {_be(waiting)} in {text}; "
        if absent:
            places = {position(dumps[q]) for q in absent}
            sentence += (f"{ranks_text(absent)} {verb}: "
                         + (f"{'it is' if len(absent) == 1 else 'they are'} {places.pop()}"
                            if len(places) == 1 else positions_text(dumps, absent)))
        else:  # they wait for each other
            sentence += f"each waits for another's message ({verb})"
        # the ranks it waits for, waiting in turn for it: a cycle, which names both sides
        back = set().union(*(o[4] for o in entered if o[3] <= absent), set())
        if absent and waiting <= back:
            sentence += (f" -- a cycle: {ranks_text(waiting)} and {ranks_text(absent)} each "
                         "wait for the other, and no rank of it sends first")
        mine = stuck(dumps[min(waiting)])
        theirs = [stuck(dumps[q]) for q in absent]
        if mine and theirs and all(c is not None and c["site"] == mine["site"]
                                   and c["group"] != mine["group"] for c in theirs):
            sentence += (f" -- the same line {mine['site']} on another group: that call was "
                         "handed the wrong one")
        candidates.append((when, 1, sentence))
    if candidates:
        return min(candidates)[2]
    failed = {r: d for r, d in dumps.items() if d["reason"] == "abort" and d["detail"]}
    if failed:
        r = min(failed)
        return (f"rank {r} ended the job ({failed[r]['detail']}); the records agree: "
                f"{positions_text(dumps, sorted(present))}")
    return ("the records agree: no rank waits for a call another rank never made "
            f"({positions_text(dumps, sorted(present))})")


def verdict_of_folder(folder: Path | str, run: str | None = None) -> str:
    """`verdict(load(folder, run))`."""
    return verdict(load(folder, run))


def _cell(call: dict) -> str:
    """One call in the table: `Allreduce 4634 data_parallel.py:167`, `Recv<1 ...` (from
    group rank 1), `Isend>1 ...` (to it); `*` marks the call a rank is inside."""
    peer = call.get("peer")
    arrow = "" if peer is None else ("<" if call["op"] in ("Recv", "Irecv") else ">") + (
        "/".join(map(str, peer)) if isinstance(peer, list) else str(peer))
    return (f"{call['op']}{arrow} {call['elements']} {call['site']}"
            + (" *" if call["state"] == "started" else ""))


def table(dumps: dict[int, dict]) -> str:
    """Every group's records side by side: one row per call number, one column per member
    that left a record, `<-- differs` where the members' ops or counts part."""
    lines = []
    keys = sorted({call["group"] for d in dumps.values() for call in d["calls"]})
    for key in keys:
        members = [m for m in _members(dumps, key) if m in dumps]
        for kind, ops in (("calls", lambda op: op not in P2P_OPS),
                          ("messages", lambda op: op in P2P_OPS)):
            rows: dict[int, dict[int, dict]] = {}
            for r in members:
                for call in dumps[r]["calls"]:
                    if call["group"] == key and ops(call["op"]):
                        rows.setdefault(call["seq"], {})[r] = call
            if not rows:
                continue
            lines.append(f"{key} {kind} (" + ", ".join(
                f"rank {r}: {_made(dumps[r], key, kind)} made" for r in members) + ")")
            texts = {(seq, r): _cell(call) for seq, row in rows.items()
                     for r, call in row.items()}
            width = max(len(t) for t in texts.values()) + 2
            lines.append("  call  " + "".join(f"{'rank ' + str(r):<{width}}"
                                              for r in members).rstrip())
            for seq in sorted(rows):
                cells = [f"{texts.get((seq, r), '-'):<{width}}" for r in members]
                shown = {(c["op"], c["elements"], c["site"]) for c in rows[seq].values()}
                flag = "  <-- differs" if kind == "calls" and len(shown) > 1 and rows[seq][
                    min(rows[seq])]["op"] != "Alltoallv" else ""
                lines.append(f"  {seq:<6}" + "".join(cells).rstrip() + flag)
    lines.append("(* the call a rank is inside; - no record of it)")
    return "\n".join(lines)
