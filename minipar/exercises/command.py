"""`python -m minipar exercise ...`: hand out an exercise, show its hint, grade it.

    python -m minipar exercise list
    python -m minipar exercise start NAME DIR       a copy of minipar with NAME stubbed
    python -m minipar exercise hint NAME
    python -m minipar exercise solution NAME        the project's own code of its regions
    python -m minipar exercise check NAME [NAME ...] [DIR]   (DIR defaults to .)

`check` starts one MPI job (`mpiexec -n 4`, the launcher beside this Python or
$MINIPAR_MPIEXEC) in DIR, so that DIR/minipar, the student's copy, is what the
ranks import; it prints the job's report and exits 0 if every exercise passed,
1 if one failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from minipar import exercises
from minipar.exercises import regions

VERDICT = "minipar: exercise verdict: "  # grade.VERDICT (grade.py loads MPI: not imported)
TIMEOUT = 240  # seconds for a whole check job; the watchdog names a stuck call sooner


def mpiexec() -> str:
    """$MINIPAR_MPIEXEC, else the launcher beside this Python (PyPI's mpich), else PATH."""
    if os.environ.get("MINIPAR_MPIEXEC"):
        return os.environ["MINIPAR_MPIEXEC"]
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def check(names: list[str], folder: Path, timeout: float = TIMEOUT) -> tuple[int, str]:
    """Grade `names` against folder/minipar in one MPI job: (exit code, report)."""
    if not (folder / "minipar" / "__init__.py").exists():
        return 2, f"{folder} holds no minipar/ (start one: python -m minipar exercise start)"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", UCX_NET_DEVICES="lo", MPIEXEC_TIMEOUT=str(int(timeout)),
               PYTHONPATH=str(folder.resolve()))  # the student's minipar, not this one
    command = [mpiexec(), "-n", str(exercises.RANKS), sys.executable, "-m",
               "minipar.exercises.grade", *names]
    try:
        job = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                             timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        return 1, f"the check job outlived {timeout} s: a rank waits in a collective forever"
    report = job.stdout.strip()
    if job.returncode not in (0, 1) or not report:
        unreported = [name for name in names if f"exercise {name}:" not in report]
        lines = [report] if report else []
        lines.append(f"exercise {unreported[0]}: FAILED\n  "
                     + explain_crash(job.returncode, job.stderr))
        lines += [f"exercise {name}: not checked (the job ended before it)"
                  for name in unreported[1:]]
        return 1, "\n".join(lines)
    return job.returncode, report


def explain_crash(code: int, stderr: str) -> str:
    """A job that ended without its report, in words: MPI's own fatal error (the ranks'
    calls did not match), the watchdog's line (a rank stuck), or the last lines."""
    fatal = re.search(r"Fatal error in (?:internal_|P?MPI_)?(\w+?)(?:_c)?: ([^,\n]+)", stderr)
    if fatal:
        return (f"MPI stopped the job in {fatal.group(1)} ({fatal.group(2)}): the "
                "ranks' calls did not match. One rank made a collective call its partners "
                "did not make, or with another size; every rank of a group must make the "
                "same calls, in the same order, with the same counts")
    verdict = [line for line in stderr.splitlines() if line.startswith(VERDICT)]
    if verdict:
        return verdict[0].removeprefix(VERDICT)
    stuck = [line for line in stderr.splitlines() if "watchdog:" in line]
    if stuck:
        return stuck[0].removeprefix("minipar: error: ")
    tail = "\n".join(stderr.strip().splitlines()[-12:])
    return f"the check job ended (exit {code}):\n{tail}"


def parser() -> argparse.ArgumentParser:
    """The `exercise` subcommands."""
    top = argparse.ArgumentParser(prog="python -m minipar exercise",
                                  description="self-grading exercises")
    sub = top.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the exercises")
    start = sub.add_parser("start", help="copy minipar to DIR with NAME's code stubbed")
    start.add_argument("name")
    start.add_argument("dir")
    for action in ("hint", "solution"):
        sub.add_parser(action).add_argument("name")
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
            print(exercises.get(args.name).hint_file.read_text().strip())
        elif args.action == "solution":
            print(regions.solution(args.name))
        else:
            names = [a for a in args.args if a in exercises.BY_NAME]
            rest = [a for a in args.args if a not in exercises.BY_NAME]
            if not names or len(rest) > 1:
                raise ValueError("check NAME [NAME ...] [DIR]: the names are "
                                 + ", ".join(exercises.BY_NAME))
            code, report = check(names, Path(rest[0] if rest else "."))
            if code == 2:
                raise ValueError(report)
            print(report, flush=True)
            return code
    except ValueError as error:
        print(f"minipar: error: {error}", file=sys.stderr)
        return 2
    return 0
