"""The classroom notebooks run headless, from the first cell to the last, and draw.

Each notebook in lessons/ is executed with nbclient in a fresh kernel (cwd
lessons/, a per-cell timeout), as a teacher would run it: its cells start real
MPI ranks, as ipyparallel engines or as `mpiexec` jobs (minipar/teaching/classroom.py).
A cell that raises fails the test with the cell and its traceback. The
repository keeps the notebooks without outputs.

`make notebooks` runs this file with $MINIPAR_NOTEBOOKS_OUT=build/notebooks: each
executed notebook, outputs and figures included, is written there for a teacher
to read (a notebook that fails is written too, up to the failing cell).

A lesson's exercise is handed out unsolved: its answer line reads `name = None  # your
formula`, and its cell prints "not written yet" instead of checking
(minipar.teaching.classroom.answered). The suite writes the solutions in
(tests/teaching/notebook_answers.py) before it runs a notebook, so every exercise cell
must print `check passed`; `make course` and $MINIPAR_NOTEBOOKS_OUT runs (the book's
notebooks) run them as handed out, and every exercise cell must say "not written yet".

A cell that holds a student's answer (it begins `# Your answer`, exercises.ipynb)
must start as a stub `exercise start` hands out, and its first run must print the
check failing on it, the region named as left as the stub: never passing.

The tests run the notebooks with $MINIPAR_QUICK=1 (unless it is set already): a
notebook that reads it (its first cells say what it changes) does less of the same
work, and says so in what it prints; a cell that runs a lesson script prints a line
instead (tests/teaching/test_lessons.py runs every script). `make notebooks` sets it to
0: full size, every cell as a teacher runs it.

The notebooks run as many at a time as the machine has cores (at most four), each in
its own kernel, from threads of this process: much of a notebook's time is one kernel's
Python (imports, figures) while a core sits idle, so on 2 cores the 16 notebooks take
about 60 s two at a time against 85 s one by one. Each test waits for its own notebook.
"""

from __future__ import annotations

import ast
import os
import re
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from minipar.exercises import regions
from tests.harness.mpi import ROOT
from tests.teaching.notebook_answers import ANSWERS

NOTEBOOKS = sorted((ROOT / "lessons").glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds; minipar.teaching.classroom kills its own MPI jobs sooner
AT_ONCE = max(1, min(4, len(os.sched_getaffinity(0))))  # notebooks running at a time
# an exercise's answer line: `left = right  # your ...` (right is `None` as handed out)
ANSWER_LINE = re.compile(r"^(?P<left>[A-Za-z_][\w, ]*?) = (?P<right>.+?)(?P<mark>\s+# your\b.*)$")


def code_cells(notebook: nbformat.NotebookNode) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


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


def with_answers(notebook: nbformat.NotebookNode, stem: str) -> nbformat.NotebookNode:
    """The notebook with each answer line's right side replaced by its solution
    (notebook_answers.py); lines without one are left as they are."""
    solutions = ANSWERS.get(stem, {})

    def solve(match: re.Match) -> str:
        right = solutions.get(match["left"], match["right"])
        return f"{match['left']} = {right}  {match['mark'].strip()}"

    for cell in code_cells(notebook):
        cell.source = "\n".join(ANSWER_LINE.sub(solve, line) for line in cell.source.split("\n"))
    return notebook


def execute(path: Path, answers: bool = False) -> nbformat.NotebookNode:
    """Run one notebook top to bottom in a fresh kernel (cwd: its folder); raises
    CellExecutionError, naming the cell, if any cell fails, with the kernel's own stderr
    as a note (kept out of the suite's output: the kernel outlives any one test's capture).
    With `answers` the exercises' solutions are written in first (`with_answers`), else
    they run as handed out (unsolved). With $MINIPAR_NOTEBOOKS_OUT the executed notebook
    (up to a failing cell) is written there for a teacher."""
    notebook = nbformat.read(path, as_version=4)
    if answers:
        with_answers(notebook, path.stem)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    out = os.environ.get("MINIPAR_NOTEBOOKS_OUT")
    try:
        with tempfile.TemporaryFile("w+") as kernel_stderr:
            try:
                client.execute(stderr=kernel_stderr)
            except Exception as error:
                kernel_stderr.seek(0)
                error.add_note("the kernel's stderr:\n" + kernel_stderr.read()[-4000:])
                raise
    finally:
        if out:
            folder = Path(out) if Path(out).is_absolute() else ROOT / out
            folder.mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, folder / path.name)
    return notebook


@pytest.fixture(scope="module")
def executions(request) -> dict[Path, Future]:
    """Every notebook this session selected, started AT_ONCE at a time, in collection
    order; the kernels inherit MINIPAR_QUICK=1 unless it is set already. The exercises
    run solved, except with $MINIPAR_NOTEBOOKS_OUT: those notebooks are for the book
    and the class, which get them unsolved."""
    chosen = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_notebook_runs_and_draws"]
    with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(AT_ONCE) as pool:
        if "MINIPAR_QUICK" not in os.environ:
            patch.setenv("MINIPAR_QUICK", "1")
        solved = not os.environ.get("MINIPAR_NOTEBOOKS_OUT")
        futures = {path: pool.submit(execute, path, solved) for path in chosen}
        yield futures
        for future in futures.values():   # stopped early (-x): drop what has not started
            future.cancel()


def drawing_problems(path: Path, notebook: nbformat.NotebookNode) -> list[str]:
    """What an executed notebook failed to draw: a drawing cell (`display(plots.x(..))`,
    load_plots, ...) without a picture in its outputs, or no drawing cell at all."""
    drawing = [cell for cell in code_cells(notebook)
               if "display(" in cell.source and "plots." in cell.source]
    problems = [f"{path.name}: no figure from {cell.source[:80]!r}" for cell in drawing
                if not any("image/png" in out.get("data", {}) for out in cell.outputs)]
    return problems + ([] if drawing else [f"{path.name} draws no figure"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_and_draws(path, executions):
    notebook = executions[path].result()
    assert drawing_problems(path, notebook) == []
    answers = [cell for cell in code_cells(notebook) if cell.source.startswith("# Your answer")]
    assert answers or path.stem != "exercises", "exercises.ipynb: no cell for an answer"
    for cell in answers:
        first_run_fails_as_the_stub(cell)
    expected = "not written yet" if os.environ.get("MINIPAR_NOTEBOOKS_OUT") else "check passed"
    for cell in code_cells(notebook):
        if any(ANSWER_LINE.match(line) for line in cell.source.splitlines()):
            printed = "".join(out.get("text", "") for out in cell.outputs)
            assert expected in printed, (path.name, cell.source[:120], printed[-500:])


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


def first_run_fails_as_the_stub(cell: nbformat.NotebookNode) -> None:
    """An answer cell's text (its first string constant) is the stub of a region, as a
    syntax tree, and what the cell printed is the check failing on that stub."""
    written = next(node.value.value for node in ast.parse(cell.source).body
                   if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant))
    stubs = {regions.normalized(regions.stub_lines(region)) for region in regions.find_regions()}
    assert regions.normalized(written.splitlines()) in stubs, cell.source[:200]
    printed = "".join(out.get("text", "") for out in cell.outputs)
    assert ": FAILED" in printed and "NotImplementedError" in printed, printed
    assert "is left as the stub handed out" in printed and ": passed" not in printed, printed


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
    solved = [c.source for c in code_cells(with_answers(nbformat.read(path, as_version=4),
                                                        "14_mixed_precision"))]
    (i,) = [i for i, source in enumerate(handed_out) if source.startswith("S = None ")]
    exec(handed_out[i], {"np": np, "classroom": classroom})
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and printed.startswith("exercise 2: not written yet -- "
                                                           "write `S` in the line"), printed
    exec(solved[i], {"np": np, "classroom": classroom})
    assert "check passed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="^not yet: "):
        exec(handed_out[i].replace("S = None", "S = 2.0 ** 12"),
             {"np": np, "classroom": classroom})


def test_the_teachers_answer_cells_hold_todays_stubs():
    """exercises.ipynb hands out a stub as a student's first answer: it must be the stub
    `exercise start` writes today (an exercise's text changed -> its stub changed), found
    without running the notebook."""
    notebook = nbformat.read(ROOT / "lessons" / "exercises.ipynb", as_version=4)
    stubs = {regions.normalized(regions.stub_lines(region)) for region in regions.find_regions()}
    answers = [cell for cell in code_cells(notebook) if cell.source.startswith("# Your answer")]
    assert answers
    for cell in answers:
        written = next(node.value.value for node in ast.parse(cell.source).body
                       if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant))
        assert regions.normalized(written.splitlines()) in stubs, cell.source[:200]
