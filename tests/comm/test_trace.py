"""`train --trace DIR` and `python -m minipar trace DIR`: timelines, measured.

Every strategy's traces are checked where the strategies already run: the sweeps of
tests/parallel/test_every_mesh.py (every 4-D mesh and schedule on 4 ranks), test_data_parallel.py
(every grad sync) and test_zero.py (ZeRO with experts) trace their runs and call
tests/harness/trace_checks.py. Here: those checks fail on broken traces; the report's interval
arithmetic against counting microseconds one by one; one pipeline run with an
overlapped gradient sync read by the `trace` command (its numbers are `measure`'s, its
plot a PNG, its simulated timeline the simulator's replay); and every refusal is one
line and exit 2 (before the first step, for `train`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minipar.settings import preflight
from minipar.teaching import trace_files, trace_report
from tests.harness.mpi import ROOT, lesson_run, minipar, read_dump
from tests.harness.trace_checks import check_events, check_trace

SMALL = ["--layers", "4", "--d-model", "16", "--d-in", "8", "--batch", "16", "--steps", "2"]
RUN = ["--dp", "2", "--pp", "2", "--microbatches", "4", "--grad-sync", "overlapped",
       "--bucket-size", "300"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One 4-rank run, dp 2 x pp 2 under 1F1B, overlapped gradient sync, traced."""
    folder = tmp_path_factory.mktemp("traced")
    job = minipar(4, ["train", *RUN, *SMALL, "--trace", str(folder / "trace"), "--dump",
                      str(folder / "dump")], timeout=120)
    assert job.returncode == 0, job.explain()
    return folder


def command(capsys, *args: str) -> tuple[int, str, str]:
    """`python -m minipar trace ...` in this process (it needs no MPI): exit code, stdout,
    stderr."""
    code = trace_report.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_run_is_valid_and_is_its_ledger(traced):
    check_trace(traced / "trace", read_dump(traced / "dump"), "dp 2 pp 2 overlapped")


def test_the_checks_fail_on_broken_traces(traced):
    doc = json.loads((traced / "trace" / "trace.json").read_text())
    check_events(doc, "as written")
    xs = [i for i, e in enumerate(doc["traceEvents"]) if e["ph"] == "X"]
    flows = [i for i, e in enumerate(doc["traceEvents"]) if e["ph"] == "s"]
    assert xs and flows
    breaks = {
        "a float ts": lambda d: d["traceEvents"][xs[0]].update(ts=0.5),
        "a negative dur": lambda d: d["traceEvents"][xs[0]].update(dur=-1),
        "no args": lambda d: d["traceEvents"][xs[0]].pop("args"),
        "an unknown phase": lambda d: d["traceEvents"][xs[0]].update(ph="B"),
        "a flow without its end": lambda d: d["traceEvents"].pop(flows[0]),
        "no process name": lambda d: d.update(traceEvents=[
            e for e in d["traceEvents"] if e.get("name") != "process_name"]),
    }

    def overlapping(d: dict) -> None:   # a span crossing the end of the one before it
        spans = [e for e in d["traceEvents"] if e["ph"] == "X" and e["dur"] > 2]
        first = spans[0]
        d["traceEvents"].append(dict(first, ts=first["ts"] + 1, dur=first["dur"] + 5))
    breaks["overlapping spans on a thread"] = overlapping
    for name, breaking in breaks.items():
        broken = copy.deepcopy(doc)
        breaking(broken)
        with pytest.raises((AssertionError, KeyError)):
            check_events(broken, name)


def test_interval_arithmetic_is_counting_microseconds():
    rng = np.random.default_rng(0)
    for _ in range(50):
        def draw() -> list[tuple[int, int]]:
            starts = rng.integers(0, 60, size=rng.integers(0, 6))
            return [(int(s), int(s + rng.integers(0, 15))) for s in starts]

        def covered(intervals: list[tuple[int, int]]) -> set[int]:
            return {t for a, b in intervals for t in range(a, b)}
        a, b = trace_report.union(draw()), trace_report.union(draw())
        assert covered(trace_report.intersect(a, b)) == covered(a) & covered(b)
        assert covered(trace_report.subtract(a, b)) == covered(a) - covered(b)
        assert trace_report.length(a) == len(covered(a))


def test_the_command_prints_measure_draws_and_simulates(traced, capsys):
    folder = traced / "trace"
    code, out, err = command(capsys, str(folder), "--plot", str(traced / "gantt.png"),
                             "--simulated", str(traced / "simulated.json"))
    assert code == 0, err
    measured = trace_report.measure(trace_files.load(folder))
    assert f"pipeline bubble (last step, measured): {measured.bubble:.1%}" in out
    assert f"communication hidden under compute: {measured.hidden:.1%}" in out
    assert 0 < measured.bubble < 1 and 0 <= measured.hidden <= 1
    assert "longest wait: rank" in out and "waiting for rank" in out
    for r in measured.ranks:   # compute + exposed comm + idle is the window
        assert r.compute + (r.comm - r.hidden) + r.idle == measured.window
    assert (traced / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sim = json.loads((traced / "simulated.json").read_text())
    spans = [e for e in sim["traceEvents"] if e["ph"] == "X"]
    assert all(isinstance(e["ts"], int) and e["dur"] >= 0 for e in spans)
    assert len(spans) == 2 * 2 * 4   # pp stages x (F, B) x M microbatches
    assert {e["pid"] for e in spans} == {0, 1}


def test_trace_command_refuses_what_it_cannot_read(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "trace.json").write_text('{"traceEvents": [{"ph": "X", "na')
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": []}))
    for folder, said in ((empty, "no trace.json"), (cut, "truncated or not JSON"),
                         (other, "not a folder")):
        code, _, err = command(capsys, str(folder))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (folder, err)
        assert lines[0].startswith("minipar: error: ") and said in lines[0], lines


def test_train_refuses_a_trace_folder_it_cannot_use(tmp_path, traced):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = {"exists and is not a folder": a_file,
             "holds the trace of another run": traced / "trace"}
    for said, folder in cases.items():
        job = minipar(2, ["train", "--dp", "2", *SMALL, "--trace", str(folder)], timeout=60)
        lines = job.stderr.strip().splitlines()
        assert job.returncode == 2 and len(lines) == 1, job.explain()
        assert lines[0].startswith("minipar: error: --trace") and said in lines[0], lines
        assert "step" not in job.stdout, job.stdout   # before the first step
    assert preflight.trace_problems(str(tmp_path / "new" / "folder")) == []


def test_a_read_only_trace_folder_is_refused(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:   # root passes os.access on a read-only mount: the probe is what catches it
        job = minipar(2, ["train", "--dp", "2", *SMALL, "--trace", str(mount / "t")], 60)
        lines = job.stderr.strip().splitlines()
        assert job.returncode == 2 and len(lines) == 1, job.explain()
        assert "--trace" in lines[0] and "not writable" in lines[0], lines
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_lesson_4_prints_the_numbers_of_its_trace():
    """Lesson 4 traces its 1F1B run of M = 8 (--plot DIR: DIR/trace_1f1b) and prints the
    bubble and the hidden share of that trace: trace_report.measure's, as `trace` prints."""
    job, folder = lesson_run(4, "04_pipeline_parallel.py", "--quick")  # test_lessons' run
    assert job.returncode == 0, job.explain()
    measured = trace_report.measure(trace_files.load(folder / "trace_1f1b"))
    lines = job.stdout.splitlines()
    line = next(after for x, after in zip(lines, lines[1:]) if "its trace:" in x)
    assert f"M = 8 bubble {measured.bubble:.1%}, communication hidden under compute " \
           f"{measured.hidden:.1%}" in line, line
    assert "cores" in line and (folder / "04_trace_1f1b.png").exists()
    check_events(json.loads((folder / "trace_1f1b" / "trace.json").read_text()), "lesson 4")


def test_lesson_12_prints_how_much_of_the_ring_its_trace_hides():
    """Lesson 12 traces its ring and zigzag runs (--plot DIR: DIR/trace_<mode>) and prints
    the share of their cp traffic under compute: trace_report.measure's, per axis."""
    job, folder = lesson_run(4, "12_context_parallel.py", "--quick")  # test_lessons' run
    assert job.returncode == 0, job.explain()
    for mode in ("ring", "zigzag"):
        measured = trace_report.measure(trace_files.load(folder / f"trace_{mode}"))
        assert 0 <= measured.hidden_by_axis["cp"] <= 1
        assert f"{mode}: its cp traffic hidden under compute " \
               f"{measured.hidden_by_axis['cp']:.1%}" in job.stdout, job.stdout[-2000:]
        doc = json.loads((folder / f"trace_{mode}" / "trace.json").read_text())
        check_events(doc, f"lesson 12 {mode}")
        ops = {e["args"]["op"] for e in doc["traceEvents"]
               if e["ph"] == "X" and e["cat"] == "comm" and e["args"]["axis"] == "cp"}
        assert {"Isend", "Irecv", "Sendrecv"} <= ops, ops   # K, V posted ahead; dK, dV


def test_lesson_1_prints_how_much_of_the_overlapped_sync_its_trace_hides():
    """Lesson 1 (--plot DIR) traces an overlapped-sync training run into
    DIR/trace_overlapped and prints the share of its dp traffic under compute."""
    # the run tests/teaching/test_lessons.py checks
    job, folder = lesson_run(8, "01_data_parallel.py")
    assert job.returncode == 0, job.explain()
    measured = trace_report.measure(trace_files.load(folder / "trace_overlapped"))
    assert f"{measured.hidden_by_axis['dp']:.1%} of the dp Iallreduces' time ran under " \
           "compute" in job.stdout, job.stdout[-2000:]
    doc = json.loads((folder / "trace_overlapped" / "trace.json").read_text())
    check_events(doc, "lesson 1")
    assert any(e["ph"] == "X" and e["name"] == "Iallreduce" for e in doc["traceEvents"])


def test_crafted_traces_are_one_line_naming_the_file_and_field(traced, tmp_path, capsys):
    """Each reader of a trace.json validates before it uses: a crafted file is refused
    in one line naming the file and the field (they were a KeyError, a TypeError, an
    AttributeError, an IndexError, a RecursionError, or "trace of -3 ranks" and
    "nan s" with exit 0)."""
    text = (traced / "trace" / "trace.json").read_text()
    doc = json.loads(text)
    x = next(i for i, e in enumerate(doc["traceEvents"]) if e["ph"] == "X")
    info = ("otherData", "minipar")

    def event(**fields):
        def edit(d):
            d["traceEvents"][x].update(fields)
        return edit

    def run_record(**fields):
        def edit(d):
            d[info[0]][info[1]].update(fields)
        return edit

    cases = {
        "no ts": (lambda d: d["traceEvents"][x].pop("ts"), f"traceEvents[{x}].ts"),
        "a string ts": (event(ts="5"), f"traceEvents[{x}].ts"),
        "a NaN ts": (event(ts=float("nan")), f"traceEvents[{x}].ts"),
        "a 1e308 ts": (event(ts=1e308), f"traceEvents[{x}].ts"),
        "a negative dur": (event(dur=-4), f"traceEvents[{x}].dur"),
        "a pid outside the ranks": (event(pid=9), f"traceEvents[{x}].pid"),
        "args a list": (event(args=[]), f"traceEvents[{x}].args"),
        "config null": (run_record(config=None), "otherData.minipar.config"),
        "0 ranks": (run_record(ranks=0), "otherData.minipar.ranks"),
        "-3 ranks": (run_record(ranks=-3), "otherData.minipar.ranks"),
        "a string pp": (lambda d: d[info[0]][info[1]]["config"].update(pp="2"),
                        "otherData.minipar.config.pp"),
        "one host short": (lambda d: d[info[0]][info[1]]["hosts"].pop(),
                           "otherData.minipar.hosts"),
        "events an object": (lambda d: d.update(traceEvents={}), "not a minipar trace"),
    }
    for name, (edit, field) in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        broken = copy.deepcopy(doc)
        edit(broken)
        (folder / "trace.json").write_text(json.dumps(broken))
        code, out, err = command(capsys, str(folder))
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1, (name, out, err)
        assert lines[0].startswith(f"minipar: error: {folder / 'trace.json'}"), (name, lines)
        assert field in lines[0], (name, lines)
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "trace.json").write_text("[" * 100_000 + "]" * 100_000)
    code, out, err = command(capsys, str(deep))
    assert code == 2 and "nested more than" in err and err.count("\n") == 1, err
    # the outputs: a figure format matplotlib lacks, before the report; never the trace
    code, out, err = command(capsys, str(traced / "trace"), "--plot", str(tmp_path / "g.xyz"))
    assert code == 2 and out == "" and ".xyz is no figure format" in err, (out, err)
    for target in (traced / "trace" / "trace.json", traced / "trace" / "rank0.json"):
        code, out, err = command(capsys, str(traced / "trace"), "--simulated", str(target))
        assert code == 2 and out == "" and "the run's own trace" in err, err
    mine = tmp_path / "notes.json"
    mine.write_text("{}")
    code, out, err = command(capsys, str(traced / "trace"), "--simulated", str(mine))
    assert code == 2 and "not a simulated trace" in err and mine.read_text() == "{}", err
    assert (traced / "trace" / "trace.json").read_text() == text      # untouched


def test_flight_dumps_and_a_trace_never_share_a_folder(traced, tmp_path):
    """--flight into a finished --trace folder (a hang's dumps would overwrite its
    rank{r}.json), --trace D --flight D, and --trace into a folder of dumps: refused."""
    trace = str(traced / "trace")
    (said,) = preflight.flight_problems(trace, None)
    assert said.startswith(f"--flight {trace}: holds the trace of a run (rank0.json)"), said
    new = str(tmp_path / "both")
    (said,) = preflight.flight_problems(new, new)
    assert "is also the --trace folder" in said, said
    assert preflight.flight_problems(new, None) == preflight.flight_problems(None, new) == []
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "rank0.json").write_text('{"format": "minipar-flight 1", "run": "r"}')
    (said,) = preflight.trace_problems(str(dumps))
    assert "holds the flight recorder's dumps of a job (rank0.json)" in said, said
    assert preflight.flight_problems(str(dumps), None) == []   # (the new dumps go beside)
    job = subprocess.run([sys.executable, "-m", "minipar", "train", *SMALL, "--flight", trace],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert job.returncode == 2 and job.stderr.count("\n") == 1, job.stderr
    assert job.stderr.startswith("minipar: error: --flight ") and "step" not in job.stdout
