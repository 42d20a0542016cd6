"""Every lesson script runs under mpiexec with its rank count, and draws its figures.

The rank count comes from the first run line of each lesson's docstring
(`mpiexec -n 4 python lessons/02_tensor_parallel.py`); a lesson that has a
`--quick` flag runs quick. Every lesson takes `--plot DIR` and must write at
least one PNG there: a real picture, not a blank one. A strategy's own tests read
what the same run printed (tests.harness.mpi.lesson_run: one run per session).

The same runs without pytest, at full size: `make lessons`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.mpi import LESSON_FLAGS, ROOT, lesson_run
from tests.teaching.test_plots import assert_picture

LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
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


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.stem)
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
