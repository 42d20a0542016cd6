"""Mixed precision in the gradient sync and the update: masters, main gradients, the
loss scale (docs/design.md, "Mixed precision").

What this file teaches. Under `--mixed` every updater (dp_updater.py, zero.py)
does the same four things around its optimizer step, through one `MixedStep`:

    1. the DP / ZeRO reduction of the main gradients runs in the master dtype
       (`--grad-reduce-dtype master`), or on a 16-bit copy summed in 16 bits
       (`low`: half the bytes; `reduction`, `landing`, `reduced`);
    2. the main gradients are divided by the loss scale S (`unscale_and_vote`);
    3. found_inf: every rank's "I hold an inf or a NaN" is MAX-Allreduced over the
       world (a superset of every axis whose ranks hold different gradients: dp,
       cp, tp, pp, ep), so every rank skips the same step and halves S together;
    4. the optimizer updates the masters, and the 16-bit compute copy is cast from
       them (`cast_copies`).

bf16 keeps S = 1 and takes no vote (its range is float32's).

The strategies never ask which precision runs (docs/design.md, "Seams"): each is
handed a policy, `FullPrecision` without --mixed or a `MixedStep`, and calls the same
methods on either. The collective stays at the strategy's call site; the policy only
says what travels and how it adds:

    buf, op = precision.reduction(grad)        # FullPrecision: grad itself, MPI.SUM
    group.Allreduce(MPI.IN_PLACE, buf, op=op)
    precision.reduced(grad, buf)               # the sum back into grad (16 bits: a copy)

so a run without --mixed executes the very calls it did before the policy existed. The
plain DP syncs take a group instead (`summing`): `LowSum` makes those three calls inside
its `Allreduce`, so their code reads `group.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from minipar.comm import low_precision
from minipar.comm.collectives import Group
from minipar.comm.low_precision import mpi_type
from minipar.core import precision
from minipar.core.memory import displacements
from minipar.core.precision import wire


class FullPrecision:
    """The precision policy of a run without --mixed: one dtype (--dtype) computes,
    travels and is updated. Every method hands the strategy its own arrays back, so
    each collective runs on them as they are, summed with MPI.SUM, and the optimizer
    updates the parameters themselves."""

    scaler: precision.LossScaler | None = None   # no loss scale
    # may the backward start from 1/dp instead of 1, so that the sums over dp arrive as
    # averages (overlapped DP, data_parallel.py)? In one dtype yes: scaling is linear
    # (bitwise the same numbers when dp is a power of two)
    average_in_seed = True

    def reduction(self, x: np.ndarray) -> tuple[np.ndarray, MPI.Op]:
        """What travels for the gradients `x` in a summing collective, and the MPI
        operation that adds it: here `x` itself and MPI.SUM (summed in place)."""
        return x, MPI.SUM

    def landing(self, x: np.ndarray) -> np.ndarray:
        """The receive buffer of a sum meant for `x` (a Reduce_scatter's): `x` itself."""
        return x

    def summing(self, group: Group) -> Group:
        """The group a gradient sync sums over, as this policy sums: `group` itself, whose
        `Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)` adds the gradients as they are."""
        return group

    def reduced(self, x: np.ndarray, buf: np.ndarray) -> None:
        """The sum that arrived in `buf` written into `x`: nothing, it landed in `x`."""

    def compute_copy(self, x: np.ndarray) -> np.ndarray:
        """The array the model computes with, made from the numbers `x` the optimizer
        updates: `x` itself (no copy)."""
        return x

    def gathering(self, space: object, a: int, b: int) -> tuple[np.ndarray, list]:
        """ZeRO-3's gather of the flat range [a, b) of `space` (parallel/zero.py
        `Space`): what I send (my part of the range) and where every rank's part lands,
        as an Allgatherv takes them ([buffer, counts, displacements, datatype]). Here
        the numbers themselves (a 16-bit array as its uint16 words)."""
        counts = space.layout.overlap(a, b)
        whole = np.empty(b - a, dtype=space.shard.dtype)
        return (wire(space.shard[space.layout.mine(a, b)]),
                [wire(whole), counts, displacements(counts), mpi_type(whole)])

    def gathered(self, space: object, a: int, b: int, arrived: list) -> np.ndarray:
        """The range [a, b)'s values from what `gathering`'s buffer received: here
        the buffer itself (its words seen as the shard's dtype again)."""
        return arrived[0].view(space.shard.dtype)

    def master_of(self, x: np.ndarray) -> np.ndarray | None:
        """A separate copy of `x` for the optimizer to update, or None when it updates
        `x` itself (here: None)."""
        return None

    def refresh(self, updated: Sequence[np.ndarray], copies: Sequence[np.ndarray]) -> None:
        """After the update: the compute copies made anew from the updated numbers.
        Nothing here: they are the same arrays."""

    def skips(self, grads: Sequence[np.ndarray]) -> bool:
        """After the sum, before the update: does every rank skip this step? Never."""
        return False


class MixedStep(FullPrecision):
    """The mixed-precision state of one rank's updater: the loss scaler, the 16-bit
    dtype, how DP / ZeRO reduce, and the group found_inf is voted over. As a policy
    (`FullPrecision`'s methods): 16-bit compute copies of master-dtype masters, and the
    gradients summed in the master dtype or, with `--grad-reduce-dtype low`, as 16-bit
    words added by `low_precision.low_sum_op`."""

    # backward starts from 1 (times S): fp16's overflow vote and the 16-bit sums see the
    # gradients one process sees, and DP divides after the sum
    average_in_seed = False

    def __init__(self, mixed: str, grad_reduce_dtype: str, scale: float, window: int,
                 vote: Group, gather: object = None) -> None:
        self.mixed = mixed
        self.gather = gather   # --fp8-allgather: parallel/fp8_scales.py `EightBitGather`
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

    def reduction(self, x: np.ndarray) -> tuple[np.ndarray, MPI.Op]:
        """In the master dtype: `x` and MPI.SUM. Low: a 16-bit copy of `x` as uint16
        words (half the bytes) and the operation that adds them in 16 bits."""
        if not self.reduce_low:
            return x, MPI.SUM
        return wire(x.astype(self.low)), low_precision.low_sum_op(self.low)

    def landing(self, x: np.ndarray) -> np.ndarray:
        """`x`, or under `low` a new 16-bit buffer of its size (as uint16 words)."""
        if not self.reduce_low:
            return x
        return wire(np.empty(x.shape, dtype=self.low))

    def reduced(self, x: np.ndarray, buf: np.ndarray) -> None:
        """Under `low`: the 16-bit sum in `buf` back into the master-dtype `x`."""
        if buf is not x:
            x[...] = buf.view(self.low)

    def summing(self, group: Group) -> Group:
        """`group`, or under `low` the group whose in-place Allreduce sums a 16-bit copy
        (`LowSum`): the sync's own call stays `Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)`."""
        return LowSum(group, self) if self.reduce_low else group

    def compute_copy(self, x: np.ndarray) -> np.ndarray:
        """The 16-bit copy of the master `x`."""
        return x.astype(self.low)

    def gathering(self, space: object, a: int, b: int) -> tuple[np.ndarray, list]:
        """The 16-bit words (FullPrecision's), or under --fp8-allgather the 8-bit
        weights' e4m3 bytes beside the others' bf16 bytes (`EightBitGather.words`)."""
        if self.gather is None:
            return super().gathering(space, a, b)
        return self.gather.words(space, a, b)

    def gathered(self, space: object, a: int, b: int, arrived: list) -> np.ndarray:
        """The 16-bit range, decoded from the 8-bit words where they travelled."""
        if self.gather is None:
            return super().gathered(space, a, b, arrived)
        return self.gather.decoded(space, a, b, arrived[0])

    def master_of(self, x: np.ndarray) -> np.ndarray | None:
        """A master-dtype copy of `x`: the optimizer updates it, never the 16-bit one."""
        return x.copy()

    def refresh(self, updated: Sequence[np.ndarray], copies: Sequence[np.ndarray]) -> None:
        """Each 16-bit compute copy cast from its updated master (`cast_copies`)."""
        cast_copies(updated, copies)

    def skips(self, grads: Sequence[np.ndarray]) -> bool:
        """The gradients divided by S, and every rank's vote (`unscale_and_vote`)."""
        return self.unscale_and_vote(grads)


class LowSum:
    """A gradient sync's group under `--grad-reduce-dtype low`: its in-place Allreduce of
    master-dtype gradients sends a 16-bit copy, summed in 16 bits (`reduction`), and
    writes the sum back (`reduced`). Everything else is the group's own."""

    def __init__(self, group: Group, policy: MixedStep) -> None:
        self.group, self.policy = group, policy

    def __getattr__(self, name: str) -> object:
        return getattr(self.group, name)

    def Allreduce(self, sendbuf: object, recvbuf: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
        """Allreduce(MPI.IN_PLACE, x, MPI.SUM) of x as 16-bit words added in 16 bits."""
        buf, low_op = self.policy.reduction(recvbuf)
        self.group.Allreduce(MPI.IN_PLACE, buf, op=low_op)   # the 16-bit copies -> their sum
        self.policy.reduced(recvbuf, buf)


def cast_copies(masters: Sequence[np.ndarray], copies: Sequence[np.ndarray]) -> None:
    """After the update: each 16-bit compute copy cast (rounded) from its master, in
    place (one pass, no temporary: the same rounding as `astype`)."""
    for master, copy in zip(masters, copies):
        np.copyto(copy, master, casting="unsafe")
