"""How many numbers each rank holds, and where: the arithmetic behind ZeRO.

What this file teaches (ZeRO, Rajbhandari et al. 2020, sections 3 and 5).
Training with Adam keeps three kinds of *model states* per parameter: the
parameter, its gradient, and the optimizer state. The paper counts bytes per
parameter for mixed precision: 2 (fp16 parameter) + 2 (fp16 gradient) + K
(K = 12: the fp32 copy of the parameter, Adam's m and v), so a model of Psi
parameters needs (2 + 2 + K) Psi bytes on *every* data-parallel rank. ZeRO cuts
each kind into N_d slices (N_d = dp ranks), one per rank:

    stage 0 (plain DP)   (p + g + K) Psi
    stage 1 (P_os)       (p + g) Psi     + K Psi / N_d
    stage 2 (P_os+g)     p Psi           + (g + K) Psi / N_d
    stage 3 (P_os+g+p)   (p + g + K) Psi / N_d

with p, g, K the bytes per parameter of each kind: 2, 2, 12 in the paper; in
minipar (float64, no master copy) 8, 8 and K = 16 for Adam (m and v), 0 for SGD.
The paper's example: Psi = 7.5 B, N_d = 64 gives 120, 31.4, 16.6 and 1.9 GB.

The slices: all of a rank's parameters, flattened in order, are one vector of
Psi numbers; rank i owns the contiguous run `[start_i, start_i + count_i)`.
When N_d does not divide Psi the counts differ by one (the first Psi mod N_d
ranks take one more): no padding, the v-collectives (`Allgatherv`,
`Reduce_scatter` with counts) carry slices of unequal size.

Pure arithmetic, no MPI: `python -m pytest tests/parallel/test_zero.py`; the measured
table beside these formulas: `mpiexec -n 4 python lessons/07_zero.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


# ------------------------------------------------------------ the slices
def shard_counts(total: int, ranks: int) -> list[int]:
    """How many of `total` flat elements each of `ranks` ranks owns: as equal as possible,
    the first `total % ranks` ranks one more. [10 over 4] -> [3, 3, 2, 2]."""
    base, extra = divmod(total, ranks)
    return [base + (1 if i < extra else 0) for i in range(ranks)]


def displacements(counts: Sequence[int]) -> list[int]:
    """Where each rank's run starts: the running sum of the counts before it."""
    return [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))]


class FlatLayout:
    """A rank's parameters as one flat vector of `total` numbers, sliced over `ranks`.

    `offsets[j]` is where array j starts in the flat vector; rank i owns
    `[starts[i], starts[i] + counts[i])`. `overlap(a, b)` answers the question
    every ZeRO collective asks: of the flat range [a, b) (one piece of the model),
    how many elements lie in each rank's slice?
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], ranks: int, rank: int) -> None:
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = displacements(self.sizes)
        self.total = sum(self.sizes)
        self.ranks, self.rank = ranks, rank
        self.counts = shard_counts(self.total, ranks)
        self.starts = displacements(self.counts)
        self.start = self.starts[rank]
        self.stop = self.start + self.counts[rank]

    def span(self, first: int, last: int) -> tuple[int, int]:
        """The flat range [a, b) of arrays first..last (inclusive)."""
        return self.offsets[first], self.offsets[last] + self.sizes[last]

    def overlap(self, a: int, b: int) -> list[int]:
        """Elements of [a, b) inside each rank's slice (zero for most ranks when the
        range is short): the counts of the Allgatherv / Reduce_scatter of that range."""
        return [max(0, min(b, s + c) - max(a, s)) for s, c in zip(self.starts, self.counts)]

    def mine(self, a: int, b: int) -> slice:
        """Where [a, b) ∩ my slice sits inside my slice (an empty slice if it does not)."""
        lo, hi = max(a, self.start), min(b, self.stop)
        return slice(lo - self.start, hi - self.start) if lo < hi else slice(0, 0)

    def views(self, flat: np.ndarray, first: int = 0, last: int | None = None
              ) -> list[np.ndarray]:
        """Arrays first..last (inclusive; default all) as views of `flat`, a buffer holding
        the flat range that starts where array `first` starts: writing into `flat`
        writes into the arrays."""
        last = len(self.shapes) - 1 if last is None else last
        base = self.offsets[first]
        return [flat[self.offsets[j] - base:self.offsets[j] - base + self.sizes[j]]
                .reshape(self.shapes[j]) for j in range(first, last + 1)]


# ------------------------------------------------------------ the bytes
@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's model states, by kind."""

    params: float
    grads: float
    optimizer: float
    masters: float = 0.0   # --mixed: the master copy of the parameters (core/precision.py)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.masters


def optimizer_bytes_per_param(optimizer: str, itemsize: int) -> int:
    """K for minipar's optimizers: Adam keeps m and v (2 numbers), SGD nothing, Muon one
    momentum per number of a block matrix (core/muon.py; the embeddings, norms, biases
    and routers it leaves to AdamW keep 2, a small share of a large model that this
    one K does not count: `Muon.state_per_parameter` says it parameter by parameter)."""
    return {"sgd": 0, "adam": 2 * itemsize, "muon": itemsize}[optimizer]


@dataclass(frozen=True)
class BytesPerParam:
    """What one parameter costs, by kind, before ZeRO divides anything.

    `params` is the copy the model computes with (16-bit under --mixed, else the
    master itself), `masters` the master copy --mixed adds (0 without it), `grads`
    the (main) gradient, `optimizer` the optimizer's state (Adam: m and v)."""

    params: float
    grads: float
    optimizer: float
    masters: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.masters


def bytes_per_param(optimizer: str = "adam", master_bytes: int = 4,
                    low_bytes: int | None = 2, main_grad_bytes: int | None = None
                    ) -> BytesPerParam:
    """Bytes per parameter of a training recipe (docs/design.md, "Mixed precision").

    `master_bytes`: the itemsize of --dtype; `low_bytes`: of the 16-bit compute copy
    (None: no --mixed, the model computes with the master); `main_grad_bytes`: of the
    gradient (default the master's). Adam with bf16, fp32 masters and fp32 main
    gradients is Megatron's 2 + 4 + 4 + 8 = 18; with 16-bit gradients
    (`main_grad_bytes=2`) the ZeRO paper's 2 + 2 + 12 = 16."""
    grads = master_bytes if main_grad_bytes is None else main_grad_bytes
    k = optimizer_bytes_per_param(optimizer, master_bytes)
    if low_bytes is None:
        return BytesPerParam(params=master_bytes, grads=grads, optimizer=k)
    return BytesPerParam(params=low_bytes, grads=grads, optimizer=k, masters=master_bytes)


def rank_states(per: BytesPerParam, whole: float, mine: float, stage: int) -> ModelStates:
    """The one formula for a rank's model states, used by `zero_formula` (the memory
    report) and by the planner (planner/memory_cost.py): each kind's bytes per parameter
    times `whole` (the parameters every replica has) or `mine` (this rank's ZeRO slice
    of them) as stage `stage` divides it. ZeRO shards the optimizer state and the
    masters at stage >= 1 (the paper's K holds both), the gradients at >= 2, the
    compute copy at 3."""
    def part(bytes_each: float, sharded: bool) -> float:
        return bytes_each * (mine if sharded else whole)
    return ModelStates(params=part(per.params, stage >= 3),
                       grads=part(per.grads, stage >= 2),
                       optimizer=part(per.optimizer, stage >= 1),
                       masters=part(per.masters, stage >= 1))


def bytes_per_param_held(per: BytesPerParam, ranks: int, stage: int) -> float:
    """Bytes a rank holds per parameter of the model under ZeRO stage `stage` over
    `ranks` replicas: e.g. 18, then 4 + 4 + 14/N, 4 + 14/N, 18/N for bf16 Adam."""
    return rank_states(per, 1.0, 1.0 / ranks, stage).total


def zero_formula(psi: float, ranks: int, stage: int, param_bytes: float = 2,
                 grad_bytes: float = 2, optimizer_bytes: float = 12,
                 master_bytes: float = 0) -> ModelStates:
    """ZeRO's per-rank memory of model states (section 5.1): stage s shards the
    optimizer state (s >= 1), the gradients (s >= 2) and the parameters (s = 3)
    over `ranks` data-parallel ranks. Defaults: the paper's mixed-precision Adam
    (its K = 12 holds the fp32 master; pass `master_bytes` to count it apart)."""
    per = BytesPerParam(param_bytes, grad_bytes, optimizer_bytes, master_bytes)
    return rank_states(per, psi, psi / ranks, stage)


def paper_example() -> list[ModelStates]:
    """ZeRO's worked example (Figure 1): Psi = 7.5 B parameters, N_d = 64, K = 12, fp16.
    Totals 120, 31.4, 16.6, 1.9 GB (1 GB = 1e9 bytes) for stages 0-3."""
    return [zero_formula(7.5e9, 64, stage) for stage in range(4)]


def measure(params: Iterable[np.ndarray | None], grads: Iterable[np.ndarray | None],
            optimizer_state: dict[str, list[np.ndarray]],
            masters: Iterable[np.ndarray | None] = ()) -> ModelStates:
    """Bytes a rank really holds: `nbytes` of its parameter, gradient and optimizer-state
    arrays (None for a dropped array). Pass each buffer once: views of one flat
    buffer are counted through the buffer, not again through each view. `masters`:
    under --mixed, the master parameters (the 16-bit compute copy is `params`)."""
    def nbytes(arrays: Iterable[np.ndarray | None]) -> int:
        return sum(a.nbytes for a in arrays if a is not None)
    return ModelStates(params=nbytes(params), grads=nbytes(grads),
                       optimizer=nbytes(a for arrays in optimizer_state.values() for a in arrays),
                       masters=nbytes(masters))


# ----------------------------------------------------- the communication
def ledger_formula(psi: int, stage: int) -> dict[str, int]:
    """Elements one rank's ledger records for the gradient sync and parameter traffic of
    one step (one microbatch): the buffers each collective is defined on.

    stage 0: Allreduce the gradients (Psi);  stages 1-2: Reduce_scatter the gradients
    (Psi) + Allgather the updated parameters (Psi);  stage 3: Allgather the parameters
    before each piece's forward and again before its backward (2 Psi) + Reduce_scatter
    the gradients (Psi)."""
    if stage == 0:
        return {"Allreduce": psi}
    if stage in (1, 2):
        return {"Reduce_scatter": psi, "Allgatherv": psi}
    return {"Reduce_scatter": psi, "Allgatherv": 2 * psi}


def wire_formula(psi: float, ranks: int, stage: int) -> float:
    """Elements a rank sends per step with ring algorithms: DP = ZeRO-1 = ZeRO-2 =
    2 (N-1)/N Psi (Allreduce = Reduce_scatter + Allgather), ZeRO-3 = 3 (N-1)/N Psi
    (section 7: the paper's 2 Psi and 3 Psi)."""
    return (3 if stage == 3 else 2) * (ranks - 1) / ranks * psi


def wire_elements(op: str, elements: int, group_size: int) -> float:
    """Elements one rank puts on the wire for a ledger entry, with ring algorithms:
    Allreduce 2(N-1)/N of the buffer, Allgather and Reduce_scatter (N-1)/N,
    Alltoall(v) (N-1)/N of what it sends when chunks are equal, Send the message."""
    n = group_size
    if op in ("Allreduce", "Iallreduce"):
        return 2 * (n - 1) / n * elements
    if op in ("Allgather", "Allgatherv", "Reduce_scatter", "Reduce_scatter_block",
              "Alltoall", "Alltoallv"):
        return (n - 1) / n * elements
    return float(elements)
