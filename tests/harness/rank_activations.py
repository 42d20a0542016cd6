"""Rank side of tests/parallel/test_gpt_tensor_parallel.py's memory test: one gpt block's tape.

    mpiexec -n 4 python -m tests.harness.rank_activations OUT.json

For tp in 1, 2, 4 (tp divides the world; the other ranks of the world build their own
tp groups), with and without --sp, and each --recompute mode: build block 0 as train.py
builds it, run it forward on a random (B, T, d) input (this rank's T/tp positions under
sp) and measure recompute.tape_bytes without the input. Rank 0 writes a list of
{tp, sp, recompute, measured} per setting.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Ledger
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import make_block
from minipar.core import nn
from minipar.core.autograd import Tensor
from minipar.core.recompute import tape_bytes
from minipar.settings.config import TrainConfig

SHAPE = dict(model="gpt", layers=2, d_model=16, heads=4, seq_len=8, vocab=16, batch=4,
             d_ff=48)


def main() -> None:
    world = MPI.COMM_WORLD
    found = []
    for tp in (1, 2, 4):
        for sp in (False, True) if tp > 1 else (False,):
            for recompute in ("none", "selective", "full"):
                cfg = TrainConfig(**SHAPE, tp=tp, sp=sp, recompute=recompute
                                  ).resolved(world.Get_size())
                mesh = Mesh(cfg.mesh_shape(), world, Ledger())
                full = nn.init_params(cfg.model_config(), cfg.seed)
                block = make_block(cfg, cfg.model_config(), mesh, full, 0)
                positions = cfg.seq_len // tp if sp else cfg.seq_len
                h = Tensor(np.random.default_rng(0).normal(size=(cfg.batch, positions, 16)),
                           requires_grad=True)
                out, _ = block(h)
                found.append(dict(tp=tp, sp=sp, recompute=recompute,
                                  measured=tape_bytes(out, exclude=(h,))))
                mesh.free()
    if world.Get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(found))


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        from minipar.comm.job import abort_all

        abort_all(f"rank {MPI.COMM_WORLD.Get_rank()} failed:\n{traceback.format_exc()}")
