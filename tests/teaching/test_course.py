"""`make course` runs the whole course: a lesson or notebook added to lessons/ joins it.

tests/course.py's COURSE is the course's table of contents (lesson, ranks); `make course`
runs every script in it at its docstring's rank count and every notebook at full size,
and CI (.ci/run) runs `make course` after `make test`. These tests fail when a file in
lessons/ is left out of that table, a lesson has no notebook, or the table's rank count
is not the one its docstring tells a student to type.
"""

from __future__ import annotations

from tests.course import COURSE, EXTRA_NOTEBOOKS, LESSONS, Outcome, cores, table
from tests.harness.mpi import ROOT
from tests.teaching.test_lessons import ranks


def test_every_lesson_script_and_notebook_is_in_the_course():
    listed = {stem for stem, _ in COURSE}
    scripts = {path.stem for path in LESSONS.glob("[0-9][0-9]_*.py")}
    notebooks = {path.stem for path in LESSONS.glob("*.ipynb")}
    assert scripts - listed == set(), "lessons missing from tests/course.py's COURSE"
    assert listed - scripts == set(), "COURSE names lessons that do not exist"
    assert scripts - notebooks == set(), "a lesson without its notebook"
    assert notebooks - scripts - set(EXTRA_NOTEBOOKS) == set(), "a notebook not in the course"


def test_the_course_runs_each_script_on_its_docstrings_rank_count():
    for stem, n in COURSE:
        assert ranks(LESSONS / f"{stem}.py") == n, stem


def test_ci_runs_the_course_after_the_suite():
    run = (ROOT / ".ci" / "run").read_text()
    assert run.index("make test") < run.index("make course"), run
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ncourse:", 1)[1].split("\n\n", 1)[0]
    assert "tests.course" in recipe, recipe


def test_the_table_gives_ranks_seconds_checks_and_marks_oversubscribed_runs():
    rows = table([Outcome("01_data_parallel.py", cores() + 1, 2.5, 3, []),
                  Outcome("02_tensor_parallel.ipynb", 1, 12.25, 4, ["exit 1"]),
                  Outcome("exercises.ipynb", None, 1.0, None, [])]).splitlines()
    assert rows[1].split() == ["01_data_parallel.py", f"{cores() + 1}*", "2.5", "3", "ok"]
    assert rows[2].split() == ["02_tensor_parallel.ipynb", "1", "12.2", "4", "FAILED"]
    assert rows[3].split() == ["exercises.ipynb", "-", "1.0", "-", "ok"]


def test_a_failing_lesson_is_named_with_its_failed_check(tmp_path, monkeypatch):
    """A lesson that prints a MISMATCH, counts it and exits 1 (what run_collectively does
    after a failed verdict) fails the course with the check's own line; one that draws
    nothing is told so."""
    import tests.course as course

    lessons, figures, stem = tmp_path / "lessons", tmp_path / "figures", "99_broken"
    lessons.mkdir()
    figures.mkdir()
    (lessons / f"{stem}.py").write_text(
        "import sys\n"
        "print('gradient sync against one process: 3.1e-02 -> MISMATCH')\n"
        "print('lesson checks: 2 passed, 1 failed')\n"
        "# run_collectively\n"
        "sys.exit(1)\n")
    monkeypatch.setattr(course, "LESSONS", lessons)
    monkeypatch.setattr(course, "FIGURES", figures)
    outcome = course.run_lesson(stem, 1, tmp_path)
    assert outcome.checks == 2 and outcome.name == f"{stem}.py"
    assert outcome.problems[:2] == ["exit 1", "1 check(s) failed"], outcome.problems
    assert any("gradient sync against one process: 3.1e-02 -> MISMATCH" in p
               for p in outcome.problems), outcome.problems
    assert outcome.problems[-1].startswith("drew no picture"), outcome.problems
    assert "MISMATCH" in (tmp_path / "99_broken.log").read_text()
