"""Shared experts (`--shared-experts S`, DeepSeekMoE, Dai et al. 2024): S always-on experts
every token goes through, beside the routed ones, their output added to the routed FFN's
(core/routing.py has the reference). Each rank runs them on its own tokens, so they
need no exchange: they are replicated over ep like the router (sync="dp"), and split
over tp like the routed experts when those are (moe/expert_tp.py).

Run it: `mpiexec -n 4 python -m minipar train --model moe --dp 4 --ep 2 --shared-experts 1
--check`.
"""

from __future__ import annotations

import numpy as np

from minipar.comm import collectives
from minipar.comm.collectives import Group
from minipar.core import nn
from minipar.core.autograd import Tensor
from minipar.parallel.moe.expert_tp import TensorParallelExpert


class SharedExperts(nn.Module):
    """sum_s Shared_s(u) of the block `prefix` on my tokens u (b, d), no gate."""

    def __init__(self, full: dict[str, np.ndarray], prefix: str, count: int, tp: Group,
                 split: bool) -> None:
        names = [f"{prefix}.shared_experts.{s}" for s in range(count)]
        self.tp_group, self.split = tp, split
        self.experts = [TensorParallelExpert(full, name, tp, sync="dp") for name in names] \
            if split else [nn.ExpertFFN(full, name, sync="dp") for name in names]

    def __call__(self, u: Tensor) -> Tensor:
        """No communication whole on every rank; split over tp (each rank its columns of
        fc1 and rows of fc2), one Allreduce of the (b, d) shares, then the fc2 biases."""
        if not self.split:
            total = self.experts[0](u)
            for expert in self.experts[1:]:
                total = total + expert(u)
            return total
        x = collectives.copy_to(u, self.tp_group)        # backward: Allreduce of (b, d) over tp
        share = self.experts[0].partial(x)
        for expert in self.experts[1:]:
            share = share + expert.partial(x)
        total = collectives.reduce_from(share, self.tp_group)  # the tp shares -> their sum (b, d)
        for expert in self.experts:
            total = total + expert.fc2_bias
        return total
