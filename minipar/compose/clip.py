"""Gradient clipping by the global norm: which rank counts which piece, then one Allreduce.

What this file teaches: `--clip-grad-norm C` scales the whole model's gradient by

    coefficient = min(1, C / (norm + 1e-6)),   norm = sqrt(sum over parameters of ||g||^2)

the norm of the gradient one process would have (after the DP average). On a mesh
no rank holds all of it, and some of what a rank holds other ranks hold too. The
placements say which is which (placement/__init__.py's words):

    a piece Shard over an axis     (tp columns, a pipeline stage, an ep rank's experts,
                                   a ZeRO slice over dp x cp): every rank of that axis
                                   holds a different piece -> each counts its own
    a piece Replicate over an axis (a LayerNorm over tp, any weight over dp and cp
                                   without ZeRO, a dense weight over ep, DualPipe's
                                   second copy of a stage): the same numbers on every
                                   rank of it -> counted by ONE of them (coordinate 0)

so each rank sums the squares of what it counts (`local_squares`), and ONE Allreduce
of that scalar over the ranks holding different pieces (`norm_group`: the tp, pp or
ep group, or every rank when several axes differ) gives every rank the square of
the global norm (`global_norm`). Every rank then multiplies its gradients by the
same coefficient, before the optimizer. The replicas of a group (dp ranks without
ZeRO) compute the same sum from the same numbers, bit for bit.

Two bugs of real trainers (lesson 08, bugs/catalog.py) are one line each here: clipping by
the norm of a rank's own pieces (no Allreduce: `clip-local-norm`), and counting a
replicated piece on every tp rank (`clip-replicated-counted-tp`). The norm is off,
so the coefficient is, and `--check` catches it on the first clipped step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from minipar.comm.collectives import Group
    from minipar.comm.mesh import Mesh
    from minipar.core.nn import Module, Parameter
    from minipar.settings.config import TrainConfig

EPS = 1e-6   # in the coefficient's denominator: C / (norm + EPS), as torch's clip_grad_norm_

# what each communicator spans, in the coordinates of mesh.MeshShape.coords
SPANS = {"tp": ("tp",), "pp": ("pp",), "ep": ("ep",), "dp": ("dp", "cp", "ep", "edp"),
         "world": ("dp", "cp", "tp", "pp", "ep", "edp")}


def coefficient(norm: float, max_norm: float) -> float:
    """min(1, C / (norm + 1e-6)): the factor every gradient is multiplied by."""
    return min(1.0, max_norm / (norm + EPS))


def reference_norm(grads: Iterable[np.ndarray]) -> float:
    """One process: sqrt of the sum of squares of every gradient (float, in order)."""
    return float(np.sqrt(sum(float(np.vdot(g, g)) for g in grads)))


def clip_reference(grads: Sequence[np.ndarray], max_norm: float) -> float:
    """The one-process clip (train_reference): scale `grads` in place; returns the norm."""
    norm = reference_norm(grads)
    scale = coefficient(norm, max_norm)
    if scale < 1.0:
        for g in grads:
            g *= scale
    return norm


# ----------------------------------------------------------- the placements
def whole(p: Parameter, shape: tuple[int, ...]) -> bool:
    """Does this rank hold the whole canonical array of `p` (shape `shape`)? A piece cut
    by tensor or vocabulary parallelism has a `full_index` covering part of it."""
    if p.full_index is None:
        return True
    return all(len(range(*part.indices(n))) == n
               for part, n in zip(p.full_index, shape) if isinstance(part, slice))


def replicated_axes(p: Parameter, cfg: TrainConfig, shape: tuple[int, ...],
                    zero_sliced: bool) -> frozenset[str]:
    """The mesh axes over which this rank's piece of `p` is the SAME numbers as on the
    other ranks of the axis (placement Replicate), in mesh.coords' names. Every other
    axis holds a different piece (Shard) there.

    - over dp and cp: every weight, unless ZeRO sliced its gradient over them; an expert
      weight (sync "edp") only over its edp group: the ep ranks hold other experts;
    - over tp: a piece held whole (LayerNorms, biases of row-parallel linears, ...).
    (Over pp, DualPipe's second copy of a stage is the mirror rank's first: `Clipper`
    leaves it to the mirror.)"""
    axes = set()
    if not zero_sliced:
        axes |= {"cp", "edp"} if p.sync == "edp" else {"dp", "cp", "ep", "edp"}
    if cfg.tp > 1 and whole(p, shape):
        axes.add("tp")
    return frozenset(axes)


def counted(replicated: frozenset[str], spanned: Sequence[str], coords: dict[str, int]
            ) -> bool:
    """Does this rank count the piece? Over each axis of the norm's group on which the
    piece is replicated, only the rank at coordinate 0 does."""
    return all(coords[axis] == 0 for axis in replicated if axis in spanned)


def differing_axes(cfg: TrainConfig) -> set[str]:
    """The mesh axes (of size > 1) whose ranks hold different pieces of the gradient."""
    axes = {axis for axis in ("tp", "pp") if getattr(cfg, axis) > 1}
    if cfg.ep > 1:
        axes.add("ep")
    if cfg.zero and cfg.dp * cfg.cp > 1:   # ZeRO slices every gradient over dp x cp
        axes.add("dp")
    return axes


def group_name(cfg: TrainConfig) -> str | None:
    """The communicator of the norm's Allreduce, by the ledger's name: the one axis
    whose ranks hold different pieces (tp, pp, ep; "dp" for ZeRO alone: its slices over
    dp x cp), "world" when there are several, None when there are none."""
    axes = differing_axes(cfg)
    if not axes:
        return None
    if axes <= {"dp", "ep"} and "dp" in axes:
        return "dp"
    return next(iter(axes)) if len(axes) == 1 else "world"


def expected_ledger(cfg: TrainConfig) -> dict[tuple[str, str], tuple[int, int]]:
    """What clipping adds to a step's ledger: (group, op) -> (calls, elements), one
    Allreduce of one number (empty without clipping, or with nothing to sum)."""
    name = group_name(cfg) if cfg.clip_grad_norm is not None else None
    return {} if name is None else {(name, "Allreduce"): (1, 1)}


# ------------------------------------------------------------ on the mesh
def local_squares(pieces: Iterable[tuple[np.ndarray, frozenset[str]]],
                  spanned: Sequence[str], coords: dict[str, int]) -> float:
    """This rank's share of norm^2: the squares of each piece it counts."""
    return sum((float(np.vdot(g, g)) for g, replicated in pieces
                if counted(replicated, spanned, coords)), 0.0)   # a float even if none


def global_norm(group: Group | None, squares: float) -> float:
    """sqrt of the sum of every rank's `squares` over the norm's group: ONE Allreduce."""
    from minipar.comm.collectives import allreduce_sum  # here: comm/collectives.py loads mpi4py.MPI

    if group is None:
        return float(np.sqrt(squares))
    # my pieces' sum of squares -> the whole gradient's, on every rank of the group
    return float(np.sqrt(allreduce_sum(group, np.array([squares], dtype=np.float64))[0]))


class Clipper:
    """Built once per run (assemble.make_updater); the updater calls it between the
    gradient sync and the optimizer. `norms` keeps each step's global norm."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, chunks: Sequence[Module]) -> None:
        from minipar.core.nn import canonical_shapes

        self.cfg, self.max_norm = cfg, cfg.clip_grad_norm
        self.coords = mesh.coords
        name = group_name(cfg)
        self.group = {None: None, "tp": mesh.tp, "pp": mesh.pp, "ep": mesh.ep,
                      "dp": mesh.dp_cp, "world": mesh.world}[name]
        self.spanned = SPANS[name] if name else ()
        self.shapes = canonical_shapes(cfg.model_config())
        dualpipe = cfg.schedule == "dualpipe" and cfg.pp > 1
        self.second = {id(p) for chunk in chunks[1:] for p in chunk.parameters()} \
            if dualpipe else set()
        self.norms: list[float] = []

    def placement_of(self, p: Parameter, zero_sliced: bool = False) -> frozenset[str]:
        """The axes over which this rank's gradient of `p` is replicated."""
        return replicated_axes(p, self.cfg, self.shapes[p.name], zero_sliced)

    def __call__(self, pieces: Sequence[tuple[Parameter, np.ndarray]],
                 grads: Sequence[np.ndarray], zero_sliced: bool = False) -> float:
        """Clip: `pieces` are (parameter, the numbers of its gradient this rank holds),
        `grads` the arrays to scale (the same numbers, perhaps as larger buffers).
        Returns the global norm (the same on every rank)."""
        squares = local_squares(((g, self.placement_of(p, zero_sliced)) for p, g in pieces
                                 if id(p) not in self.second),   # DualPipe: the mirror's
                                self.spanned, self.coords)
        norm = global_norm(self.group, squares)
        scale = coefficient(norm, self.max_norm)
        if scale < 1.0:
            for g in grads:
                g *= scale
        self.norms.append(norm)
        return norm
