"""Data parallelism: every rank holds the whole model and a slice of the batch.

What this file teaches (the source text's first strategy): with the global
batch cut into dp equal slices, each rank's gradient g_i is the gradient of its
slice's mean loss, and the full-batch gradient is their average,

    g = 1/dp * sum_i g_i          (batch 1024 on 8 ranks: 128 each, 1/8 sum)

computed with Allreduce(SUM) and a division. In placements (placement/__init__.py): every
parameter is Replicate over dp, the batch rows Shard(0), so each g_i is a Partial
over dp; the sync turns it into Replicate before the optimizer step, and says so
(`placement.summed`: `train --check-placements` then checks no gradient was left
partial). Three ways to call it, side by
side, each equal to one process (`--grad-sync`):

1. naive: one Allreduce per parameter after backward. Simple, but a model of
   many small tensors pays the latency of many small messages.
2. bucketed: gradients copied into contiguous buckets of about `--bucket-size`
   elements (in reverse order: the order backward finishes them), one in-place
   Allreduce per bucket (PyTorch DDP, Li et al. 2020).
3. overlapped: each bucket's nonblocking Iallreduce starts as soon as backward
   has produced all of its gradients, while backward goes on with earlier
   pieces of the model; the requests are waited just before the optimizer.
   In one dtype its backward starts from 1/dp instead of 1 (`backward_seed`):
   every g_i arrives already divided, the sum is the average, and no pass over
   the gradients is left after the last Wait (--mixed keeps the division).

How overlap knows a gradient is complete: dp_hooks.py (a `Piece` around each
piece of the model, its marker nodes in the tape). The buckets and their flat
buffers: buckets.py. The updater that calls a sync and then the optimizer, with the
masters, the memory and the checkpoint pieces it holds: dp_updater.py.

Run it: `mpiexec -n 8 python lessons/01_data_parallel.py`, or
`mpiexec -n 4 python -m minipar train --dp 4 --grad-sync overlapped --check --ledger`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from minipar import placement
from minipar.comm import trace
from minipar.comm.collectives import Group
from minipar.comm.mesh import Mesh
from minipar.core.nn import Parameter
from minipar.parallel.buckets import flat_buffers, grad_or_zeros, pack, unpack
from minipar.parallel.dp_hooks import Hooks, Piece
from minipar.parallel.mixed import FullPrecision

FULL = FullPrecision()  # the policy of a run in one dtype (parallel/mixed.py)


def _group(p: Parameter, mesh: Mesh) -> Group:
    """The replicas of p: all dp ranks, or for an expert weight the ranks with its expert;
    with context parallelism, those of every cp coordinate too (mesh.py: dp_cp, edp_cp)."""
    return mesh.dp_cp if p.sync == "dp" else mesh.edp_cp


# ------------------------------------------------------------- 1. naive
def allreduce_gradients(params: Sequence[Parameter], mesh: Mesh,
                        precision: FullPrecision = FULL) -> None:
    """Naive DP: one Allreduce per parameter, then divide by dp.

    A parameter replicated over all data-parallel ranks (`sync="dp"`) sums over
    the dp group. An expert weight (`sync="edp"`) lives on one rank of each
    expert-parallel group and sums over the ranks holding the same experts; it
    is still divided by dp, because each of its contributions was the gradient of
    one rank's *local mean* loss, of which there are dp in the global mean.
    With context parallelism every rank's loss is the mean over its positions, so
    the sum runs over the dp x cp ranks and is divided by dp cp (`mesh.shape.replicas`).
    `precision`: the policy (parallel/mixed.py) whose `summing(group)` says how the sum
    adds; without --mixed the group itself: the gradient travels, with MPI.SUM.
    """
    for p in params:
        if p.sync is None:
            continue
        grad, replicas = grad_or_zeros(p), _group(p, mesh)
        if replicas.size > 1:
            placement.summed([p], replicas)            # Partial -> Replicate over dp
        group = precision.summing(replicas)    # how the policy adds (parallel/mixed.py)
        # exercise: dp-naive
        if group.size > 1:
            group.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)   # g_i of every replica -> sum
        if mesh.shape.replicas > 1:
            grad /= mesh.shape.replicas
        # end exercise


# ----------------------------------------------------------- 2. bucketed
def bucketed_allreduce(buckets: Sequence[Sequence[Parameter]], mesh: Mesh,
                       flats: Sequence[np.ndarray] | None = None,
                       precision: FullPrecision = FULL) -> None:
    """Bucketed DP: one in-place Allreduce per bucket, then divide by dp. `flats`: the
    buckets' reused buffers (`flat_buffers`), or None for new ones. `precision`: how the
    sums add (parallel/mixed.py; in one dtype the bucket itself, MPI.SUM)."""
    groups = []
    for bucket in buckets:
        replicas = _group(bucket[0], mesh)
        if replicas.size > 1:
            placement.summed(bucket, replicas)             # Partial -> Replicate over dp
        groups.append(precision.summing(replicas))  # how the policy adds (parallel/mixed.py)
    # exercise: dp-bucketed
    for i, (bucket, group) in enumerate(zip(buckets, groups)):
        if group.size == 1 and mesh.shape.replicas == 1:
            continue  # one replica and nothing to average: the gradients are final
        flat = pack(bucket, None if flats is None else flats[i])
        if group.size > 1:
            group.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)   # a bucket of g_i -> its sum
        unpack(bucket, flat, 1.0 / mesh.shape.replicas)
    # end exercise


# ---------------------------------------------------------- 3. overlapped
class OverlappedAllreduce(Hooks):
    """Overlapped DP: a bucket's Iallreduce starts when backward has finished every
    parameter in it for the last microbatch; `finish` waits for all of them."""

    def __init__(self, buckets: list[list[Parameter]], mesh: Mesh, microbatches: int,
                 precision: FullPrecision = FULL, seeded: bool = False) -> None:
        self.buckets, self.mesh, self.microbatches = buckets, mesh, microbatches
        self.precision = precision  # what travels for a bucket (parallel/mixed.py)
        # seeded: backward started from 1/dp, each sum is already the average
        self.scale = 1.0 if seeded else 1.0 / mesh.shape.replicas
        self.flats = flat_buffers(buckets)  # each bucket's buffer, reused every step
        self.bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
        self._reset()

    def _reset(self) -> None:
        self.passes: dict[int, int] = {}                   # piece -> backward passes so far
        self.waiting = [len(bucket) for bucket in self.buckets]  # params not final yet
        self.in_flight: list[tuple[int, np.ndarray, MPI.Request | None]] = []
        self.travelling: dict[int, np.ndarray] = {}  # bucket -> what travels for it

    def before_backward(self, piece: Piece) -> None:
        self._progress()

    def after_backward(self, piece: Piece) -> None:
        self.passes[id(piece)] = self.passes.get(id(piece), 0) + 1
        if self.passes[id(piece)] < self.microbatches:
            return  # a later microbatch will add to these gradients
        for p in reversed(piece.parameters()):  # buckets were cut from the back
            i = self.bucket_of.get(id(p))
            if i is not None:
                self.waiting[i] -= 1
                if self.waiting[i] == 0:
                    self._launch(i)
        self._progress()

    def _progress(self) -> None:
        """Let the buckets in flight move on. An MPI library without a progress thread
        (MPICH's default) advances a nonblocking collective only inside MPI calls: a
        Test at each piece's edges hands it the wire between the pieces' backwards,
        instead of leaving all of it to the final Waitall. Changes no number."""
        for _, _, request in self.in_flight:
            if request is not None:
                request.Test()  # done: the request becomes MPI.REQUEST_NULL

    def _launch(self, i: int) -> None:
        flat = pack(self.buckets[i], self.flats[i])
        group = _group(self.buckets[i][0], self.mesh)
        buf, request = flat, None
        if group.size > 1:  # a bucket of g_i -> its sum, in the background
            buf, op = self.precision.reduction(flat)   # in one dtype: flat and MPI.SUM
            request = group.Iallreduce(MPI.IN_PLACE, buf, op=op)
            placement.summed(self.buckets[i], group)       # Partial -> Replicate over dp
        self.travelling[i] = buf  # kept until finish: MPI is writing into it
        self.in_flight.append((i, flat, request))

    def finish(self) -> int:
        """Start any bucket backward did not (a parameter outside every piece), wait for
        all, divide by dp (unless the backward's seed did). Returns how many buckets had
        started during backward."""
        early = len(self.in_flight)
        started = {i for i, _, _ in self.in_flight}
        for i in range(len(self.buckets)):
            if i not in started:
                self._launch(i)
        trace.wait([r for _, _, r in self.in_flight if r is not None],
                   "Waitall of the gradient buckets over dp")
        for i, flat, _ in self.in_flight:
            self.precision.reduced(flat, self.travelling[i])   # the sum into the bucket
            unpack(self.buckets[i], flat, self.scale)
        self._reset()
        return early
