"""Lesson scripts run under mpiexec with their rank count, and draw their figures.

The rank count comes from the first run line of each lesson's docstring
(`mpiexec -n 4 python lessons/02_tensor_parallel.py`). `make course` runs every lesson
at full size; the suite runs those it would not run the same way: a lesson with a
`--quick` flag (run quick here), and a lesson whose printout a strategy's own tests read
(tests.harness.mpi.lesson_run: one run per session). Every lesson takes `--plot DIR`
and must write at least one PNG there: a real picture, not a blank one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.mpi import LESSON_FLAGS, ROOT, lesson_run
from tests.teaching.test_plots import assert_picture

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
# lessons whose run a strategy's test reads: `lesson_run(ranks, "<lesson file>", ...)`
READ_BY_TESTS = set(re.findall(r'lesson_run\(\s*\w+,\s*"(\d\d_\w+\.py)"', "\n".join(
    path.read_text() for path in (ROOT / "tests").rglob("test_*.py"))))
# run here: quick where a lesson has --quick (make course runs none quick), or read above
IN_SUITE = [lesson for lesson in LESSONS
            if '"--quick"' in lesson.read_text() or lesson.name in READ_BY_TESTS]
RUN_LINE = re.compile(r"mpiexec -n (\d+) python (?:-m mpi4py )?lessons/")


def ranks(lesson: Path) -> int:
    """The rank count of the lesson's first run line."""
    found = RUN_LINE.search(lesson.read_text())
    assert found, f"{lesson.name}: its docstring has no 'mpiexec -n N python lessons/...' line"
    return int(found.group(1))


def test_there_is_a_lesson_for_every_strategy():
    names = " ".join(lesson.stem for lesson in LESSONS)
    for word in ("collectives", "data_parallel", "tensor_parallel", "expert_parallel",
                 "pipeline_parallel", "hybrid", "zero", "context_parallel"):
        assert word in names, word


def test_the_lessons_left_to_the_course_run_there_as_they_would_here():
    """A lesson the suite leaves out has no --quick and no test reading it: its run here
    would be `make course`'s own run (full size, its docstring's ranks)."""
    from tests.course import COURSE

    left = {lesson.stem for lesson in LESSONS} - {lesson.stem for lesson in IN_SUITE}
    assert left <= {stem for stem, _ in COURSE}, left
    assert len(IN_SUITE) >= len(LESSONS) // 2, [lesson.name for lesson in IN_SUITE]


@pytest.mark.parametrize("lesson", IN_SUITE, ids=lambda path: path.stem)
def test_lesson_runs_and_draws_its_figures(lesson):
    quick = ["--quick"] if '"--quick"' in lesson.read_text() else []
    job, folder = lesson_run(ranks(lesson), lesson.name, *quick,  # shared with other tests
                             *LESSON_FLAGS.get(lesson.name, ()))
    assert job.returncode == 0 and not job.timed_out, job.explain()
    figures = sorted(folder.glob("*.png"))
    assert figures, f"{lesson.name} --plot {folder} wrote no PNG"
    for figure in figures:
        assert figure.name.startswith(lesson.name[:2]), figure.name  # NN_what.png
        assert_picture(figure)
