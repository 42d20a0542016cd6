"""Reading a timeline: where each rank's time went, measured (`python -m minipar trace DIR`).

What this file teaches: a rank's step is compute, communication and idle time, and
communication is worth something only where compute does not hide it. From the
spans of `train --trace DIR` (trace.py), over the steps' window:

    compute  K = the compute spans (forward, backward, optimizer...) minus the
                 moments the rank sat inside a blocking call or a Wait
    comm     C = every communication span (a nonblocking one from start to Wait)
    hidden     = |C and K| / |C|     (interval union: time counted once)
    idle       = window - K - (C - K)

and for a pipeline the measured bubble, 1 - busy / (ranks x T) over the last step's
forward and backward spans (`simulator.bubble_fraction`, the simulator's own
measure). The longest wait names who it waited for: the member of the collective that
entered last, or the rank whose message it received. `measure(doc)` computes all of
it once; the command and the lessons print its numbers.

    python -m minipar trace DIR                 # the table
    python -m minipar trace DIR --plot g.png    # the measured Gantt chart
    python -m minipar trace DIR --simulated s.json  # the simulator's replay, same format
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from minipar.comm.trace import FILES
from minipar.teaching.trace_files import MAX_BYTES, PIPELINE, TraceError, is_count, load

Intervals = list[tuple[int, int]]
# ------------------------------------------------------ interval arithmetic
def union(intervals: Iterable[tuple[int, int]]) -> Intervals:
    """The intervals merged into disjoint sorted ones (time covered once)."""
    out: Intervals = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def length(intervals: Intervals) -> int:
    return sum(end - start for start, end in intervals)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Where two disjoint sorted interval lists overlap."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """`a` without `b` (both disjoint and sorted)."""
    out: Intervals = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


# ------------------------------------------------------------- measuring
@dataclass
class RankTime:
    """One rank's window, in microseconds."""

    rank: int
    compute: int
    comm: int
    hidden: int
    idle: int


@dataclass
class Measured:
    """What a trace measures (`measure`): per rank, the pipeline's bubble (None without
    one), the share of communication hidden under compute, and the longest wait."""

    ranks: list[RankTime]
    window: int
    bubble: float | None
    hidden: float
    longest_wait: dict = field(default_factory=dict)
    hidden_by_axis: dict[str, float] = field(default_factory=dict)  # the same, per axis


def spans(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def measure(doc: dict) -> Measured:
    """Every number `trace` prints, from the merged trace `doc` (one computation: the
    lessons call this too)."""
    xs = spans(doc)
    ranks = doc["otherData"]["minipar"]["ranks"]
    steps = [e for e in xs if e["cat"] == "step"]
    if not steps:
        raise TraceError("the trace holds no step (the run stopped before its first)")
    begin = min(e["ts"] for e in steps)
    end = max(e["ts"] + e["dur"] for e in steps)
    window = [(begin, end)]
    per_rank = []
    total_comm = total_hidden = 0
    by_axis: dict[str, list[int]] = {}   # axis -> [its comm time, of it hidden]
    for rank in range(ranks):
        mine = [e for e in xs if e["pid"] == rank]
        busy = union(iv(e) for e in mine if e["cat"] == "compute")
        blocked = union(iv(e) for e in mine if e["cat"] == "wait"
                        or (e["cat"] == "comm" and e["args"].get("blocking")))
        compute = intersect(subtract(busy, blocked), window)
        comm = intersect(union(iv(e) for e in mine if e["cat"] == "comm"), window)
        hidden = length(intersect(comm, compute))
        exposed = length(comm) - hidden
        per_rank.append(RankTime(rank, length(compute), length(comm), hidden,
                                 end - begin - length(compute) - exposed))
        total_comm += length(comm)
        total_hidden += hidden
        for axis in {e["args"]["axis"] for e in mine if e["cat"] == "comm"}:
            on_axis = intersect(union(iv(e) for e in mine if e["cat"] == "comm"
                                      and e["args"]["axis"] == axis), window)
            entry = by_axis.setdefault(axis, [0, 0])
            entry[0] += length(on_axis)
            entry[1] += length(intersect(on_axis, compute))
    return Measured(per_rank, end - begin, pipeline_bubble(doc),
                    total_hidden / total_comm if total_comm else 0.0, longest_wait(doc),
                    {axis: hidden / time for axis, (time, hidden) in sorted(by_axis.items())
                     if time})


def iv(event: dict) -> tuple[int, int]:
    return event["ts"], event["ts"] + event["dur"]


def pipeline_bubble(doc: dict) -> float | None:
    """1 - busy / (ranks x T) over the last step's pipeline compute spans, as the
    simulator measures its own timeline; None when the run has no pipeline."""
    from minipar.parallel.pipeline.simulator import bubble_fraction

    cfg = doc["otherData"]["minipar"]["config"]
    if cfg.get("pp", 1) < 2:
        return None
    last = cfg["steps"]
    busy = [(e["pid"], *iv(e)) for e in spans(doc)
            if e["name"] in PIPELINE and e["args"].get("step") == last]
    return bubble_fraction(busy, len({pid for pid, _, _ in busy})) if busy else None


def longest_wait(doc: dict) -> dict:
    """The longest blocking call or Wait of any rank, and who it waited for: for a
    collective the member that entered it last, for a receive the sender, for a Wait
    the latest of its requests' partners. {} if no rank ever waited."""
    xs = spans(doc)
    info = doc["otherData"]["minipar"]
    steps = [e for e in xs if e["cat"] == "step"]
    begin = min((e["ts"] for e in steps), default=0)
    end = max((e["ts"] + e["dur"] for e in steps), default=0)
    waits = [e for e in xs if (e["cat"] == "wait" or (e["cat"] == "comm" and e["args"].get(
        "blocking"))) and begin <= e["ts"] <= end]   # inside the steps
    if not waits:
        return {}
    worst = max(waits, key=lambda e: e["dur"])
    collectives: dict[tuple, list[tuple[int, int]]] = {}
    by_request: dict[tuple, dict] = {}
    for e in xs:
        if e["cat"] == "comm":
            by_request[(e["pid"], e["args"]["axis"], e["args"]["seq"])] = e
            if "dest" not in e["args"] and "source" not in e["args"]:
                members = tuple(info["groups"][e["pid"]].get(e["args"]["axis"], ()))
                collectives.setdefault((members, e["args"]["axis"], e["args"]["seq"]),
                                       []).append((e["ts"], e["pid"]))
    sent = {f["id"]: f for f in doc["traceEvents"] if f.get("ph") == "s"}
    received = {f["id"]: f for f in doc["traceEvents"] if f.get("ph") == "f"}

    def partners(e: dict) -> list[tuple[int, int]]:
        """(the time the other side got there, its rank) for one comm span."""
        args = e["args"]
        if "dest" in args or "source" in args:   # a message: the other end of its flow
            found = []
            for ident, end in list(sent.items()) + list(received.items()):
                if end["pid"] == e["pid"] and e["ts"] <= end["ts"] <= e["ts"] + e["dur"]:
                    other = (received if end["ph"] == "s" else sent).get(ident)
                    if other is not None and (end["ph"] == "f" or args["op"] != "Recv"):
                        found.append((other["ts"], other["pid"]))
            return found
        members = tuple(info["groups"][e["pid"]].get(args["axis"], ()))
        return [(ts, pid) for ts, pid in collectives.get((members, args["axis"], args["seq"]),
                                                         []) if pid != e["pid"]]

    if worst["cat"] == "wait":
        closed = [by_request.get((worst["pid"], axis, seq))
                  for axis, seq in worst["args"].get("requests", [])]
        found = [p for e in closed if e is not None for p in partners(e)]
        what = worst["args"].get("what", "Wait")
    else:
        found = partners(worst)
        what = f"{worst['name']} over {worst['args']['axis']}"
    latest = max(found, default=None)
    return {"rank": worst["pid"], "what": what, "step": worst["args"].get("step"),
            "us": worst["dur"], "start": worst["ts"],
            "waited_for": None if latest is None else latest[1],
            "arrived_after_us": None if latest is None else latest[0] - worst["ts"]}


# ---------------------------------------------------------------- printing
def report(doc: dict, measured: Measured | None = None) -> str:
    """The table `python -m minipar trace DIR` prints."""
    m = measure(doc) if measured is None else measured
    info = doc["otherData"]["minipar"]
    cfg = info["config"]
    lines = [f"trace of {info['ranks']} ranks (dp={cfg['dp']} cp={cfg.get('cp', 1)} "
             f"tp={cfg['tp']} pp={cfg['pp']}" + (f" {cfg['schedule']}" if cfg["pp"] > 1
                                                 else "")
             + f", {cfg['steps']} steps: {m.window / 1e6:.4f} s), hosts "
             + ", ".join(sorted(set(info["hosts"]))) + ", clock offsets (us) "
             + " ".join(f"{o:+.0f}" for o in info["clock_offsets_us"])
             + (f"; {info['ranks']} ranks on {info['cores']} cores of rank 0's host: "
                "oversubscribed, the ranks take turns on the cores (waits include that)"
                if info.get("cores") and len(set(info["hosts"])) == 1
                and info["ranks"] > info["cores"] else ""),
             f"{'rank':>4}  {'compute s':>9}  {'comm s':>9}  {'hidden':>6}  {'idle s':>9}"]
    for r in m.ranks:
        lines.append(f"{r.rank:>4}  {r.compute / 1e6:9.4f}  {r.comm / 1e6:9.4f}  "
                     f"{r.hidden / r.comm if r.comm else 0.0:6.1%}  {r.idle / 1e6:9.4f}")
    lines.append("pipeline bubble (last step, measured): " + (
        "no pipeline" if m.bubble is None else f"{m.bubble:.1%}"))
    lines.append(f"communication hidden under compute: {m.hidden:.1%} ("
                 + ", ".join(f"{axis} {share:.1%}" for axis, share in m.hidden_by_axis.items())
                 + ")")
    w = m.longest_wait
    if w:
        who = "" if w["waited_for"] is None else (
            f", waiting for rank {w['waited_for']} (there "
            f"{w['arrived_after_us'] / 1000:+.3f} ms after it began)")
        lines.append(f"longest wait: rank {w['rank']}, {w['us'] / 1000:.3f} ms in {w['what']} "
                     f"at step {w['step']}{who}")
    return "\n".join(lines)


def by_axis_text(m: Measured) -> str:
    """` (dp 8.3%, world 0.0%)`: the hidden share of each axis, when there are several
    (the total alone would differ from what a lesson prints for one axis)."""
    shares = m.hidden_by_axis
    return (" (" + ", ".join(f"{a} {v:.1%}" for a, v in shares.items()) + ")"
            if len(shares) > 1 else "")


COLORS = {"forward": "tab:blue", "backward": "tab:orange", "backward (B)": "tab:orange",
          "backward (W)": "tab:green", "F&B": "tab:purple", "optimizer step": "tab:gray",
          "checkpoint save": "tab:brown"}


def figure(doc: dict, title: str = "") -> object:
    """The measured Gantt chart: a row per rank, its compute spans (colors as the
    simulator's chart), waits in red, and under them a thin strip per communication
    axis; the bubble and the hidden share in the title."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    m = measure(doc)
    xs = spans(doc)
    info = doc["otherData"]["minipar"]
    ranks = info["ranks"]
    steps = [e for e in xs if e["cat"] == "step"]
    origin = min(e["ts"] for e in steps)
    axes_names = sorted({e["args"]["axis"] for e in xs if e["cat"] == "comm"})
    fig = Figure(figsize=(11, 1.2 + 0.55 * ranks), layout="constrained")
    ax = fig.subplots()
    palette = ["tab:cyan", "tab:olive", "tab:pink", "tab:red", "tab:brown", "0.4", "gold"]
    axis_color = {a: palette[i % len(palette)] for i, a in enumerate(axes_names)}
    for e in xs:
        if e["ts"] + e["dur"] < origin:
            continue
        start, width = (e["ts"] - origin) / 1000, max(e["dur"], 1) / 1000
        y = e["pid"]
        if e["cat"] == "compute" and e["name"] in COLORS:
            ax.barh(y - 0.12, width, left=start, height=0.5, color=COLORS[e["name"]],
                    edgecolor="white", linewidth=0.4,
                    hatch="///" if e["args"].get("chunk") else None)
            mb = e["args"].get("microbatch")
            if mb is not None and width > 0.02 * m.window / 1000:
                ax.text(start + width / 2, y - 0.12, str(mb + 1), ha="center",
                        va="center", fontsize=6, color="white")
        elif e["cat"] == "wait":
            ax.barh(y - 0.12, width, left=start, height=0.5, color="tab:red", alpha=0.35)
        elif e["cat"] == "comm":
            row = axes_names.index(e["args"]["axis"])
            ax.barh(y + 0.2 + 0.08 * row, width, left=start, height=0.07,
                    color=axis_color[e["args"]["axis"]])
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "process_name"}
    ax.set_yticks(range(ranks), [names.get(r, f"rank {r}") for r in range(ranks)],
                  fontsize=7)
    ax.set_ylim(ranks - 0.4 + 0.08 * len(axes_names), -0.6)
    ax.set_xlim(0, m.window / 1000)
    ax.set_xlabel("ms from the first step's start (wall clock, one shared clock)")
    cfg = info["config"]
    ax.set_title((title + "\n" if title else "") + (
        f"measured: bubble {m.bubble:.1%}, " if m.bubble is not None else "measured: ")
        + f"communication hidden under compute {m.hidden:.1%}{by_axis_text(m)};\n{ranks} ranks on "
        f"{info.get('cores', '?')} cores" + (" (oversubscribed)" if info.get("cores")
                                             and ranks > info["cores"] else "")
        + f"; dp={cfg['dp']} tp={cfg['tp']} pp={cfg['pp']} cp={cfg.get('cp', 1)}",
        fontsize=9)
    used = {e["name"] for e in xs if e["cat"] == "compute"}
    handles = [Patch(color=c, label=n) for n, c in COLORS.items() if n in used]
    handles += [Patch(color="tab:red", alpha=0.35, label="wait")]
    handles += [Patch(color=axis_color[a], label=f"comm {a}") for a in axes_names]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8),
               fontsize=7, frameon=False)
    return fig


# ------------------------------------------------------------ simulated
def simulated(doc: dict) -> dict:
    """The simulator's timeline of the same run in the same format: the schedule played
    with the last step's measured compute times (`schedules.replay`, the
    slowest replica of each stage), communication free; one process per stage."""
    from minipar.parallel.pipeline.schedules import replay

    info = doc["otherData"]["minipar"]
    cfg = info["config"]
    if cfg.get("pp", 1) < 2:
        raise TraceError("--simulated needs a pipeline run (--pp 2 or more): the "
                         "simulator plays pipeline schedules")
    last = cfg["steps"]
    played = [e for e in spans(doc) if e["name"] in PIPELINE and e["args"].get("step") == last]
    for e in played:   # what the replay needs of each span (`check` saw their kinds)
        if not (isinstance(e["args"].get("kind"), str) and is_count(e["args"].get("chunk"))
                and is_count(e["args"].get("microbatch"))
                and is_count(info["coords"][e["pid"]].get("pp"))):
            raise TraceError(f"a {e['name']} span of rank {e['pid']} lacks the kind, chunk, "
                             "microbatch or pp coordinate the simulator replays")
    if not is_count(cfg.get("microbatches"), 1):
        raise TraceError("the trace's config has no --microbatches for the simulator")
    records = [{"stage": info["coords"][e["pid"]]["pp"], "kind": e["args"]["kind"],
                "chunk": e["args"]["chunk"], "microbatch": e["args"]["microbatch"],
                "start": e["ts"] / 1e6, "end": (e["ts"] + e["dur"]) / 1e6} for e in played]
    try:
        sim = replay(cfg["schedule"], cfg["pp"], cfg["microbatches"], cfg.get("virtual", 1),
                     records)
    except (KeyError, ValueError, IndexError) as error:   # spans no schedule could make
        raise TraceError(f"the trace's pipeline spans do not replay as {cfg['schedule']}: "
                         f"{error}") from None
    names = {"F": "forward", "B": "backward", "W": "backward (W)", "F&B": "F&B"}
    split = any(slot.kind == "W" for slot in sim.timeline)
    events = []
    for s in range(cfg["pp"]):
        events += [{"name": "process_name", "ph": "M", "pid": s, "tid": 0,
                    "args": {"name": f"stage {s} (simulated)"}},
                   {"name": "thread_name", "ph": "M", "pid": s, "tid": 0,
                    "args": {"name": "compute"}}]
    for slot in sim.timeline:
        start = int(round(slot.start * 1e6))
        name = "backward (B)" if slot.kind == "B" and split else names[slot.kind]
        events.append({"name": name, "cat": "compute", "ph": "X", "ts": start,
                       "dur": max(0, int(round(slot.end * 1e6)) - start), "pid": slot.stage,
                       "tid": 0, "args": {"microbatch": slot.microbatch, "chunk": slot.chunk,
                                          "kind": slot.kind, "step": last}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"minipar": {"simulated": True, "run": info["run"],
                                      "ranks": cfg["pp"], "config": cfg,
                                      "bubble": sim.bubble}}}


# ---------------------------------------------------------------- command
# what matplotlib's savefig writes, by the name's suffix (no suffix: PNG)
FIGURE_FORMATS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg",
                  "svgz", "tif", "tiff", "webp")


def output_problems(flag: str, path: Path, folder: Path) -> list[str]:
    """Why `trace DIR --plot/--simulated PATH` must not write PATH: a figure format
    matplotlib does not know (found before the report, not after it), or a file this
    command did not make -- the run's own trace (DIR/trace.json, DIR/rank{r}.json), or
    for --simulated any file that is not a simulated trace already."""
    suffix = path.suffix.lower().lstrip(".")
    if flag == "plot" and suffix and suffix not in FIGURE_FORMATS:
        return [f"{path}: .{suffix} is no figure format ({', '.join(FIGURE_FORMATS)})"]
    if not path.exists():
        return []
    if folder.is_dir() and path.resolve().parent == folder.resolve() and (
            path.name == FILES or (path.name.startswith("rank") and path.suffix == ".json")):
        return [f"{path}: is the run's own trace in {folder}: give another file name"]
    if flag == "simulated":
        try:
            head = json.loads(path.read_text()) if path.stat().st_size < MAX_BYTES else None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            head = None
        other = head.get("otherData") if isinstance(head, dict) else None
        info = other.get("minipar") if isinstance(other, dict) else None
        if not (isinstance(info, dict) and info.get("simulated") is True):
            return [f"{path}: exists and is not a simulated trace: give a new file name"]
    return []


def main(argv: Sequence[str]) -> int:
    """`python -m minipar trace DIR [--plot FILE] [--simulated FILE]` (no MPI)."""
    from minipar.settings.config import ConfigError
    from minipar.settings.flags import Parser
    from minipar.settings.preflight import folder_problems

    parser = Parser(prog="python -m minipar trace",
                     description="Where each rank's time went in a --trace run.")
    parser.add_argument("folder", metavar="DIR", help="the --trace DIR of a run")
    parser.add_argument("--plot", metavar="FILE", help="draw the measured Gantt chart (PNG)")
    parser.add_argument("--simulated", metavar="FILE",
                        help="write the simulator's timeline of the same run (JSON)")
    try:
        args = parser.parse_args(list(argv))
        for flag in ("plot", "simulated"):
            path = getattr(args, flag)
            problems = [] if path is None else folder_problems(Path(path).parent)
            if path is not None and Path(path).is_dir():
                problems = [f"{path}: is a folder (give a file name)"]
            if not problems and path is not None:
                problems = output_problems(flag, Path(path), Path(args.folder))
            if problems:
                raise TraceError(f"--{flag} {problems[0]}")
        doc = load(args.folder)
        measured = measure(doc)
        sim = simulated(doc) if args.simulated else None
    except (ConfigError, TraceError) as error:
        print(f"minipar: error: {error}", flush=True, file=__import__("sys").stderr)
        return 2
    print(report(doc, measured), flush=True)
    if args.plot:
        figure(doc).savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}", flush=True)
    if sim is not None:
        Path(args.simulated).write_text(json.dumps(sim))
        print(f"wrote {args.simulated} (the simulator's replay: bubble "
              f"{sim['otherData']['minipar']['bubble']:.1%})", flush=True)
    return 0
