"""The classroom notebooks run headless, from the first cell to the last, and draw.

Each notebook in lessons/ is executed with nbclient in a fresh kernel (cwd
lessons/, a per-cell timeout), as a teacher would run it: its cells start real
MPI ranks, as ipyparallel engines or as `mpiexec` jobs (minipar/teaching/classroom.py).
A cell that raises fails the test with the cell and its traceback. The
repository keeps the notebooks without outputs.

`make notebooks` runs this file with $MINIPAR_NOTEBOOKS_OUT=build/notebooks: each
executed notebook, outputs and figures included, is written there for a teacher
to read (a notebook that fails is written too, up to the failing cell).

A cell that holds a student's answer (it begins `# Your answer`, exercises.ipynb)
must start as a stub `exercise start` hands out, and its first run must print the
check failing on it, the region named as left as the stub: never passing.

The tests run the notebooks with $MINIPAR_QUICK=1 (unless it is set already): a
notebook that reads it (its first cells say what it changes) does less of the same
work, and says so in what it prints; a cell that runs a lesson script prints a line
instead (tests/teaching/test_lessons.py runs every script). `make notebooks` sets it to
0: full size, every cell as a teacher runs it.

The notebooks run in the background (tests/harness/background.py), one after another
in one process started when the session's tests are collected (`start_background`,
tests/conftest.py), on the core the rest of the suite leaves idle; each test waits for
its notebook's result, read from the executed notebook the runner writes. The runner
is this file: `python -m tests.teaching.test_notebooks OUT NOTEBOOK...`.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from minipar.exercises import regions
from tests.harness.background import Background
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


def execute(path: Path) -> tuple[nbformat.NotebookNode, str]:
    """Run a notebook in a fresh kernel (cwd lessons/): the executed notebook and, if a
    cell raised, nbclient's account of it (the cell and its traceback), else ''. With
    $MINIPAR_NOTEBOOKS_OUT set, the executed notebook is also kept there for a teacher
    (up to the failing cell)."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    error = ""
    try:
        client.execute()
    except CellExecutionError as failed:  # names the cell and carries its traceback
        error = str(failed)
    except Exception:  # noqa: BLE001 - a kernel that died or timed out: the test's to report
        error = traceback.format_exc()
    out = os.environ.get("MINIPAR_NOTEBOOKS_OUT")
    if out:
        folder = Path(out) if Path(out).is_absolute() else ROOT / out
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, folder / path.name)
    return notebook, error


def run_all(out: Path, paths: list[Path]) -> None:
    """The background runner: each notebook executed in turn, written to OUT/<name> with
    its error beside it (OUT/<stem>.error); OUT/<stem>.done, written last, says it is
    there to read."""
    os.environ.setdefault("MINIPAR_QUICK", "1")  # the kernels inherit the environment
    for path in paths:
        started = time.monotonic()
        notebook, error = execute(path)
        print(f"{path.name}: {time.monotonic() - started:.1f} s"
              + (", FAILED" if error else ""), flush=True)   # the runner's log
        nbformat.write(notebook, out / path.name)
        (out / f"{path.stem}.error").write_text(error)
        (out / f"{path.stem}.done").touch()


_BACKGROUND: dict[str, object] = {}
# run where their test is, not in the background, for their short wall-clock deadlines,
# which a stopped job's clock keeps counting (tests/harness/background.py): 15_hangs's jobs
# end by a 2 s watchdog; 00 and 02 wait at most 120 s for their ipyparallel engines (in
# one full run, stopped four fifths of the time, one engine of four missed it)
FOREGROUND = {"00_collectives", "02_tensor_parallel", "15_hangs"}
RAN = re.compile(r"\S+\.ipynb: ([\d.]+) s")   # a line of the runner's log


def start_background(paths: list[Path]) -> None:
    """Start the runner for `paths` beside the suite, writing into a fresh temporary
    folder (tests/conftest.py calls this once the tests are collected);
    `stop_background` ends it with the session and removes the folder."""
    out = Path(tempfile.mkdtemp(prefix="minipar-notebooks-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job = Background([sys.executable, "-m", "tests.teaching.test_notebooks", str(out),
                      *map(str, paths)], env, out / "runner.log")
    _BACKGROUND.update(job=job, out=out, paths={path.stem for path in paths})


def background_summary() -> str:
    """One line for the end of the session: what the runner did and how long the suite
    kept it stopped ('' if it never started)."""
    if "out" not in _BACKGROUND:
        return ""
    if "summary" not in _BACKGROUND:
        log = _BACKGROUND["out"] / "runner.log"
        done = [RAN.match(line) for line in (log.read_text() if log.exists() else "").splitlines()]
        seconds = sum(float(ran.group(1)) for ran in done if ran)
        done = [ran for ran in done if ran]
        job = _BACKGROUND["job"]
        _BACKGROUND["summary"] = (
            f"notebooks in the background: {len(done)} of {len(_BACKGROUND['paths'])} run, "
            f"{seconds:.0f} s of wall clock, stopped {job.stopped_seconds:.0f} s of it while "
            "the suite ran processes of its own")
    return _BACKGROUND["summary"]


def stop_background() -> None:
    """End the runner (and its kernels) and remove its folder: the end of the session."""
    if "job" in _BACKGROUND:
        background_summary()
        _BACKGROUND.pop("job").close()
        shutil.rmtree(_BACKGROUND["out"], ignore_errors=True)


def result(path: Path) -> tuple[nbformat.NotebookNode, str]:
    """The executed notebook and its error: the background runner's, waited for, if it
    has this notebook; else executed here and now."""
    job = _BACKGROUND.get("job")
    if job is None or path.stem not in _BACKGROUND["paths"]:
        return execute(path)
    out = _BACKGROUND["out"]
    if not job.wait_for(out / f"{path.stem}.done", timeout=CELL_TIMEOUT * 4):
        log = (out / "runner.log").read_text()[-4000:]
        pytest.fail(f"{path.name}: the background runner ended or stalled before it "
                    f"(stopped {job.stopped_seconds:.0f} s while the suite ran jobs)\n{log}")
    error = (out / f"{path.stem}.error").read_text()
    if error:
        error += (f"\n(run in the background; stopped {job.stopped_seconds:.0f} s in all "
                  "while the suite ran its own processes)")
    return nbformat.read(out / path.name, as_version=4), error


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_and_draws(path, monkeypatch):
    if "MINIPAR_QUICK" not in os.environ:  # the kernel inherits the environment
        monkeypatch.setenv("MINIPAR_QUICK", "1")
    notebook, error = result(path)
    if error:
        pytest.fail(f"{path.name}: a cell failed\n{error}", pytrace=False)
    drawing = [cell for cell in code_cells(notebook)   # display(plots.x(..)), load_plots, ...
               if "display(" in cell.source and "plots." in cell.source]
    for cell in drawing:
        images = [out for out in cell.outputs if "image/png" in out.get("data", {})]
        assert len(images) >= 1, f"{path.name}: no figure from {cell.source[:80]!r}"
    assert drawing, f"{path.name} draws no figure"
    answers = [cell for cell in code_cells(notebook) if cell.source.startswith("# Your answer")]
    assert answers or path.stem != "exercises", "exercises.ipynb: no cell for an answer"
    for cell in answers:
        first_run_fails_as_the_stub(cell)


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


if __name__ == "__main__":
    run_all(Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]])
