"""ZeRO: data parallelism without keeping N_d copies of the same model states.

What this file teaches (ZeRO, Rajbhandari et al. 2020). Plain data parallelism
(data_parallel.py) keeps every parameter, gradient and optimizer state on every
one of the N_d ranks. But after the Allreduce each rank applies the *same*
update to the *same* numbers: it would be enough for rank i to update a 1/N_d
slice and hand the result to the others. Flatten this rank's parameters into
one vector of Psi numbers; rank i owns a contiguous slice of it (memory.py:
`FlatLayout`, unequal slices when N_d does not divide Psi, carried by the
v-collectives' counts, no padding). Then:

    stage 1 (P_os)     optimizer state only for my slice.
                       Reduce_scatter(gradients) -> my slice of the summed gradient;
                       update my slice; Allgather(parameters) -> every slice to all.
    stage 2 (P_os+g)   gradients sharded too: as backward finishes each piece of the
                       model, its gradient is Reduce_scattered at once and dropped;
                       only my slice of the sum is kept.
    stage 3 (P_os+g+p) parameters sharded too: before each piece's forward its
                       parameters are Allgathered and dropped after it; again
                       before its backward, dropped after its Reduce_scatter.

Allreduce = Reduce_scatter + Allgather, so stages 1 and 2 move what DP moves
(2 Psi per step on the wire, ring algorithms); stage 3 adds one Allgather (3 Psi).
The hooks around each piece are the marker nodes of data_parallel.py (`Piece`).

With MoE, the expert weights are not replicated over dp but over the
expert-data-parallel group (edp: the dp ranks holding the same experts). So ZeRO
keeps one flat vector per group of replicas (`Space`): the dense weights sliced
over dp, the expert weights over edp (DeepSpeed-MoE's way). An MoE block's
backward Reduce_scatters its router and LayerNorm over dp and its experts over
edp; one optimizer step updates both slices.

Placements (placement/__init__.py): every parameter is Replicate over dp as in plain data
parallelism and its gradient Partial over dp; the Reduce_scatter turns the flat
gradient into Shard(0) of its sum (each rank its slice), and the Allgather turns the
updated slices back into Replicate parameters. `placement.summed` states the first
transition for the parameters. The flat parameter vector itself carries a placement too
(`Space.values`, under `--check-placements`): Shard(0) over dp once the optimizer has
updated my slice (the other slices are stale here), Replicate again after the
Allgatherv; a step that ends with it still sharded stops with one line
(`check_replicated`: `--inject-bug zero-no-allgather --check-placements`). Gradient
clipping (clip.py) counts the gradient slices as what they are, Shard(0) over dp x cp:
every rank its own numbers.

Checkpoints (checkpoint/save_load.py) speak of parameters, not flat slices: each rank
saves its slice as boxes of the full arrays it covers (`checkpoint_pieces`), and
on resume cuts its slice of Adam's m and v out of the full ones (`slice_state`),
so a ZeRO run saved on dp=4 resumes on dp=3, on ZeRO-0, or on one process.

Run it: `mpiexec -n 4 python lessons/07_zero.py`, or
`mpiexec -n 4 python -m minipar train --dp 4 --zero 3 --optimizer adam --check --ledger`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from minipar import placement
from minipar.comm.collectives import Group
from minipar.comm.low_precision import mpi_type
from minipar.comm.mesh import Mesh
from minipar.core.autograd import Tensor
from minipar.core.memory import FlatLayout, ModelStates, displacements, measure
from minipar.core.nn import Module, Parameter
from minipar.core.optim import Held, Optimizer
from minipar.core.precision import wire
from minipar.core.shards import flat_boxes, in_full_array
from minipar.parallel.buckets import grad_or_zeros
from minipar.parallel.dp_hooks import Hooks, Piece, install_hooks
from minipar.parallel.mixed import FullPrecision

FULL = FullPrecision()  # the policy of a run in one dtype (parallel/mixed.py)


def _mpi_type(array: np.ndarray) -> MPI.Datatype:
    return mpi_type(array)  # a 16-bit array travels as uint16 words


class Space:
    """One flat vector of ZeRO: the parameters of this rank that share one group of
    replicas, sliced over that group. Dense weights (sync="dp") are replicated over the
    dp ranks; with MoE, expert weights (sync="edp") over the expert-data-parallel group
    only (the dp ranks holding the same experts), so they get a flat vector of their own,
    sliced over edp (DeepSpeed-MoE's way). Each parameter's `data` is a view into `flat`.

    The precision policy (`precision`, parallel/mixed.py) makes `flat` the copy the model
    computes with and may keep `master`, my slice of a separate copy the optimizer
    updates (under --mixed: 16-bit `flat`, --dtype `master`; the rank casts `master` into
    its slice of `flat` and the Allgather moves 16-bit words). In one dtype there is no
    `master`: the optimizer updates my slice of `flat` itself."""

    def __init__(self, params: list[Parameter], group: Group,
                 precision: FullPrecision = FULL) -> None:
        self.params, self.group, self.precision = params, group, precision
        self.layout = FlatLayout([p.data.shape for p in params], group.size, group.rank)
        self.flat: np.ndarray | None = np.concatenate([p.data.ravel() for p in params])
        # my slice of the masters (None in one dtype), then the flat copy to compute with
        self.master = precision.master_of(self.flat[self.layout.start:self.layout.stop])
        self.flat = precision.compute_copy(self.flat)
        for p, view in zip(params, self.layout.views(self.flat)):
            p.data = view
        kind = "expert" if any(p.sync == "edp" for p in params) else "dense"
        # the flat vector as a tensor (no copy), carrying its placement over the group
        self.values = Tensor(self.flat, name=f"ZeRO's flat vector of the {kind} parameters")
        self.shard: np.ndarray | None = None   # ZeRO-3: my slice, once `flat` is dropped
        self.grad_shard: np.ndarray | None = None  # ZeRO-2/3: my slice of the summed grads
        self.span: dict[int, tuple[int, int]] = {}  # piece -> (first, last) array index

    def mine(self) -> np.ndarray:
        """My slice of the flat parameters: the only numbers this rank updates (my slice
        of the masters when the policy keeps them)."""
        if self.master is not None:
            return self.master
        return self.compute_slice()

    def compute_slice(self) -> np.ndarray:
        """My slice of the parameters the model computes with (16-bit under --mixed)."""
        if self.flat is None:
            return self.shard
        return self.flat[self.layout.start:self.layout.stop]

    def reduce_scatter(self, grads: np.ndarray, a: int, b: int) -> np.ndarray:
        """Sum the gradients of flat range [a, b) over the group; return my part of it."""
        if self.group.size == 1:
            return grads.copy()
        # exercise: zero1
        counts = self.layout.overlap(a, b)
        mine = np.empty(counts[self.layout.rank], dtype=grads.dtype)
        send, op = self.precision.reduction(grads)   # in one dtype: grads and MPI.SUM
        recv = self.precision.landing(mine)          # and the sum lands in `mine` itself
        # [a, b) of every replica's g_i -> the sum, each rank receiving its slice of it
        self.group.Reduce_scatter(send, recv, counts, op=op)
        self.precision.reduced(mine, recv)
        return mine
        # end exercise

    def flat_range(self, piece: Piece) -> tuple[int, int]:
        """The piece's parameters of this space as a range [a, b) of the flat vector."""
        return self.layout.span(*self.span[id(piece)])


def spaces_of(params: list[Parameter], mesh: Mesh, precision: FullPrecision = FULL
              ) -> list[Space]:
    """The flat vectors: dense weights over dp, expert weights (if any) over edp (with
    context parallelism over dp x cp and edp x cp: mesh.dp_cp, mesh.edp_cp)."""
    groups = {"dp": mesh.dp_cp, "edp": mesh.edp_cp}  # with cp, every cp coordinate too
    if any(p.sync not in groups for p in params):
        raise ValueError("ZeRO here shards parameters replicated over dp or edp only")
    return [Space([p for p in params if p.sync == sync], group, precision)
            for sync, group in groups.items() if any(p.sync == sync for p in params)]


class Zero1:
    """Stage 1: shard the optimizer state. Parameters live in flat buffers (each `p.data`
    is a view into its space's buffer), so the Allgather lands in them directly."""

    stage = 1
    clipper = None  # clip.Clipper with --clip-grad-norm: called on my slices
    backward_seed = 1.0  # backward starts from 1: the Reduce_scatter's sum is divided

    def __init__(self, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer,
                 precision: FullPrecision = FULL) -> None:
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        # the replicas: dp ranks, and with context parallelism dp x cp (mesh.dp_cp)
        self.dp, self.optimizer, self.precision = mesh.shape.replicas, optimizer, precision
        self.spaces = spaces_of(self.params, mesh, precision)

    def my_slices(self) -> list[np.ndarray]:
        """My slice of each flat vector: the only numbers this rank updates."""
        return [space.mine() for space in self.spaces]

    def step(self) -> None:
        shards = []
        for space in self.spaces:
            grads = np.concatenate([grad_or_zeros(p).ravel() for p in space.params])  # (Psi,)
            shards.append(space.reduce_scatter(grads, 0, space.layout.total))
            placement.summed(space.params, space.group)  # Partial -> my slice of the sum
        if self.update(shards):
            self.allgather_params()
        self.check_replicated()

    def update(self, grad_shards: list[np.ndarray]) -> bool:
        """g = (sum_i g_i) / dp on my slices, then the optimizer on my slices only: its
        state (Adam's m and v) is created with their shapes. Expert gradients, summed
        over edp, are divided by dp too (data_parallel.allreduce_gradients says why).
        The precision policy may skip the step on every rank (fp16: an overflow on one;
        returns False: nothing updated) and remakes my compute slice from the updated
        masters (16-bit under --mixed). Returns True when the parameters changed."""
        for grad_shard in grad_shards:
            grad_shard /= self.dp
        if self.precision.skips(grad_shards):
            return False  # fp16 overflow somewhere: every rank skips (S halved)
        if self.clipper is not None:  # clip.py: my slices are Shard over dp x cp
            pieces = [(p, shard[where]) for space, shard in zip(self.spaces, grad_shards)
                      for p, _, where in self.shard_pieces(space)]
            self.clipper(pieces, grad_shards, zero_sliced=True)
        self.optimizer.step(self.my_slices(), grad_shards, self.held())
        # my compute slice made anew from my updated masters (nothing in one dtype)
        self.precision.refresh(self.my_slices(), [space.compute_slice() for space in self.spaces])
        for space in self.spaces:   # only my slice is new: the flat vector is Shard(0)
            placement.place(space.values, space.group, placement.Shard(0))
        return True

    def allgather_params(self) -> None:
        """Every rank's updated slice to every rank, into the flat buffers behind `p.data`."""
        for space in self.spaces:
            if not all(np.may_share_memory(p.data, space.flat) for p in space.params):
                raise RuntimeError("a parameter's data was replaced after ZeRO flattened it")
            if space.group.size == 1:
                continue
            # exercise: zero1
            counts = space.layout.counts
            # my updated slice -> every replica; every other slice -> me, in place
            space.group.Allgatherv(MPI.IN_PLACE, [wire(space.flat), counts,
                                                  displacements(counts),
                                                  _mpi_type(space.flat)])
            # end exercise
            if placement.ON:  # every slice new on every rank: Shard(0) -> Replicate
                placement.transition("the Allgatherv of the updated slices", space.values,
                                     space.group, placement.Shard, placement.REPLICATED,
                                     space.values)

    def check_replicated(self) -> None:
        """After the step: the next forward reads every parameter whole, so each flat
        vector must be Replicate over its group again (placement/__init__.py; a no-op unless
        `--check-placements`). Every rank of the group stops at the same step."""
        if placement.ON:
            for space in self.spaces:
                for axis, found in placement.of(space.values).items():
                    raise placement.refuse("the next forward", space.values, axis, found,
                                           placement.REPLICATED)

    def held(self) -> list[list[Held]]:
        """What my slices hold, for the optimizer (optim.Held): each box of each
        parameter a slice cuts, in the full array. A flat slice is 1-D, the parameters
        in it are not: a matrix crossing a partition boundary is two boxes on two ranks,
        and Muon (core/muon.py) brings them together."""
        out = []
        for space in self.spaces:
            shapes = {id(p): shape for p, shape in zip(space.params, space.layout.shapes)}
            out.append([Held(p.name, in_full_array(box, p.full_index),
                             in_full_array(tuple(slice(0, n) for n in shapes[id(p)]),
                                           p.full_index), where)
                        for p, box, where in self.shard_pieces(space)])
        return out

    @staticmethod
    def shard_pieces(space: Space) -> list[tuple[Parameter, tuple[slice, ...], slice]]:
        """My slice of a flat vector in the model's words: for each parameter it touches,
        each box of it (flat_boxes) as (the parameter, the box of its LOCAL array, where
        the box's elements sit in my slice). In order, they tile my slice."""
        out = []
        layout = space.layout  # shapes of the local arrays (ZeRO-3 may have dropped p.data)
        for p, shape, offset, size in zip(space.params, layout.shapes, layout.offsets,
                                          layout.sizes):
            lo, hi = max(offset, layout.start), min(offset + size, layout.stop)
            at = lo - layout.start  # where this parameter's run starts in my slice
            for box in flat_boxes(shape, lo - offset, hi - offset):
                count = int(np.prod([part.stop - part.start for part in box], dtype=np.int64))
                out.append((p, box, slice(at, at + count)))
                at += count
        return out

    def checkpoint_pieces(self) -> tuple[list[Parameter], dict[str, list[np.ndarray]]]:
        """What this rank saves: one piece per box of my slices, named and indexed in the
        full canonical array (`full_index` = the box shifted by the parameter's own), with
        the parameters and the optimizer state (Adam's m, v) of those elements. Read from
        my slices, so ZeRO-3 needs no gather; the replicas' pieces tile the full state."""
        slots = self.optimizer.state_arrays()  # slot -> one flat array per space
        pieces, state = [], {slot: [] for slot in slots}
        for i, space in enumerate(self.spaces):
            values = space.mine()
            for p, box, where in self.shard_pieces(space):
                shape = tuple(part.stop - part.start for part in box)
                pieces.append(Parameter(values[where].reshape(shape), p.name,
                                        full_index=in_full_array(box, p.full_index)))
                for slot, arrays in slots.items():
                    state[slot].append(arrays[i][where].reshape(shape))
        return pieces, state

    def slice_state(self, full: dict[str, np.ndarray]) -> list[np.ndarray]:
        """My slices of one optimizer slot (Adam's m or v), cut from its full canonical
        arrays (name -> array): the inverse of `checkpoint_pieces`. One flat array per
        space, as `update` hands the optimizer my slice of each."""
        out = []
        for space in self.spaces:
            mine = np.empty(space.layout.counts[space.layout.rank], dtype=space.mine().dtype)
            for p, box, where in self.shard_pieces(space):
                mine[where] = full[p.name][in_full_array(box, p.full_index)].ravel()
            out.append(mine)
        return out

    def materialize(self) -> None:
        """Every parameter is whole in `p.data` after each step (stage 3 overrides)."""

    def use_masters(self) -> None:
        """Point every `p.data` at its whole master (the end of a --mixed run: what
        --check and --dump read): each rank's master slice Allgathered into a full
        master-dtype flat vector per space. No-op without masters (one dtype)."""
        if not self.master_slices():
            return
        for space in self.spaces:
            whole = np.empty(space.layout.total, dtype=space.master.dtype)
            counts = space.layout.counts
            if space.group.size == 1:
                whole[...] = space.master
            else:  # my master slice -> every replica; theirs -> me
                space.group.Allgatherv(space.master, [whole, counts, displacements(counts),
                                                      _mpi_type(whole)])
            for p, view in zip(space.params, space.layout.views(whole)):
                p.data = view

    def master_slices(self) -> list[np.ndarray]:
        """The master slices this rank keeps (none in one dtype)."""
        return [space.master for space in self.spaces if space.master is not None]

    def memory(self) -> ModelStates:
        """Bytes this rank holds: the flat parameters, full gradients, my optimizer state."""
        return measure([space.flat for space in self.spaces], [p.grad for p in self.params],
                       self.optimizer.held_state(), self.master_slices())


class Zero2(Zero1, Hooks):
    """Stage 2: also shard the gradients. After each piece's backward (every microbatch)
    its gradients are Reduce_scattered into `grad_shard` and the full ones dropped: an
    MoE block's dense part over dp, its experts' over edp."""

    stage = 2

    def __init__(self, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer,
                 precision: FullPrecision = FULL) -> None:
        super().__init__(chunks, mesh, optimizer, precision)
        self.pieces = install_hooks(chunks, self)
        for space in self.spaces:  # --mixed: my slice of the main gradients, master dtype
            space.grad_shard = np.zeros(space.layout.counts[space.layout.rank],
                                        dtype=space.mine().dtype)
            index = {id(p): j for j, p in enumerate(space.params)}
            covered = []
            for piece in self.pieces:
                where = [index[id(p)] for p in piece.parameters() if id(p) in index]
                if where:
                    space.span[id(piece)] = (where[0], where[-1])
                    covered += where
            if covered != list(range(len(space.params))):
                raise ValueError("ZeRO-2/3 needs every parameter in a piece of the model, "
                                 "in order")

    def after_backward(self, piece: Piece) -> None:
        """The piece's gradients of this microbatch are complete: Reduce_scatter, drop.
        (Under a zero-bubble schedule this runs after the piece's deferred weight
        gradients; a gradient another microbatch already added is simply sent now.)"""
        for space in self.spaces:
            if id(piece) not in space.span:
                continue
            a, b = space.flat_range(piece)
            first, last = space.span[id(piece)]
            grads = np.zeros(b - a, dtype=space.grad_shard.dtype)  # (b - a,); absent = zero
            for p, view in zip(space.params[first:last + 1],
                               space.layout.views(grads, first, last)):
                if p.grad is not None:
                    view[...] = p.grad
            space.grad_shard[space.layout.mine(a, b)] += space.reduce_scatter(grads, a, b)
            placement.summed(space.params[first:last + 1], space.group)  # Partial -> my slice
        for p in piece.parameters():
            p.grad = None  # the full gradient is dropped: my slice of the sum stays

    def step(self) -> None:
        if self.update([space.grad_shard for space in self.spaces]):
            self.allgather_params()
        self.check_replicated()
        for space in self.spaces:
            space.grad_shard[...] = 0.0  # the next step accumulates afresh

    def memory(self) -> ModelStates:
        """The flat parameters, my slice of the gradient (and any not yet dropped), my
        optimizer state."""
        return measure([space.flat for space in self.spaces],
                       [space.grad_shard for space in self.spaces]
                       + [p.grad for p in self.params], self.optimizer.held_state(),
                       self.master_slices())


class Zero3(Zero2):
    """Stage 3: also shard the parameters. A piece's parameters exist in full only
    from just before its forward (or backward) to just after it."""

    stage = 3

    def __init__(self, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer,
                 precision: FullPrecision = FULL) -> None:
        super().__init__(chunks, mesh, optimizer, precision)
        for space in self.spaces:  # (Psi/N,): my slice, the only copy I keep (16-bit
            space.shard = space.compute_slice().copy()  # under --mixed, beside the master)
            space.flat = None
        self.gathered: set[int] = set()
        for p in self.params:
            p.data = np.empty(0, dtype=self.spaces[0].shard.dtype)  # dropped until gathered

    def gather(self, piece: Piece) -> None:
        """Allgather the piece's parameters: every replica sends its part of them. The
        precision policy says in which words they travel (parallel/mixed.py
        `gathering`: the numbers as they are, or under --fp8-allgather 8-bit ones) and
        reads the whole piece back from what arrived (`gathered`)."""
        for space in self.spaces:
            if id(piece) not in space.span:
                continue
            a, b = space.flat_range(piece)
            if space.group.size == 1:
                whole = space.shard[a:b].copy()
            else:  # my part of the piece -> every replica; the other parts -> me
                mine, arriving = self.precision.gathering(space, a, b)
                space.group.Allgatherv(mine, arriving)
                whole = self.precision.gathered(space, a, b, arriving)
            first, last = space.span[id(piece)]
            for p, view in zip(space.params[first:last + 1],
                               space.layout.views(whole, first, last)):
                p.data = view
        self.gathered.add(id(piece))

    def drop(self, piece: Piece) -> None:
        for p in piece.parameters():
            p.data = np.empty(0, dtype=self.spaces[0].shard.dtype)
        self.gathered.discard(id(piece))

    def before_forward(self, piece: Piece) -> None:
        self.gather(piece)

    def after_forward(self, piece: Piece) -> None:
        self.drop(piece)

    def before_backward(self, piece: Piece) -> None:
        if id(piece) not in self.gathered:  # a block has two outputs (h, aux): gather once
            self.gather(piece)

    def after_backward(self, piece: Piece) -> None:
        super().after_backward(piece)
        self.drop(piece)

    def step(self) -> None:
        # no Allgather: the next forward gathers piece by piece
        self.update([space.grad_shard for space in self.spaces])
        for space in self.spaces:
            space.grad_shard[...] = 0.0

    def materialize(self) -> None:
        """Gather every piece, so `p.data` is whole (for --dump/--check and checkpoints)."""
        for piece in self.pieces:
            self.gather(piece)

    def memory(self) -> ModelStates:
        """My slice of everything (and whatever piece is gathered at the moment)."""
        return measure([space.shard for space in self.spaces] + [p.data for p in self.params],
                       [space.grad_shard for space in self.spaces]
                       + [p.grad for p in self.params], self.optimizer.held_state(),
                       self.master_slices())


def make_zero(stage: int, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer,
              precision: FullPrecision = FULL) -> Zero1:
    """The ZeRO stage `stage` (1, 2 or 3) updater for this rank's chunks (`precision`:
    the precision policy, parallel/mixed.py)."""
    return {1: Zero1, 2: Zero2, 3: Zero3}[stage](chunks, mesh, optimizer, precision)
