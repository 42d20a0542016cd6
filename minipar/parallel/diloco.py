"""DiLoCo: data parallelism that talks every H steps instead of every step.

What this file teaches: communication frequency is a knob. Plain data parallelism
(data_parallel.py) Allreduces the gradients every step. DiLoCo (Douillard et al. 2023,
"DiLoCo: Distributed Low-Communication Training of Language Models") lets each dp
replica -- a *worker*, itself any tp x pp x cp mesh -- train alone on its own rows for
H inner steps with its own inner optimizer, then averages what the K = dp workers
learned with ONE Allreduce of the parameters over dp and applies it with an outer
optimizer, SGD with Nesterov momentum:

    Delta = theta - (1/K) sum_k theta_k          # the outer "gradient": theta moved by
    v     = Delta (first outer step) or mu v + Delta
    theta = theta - eta (Delta + mu v)           # torch.optim.SGD(nesterov=True)
    theta_k = theta for every worker             # and the next H inner steps begin

With H = 1, eta = 1, mu = 0 and SGD this is plain data parallelism, exactly.

Streaming DiLoCo (Douillard et al. 2025) cuts the model into P fragments (runs of L/P
blocks; the embedding and the head join fragment 0) whose outer steps are staggered by
H/P inner steps, so no step carries more than about 1/P of the model
(`due`, `dp_allreduce_elements`: the ledger's formula, step by step).

The worker's own communicators come from `worker_groups` (one Comm.Split by the dp
coordinate); inside a worker every strategy runs as on a mesh with dp = 1.
run/diloco_train.py runs the steps (`train_workers`) and the one-process reference
(`train_diloco_reference`: K one-process runs and the rule above, written plainly).

Run it: `mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --outer diloco
--inner-steps 4 --steps 8 --check`; lesson 18.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from minipar.comm.mesh import Mesh, MeshShape
from minipar.core.nn import Parameter

if TYPE_CHECKING:  # the schedule and the formula import without mpi4py.MPI (tests, planner)
    from minipar.comm.collectives import Group, Ledger

BLOCK = re.compile(r"blocks\.(\d+)\.")


# ------------------------------------------------------------ fragments and their steps
def fragment_of(name: str, layers: int, fragments: int) -> int:
    """The fragment of a canonical parameter name: block i is in fragment i // (L/P);
    every parameter outside the blocks (embedding, head) is in fragment 0."""
    found = BLOCK.match(name)
    return 0 if found is None else int(found.group(1)) // (layers // fragments)


def due(step: int, inner_steps: int, fragments: int) -> list[int]:
    """The fragments whose outer step follows inner step `step` (1-based): fragment p
    after steps p H / P + H, p H / P + 2H, ... (its offset p H / P, then every H)."""
    out = []
    for p in range(fragments):
        offset = p * inner_steps // fragments
        if step >= offset + inner_steps and (step - offset) % inner_steps == 0:
            out.append(p)
    return out


def dp_allreduce_elements(fragment_sizes: Sequence[int], inner_steps: int, fragments: int,
                          step: int) -> int:
    """The ledger's formula: the elements of this rank's dp Allreduce after inner step
    `step` (1-based), from the elements it holds of each fragment. Zero on a step no
    fragment syncs (no dp traffic at all), the whole model's share every H steps with
    P = 1, about 1/P of it every H/P steps with P fragments."""
    return sum(fragment_sizes[p] for p in due(step, inner_steps, fragments))


def ledger_differences(records: Sequence[dict], fragment_sizes: Sequence[Sequence[int]],
                       inner_steps: int, fragments: int, steps: int, itemsize: int,
                       first: int = 1) -> list[str]:
    """Every step's dp lines of every rank against the formula, one sentence for each
    that differs (empty when all match). `records`: the per-step ledger (`ledger_steps.json`:
    records with a "step"); `fragment_sizes[rank]`: the elements that rank holds of each
    fragment. Predicted: one Allreduce over dp per fragment due that the rank holds,
    `dp_allreduce_elements` elements of `itemsize` bytes; no other dp line, ever."""
    out = []
    for rank, sizes in enumerate(fragment_sizes):
        for step in range(first, steps + 1):
            got = {r["op"]: r for r in records
                   if r["rank"] == rank and r["step"] == step and r["group"] == "dp"}
            elements = dp_allreduce_elements(sizes, inner_steps, fragments, step)
            calls = sum(1 for p in due(step, inner_steps, fragments) if sizes[p])
            want = {"Allreduce": (calls, elements, elements * itemsize)} if calls else {}
            for op in sorted(set(got) | set(want)):
                line = got.get(op, {"calls": 0, "elements": 0, "bytes": 0})
                measured = (line["calls"], line["elements"], line["bytes"])
                if measured != want.get(op, (0, 0, 0)):
                    out.append(f"rank {rank} step {step}: dp {op} {measured} (calls, "
                               f"elements, bytes), the formula {want.get(op, (0, 0, 0))}")
    return out


# ------------------------------------------------------------------ the workers
def worker_groups(shape: MeshShape, world: object, ledger: Ledger
                  ) -> tuple[Mesh, Group]:
    """This rank's worker, a mesh of its own with dp = 1 (the ranks of its dp coordinate,
    in world order: tp fastest, then cp, then pp), and the dp group the outer step
    Allreduces over (the ranks of the other workers that hold the same pieces).

    Inside a worker the replicas of a weight are its cp ranks only: their gradient sum
    is named "cp" in the ledger, so that "dp" is the outer step's traffic alone."""
    from minipar.comm.collectives import Group  # here: it loads mpi4py.MPI

    rank = world.Get_rank()
    coords = shape.coords(rank)
    inner = MeshShape(dp=1, tp=shape.tp, pp=shape.pp, cp=shape.cp)
    # Comm.Split: the ranks of one dp coordinate form a worker, ordered as in the world
    worker = Mesh(inner, world.Split(coords["dp"], key=rank), ledger)
    if shape.cp > 1:
        worker.dp_cp.name = worker.edp_cp.name = "cp"
    # the same (tp, cp, pp) coordinates on every worker: the same pieces of the model
    color = coords["tp"] + shape.tp * (coords["cp"] + shape.cp * coords["pp"])
    dp = Group(world.Split(color, key=rank), "dp", ledger)
    return worker, dp


# ---------------------------------------------------------------- the outer step
class OuterNesterov:
    """The outer optimizer of this rank's pieces: theta (the parameters every worker
    started its inner steps from), v, and the outer step of each fragment.

    `masters`: the arrays the inner optimizer updates (the parameters themselves, or
    their master copies under --mixed), read and overwritten by the outer step;
    `refresh(masters)`: makes the compute copies anew from them (nothing in one dtype).
    `params`: the worker's pieces (canonical name, which says the fragment, and
    `full_index`), in the order of `masters`."""

    def __init__(self, params: Sequence[Parameter], masters: Sequence[np.ndarray],
                 refresh: Callable[[], None], dp: Group, layers: int, inner_steps: int,
                 fragments: int, lr: float, momentum: float) -> None:
        self.masters, self.refresh, self.dp = list(masters), refresh, dp
        self.inner_steps, self.fragments = inner_steps, fragments
        self.lr, self.momentum = lr, momentum
        self.names = [p.name for p in params]
        self.full_index = [p.full_index for p in params]
        self.fragment = [fragment_of(n, layers, fragments) for n in self.names]
        self.theta = [m.copy() for m in self.masters]
        self.v = [np.zeros_like(m) for m in self.masters]
        self.started = [False] * fragments  # has fragment p taken its first outer step?
        self.t = 0   # outer steps taken, over every fragment (a checkpoint's count)

    def fragment_sizes(self) -> list[int]:
        """The elements this rank holds of each fragment (what its Allreduce carries)."""
        sizes = [0] * self.fragments
        for i, m in enumerate(self.masters):
            sizes[self.fragment[i]] += m.size
        return sizes

    def after_inner_step(self, step: int) -> list[int]:
        """After inner step `step` (1-based): the outer step of every fragment due then
        (`due`); returns them."""
        done = due(step, self.inner_steps, self.fragments)
        for p in done:
            self.outer_step(p)
        if done:
            self.refresh()
        return done

    def outer_step(self, p: int) -> None:
        """Fragment p: one Allreduce of the workers' parameters over dp, their mean, then
        Nesterov SGD on theta; every worker restarts from the new theta."""
        mine = [i for i, f in enumerate(self.fragment) if f == p]
        if not mine:
            return  # this rank holds none of fragment p (nor do its dp peers)
        from mpi4py import MPI  # here: the formulas above import without it

        flat = np.concatenate([self.masters[i].ravel() for i in mine])
        # theta_k of this worker's pieces of fragment p -> sum over the K workers
        self.dp.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        flat *= 1.0 / self.dp.size   # (1/K) sum_k theta_k
        at = 0
        for i in mine:
            mean = flat[at:at + self.masters[i].size].reshape(self.masters[i].shape)
            at += self.masters[i].size
            delta = self.theta[i] - mean
            if self.started[p]:
                self.v[i] *= self.momentum
                self.v[i] += delta
            else:
                self.v[i][...] = delta
            self.theta[i] -= self.lr * (delta + self.momentum * self.v[i])
            self.masters[i][...] = self.theta[i]
        self.started[p] = True
        self.t += 1

    def restore(self, theta: Sequence[np.ndarray], v: Sequence[np.ndarray], step: int) -> None:
        """A resumed run at `step` (inner steps taken): this rank's pieces of theta and v
        as saved; fragment p has started if its first outer step, p H / P + H, is past."""
        for mine, saved in zip(self.theta, theta):
            mine[...] = saved
        for mine, saved in zip(self.v, v):
            mine[...] = saved
        self.started = [step >= p * self.inner_steps // self.fragments + self.inner_steps
                        for p in range(self.fragments)]
        self.t = sum(len(due(s, self.inner_steps, self.fragments)) for s in range(1, step + 1))

    def checkpoint_pieces(self) -> tuple[list, dict[str, list[np.ndarray]]]:
        """What a checkpoint saves of the outer step (checkpoint/save_load.py `save`, as an
        updater's pieces): theta as the parameters (each with its canonical name and
        `full_index`, those of the worker's pieces), v as the slot "v"."""
        pieces = [Parameter(theta, name, index) for theta, name, index
                  in zip(self.theta, self.names, self.full_index)]
        return pieces, {"v": self.v}

    def use_theta(self) -> None:
        """Point the workers' parameters at theta (each fragment's after its last outer
        step): what final.npz and --check read at the end of a run."""
        for master, theta in zip(self.masters, self.theta):
            master[...] = theta
        self.refresh()
