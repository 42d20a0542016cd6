"""The checks made before the first step: memory, overflow, output folders (no MPI).

The closed-form parameter count is the model's own (`nn.canonical_shapes`); the
memory estimate refuses what the machine cannot hold, with the estimate in the
line; folders that are files, under files, empty or read-only are refused (the
read-only case on a real read-only tmpfs mount, where the machine allows one).

    python -m pytest tests/run/test_preflight.py
"""

from __future__ import annotations

import math
import os
import subprocess

import pytest

from minipar.core import nn
from minipar.settings import preflight
from minipar.settings.config import TrainConfig


@pytest.mark.parametrize("fields", [{}, {"layers": 3, "d_ff": 10, "classes": 7},
                                    {"model": "moe", "experts": 3, "expert_d_ff": 5},
                                    {"model": "gpt", "layers": 3, "seq_len": 7, "vocab": 11},
                                    {"model": "gpt-moe", "experts": 3, "expert_d_ff": 5}])
def test_the_closed_form_count_is_the_models(fields):
    cfg = TrainConfig(**fields).resolved(1)
    shapes = nn.canonical_shapes(cfg.model_config())
    assert preflight.parameter_count(cfg) == sum(math.prod(s) for s in shapes.values())


def test_memory_is_refused_with_the_estimate_and_allowed_when_it_fits():
    cfg = TrainConfig(optimizer="adam").resolved(2)
    need = preflight.rank_bytes(cfg)
    # the full model (init) + its parameters, gradients, m and v: 5 copies, and more
    assert need >= 5 * 8 * preflight.parameter_count(cfg)
    assert preflight.memory_problems(cfg, 2, total=2 * need) == []
    (line,) = preflight.memory_problems(cfg, 2, total=2 * need - 1)
    assert "GiB per rank" in line and "--d-model 64" in line and "\n" not in line
    huge = TrainConfig(d_model=10 ** 9).resolved(1)
    assert preflight.memory_problems(huge, 1)           # this machine, whatever it has


def test_a_capacity_that_is_no_count_is_refused():
    ok = TrainConfig(model="moe", capacity_factor=1e6).resolved(1)
    assert preflight.overflow_problems(ok) == []
    for factor in (1e308, 1e20):
        cfg = TrainConfig(model="moe", capacity_factor=factor).resolved(1)
        assert "--capacity-factor" in preflight.overflow_problems(cfg)[0]


def test_folders_that_cannot_take_files(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert preflight.folder_problems(tmp_path / "new" / "deeper") == []
    assert "empty" in preflight.folder_problems("")[0]
    assert "not a folder" in preflight.folder_problems(a_file)[0]
    assert "is a file" in preflight.folder_problems(a_file / "sub")[0]
    assert not list(tmp_path.glob(".minipar-probe-*"))   # the probe cleans up after itself


def test_a_read_only_mount_is_refused(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:   # root passes os.access on a read-only mount: the probe is what catches it
        assert "not writable (Read-only file system)" in preflight.folder_problems(
            mount / "ckpt")[0]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
