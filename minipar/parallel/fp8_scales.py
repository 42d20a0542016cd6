"""FP8 scales over the mesh: the Allreduce(MAX) that makes a scaling group's amax the
unsharded tensor's (docs/design.md, "FP8").

What this file teaches. core/fp8.py computes every amax from what the rank holds; a
group that a mesh axis cuts (a tensorwise weight split by tp, the output columns of a
row-parallel weight, the rows of fc2's input split by columns) is only whole after a
MAX over that axis's ranks. `recipe` hands core/fp8.py that MAX as its `agree`: the
strategies never ask whether a run is in 8 bits, they only hand over the group.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minipar.comm.mesh import Mesh
from minipar.core import fp8


def over_mesh(recipe: fp8.Recipe | None, mesh: Mesh) -> fp8.Recipe | None:
    """The run's FP8 recipe (`fp8.recipe_of`; None without --fp8) made to agree its
    amaxes over the mesh: the Allreduce(MAX) over the axis that cuts a group."""
    if recipe is not None:
        recipe.agree = lambda amaxes, axis: agree_max(mesh, amaxes, axis)
    return recipe


def agree_max(mesh: Mesh, amaxes: np.ndarray, axis: str) -> np.ndarray:
    """The elementwise MAX of `amaxes` over the ranks of `axis` (each rank's amax of its
    shard -> the unsharded group's): one Allreduce, none on a group of one."""
    group = getattr(mesh, axis)
    out = np.ascontiguousarray(amaxes, dtype=np.float32)
    if group.size > 1:  # every shard's amax -> the largest, on every rank of the axis
        group.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
    return out


def begin_step(recipe: fp8.Recipe, chunks: list, updater: object) -> None:
    """The step's weight amaxes before its forward: from the whole weights a rank holds
    (tp's shards agreed in one Allreduce over tp, `Recipe.begin_step`), or under ZeRO-3
    from its flat slices (one Allreduce over each vector's replicas,
    `Recipe.begin_sliced_step`)."""
    spaces = zero3_spaces(updater)
    if spaces is None:
        recipe.begin_step(p for chunk in chunks for p in chunk.parameters())
    else:
        recipe.begin_sliced_step(spaces)


def zero3_spaces(updater: object) -> list[tuple[list, list, fp8.Agree]] | None:
    """ZeRO-3's flat vectors as `Recipe.begin_sliced_step` takes them: for each, its
    parameters, the boxes my slice holds of them with their |values| (parallel/zero.py
    `shard_pieces`, read, not changed), and the MAX over its group (dp, or edp for the
    experts). None for any other updater: its weights are whole on the rank."""
    if getattr(updater, "stage", 0) != 3:
        return None
    out = []
    for space in updater.spaces:
        shapes = dict(zip((id(p) for p in space.params), space.layout.shapes))
        pieces = []
        for p, box, where in updater.shard_pieces(space):
            part = space.shard[where].reshape([b.stop - b.start for b in box])
            pieces.append((_Shaped(p, shapes[id(p)]), box, np.abs(part)))
        params = [_Shaped(p, shapes[id(p)]) for p in space.params]

        def agree(amaxes: np.ndarray, group: object = space.group) -> np.ndarray:
            out = np.ascontiguousarray(amaxes, dtype=np.float32)
            if group.size > 1:  # my slices' amaxes -> the whole weights', every replica
                group.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX)
            return out
        out.append((params, pieces, agree))
    return out


class _Shaped:
    """A parameter's name, the shape of its array on this rank (ZeRO-3 dropped the
    array itself between uses) and its place in the unsharded weight (`full_index`:
    whether tp cut its rows or columns, core/fp8.py `cuts`)."""

    __slots__ = ("name", "shape", "full_index")

    def __init__(self, param: object, shape: tuple[int, ...]) -> None:
        self.name, self.shape = param.name, tuple(shape)
        self.full_index = getattr(param, "full_index", None)


class EightBitGather:
    """--fp8-allgather: ZeRO-3's Allgatherv of a piece moves the 8-bit weights as one
    e4m3 byte each, quantized with the step's agreed scales (every rank holds them
    after `Recipe.begin_sliced_step`'s Allreduce: the scales need no message of their
    own), the other parameters as their two bf16 bytes; each rank knows every rank's
    byte count from the layout alone. The whole piece is decoded back to bf16, which
    the matmul requantizes to the same bytes: the run equals the 16-bit gather's."""

    def __init__(self, recipe: fp8.Recipe) -> None:
        self.recipe = recipe
        self.width_of: dict[int, np.ndarray] = {}   # per flat vector: bytes an element
        self.sent_scales: tuple[tuple, np.ndarray] | None = None   # words' -> decoded

    def widths(self, space: object, a: int, b: int) -> np.ndarray:
        """Bytes each element of the flat range [a, b) of `space` takes on the wire."""
        if id(space) not in self.width_of:
            self.width_of[id(space)] = fp8.word_bytes(
                self.recipe, [p.name for p in space.params], space.layout)
        return self.width_of[id(space)][a:b]

    def words(self, space: object, a: int, b: int) -> tuple[np.ndarray, list]:
        """What I send of the range [a, b) (my elements of it encoded: 8-bit words and
        bf16 bytes) and where every rank's bytes land, as an Allgatherv takes them."""
        layout, widths = space.layout, self.widths(space, a, b)
        scales = fp8.element_scales(self.recipe, [p.name for p in space.params], layout, a, b)
        self.sent_scales = (id(space), a, b), scales   # the gather's decode reads them
        starts = np.cumsum([0, *layout.overlap(a, b)])   # each rank's elements of [a, b)
        sizes = [int(widths[s:e].sum()) for s, e in zip(starts[:-1], starts[1:])]
        mine = slice(int(starts[layout.rank]), int(starts[layout.rank + 1]))
        sent = fp8.encode(space.shard[layout.mine(a, b)], widths[mine], scales[mine])
        data = np.empty(sum(sizes), dtype=np.uint8)
        return sent, [data, sizes, np.cumsum([0, *sizes[:-1]]).tolist(), MPI.BYTE]

    def decoded(self, space: object, a: int, b: int, data: np.ndarray) -> np.ndarray:
        """The range [a, b) in the shard's dtype (bf16) from every rank's bytes, with the
        scales `words` computed for this range (the same step's agreed amaxes)."""
        key, scales = self.sent_scales
        assert key == (id(space), a, b), "decoded() follows words() of the same range"
        return fp8.decode(data, self.widths(space, a, b), scales, space.shard.dtype)
