"""Muon: each weight matrix's momentum, orthogonalized, is its update.

What this file teaches (Keller Jordan 2024; Moonlight 2025). SGD and Adam are rules
on single numbers, so any strategy may hand them any slice (optim.py). Muon's rule
is on a whole matrix: for W (m, n) with step gradient G,

    buf = mu buf + (1 - mu) G                    (elementwise: shards like Adam's m)
    U   = (1 - mu) G + mu buf  (Nesterov), or buf
    X   = U^T if m > n else U;  X = X / max(||X||_F, 1e-7)
    ns_steps times:  A = X X^T;  X = a X + (b A + c A A) X,   (a, b, c) below
    W   = W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) X   (X transposed back)

`A = X X^T` mixes every row with every other: a rank holding a column slice, a
row slice or a flat ZeRO slice of W cannot compute its part of X alone. Every
2-D weight inside `blocks.N.` but the router takes this rule; everything else
(embeddings, head, norms, biases, routers) takes AdamW (betas 0.9/0.999, eps
1e-8, the same lr, decoupled decay).

Over the mesh (`--muon-mode`, docs/design.md "Muon"), the strategy hands the
optimizer its arrays and what they hold (`optim.Held`); the elementwise part runs
on whatever slice this rank holds, then the matrices come together one of three ways:

    duplicated     every rank that holds a piece of W receives the rest and runs
                   the iteration itself (redundant compute, no choice to make);
    layer-sharded  W has one home among its holders (longest-processing-time on
                   m n min(m, n)); the home receives the pieces, runs the iteration
                   alone and sends each holder its piece of X;
    distributed    a TP-sharded W is orthogonalized where it lies: the Gram matrix
                   on the sharded side summed by one Allreduce over tp per iteration,
                   the products local; the rest as duplicated.

This file is the rule and the plan, one process, no MPI: who sends which piece to
whom is a pure function of every rank's boxes (`Plan`). How the pieces travel and
how a sharded iteration sums its Gram matrix is parallel/muon_mesh.py's (`bind`);
without it every matrix is whole here and the iteration runs locally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from minipar.core.held import Held

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # (a, b, c): Keller Jordan's quintic
MODES = ("layer-sharded", "distributed", "duplicated")
EPS = 1e-7          # the floor of ||U||_F
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8

Box = tuple[tuple[int, int], ...]   # a box as (start, stop) per axis: hashable, picklable


def is_matrix(name: str, ndim: int) -> bool:
    """Muon's or AdamW's? Every 2-D weight inside `blocks.N.` but the router. `ndim` is
    that of the FULL parameter, never of a flat slice of it."""
    return (ndim == 2 and name.startswith("blocks.") and name.endswith(".weight")
            and not name.endswith(".router.weight"))


def lr_scale(shape: tuple[int, int]) -> float:
    """0.2 sqrt(max(m, n)): the update's RMS matched to AdamW's (Moonlight)."""
    return 0.2 * float(np.sqrt(max(shape)))


def orthogonalize(u: np.ndarray, steps: int) -> np.ndarray:
    """Newton-Schulz on a whole matrix: X ~ U V^T of U's SVD, in U's dtype."""
    a, b, c = NS_COEFFICIENTS
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / max(float(np.linalg.norm(x)), EPS)
    for _ in range(steps):
        gram = x @ x.T                      # (m', m'), m' = min(m, n)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def ns_flops(shape: tuple[int, int], held: tuple[int, ...], steps: int) -> int:
    """Floating-point operations of `steps` Newton-Schulz iterations on the `held` part
    (the whole, or a TP shard) of a matrix of `shape`: per iteration the Gram matrix
    (g x g: the short side of a whole matrix, the unsplit side of a TP shard),
    its square, and the product with the held part: 2 (2 g^2 h + g^3), h = the held
    elements / g."""
    m, n = shape
    g = min(m, n) if tuple(held) == (m, n) else (m if held[0] == m else n)
    h = int(np.prod(held)) // g
    return 2 * steps * (2 * g * g * h + g ** 3)


def _box(box: tuple[slice, ...]) -> Box:
    return tuple((int(s.start), int(s.stop)) for s in box)


def _size(box: Box) -> int:
    return int(np.prod([b - a for a, b in box], dtype=np.int64))


def _inside(box: Box, region: Box) -> bool:
    return all(r0 <= b0 and b1 <= r1 for (b0, b1), (r0, r1) in zip(box, region))


def _local(box: Box, region: Box) -> tuple[slice, ...]:
    """`box` as slices of an array that holds `region`."""
    return tuple(slice(b0 - r0, b1 - r0) for (b0, b1), (r0, _) in zip(box, region))


Route = dict[int, tuple[list, list]]   # peer -> (pieces sent to it, pieces from it)


class Meeting(Protocol):
    """How a matrix's pieces meet over a mesh (parallel/muon_mesh.py)."""

    rank: int

    def allgather(self, obj: object) -> list:
        """Every rank's `obj`, in rank order."""

    def exchange(self, table: Route, arrays: dict, dtype: np.dtype,
                 cut: bool = False) -> dict[tuple[str, Box], np.ndarray]:
        """Send each peer its pieces (`Plan.gather`, `Plan.scatter`), receive mine."""

    def orthogonalize_sharded(self, u: np.ndarray, shape: tuple[int, int],
                              sharded_axis: int, steps: int) -> np.ndarray:
        """Newton-Schulz on a matrix split over tp: my shard in, my shard of X out."""

    def agree(self, sharded: list[str]) -> None:
        """Every tp rank must iterate the same split matrices, in the same order."""


class Muon:
    """`--optimizer muon`: Muon on the blocks' matrices, AdamW on the rest.

    State: `m`, one array per handed array, is Muon's momentum buffer on a matrix's
    elements and AdamW's first moment elsewhere; `v`, AdamW's second moment, is kept
    for the AdamW elements only (one compact 1-D array per handed array): a matrix
    element costs one number of state, any other two. Checkpoints see both as Adam's
    (`state_arrays`: `v` spread over the handed array's shape, zero on the matrices)."""

    def __init__(self, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.1,
                 mode: str = "layer-sharded") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown --muon-mode {mode!r}")
        self.lr, self.mu, self.nesterov = lr, momentum, nesterov
        self.ns_steps, self.wd, self.mode = ns_steps, weight_decay, mode
        self.t = 0
        self.m: list[np.ndarray] = []
        self.v: list[np.ndarray] = []     # compact after the first step (see the class)
        self.v_runs: list[list[tuple[slice, slice]]] | None = None  # (where, in v) per array
        self.meeting: Meeting | None = None   # None: every matrix is whole on this rank
        self.plan: Plan | None = None
        self.ns_runs = 0          # Newton-Schulz runs on this rank, last step
        self.ns_flops = 0         # their floating-point operations, last step

    def bind(self, meeting: Meeting | None) -> None:
        """How this rank's matrix pieces meet the others' (parallel/muon_mesh.py)."""
        self.meeting = meeting

    def make_plan(self, held: Sequence[Sequence[Held]]) -> Plan:
        """The plan from every rank's matrix boxes (one allgather, at the first step)."""
        pieces = [(h.name, _box(h.box), _box(h.shard)) for hs in held for h in hs
                  if is_matrix(h.name, len(h.box))]
        if self.meeting is None:
            return Plan([pieces], 0, self.mode)
        plan = Plan(self.meeting.allgather(pieces), self.meeting.rank, self.mode)
        self.meeting.agree([name for name, _, axis in plan.runs if axis is not None])
        return plan

    def state_arrays(self) -> dict[str, list[np.ndarray]]:
        """`{"m": [...], "v": [...]}` as Adam's (see the class), for checkpoints."""
        if not self.m:
            return {}
        if self.v_runs is None:   # restored, not stepped yet: v is still spread out
            return {"m": self.m, "v": self.v}
        spread = []
        for m, v, runs in zip(self.m, self.v, self.v_runs):
            out = np.zeros(m.size, dtype=m.dtype)
            for where, at in runs:
                out[where] = v[at]
            spread.append(out.reshape(m.shape))
        return {"m": self.m, "v": spread}

    def held_state(self) -> dict[str, list[np.ndarray]]:
        """The state arrays as this optimizer keeps them (the memory report): `m` whole,
        `v` only over the AdamW elements."""
        return {"m": self.m, "v": self.v} if self.m else {}

    def state_per_parameter(self, name: str, shape: tuple[int, ...]) -> int:
        """Arrays of state a parameter needs: 1 for a Muon matrix (its momentum), 2 for
        the AdamW rest (m and v)."""
        return 1 if is_matrix(name, len(shape)) else 2

    # ------------------------------------------------------------ the step
    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray],
             held: Sequence[Sequence[Held]] | None = None) -> None:
        """One update of every handed array in place. `held` is required: it names the
        parameter boxes each array holds (held.held_whole for whole parameters)."""
        if held is None:
            raise ValueError("Muon needs to know what each array holds (core/held.py)")
        if not self.m:
            self.m = [np.zeros_like(p) for p in params]
            self.v = [np.zeros_like(p) for p in params]
        if self.v_runs is None:   # v kept for the AdamW elements only, from now on
            self.compact_v(params, held)
        self.t += 1
        b1, b2 = ADAM_BETAS
        correct1, correct2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        decay = 1.0 - self.lr * self.wd
        updates: dict[tuple[str, Box], np.ndarray] = {}   # my matrix pieces: U
        mine: list[tuple[np.ndarray, Held]] = []          # (the param's flat view, piece)
        for i, (p, g, pieces) in enumerate(zip(params, grads, held)):
            flat_p = p.reshape(-1)
            flat_g = np.zeros(p.size, p.dtype) if g is None else np.asarray(g).reshape(-1)
            flat_m, runs = self.m[i].reshape(-1), iter(self.v_runs[i])
            for h in pieces:
                w, gr, m = flat_p[h.where], flat_g[h.where], flat_m[h.where]
                if is_matrix(h.name, len(h.box)):   # momentum, elementwise on my piece
                    m *= self.mu
                    m += (1.0 - self.mu) * gr
                    u = (1.0 - self.mu) * gr + self.mu * m if self.nesterov else m.copy()
                    shape = tuple(s.stop - s.start for s in h.box)
                    updates[(h.name, _box(h.box))] = u.reshape(shape)
                    mine.append((flat_p, h))
                    continue
                v = self.v[i][next(runs)[1]]        # AdamW, decoupled decay first
                w *= decay
                m *= b1
                m += (1.0 - b1) * gr
                v *= b2
                v += (1.0 - b2) * (gr * gr)
                w -= self.lr * (m / correct1) / (np.sqrt(v / correct2) + ADAM_EPS)
        xs = self.orthogonalize_all(updates, held)
        for flat_p, h in mine:
            w = flat_p[h.where]
            w *= decay
            w -= self.lr * lr_scale(self.plan.shapes[h.name]) * \
                xs[(h.name, _box(h.box))].reshape(-1)

    def compact_v(self, params: Sequence[np.ndarray], held: Sequence[Sequence[Held]]) -> None:
        """Keep v for the AdamW pieces only: `v_runs[i]` pairs each such piece's place in
        handed array i with its place in the compact v[i] (zero state or restored)."""
        self.v_runs, compact = [], []
        for p, v, pieces in zip(params, self.v, held):
            runs, at = [], 0
            for h in pieces:
                if not is_matrix(h.name, len(h.box)):
                    size = h.where.stop - h.where.start
                    runs.append((h.where, slice(at, at + size)))
                    at += size
            flat = v.reshape(-1)
            compact.append(np.concatenate([flat[w] for w, _ in runs]) if runs
                           else np.zeros(0, dtype=p.dtype))
            self.v_runs.append(runs)
        self.v = compact

    def orthogonalize_all(self, updates: dict[tuple[str, Box], np.ndarray],
                          held: Sequence[Sequence[Held]]) -> dict[tuple[str, Box], np.ndarray]:
        """X for each matrix piece of `updates` ((name, box) -> U), as the mode says:
        the pieces gathered where the plan runs the iteration, X sent back."""
        if self.plan is None:
            self.plan = self.make_plan(held)
        plan, meeting = self.plan, self.meeting
        self.ns_runs = self.ns_flops = 0
        dtype = next(iter(updates.values())).dtype if updates else np.dtype(np.float64)
        received = {} if meeting is None else meeting.exchange(plan.gather, updates, dtype)
        out: dict[tuple[str, Box], np.ndarray] = {}
        results: dict[tuple[str, Box], np.ndarray] = {}
        for name, region, sharded in plan.runs:   # the matrices this rank orthogonalizes
            whole = np.empty([b - a for a, b in region], dtype=dtype)
            for (n, box), u in list(updates.items()) + list(received.items()):
                if n == name and _inside(box, region):
                    whole[_local(box, region)] = u
            self.ns_runs += 1
            self.ns_flops += ns_flops(plan.shapes[name], whole.shape, self.ns_steps)
            if sharded is None:
                x = orthogonalize(whole, self.ns_steps)
            else:
                x = meeting.orthogonalize_sharded(whole, plan.shapes[name], sharded,
                                                  self.ns_steps)
            results[(name, region)] = x
            for key in updates:                     # my own pieces, cut from X
                if key[0] == name and _inside(key[1], region):
                    out[key] = x[_local(key[1], region)]
        sent = {} if meeting is None else meeting.exchange(plan.scatter, results, dtype,
                                                           cut=True)
        out.update({key: x for key, x in sent.items() if key in updates})
        missing = [key for key in updates if key not in out]
        if missing:
            raise RuntimeError(f"Muon: no update for {missing[0][0]} box {missing[0][1]}")
        return out


class Plan:
    """Who sends which piece to whom, and who runs which matrix: computed once, the same
    on every rank, from every rank's boxes (one allgather at the first step).

    `everyone[r]`: rank r's matrix pieces as (name, box, its TP shard's box); `me`: my rank.
    `runs`: (name, region, sharded axis or None) this rank orthogonalizes (region: the
    whole matrix, or under `distributed` its TP shard); `gather` and `scatter`: for each
    peer, the (name, box) pieces sent to it and received from it, in order."""

    def __init__(self, everyone: list[list[tuple[str, Box, Box]]], me: int, mode: str) -> None:
        self.shapes: dict[str, tuple[int, int]] = {}
        holders: dict[str, dict[int, list[tuple[Box, Box]]]] = {}
        for rank, theirs in enumerate(everyone):
            for name, box, shard in theirs:
                holders.setdefault(name, {}).setdefault(rank, []).append((box, shard))
                old = self.shapes.get(name, (0, 0))
                self.shapes[name] = tuple(max(o, b) for o, (_, b) in zip(old, box))
        self.runs: list[tuple[str, Box, int | None]] = []
        self.gather: Route = {}
        self.scatter: Route = {}
        self.homes: dict[str, int] = {}
        load: dict[int, int] = {}       # layer-sharded: the work homed on each rank
        sending: dict[int, int] = {}    # elements each rank sends in the gather
        costs = {name: m * n * min(m, n) for name, (m, n) in self.shapes.items()}
        for name in sorted(holders, key=lambda k: (-costs[k], k)):  # longest first
            full = tuple((0, n) for n in self.shapes[name])
            by_rank = holders[name]
            if mode == "layer-sharded":   # the least-loaded holder (lowest rank on ties)
                home = min(by_rank, key=lambda r: (load.get(r, 0), r))
                load[home] = load.get(home, 0) + costs[name]
                self.homes[name] = home
                runners = {home: (full, None)}
            else:
                runners = {}
                for rank, boxes in by_rank.items():
                    shard = boxes[0][1]
                    tp_split = shard != full and mode == "distributed"
                    axis = next(i for i, (s, f) in enumerate(zip(shard, full)) if s != f) \
                        if tp_split else None
                    runners[rank] = (shard if tp_split else full, axis)
            owners: dict[Box, list[int]] = {}   # each distinct box: the ranks holding it
            for rank in sorted(by_rank):
                for box, _ in by_rank[rank]:
                    owners.setdefault(box, []).append(rank)
            for rank, (region, axis) in sorted(runners.items()):
                have = {box for box, _ in by_rank.get(rank, [])}
                needed = [box for box in owners if _inside(box, region)]
                if sum(_size(b) for b in needed) != _size(region):
                    raise RuntimeError(f"Muon: the pieces of {name} do not tile it once")
                for box in sorted(needed):
                    if box not in have:   # from the holder that has sent least so far
                        source = min(owners[box], key=lambda r: (sending.get(r, 0), r))
                        sending[source] = sending.get(source, 0) + _size(box)
                        self._route(self.gather, source, rank, (name, box), me)
                if rank == me:
                    self.runs.append((name, region, axis))
            if mode == "layer-sharded":   # the home sends every other holder its pieces
                for rank in sorted(by_rank):
                    if rank != self.homes[name]:
                        for box, _ in by_rank[rank]:
                            self._route(self.scatter, self.homes[name], rank, (name, box), me)
        self.runs.sort()

    @staticmethod
    def _route(table: Route, source: int, dest: int, key: tuple, me: int) -> None:
        if source == me:
            table.setdefault(dest, ([], []))[0].append(key)
        if dest == me:
            table.setdefault(source, ([], []))[1].append(key)
