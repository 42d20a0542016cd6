"""Training: the entry points, the single-process reference and the run on a mesh.

What this file teaches: the outer loop. `train` checks a run's flags on every rank
alike, builds the mesh, applies every strategy to the model (compose/parallelize.py)
and takes `--steps` steps of mesh_step.py's `train_step`; `train_reference` runs the
same steps in one process with no communication (reference.py): the ground truth that
`--check` and the test suite compare every mesh against. --outer diloco runs its own
loops (diloco_train.py): both entry points hand such a run to them.

    mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --check
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from minipar import placement
from minipar.bugs import catalog
from minipar.checkpoint import save_load
from minipar.comm import trace, watchdog
from minipar.comm.mesh import AXES as MESH_AXES
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import parallelize
from minipar.core import fp8, nn, precision, routing
from minipar.core.optim import make_optimizer
from minipar.run import agreement, diloco_train, reference
from minipar.run.agreement import scaler_of
from minipar.run.mesh_step import finish, norms_of, train_step
from minipar.run.reference import RunResult, step_done
from minipar.settings import config, preflight
from minipar.settings.config import TrainConfig

if TYPE_CHECKING:  # dp_updater.py loads mpi4py.MPI; train_reference needs none
    from minipar.parallel.dp_updater import Updater


def problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """Every reason this run cannot start, empty if it can: the flags and the mesh
    (`config.problems`), then the bug `--inject-bug` names (`catalog.problems`: unknown, or
    for a strategy this mesh does not use), then the `--save`/`--resume` folders
    (`save_load.problems`: reads the manifest and checksums); with sound flags, also a
    size this machine cannot hold or a product that is no count (preflight.py). `cfg`
    must be resolved. No communication: every rank reaches the same list alone, before
    the first step."""
    out = config.problems(cfg, world_size)
    if not out:
        out += preflight.overflow_problems(cfg) + preflight.memory_problems(cfg, world_size)
    if cfg.inject_bug is not None and not config.size_problems(cfg, world_size):
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
    from minipar.comm.collectives import (
        Ledger,  # here: comm/collectives.py loads mpi4py.MPI, train_reference not
    )
    from minipar.parallel import fp8_scales

    mesh = Mesh(cfg.mesh_shape(), world, Ledger())
    try:  # overflow shows up as a DivergedError line, not as NumPy warnings burying it
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"), \
                placement.checking(cfg.check_placements,   # placement/__init__.py: on or off
                                   {axis: getattr(mesh, axis).size for axis in MESH_AXES}), \
                trace.recording(cfg.trace, mesh, cfg.as_json()), \
                precision.use(cfg.mixed, cfg.dtype,   # --mixed: 16-bit ops (precision.py)
                              fp8_scales.over_mesh(fp8.recipe_of(cfg), mesh)):  # --fp8
            chunks, updater, init, losses, start = start_on_mesh(cfg, mesh)
            timeline: list[dict] = []  # the pipeline's instructions of the last step, timed
            steps_ledger: list[dict] = []  # every step's ledger records, each with its "step"
            for step in range(start, cfg.steps):  # --steps is the total, resumed or not
                watchdog.doing(f"step {step + 1} of {cfg.steps}")  # named if a rank gets stuck
                timeline.clear()
                with trace.step(step + 1):   # --trace: one span per step
                    losses.append(train_step(cfg, mesh, chunks, updater, step, timeline))
                steps_ledger += [{"step": step + 1, **r} for r in mesh.ledger.records(mesh.rank)]
                if on_step is not None:
                    step_done(on_step, step, losses[-1], norms_of(updater), scaler_of(updater))
            watchdog.doing("the end of the run (gathering results, saving the checkpoint)")
            return finish(cfg, mesh, chunks, updater, losses, init, timeline, steps_ledger)
    finally:  # also when a step diverges: a sweep or a notebook builds many meshes
        mesh.free()


def start_on_mesh(cfg: TrainConfig, mesh: Mesh
                  ) -> tuple[list[nn.Model], Updater, dict, list[float], int]:
    """Before the first step, on a mesh already built: this rank's chunks and updater,
    the full initial parameters (on rank 0), the losses of the steps already taken (a
    resumed run reports all --steps of them) and the step to start from."""
    # --resume: the full arrays assembled from any mesh's shards, sliced below like init
    saved = save_load.load(cfg.resume) if cfg.resume else None
    full = saved.params if saved else nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)
    optimizer = make_optimizer(cfg.optimizer, cfg.lr, **cfg.optimizer_rule())
    chunks, updater = parallelize(cfg, mesh, full, optimizer)
    trace.instrument(optimizer, updater.memory)  # --trace: optimizer spans, bytes held
    params = [p for chunk in chunks for p in chunk.parameters()]
    # the model as built, read from `full` (ZeRO-3 has dropped p.data by now)
    init, _ = agreement.gather_full_params(mesh, params, cfg, values=full)
    # the saved optimizer state, cut as the updater keeps it (ZeRO: its flat slice)
    start = save_load.restore_optimizer(optimizer, params, saved, updater) if saved else 0
    if saved:  # sigmoid-bias: every block's b as saved (replicated: any mesh takes it whole)
        routing.set_bias_values(chunks, saved.manifest.get("router_bias", {}))
    if saved and scaler_of(updater) is not None and "loss_scaler" in saved.manifest:
        scaler_of(updater).load(saved.manifest["loss_scaler"])  # --mixed: S continues
    losses = list(saved.manifest.get("losses", [])) if saved else []
    return chunks, updater, init, losses, start
