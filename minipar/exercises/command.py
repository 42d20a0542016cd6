"""`python -m minipar exercise ...`: hand out an exercise, show its hint, grade it.

    python -m minipar exercise list
    python -m minipar exercise start NAME DIR       a copy of minipar with NAME stubbed
    python -m minipar exercise hint NAME [--step K] the hint's steps 1..K (K = 1 alone)
    python -m minipar exercise solution NAME        the project's own code of its regions
    python -m minipar exercise check NAME [NAME ...] [DIR]   (DIR defaults to .)

`check` starts one MPI job (`mpiexec -n 4`, the launcher beside this Python or
$MINIPAR_MPIEXEC) in DIR, so that DIR/minipar, the student's copy, is what the
ranks import; it prints the job's report, with a line under an exercise for each
of its regions that is left as the stub or copied from the reference answer
(`regions.compare`). A verdict is taken only from the grader's lines, sealed with a
word of this run the student's code never sees (exercises/sealed.py); it exits 0 if
every exercise passed, 1 if one failed, 3 if
all passed but a region is the reference answer itself (the numbers pass on the
library's own code, not on the student's), 2 on bad arguments (a name the folder
was not started for among them: `start` records its names in DIR/exercise.json).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from minipar import exercises
from minipar.exercises import regions

COPIED = 3   # check's exit code: every check passed, but some region is the reference answer
VERDICT = "minipar: exercise verdict: "  # grade.VERDICT (grade.py loads MPI: not imported)
TIMEOUT = 60  # seconds per check for the launcher; grade.py names where it is stuck at 40
SHOWN_LINES = 20   # of the student's own output, at most this many lines are shown
# The job's ranks start in this package's exercises/sealed.py (run by its path: the
# grader's code, not the student's copy), which imports the student's folder alone and
# reads the run's seal from the standard input before any of the student's code runs.
SEALED = Path(__file__).resolve().parent / "sealed.py"
# The grader's own files: the student's copy must hold them as handed out (a verdict comes
# from them); the files with the exercises' regions are the student's to write.
GRADER_FILES = ("exercises/__init__.py", "exercises/grade.py", "exercises/units.py",
                "exercises/units_attention.py")


def grader_changed(folder: Path) -> list[str]:
    """The grader's files (`GRADER_FILES`) in folder/minipar that differ from this
    package's, byte for byte."""
    ours = Path(__file__).resolve().parent.parent
    return [f"minipar/{path}" for path in GRADER_FILES
            if (ours / path).is_file() and (folder / "minipar" / path).is_file()
            and (folder / "minipar" / path).read_bytes() != (ours / path).read_bytes()]


def unsealed(stdout: str, word: str) -> tuple[str, dict[str, bool]]:
    """The job's output with the seal taken off the grader's verdict lines, and each
    exercise's verdict from those lines alone ({name: passed}); a line the student's
    code printed in their form is shown as the code's, and decides nothing."""
    mark, lines, verdicts = f" [{word}]", [], {}
    for line in stdout.splitlines():
        graded = re.match(r"exercise (\S+): (passed|FAILED)", line)
        if graded and line.endswith(mark):
            lines.append(line[:-len(mark)])
            verdicts.setdefault(graded.group(1), graded.group(2) == "passed")
        elif line.startswith("exercise "):
            lines.append(f"(printed by the code, not the grader) {line}")
        else:
            lines.append(line)
    return "\n".join(lines), verdicts


def missing_files(folder: Path, names: list[str]) -> list[str]:
    """The files of `names`' regions and the grader that folder/minipar lacks. Any other
    module the job needs and does not find fails it as an import error naming the file
    (`explain_crash`): with the installed package's hook gone (`ALONE`) nothing fills in."""
    needed = {"exercises/grade.py", *(r.path for name in names
                                      for r in regions.regions_of(name))}
    return sorted(f"minipar/{path}" for path in needed
                  if not (folder / "minipar" / path).is_file())


# MPICH's launcher prints this block on stdout when it cleans up after a rank it had to
# kill: the job's own sentence (`explain_crash`) already says what happened, in words.
LAUNCHER_BANNER = re.compile(
    r"^=+\n(?:=   .*\n)+=+\n"
    r"(?:YOUR APPLICATION TERMINATED WITH THE EXIT STRING:.*\n)?"
    r"(?:This typically refers to a problem with your application\..*\n)?"
    r"(?:Please see the FAQ page for debugging suggestions.*(?:\n|$))?", re.M)


def without_launcher_banner(stdout: str) -> str:
    """The job's stdout without mpiexec's "BAD TERMINATION" block (and the three lines
    after it), which hydra prints there, between the ranks' own lines, when a rank ends
    by a signal in a job that is already going down."""
    return LAUNCHER_BANNER.sub("", stdout)


def bounded(report: str, limit: int = SHOWN_LINES) -> str:
    """The job's report with the student's own printing cut to `limit` lines (each to 300
    characters): the graded lines ("exercise NAME: ..." and the verdict under it) stay
    whole."""
    lines, out, other = report.splitlines(), [], 0
    for i, line in enumerate(lines):
        graded = line.startswith("exercise ") or (
            line.startswith("  ") and i and lines[i - 1].startswith("exercise "))
        if graded:
            out.append(line)
        elif other < limit:
            out.append(line if len(line) <= 300 else line[:300] + " ...")
        other += not graded
    if other > limit:
        out.append(f"({other - limit} more lines the code printed are left out)")
    return "\n".join(out)


def mpiexec() -> str:
    """$MINIPAR_MPIEXEC, else the launcher beside this Python (PyPI's mpich), else PATH."""
    if os.environ.get("MINIPAR_MPIEXEC"):
        return os.environ["MINIPAR_MPIEXEC"]
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def check(names: list[str], folder: Path, timeout: float = TIMEOUT) -> tuple[int, str]:
    """Grade `names` against folder/minipar in one MPI job: (exit code, report). The
    launcher's limit is `timeout` seconds per check (grade.py's own deadline, shorter,
    names the step and the call a rank is stuck in). Under each exercise's lines, one
    line per region left as the stub or copied from the reference (`region_notes`); a
    job whose every exercise passed exits `COPIED` instead of 0 if a region is a copy."""
    code, report = run_job(names, folder, timeout)
    if code == 2:
        return code, report
    notes = {name: region_notes(name, folder) for name in names}
    copied = any(kind == "copied" for found in notes.values() for kind, _ in found)
    return (COPIED if code == 0 and copied else code), annotate(report, notes)


def region_notes(name: str, folder: Path) -> list[tuple[str, str]]:
    """(kind, sentence) for each region of `name` in folder/minipar that is still the stub
    or is the reference answer (`regions.compare`), in words a student and a teacher read."""
    found = regions.compare(name, folder)
    notes = []
    for number, (region, kind) in enumerate(found, 1):
        where = f"region {number} of {len(found)} (minipar/{region.path}:{region.first + 1})"
        if kind == "stub":
            notes.append((kind, f"{where} is left as the stub handed out: the check fails "
                          f"until you write it; for help, python -m minipar exercise hint {name}"))
        elif kind == "copied":
            notes.append((kind, f"{where} is copied from the reference answer (the same code "
                          "as exercise solution prints, up to spacing and comments): what "
                          "passes there is the library's own code, not yours"))
    return notes


def annotate(report: str, notes: dict[str, list[tuple[str, str]]]) -> str:
    """The report with each exercise's notes put under its lines (its `exercise NAME:`
    line and the indented lines after it), two spaces in, like the verdict."""
    out: list[str] = []
    pending: list[str] = []
    for line in report.splitlines():
        if pending and not line.startswith("  "):
            out, pending = out + pending, []
        out.append(line)
        name = next((n for n in notes if line.startswith(f"exercise {n}: ")), None)
        if name is not None:
            pending = [f"  {sentence}" for _, sentence in notes[name]]
    return "\n".join(out + pending)


def run_job(names: list[str], folder: Path, timeout: float = TIMEOUT) -> tuple[int, str]:
    """`check`'s job alone: (exit code, report) of the grader run on folder/minipar."""
    timeout = timeout * sum(len(exercises.get(name).checks) for name in names)
    if not (folder / "minipar" / "__init__.py").exists():
        return 2, f"{folder} holds no minipar/ (start one: python -m minipar exercise start)"
    missing = missing_files(folder, names)
    if missing:   # nothing falls back to the installed package: say what is not there
        return 1, "\n".join(
            [f"exercise {names[0]}: FAILED\n  your folder lacks {missing[0]}"
             + (f" (and {len(missing) - 1} more files of the package)" if len(missing) > 1
                else "") + ": the check runs your copy alone; start again with python -m "
             "minipar exercise start NAME DIR"]
            + [f"exercise {name}: not checked (the folder is incomplete)" for name in names[1:]])
    changed = grader_changed(folder)
    if changed:   # the verdicts come from these files: they must be the ones handed out
        return 1, "\n".join(
            [f"exercise {names[0]}: FAILED\n  {changed[0]} is not the grader handed out "
             "(it differs from this minipar's): the check grades with its own files; start "
             "again with python -m minipar exercise start NAME DIR and copy your regions in"]
            + [f"exercise {name}: not checked (the grader was changed)" for name in names[1:]])
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", UCX_NET_DEVICES="lo", MPIEXEC_TIMEOUT=str(int(timeout)),
               PYTHONPATH=str(folder.resolve()))  # the student's minipar, not this one
    launcher = mpiexec()
    named = "$MINIPAR_MPIEXEC" if os.environ.get("MINIPAR_MPIEXEC") else "the launcher"
    if shutil.which(launcher) is None:   # a name or path that runs nothing: said, not raised
        return 2, (f"{named} {launcher!r} is no program this process can run (not found, "
                   "or not executable): set MINIPAR_MPIEXEC to an mpiexec, or unset it")
    command = [launcher, "-n", str(exercises.RANKS), sys.executable, str(SEALED), *names]
    word = secrets.token_hex(16)   # this run's seal: on rank 0's standard input alone
    try:
        job = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                             timeout=timeout + 10, input=word + "\n")
    except OSError as error:   # it vanished or lost its permission since: the same words
        return 2, (f"{named} {launcher!r} could not be started ({error.strerror}): set "
                   "MINIPAR_MPIEXEC to an mpiexec, or unset it")
    except subprocess.TimeoutExpired:
        return 1, (f"exercise {names[0]}: FAILED\n  timeout: the check job ran past its "
                   f"{timeout:g} s: a rank loops forever or waits in a call its partners "
                   "never make")
    text, verdicts = unsealed(without_launcher_banner(job.stdout).strip(), word)
    report = bounded(text)
    unreported = [name for name in names if name not in verdicts]
    if unreported:   # the job ended (an abort: exit 1 too) before these reported
        lines = [report] if report else []
        why = explain_crash(job.returncode, job.stderr, job.stdout, timeout)
        if "(printed by the code, not the grader) exercise " in text:
            why = ("the code printed a verdict line itself, and no check of the grader's "
                   f"reported (the job ended with exit {job.returncode}): a verdict comes "
                   "from the grader alone; code that prints or ends the process at import "
                   "(sys.exit, os._exit) grades nothing")
        lines.append(f"exercise {unreported[0]}: FAILED\n  " + why)
        lines += [f"exercise {name}: not checked (the job ended before it)"
                  for name in unreported[1:]]
        return 1, "\n".join(lines)
    if all(verdicts.values()) and job.returncode != 0:   # passed, then the job failed
        return 1, (f"{report}\n  but the job ended with exit {job.returncode} after its "
                   "checks: " + explain_crash(job.returncode, job.stderr, job.stdout, timeout))
    return (0 if all(verdicts.values()) else 1), report


def explain_crash(code: int, stderr: str, stdout: str = "", limit: float | None = None
                  ) -> str:
    """A job that ended without its report, in words: MPI's own fatal error (the ranks'
    calls did not match), the watchdog's line (a rank stuck), the launcher's timeout
    (MPIEXEC_TIMEOUT: mpiexec says so on its standard output), or the last lines."""
    fatal = re.search(r"Fatal error in (?:internal_|P?MPI_)?(\w+?)(?:_c)?: ([^,\n]+)", stderr)
    if fatal:
        return (f"MPI stopped the job in {fatal.group(1)} ({fatal.group(2)}): the "
                "ranks' calls did not match. One rank made a collective call its partners "
                "did not make, or with another size; every rank of a group must make the "
                "same calls, in the same order, with the same counts")
    lacking = re.search(r"No module named '(minipar(?:\.\w+)*)'", stderr)
    name = re.search(r"cannot import name '(\w+)' from '(minipar(?:\.\w+)*)' \(\S*__init__\.py",
                     stderr)
    if lacking or name:   # the student's folder alone: a module it lacks is not found elsewhere
        path = (lacking.group(1) if lacking else f"{name.group(2)}.{name.group(1)}"
                ).replace(".", "/")
        return (f"your folder lacks {path}.py (or the package {path}/): the check runs your "
                "copy alone; start again with python -m minipar exercise start NAME DIR")
    verdict = [line for line in stderr.splitlines() if line.startswith(VERDICT)]
    if verdict:
        return verdict[0].removeprefix(VERDICT)
    stuck = [line for line in stderr.splitlines() if "watchdog:" in line]
    if stuck:
        return stuck[0].removeprefix("minipar: error: ")
    said = stderr + "\n" + stdout
    if "TIMED OUT" in said or "timeout" in said.lower() and code in (-9, 137, 255):
        return ("timeout: the check job ran past its time limit"
                + (f" of {limit:g} s" if limit else "") + " (the launcher ended it): a rank "
                "loops forever, or waits in a call its partners never make")
    tail = "\n".join(line[:300] for line in stderr.strip().splitlines()[-12:])
    if code == 0:
        return ("the job ended with exit 0 before any check reported: the code ended the "
                "process early (sys.exit or os._exit at import?)" + (f":\n{tail}" if tail
                                                                     else ""))
    return f"the check job ended (exit {code}):\n{tail}"


def hint(name: str, step: int = 1) -> str:
    """Steps 1..`step` of the hint of `name`, each under its number, and a last line that
    says how many there are and how to see the next. A ValueError (one line) for a step
    that is not there."""
    steps = exercises.get(name).hint_steps()
    if not 1 <= step <= len(steps):
        raise ValueError(f"the hint of {name} has steps 1 to {len(steps)}, not {step}")
    shown = [f"Step {k} of {len(steps)}:\n{text}" for k, text in enumerate(steps[:step], 1)]
    if step < len(steps):
        shown.append(f"(step {step} of {len(steps)}; the next one: python -m minipar exercise "
                     f"hint {name} --step {step + 1})")
    else:
        shown.append(f"(the last step of {len(steps)})")
    return "\n\n".join(shown)


def parser() -> argparse.ArgumentParser:
    """The `exercise` subcommands."""
    top = argparse.ArgumentParser(prog="python -m minipar exercise",
                                  description="self-grading exercises")
    sub = top.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the exercises")
    start = sub.add_parser("start", help="copy minipar to DIR with NAME's code stubbed")
    start.add_argument("name")
    start.add_argument("dir")
    hint = sub.add_parser("hint", help="NAME's hint, one step at a time")
    hint.add_argument("name")
    hint.add_argument("--step", type=int, default=1, metavar="K",
                      help="show steps 1..K (default 1)")
    sub.add_parser("solution", help="the reference answer").add_argument("name")
    grade = sub.add_parser("check", help="grade NAME (several allowed) against DIR/minipar")
    grade.add_argument("args", nargs="+", metavar="NAME [NAME ...] [DIR]")
    return top


def main(argv: list[str]) -> int:
    """Run one `exercise` subcommand; 2 and one line on bad input."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    try:
        if args.action == "list":
            for exercise in exercises.EXERCISES:
                files = sorted({r.path for r in regions.regions_of(exercise.name)})
                print(f"{exercise.name:18} {exercise.title}  [{', '.join(files)}]")
        elif args.action == "start":
            stubbed = regions.start([args.name], Path(args.dir))
            print(f"started {args.name} in {args.dir}: read {Path(args.dir) / 'EXERCISE.txt'}, "
                  f"write your code in {', '.join(str(p) for p in stubbed)}, then run "
                  f"python -m minipar exercise check {args.name} {args.dir}")
        elif args.action == "hint":
            print(hint(args.name, args.step))
        elif args.action == "solution":
            print(regions.solution(args.name))
        else:
            names = [a for a in args.args if a in exercises.BY_NAME]
            rest = [a for a in args.args if a not in exercises.BY_NAME]
            if not names or len(rest) > 1:
                raise ValueError("check NAME [NAME ...] [DIR]: the names are "
                                 + ", ".join(exercises.BY_NAME))
            folder = Path(rest[0] if rest else ".")
            held = regions.started_for(folder)
            other = [name for name in names if held is not None and name not in held]
            if other:
                raise ValueError(f"{folder} was started for {', '.join(held) or 'nothing'}, "
                                 f"not {', '.join(other)}: check "
                                 f"{' '.join(held) or 'NAME'} {folder}, or start {other[0]} "
                                 "in a new folder")
            code, report = check(names, folder)
            if code == 2:
                raise ValueError(report)
            print(report, flush=True)
            return code
    except ValueError as error:
        print(f"minipar: error: {error}", file=sys.stderr)
        return 2
    return 0
