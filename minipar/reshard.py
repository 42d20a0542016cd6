"""Rewrite a checkpoint for another mesh, without training.

What this file teaches: because a checkpoint speaks of the full canonical arrays
(checkpoint.py), moving it to another mesh is "resume, then save": build this
rank's model from the full arrays as a resumed run does (`assemble.parallelize`),
hand the optimizer its slices, and save on the new mesh. On one rank with the
default mesh the result is a single file holding the full state.

    mpiexec -n 2 python -m minipar reshard ckpt ckpt-tp2 --tp 2
    python -m minipar reshard ckpt full
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from minipar import checkpoint
from minipar.comm import Ledger
from minipar.config import TrainConfig
from minipar.mesh import Mesh
from minipar.optim import make_optimizer
from minipar.train import parallelize


def for_mesh(cfg: TrainConfig) -> TrainConfig:
    """`cfg` (resolved) with the flags its mesh needs and the checkpoint does not fix,
    derived: the interleaved schedule takes microbatches in groups of pp, so M becomes
    the smallest multiple of pp that splits each dp rank's rows (M changes no saved
    number: it only orders the work of a step)."""
    if cfg.pp > 1 and cfg.schedule == "interleaved" and cfg.microbatches % cfg.pp:
        rows = cfg.batch // cfg.dp
        fits = [m for m in range(cfg.pp, rows + 1, cfg.pp) if rows % m == 0]
        if fits:
            return replace(cfg, microbatches=fits[0])
    return cfg


def reshard(cfg: TrainConfig, world: object, source: str | Path,
            destination: str | Path) -> None:
    """Rewrite the checkpoint in `source` for the mesh of `cfg`, into `destination`;
    a collective over the `world` communicator."""
    mesh = Mesh(cfg.mesh_shape(), world, Ledger())
    saved = checkpoint.load(source)
    optimizer = make_optimizer(cfg.optimizer, cfg.lr)
    chunks, updater = parallelize(cfg, mesh, saved.params, optimizer)
    params = [p for chunk in chunks for p in chunk.parameters()]
    step = checkpoint.restore_optimizer(optimizer, params, saved, updater)
    checkpoint.save(destination, cfg, mesh, updater, optimizer, step,   # the same run, moved
                    losses=saved.manifest.get("losses", []), run=saved.manifest.get("run"))
    mesh.free()
