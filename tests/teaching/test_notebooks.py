"""The classroom notebooks run headless, from the first cell to the last, and draw.

Each notebook in lessons/ is executed with nbclient in a fresh kernel (cwd
lessons/, a per-cell timeout), as a teacher would run it: its cells start real
MPI ranks, as ipyparallel engines or as `mpiexec` jobs (minipar/teaching/classroom.py).
A cell that raises fails the test with the cell and its traceback. The
repository keeps the notebooks without outputs.

`make notebooks` runs this file with $MINIPAR_NOTEBOOKS_OUT=build/notebooks: each
executed notebook, outputs and figures included, is written there for a teacher
to read (a notebook that fails is written too, up to the failing cell).

The tests run the notebooks with $MINIPAR_QUICK=1 (unless it is set already): a
notebook that reads it (its first cells say what it changes) does less of the same
work, and says so in what it prints. `make notebooks` sets it to 0: full size.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.harness.mpi import ROOT

NOTEBOOKS = sorted((ROOT / "lessons").glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds; minipar.teaching.classroom kills its own MPI jobs sooner


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_and_draws(path, monkeypatch):
    if "MINIPAR_QUICK" not in os.environ:  # the kernel inherits the environment
        monkeypatch.setenv("MINIPAR_QUICK", "1")
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    out = os.environ.get("MINIPAR_NOTEBOOKS_OUT")
    try:
        client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    finally:
        if out:  # the executed notebook, kept for a teacher (`make notebooks`)
            folder = Path(out) if Path(out).is_absolute() else ROOT / out
            folder.mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, folder / path.name)
    drawing = [cell for cell in code_cells(notebook)   # display(plots.x(..)), load_plots, ...
               if "display(" in cell.source and "plots." in cell.source]
    for cell in drawing:
        images = [out for out in cell.outputs if "image/png" in out.get("data", {})]
        assert len(images) >= 1, f"{path.name}: no figure from {cell.source[:80]!r}"
    assert drawing, f"{path.name} draws no figure"


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
