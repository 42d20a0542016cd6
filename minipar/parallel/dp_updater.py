"""The updater of plain data parallelism: what turns a rank's gradients into updated
parameters after each step's backward, around one of data_parallel.py's three syncs.

`Updater` is the protocol every updater follows (this file's `DataParallel`, ZeRO's
stages in zero.py): `step` syncs the gradients over dp and updates what the rank holds,
and the rest says what it holds -- the whole parameters (`materialize`), their bytes
(`memory`), the pieces a checkpoint saves (`checkpoint_pieces`, `slice_state`). Under
--mixed the optimizer updates master copies and the model computes with 16-bit ones
(parallel/mixed.py's policy makes them).

Run it: `mpiexec -n 4 python -m minipar train --dp 4 --grad-sync overlapped --check`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from minipar.comm.mesh import Mesh
from minipar.core.memory import ModelStates, measure
from minipar.core.nn import Module, Parameter
from minipar.core.optim import Optimizer, held_whole
from minipar.core.shards import held_parts
from minipar.parallel import data_parallel
from minipar.parallel.buckets import flat_buffers, grad_or_zeros, make_buckets
from minipar.parallel.dp_hooks import install_hooks
from minipar.parallel.mixed import FullPrecision


class Updater(Protocol):
    """What turns this rank's gradients into updated parameters after each step's
    backward: plain data parallelism (`DataParallel`) or a ZeRO stage (zero.py). Built
    once before the first forward (it may wrap the model's pieces in hooks)."""

    stage: int             # the ZeRO stage: 0 for plain data parallelism
    optimizer: Optimizer   # what updates this rank's parameters (or its flat slice)
    backward_seed: float   # what backward starts from (times S under fp16): 1, or 1/dp

    def step(self) -> None:
        """Synchronize the gradients over dp, then update what this rank holds."""

    def materialize(self) -> None:
        """Make every parameter whole in `p.data` (ZeRO-3 gathers them)."""

    def memory(self) -> ModelStates:
        """Bytes of parameters, gradients and optimizer state this rank holds."""

    def checkpoint_pieces(self) -> tuple[list[Parameter], dict[str, list[np.ndarray]]]:
        """What this rank saves: pieces named and indexed in the full canonical arrays,
        and each optimizer slot (Adam's m, v) as one array per piece."""

    def slice_state(self, full: dict[str, np.ndarray]) -> list[np.ndarray]:
        """This rank's part of one optimizer slot, cut from its full canonical arrays:
        the inverse of `checkpoint_pieces`, in the layout the optimizer is handed."""


class DataParallel:
    """ZeRO stage 0: full parameters, gradients and optimizer state on every rank.
    `step()` synchronizes the gradients (naive, bucketed or overlapped), then updates."""

    stage = 0
    clipper = None  # clip.Clipper with --clip-grad-norm: called after the sync

    def __init__(self, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer,
                 grad_sync: str = "bucketed", bucket_size: int = 65536,
                 microbatches: int = 1, precision: FullPrecision = data_parallel.FULL) -> None:
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        self.mesh, self.optimizer, self.grad_sync = mesh, optimizer, grad_sync
        # the precision policy (parallel/mixed.py): the optimizer updates `masters`, the
        # parameters as built; each p.data becomes the copy the model computes with (the
        # same array in one dtype), made anew from its master after each step
        self.precision = precision
        self.masters = [p.data for p in self.params]
        for p in self.params:
            p.data = precision.compute_copy(p.data)
        self.buckets = make_buckets(self.params, bucket_size)
        self.flats = flat_buffers(self.buckets) if grad_sync == "bucketed" else None
        self.overlap = None
        self.started_in_backward = 0  # buckets the last step started during backward
        # overlapped, in one dtype: backward starts from 1/dp (run/mesh_step.py reads this),
        # so each g_i is already divided and the last Wait leaves the average, where
        # dividing afterwards is one more pass over every gradient (docs/design.md)
        seeded = grad_sync == "overlapped" and precision.average_in_seed
        self.backward_seed = 1.0 / mesh.shape.replicas if seeded else 1.0
        if grad_sync == "overlapped":
            self.overlap = data_parallel.OverlappedAllreduce(self.buckets, mesh, microbatches,
                                                             precision, seeded)
            install_hooks(chunks, self.overlap)

    def step(self) -> None:
        # the syncs looked up at call time (data_parallel.py): --inject-bug may swap them
        if self.grad_sync == "naive":
            data_parallel.allreduce_gradients(self.params, self.mesh, self.precision)
        elif self.grad_sync == "bucketed":
            data_parallel.bucketed_allreduce(self.buckets, self.mesh, self.flats,
                                             self.precision)
        else:
            self.started_in_backward = self.overlap.finish()
        if self.precision.skips([grad_or_zeros(p) for p in self.params]):
            return  # fp16 overflow somewhere: every rank skips this update (S halved)
        if self.clipper is not None:  # clip.py: the global norm, one scale on every rank
            grads = [grad_or_zeros(p) for p in self.params]
            self.clipper(list(zip(self.params, grads)), grads)
        # the optimizer is handed whole parameters (or their TP shards), and says so
        self.optimizer.step(self.masters, [p.grad for p in self.params],  # the masters,
                            held_whole(self.params))
        self.precision.refresh(self.masters, [p.data for p in self.params])  # the copies

    def my_slices(self) -> list[np.ndarray]:
        """The numbers this rank's optimizer updates: the masters (in one dtype the
        parameters themselves)."""
        return self.masters

    def use_masters(self) -> None:
        """Point every `p.data` at its master (the end of a --mixed run: what --check,
        --dump and checkpoints read). No-op without --mixed."""
        for p, master in zip(self.params, self.masters):
            p.data = master

    def materialize(self) -> None:
        """Every parameter is already whole in `p.data` (ZeRO-3 must gather them)."""

    def memory(self) -> ModelStates:
        """Bytes of parameters, gradients and optimizer state this rank holds."""
        return measure([p.data for p in self.params], [p.grad for p in self.params],
                       self.optimizer.held_state(),
                       [m for p, m in zip(self.params, self.masters) if m is not p.data])

    def checkpoint_pieces(self) -> tuple[list[Parameter], dict[str, list[np.ndarray]]]:
        """Every parameter as it is held (its `full_index`), with its optimizer state."""
        return self.params, self.optimizer.state_arrays()

    def slice_state(self, full: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Each parameter's part of the full slot, cut as the parameter was cut."""
        return held_parts(self.params, full)
