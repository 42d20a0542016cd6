"""Rewrite a checkpoint for another mesh, without training.

What this file teaches: because a checkpoint speaks of the full canonical arrays
(checkpoint/save_load.py), moving it to another mesh is "resume, then save": build this
rank's model from the full arrays as a resumed run does (`assemble.parallelize`),
hand the optimizer its slices, and save on the new mesh. On one rank with the
default mesh the result is a single file holding the full state.

    mpiexec -n 2 python -m minipar reshard ckpt ckpt-tp2 --tp 2
    python -m minipar reshard ckpt full
"""

from __future__ import annotations

from pathlib import Path

from minipar.checkpoint import save_load
from minipar.comm.collectives import Ledger
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import parallelize
from minipar.core.optim import make_optimizer
from minipar.settings.config import TrainConfig


def reshard(cfg: TrainConfig, world: object, source: str | Path,
            destination: str | Path) -> None:
    """Rewrite the checkpoint in `source` for the mesh of `cfg`, into `destination`;
    a collective over the `world` communicator."""
    mesh = Mesh(cfg.mesh_shape(), world, Ledger())
    saved = save_load.load(source)
    optimizer = make_optimizer(cfg.optimizer, cfg.lr, **cfg.optimizer_rule())
    chunks, updater = parallelize(cfg, mesh, saved.params, optimizer)
    params = [p for chunk in chunks for p in chunk.parameters()]
    step = save_load.restore_optimizer(optimizer, params, saved, updater)
    save_load.save(destination, cfg, mesh, updater, optimizer, step,   # the same run, moved
                    losses=saved.manifest.get("losses", []),
                    router_bias=saved.manifest.get("router_bias"), run=saved.manifest.get("run"))
    mesh.free()
