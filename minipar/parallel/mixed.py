"""Mixed precision in the gradient sync and the update: masters, main gradients, the
loss scale (docs/design.md, "Mixed precision").

What this file teaches. Under `--mixed` every updater (data_parallel.py, zero.py)
does the same four things around its optimizer step, through one `MixedStep`:

    1. the DP / ZeRO reduction of the main gradients runs in the master dtype
       (`--grad-reduce-dtype master`), or on a 16-bit copy summed in 16 bits
       (`low`: half the bytes; `sum_gradients`, `reduce_scatter_gradients`);
    2. the main gradients are divided by the loss scale S (`unscale_and_vote`);
    3. found_inf: every rank's "I hold an inf or a NaN" is MAX-Allreduced over the
       world (a superset of every axis whose ranks hold different gradients: dp,
       cp, tp, pp, ep), so every rank skips the same step and halves S together;
    4. the optimizer updates the masters, and the 16-bit compute copy is cast from
       them (`cast_copies`).

bf16 keeps S = 1 and takes no vote (its range is float32's).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from minipar.comm import low_precision
from minipar.comm.collectives import Group
from minipar.core import precision


class MixedStep:
    """The mixed-precision state of one rank's updater: the loss scaler, the 16-bit
    dtype, how DP / ZeRO reduce, and the group found_inf is voted over."""

    def __init__(self, mixed: str, grad_reduce_dtype: str, scale: float, window: int,
                 vote: Group) -> None:
        self.mixed = mixed
        self.low = precision.low_dtype(mixed)
        self.reduce_low = grad_reduce_dtype == "low"
        self.scaler = precision.make_scaler(mixed, scale, window)
        self.vote = vote
        self.skipped_last = False   # did the last step skip its update?
        self.history: list[tuple[float, bool]] = []  # per step: S it ran with, skipped?
        # fp16, per step: this rank's largest finite scaled main gradient (--check's margin)
        self.largest: list[float] = []

    @property
    def scale(self) -> float:
        """S: what the loss is multiplied by before backward."""
        return self.scaler.scale

    def unscale_and_vote(self, grads: Sequence[np.ndarray]) -> bool:
        """Divide this rank's (reduced) main gradients by S, then decide with every rank
        whether this step is skipped (fp16: any inf/NaN anywhere). Returns True = skip."""
        if self.scaler.static:         # bf16: S = 1, nothing to divide, nothing to vote
            self.skipped_last = False
            self.history.append((1.0, False))
            return False
        used = self.scaler.scale
        self.largest.append(precision.largest_finite(list(grads)))   # before dividing by S
        inverse = 1.0 / used           # a power of two: the division is exact
        for g in grads:
            g *= inverse
        found_inf = low_precision.any_nonfinite(self.vote, list(grads))
        self.skipped_last = self.scaler.update(found_inf)
        self.history.append((used, self.skipped_last))
        return self.skipped_last


def sum_gradients(group: Group, flat: np.ndarray, mixed: MixedStep | None) -> None:
    """Sum the master-dtype gradient buffer `flat` over the group, in place: in the
    master dtype, or (`--grad-reduce-dtype low`) as a 16-bit copy summed in 16 bits and
    written back."""
    if mixed is None or not mixed.reduce_low:
        group.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)  # g_i of every replica -> sum
        return
    flat[...] = low_precision.allreduce_low(group, flat.astype(mixed.low))


def reduce_scatter_gradients(group: Group, grads: np.ndarray, counts: list[int],
                             mixed: MixedStep | None) -> np.ndarray | None:
    """ZeRO's Reduce_scatter under `--grad-reduce-dtype low`: the 16-bit copy of the
    master-dtype gradients summed in 16 bits; my part back in the master dtype. None
    when the reduction runs in the master dtype (the caller's own Reduce_scatter)."""
    if mixed is None or not mixed.reduce_low:
        return None
    mine = low_precision.reduce_scatter_low(group, grads.astype(mixed.low), counts)
    return mine.astype(grads.dtype)


def cast_copies(masters: Sequence[np.ndarray], copies: Sequence[np.ndarray]) -> None:
    """After the update: each 16-bit compute copy cast (rounded) from its master."""
    for master, copy in zip(masters, copies):
        copy[...] = master.astype(copy.dtype)
