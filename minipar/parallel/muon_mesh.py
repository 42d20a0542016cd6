"""How Muon's matrix pieces meet over the mesh (the rule and the plan: core/muon.py).

What this file teaches: an optimizer that needs whole matrices adds one kind of
traffic to a step, and only two shapes of it. Pieces of a matrix travel point to
point over the world (one Isend per pair of ranks per direction and per phase,
`Isend`/`Irecv` over `world` in the ledger): to a matrix's home and back
(`--muon-mode layer-sharded`), or to every holder (`duplicated`). Or they do not
travel at all and the Newton-Schulz iteration runs on TP shards where they lie, the
Gram matrix of the sharded side summed by one Allreduce over tp per iteration
(`distributed`, `orthogonalize_sharded`). docs/design.md, "Muon".

    mpiexec -n 4 python -m minipar train --model gpt --dp 2 --tp 2 --optimizer muon \\
        --muon-mode distributed --check --ledger
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minipar.comm import trace
from minipar.comm.collectives import Group
from minipar.comm.mesh import Mesh
from minipar.core import muon
from minipar.core.muon import Box, Route

TAG = 6060   # the point-to-point tag of Muon's pieces


def orthogonalize_sharded(u: np.ndarray, shape: tuple[int, int], sharded_axis: int,
                          group: Group, steps: int) -> np.ndarray:
    """Newton-Schulz on a matrix of `shape` split over `group` along `sharded_axis` of U
    (0: rows, 1: columns); `u` is this rank's shard, the result its shard of X.

    With X short and wide (m' <= n'): when X's columns are split, A = X X^T is the sum
    of the shards' own X_i X_i^T (one Allreduce of m' x m' per iteration) and each shard
    is updated alone, X_i <- a X_i + (b A + c A A) X_i. When X's rows are split, the
    same step reads X (a I + b B + c B B) with B = X^T X = sum_i X_i^T X_i (n' x n').
    The norm is one more Allreduce, of one number. Equal to `muon.orthogonalize` up to
    the order of the sums (float64: ~1e-15); every shard holder gets the same Gram
    matrix, so the dp replicas of a shard stay bitwise equal."""
    a, b, c = muon.NS_COEFFICIENTS
    tall = shape[0] > shape[1]
    x = u.T if tall else u
    split_cols = (sharded_axis == 1) != tall   # X's columns are the sharded side
    # exercise: muon-sharded
    squares = np.array([float(np.sum(x * x))])
    group.Allreduce(MPI.IN_PLACE, squares, op=MPI.SUM)
    x = x / max(float(np.sqrt(squares[0])), muon.EPS)
    for _ in range(steps):
        gram = x @ x.T if split_cols else x.T @ x
        group.Allreduce(MPI.IN_PLACE, gram, op=MPI.SUM)   # the Gram matrix, whole
        poly = b * gram + c * (gram @ gram)
        x = a * x + (poly @ x if split_cols else x @ poly)
    # end exercise
    return x.T if tall else x


class MeshMeeting:
    """muon.Meeting over a mesh: the world for the pieces, tp for the Gram matrices."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.rank = mesh, mesh.rank

    def allgather(self, obj: object) -> list:
        """Every rank's `obj` (the box lists, once: a call with no elements)."""
        return self.mesh.world.allgather(obj)

    def agree(self, sharded: list[str]) -> None:
        """The split matrices this rank will iterate must be its tp peers' too, in the
        same order (each iteration is an Allreduce over tp): one allgather of the names
        at the first step, and a RuntimeError on every rank of the group if they differ
        (ZeRO slices that cut the tp ranks' flat vectors differently would)."""
        lists = self.mesh.tp.allgather(sharded)
        if any(names != lists[0] for names in lists):
            raise RuntimeError("--muon-mode distributed: the tp ranks would iterate different "
                               "split matrices (their ZeRO slices cut them differently); use "
                               "--muon-mode layer-sharded or duplicated")

    def orthogonalize_sharded(self, u: np.ndarray, shape: tuple[int, int],
                              sharded_axis: int, steps: int) -> np.ndarray:
        """`orthogonalize_sharded` over this rank's tp group (looked up at call time, so
        `--inject-bug muon-tp-local-shard` can swap it)."""
        return orthogonalize_sharded(u, shape, sharded_axis, self.mesh.tp, steps)

    def exchange(self, table: Route, arrays: dict, dtype: np.dtype,
                 cut: bool = False) -> dict[tuple[str, Box], np.ndarray]:
        """Send each peer its pieces (one message, the pieces in plan order), receive
        mine. `arrays`: (name, box) -> array, or with `cut` (name, region) -> X from
        which each box is cut. Returns (name, box) -> the received piece."""
        if not table:
            return {}

        def piece(key: tuple[str, Box]) -> np.ndarray:
            if not cut:
                return arrays[key]
            for (name, region), x in arrays.items():
                if name == key[0] and muon._inside(key[1], region):
                    return x[muon._local(key[1], region)]
            raise KeyError(key)

        world = self.mesh.world
        requests, inbox = [], []
        for peer, (_, receive) in sorted(table.items()):
            if receive:
                buf = np.empty(sum(muon._size(box) for _, box in receive), dtype=dtype)
                inbox.append((buf, receive))
                requests.append(world.Irecv(buf, source=peer, tag=TAG))
        for peer, (send, _) in sorted(table.items()):
            if send:
                buf = np.concatenate([piece(key).reshape(-1) for key in send])
                requests.append(world.Isend(buf, dest=peer, tag=TAG))
                inbox.append((buf, []))        # kept alive until the wait
        trace.wait(requests, "Muon's matrix pieces")
        out = {}
        for buf, keys in inbox:
            at = 0
            for name, box in keys:
                size = muon._size(box)
                out[(name, box)] = buf[at:at + size].reshape([b - a for a, b in box])
                at += size
        return out
