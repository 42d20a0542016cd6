"""16-bit buffers on the wire: what mpi4py cannot name, moved as raw 16-bit words.

What this file teaches (docs/design.md, "Mixed precision"). MPI knows float16 in
some libraries and bfloat16 in none, but a collective that only *moves* bytes
(Allgather, Send, Alltoall) does not care what they mean: a 16-bit array is handed
to MPI as its `uint16` view (`wire`), and the ledger counts 2 bytes per element.

A collective that *adds* must know the format. Two hand-written ways:

    upcast   (`allreduce_upcast`)  16-bit -> master dtype, Allreduce(SUM) in the master
             dtype, round once. The sum is as exact as the master run's; the wire
             carries master bytes (4 or 8 per element).
    low      (`low_sum_op`; `allreduce_low`)  the uint16 words travel, and
             a user-defined MPI operation (`MPI.Op.Create`) adds two of them: view
             uint16 -> the 16-bit dtype, add (in float32, as NumPy does for 16-bit
             types), round back to 16 bits. Every partial sum of the reduction tree
             is rounded: half the bytes, and an error that grows with the group size.
             The strategies' own calls (DP's Allreduce and Iallreduce, ZeRO's
             Reduce_scatter) take the words and the op from the precision policy
             (parallel/mixed.py `reduction`) and make the call where they stand.

`any_nonfinite` is the loss scaler's vote: the MAX over the group of "I saw an inf
or a NaN", so every rank skips the same step.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Group
from minipar.core import precision
from minipar.core.precision import wire  # noqa: F401  (the uint16 view; no MPI in it)

_OPS: dict[str, MPI.Op] = {}


def mpi_type(x: np.ndarray) -> MPI.Datatype:
    """The MPI datatype of `wire(x)` (for buffer specs of the v-collectives)."""
    return MPI._typedict[wire(x).dtype.char]


def low_sum_op(dtype: np.dtype) -> MPI.Op:
    """An MPI operation that adds two buffers of 16-bit words as `dtype` numbers,
    rounding each sum to 16 bits. Created once per dtype (MPI.Op.Create)."""
    dtype = np.dtype(dtype)
    name = precision.name_of(dtype)
    if name not in _OPS:
        def add_in_16_bits(inbuf: object, inoutbuf: object, datatype: MPI.Datatype) -> None:
            a = np.frombuffer(inbuf, dtype=np.uint16).view(dtype)
            b = np.frombuffer(inoutbuf, dtype=np.uint16).view(dtype)
            b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
        _OPS[name] = MPI.Op.Create(add_in_16_bits, commute=True)
    return _OPS[name]


def allreduce_low(group: Group, x: np.ndarray) -> np.ndarray:
    """Sum the 16-bit array `x` over the group in place, in 16 bits on the wire and in
    every partial sum (`low_sum_op`). Returns x."""
    if group.size > 1:  # every rank's 16-bit words -> their 16-bit sum, on every rank
        group.Allreduce(MPI.IN_PLACE, wire(x), op=low_sum_op(x.dtype))
    return x


def allreduce_upcast(group: Group, x: np.ndarray, master: np.dtype) -> np.ndarray:
    """The sum over the group of the 16-bit array `x`, computed in `master` (upcast,
    Allreduce, round once): a new 16-bit array."""
    wide = x.astype(master)
    if group.size > 1:  # every rank's upcast values -> their exact-as-master sum
        group.Allreduce(MPI.IN_PLACE, wide, op=MPI.SUM)
    return wide.astype(x.dtype)


def any_nonfinite(group: Group, arrays: list[np.ndarray]) -> bool:
    """Did any rank of the group see an inf or a NaN in its arrays? One MAX-Allreduce
    of a 0/1 flag, so every rank of the group gets the same answer."""
    # exercise: loss-scaler
    flag = np.array([1 if precision.nonfinite(arrays) else 0], dtype=np.int32)
    if group.size > 1:  # my verdict -> the worst verdict of the group
        group.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    return bool(flag[0])
    # end exercise
