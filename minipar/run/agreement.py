"""What the ranks must agree on after a step, and the one answer assembled from their pieces.

What this file teaches: a parallel run is only right if its ranks agree, and they must
find out together. Every check here ends in a number or a list that every rank holds
alike (an allreduce, an allgather), so a failure stops every rank at the same step and
no rank waits forever in a collective the others left:

    the loss        summed over pp, averaged over dp x cp (`report_loss`); a NaN or an
                    infinity in it, or in any rank's parameters after the update
                    (`nonfinite_count`), is a `DivergedError` naming the flag to change
    the replicas    with --mixed, one CRC-32 per held piece and of the loss scale S,
                    allgathered and compared by every rank (`replica_check`,
                    `ReplicaError`)
    the model       every rank's pieces gathered on rank 0 and written into the full
                    arrays; two copies of one piece that differ are listed, never
                    averaged (`gather_full_params`, `gather_biases`)

run/mesh_step.py calls these around each step and at the end of the run
(docs/design.md, "Mixed precision" for the replica check).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from minipar.comm.mesh import Mesh
from minipar.core import nn, precision, routing
from minipar.core.shards import held_parts
from minipar.settings.config import TrainConfig

if TYPE_CHECKING:  # dp_updater.py loads mpi4py.MPI
    from minipar.parallel.dp_updater import Updater


class DivergedError(ArithmeticError):
    """The step loss, or the parameters after an update, became NaN or infinite. Raised
    on every rank at the same step (the loss and the count of non-finite numbers are the
    same everywhere), so the job stops together, before anything is saved."""

    def __init__(self, step: int, steps: int, what: str, blame: str) -> None:
        super().__init__(f"step {step} of {steps}: {what} (training diverged; every rank "
                         f"stopped, nothing saved; {blame})")
        self.step = step


def blame(cfg: TrainConfig, first: bool) -> str:
    """Which flag to change. The loss of a run's first step is taken before any update, so
    --lr cannot be its cause; a large MoE --aux-coef can (its term adds to every block's
    loss and gradient); otherwise the learning rate overshot."""
    if cfg.model == "moe" and (first or cfg.aux_coef > 1):
        return f"try a smaller --aux-coef than {cfg.aux_coef:g}"
    if first:
        return "the loss is not finite before any update: check --dtype and the sizes"
    return f"try a smaller --lr than {cfg.lr:g}"


def nonfinite_count(mesh: Mesh, chunks: list[nn.Model], updater: Updater) -> int:
    """How many numbers of the model are NaN or infinite after the update, summed over
    every rank (each counts what it updates: ZeRO its flat slice, others what they hold)."""
    from minipar.comm.collectives import allreduce_sum  # here: it loads mpi4py.MPI

    mine = getattr(updater, "my_slices", None)   # ZeRO: the flat slices this rank updates
    held = mine() if mine else [p.data for chunk in chunks for p in chunk.parameters()]
    local = sum(precision.count_nonfinite(a) for a in held)   # 16-bit: on its words
    # this rank's count -> the sum on every rank, so all stop at the same step
    return int(allreduce_sum(mesh.world, np.array([local], dtype=np.int64))[0])


class ReplicaError(RuntimeError):
    """Two copies of a replicated parameter (or of the loss scale S) differ after a step
    of a --mixed run. Raised on every rank at the same step (all read the same digests)."""


def scaler_of(updater: Updater) -> precision.LossScaler | None:
    """The loss scaler of a --mixed run (parallel/mixed.py), None without --mixed."""
    return getattr(getattr(updater, "precision", None), "scaler", None)  # (mixed.py)


def replica_check(mesh: Mesh, chunks: list[nn.Model], updater: Updater, step: int) -> None:
    """After a --mixed step: every copy of a replicated parameter, and S, bitwise equal
    on every rank (docs/design.md, "Mixed precision").

    How, cheaply: each rank hashes the bytes of what it holds, one CRC-32 per
    piece, keyed by (name, part of the full array): the 16-bit compute copy, and under
    plain data parallelism the master too (ZeRO's master slices are no replicas); and
    the bytes of S. One allgather of these small lists over the world, then every rank
    checks every key alike, so a disagreement stops all ranks at the same step. A
    piece ZeRO-3 has dropped is not held and not hashed (its flat shards are no
    replicas either)."""
    import zlib

    def digest(a: np.ndarray) -> int:
        # CRC-32 of the bytes, in place (no copy): it changes for any difference of at most
        # 32 bits in a row, so for every one-element difference; several differences slip
        # by with odds 2^-32. Five times cheaper than a cryptographic hash, every step.
        return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1))
    mine = {}
    masters = getattr(updater, "masters", None)
    masters = masters if isinstance(masters, list) else None   # plain DP's whole masters
    params = [p for chunk in chunks for p in chunk.parameters()]
    for i, p in enumerate(params):
        if p.data.size:
            mine[f"{p.name}{p.full_index or ''}"] = digest(p.data)
            if masters is not None:
                mine[f"master {p.name}{p.full_index or ''}"] = digest(masters[i])
    mine["loss scale S"] = digest(np.array([scaler_of(updater).scale]))
    seen: dict[str, tuple[int, int]] = {}
    for rank, digests in enumerate(mesh.world.allgather(mine)):
        for key, value in digests.items():
            first = seen.setdefault(key, (value, rank))
            if first[0] != value:
                raise ReplicaError(f"step {step}: {key} on rank {rank} is not bitwise equal "
                                   f"to its copy on rank {first[1]} (replicas must agree)")


def report_loss(mesh: Mesh, local: float) -> float:
    """The step loss on every rank: stage shares summed over pp, averaged over dp (and cp:
    each cp rank's share is the mean over its positions, the same number of them)."""
    from minipar.comm.collectives import allreduce_sum  # here: it loads mpi4py.MPI

    value = allreduce_sum(mesh.pp, np.array([local]))
    return float(allreduce_sum(mesh.dp_cp, value)[0] / mesh.shape.replicas)


def gather_biases(mesh: Mesh, chunks: list[nn.Model]
                  ) -> tuple[dict[str, np.ndarray], list[str]]:
    """Every block's b (routing.BiasBalance, sigmoid-bias) on world rank 0, and a line for
    each replica that is not bitwise equal to the first one holding it (every rank of the
    block's dp x cp and tp groups must have taken the same steps). Empty elsewhere."""
    # {name: b} of every rank -> rank 0
    everyone = mesh.world.gather(routing.bias_values(chunks))
    if everyone is None:
        return {}, []
    found: dict[str, np.ndarray] = {}
    disagreements = []
    for rank, values in enumerate(everyone):
        for name, value in values.items():
            first = found.setdefault(name, value)
            if not np.array_equal(first, value):
                disagreements.append(f"{name}: rank {rank} differs from an earlier replica "
                                     f"by {float(np.max(np.abs(first - value))):.3g}")
    return found, disagreements


def gather_full_params(mesh: Mesh, params: list[nn.Parameter], cfg: TrainConfig,
                       values: dict[str, np.ndarray] | None = None
                       ) -> tuple[dict[str, np.ndarray] | None, list[str]]:
    """Assemble the full canonical parameters on world rank 0 from every rank's pieces.

    Each rank sends `(name, full_index, array)` for what it holds; rank 0 writes
    each piece into its place (the first rank's copy wins). Replicas (the same
    piece on several ranks) must agree: each disagreement is a strategy that
    forgot to synchronize, and is listed in the second return value. With `values`
    (full arrays the params were cut from), each piece is read from there instead
    of `p.data`: the model as built, even where ZeRO-3 has dropped `p.data` since.
    """
    pieces = [(p.name, p.full_index, p.data) for p in params] if values is None else [
        (p.name, p.full_index, part) for p, part in zip(params, held_parts(params, values))]
    everything = mesh.world.gather(pieces)
    if everything is None:
        return None, []
    shapes = nn.canonical_shapes(cfg.model_config())
    full: dict[str, np.ndarray] = {}
    disagreements: list[str] = []
    for rank, rank_pieces in enumerate(everything):
        for name, index, data in rank_pieces:
            target = full.setdefault(name, np.full(shapes[name], np.nan, dtype=data.dtype))
            where = slice(None) if index is None else index
            seen = target[where]
            if np.isnan(seen).all():
                target[where] = data
            elif not np.array_equal(seen, data):
                diff = float(np.nanmax(np.abs(seen - data)))
                disagreements.append(f"{name}: rank {rank} differs from an earlier replica "
                                     f"by {diff:.3g}")
    missing = sorted(set(shapes) - set(full)) + sorted(
        name for name, value in full.items() if np.isnan(value).any())  # a part unheld
    if missing:
        raise RuntimeError(f"parameters (or parts of them) held by no rank: {missing[:3]}")
    return full, disagreements
