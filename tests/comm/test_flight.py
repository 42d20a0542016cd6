"""The flight recorder: every hang ends with a verdict naming the ranks, the call and the line.

Each injected hang (minipar/bugs/hangs.py) runs on 4 ranks with `--timeout 2` (the
pipeline's in lesson 15's run, which tests/teaching/test_lessons.py makes anyway): the
watchdog's one line must end with the verdict, which names the right ranks, op,
axis and file:line, and every rank's dump must be in the --flight folder. A rank
that leaves on its own, and one frozen (SIGSTOP: it cannot write), are named too. A clean run's
records agree with its ledger, call for call; a SIGUSR1 dumps a live job. The
verdict's logic is also tested on small hand-made dumps (no MPI), and bad input is
one line and exit 2.

    python -m pytest tests/comm/test_flight.py
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from minipar.bugs.hangs import HANGS
from minipar.comm import flight
from minipar.comm.flight_files import FlightError, load
from minipar.comm.flight_report import ranks_text, stuck, table, verdict
from tests.harness.mpi import ROOT, launch, lesson_run, read_dump

SMALL = ["--layers", "2", "--d-model", "16", "--d-in", "8", "--batch", "16", "--steps", "1"]
TIMEOUT = 2


def flags_of(fields: dict) -> list[str]:
    return [part for key, value in fields.items()
            for part in (f"--{key.replace('_', '-')}", str(value))]


def the_verdict(job: object, folder: Path) -> str:
    """The one watchdog (or abort) line's verdict, after `; flight (DIR): `."""
    marker = f"; flight ({folder}): "
    lines = [line for line in job.stderr.splitlines() if marker in line]
    assert len(lines) == 1, job.explain()
    return lines[0].split(marker, 1)[1]


EARLIER = '{"format": "minipar-flight 1", "run": "an earlier job"}'
LESSON_HANG = "hang-pp-both-recv"   # lesson 15 --quick runs it: its test reads that run


@pytest.mark.parametrize("name", [name for name in HANGS if name != LESSON_HANG])
def test_a_hang_ends_with_the_verdict_and_every_rank_dumps(name, tmp_path):
    asked = tmp_path / "flight"
    folder = asked
    if name == "hang-wrong-group":   # an earlier job's dumps: the new ones go beside them
        asked.mkdir()
        (asked / "rank0.json").write_text(EARLIER)
        folder = tmp_path / "flight-2"
    start = time.monotonic()
    job = launch(4, ["-m", "minipar", "train", *SMALL, *flags_of(HANGS[name].flags),
                     "--inject-bug", name, "--timeout", str(TIMEOUT), "--flight", str(asked)],
                 timeout=60)
    seconds = time.monotonic() - start
    assert not job.timed_out and job.returncode != 0, job.explain()
    assert seconds < TIMEOUT + 10 + 10, job.explain()   # + 10 s of start-up on a busy machine
    watchdog = [line for line in job.stderr.splitlines() if "watchdog:" in line]
    mpi_failed = HANGS[name].mpi_may_fail and not watchdog
    if mpi_failed:   # the sender's next message landed in the wait, longer: MPI's error,
        # one line like the watchdog's (where from its stamps, then the verdict), exit 1
        (line,) = [x for x in job.stderr.splitlines() if x.startswith("minipar: ")]
        assert re.match(r"minipar: error: MPI error: rank \d in Alltoallv over ep at step 1 "
                        r"of 1: Message truncated .*\(MPI_ERR_\w+\); flight \(", line), line
        assert job.returncode == 1 and "mpi4py" not in job.stderr, job.explain()
    else:
        assert len(watchdog) == 1 and watchdog[0].startswith("minipar: error: watchdog: rank ")
    said = the_verdict(job, folder)
    for words in HANGS[name].names:
        assert words in said, (words, said)
    dumps = load(folder)
    assert sorted(dumps) == [0, 1, 2, 3]                   # every live rank wrote its file
    assert len({d["run"] for d in dumps.values()}) == 1
    assert verdict(dumps) == said                          # `python -m minipar flight DIR`
    for late in (r for r in dumps if stuck(dumps[r])):     # a rank scheduled last on busy
        skewed = copy.deepcopy(dumps)                     # cores entered its call last:
        stuck(skewed[late])["t"] = 1 + max(c["t"] for d in dumps.values() for c in d["calls"])
        said_late = verdict(skewed)
        for words in HANGS[name].names:                   # the same culprit is named
            assert words in said_late, (late, words, said_late)
    assert "done:" not in job.stdout, job.explain()
    assert "Traceback" not in job.stderr, job.explain()   # MINIPAR_TRACEBACK=1 shows it
    # the dumps and the line, nothing else left behind; an earlier job's files untouched
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank0.json", "rank1.json", "rank2.json", "rank3.json", "verdict.txt"]
    line, run = (folder / "verdict.txt").read_text().splitlines()
    assert line.endswith(said) and run == f"run {dumps[0]['run']}", (line, run)
    if folder != asked:
        assert [p.name for p in asked.iterdir()] == ["rank0.json"]
        assert (asked / "rank0.json").read_text() == EARLIER


def item(block: str, start: str) -> str:
    """The line of a lesson's output that starts with `start`, its continuation lines (the
    lesson wraps a line wider than the page, each continuation indented deeper:
    minipar/teaching/lines.py) joined back on."""
    lines = block.splitlines()
    at = next(i for i, x in enumerate(lines) if x.strip().startswith(start))
    indent = len(lines[at]) - len(lines[at].lstrip())
    joined = [lines[at].strip()]
    for x in lines[at + 1:]:
        if not x.strip() or len(x) - len(x.lstrip()) <= indent:
            break
        joined.append(x.strip())
    return " ".join(joined)


def test_the_pipeline_hang_of_lesson_15_ends_with_its_verdict_and_every_dump():
    # the run tests/teaching/test_lessons.py makes
    job, _ = lesson_run(4, "15_hangs.py", "--quick")
    assert job.returncode == 0 and not job.timed_out, job.explain()
    block = job.stdout.split(f"2.1 {LESSON_HANG} ", 1)[1]
    line = item(block, "minipar: error: watchdog: rank ")
    said = item(block, "verdict: ")
    for words in HANGS[LESSON_HANG].names:
        assert words in said, (words, said)
    ended = re.search(r"ended after ([\d.]+) s", block)
    assert ended and float(ended.group(1)) < TIMEOUT + 10 + 10, block[:400]
    assert "every rank's dump in the folder: [OK]" in block and "--timeout 2" in line


@pytest.mark.parametrize("mode,names", [
    ("exit", ("rank 2 left the job on its own (SystemExit(3))", "ranks 0,1,3 are in ")),
    # SIGSTOP: alive but frozen, it writes nothing (a SIGKILLed rank would too, but MPICH's
    # launcher then ends every rank at once, before any of them can write)
    ("stop", ("rank 2 left no record", "ranks 0,1,3 are in ")),
])
def test_a_rank_that_leaves_or_freezes_is_named(tmp_path, mode, names):
    folder = tmp_path / "flight"
    job = launch(4, ["-m", "tests.harness.rank_faults", "fault", f"{mode}:2:1", "train", *SMALL,
                     "--dp", "4", "--timeout", str(TIMEOUT), "--flight", str(folder)],
                 timeout=60)
    assert not job.timed_out and job.returncode != 0, job.explain()
    said = the_verdict(job, folder)
    for words in names:
        assert words in said, (words, said)
    assert "Allreduce over dp" in said or "Allreduce over world" in said, said
    assert sorted(load(folder)) == ([0, 1, 2, 3] if mode == "exit" else [0, 1, 3])


def test_the_grace_does_not_wait_for_a_rank_that_is_stopped_or_gone(monkeypatch):
    """The speaking rank waits for a peer's file only while the peer can still write one:
    a process of this host that is stopped (SIGSTOP) or gone never will."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setattr(flight.STATE, "peers", [(flight.socket.gethostname(), 1),
                                                     (flight.socket.gethostname(), peer.pid),
                                                     ("another-host", peer.pid)])
        monkeypatch.setattr(flight.STATE, "rank", 0)
        assert [flight._cannot_dump(r) for r in range(3)] == [False, False, False]
        peer.send_signal(flight.signal.SIGSTOP)
        for _ in range(100):   # the kernel marks it stopped within moments
            if flight._cannot_dump(1):
                break
            time.sleep(0.01)
        assert flight._cannot_dump(1) and not flight._cannot_dump(2)
        peer.send_signal(flight.signal.SIGCONT)
        for _ in range(100):
            if not flight._cannot_dump(1):
                break
            time.sleep(0.01)
        assert not flight._cannot_dump(1)
    finally:
        peer.kill()
        peer.wait()
    assert flight._cannot_dump(1) and not flight._cannot_dump(2)   # reaped: gone


CLEAN = [{"dp": 2, "tp": 2, "microbatches": 2, "layers": 2, "d_model": 16, "d_in": 8,
          "batch": 16, "steps": 2},
         {"model": "moe", "dp": 2, "pp": 2, "ep": 2, "microbatches": 2, "layers": 2,
          "d_model": 16, "d_in": 8, "batch": 16, "steps": 2, "experts": 4}]


def test_a_clean_runs_records_agree_with_its_ledger_and_a_signal_dumps_a_live_job(tmp_path):
    spec = tmp_path / "configs.json"
    spec.write_text(json.dumps(CLEAN))
    job = launch(4, ["-m", "tests.harness.rank_flight", str(spec), str(tmp_path)], timeout=120)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    signalled = load(tmp_path / "signalled")
    assert list(signalled) == [0] and signalled[0]["reason"] == "SIGUSR1"
    assert signalled[0]["calls"], "the live dump holds the calls made so far"
    for i, fields in enumerate(CLEAN):
        ledger = read_dump(tmp_path / str(i))["ledger"]
        dumps = load(tmp_path / str(i) / "flight")
        assert sorted(dumps) == [0, 1, 2, 3]
        for rank, dump in dumps.items():
            last = [c for c in dump["calls"] if c["step"] == fields["steps"] and c["counted"]]
            assert all(c["state"] != "started" for c in dump["calls"])   # nothing in flight
            calls, elements = Counter(), Counter()
            for c in last:
                calls[(c["op"], c["axis"])] += 1
                elements[(c["op"], c["axis"])] += c["elements"]
            mine = [r for r in ledger if r["rank"] == rank]
            assert {(r["op"], r["group"]): r["calls"] for r in mine} == dict(calls), (i, rank)
            assert {(r["op"], r["group"]): r["elements"] for r in mine} == dict(elements)
        assert "the records agree" in verdict(dumps), verdict(dumps)


# ------------------------------------------------------------ no MPI from here on
def fake_group(key: str) -> SimpleNamespace:
    """What `flight.record` reads of a comm.Group, its key already known (no MPI)."""
    return SimpleNamespace(name=key.split("{")[0], comm=None, _flight_key=key,
                           ledger=SimpleNamespace(enabled=True))


def made_dumps(tmp_path: Path, calls_by_rank: dict[int, list[tuple]], world: int,
               stuck: dict[int, str]) -> Path:
    """Write the dumps of ranks that made `calls_by_rank[r]` (group key, op, elements,
    detail...); `stuck[r]` names the call rank r is still inside (the last one)."""
    folder = tmp_path / "made"
    for rank, calls in calls_by_rank.items():
        flight.reset()
        flight.STATE.rank, flight.STATE.world, flight.STATE.run = rank, world, "run-1"
        for key, op, elements, *detail in calls:
            flight.record(fake_group(key), op, elements, 8, tuple(detail))
        if rank in stuck:
            flight.watchdog._waiting = (time.monotonic() + 1, stuck[rank])
        try:
            flight.write(folder, "watchdog")
        finally:
            flight.watchdog._waiting = None
    flight.reset()
    return folder


def test_a_collective_one_rank_never_entered_is_named(tmp_path):
    calls = {r: [("dp{0,1,2}", "Allreduce", 64)] for r in range(3)}
    calls[0].append(("dp{0,1,2}", "Allreduce", 64))          # rank 0 alone: one call more
    for r in (1, 2):
        calls[r].append(("world{0,1,2}", "Barrier", 0))
    folder = made_dumps(tmp_path, calls, 3, {0: "Allreduce over dp", 1: "Barrier",
                                             2: "Barrier"})
    dumps = load(folder)
    said = verdict(dumps)
    assert "Allreduce over dp (call 2" in said and "never entered it" in said, said
    assert "rank 0" in said and "ranks 1,2" in said, said
    assert "<-- differs" not in table(dumps) and "Allreduce 64 test_flight.py:" in table(dumps)


def test_counts_that_differ_and_a_send_never_received_are_named(tmp_path):
    sizes = {0: 64, 1: 60}
    folder = made_dumps(tmp_path, {r: [("tp{0,1}", "Allreduce", n)] for r, n in sizes.items()},
                        2, {0: "Allreduce", 1: "Allreduce"})
    said = verdict(load(folder))
    assert said.startswith("counts differ in Allreduce over tp (call 1,"), said
    assert "rank 0 has 64 elements, rank 1 has 60 elements" in said, said
    folder = made_dumps(tmp_path / "p2p", {0: [("pp{0,1}", "Send", 8, 1, 0)],
                                           1: [("pp{0,1}", "Allreduce", 1)]},
                        2, {0: "Send", 1: "Allreduce"})
    said = verdict(load(folder))
    assert said.startswith("rank 0 is in Send to pp rank 1 (call 1,"), said
    assert "rank 1 never entered the matching Recv: it is in Allreduce over pp" in said, said


def test_a_posted_send_nobody_receives_is_named_while_its_rank_waits(tmp_path):
    folder = made_dumps(tmp_path, {0: [("pp{0,1}", "Isend", 8, 1, 0)],
                                   1: [("pp{0,1}", "Allreduce", 1)]},
                        2, {0: "Waitall of the sends over pp", 1: "Allreduce over pp"})
    said = verdict(load(folder))
    assert said.startswith("rank 0 is in Waitall of the sends over pp, for its Isend to pp "
                           "rank 1 (call 1,"), said
    assert "rank 1 never entered the matching Recv: it is in Allreduce over pp" in said, said


def test_ranks_are_named_compactly():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0, 1]) == "ranks 0-2"
    assert ranks_text([0, 2, 3, 4, 7]) == "ranks 0,2-4,7"


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    good = made_dumps(tmp_path, {0: [("dp{0,1}", "Allreduce", 4)],
                                 1: [("dp{0,1}", "Allreduce", 4)]}, 2, {})
    text = (good / "rank1.json").read_text()
    cases = {"empty": tmp_path / "empty", "missing": tmp_path / "nowhere"}
    cases["empty"].mkdir()
    for name, edit in {"truncated": lambda t: t[: len(t) // 2],
                       "seq": lambda t: t.replace('"seq": 1', '"seq": "one"'),
                       "rank": lambda t: t.replace('"rank": 1', '"rank": 7'),
                       "members": lambda t: t.replace('"members": [0, 1]', '"members": [0, 9]'),
                       "state": lambda t: t.replace('"completed"', '"lost"')}.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "rank0.json").write_text((good / "rank0.json").read_text())
        edited = edit(text)
        assert edited != text, name
        (folder / "rank1.json").write_text(edited)
        cases[name] = folder
    for folder in cases.values():
        with pytest.raises(FlightError):
            load(folder)
    run = subprocess.run([sys.executable, "-m", "minipar", "flight", str(cases["truncated"])],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.startswith("minipar: error: ") and run.stderr.count("\n") == 1, run.stderr
    assert "rank1.json is not a flight dump" in run.stderr
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    run = subprocess.run([sys.executable, "-m", "minipar", "train", "--flight", str(a_file),
                          "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("minipar: error: --flight ") and "not a folder" in run.stderr


def test_crafted_dumps_are_one_line_naming_the_file_and_field(tmp_path):
    """`python -m minipar flight DIR` validates each dump before it reads one: a crafted
    file is one line and exit 2 naming the file and what is wrong (they were a
    RecursionError, an IndexError, a KeyError)."""
    good = made_dumps(tmp_path, {0: [("pp{0,1}", "Sendrecv", 8, 1, 1, 0)],
                                 1: [("pp{0,1}", "Sendrecv", 8, 0, 0, 0)]}, 2,
                      {0: "Sendrecv with pp", 1: "Sendrecv with pp"})
    assert "Sendrecv with pp ranks 1/1" in verdict(load(good))
    dump = json.loads((good / "rank1.json").read_text())

    def edited(edit):
        data = copy.deepcopy(dump)
        edit(data)
        return json.dumps(data)

    call = ("calls", 0)
    cases = {
        "deep": ("[" * 100_000 + "]" * 100_000, "nested more than"),
        "one peer": (edited(lambda d: d[call[0]][0].update(peer=[0], nth=[1])),
                     "call 0 (Sendrecv) has no valid peer"),
        "waiting without what": (edited(lambda d: d.update(waiting={"seconds": 3})),
                                 "field 'waiting'"),
        "a NaN time": (edited(lambda d: d[call[0]][0].update(t=float("nan"))), "call 0"),
        "seq 0": (edited(lambda d: d[call[0]][0].update(seq=0)), "call 0"),
        "a string step": (edited(lambda d: d[call[0]][0].update(step="1")), "'step'"),
        "world 0": (edited(lambda d: d.update(world=0, rank=0)), "field 'world'"),
        "rank outside its group": (edited(lambda d: d["groups"]["pp{0,1}"].update(
            members=[0, 0])), "group 'pp{0,1}'"),
    }
    for name, (text, said) in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        (folder / "rank0.json").write_text((good / "rank0.json").read_text())
        (folder / "rank1.json").write_text(text)
        with pytest.raises(FlightError) as error:   # what the command prints, in one line
            load(folder)
        line = str(error.value)
        assert line.startswith(f"{folder / 'rank1.json'} is not a flight dump"), line
        assert said in line and "\n" not in line, (name, line)
    run = subprocess.run([sys.executable, "-m", "minipar", "flight", str(tmp_path / "deep")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1, run
    assert run.stderr.startswith("minipar: error: ") and "nested more than" in run.stderr
    other = tmp_path / "members"   # a group whose members differ between two ranks' dumps
    other.mkdir()
    (other / "rank0.json").write_text((good / "rank0.json").read_text())
    (other / "rank1.json").write_text(edited(lambda d: d["groups"].update(
        {"dp{0,1}": {"axis": "dp", "calls": 0, "messages": 0, "members": [1]}})))
    zero = json.loads((good / "rank0.json").read_text())
    zero["groups"]["dp{0,1}"] = {"axis": "dp", "calls": 0, "messages": 0, "members": [0, 1]}
    (other / "rank0.json").write_text(json.dumps(zero))
    with pytest.raises(FlightError, match=re.escape("group 'dp{0,1}' has members [1], "
                                                    "rank0.json says [0, 1]")):
        load(other)


def test_an_abort_leaves_its_dumps_and_line_beside_an_earlier_jobs(tmp_path, monkeypatch):
    """One rank armed without MPI (a world of one): a folder holding an earlier job's
    files is left alone, the dumps go to DIR-2; the first aborting rank's line is in
    DIR-2/verdict.txt, and nothing else is left (no lock files)."""
    world = SimpleNamespace(Get_rank=lambda: 0, Get_size=lambda: 1,
                            allgather=lambda value: [value], bcast=lambda value, root: value)
    monkeypatch.setattr(flight, "_listen", lambda: None)
    asked = tmp_path / "flight"
    asked.mkdir()
    (asked / "rank0.json").write_text(EARLIER)
    flight.arm(str(asked), world)
    try:
        assert flight.STATE.folder == tmp_path / "flight-2"
        flight.record(fake_group("dp{0}"), "Allreduce", 4, 8, ())
        line = flight.before_abort("minipar: error: watchdog: rank 0 waited 3 s in X\n")
        run = flight.STATE.run
    finally:
        flight.disarm()
        flight.reset()
    assert line.startswith("minipar: error: watchdog: rank 0 waited 3 s in X; flight ("
                           f"{tmp_path / 'flight-2'}): "), line
    assert sorted(p.name for p in (tmp_path / "flight-2").iterdir()) == ["rank0.json",
                                                                         "verdict.txt"]
    assert (tmp_path / "flight-2" / "verdict.txt").read_text() == f"{line}run {run}\n"
    assert (asked / "rank0.json").read_text() == EARLIER
    assert flight.fresh_folder(tmp_path / "flight") == tmp_path / "flight-3"


def test_the_default_folder_keeps_the_last_jobs_dumps_and_one_speaker(tmp_path, monkeypatch):
    """minipar-flight/ (no --flight) is minipar's own: a later job's dumps replace an
    earlier one's, whose verdict.txt does not silence the new job and whose files beyond
    the new world and old locks go; a second aborting rank of the same job stays silent."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(flight, "_listen", lambda: None)
    monkeypatch.setattr(flight, "GRACE", 0.0)
    folder = tmp_path / flight.DEFAULT_FOLDER
    folder.mkdir()
    for name in ("rank0.json", "rank5.json", ".speaker-old", "verdict.txt"):
        (folder / name).write_text("an earlier job's\nrun old\n")
    world = SimpleNamespace(Get_rank=lambda: 0, Get_size=lambda: 1,
                            allgather=lambda value: [value], bcast=lambda value, root: value)
    flight.arm(None, world)
    try:
        assert flight.STATE.folder == Path(flight.DEFAULT_FOLDER)
        flight.record(fake_group("dp{0}"), "Allreduce", 4, 8, ())
        line = flight.before_abort("minipar: error: watchdog: rank 0 waited 3 s in X\n")
        sleeps = []
        monkeypatch.setattr(flight.time, "sleep", sleeps.append)
        again = flight.before_abort("minipar: error: watchdog: rank 0 waited 9 s in X\n")
    finally:
        flight.disarm()
        flight.reset()
    assert line.startswith("minipar: error: watchdog: rank 0 waited 3 s in X; flight (")
    assert again == "" and sleeps, again           # spoken already: it waits, silent
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "verdict.txt"]
    assert (folder / "verdict.txt").read_text().splitlines()[0] == line.rstrip("\n")
