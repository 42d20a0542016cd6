"""`make course`: the course as a class runs it -- every lesson script, then every notebook.

    python -m tests.course                     # every lesson, then every notebook
    python -m tests.course --only 03 15        # lessons and notebooks 03 and 15 only
    python -m tests.course --lessons           # the scripts alone (`make lessons`)
    python -m tests.course --notebooks         # the notebooks alone (`make notebooks`)

Each lesson script runs as its docstring's run line says (`mpiexec -n 4 python
lessons/02_tensor_parallel.py`), at full size (no `--quick`), with `--plot
build/figures`: it must exit 0 (every `verdict` it printed OK: minipar/comm/job.py), print
its `lesson checks:` line, number its parts 1..N in order, each under its `=== N. title`
header, print no line wider than 120 characters, and draw at least one picture that is
not blank. Each notebook runs headless in a fresh kernel (nbclient) with MINIPAR_QUICK=0
-- every cell as a teacher runs it, lesson scripts included -- and is kept, outputs and
figures in it, in build/notebooks/ (the book is built from there); a cell that raises,
or a drawing cell that drew nothing, fails it. Its exercises run as handed out (each
must print "not written yet") and, right after, solved in the same kernel (each must
print `check passed`; tests/teaching/notebooks.py): the suite does not run the
notebooks, this does.
The Chinese notebooks of lessons 00-05 (lessons/zh/, a Chinese class's first week) run
too, after the English ones, kept in build/notebooks/zh/.
Two notebooks run at a time (as many as the cores, at most four): much of a notebook's
time is one kernel's Python while a core waits.

A failure names the lesson or notebook and the check (the lines that said MISMATCH or
FAILED, or the cell that raised); at the end a table of every lesson and notebook: its
ranks, its seconds, its checks passed. The exit code is 1 if anything failed.

COURSE below is the course's table of contents: a lesson or a notebook added to lessons/
without a line here fails `tests/teaching/test_course.py`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
FIGURES = ROOT / "build" / "figures"
NOTEBOOKS_OUT = ROOT / "build" / "notebooks"
LESSON_TIMEOUT = 600   # seconds a lesson may take before it is called hung (MPIEXEC_TIMEOUT)

# (lesson, ranks of its docstring's run line): scripts in this order, then the notebooks
COURSE: tuple[tuple[str, int], ...] = (
    ("00_collectives", 4),
    ("01_data_parallel", 8),
    ("02_tensor_parallel", 4),
    ("03_expert_parallel", 8),
    ("04_pipeline_parallel", 4),
    ("05_tp_vs_pp", 4),
    ("06_hybrid", 8),
    ("07_zero", 4),
    ("08_bugs", 4),
    ("09_planning", 1),
    ("10_transformer", 2),
    ("11_transformer_tp", 4),
    ("12_context_parallel", 4),
    ("13_recipes", 8),
    ("14_mixed_precision", 4),
    ("15_hangs", 4),
    ("16_serving", 2),
    ("17_muon", 4),
    ("18_diloco", 4),
)
EXTRA_NOTEBOOKS = ("exercises",)   # notebooks that belong to no single lesson
# a Chinese class's first week: these twins (lessons/zh/) run too, kept in build/notebooks/zh/
ZH_NOTEBOOKS = tuple(LESSONS / "zh" / f"{stem}.ipynb" for stem, _ in COURSE[:6])
CHECKS = re.compile(r"^lesson checks: (\d+) passed, (\d+) failed$", re.M)
HEADER = re.compile(r"^=== ")             # a part's header: `=== N. its title`
NUMBERED = re.compile(r"^=== (\d+)\. \S")
FAILED_LINE = re.compile(r"MISMATCH|FAILED|Traceback|Error:|error:")


@dataclass
class Outcome:
    """What one lesson script or notebook did."""

    name: str
    ranks: int | None
    seconds: float
    checks: int | None   # None: a lesson with no checks of its own (it prints no count)
    problems: list[str]


def cores() -> int:
    """The cores this process may run on (what the lines about oversubscription count)."""
    return len(os.sched_getaffinity(0))


def environment() -> dict[str, str]:
    """The ranks' environment: one BLAS thread each, MPI on this host, no quick mode."""
    from minipar.teaching.classroom import rank_environment

    env = rank_environment()
    env["MINIPAR_QUICK"] = "0"
    env["MPIEXEC_TIMEOUT"] = str(LESSON_TIMEOUT)
    return env


def typed(path: Path) -> str:
    """A path as a student types it from the repository's root
    (`lessons/01_data_parallel.py`), or whole when it lies elsewhere (a lesson a test wrote
    in a temporary folder)."""
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def run_lesson(stem: str, ranks: int, logs: Path) -> Outcome:
    """`mpiexec -n ranks python lessons/<stem>.py --plot build/figures`, its output kept in
    build/course/<stem>.log; the problems: a non-zero exit, no `lesson checks:` line, a
    failed check, parts not numbered 1..N or a line too wide (`layout_problems`), no
    picture drawn (or a blank one)."""
    from minipar.teaching.classroom import mpiexec
    from tests.teaching.test_plots import picture_problem

    script = LESSONS / f"{stem}.py"
    if not script.is_file():   # a row of the table that says so, not a traceback
        return Outcome(f"{stem}.py", ranks, 0.0, None, [f"{script} is missing"])
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    # the figures' folder as a student types it (relative, the job runs in the repository's
    # root): the lesson prints its paths, and a clone's own path must not widen its lines
    command = [*launch, sys.executable, typed(script), "--plot", typed(FIGURES)]
    started, wall = time.time(), time.monotonic()
    try:
        job = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True,
                             text=True, timeout=LESSON_TIMEOUT + 30)
        output, code = job.stdout + job.stderr, job.returncode
    except subprocess.TimeoutExpired as stuck:
        output = (stuck.stdout or b"").decode(errors="replace") if isinstance(
            stuck.stdout, bytes) else (stuck.stdout or "")
        code = None
    seconds = time.monotonic() - wall
    (logs / f"{stem}.log").write_text(" ".join(command) + "\n" + output)
    problems = []
    if code is None:
        problems.append(f"did not end within {LESSON_TIMEOUT + 30} s")
    elif code != 0:
        problems.append(f"exit {code}")
    counted = CHECKS.findall(output)
    passed = int(counted[-1][0]) if counted else None   # a lesson that checks nothing
    if counted and int(counted[-1][1]):
        problems.append(f"{counted[-1][1]} check(s) failed")
    if not counted and "run_collectively" in script.read_text():
        problems.append("no 'lesson checks:' line: it ended before run_collectively's end")
    if problems:
        problems += [f"  {line.strip()[:200]}" for line in output.splitlines()
                     if FAILED_LINE.search(line)][:12]
    problems += layout_problems(output)
    drawn = [p for p in FIGURES.glob(f"{stem[:2]}_*.png") if p.stat().st_mtime >= started - 1]
    if not drawn:
        problems.append(f"drew no picture ({FIGURES}/{stem[:2]}_*.png)")
    problems += [f"{p.name}: {said}" for p in drawn if (said := picture_problem(p))]
    return Outcome(f"{stem}.py", ranks, seconds, passed, problems)


def layout_problems(output: str) -> list[str]:
    """What a reader of the output would trip over: parts not numbered 1..N in order, each
    under its `=== N. title` header (a lesson's first part included), or a line wider than
    minipar/teaching/lines.py's WIDTH, 120 characters (a terminal, a notebook cell, the
    book's page; `lines.fit` wraps a lesson's prose to it)."""
    from minipar.teaching.lines import WIDTH as WIDEST

    problems = []
    lines = output.splitlines()
    headers = [(i + 1, line) for i, line in enumerate(lines) if HEADER.match(line)]
    if not headers:
        problems.append("no part header: the output should open its parts with `=== 1. title`")
    for expected, (at, line) in enumerate(headers, start=1):
        numbered = NUMBERED.match(line)
        if not numbered or int(numbered.group(1)) != expected:
            problems.append(f"part header at output line {at} is not `=== {expected}. ...`: "
                            f"{line[:80]!r}")
            break
    wide = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > WIDEST]
    if wide:
        at, width = wide[0]
        problems.append(f"{len(wide)} output line(s) wider than {WIDEST} characters, the first "
                        f"at output line {at} ({width} characters)")
    return problems


def run_notebook(path: Path, ranks: int | None) -> Outcome:
    """Execute one notebook top to bottom as handed out, each exercise also solved in the
    same kernel (tests/teaching/notebooks.py), kept in build/notebooks/; the problems: a
    cell that raised, a drawing cell without a picture, an exercise that did not wait for
    its answer or whose solution did not pass. Its checks: the cells with an `assert`
    that ran, the solutions that passed, and the lesson checks of the scripts it ran."""
    from tests.teaching import notebooks

    wall = time.monotonic()
    try:
        notebook, solved_runs = notebooks.execute(
            path, NOTEBOOKS_OUT / path.parent.relative_to(LESSONS))
        problems = notebooks.problems(path, notebook, solved_runs)
    except Exception as error:  # nbclient's CellExecutionError names the cell
        notebook, solved_runs = None, {}
        problems = [f"{type(error).__name__}: {str(error)[:1500]}"]
    seconds = time.monotonic() - wall
    checks = 0
    if notebook is not None:
        for cell in notebook.cells:
            if cell.cell_type != "code" or not cell.get("outputs"):
                continue
            text = "".join(out.get("text", "") for out in cell.outputs)
            checks += "assert " in cell.source and "not written yet" not in text  # answered
            checks += sum(int(n) for n, _ in CHECKS.findall(text))
        checks += sum("check passed" in said for said in solved_runs.values())
    return Outcome(str(path.relative_to(LESSONS)), ranks, seconds, checks, problems)


def table(outcomes: list[Outcome]) -> str:
    """One row per lesson and notebook: ranks, seconds, checks passed, and its verdict."""
    rows = [f"{'lesson / notebook':<28} {'ranks':>5} {'seconds':>8} {'checks':>7}  result"]
    for o in outcomes:
        ranks = "-" if o.ranks is None else str(o.ranks)
        over = "*" if o.ranks and o.ranks > cores() else " "
        checks = "-" if o.checks is None else str(o.checks)
        rows.append(f"{o.name:<28} {ranks:>4}{over} {o.seconds:8.1f} {checks:>7}  "
                    + ("ok" if not o.problems else "FAILED"))
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NN", help="these lessons' numbers only")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--lessons", action="store_true", help="the lesson scripts only")
    part.add_argument("--notebooks", action="store_true", help="the notebooks only")
    args = parser.parse_args()
    if args.only:   # 9 is lesson 09; a number no lesson has is refused, not run as nothing
        args.only = [n.zfill(2) if n.isdigit() else n for n in args.only]
        unknown = [n for n in args.only if n not in {s[:2] for s, _ in COURSE}]
        if unknown:   # one line, exit 2, before anything runs
            print(f"course: error: --only {unknown[0]}: no such lesson (the lessons: "
                  f"{', '.join(s[:2] for s, _ in COURSE)})", file=sys.stderr)
            return 2
    chosen = [(s, n) for s, n in COURSE if not args.only or s[:2] in args.only]
    logs = ROOT / "build" / "course"
    for folder in (logs, FIGURES, NOTEBOOKS_OUT):
        folder.mkdir(parents=True, exist_ok=True)
    start, outcomes = time.monotonic(), []
    if not args.notebooks:
        for stem, ranks in chosen:
            print(f"course: lesson {stem} on {ranks} rank(s) ...", flush=True)
            outcomes.append(run_lesson(stem, ranks, logs))
            report(outcomes[-1])
    if not args.lessons:
        os.environ["MINIPAR_QUICK"] = "0"
        paths = [(LESSONS / f"{s}.ipynb", n) for s, n in chosen]
        if not args.only:
            paths += [(LESSONS / f"{name}.ipynb", None) for name in EXTRA_NOTEBOOKS]
        paths += [(path, n) for path in ZH_NOTEBOOKS for stem, n in chosen if stem == path.stem]
        print(f"course: {len(paths)} notebooks, {at_once()} at a time ...", flush=True)
        with ThreadPoolExecutor(at_once()) as pool:
            for outcome in pool.map(lambda p: run_notebook(*p), paths):
                outcomes.append(outcome)
                report(outcome)
    seconds = time.monotonic() - start
    bad = [o for o in outcomes if o.problems]
    print("\n" + table(outcomes))
    print(f"(* more ranks than this machine's {cores()} cores: oversubscribed)")
    print(f"course: {seconds:.0f} s in all on {cores()} cores; "
          f"logs in build/course/, figures in {FIGURES.relative_to(ROOT)}/, "
          f"executed notebooks in {NOTEBOOKS_OUT.relative_to(ROOT)}/")
    for o in bad:
        print(f"FAILED {o.name}: " + "\n  ".join(o.problems))
    print(f"course: {len(outcomes) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


def at_once() -> int:
    """Notebooks executed side by side: the cores, at most four."""
    return max(1, min(4, cores()))


def report(o: Outcome) -> None:
    """One line as each lesson or notebook ends; its problems when it failed."""
    verdict = "ok" if not o.problems else "FAILED: " + "; ".join(o.problems[:1])
    checks = "no checks of its own" if o.checks is None else f"{o.checks} checks passed"
    print(f"  {o.name}: {o.seconds:.1f} s, {checks} -> {verdict}", flush=True)
    for line in o.problems[1:]:
        print(f"    {line}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
