"""Rank side of the PyTorch comparison: DDP over gloo on loopback, the same model and batch.

    mpiexec -n N python -m bench.ddp_rank STEPS OUT.json

mpiexec only starts the processes (each reads its rank from the launcher's
environment); torch.distributed does the communication itself, over gloo on
127.0.0.1. The model is minipar's dense MLP of bench/dp_rank.py, float64, one
thread per rank, global batch 256 split as minipar splits it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as fn

from bench.dp_rank import SHAPE
from minipar.core import nn
from minipar.core.data import make_batch


class MLP(torch.nn.Module):
    """docs/design.md's dense model: embed, pre-LN residual GELU blocks, head."""

    def __init__(self, full: dict, layers: int) -> None:
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.tensor(v)) for k, v in full.items()})
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        h = x @ p["embed_weight"] + p["embed_bias"]
        for i in range(self.layers):
            b = f"blocks_{i}_"
            u = fn.layer_norm(h, h.shape[-1:], p[b + "ln_weight"], p[b + "ln_bias"], 1e-5)
            z = fn.gelu(u @ p[b + "fc1_weight"] + p[b + "fc1_bias"], approximate="tanh")
            h = h + z @ p[b + "fc2_weight"] + p[b + "fc2_bias"]
        return h @ p["head_weight"] + p["head_bias"]


def main() -> None:
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    steps, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    cfg = nn.ModelConfig(**{k: v for k, v in SHAPE.items() if k != "batch"})
    model = torch.nn.parallel.DistributedDataParallel(
        MLP(nn.init_params(cfg, 0, "float64"), cfg.layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = SHAPE["batch"] // size
    stamps = []
    for step in range(steps):
        x, y = make_batch(0, step, SHAPE["batch"], cfg.d_in, cfg.classes, "float64")
        x, y = torch.tensor(x[rank * rows:(rank + 1) * rows]), torch.tensor(y[rank * rows:
                                                                              (rank + 1) * rows])
        opt.zero_grad(set_to_none=True)
        fn.cross_entropy(model(x), y).backward()  # DDP averages the gradients over ranks
        opt.step()
        stamps.append(time.perf_counter())
    if rank == 0:
        durations = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))
        with open(out, "w") as f:
            json.dump({"ranks": size, "median": durations[len(durations) // 2],
                       "min": durations[0], "max": durations[-1]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
