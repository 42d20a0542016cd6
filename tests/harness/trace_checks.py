"""What every `--trace` folder must hold, checked without minipar's own code.

`check_trace(folder, run)` is called by the sweeps that trace their runs
(tests/parallel/test_every_mesh.py: every 4-D mesh and schedule of 4 ranks; test_data_parallel.py:
every grad sync, overlap beside a pipeline and experts; test_zero.py: ZeRO 1-3 with
experts). It reads `trace.json` as Perfetto would and asserts, for every event, the
fields of its phase, integer non-negative microseconds, spans nesting on every thread,
both ends of every flow inside a span of their thread, the metadata naming every
process and thread, and that the last step's spans are the last step's ledger: per
rank and (op, axis), the same calls, elements and bytes.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

PROCESS = re.compile(r"rank (\d+) \(dp \d+, cp \d+, tp \d+, pp \d+\)$")
THREAD = re.compile(r"(compute|comm [a-z_]+)( \(\d+\))?$")
FIELDS = {"X": ("name", "cat", "ts", "dur", "pid", "tid", "args"),
          "M": ("name", "pid", "tid", "args"),
          "C": ("name", "ts", "pid", "args"),
          "s": ("name", "cat", "id", "ts", "pid", "tid"),
          "f": ("name", "cat", "id", "ts", "pid", "tid", "bp")}
METADATA = {"process_name", "process_sort_index", "process_labels", "thread_name",
            "thread_sort_index"}
COUNTERS = {"params", "grads", "optimizer", "activations"}
PIPELINE = {"forward", "backward", "backward (B)", "backward (W)", "F&B"}


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_events(doc: dict, label: str) -> dict:
    """Every event of a merged trace; returns the X spans by (pid, tid)."""
    events = doc["traceEvents"]
    assert isinstance(events, list) and events, label
    info = doc["otherData"]["minipar"]
    ranks = info["ranks"]
    assert len(info["clock_offsets_us"]) == ranks and len(info["hosts"]) == ranks, label
    threads: dict[tuple[int, int], list[tuple[int, int, dict]]] = defaultdict(list)
    names: dict[tuple[int, int], str] = {}
    processes: dict[int, str] = {}
    flows: dict[int, list[dict]] = defaultdict(list)
    for event in events:
        ph = event.get("ph")
        assert ph in FIELDS, f"{label}: unknown phase in {event}"
        missing = [f for f in FIELDS[ph] if f not in event]
        assert not missing, f"{label}: {ph} event without {missing}: {event}"
        assert event["pid"] in range(ranks), f"{label}: pid {event}"
        for key in ("ts", "dur"):
            if key in FIELDS[ph]:
                assert is_count(event[key]), f"{label}: {key} not a count of us: {event}"
        if ph == "X":
            threads[(event["pid"], event["tid"])].append(
                (event["ts"], event["ts"] + event["dur"], event))
        elif ph == "M":
            assert event["name"] in METADATA, f"{label}: {event}"
            if event["name"] == "process_name":
                processes[event["pid"]] = event["args"]["name"]
            elif event["name"] == "thread_name":
                names[(event["pid"], event["tid"])] = event["args"]["name"]
        elif ph == "C":
            assert set(event["args"]) == COUNTERS or set(event["args"]) == {"activations"}, \
                f"{label}: {event}"
            assert all(is_count(v) for v in event["args"].values()), f"{label}: {event}"
        else:
            assert event["bp"] == "e" if ph == "f" else True, f"{label}: {event}"
            flows[event["id"]].append(event)
    assert sorted(processes) == list(range(ranks)), f"{label}: processes {processes}"
    for pid, name in processes.items():
        match = PROCESS.match(name)
        assert match and int(match.group(1)) == pid, f"{label}: process {pid} is {name!r}"
    for key, spans in threads.items():
        assert key in names and THREAD.match(names[key]), f"{label}: thread {key} {names}"
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends: list[int] = []
        for start, end, event in spans:   # Perfetto's rule: spans on a thread nest
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], \
                f"{label}: {event} overlaps its neighbour on thread {names[key]}"
            open_ends.append(end)
    for ident, ends in flows.items():
        assert sorted(e["ph"] for e in ends) == ["f", "s"], f"{label}: flow {ident}: {ends}"
        for end in ends:
            assert any(start <= end["ts"] <= stop for start, stop, _ in
                       threads[(end["pid"], end["tid"])]), f"{label}: flow end outside {end}"
    return threads


def check_trace(folder: Path, run: dict, label: str = "") -> None:
    """The merged trace of `run` (a `tests.harness.mpi.read_dump` result) in `folder`."""
    doc = json.loads((Path(folder) / "trace.json").read_text())
    cfg = run["config"]
    threads = check_events(doc, label)
    spans = [event for spans in threads.values() for _, _, event in spans]
    last = cfg["steps"]
    ranks = doc["otherData"]["minipar"]["ranks"]
    for rank in range(ranks):   # rank files: the same run, this rank's events
        mine = json.loads((Path(folder) / f"rank{rank}.json").read_text())
        assert mine["otherData"]["minipar"]["run"] == doc["otherData"]["minipar"]["run"]
        assert all(e["pid"] == rank for e in mine["traceEvents"]), label
    traced: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    for event in spans:
        args = event["args"]
        if event["cat"] == "comm" and args["step"] == last and args.get("ledger", True):
            assert event["name"] == args["op"] and is_count(args["bytes"]), label
            entry = traced[(event["pid"], args["op"], args["axis"])]
            entry[0] += 1
            entry[1] += args["elements"]
            entry[2] += args["bytes"]
    ledger = {(r["rank"], r["op"], r["group"]): [r["calls"], r["elements"], r["bytes"]]
              for r in run["ledger"]}
    assert dict(traced) == ledger, f"{label}: the last step's spans are not its ledger"
    per_rank = Counter((e["pid"], e["name"]) for e in spans)
    for rank in range(ranks):   # one update per step taken (a resumed run: its own steps)
        taken = sum(1 for e in spans if e["pid"] == rank and e["cat"] == "step")
        assert per_rank[(rank, "optimizer step")] == taken >= 1, f"{label} rank {rank}"
        assert per_rank[(rank, f"step {last}")] == 1, f"{label} rank {rank}"
    compute = [e for e in spans if e["cat"] == "compute" and e["args"]["step"] == last
               and e["name"] in PIPELINE]
    kinds = {e["name"] for e in compute}
    if cfg["pp"] > 1:   # every rank runs each of its chunks on every microbatch
        for rank in range(ranks):
            pairs = {(e["args"]["chunk"], e["args"]["microbatch"]) for e in compute
                     if e["pid"] == rank and e["name"] in ("forward", "F&B")}
            assert {m for _, m in pairs} >= set(range(cfg["microbatches"]))
        split = cfg["schedule"] in ("zb-h1", "zb-v", "dualpipev", "dualpipe")
        assert ("backward (W)" in kinds) == split, f"{label}: {kinds}"
        assert ("backward (B)" in kinds) == split, f"{label}: {kinds}"
    else:
        assert kinds == {"forward", "backward"}, f"{label}: {kinds}"
        assert len(compute) == 2 * ranks * cfg["microbatches"], label
    if cfg["pp"] > 1:   # a message from each pipeline Send to its Recv
        assert any(e["ph"] == "s" for e in doc["traceEvents"]), label
