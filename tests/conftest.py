"""Shared fixtures: the single-process reference runs, computed once per config."""

from __future__ import annotations

import functools
import sys

import numpy as np

from minipar.run.results import (
    TOLERANCE,
    mixed_tolerance,
    moved_difference,
    relative_difference,
)
from minipar.run.train import RunResult, train_reference
from minipar.settings.config import TrainConfig

RTOL = TOLERANCE["float64"]


@functools.cache
def _reference(items: tuple) -> RunResult:
    return train_reference(TrainConfig(**dict(items)).resolved(1))


def reference(**fields: object) -> RunResult:
    """The single-process run of a config (cached: many meshes share one reference)."""
    mesh = ("dp", "tp", "pp", "ep", "schedule", "virtual", "zero", "sp", "cp", "cp_mode")
    fields = {k: v for k, v in fields.items() if k not in mesh}
    return _reference(tuple(sorted(fields.items())))


def assert_equivalent(run: dict, ref: RunResult, rtol: float = RTOL, label: str = "") -> None:
    """A parallel run's losses and final parameters equal the reference (float64, 1e-9):
    `results.relative_difference` (max |a - b| / max |b|) at most rtol, per tensor, the
    measure of `--check`; a parameter's scale is taken as at least 1e-12."""
    losses, expected = np.asarray(run["losses"]), np.asarray(ref.losses)
    assert losses.shape == expected.shape, label
    assert relative_difference(losses, expected) <= rtol, (
        f"{label}: losses {losses} != {expected}")
    assert set(run["final"]) == set(ref.final), label
    for name, value in ref.final.items():
        rel = relative_difference(run["final"][name], value, floor=1e-12)
        assert rel <= rtol, f"{label}: {name} differs by {rel:.3e} (relative)"


def assert_within_mixed_tolerance(run: dict, fields: dict, world: int, label: str = "") -> None:
    """A --mixed run against one process in the same precision: losses and the
    parameters' movement from init within run/results.py's derived tolerance."""
    ref = reference(**fields)
    loss_tol, param_tol = mixed_tolerance(TrainConfig(**fields).resolved(world))
    loss_rel = relative_difference(run["losses"], ref.losses)
    moved, where = moved_difference(run["final"], ref.final, ref.init)
    said = f"{fields.get('mixed')} {label}"
    assert loss_rel <= loss_tol, f"{said}: losses {loss_rel:.3g} > {loss_tol:.3g}"
    assert moved <= param_tol, f"{said}: {where} {moved:.3g} > {param_tol:.3g}"


def pytest_collection_modifyitems(items: list) -> None:
    """The notebook runs' tests go last: the longer the rest of the suite, the more of the
    background runner's work is done by the time they read it (tests/harness/background.py)."""
    items.sort(key=lambda item: getattr(item, "originalname", "") == "test_notebook_runs_and_draws")


def pytest_collection_finish(session) -> None:
    """The selected notebooks start running in the background, beside the suite
    (tests/teaching/test_notebooks.py, tests/harness/background.py)."""
    paths = [item.callspec.params["path"] for item in session.items
             if getattr(item, "originalname", "") == "test_notebook_runs_and_draws"]
    if paths and not session.config.option.collectonly:
        from tests.teaching import test_notebooks

        paths = [path for path in paths if path.stem not in test_notebooks.FOREGROUND]
        if paths:
            test_notebooks.start_background(paths)


def pytest_sessionfinish(session) -> None:
    notebooks = sys.modules.get("tests.teaching.test_notebooks")
    if notebooks is not None:
        notebooks.stop_background()


def pytest_terminal_summary(terminalreporter) -> None:
    notebooks = sys.modules.get("tests.teaching.test_notebooks")
    if notebooks is not None and notebooks.background_summary():
        terminalreporter.write_line(notebooks.background_summary())
