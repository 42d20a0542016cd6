"""Training: the entry points, the check of a run's flags, the single-process reference.

What this file teaches: where a run starts. `train` checks a run's flags on every rank
alike and hands the run to mesh_step.py's `train_on_mesh` (the mesh built, every
strategy applied, `--steps` steps of `train_step`); `python -m minipar train` checks
them itself, then calls that loop directly. `train_reference` runs the same steps in
one process with no communication (reference.py): the ground truth that `--check` and
the test suite compare every mesh against. --outer diloco runs its own loops
(diloco_train.py): both entry points hand such a run to them.

    mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --check
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from minipar.bugs import catalog
from minipar.checkpoint import save_load
from minipar.core import fp8, precision
from minipar.run import diloco_train, mesh_step, reference
from minipar.run.reference import RunResult
from minipar.settings import config, preflight, validation
from minipar.settings.config import TrainConfig


def problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """Every reason this run cannot start, empty if it can: the flags and the mesh
    (`validation.problems`), then the bug `--inject-bug` names (`catalog.problems`: unknown, or
    for a strategy this mesh does not use), then the `--save`/`--resume` folders
    (`save_load.problems`: reads the manifest and checksums); with sound flags, also a
    size this machine cannot hold or a product that is no count (preflight.py). `cfg`
    must be resolved. No communication: every rank reaches the same list alone, before
    the first step."""
    out = validation.problems(cfg, world_size)
    if not out:
        out += preflight.overflow_problems(cfg) + preflight.memory_problems(cfg, world_size)
    if cfg.inject_bug is not None and not validation.size_problems(cfg, world_size):
        out += catalog.problems(cfg)
    if not out and (cfg.save or cfg.resume):  # --outer diloco: K + 1 checkpoints
        out += save_load.diloco_problems(cfg) if cfg.outer else save_load.problems(cfg)
    if not out and cfg.trace is not None:  # a file, read-only, another run's trace
        out += preflight.trace_problems(cfg.trace)
    return out


# ------------------------------------------------------------ the reference
def train_reference(cfg: TrainConfig, on_step: Callable[[int, float], None] | None = None
                    ) -> RunResult:
    """Train with one process: the ground truth for every parallel run.

    Gradient accumulation: each microbatch's loss is scaled by 1/M and its
    gradients add up in `.grad`; one optimizer step follows. With --mixed the same
    steps in 16 bits (core/precision.py): master copies updated, the loss scaled by S.
    """
    body = diloco_train.train_diloco_reference if cfg.outer == "diloco" \
        else reference.train_one_process
    if not cfg.mixed:
        return body(cfg, on_step)
    # fp16 overflow is expected (the loss scaler skips that step): no warnings for it
    with precision.use(cfg.mixed, cfg.dtype, fp8.recipe_of(cfg)), \
            np.errstate(over="ignore", invalid="ignore"):
        return body(cfg, on_step)


# ----------------------------------------------------------- the mesh run
def train(cfg: TrainConfig, world: object, on_step: Callable[[int, float], None] | None = None
          ) -> RunResult:
    """Train `cfg` on the mesh it describes over the `world` communicator.

    `cfg` must be resolved. Its `problems` are checked here too, on every rank alike
    before any communication (lessons and notebooks call this without the command line):
    the first is raised as a ConfigError. Every rank returns the losses; rank 0 also the
    full parameters (init and final) and the ledger of the last step from every rank.
    """
    refusals = problems(cfg, world.Get_size())
    if refusals:
        raise config.ConfigError(refusals[0] + (f" (and {len(refusals) - 1} more)"
                                                if len(refusals) > 1 else ""))
    if cfg.inject_bug:  # lesson 08: this same run with one piece swapped for a broken one
        with catalog.injected(cfg.inject_bug):
            return train(replace(cfg, inject_bug=None), world, on_step)
    if cfg.outer == "diloco":  # every dp replica a worker of its own (parallel/diloco.py)
        return diloco_train.train_workers(cfg, world, on_step)
    return mesh_step.train_on_mesh(cfg, world, on_step)
