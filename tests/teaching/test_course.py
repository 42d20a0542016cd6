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


def test_a_notebooks_exercise_runs_handed_out_then_solved_in_the_same_kernel(tmp_path,
                                                                             monkeypatch):
    """tests/teaching/notebooks.py on a five-cell notebook: an exercise cell waits for
    its answer as handed out, its solved run passes and is kept apart, and the next cell
    sees the handed-out kernel (x is None again) and keeps its In [n]; a second exercise
    built on the first passes solved with the first's answer. A solution that fails its
    check, and an exercise that does not wait, are each named."""
    import nbformat

    from tests.teaching import notebooks

    exercise = ('from minipar.teaching import classroom\n'
                'x = None                 # your formula\n'
                'if classroom.answered("exercise 1", "measured 3", x=x):\n'
                '    assert x == 3, "not yet: count again"\n'
                '    print("check passed")')
    builds_on_it = ('z = None                 # your formula\n'
                    'if classroom.answered("exercise 2", "x + 1", x=x, z=z):\n'
                    '    assert z == x + 1, "not yet"\n'
                    '    print("check passed")')
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("y = 1"),
                                           nbformat.v4.new_code_cell(exercise),
                                           nbformat.v4.new_code_cell("print('x is', x)"),
                                           nbformat.v4.new_code_cell(builds_on_it),
                                           nbformat.v4.new_code_cell("print(x, z)")])
    path = tmp_path / "tiny.ipynb"
    nbformat.write(book, path)
    monkeypatch.setitem(notebooks.ANSWERS, "tiny", {"x": "1 + 2", "z": "4"})
    ran, solved_runs = notebooks.execute(path, tmp_path / "out")
    assert "exercise 1: not written yet" in notebooks.printed(ran.cells[1])
    assert "check passed" in solved_runs[1] and "check passed" not in notebooks.printed(
        ran.cells[1])
    assert notebooks.printed(ran.cells[2]) == "x is None\n"
    assert "check passed" in solved_runs[3]   # exercise 2's check saw exercise 1 solved
    assert notebooks.printed(ran.cells[4]) == "None None\n"   # and the class's kernel not
    assert [c.execution_count for c in ran.cells] == [1, 2, 3, 4, 5]
    assert (tmp_path / "out" / "tiny.ipynb").exists()
    exercise_problems = [p for p in notebooks.problems(path, ran, solved_runs)
                         if "draws no figure" not in p]
    assert exercise_problems == []
    wrong = notebooks.problems(path, ran, {1: "AssertionError: not yet: count again"})
    assert any("solved" in p and "did not pass" in p for p in wrong), wrong
    ran.cells[1].outputs = []
    assert any("did not wait for its answer" in p
               for p in notebooks.problems(path, ran, solved_runs))


def test_a_lessons_parts_are_numbered_in_order_and_its_lines_fit_the_page():
    """`make course` fails a lesson whose parts skip a number, come out of order, have no
    `=== N.` header at all, or whose output has a line wider than 120 characters; the
    output of a lesson that does it right passes."""
    from minipar.teaching.lines import fit
    from tests.course import layout_problems

    good = "lesson 9 on 4 ranks\n\n=== 1. the first\n[rank 0] x\n\n=== 2. Beyond the source: y\n"
    assert layout_problems(good) == []
    gap = layout_problems(good.replace("=== 2.", "=== 3."))
    assert len(gap) == 1 and "is not `=== 2. ...`" in gap[0], gap
    assert "no part header" in layout_problems("just lines\n")[0]
    assert "is not `=== 1. ...`" in layout_problems("=== 5a. ring\n")[0]
    assert "is not `=== 1. ...`" in layout_problems("=== 1/21 a bug\n")[0]
    wide = layout_problems(good + "x" * 121 + "\n" + "y" * 120 + "\n" + "z" * 130)
    assert wide == ["2 output line(s) wider than 120 characters, the first at output line 7 "
                    "(121 characters)"], wide
    prose = "  why: " + " ".join(["word"] * 60)   # 307 characters
    wrapped = fit(prose).splitlines()
    assert len(wrapped) == 3 and all(len(line) <= 120 for line in wrapped), wrapped
    assert wrapped[0].startswith("  why: ") and wrapped[1].startswith("    word")
    assert " ".join(line.strip() for line in wrapped) == prose.strip()
    assert fit("short\n\n  kept as it is") == "short\n\n  kept as it is"
    assert fit("a" * 130) == "a" * 130   # no space to break at: left whole
