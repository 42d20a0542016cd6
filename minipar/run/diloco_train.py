"""DiLoCo's two runs: K workers on the mesh, and the same rule in one process.

What this file teaches: --outer diloco (parallel/diloco.py; docs/design.md, "DiLoCo")
as loops. On the mesh (`train_workers`) each dp coordinate's ranks are a worker, a mesh
of its own with dp = 1 that takes plain `train_step`s (mesh_step.py) on its rows of every
step's batch; after each inner step the fragments due take their outer step (one
Allreduce over dp each). In one process (`train_diloco_reference`) the same rule is
written out plainly: K one-process workers (reference.py's `reference_step`) and the
outer Nesterov step on theta. run/train.py's `train` and `train_reference`, and the
train command, call these when the flags say --outer diloco.

    mpiexec -n 2 python -m minipar train --dp 2 --outer diloco --inner-steps 2 --check
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from minipar.checkpoint import save_load
from minipar.comm import watchdog
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import parallelize
from minipar.core import fp8, nn, precision
from minipar.core.data import rank_rows
from minipar.core.optim import make_optimizer
from minipar.core.shards import held_parts
from minipar.run import agreement
from minipar.run.agreement import scaler_of
from minipar.run.mesh_step import finish, norms_of, train_step
from minipar.run.reference import (
    RunResult,
    build_reference,
    reference_step,
    step_batch,
    step_done,
)
from minipar.settings import config
from minipar.settings.config import TrainConfig

if TYPE_CHECKING:  # dp_updater.py loads mpi4py.MPI; train_reference needs none
    # (run/train.py imports this file and runs train_reference without MPI)
    from minipar.parallel.dp_updater import Updater


def train_diloco_reference(cfg: TrainConfig, on_step: Callable[[int, float], None] | None
                            ) -> RunResult:
    """--outer diloco in one process, written as its definition (docs/design.md, "DiLoCo"):
    K = dp workers, each a one-process run (its own model, inner optimizer, masters, loss
    scaler) on its rows of every step's global batch (DP's rows, `rank_rows`); the step's
    loss is the workers' mean. After inner step s, fragment p (blocks [p L/P, (p+1) L/P),
    the rest in fragment 0) takes its outer step if s = p H/P + nH (n >= 1): Delta = theta
    - mean_k theta_k, v = Delta (first) or mu v + Delta, theta -= eta (Delta + mu v), every
    worker restarts from theta. Returns theta as `final`; worker 0's norms and scaler."""
    K, H, P, L = cfg.dp, cfg.inner_steps, cfg.fragments, cfg.layers
    eta, mu = cfg.outer_lr, cfg.outer_momentum
    full = nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)
    theta = {name: a.copy() for name, a in full.items()}
    v = {name: np.zeros_like(a) for name, a in full.items()}
    started = [False] * P
    workers = []   # (model, inner optimizer, {name: what it updates}, scaler, norms)
    for _ in range(K):
        model = build_reference(cfg, {name: a.copy() for name, a in full.items()})
        params = model.parameters()
        held = {p.name: p.data for p in params}
        if cfg.mixed:  # the optimizer updates the masters; each p.data a 16-bit copy
            for p in params:
                p.data = precision.to_low(p.data)
        workers.append((model, make_optimizer(cfg.optimizer, cfg.lr, **cfg.optimizer_rule()),
                        held, precision.make_scaler(cfg.mixed, cfg.loss_scale,
                                                    cfg.loss_scale_window), []))

    def fragment(name: str) -> int:
        block = re.match(r"blocks\.(\d+)\.", name)
        return 0 if block is None else int(block.group(1)) // (L // P)
    losses = []
    for step in range(cfg.steps):
        x, y = step_batch(cfg, step)
        total = 0.0
        for k, (model, optimizer, held, scaler, norms) in enumerate(workers):
            rows = rank_rows(cfg.batch, cfg.microbatches, K, k)
            masters = list(held.values()) if cfg.mixed else None
            total += reference_step(cfg, model, optimizer, masters, scaler, norms,
                                    x[rows], y[rows])
        losses.append(total / K)
        for p in range(P):
            offset = p * H // P
            if step + 1 < offset + H or (step + 1 - offset) % H:
                continue
            for name in (n for n in theta if fragment(n) == p):
                delta = theta[name] - sum(w[2][name] for w in workers) * (1.0 / K)
                v[name] = mu * v[name] + delta if started[p] else delta
                theta[name] = theta[name] - eta * (delta + mu * v[name])
                for w in workers:
                    w[2][name][...] = theta[name]
            started[p] = True
            for model, _, held, *_ in workers:  # --mixed: 16-bit copies cast anew
                for param in model.parameters() if cfg.mixed else ():
                    param.data = precision.to_low(held[param.name])
        if on_step is not None:
            step_done(on_step, step, losses[-1], workers[0][4],
                      workers[0][3] if cfg.mixed else None)
    return RunResult(losses, full, theta, extras={"gnorms": workers[0][4],
                                                  "loss_scale": workers[0][3].scale,
                                                  "skipped": workers[0][3].skipped})


def train_workers(cfg: TrainConfig, world: object,
                  on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """--outer diloco on the mesh (parallel/diloco.py): each dp coordinate's ranks are a
    worker, a mesh of its own with dp = 1 training on its rows of every step's batch
    (`rank_rows`, DP's rows) with no dp traffic; after each inner step the outer step of
    the fragments due (one Allreduce of their parameters over dp each). The step's loss
    is the workers' mean (one scalar Allreduce over dp, outside the ledger). Returns as
    `train` does, with theta as `final`, the whole world's ledger of the last step, and
    `extras["ledger_steps"]` (every step's) and `extras["fragment_sizes"]` (each rank's
    elements of each fragment: the ledger formula's input)."""
    from mpi4py import MPI  # here: train_reference runs without it

    from minipar.comm.collectives import Ledger  # here: loads mpi4py.MPI
    from minipar.parallel import diloco, fp8_scales

    ledger = Ledger()
    mesh, dp = diloco.worker_groups(cfg.mesh_shape(), world, ledger)
    inner = config.worker_config(cfg)
    rank, k = world.Get_rank(), cfg.mesh_shape().coords(world.Get_rank())["dp"]
    rows = rank_rows(cfg.batch, cfg.microbatches, cfg.dp, k)
    # --resume: theta and v from the outer part, this worker's own state from its part
    parts = save_load.diloco_folders(cfg.resume, cfg.dp) if cfg.resume else None
    saved = save_load.load(parts[f"worker-{k}"]) if parts else None
    saved_outer = save_load.load(parts["outer"]) if parts else None
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"), \
                precision.use(cfg.mixed, cfg.dtype,
                              fp8_scales.over_mesh(fp8.recipe_of(cfg), mesh)):
            full = saved.params if saved else \
                nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)
            optimizer = make_optimizer(cfg.optimizer, cfg.lr, **cfg.optimizer_rule())
            chunks, updater = parallelize(inner, mesh, full, optimizer)
            params = updater.params
            init, _ = agreement.gather_full_params(
                mesh, params, inner, values=saved_outer.params if saved_outer else full)
            outer = diloco.OuterNesterov(
                params, updater.my_slices(),
                lambda: updater.precision.refresh(updater.masters, [p.data for p in params]),
                dp, cfg.layers, cfg.inner_steps, cfg.fragments, cfg.outer_lr,
                cfg.outer_momentum)
            start = 0
            if saved:
                start = save_load.restore_optimizer(optimizer, params, saved, updater)
                outer.restore(held_parts(params, saved_outer.params),
                              held_parts(params, saved_outer.state["v"]), start)
                if scaler_of(updater) is not None and "loss_scaler" in saved.manifest:
                    scaler_of(updater).load(saved.manifest["loss_scaler"])
            losses = list(saved_outer.manifest.get("losses", [])) if saved_outer else []
            steps_ledger: list[dict] = []
            timeline: list[dict] = []
            for step in range(start, cfg.steps):
                watchdog.doing(f"step {step + 1} of {cfg.steps}")
                timeline.clear()
                local = train_step(inner, mesh, chunks, updater, step, timeline,
                                   step_batch(cfg, step, rows))
                outer.after_inner_step(step + 1)   # the fragments due: Allreduce over dp
                steps_ledger += [{"step": step + 1, **r} for r in ledger.records(rank)]
                ledger.enabled = False   # the workers' mean loss is no training traffic
                mean = np.array([local])
                dp.Allreduce(MPI.IN_PLACE, mean)
                ledger.enabled = True
                losses.append(float(mean[0]) / cfg.dp)
                if on_step is not None:
                    step_done(on_step, step, losses[-1], norms_of(updater),
                              scaler_of(updater))
            last = ledger.records(rank)
            ledger.enabled = False
            if cfg.save:   # each worker its part, worker 0 also theta and v
                save_workers(cfg, k, mesh, updater, optimizer, outer, losses)
            outer.use_theta()   # final.npz: theta, each fragment's after its last outer step
            result = finish(inner, mesh, chunks, updater, losses, init, timeline)
            everyone = world.gather((last, steps_ledger, outer.fragment_sizes()), root=0)
    finally:
        mesh.free()
        dp.comm.Free()
    if everyone is not None:
        result.ledger = [r for mine, _, _ in everyone for r in mine]
        result.extras["ledger_steps"] = [r for _, steps, _ in everyone for r in steps]
        result.extras["fragment_sizes"] = [sizes for _, _, sizes in everyone]
    result.extras["first_step"] = start + 1   # a resumed run's first (ledger_steps from it)
    return result


def save_workers(cfg: TrainConfig, k: int, mesh: Mesh, updater: Updater,
                 optimizer: object, outer: object, losses: list[float]) -> None:
    """--outer diloco --save: worker k's ranks write its part (its parameters, the masters
    under --mixed, and its inner optimizer state), worker 0's ranks also the outer part
    (theta, v) with the run's own flags (save_load.diloco_folders)."""
    parts = save_load.diloco_folders(cfg.save, cfg.dp)
    resumed = save_load.diloco_folders(cfg.resume, cfg.dp) if cfg.resume else {}
    updater.use_masters()  # what is saved: the masters (the parameters in one dtype)
    scaler = None if scaler_of(updater) is None else scaler_of(updater).state()
    save_load.save(parts[f"worker-{k}"], config.worker_config(cfg), mesh, updater,
                   optimizer, cfg.steps, losses, keep=cfg.keep, loss_scaler=scaler,
                   run=save_load.continued_run(resumed.get(f"worker-{k}")))
    if k == 0:
        save_load.save(parts["outer"], cfg, mesh, outer, outer, cfg.steps, losses,
                       keep=cfg.keep, run=save_load.continued_run(resumed.get("outer")))
