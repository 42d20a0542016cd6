"""Shared fixtures: the single-process reference runs, computed once per config."""

from __future__ import annotations

import functools

import numpy as np

from minipar.config import TrainConfig
from minipar.train import RunResult, train_reference

RTOL = 1e-9


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
    max |a - b| <= rtol * max |b|, per tensor."""
    losses, expected = np.asarray(run["losses"]), np.asarray(ref.losses)
    assert losses.shape == expected.shape, label
    assert np.max(np.abs(losses - expected)) <= rtol * np.max(np.abs(expected)), (
        f"{label}: losses {losses} != {expected}")
    assert set(run["final"]) == set(ref.final), label
    for name, value in ref.final.items():
        diff = np.max(np.abs(run["final"][name] - value))
        assert diff <= rtol * max(np.max(np.abs(value)), 1e-12), (
            f"{label}: {name} differs by {diff:.3e}")
