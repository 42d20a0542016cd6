"""The first code each rank of `exercise check` runs: the grader's, never the student's.

    mpiexec -n 4 python <this package>/exercises/sealed.py NAME [NAME ...]  (stdin: the seal)

`command.py` runs this file by its path in the package that grades (not the student's
copy), with the student's folder first on the path, so that `import minipar` is the
student's code. Before importing any of it, this file

- hides the installed package (an editable install's import hook would fill in a
  module the student's folder lacks);
- reads the run's seal on rank 0: a random word `command.py` writes to the job's
  standard input (mpiexec hands it to rank 0 alone), and so in no file, no variable of
  the environment and no argument the student's code could read. Only the lines the
  grader prints through `seal` end with it, and `command.py` believes no other:
  a student's module that prints "exercise NAME: passed" and exits 0 at import
  grades nothing;
- starts a deadline for the import itself (40 s, `MINIPAR_EXERCISE_IMPORT_DEADLINE`):
  code at module level that never returns ends the job with the line it is stuck on,
  as a check's deadline does (grade.py).

Then it runs the student's `minipar/exercises/grade.py` (which `command.py` has checked
is the one handed out, byte for byte) and exits with its code.
"""

from __future__ import annotations

import os
import sys
import threading

VERDICT = "minipar: exercise verdict: "   # grade.VERDICT (not imported: the student's)


def hide_installed_package() -> None:
    """Only the student's folder provides `minipar`: this file's own folder leaves the
    path, and an editable install's finder and path hook leave the import system."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in repr(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in repr(h)]
    sys.path_importer_cache.clear()


def import_deadline(seconds: float, rank: int) -> threading.Timer:
    """End the job (exit 1, one verdict line on stderr) if the import of the grader and
    the student's modules takes longer than `seconds`, naming the student's line the
    main thread is on."""
    main = threading.main_thread().ident

    def expire() -> None:
        frame, where = sys._current_frames().get(main), "?"
        while frame is not None:
            name = frame.f_code.co_filename
            if "/minipar/" in name:
                where = f"{name.split('/minipar/')[-1]}:{frame.f_lineno}"
                break
            frame = frame.f_back
        sys.stderr.write(f"{VERDICT}timeout: after {seconds:g} s rank {rank} is still "
                         f"importing the code, at {where}: code that runs at import (at "
                         "module level) never ends\n")
        sys.stderr.flush()
        os._exit(1)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def run() -> int:
    """Hide the package, read the seal, import the grader under a deadline, grade."""
    hide_installed_package()
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    word = sys.stdin.readline().strip() if rank == 0 else ""
    # its own limit: an import on a loaded machine may take longer than a test's short
    # check deadline (MINIPAR_EXERCISE_DEADLINE), and a check's deadline starts after it
    seconds = float(os.environ.get("MINIPAR_EXERCISE_IMPORT_DEADLINE", "40"))
    deadline = import_deadline(seconds, rank)
    import runpy

    sys.argv[0] = "grade"
    grader = runpy.run_module("minipar.exercises.grade", run_name="minipar_grade")
    deadline.cancel()
    return grader["main"](sys.argv[1:], lambda line: f"{line} [{word}]")


if __name__ == "__main__":
    sys.exit(run())
