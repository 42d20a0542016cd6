"""Running a classroom notebook headless and judging what it did (`make course`).

A notebook in lessons/ runs top to bottom in a fresh kernel (nbclient; cwd lessons/,
a per-cell timeout), as handed out: its exercises unsolved, so each exercise cell prints
"not written yet" (minipar.teaching.classroom.answered) and the notebook reaches its last
cell. Right after each exercise cell the same kernel runs that cell twice more, outputs
kept apart from the notebook: once with its solution written in
(tests/teaching/notebook_answers.py), which must print `check passed` -- the check is
passable on what this very run measured --, and once more as handed out, so every later
cell sees the kernel a class has. The notebook a teacher reads (and the book is built
from) holds the handed-out run alone.

`problems` lists what a run did wrong: a drawing cell without a picture, an exercise cell
that did not wait for its answer, a solution its check did not pass, a student's answer
cell (exercises.ipynb) that is not today's stub or whose first run did not fail on it.
"""

from __future__ import annotations

import ast
import re
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from minipar.exercises import regions
from tests.teaching.notebook_answers import ANSWERS

CELL_TIMEOUT = 300  # seconds; minipar.teaching.classroom kills its own MPI jobs sooner
# an exercise's answer line: `left = right  # your ...` (right is `None` as handed out)
ANSWER_LINE = re.compile(r"^(?P<left>[A-Za-z_][\w, ]*?) = (?P<right>.+?)(?P<mark>\s+# your\b.*)$")


def code_cells(notebook: nbformat.NotebookNode) -> list:
    """The notebook's code cells, in order."""
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def is_exercise(source: str) -> bool:
    """Does this cell hold an answer line (`name = None  # your formula`)?"""
    return any(ANSWER_LINE.match(line) for line in source.splitlines())


def solved(source: str, stem: str) -> str:
    """The cell's source with each answer line's right side replaced by its solution
    (notebook_answers.py); lines without one are left as they are."""
    solutions = ANSWERS.get(stem, {})

    def solve(match: re.Match) -> str:
        right = solutions.get(match["left"], match["right"])
        return f"{match['left']} = {right}  {match['mark'].strip()}"

    return "\n".join(ANSWER_LINE.sub(solve, line) for line in source.split("\n"))


def printed(cell: nbformat.NotebookNode) -> str:
    """What a cell printed (its stream outputs, joined)."""
    return "".join(out.get("text", "") for out in cell.outputs)


def answer_names(source: str) -> list[str]:
    """The left sides of a cell's answer lines (`tp_wire`, `calls, elements`)."""
    return [match["left"] for line in source.splitlines() if (match := ANSWER_LINE.match(line))]


class ClassroomClient(NotebookClient):
    """nbclient's client, running each exercise cell twice more right after it ran as
    handed out: solved (what it printed kept in `solved_runs`, by cell index), with the
    answers of the exercises before it solved too (a later exercise may build on an
    earlier one); then as handed out again, every answer back to None. The kernel goes
    on as a class's would, and the notebook keeps its handed-out run and In [n] numbers.
    The solved values wait in the kernel's `__solved__` between the extra runs."""

    def __init__(self, notebook: nbformat.NotebookNode, stem: str, **kwargs: object) -> None:
        super().__init__(notebook, **kwargs)
        self.stem = stem
        self.solved_runs: dict[int, str] = {}
        self.earlier: list[str] = []   # answer names of the exercises run so far

    async def async_execute_cell(self, cell: nbformat.NotebookNode, cell_index: int,
                                 execution_count: int | None = None,
                                 store_history: bool = True) -> nbformat.NotebookNode:
        """Run the cell; an exercise cell then solved, then as handed out again."""
        cell = await super().async_execute_cell(cell, cell_index, execution_count,
                                                store_history)
        if cell.cell_type != "code" or not is_exercise(cell.source):
            return cell
        mine = answer_names(cell.source)
        fetch = [f"{name} = __solved__[{name!r}]" for name in self.earlier]
        keep = [f"__solved__[{name!r}] = {name}" for name in mine]
        unset = [f"{name} = {', '.join(['None'] * len(name.split(',')))}"
                 for name in self.earlier]
        runs = {"solved": "\n".join(["__solved__ = globals().get('__solved__', {})", *fetch,
                                      solved(cell.source, self.stem), *keep]),
                "handed out": "\n".join([cell.source, *unset])}
        for what, source in runs.items():
            extra = nbformat.v4.new_code_cell(source)
            await super().async_execute_cell(extra, cell_index, store_history=False)
            self.code_cells_executed -= 1   # not a cell of the notebook: no In [n]
            if what == "solved":
                self.solved_runs[cell_index] = printed(extra)
        self.nb.cells[cell_index] = cell   # nbclient put the last extra run there
        self.earlier += mine
        return cell


def execute(path: Path, out: Path | None = None) -> tuple[nbformat.NotebookNode, dict[int, str]]:
    """Run one notebook as handed out, top to bottom in a fresh kernel (cwd: its folder),
    each exercise also solved (`ClassroomClient`); raises CellExecutionError, naming the
    cell, if any cell fails, with the kernel's own stderr as a note. The executed notebook
    (up to a failing cell) is written into the folder `out` when given. Returns it and
    what each exercise cell printed solved."""
    notebook = nbformat.read(path, as_version=4)
    client = ClassroomClient(notebook, path.stem, timeout=CELL_TIMEOUT, kernel_name="python3",
                             resources={"metadata": {"path": str(path.parent)}})
    try:
        with tempfile.TemporaryFile("w+") as kernel_stderr:
            try:
                client.execute(stderr=kernel_stderr)
            except Exception as error:
                kernel_stderr.seek(0)
                error.add_note("the kernel's stderr:\n" + kernel_stderr.read()[-4000:])
                raise
    finally:
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, out / path.name)
    return notebook, client.solved_runs


def drawing_problems(path: Path, notebook: nbformat.NotebookNode) -> list[str]:
    """What an executed notebook failed to draw: a drawing cell (`display(plots.x(..))`,
    load_plots, ...) without a picture in its outputs, or no drawing cell at all."""
    drawing = [cell for cell in code_cells(notebook)
               if "display(" in cell.source and "plots." in cell.source]
    problems = [f"{path.name}: no figure from {cell.source[:80]!r}" for cell in drawing
                if not any("image/png" in out.get("data", {}) for out in cell.outputs)]
    return problems + ([] if drawing else [f"{path.name} draws no figure"])


def stub_problem(cell: nbformat.NotebookNode) -> str | None:
    """A student's answer cell (it begins `# Your answer`): its text (the first string
    constant) must be the stub of a region as `exercise start` hands it out today, and
    what its run printed the check failing on that stub, never passing."""
    written = next(node.value.value for node in ast.parse(cell.source).body
                   if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant))
    stubs = {regions.normalized(regions.stub_lines(region)) for region in regions.find_regions()}
    if regions.normalized(written.splitlines()) not in stubs:
        return f"not today's stub: {cell.source[:200]!r}"
    said = printed(cell)
    if not (": FAILED" in said and "NotImplementedError" in said
            and "is left as the stub handed out" in said and ": passed" not in said):
        return f"its first run did not fail on the stub: {said[-300:]!r}"
    return None


def problems(path: Path, notebook: nbformat.NotebookNode, solved_runs: dict[int, str]
             ) -> list[str]:
    """Everything wrong with one executed notebook (empty: it is fine)."""
    found = drawing_problems(path, notebook)
    answers = [c for c in code_cells(notebook) if c.source.startswith("# Your answer")]
    if path.stem == "exercises" and not answers:
        found.append("exercises.ipynb: no cell for an answer")
    found += [f"{path.name}: {said}" for cell in answers if (said := stub_problem(cell))]
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or not is_exercise(cell.source):
            continue
        if "not written yet" not in printed(cell):
            found.append(f"{path.name}: handed out, {cell.source[:80]!r} did not wait for "
                         f"its answer: {printed(cell)[-300:]!r}")
        if "check passed" not in solved_runs.get(index, ""):
            found.append(f"{path.name}: solved, {cell.source[:80]!r} did not pass: "
                         f"{solved_runs.get(index, '(not run)')[-500:]!r}")
    return found
