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
