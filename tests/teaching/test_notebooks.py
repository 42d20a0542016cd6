"""The classroom notebooks as stored: without outputs, every exercise handed out unsolved
with its solution kept, a teacher's answer cells holding today's stubs.

Running them is `make course`'s (tests/course.py with tests/teaching/notebooks.py): every
notebook at full size, as a class runs it, each exercise also solved in the same kernel
and checked passing. The tests here read the notebooks without running one, except
lesson 14's last exercise cell, run in this process three ways.
"""

from __future__ import annotations

import nbformat
import pytest

from tests.harness.mpi import ROOT
from tests.teaching.notebook_answers import ANSWERS
from tests.teaching.notebooks import ANSWER_LINE, code_cells, solved, stub_problem

NOTEBOOKS = sorted((ROOT / "lessons").glob("*.ipynb"))


def test_a_notebook_for_every_strategy():
    names = " ".join(path.stem for path in NOTEBOOKS)
    for word in ("collectives", "data_parallel", "tensor_parallel", "expert_parallel",
                 "pipeline_parallel", "tp_vs_pp", "hybrid", "zero", "bugs", "transformer",
                 "transformer_tp", "context_parallel"):
        assert word in names, word


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in code_cells(notebook):
        assert cell.outputs == [] and cell.execution_count is None, (
            f"{path.name}: strip the outputs before committing (cell {cell.source[:60]!r})")


def answer_lines(notebook: nbformat.NotebookNode) -> list[tuple[str, str]]:
    """Every line of a code cell marked `# your`, as (left side, right side); a marked line
    that is not `left = right  # your ...` comes back as ("", the line)."""
    found = []
    for cell in code_cells(notebook):
        for line in cell.source.splitlines():
            if "# your" in line:
                match = ANSWER_LINE.match(line)
                found.append((match["left"], match["right"]) if match else ("", line))
    return found


def test_exercises_are_handed_out_unsolved_with_their_solutions_kept():
    """Every `# your` line of a notebook is `left = None` (or `None, None`) as stored, and
    has its solution in notebook_answers.py; every solution there has its line."""
    problems, lines = [], {}
    for path in NOTEBOOKS:
        for left, right in answer_lines(nbformat.read(path, as_version=4)):
            if not left:
                problems.append(f"{path.name}: not an answer line: {right!r}")
            elif (path.stem, left) in lines:
                problems.append(f"{path.name}: two answer lines for {left!r}")
            elif set(right.replace(" ", "").split(",")) != {"None"}:
                problems.append(f"{path.name}: {left} = {right}: hand it out as None")
            lines[path.stem, left] = right
    solutions = {(stem, left) for stem, answers in ANSWERS.items() for left in answers}
    problems += [f"{stem}: {left!r} has no solution in notebook_answers.py"
                 for stem, left in sorted(lines.keys() - solutions)]
    problems += [f"{stem}: notebook_answers.py solves {left!r}, a line it does not have"
                 for stem, left in sorted(solutions - lines.keys())]
    assert problems == []
    assert len(lines) >= 20, "the lessons' exercises: none found"


@pytest.mark.parametrize("name", ["05_tp_vs_pp", "07_zero", "08_bugs", "10_transformer",
                                  "11_transformer_tp", "12_context_parallel",
                                  "14_mixed_precision"])
def test_lesson_notebooks_ask_what_to_notice_and_check_exercises(name):
    """A notebook for a class: "what to notice" prompts, and exercises whose cells
    check the answer against what the ranks measured (an assert that can fail)."""
    notebook = nbformat.read(ROOT / "lessons" / f"{name}.ipynb", as_version=4)
    text = [cell.source for cell in notebook.cells if cell.cell_type == "markdown"]
    assert sum("What to notice" in t for t in text) >= 1, name
    exercises = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "markdown"
                 and cell.source.startswith("## Exercise")]
    assert 2 <= len(exercises) <= 3, name
    for i in exercises:  # the code cell after each exercise checks the answer
        check = notebook.cells[i + 1]
        assert check.cell_type == "code" and "assert" in check.source, (name, i)


def test_an_exercise_cell_waits_for_its_answer_then_judges_it(capsys):
    """Lesson 14's last exercise cell, run in-process three ways: as handed out it prints
    one "not written yet" line and does not raise; solved it prints `check passed`; a
    wrong answer raises the check's AssertionError ("not yet: ...")."""
    import numpy as np

    from minipar.teaching import classroom

    path = ROOT / "lessons" / "14_mixed_precision.ipynb"
    handed_out = [c.source for c in code_cells(nbformat.read(path, as_version=4))]
    (i,) = [i for i, source in enumerate(handed_out) if source.startswith("S = None ")]
    exec(handed_out[i], {"np": np, "classroom": classroom})
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and printed.startswith("exercise 2: not written yet -- "
                                                           "write `S` in the line"), printed
    exec(solved(handed_out[i], "14_mixed_precision"), {"np": np, "classroom": classroom})
    assert "check passed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="^not yet: "):
        exec(handed_out[i].replace("S = None", "S = 2.0 ** 12"),
             {"np": np, "classroom": classroom})


def test_the_teachers_answer_cells_hold_todays_stubs():
    """exercises.ipynb hands out a stub as a student's first answer: it must be the stub
    `exercise start` writes today (an exercise's text changed -> its stub changed), found
    without running the notebook (`make course` also checks its run fails on it)."""
    notebook = nbformat.read(ROOT / "lessons" / "exercises.ipynb", as_version=4)
    answers = [cell for cell in code_cells(notebook) if cell.source.startswith("# Your answer")]
    assert answers
    for cell in answers:
        said = stub_problem(cell)   # the first line of its problems: not today's stub
        assert said is None or not said.startswith("not today's stub"), said
