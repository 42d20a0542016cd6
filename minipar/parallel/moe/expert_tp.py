"""Expert tensor parallelism (`--tp` with `--model moe`): each expert itself split
Megatron's way over the tp group (Megatron-LM, Shoeybi et al. 2019), fc1 by columns and
fc2 by rows (`TensorParallelExpert`).

The ranks of a tp group hold the same tokens, route them alike, and each is in its own
ep group (one per tp coordinate), so every tp rank receives the same rows for the same
local experts. Each runs its column shard of every local expert on them; one Allreduce
over tp of the (R, d) partial outputs (`reduce_from`) sums the shares before the biases
of fc2 are added and the results go back; in the backward one Allreduce of (R, d) sums the
input gradients (`copy_to`). Everything outside the experts is replicated over tp.

Run it: `mpiexec -n 4 python -m minipar train --model moe --dp 2 --ep 2 --tp 2 --check`.
"""

from __future__ import annotations

import numpy as np

from minipar import placement
from minipar.comm import collectives
from minipar.comm.collectives import Group
from minipar.core import autograd as ag
from minipar.core import fused_layers, nn
from minipar.core.autograd import Tensor
from minipar.placement import Shard


class TensorParallelExpert(nn.Module):
    """Expert e split over tp: rank t holds fc1's W1[:, cols_t], b1[cols_t] and fc2's
    W2[rows_t, :] (the same f_e/tp slice), and all of fc2's bias b2. `partial` gives this
    rank's share GELU(u W1[:, cols_t] + b1[cols_t]) W2[rows_t, :] of the expert's output
    before b2: the shares of the tp ranks sum to Expert_e(u) - b2 (GELU is elementwise,
    so it runs on the column shard as it stands)."""

    def __init__(self, full: dict[str, np.ndarray], name: str, tp: Group,
                 sync: str = "edp") -> None:
        width = full[f"{name}.fc1.weight"].shape[1]
        part = slice(tp.rank * width // tp.size, (tp.rank + 1) * width // tp.size)
        self.fc1_weight = nn.Parameter(full[f"{name}.fc1.weight"][:, part],
                                       f"{name}.fc1.weight",
                                       full_index=(slice(None), part), sync=sync)
        self.fc1_bias = nn.Parameter(full[f"{name}.fc1.bias"][part], f"{name}.fc1.bias",
                                     full_index=(part,), sync=sync)
        self.fc2_weight = nn.Parameter(full[f"{name}.fc2.weight"][part], f"{name}.fc2.weight",
                                       full_index=(part, slice(None)), sync=sync)
        self.fc2_bias = nn.Parameter(full[f"{name}.fc2.bias"], f"{name}.fc2.bias", sync=sync)
        placement.place(self.fc1_weight, tp, Shard(1))   # my columns of W1 (d, f_e)
        placement.place(self.fc1_bias, tp, Shard(0))     # and of b1 (f_e,)
        placement.place(self.fc2_weight, tp, Shard(0))   # my rows of W2 (f_e, d); b2 whole

    def partial(self, u: Tensor) -> Tensor:
        """(n, d) rows -> (n, d), this rank's share of the output (b2 not added)."""
        z = fused_layers.gelu(fused_layers.linear(u, self.fc1_weight, self.fc1_bias))  # (n, f_e/tp)
        return fused_layers.linear(z, self.fc2_weight)                           # (n, d), a share


def run_local_experts_split(received: Tensor, recv: np.ndarray,
                            experts: list[TensorParallelExpert], tp: Group) -> Tensor:
    """`run_local_experts` with every expert split over tp: the same rows on every tp rank,
    each rank's share of every expert, one Allreduce of the shares, then each row's b2."""
    local = len(experts)
    expert_of_row = np.repeat(np.tile(np.arange(local), recv.shape[0]), recv.ravel())  # (R,)
    by_expert = np.argsort(expert_of_row, kind="stable")      # rows grouped per expert
    bounds = np.cumsum(recv.sum(axis=0))[:-1]
    x = collectives.copy_to(received, tp)     # f: nothing moves; backward Allreduce of (R, d)
    shares = ag.concat([expert.partial(ag.take_rows(x, rows))
                        for expert, rows in zip(experts, np.split(by_expert, bounds))])
    summed = collectives.reduce_from(shares, tp)   # g: (R, d) shares of every tp rank -> their sum
    biases = ag.concat([ag.reshape(expert.fc2_bias, (1, -1)) for expert in experts])  # (l, d)
    picked = ag.take_rows(biases, expert_of_row[by_expert])  # (R, d): each row's own b2
    if placement.ON:  # placed as the rows it is added to; b2's gradient partial there
        placement.follow(picked, placement.picked_for("each row's fc2 bias", biases, summed))
    stacked = summed + picked
    back = np.empty_like(by_expert)
    back[by_expert] = np.arange(by_expert.size)               # inverse permutation
    return ag.take_rows(stacked, back)                        # (R, d) in received order
