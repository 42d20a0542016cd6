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

Placements (placement.py): every parameter is Replicate over dp as in plain data
parallelism and its gradient Partial over dp; the Reduce_scatter turns the flat
gradient into Shard(0) of its sum (each rank its slice), and the Allgather turns the
updated slices back into Replicate parameters. `placement.summed` states the first
transition for the parameters; the flat buffers themselves carry no placement.

Checkpoints (checkpoint.py) speak of parameters, not flat slices: each rank
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
from minipar.memory import FlatLayout, ModelStates, displacements, measure
from minipar.mesh import Mesh
from minipar.nn import Module, Parameter
from minipar.optim import Optimizer
from minipar.parallel.data_parallel import Hooks, Piece, grad_or_zeros, install_hooks
from minipar.shards import flat_boxes, in_full_array


def _mpi_type(array: np.ndarray) -> MPI.Datatype:
    return MPI._typedict[array.dtype.char]


class Zero1:
    """Stage 1: shard the optimizer state. Parameters live in one flat buffer (each
    `p.data` is a view into it), so the Allgather lands in them directly."""

    stage = 1

    def __init__(self, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer) -> None:
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        if any(p.sync != "dp" for p in self.params):
            raise ValueError("ZeRO here shards parameters replicated over dp (sync='dp') only")
        # the replicas: dp ranks, and with context parallelism dp x cp (mesh.dp_cp)
        self.group, self.dp, self.optimizer = mesh.dp_cp, mesh.shape.replicas, optimizer
        self.layout = FlatLayout([p.data.shape for p in self.params], mesh.dp_cp.size,
                                 mesh.dp_cp.rank)
        self.flat = np.concatenate([p.data.ravel() for p in self.params])  # (Psi,)
        for p, view in zip(self.params, self.layout.views(self.flat)):
            p.data = view

    def my_params(self) -> np.ndarray:
        """My slice of the flat parameters: the only numbers this rank updates."""
        return self.flat[self.layout.start:self.layout.stop]

    def step(self) -> None:
        grads = np.concatenate([grad_or_zeros(p).ravel() for p in self.params])  # (Psi,)
        mine = self.reduce_scatter(grads, 0, self.layout.total)
        placement.summed(self.params, self.group)  # Partial -> my slice of the sum
        self.update(mine)
        self.allgather_params()

    def reduce_scatter(self, grads: np.ndarray, a: int, b: int) -> np.ndarray:
        """Sum the gradients of flat range [a, b) over dp; return my part of the sum."""
        if self.group.size == 1:
            return grads.copy()
        # exercise: zero1
        counts = self.layout.overlap(a, b)
        mine = np.empty(counts[self.layout.rank], dtype=grads.dtype)
        # [a, b) of every rank's g_i -> the sum, each rank receiving its slice of it
        self.group.Reduce_scatter(grads, mine, counts, op=MPI.SUM)
        return mine
        # end exercise

    def update(self, grad_shard: np.ndarray) -> None:
        """g = (sum_i g_i) / dp on my slice, then the optimizer on my slice only: its
        state (Adam's m and v) is created with my slice's shape."""
        grad_shard /= self.dp
        self.optimizer.step([self.my_params()], [grad_shard])

    def allgather_params(self) -> None:
        """Every rank's updated slice to every rank, into the flat buffer behind `p.data`."""
        if not all(np.may_share_memory(p.data, self.flat) for p in self.params):
            raise RuntimeError("a parameter's data was replaced after ZeRO flattened it")
        if self.group.size == 1:
            return
        # exercise: zero1
        counts = self.layout.counts
        # my updated slice -> every rank; every other slice -> me, in place in the flat buffer
        self.group.Allgatherv(MPI.IN_PLACE, [self.flat, counts, displacements(counts),
                                             _mpi_type(self.flat)])
        # end exercise

    def shard_pieces(self) -> list[tuple[Parameter, tuple[slice, ...], slice]]:
        """My slice of the flat vector in the model's words: for each parameter it
        touches, each box of it (flat_boxes) as (the parameter, the box of its LOCAL
        array, where the box's elements sit in my slice). In order, they tile my slice."""
        out = []
        layout = self.layout  # shapes of the local arrays (ZeRO-3 may have dropped p.data)
        for p, shape, offset, size in zip(self.params, layout.shapes, layout.offsets,
                                          layout.sizes):
            lo, hi = max(offset, layout.start), min(offset + size, layout.stop)
            at = lo - layout.start  # where this parameter's run starts in my slice
            for box in flat_boxes(shape, lo - offset, hi - offset):
                count = int(np.prod([part.stop - part.start for part in box], dtype=np.int64))
                out.append((p, box, slice(at, at + count)))
                at += count
        return out

    def checkpoint_pieces(self) -> tuple[list[Parameter], dict[str, list[np.ndarray]]]:
        """What this rank saves: one piece per box of my slice, named and indexed in the
        full canonical array (`full_index` = the box shifted by the parameter's own), with
        the parameters and the optimizer state (Adam's m, v) of those elements. Read from
        my slice, so ZeRO-3 needs no gather; the dp ranks' pieces tile the full state."""
        values = self.my_params()
        slots = {slot: arrays[0] for slot, arrays in self.optimizer.state_arrays().items()}
        pieces, state = [], {slot: [] for slot in slots}
        for p, box, where in self.shard_pieces():
            shape = tuple(part.stop - part.start for part in box)
            pieces.append(Parameter(values[where].reshape(shape), p.name,
                                    full_index=in_full_array(box, p.full_index)))
            for slot, flat in slots.items():
                state[slot].append(flat[where].reshape(shape))
        return pieces, state

    def slice_state(self, full: dict[str, np.ndarray]) -> list[np.ndarray]:
        """My slice of one optimizer slot (Adam's m or v), cut from its full canonical
        arrays (name -> array): the inverse of `checkpoint_pieces`. A list of one flat
        array, as `update` hands the optimizer [my slice of the parameters]."""
        mine = np.empty(self.layout.counts[self.layout.rank], dtype=self.my_params().dtype)
        for p, box, where in self.shard_pieces():
            mine[where] = full[p.name][in_full_array(box, p.full_index)].ravel()
        return [mine]

    def materialize(self) -> None:
        """Every parameter is whole in `p.data` after each step (stage 3 overrides)."""

    def memory(self) -> ModelStates:
        """Bytes this rank holds: the flat parameters, full gradients, my optimizer state."""
        return measure([self.flat], [p.grad for p in self.params],
                       self.optimizer.state_arrays())


class Zero2(Zero1, Hooks):
    """Stage 2: also shard the gradients. After each piece's backward (every microbatch)
    its gradients are Reduce_scattered into `grad_shard` and the full ones dropped."""

    stage = 2

    def __init__(self, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer) -> None:
        super().__init__(chunks, mesh, optimizer)
        self.grad_shard = np.zeros(self.layout.counts[self.layout.rank], dtype=self.flat.dtype)
        self.pieces = install_hooks(chunks, self)
        index = {id(p): j for j, p in enumerate(self.params)}
        self.span: dict[int, tuple[int, int]] = {}  # piece -> (first, last) array index
        covered = []
        for piece in self.pieces:
            where = [index[id(p)] for p in piece.parameters()]
            self.span[id(piece)] = (where[0], where[-1])
            covered += where
        if covered != list(range(len(self.params))):
            raise ValueError("ZeRO-2/3 needs every parameter in a piece of the model, in order")

    def flat_range(self, piece: Piece) -> tuple[int, int]:
        """The piece's parameters as a range [a, b) of the flat vector."""
        return self.layout.span(*self.span[id(piece)])

    def after_backward(self, piece: Piece) -> None:
        """The piece's gradients of this microbatch are complete: Reduce_scatter, drop.
        (Under a zero-bubble schedule this runs after the piece's deferred weight
        gradients; a gradient another microbatch already added is simply sent now.)"""
        a, b = self.flat_range(piece)
        first, last = self.span[id(piece)]
        params = piece.parameters()
        grads = np.zeros(b - a, dtype=self.grad_shard.dtype)  # (b - a,); absent = zero
        for p, view in zip(params, self.layout.views(grads, first, last)):
            if p.grad is not None:
                view[...] = p.grad
        self.grad_shard[self.layout.mine(a, b)] += self.reduce_scatter(grads, a, b)
        placement.summed(params, self.group)       # Partial -> my slice of the sum
        for p in params:
            p.grad = None  # the full gradient is dropped: my slice of the sum stays

    def step(self) -> None:
        self.update(self.grad_shard)
        self.allgather_params()
        self.grad_shard[...] = 0.0  # the next step accumulates afresh

    def memory(self) -> ModelStates:
        """The flat parameters, my slice of the gradient (and any not yet dropped), my
        optimizer state."""
        return measure([self.flat], [self.grad_shard] + [p.grad for p in self.params],
                       self.optimizer.state_arrays())


class Zero3(Zero2):
    """Stage 3: also shard the parameters. A piece's parameters exist in full only
    from just before its forward (or backward) to just after it."""

    stage = 3

    def __init__(self, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer) -> None:
        super().__init__(chunks, mesh, optimizer)
        self.shard = self.my_params().copy()  # (Psi/N,): my slice, the only copy I keep
        self.flat = None
        self.gathered: set[int] = set()
        for p in self.params:
            p.data = np.empty(0, dtype=self.shard.dtype)  # dropped until gathered

    def my_params(self) -> np.ndarray:
        return self.shard if self.flat is None else super().my_params()

    def gather(self, piece: Piece) -> None:
        """Allgather the piece's parameters: every rank sends its part of them."""
        a, b = self.flat_range(piece)
        whole = np.empty(b - a, dtype=self.shard.dtype)
        counts = self.layout.overlap(a, b)
        if self.group.size == 1:
            whole[...] = self.shard[a:b]
        else:  # my part of the piece -> every rank; the other parts -> me
            self.group.Allgatherv(self.shard[self.layout.mine(a, b)],
                                  [whole, counts, displacements(counts), _mpi_type(whole)])
        first, last = self.span[id(piece)]
        for p, view in zip(piece.parameters(), self.layout.views(whole, first, last)):
            p.data = view
        self.gathered.add(id(piece))

    def drop(self, piece: Piece) -> None:
        for p in piece.parameters():
            p.data = np.empty(0, dtype=self.shard.dtype)
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
        self.update(self.grad_shard)  # no Allgather: the next forward gathers piece by piece
        self.grad_shard[...] = 0.0

    def materialize(self) -> None:
        """Gather every piece, so `p.data` is whole (for --dump/--check and checkpoints)."""
        for piece in self.pieces:
            self.gather(piece)

    def memory(self) -> ModelStates:
        """My slice of everything (and whatever piece is gathered at the moment)."""
        return measure([self.shard] + [p.data for p in self.params],
                       [self.grad_shard] + [p.grad for p in self.params],
                       self.optimizer.state_arrays())


def make_zero(stage: int, chunks: Sequence[Module], mesh: Mesh, optimizer: Optimizer) -> Zero1:
    """The ZeRO stage `stage` (1, 2 or 3) updater for this rank's chunks."""
    return {1: Zero1, 2: Zero2, 3: Zero3}[stage](chunks, mesh, optimizer)
