"""The process grid: world = dp x cp x tp x pp, cut into communicators with `Comm.Split`.

What this file teaches: how one flat list of ranks becomes a 3-D grid, and
which ranks must talk to each other for each kind of parallelism.

Rank order is Megatron's: tp fastest, then cp, then dp, then pp,

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so the ranks of one tensor-parallel group are neighbours (on a real cluster,
GPUs of one node, where the bandwidth is). For MoE, expert parallelism lives
inside the data-parallel axis: `ep` divides `dp`, the ep groups are runs of
`ep` consecutive dp ranks (they split the experts between them), and the
expert-data-parallel ("edp") groups are the dp ranks holding the same experts.

Context parallelism (`cp`, parallel/context_parallel.py) splits every sequence's
positions over the cp ranks of a group. Every weight is replicated over cp as over
dp, so gradients are summed over the dp x cp ranks together: the `dp_cp` group
(and `edp_cp` for expert weights). With cp = 1 those are the dp and edp groups
themselves, and the order above is the one without cp. The ledger records them
under "dp" and "edp": the axis of every replica, as the planner names it.

All the arithmetic is pure (no MPI): `python -m minipar mesh --dp 2 --tp 2 --pp 2`
prints the table, and the tests check it for every factorization of 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minipar.comm.collectives import Group, Ledger

CP_MODES = ("allgather", "ring", "zigzag", "ulysses")  # --cp-mode (context_parallel.py)
AXES = ("dp", "tp", "pp", "ep", "edp", "cp", "dp_cp", "edp_cp")


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the grid's axes. `ep` divides `dp` (experts split inside the dp axis)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """dp x cp: the ranks holding a copy of every replicated weight, each with its own
        share of the global batch's positions (gradients are summed over them, / dp cp)."""
        return self.dp * self.cp

    def problems(self, world_size: int) -> list[str]:
        """Why this mesh cannot run on `world_size` ranks (empty if it can)."""
        out = []
        for axis in ("dp", "tp", "pp", "ep", "cp"):
            if getattr(self, axis) < 1:
                out.append(f"--{axis} must be at least 1 (got {getattr(self, axis)})")
        if out:
            return out
        if self.world != world_size:
            sizes = f"{self.dp}*{self.tp}*{self.pp}" + (f"*{self.cp}" if self.cp > 1 else "")
            out.append(f"the mesh dp*tp*pp{'*cp' if self.cp > 1 else ''} = {sizes} = "
                       f"{self.world} does not fill the {world_size} ranks of the world "
                       f"(run with mpiexec -n {self.world}, or change --dp/--tp/--pp"
                       f"{'/--cp' if self.cp > 1 else ''})")
        if self.dp % self.ep:
            out.append(f"--ep {self.ep} must divide --dp {self.dp} "
                       "(expert parallelism splits the data-parallel axis)")
        return out

    # ---------------------------------------------------------- rank arithmetic
    def rank(self, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """World rank of the grid point (tp fastest, then cp, then dp, then pp)."""
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def coords(self, rank: int) -> dict[str, int]:
        """Grid coordinates of a world rank, on every axis including ep and edp."""
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return {"dp": dp_rank, "tp": tp_rank, "pp": pp_rank, "cp": cp_rank,
                "ep": dp_rank % self.ep, "edp": dp_rank // self.ep,
                "dp_cp": dp_rank * self.cp + cp_rank,
                "edp_cp": dp_rank // self.ep * self.cp + cp_rank}

    def group_key(self, rank: int, axis: str) -> tuple[int, ...]:
        """Ranks with equal key are in the same `axis` group (the `color` of Comm.Split)."""
        c = self.coords(rank)
        block = c["dp"] // self.ep  # which run of ep consecutive dp ranks
        keys = {"dp": (c["tp"], c["cp"], c["pp"]), "tp": (c["dp"], c["cp"], c["pp"]),
                "pp": (c["dp"], c["cp"], c["tp"]), "cp": (c["dp"], c["tp"], c["pp"]),
                "ep": (block, c["cp"], c["tp"], c["pp"]),
                "edp": (c["ep"], c["cp"], c["tp"], c["pp"]),
                "dp_cp": (c["tp"], c["pp"]), "edp_cp": (c["ep"], c["tp"], c["pp"])}
        return keys[axis]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis` as a sorted list of world ranks."""
        found: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world):
            found.setdefault(self.group_key(r, axis), []).append(r)
        return sorted(found.values())

    def table(self) -> str:
        """A slide-ready table: each rank's coordinates and its group on every axis.
        Linear in the ranks: each axis's groups are found once; a group of more than
        8 ranks (always evenly spaced) is written by its first two and last members."""
        axes = ["dp", "tp", "pp"] + (["ep", "edp"] if self.ep > 1 else []) + (
            ["cp", "dp_cp"] + (["edp_cp"] if self.ep > 1 else []) if self.cp > 1 else [])
        head = ["rank"] + [f"{a}_rank" for a in axes] + [f"{a} group" for a in axes]
        written = {a: {} for a in axes}   # axis -> world rank -> its group, as text
        for a in axes:
            for group in self.groups(a):
                text = ",".join(map(str, group)) if len(group) <= 8 else (
                    f"{group[0]},{group[1]},...,{group[-1]}")
                written[a].update(dict.fromkeys(group, text))
        rows = [head]
        for r in range(self.world):
            c = self.coords(r)
            rows.append([str(r)] + [str(c[a]) for a in axes] + [written[a][r] for a in axes])
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        title = f"mesh dp={self.dp} tp={self.tp} pp={self.pp}" + (
            f" ep={self.ep}" if self.ep > 1 else "") + (
            f" cp={self.cp}" if self.cp > 1 else "") + f": {self.world} ranks, tp fastest" + (
            ", then cp; gradients sum over the dp_cp group (dp x cp)" + (
                ", experts' over edp_cp" if self.ep > 1 else "") if self.cp > 1 else "")
        return "\n".join([title, *lines])

    def _group_index(self, rank: int, axis: str) -> int:
        return next(i for i, g in enumerate(self.groups(axis)) if rank in g)


class Mesh:
    """This rank's place in the grid and its communicators, one per axis.

    `mesh.dp`, `mesh.tp`, `mesh.pp`, `mesh.ep`, `mesh.edp`, `mesh.cp` are `comm.Group`s:
    the MPI communicator plus the ledger that records every byte sent on that axis.
    `mesh.dp_cp` and `mesh.edp_cp` are where replicated gradients are summed: the
    dp (edp) ranks of every cp coordinate; with cp = 1, the dp (edp) groups themselves.
    """

    def __init__(self, shape: MeshShape, world: object, ledger: Ledger) -> None:
        from minipar.comm.collectives import (
            Group,  # here: comm/collectives.py loads mpi4py.MPI, MeshShape needs none
        )

        self.shape = shape
        self.rank = world.Get_rank()
        self.coords = shape.coords(self.rank)
        self.world = Group(world, "world", ledger)
        self.ledger = ledger
        split: dict[str, Group] = {}
        for axis in AXES:
            if axis.endswith("_cp") and shape.cp == 1:
                continue  # the same ranks as dp / edp: no second communicator
            color = shape._group_index(self.rank, axis)  # which group of `axis` I am in
            # Comm.Split: ranks with the same color form one communicator, ordered by key
            # the ledger names dp x cp "dp" (edp x cp "edp"): every replica of a weight
            # (with cp > 1 the pure dp group carries no traffic of its own)
            name = axis.removesuffix("_cp")
            split[axis] = Group(world.Split(color, key=self.rank), name, ledger)
        self.dp, self.tp, self.pp = split["dp"], split["tp"], split["pp"]
        self.ep, self.edp, self.cp = split["ep"], split["edp"], split["cp"]
        self.dp_cp = split.get("dp_cp", self.dp)
        self.edp_cp = split.get("edp_cp", self.edp)
        self._groups = list(split.values())

    def free(self) -> None:
        """Release the communicators (a sweep builds many meshes in one process)."""
        for group in self._groups:
            group.comm.Free()
