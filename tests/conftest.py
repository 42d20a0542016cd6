"""Shared fixtures: the single-process reference runs, computed once per config."""

from __future__ import annotations

import functools

import numpy as np

from minipar.run.reference import RunResult
from minipar.run.results import (
    TOLERANCE,
    mixed_tolerance,
    moved_difference,
    relative_difference,
)
from minipar.run.train import train_reference
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
