"""The broken code of lesson 8's bugs: each a detour around one piece of the correct code.

What this file teaches: how a bug gets in without the correct code ever being
touched. Each function below returns the (module, name, replacement) swaps that
break one thing -- a subclass overriding one method, or a replacement function
-- each broken line marked `# BUG:`, so a learner can diff the broken piece
against the real one. bugs/catalog.py lists the bugs (what each breaks, which check
catches it, where it shipped) and applies a bug's swaps for one run
(`catalog.injected`, used by `train.train` and the train command under
`--inject-bug NAME`).

    mpiexec -n 4 python -m minipar train --tp 2 --inject-bug tp-copy-to-no-allreduce --check

The detours import the parallel modules that load mpi4py.MPI when applied, not
when this file is imported (`train.problems` asks bugs/catalog.py before any
communication; the test process never loads MPI).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from minipar import placement
from minipar.core import nn
from minipar.core.autograd import Tensor
from minipar.parallel.pipeline import executor as pipeline

if TYPE_CHECKING:
    from minipar.comm.collectives import Group
    from minipar.comm.mesh import Mesh
    from minipar.core.optim import Optimizer

Swap = tuple[object, str, object]  # (module, attribute, what stands in for it)


# ----------------------------------------------------- pipeline parallelism
class OneBuffer:
    """Indexing hands out the rows copied into ONE array, the same array every time
    (a data loader that stages every microbatch in one preallocated buffer)."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.buffer: np.ndarray | None = None

    def __getitem__(self, rows: slice) -> np.ndarray:
        picked = self.x[rows]
        if self.buffer is None:
            self.buffer = np.empty_like(picked)
        self.buffer[...] = picked  # BUG: overwrites the microbatch still waiting for backward
        return self.buffer


def one_input_buffer() -> list[Swap]:
    """A stage worker that allocates its input buffer once, for every microbatch."""
    class OneInputBufferWorker(pipeline.StageWorker):
        def __init__(self, pp_group: Group, chunks: list[nn.Model], x: np.ndarray,
                     y: np.ndarray, *args: object, **kwargs: object) -> None:
            super().__init__(pp_group, chunks, x, y, *args, **kwargs)
            self.x = OneBuffer(x)  # BUG: the first stage's data rows, all in one array
            self.buffer = np.empty(self.shape, dtype=self.dtype)

        def recv_act(self, ins: pipeline.Instruction) -> None:
            source = self.peer(ins)
            # activation (B/(M dp), d) <- the previous stage. BUG: into the stage's one buffer
            self.group.Recv(self.buffer, source=source, tag=pipeline.ACT_TAG)
            self.inputs[(ins.chunk, ins.microbatch)] = pipeline.rows_of(
                Tensor(self.buffer, requires_grad=True), self.boundary_rows_over)

    return [(pipeline, "StageWorker", OneInputBufferWorker)]


# ------------------------------------------------------- tensor parallelism
def copy_to_without_allreduce(x: Tensor, group: object) -> Tensor:
    """Forward: identity. Backward: identity -- BUG: Megatron's f lost its Allreduce."""
    return x


def f_without_allreduce() -> list[Swap]:
    """Column-parallel linears whose f operator forgot the backward half of its pair."""
    from minipar.parallel import tensor_parallel  # here: loads mpi4py.MPI (module docstring)

    return [(tensor_parallel, "copy_to", copy_to_without_allreduce)]


class PlainLinear(nn.Linear):
    """Stands in for Column/RowParallelLinear: BUG: the FULL weight on every tp rank, no
    communication. Each tp rank computes the whole layer: right numbers, no parallelism."""

    def __init__(self, full: dict[str, np.ndarray], name: str, tp: object,
                 **flags: bool) -> None:
        super().__init__(full, name)  # BUG: the full (in, out) weight, not this rank's shard


def plain_linears() -> list[Swap]:
    """Both of the block's parallel linears built as plain ones (tensor_parallel.py)."""
    from minipar.parallel import tensor_parallel  # here: loads mpi4py.MPI (module docstring)

    return [(tensor_parallel, "ColumnParallelLinear", PlainLinear),
            (tensor_parallel, "RowParallelLinear", PlainLinear)]


# --------------------------------------------------------- data parallelism
def stage_left_out() -> list[Swap]:
    """Plain DP whose last pipeline stage never registered its gradients for the sync."""
    from minipar.parallel import dp_updater  # here: loads mpi4py.MPI (module docstring)

    class StageLeftOut(dp_updater.DataParallel):
        def __init__(self, chunks: list[nn.Model], mesh: Mesh, *args: object) -> None:
            super().__init__(chunks, mesh, *args)
            if mesh.coords["pp"] == mesh.shape.pp - 1:
                self.buckets = []  # BUG: this stage's buckets are never Allreduced over dp

    return [(dp_updater, "DataParallel", StageLeftOut)]


def sum_not_mean() -> list[Swap]:
    """The bucketed gradient sync without its division by dp."""
    from mpi4py import MPI  # here, as every detour's import (module docstring)

    from minipar.parallel import data_parallel as dp  # here: loads mpi4py.MPI

    def bucketed_allreduce_sum(buckets: list[list[nn.Parameter]], mesh: Mesh,
                               flats: list[np.ndarray] | None = None,
                               precision: object = None) -> None:
        for bucket in buckets:
            flat = dp.pack(bucket)
            group = dp._group(bucket[0], mesh)
            if group.size > 1:
                group.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)  # a bucket of g_i -> its sum
                placement.summed(bucket, group)                 # Partial -> Replicate
            dp.unpack(bucket, flat, 1.0)  # BUG: sum_i g_i, never divided by dp

    return [(dp, "bucketed_allreduce", bucketed_allreduce_sum)]


# ----------------------------------------------------- expert parallelism
def miscounted_aux(counter: Callable[[object, np.ndarray, int], np.ndarray]) -> list[Swap]:
    """The expert-parallel block with the aux loss's `f` counted by `counter(routing,
    kept, E)` instead of from every routed assignment. The same collectives of the same
    sizes: only the numbers counted change."""
    from minipar.parallel import expert_parallel as ep  # here: loads mpi4py.MPI (module docstring)

    class MiscountedAux(ep.ExpertParallelBlock):
        def assignment_counts(self, routing: object, kept: np.ndarray) -> np.ndarray:
            # BUG: `counter` picks what is counted
            return counter(routing, kept, self.cfg.experts)

    return [(ep, "ExpertParallelBlock", MiscountedAux)]


def first_choice_only() -> list[Swap]:
    # BUG: only column 0 of the top-k choices (Switch's top-1 formula kept for top-2)
    return miscounted_aux(lambda routing, kept, experts:
                          np.bincount(routing.chosen[:, 0], minlength=experts))


def after_capacity() -> list[Swap]:
    # BUG: only the assignments that survived capacity; docs/design.md counts every routed one
    return miscounted_aux(lambda routing, kept, experts:
                          np.bincount(routing.expert_of[kept], minlength=experts))


def aux_per_rank() -> list[Swap]:
    """The aux loss of each rank's own tokens: the single-process formula, copied over."""
    from minipar.parallel import expert_parallel as ep  # here: loads mpi4py.MPI (module docstring)

    def local_aux(probs: Tensor, counts: np.ndarray, tokens: int, cfg: nn.ModelConfig,
                  dp_group: object) -> Tensor:
        chosen = nn.route(probs.data, cfg.top_k)  # (b, k): this rank's tokens only
        # BUG: f and P over this rank's b tokens, not the microbatch's dp b tokens
        return nn.aux_loss(probs, chosen, cfg.experts, cfg.aux_coef)

    return [(ep, "global_aux", local_aux)]


def bias_from_local_load() -> list[Swap]:
    """The sigmoid-bias router's b updated from each rank's own tokens (routing.py)."""
    from minipar.core import routing

    def local_load(states: list[routing.BiasBalance], group: object) -> np.ndarray:
        # BUG: my tokens' counts only, never summed over dp x cp
        return np.stack([s.load for s in states])

    return [(routing, "global_load", local_load)]


# ------------------------------------------- the transformer: vocabulary and cp
def vocab_loss_without_max() -> list[Swap]:
    """The vocabulary-parallel cross-entropy without its Allreduce(MAX) of the row maxima."""
    from mpi4py import MPI  # here, as every detour's import (module docstring)

    from minipar.parallel import vocab_parallel  # here: loads mpi4py.MPI

    original = vocab_parallel.allreduce_statistic

    def allreduce_statistic(stat: Tensor, tp: Group, op: MPI.Op) -> Tensor:
        if op == MPI.MAX:
            return stat  # BUG: each rank shifts its logits by the max of its own columns
        return original(stat, tp, op)

    return [(vocab_parallel, "allreduce_statistic", allreduce_statistic)]


def keys_not_gathered() -> list[Swap]:
    """Context parallelism's allgather mode with its Allgather of K and V forgotten."""
    from minipar.core import attention
    from minipar.parallel import context_parallel as cp  # here: loads mpi4py.MPI

    def local_attention(cp_attention: cp.ContextParallelAttention, q: Tensor, k: Tensor, v: Tensor,
                        heads: int, key_bias: Tensor | None) -> Tensor:
        # BUG: my positions' queries against my positions' keys and values only
        return attention.attention(q, k, v, heads, q_positions=cp_attention.positions,
                                   k_positions=cp_attention.positions, key_bias=key_bias)

    return [(cp, "allgather_attention", local_attention)]


def merge_without_lse() -> list[Swap]:
    """Ring attention whose online softmax adds the blocks' results without weights."""
    from minipar.parallel import context_parallel as cp  # here: loads mpi4py.MPI

    def plain_sum(Out: np.ndarray, L: np.ndarray, o: np.ndarray, lse: np.ndarray) -> None:
        Out[...] = Out + o  # BUG: no exp(L - L'), exp(lse - L') weights
        L[...] = np.logaddexp(L, lse)

    return [(cp, "_merge", plain_sum)]


# ------------------------------------------------------------------- ZeRO
def no_allgather() -> list[Swap]:
    """ZeRO-1/2 that updates its slice and never Allgathers the parameters back."""
    from minipar.parallel import zero  # here: loads mpi4py.MPI (module docstring)

    def make_zero_without_allgather(stage: int, chunks: list[nn.Model], mesh: Mesh,
                                    optimizer: Optimizer, precision: object) -> zero.Zero1:
        class NoAllgather({1: zero.Zero1, 2: zero.Zero2}[stage]):
            def allgather_params(self) -> None:
                """BUG: nothing. My slice is updated; every other slice stays stale here."""

        return NoAllgather(chunks, mesh, optimizer, precision)

    return [(zero, "make_zero", make_zero_without_allgather)]


# ------------------------------------------------ gradient clipping, masked losses
def clip_by_local_norm() -> list[Swap]:
    """Each rank clips by the norm of its own pieces: the Allreduce of the squares left
    out (a pipeline stage, a tp rank, a ZeRO slice: each its own coefficient)."""
    from minipar.compose import clip

    def global_norm(group: Group | None, squares: float) -> float:
        return float(np.sqrt(squares))  # BUG: my pieces' norm, not the whole model's

    return [(clip, "global_norm", global_norm)]


def replicated_counted_on_every_tp_rank() -> list[Swap]:
    """The norm counts a piece replicated over tp (a LayerNorm, a row-parallel bias) on
    every tp rank: tp times in the sum of squares."""
    from minipar.compose import clip

    correct = clip.replicated_axes

    def replicated_axes(*args: object) -> frozenset[str]:
        return correct(*args) - {"tp"}  # BUG: a whole piece looks sharded over tp

    return [(clip, "replicated_axes", replicated_axes)]


def loss_mean_per_microbatch() -> list[Swap]:
    """Each microbatch's CE is the mean over ITS OWN valid positions, not over those of
    the global batch: every microbatch (and rank) weighs the same, whatever its count."""
    from minipar.core import documents

    def loss_weight(labels: np.ndarray, step_positions: int, step_valid: int) -> float:
        # BUG: my microbatch's positions over its valid ones, not the global batch's
        # (at least one, as trainers guard it: a cp rank may hold padding alone)
        return labels.size / max(documents.valid_positions(labels), 1)

    return [(documents, "loss_weight", loss_weight)]


# ------------------------------------------------------- mixed precision (--mixed)
def found_inf_per_rank() -> list[Swap]:
    """fp16's overflow check decided by each rank from its own gradients: the vote's
    MAX-Allreduce left out, so a rank whose pieces overflowed skips and halves S while
    the others step with theirs."""
    from minipar.comm import low_precision
    from minipar.core import precision

    def any_nonfinite(group: Group, arrays: list[np.ndarray]) -> bool:
        return precision.nonfinite(arrays)  # BUG: my own verdict, never voted over the group

    return [(low_precision, "any_nonfinite", any_nonfinite)]


def no_master_weights() -> list[Swap]:
    """The update lands on the 16-bit copy: after each step the master is set back to
    its own rounding, so an update smaller than half a 16-bit step is lost."""
    from minipar.parallel import mixed

    def cast_copies(masters: list[np.ndarray], copies: list[np.ndarray]) -> None:
        for master, copy in zip(masters, copies):
            copy[...] = master.astype(copy.dtype)
            master[...] = copy  # BUG: the master kept no finer than the 16-bit copy

    return [(mixed, "cast_copies", cast_copies)]


def tp_partials_in_16_bits() -> list[Swap]:
    """The row-parallel linear's shares rounded to 16 bits and summed in 16 bits on the
    wire (every partial sum of the Allreduce rounded), not in the master dtype."""
    from minipar.comm import low_precision
    from minipar.core import precision
    from minipar.parallel import tensor_parallel

    def reduce_from(x: Tensor, group: Group) -> Tensor:
        if group.size == 1:
            return x
        share = precision.to_low(x.data)  # BUG: each share rounded to 16 bits ...
        summed = low_precision.allreduce_low(group, share)  # BUG: ... and added in 16 bits
        out = Tensor.from_op(summed.astype(x.data.dtype), (x,), lambda g: x.accumulate(g))
        return placement.transition("reduce_from (an Allreduce)", x, group, placement.Partial,
                                    placement.Replicate(), out) if placement.ON else out

    return [(tensor_parallel, "reduce_from", reduce_from)]


# ------------------------------------------------------------ FP8 (--fp8)
def fp8_local_amax() -> list[Swap]:
    """A tensorwise scale of a tp-sharded tensor taken from the rank's own shard: the
    Allreduce(MAX) over tp left out, so each shard is quantized on its own scale."""
    from minipar.parallel import fp8_scales

    real = fp8_scales.agree_max

    def agree_max(mesh: Mesh, amaxes: np.ndarray, axis: str) -> np.ndarray:
        if axis == "tp":
            return amaxes  # BUG: my shard's amax, never the MAX over the tp shards
        return real(mesh, amaxes, axis)

    return [(fp8_scales, "agree_max", agree_max)]


def fp8_block_straddles_shard() -> list[Swap]:
    """Blockwise under ZeRO-3: each rank takes its blocks' amaxes from its own flat
    slice, as if a block never crossed a shard (true of tp's shards, multiples of B; not
    of ZeRO's slices, cut anywhere): the Allreduce(MAX) over the replicas left out."""
    from minipar.parallel import fp8_scales

    real = fp8_scales.zero3_spaces

    def zero3_spaces(updater: object) -> list | None:
        spaces = real(updater)
        if spaces is None:
            return None
        # BUG: a block's amax from my slice's part of it (0 for a block I hold none of)
        return [(params, pieces, lambda amaxes: amaxes) for params, pieces, _ in spaces]

    return [(fp8_scales, "zero3_spaces", zero3_spaces)]


def fp8_accumulate_in_low() -> list[Swap]:
    """The 8-bit matmul's sum kept in 8 bits: every partial sum of the contraction
    rounded to e4m3 (no fp32 accumulator), not summed in the master dtype."""
    from minipar.core import fp8, precision

    real = precision.matmul

    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if not isinstance(a, fp8.Exact):
            return real(a, b)
        x, w = a.values, b.values
        total = np.zeros((x.shape[0], w.shape[1]), dtype=x.dtype)
        one = np.float32(1.0)
        for k in range(x.shape[1]):  # BUG: each partial sum rounded to 8 bits (e4m3) ...
            total = fp8.quantize(total + np.outer(x[:, k], w[k]), one, "e4m3").astype(
                x.dtype)  # BUG: ... as it grows, where the tensor core keeps fp32
        return total

    return [(precision, "matmul", matmul)]


# ------------------------------------------------------------------- Muon
def muon_per_microbatch() -> list[Swap]:
    """ZeRO-2 whose optimizer step runs on each microbatch's reduced gradient slice, as a
    gradient hook sees it, instead of once on the step's sum (core/muon.py)."""
    from minipar.parallel import zero

    class PerMicrobatchZero2(zero.Zero2):
        def after_backward(self, piece: object) -> None:
            passes = self.__dict__.setdefault("passes", {})
            m = passes[id(piece)] = passes.get(id(piece), -1) + 1   # its microbatch
            kept = [space.grad_shard.copy() for space in self.spaces]
            for space in self.spaces:
                space.grad_shard[...] = 0.0
            super().after_backward(piece)
            shards = self.__dict__.setdefault("by_microbatch", {}).setdefault(
                m, [np.zeros_like(space.grad_shard) for space in self.spaces])
            for shard, space, old in zip(shards, self.spaces, kept):
                shard += space.grad_shard
                space.grad_shard[...] = old + space.grad_shard

        def step(self) -> None:
            by_microbatch = self.__dict__.pop("by_microbatch", {})
            self.__dict__.pop("passes", None)
            for m in sorted(by_microbatch):
                self.update(by_microbatch[m])  # BUG: Muon's update once per microbatch
            self.allgather_params()
            self.check_replicated()
            for space in self.spaces:
                space.grad_shard[...] = 0.0

    return [(zero, "Zero2", PerMicrobatchZero2)]


def muon_without_orthogonalization() -> list[Swap]:
    """Muon whose Newton-Schulz is skipped: the momentum itself is the update (plain
    momentum SGD at Muon's learning-rate scale), and no error says so."""
    from minipar.core import muon

    def orthogonalize(u: np.ndarray, steps: int) -> np.ndarray:
        return u  # BUG: no Newton-Schulz: U is used as if it were orthogonal

    return [(muon, "orthogonalize", orthogonalize)]


def muon_flat_shard_is_1d() -> list[Swap]:
    """Muon that reads each piece's shape from the array it is handed: ZeRO's flat
    slices are 1-D, so no matrix is found and AdamW updates every parameter."""
    from minipar.core import muon

    class FlatMuon(muon.Muon):
        def step(self, params: list[np.ndarray], grads: list[np.ndarray],
                 held: list | None = None) -> None:
            # BUG: the shape of the handed array, not of the parameter: a flat slice is 1-D
            flat = [[h._replace(box=(slice(0, h.where.stop - h.where.start),))
                     if p.ndim == 1 else h for h in pieces]
                    for p, pieces in zip(params, held)]
            super().step(params, grads, flat)

    return [(muon, "Muon", FlatMuon)]


def muon_unreduced_slice() -> list[Swap]:
    """ZeRO-1 + Muon where a matrix crosses a partition boundary: each rank fills the
    parts of the matrix it does not hold from its OWN unreduced gradient and
    orthogonalizes alone, instead of gathering the reduced pieces."""
    from minipar.core import muon
    from minipar.parallel import zero
    from minipar.parallel.buckets import grad_or_zeros

    class UnreducedZero1(zero.Zero1):
        def step(self) -> None:
            self.optimizer.unreduced = {p.name: grad_or_zeros(p).copy() for p in self.params}
            super().step()

    class AloneMuon(muon.Muon):
        unreduced: dict = {}

        def orthogonalize_all(self, updates: dict, held: list) -> dict:
            if self.plan is None:
                self.plan = self.make_plan(held)
            out = {}
            for name in sorted({name for name, _ in updates}):
                whole = self.unreduced[name].copy()  # BUG: the others' parts, unreduced
                region = tuple((0, n) for n in whole.shape)
                for (n, box), u in updates.items():
                    if n == name:
                        whole[muon._local(box, region)] = u  # my reduced part
                x = muon.orthogonalize(whole, self.ns_steps)  # BUG: no piece exchanged
                out.update({key: x[muon._local(key[1], region)] for key in updates
                            if key[0] == name})
            return out

    return [(zero, "Zero1", UnreducedZero1), (muon, "Muon", AloneMuon)]


def muon_tp_local_shard() -> list[Swap]:
    """--muon-mode distributed without its Gram Allreduce: each TP shard is
    orthogonalized as if it were the whole matrix."""
    from minipar.core import muon
    from minipar.parallel import muon_mesh

    def orthogonalize_sharded(u: np.ndarray, shape: tuple[int, int], sharded_axis: int,
                              group: Group, steps: int) -> np.ndarray:
        return muon.orthogonalize(u, steps)  # BUG: my shard alone, its Gram matrix local

    return [(muon_mesh, "orthogonalize_sharded", orthogonalize_sharded)]
