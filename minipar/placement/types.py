"""What a placement is: replicated, sharded along a dim, or a partial sum, per mesh axis.

What this file teaches: the vocabulary the placement rules are written in. For
each mesh axis (dp, tp, ep, cp, ...) a tensor on a rank is `Replicate()`,
`Shard(dim)` or `Partial("sum" | "avg" | "max")`; an axis a tensor does not list
is Replicate. A communicator names the axis it spans (`axes_of`: the gradient
sync of context parallelism spans dp and cp at once), and a violation is one
line, `refuse`: which tensor is what over which axis, what the op needs, what is
missing, and the model line that called the op.

The rules of the ops are in placement/rules.py (and placement/transformer.py
for attention, the vocabulary-parallel lookup and loss, and MoE's rows); the
switch, the collectives' transitions and the gradient sync in placement/__init__.py,
which is the module every caller imports. docs/design.md, "Placements".
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the same whole values. `grad_summed`: the tensor
    came out of an operator whose backward sums its gradient over the axis (copy_to)."""

    grad_summed: bool = False

    def __str__(self) -> str:
        return "replicated"


@dataclass(frozen=True)
class Shard:
    """Rank k of the axis holds the k-th equal piece along `dim` (negative: from the end)."""

    dim: int

    def __str__(self) -> str:
        return f"sharded along dim {self.dim}"


@dataclass(frozen=True)
class Partial:
    """The true tensor is the sum (or mean, `op="avg"`; or max, `op="max"`: a row
    statistic) of every rank's tensor."""

    op: str = "sum"

    def __str__(self) -> str:
        return {"sum": "a partial sum", "avg": "a partial average"}.get(self.op,
                                                                        f"a partial {self.op}")


Placement = Replicate | Shard | Partial
Placements = dict[str, Placement]        # axis name -> placement; absent = Replicate
REPLICATED = Replicate()


class PlacementError(ValueError):
    """A tensor's placement is not the one the op needs: the line says which and where."""


class HasPlacement(Protocol):
    """What the rules read of a tensor: its name, its number of dims, its shape."""

    name: str
    ndim: int
    shape: tuple[int, ...]


class AxisGroup(Protocol):
    """What the rules read of a communicator: the axis it spans and its size."""

    name: str
    size: int


# The communicators that span two mesh axes at once: the gradient sync of context
# parallelism sums over dp x cp (mesh.py's dp_cp and edp_cp, which the ledger names "dp"
# and "edp": they are told from the plain groups by their size, dp cp). With cp = 1
# the mesh hands out the dp group itself, and an axis of size 1 records nothing.
_COMPOUND = {"dp_cp": ("dp", "cp"), "edp_cp": ("edp", "cp")}
AXIS_SIZES: dict[str, int] = {}   # axis -> size, set by `checking` (unknown: taken as > 1)


def axes_of(group: AxisGroup) -> tuple[str, ...]:
    """The mesh axes a group spans (one, or dp and cp for dp_cp) of size > 1."""
    cp = AXIS_SIZES.get("cp", 1)
    if group.name in ("dp", "edp") and cp > 1 and group.size == AXIS_SIZES.get(group.name, 1) * cp:
        return tuple(a for a in (group.name, "cp") if AXIS_SIZES.get(a, 1) > 1)
    if group.name not in _COMPOUND:
        return (group.name,) if group.size > 1 else ()
    return tuple(a for a in _COMPOUND[group.name] if AXIS_SIZES.get(a, 2) > 1)


def axis_of(group: AxisGroup) -> str:
    """The mesh axis a group spans, by which placements are recorded (the first one of
    a group spanning two)."""
    axes = axes_of(group)
    return axes[0] if axes else _COMPOUND.get(group.name, (group.name,))[0]



# ---------------------------------------------------------------- reading
def of(t: object) -> Placements:
    """The placements of `t` (a Tensor; plain arrays and numbers are replicated)."""
    return getattr(t, "placement", None) or {}


def get(t: object, axis: str) -> Placement:
    """The placement of `t` over one axis."""
    return of(t).get(axis, REPLICATED)


# --------------------------------------------------------------- messages
# the files that implement ops and collectives, relative to the package folder
_INTERNAL = ("placement/__init__.py", "placement/types.py", "placement/rules.py",
             "placement/transformer.py", "core/autograd.py", "core/fused_layers.py",
             "comm/collectives.py", "core/attention.py")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller() -> str:
    """file:line of the model code that called the op (the first frame outside the
    files that implement ops and collectives)."""
    frame = sys._getframe(1)
    while frame is not None and \
            os.path.relpath(frame.f_code.co_filename, _PACKAGE) in _INTERNAL:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    short = path[path.rfind("minipar"):] if "minipar" in path else path
    return f"{short}:{frame.f_lineno}"


_FIX = {(Partial, Replicate): " (an Allreduce is missing)",
        (Shard, Replicate): " (an Allgather is missing)",
        (Replicate, Partial): " (it is already whole: summing it would count it once per rank)",
        (Replicate, Shard): " (a split is missing)",
        (Partial, Shard): " (a Reduce_scatter is missing)"}


def refuse(op: str, t: HasPlacement, axis: str, found: Placement, needed: Placement | str,
           why: str = "") -> PlacementError:
    """The error of one violation, as one line: which tensor is what over which axis,
    what the op needs, why, and where the op was called."""
    label = t.name or "a tensor"
    if not why and not isinstance(needed, str):
        why = _FIX.get((type(found), type(needed)), "")
    return PlacementError(f"{label} is {found} over {axis}; {op} needs it {needed}{why} "
                          f"[at {_caller()}]")


def shard_dim(p: Placement, ndim: int) -> int | None:
    """The sharded dim of `p` counted from the end (-1 = last), or None."""
    return (p.dim - ndim if p.dim >= 0 else p.dim) if isinstance(p, Shard) else None


def axes_among(*tensors: object) -> list[str]:
    return sorted({a for t in tensors for a in of(t)})


def first_name(*tensors: object) -> str:
    return next((t.name for t in tensors if getattr(t, "name", "")), "")

