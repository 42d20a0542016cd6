"""Timelines: what every rank did, and when, in the format Perfetto and chrome://tracing open.

What this file teaches: a bubble, an overlapped gradient sync or a ring that hides its
traffic are claims about *time*, and a profiler timeline shows them. With
`train --trace DIR` every rank records, on one shared clock,

- spans (`ph: "X"`, `ts` and `dur` in integer microseconds) on a `compute` thread:
  each step, the forward and backward of every microbatch and chunk (B and W apart
  under the zero-bubble schedules), the optimizer step, a checkpoint save, and the
  waits for nonblocking requests;
- spans on `comm <axis>` threads: every call `comm.Group` makes (`args`: op, axis,
  elements, bytes, the call's sequence number on its communicator), a nonblocking one
  from its start to its Wait. Spans on one thread must nest (Perfetto's rule), and
  several requests in flight at once overlap, so a thread is cut into lanes
  (`comm pp`, `comm pp (2)`, ...) packed so that every lane nests;
- flow events (`ph: "s"` / `"f"`) from each message's send to its receive: both ends
  name it by (axis, sender, receiver, tag, n-th message on that channel), which MPI's
  non-overtaking rule makes the same message on both sides;
- counters (`ph: "C"`) of the bytes a rank holds: parameters, gradients, optimizer
  state and the activations kept for backward;
- metadata (`ph: "M"`): process `rank r (dp i, cp j, tp k, pp l)`, its threads, its
  host and clock offset.

One clock: every rank of a host reads the same monotonic clock (`time.monotonic_ns`,
CLOCK_MONOTONIC on Linux, shared by all processes of a machine); a rank on another host
measures its offset to rank 0's clock at start-up by ping-pong (the round trip with the
least time, its midpoint taken as rank 0's reading: Cristian's algorithm), written in
the metadata. At the end each rank writes `DIR/rank{r}.json` and rank 0 the merged
`DIR/trace.json`; `python -m minipar trace DIR` (trace_report.py) reads it.

Off (no `--trace`), `RECORDER` is None and every hook is one test of it.

    mpiexec -n 4 python -m minipar train --pp 4 --microbatches 8 --trace /tmp/t
    python -m minipar trace /tmp/t --plot /tmp/t/gantt.png
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from minipar.comm import watchdog

# `Group` is comm.Group and `Mesh` mesh.Mesh: named, not imported (comm/collectives.py imports this
# file, so importing them back, even only for the type checker, would close a cycle)
Group = Mesh = object

RECORDER: Recorder | None = None     # the recorder of this rank while a --trace run runs
NOTHING = contextlib.nullcontext()  # what every hook returns when nothing is recorded
FILES = "trace.json"                # the merged file; the ranks' are rank{r}.json
COMPUTE, COMM, WAIT = "compute", "comm", "wait"
POINT_TO_POINT = ("Send", "Isend", "Recv", "Irecv", "Sendrecv")
PINGS = 8                          # round trips of the clock-offset ping-pong


def trace_files(folder: Path) -> list[str]:
    """The names of the trace files a folder holds (trace.json, rank{r}.json)."""
    return sorted(p.name for p in folder.iterdir()
                  if p.name == FILES or (p.name.startswith("rank") and p.suffix == ".json"))


# -------------------------------------------------------------- the recorder
class Span:
    """One span being recorded: [name, cat, thread, start ns, end ns or None, args]."""

    __slots__ = ("record", "stamp", "recorder")

    def __init__(self, recorder: Recorder, record: list, stamp: object) -> None:
        self.recorder, self.record, self.stamp = recorder, record, stamp

    def __enter__(self) -> Span:
        if self.stamp is not None:
            self.stamp.__enter__()
        self.record[3] = time.monotonic_ns()
        return self

    def __exit__(self, *exc: object) -> bool:
        if self.record[2] == COMPUTE or self.record[5].get("blocking"):
            self.record[4] = time.monotonic_ns()
        if self.stamp is not None:
            self.stamp.__exit__(*exc)
        return False


class Recorder:
    """This rank's events while a run is traced (plain lists; turned into the Trace
    Event Format once, at the end, by `events`)."""

    def __init__(self, rank: int, label: str, host: str, offset_ns: int, run: str) -> None:
        self.rank, self.label, self.host, self.offset_ns, self.run = rank, label, host, \
            offset_ns, run
        self.spans: list[list] = []         # [name, cat, thread, t0, t1, args]
        self.flows: list[tuple[str, int, list]] = []  # (phase, id, the span it binds to)
        self.counters: list[tuple[int, dict]] = []
        self.pending: dict[int, list] = {}  # id(request) -> its open span
        self.channels: dict[tuple, int] = {}  # (axis, src, dst, tag, way) -> messages so far
        self.world_ranks: dict[int, list[int]] = {}  # id(comm) -> its ranks' world ranks
        self.sequence: dict[tuple, int] = {}  # (id(comm), p2p?) -> calls so far
        self.groups: dict[str, list[int]] = {}  # axis -> my group's world ranks
        self.held: dict[object, int] = {}   # activation bytes kept per (chunk, microbatch)
        self.tapes: dict[int, int] = {}     # a chunk's tape bytes of one microbatch
        self.memory: Callable[[], object] | None = None  # updater.memory
        self.step = 0
        self.start_ns = time.monotonic_ns()

    # ------------------------------------------------------------ spans
    def span(self, name: str, cat: str, args: dict) -> Span:
        args["step"] = self.step
        record = [name, cat, COMPUTE, 0, None, args]
        self.spans.append(record)
        return Span(self, record, None)

    def call(self, group: Group, op: str, elements: int, itemsize: int, what: str | None,
             dest: int | None, source: int | None, tag: int, recvtag: int) -> Span:
        """The span of one `Group` call (blocking if `what` names it for the watchdog)."""
        comm = group.comm
        key = id(comm)
        ranks = self.world_ranks.get(key)
        if ranks is None:
            ranks = self.world_ranks[key] = _world_ranks(comm)
            self.groups.setdefault(group.name, ranks)
        counter = (key, op in POINT_TO_POINT)   # collectives: numbered alike on every rank
        seq = self.sequence.get(counter, 0)
        self.sequence[counter] = seq + 1
        args = {"op": op, "axis": group.name, "elements": int(elements),
                "bytes": int(elements) * int(itemsize), "seq": seq, "step": self.step,
                "blocking": what is not None}
        if not group.ledger.enabled:
            args["ledger"] = False   # not the model's traffic (the loss report, ...)
        record = [op, COMM, f"{COMM} {group.name}", 0, None, args]
        self.spans.append(record)
        if op in POINT_TO_POINT:
            me = self.rank
            if dest is not None:
                args["dest"] = ranks[dest]
                self._flow("s", (group.name, me, ranks[dest], tag), record)
            if source is not None:
                args["source"] = ranks[source]
                self._flow("f", (group.name, ranks[source], me, recvtag), record)
        return Span(self, record, watchdog.waiting(what) if what else None)

    def _flow(self, phase: str, channel: tuple, record: list) -> None:
        n = self.channels.get((*channel, phase), 0)
        self.channels[(*channel, phase)] = n + 1
        self.flows.append((phase, flow_id(*channel, n), record))

    def closed(self, requests: Iterable[object], wait: list) -> None:
        """The requests a Wait just completed: their spans end now (at the Wait)."""
        end = wait[4]
        ends = []
        for request in requests:
            record = self.pending.pop(id(request), None)
            if record is not None:
                record[4] = end
                ends.append([record[5]["axis"], record[5]["seq"]])
        wait[5]["requests"] = ends

    # --------------------------------------------------------- counters
    def sample(self) -> None:
        """A counter event of the bytes this rank holds now."""
        states = self.memory() if self.memory is not None else None
        values = {"activations": sum(self.held.values())}
        if states is not None:
            values.update(params=int(states.params), grads=int(states.grads),
                          optimizer=int(states.optimizer))
        self.counters.append((time.monotonic_ns(), values))

    # ------------------------------------------------------------- output
    def events(self, origin_ns: int, coords: dict[str, int]) -> list[dict]:
        """This rank's events in the Trace Event Format, times in microseconds from
        `origin_ns` on the shared clock (every rank's earliest start)."""
        pid = self.rank
        shift = self.offset_ns - origin_ns

        def us(t: int) -> int:
            return (t + shift) // 1000

        now = time.monotonic_ns()
        for record in self.spans:  # a request never waited: it ends with the run
            if record[4] is None:
                record[4] = now
        lanes = pack_lanes([(r[2], us(r[3]), us(r[4])) for r in self.spans])
        threads = sorted(set(lanes) | {(COMPUTE, 0)}, key=lambda t: (t[0] != COMPUTE, t))
        tid = {thread: i for i, thread in enumerate(threads)}
        out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                "args": {"name": self.label}},
               {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                "args": {"sort_index": pid}},
               {"name": "process_labels", "ph": "M", "pid": pid, "tid": 0,
                "args": {"labels": f"host {self.host}, clock offset "
                                   f"{self.offset_ns / 1000:+.0f} us"}}]
        for thread, i in tid.items():
            name, lane = thread
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": i,
                        "args": {"name": name if lane == 0 else f"{name} ({lane + 1})"}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": i,
                        "args": {"sort_index": i}})
        where = {}
        for record, lane in zip(self.spans, lanes):
            start, end = us(record[3]), us(record[4])
            where[id(record)] = (tid[lane], start, end)
            out.append({"name": record[0], "cat": record[1], "ph": "X", "ts": start,
                        "dur": end - start, "pid": pid, "tid": tid[lane], "args": record[5]})
        for phase, ident, record in self.flows:
            thread, start, end = where[id(record)]
            event = {"name": "message", "cat": "flow", "ph": phase, "id": ident,
                     "ts": start if phase == "s" else max(start, end - 1), "pid": pid,
                     "tid": thread}
            if phase == "f":
                event["bp"] = "e"   # binds to the receive's span around ts
            out.append(event)
        for t, values in self.counters:
            out.append({"name": "live bytes", "ph": "C", "ts": max(0, us(t)), "pid": pid,
                        "tid": 0, "args": values})
        return out


def _world_ranks(comm: object) -> list[int]:
    """The world rank of each rank of `comm`, in its rank order."""
    from mpi4py import MPI  # here: this file is imported by train.py, which runs without MPI

    return list(comm.Get_group().Translate_ranks(list(range(comm.Get_size())),
                                                 MPI.COMM_WORLD.Get_group()))


AXIS_IDS = {"world": 0, "dp": 1, "tp": 2, "pp": 3, "ep": 4, "edp": 5, "cp": 6}


def flow_id(axis: str, source: int, dest: int, tag: int, n: int) -> int:
    """The id both ends give the n-th message from `source` to `dest` (world ranks) with
    `tag` on `axis`: 4 + 12 + 12 + 6 + 19 bits, under 2**53 (JSON numbers stay exact)."""
    key = (((AXIS_IDS.get(axis, 7) * 4096 + source % 4096) * 4096 + dest % 4096) * 64
           + tag % 64)
    return key * 2 ** 19 + n % 2 ** 19


def pack_lanes(spans: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    """The lane (thread, lane index) of each (thread, start, end) span such that every
    lane nests: spans taken by start (the longer first), each put on the first lane of
    its thread where it starts after, or lies inside, the innermost span still open."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][1], -spans[i][2], i))
    stacks: dict[str, list[list[int]]] = {}   # thread -> per lane, the open spans' ends
    lane_of: list[tuple[str, int]] = [("", 0)] * len(spans)
    for i in order:
        thread, start, end = spans[i]
        lanes = stacks.setdefault(thread, [])
        for k, stack in enumerate(lanes):
            while stack and stack[-1] <= start:   # spans over by now: closed
                stack.pop()
            if not stack or end <= stack[-1]:     # inside the innermost open one
                stack.append(end)
                lane_of[i] = (thread, k)
                break
        else:
            lanes.append([end])
            lane_of[i] = (thread, len(lanes) - 1)
    return lane_of


# ------------------------------------------------------------ hooks (cheap when off)
def span(name: str, cat: str = COMPUTE, **args: object) -> contextlib.AbstractContextManager:
    """A span on the compute thread around a `with` block (nothing when not tracing)."""
    recorder = RECORDER
    return NOTHING if recorder is None else recorder.span(name, cat, args)


def posted(call: Span | None, request: object) -> object:
    """A nonblocking call's request: its span stays open until a `wait` completes it."""
    if call is not None:
        call.recorder.pending[id(request)] = call.record
    return request


def wait(requests: list, what: str) -> None:
    """`MPI.Request.Waitall(requests)`, stamped for the watchdog, and when tracing a
    `wait` span on the compute thread that ends each request's span on its comm thread."""
    from mpi4py import MPI  # here: this file is imported by train.py, which runs without MPI

    recorder = RECORDER
    if recorder is None:
        with watchdog.waiting(what):
            MPI.Request.Waitall(requests)
        return
    with watchdog.waiting(what), recorder.span("wait", WAIT, {"what": what}) as waiting:
        MPI.Request.Waitall(requests)
    recorder.closed(requests, waiting.record)


def hold(key: tuple[int, int], output: object) -> None:
    """Count the activations the tape behind `output` keeps for backward, under `key`
    (chunk, microbatch), and sample the counters. The tape is walked once per chunk and
    step (its first microbatch): the others have the same shapes, and a walk per
    microbatch would cost more than the rest of the tracing."""
    recorder = RECORDER
    if recorder is not None:
        from minipar.core.recompute import tape_bytes  # here: only a traced run walks tapes

        chunk = ("tape", key[0])
        if chunk not in recorder.held:
            recorder.held[chunk] = 0
            recorder.tapes[key[0]] = tape_bytes(output)
        recorder.held[key] = recorder.tapes[key[0]]
        recorder.sample()


def release(key: object) -> None:
    """The activations under `key` are freed (its backward ran); sample the counters."""
    recorder = RECORDER
    if recorder is not None:
        recorder.held.pop(key, None)
        recorder.sample()


def step(number: int) -> contextlib.AbstractContextManager:
    """The span of training step `number` (1-based); later spans carry it in `args`."""
    recorder = RECORDER
    if recorder is None:
        return NOTHING
    recorder.step = number
    recorder.held.clear()
    recorder.sample()
    return recorder.span(f"step {number}", "step", {})


def instrument(optimizer: object, memory: Callable[[], object]) -> None:
    """While a run is traced, record the optimizer's updates as `optimizer step` spans,
    and read the model states' bytes from `memory` (the updater's) for the counters."""
    recorder = RECORDER
    if recorder is None:
        return
    recorder.memory = memory
    update = optimizer.step

    def traced(*args: object, **kwargs: object) -> None:
        now = RECORDER
        if now is None:   # the run's recording is over (a checkpoint, a benchmark)
            update(*args, **kwargs)
            return
        with now.span("optimizer step", COMPUTE, {}):
            update(*args, **kwargs)
        now.sample()
    optimizer.step = traced


# ----------------------------------------------------------- a traced run
def clock_offset(world: Group, host: str) -> int:
    """Nanoseconds to add to this rank's clock to read rank 0's. Ranks on rank 0's host
    share its clock (0); every other rank plays `PINGS` round trips with rank 0, one rank
    at a time, and keeps the one with the least round trip: rank 0's reading minus the
    midpoint of the trip. A collective over `world`."""
    import numpy as np

    hosts = world.allgather(host)
    offset = 0
    stamp = np.zeros(1, dtype=np.int64)
    for other in range(1, world.size):
        if hosts[other] == hosts[0]:
            continue
        if world.rank == 0:
            for _ in range(PINGS):
                world.Recv(stamp, source=other, tag=7)
                stamp[0] = time.monotonic_ns()
                world.Send(stamp, dest=other, tag=7)
        elif world.rank == other:
            best = None
            for _ in range(PINGS):
                sent = time.monotonic_ns()
                world.Send(stamp, dest=0, tag=7)
                world.Recv(stamp, source=0, tag=7)
                back = time.monotonic_ns()
                if best is None or back - sent < best[0]:
                    best = (back - sent, int(stamp[0]) - (sent + back) // 2)
            offset = best[1]
    return offset


def label(rank: int, coords: dict[str, int]) -> str:
    """The process name of a rank: `rank 5 (dp 0, cp 0, tp 1, pp 1)`."""
    return f"rank {rank} (dp {coords['dp']}, cp {coords['cp']}, tp {coords['tp']}, " \
           f"pp {coords['pp']})"


@contextlib.contextmanager
def recording(folder: str | None, mesh: Mesh, config: dict) -> Iterator[Recorder | None]:
    """Record this rank's run inside the block when `folder` is given, then write
    `folder/rank{r}.json` on every rank and the merged `folder/trace.json` on rank 0
    (collectives over the world: every rank must leave the block normally; on an
    exception nothing is written, and no rank waits for another)."""
    global RECORDER
    if folder is None:
        yield None
        return
    world = mesh.world
    host = socket.gethostname()
    was = world.ledger.enabled
    world.ledger.enabled = False   # the clock's messages are not the model's traffic
    offset = clock_offset(world, host)
    run = world.bcast(uuid.uuid4().hex if world.rank == 0 else None)
    world.ledger.enabled = was
    recorder = Recorder(mesh.rank, label(mesh.rank, mesh.coords), host, offset, run)
    RECORDER = recorder
    try:
        yield recorder
    finally:
        RECORDER = None
    write(folder, recorder, mesh, config)


def write(folder: str, recorder: Recorder, mesh: Mesh, config: dict) -> None:
    """Every rank writes its events; rank 0 merges them into trace.json (a collective)."""
    world = mesh.world
    was = world.ledger.enabled
    world.ledger.enabled = False
    origin = min(world.allgather(recorder.start_ns + recorder.offset_ns))
    events = recorder.events(origin, mesh.coords)
    info = {"run": recorder.run, "rank": recorder.rank, "host": recorder.host,
            "clock_offset_us": recorder.offset_ns / 1000, "coords": mesh.coords,
            "groups": recorder.groups, "ranks": world.size, "config": config}
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{recorder.rank}.json").write_text(json.dumps(
        {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"minipar": info}}))
    everything = world.gather((events, info))
    world.ledger.enabled = was
    if everything is None:
        return
    merged = [event for rank_events, _ in everything for event in rank_events]
    infos = [rank_info for _, rank_info in everything]
    summary = {"run": recorder.run, "ranks": world.size, "config": config,
               "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(),   # what the ranks of rank 0's host shared
               "hosts": [i["host"] for i in infos],
               "clock_offsets_us": [i["clock_offset_us"] for i in infos],
               "coords": [i["coords"] for i in infos], "groups": [i["groups"] for i in infos]}
    temporary = path / f".{FILES}.{os.getpid()}"
    temporary.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms",
                                     "otherData": {"minipar": summary}}))
    temporary.replace(path / FILES)   # whole or absent: a reader never sees half of it
