"""Bugs of the kinds real parallel trainers shipped, re-created on purpose, one flag away.

What this file teaches: a parallel run that is wrong usually still trains. Its
loss goes down, often by the same amount per step as the correct run, because
most of these bugs leave the model a *reasonable* model -- just not the one the
single-process math defines. What finds them is the equivalence check
(`--check`: losses and final parameters against one process), the replica check
(`agreement.gather_full_params`: every copy of the same parameter piece must be
bitwise equal), the ledger (`--ledger`: what each axis moved, against the
formula) and the bytes each rank holds.

    python -m minipar bugs                                     # the list
    mpiexec -n 4 python -m minipar train --tp 2 --inject-bug tp-copy-to-no-allreduce --check
    mpiexec -n 4 python lessons/08_bugs.py                     # every bug, and its checks
How a bug gets in: the correct code is never touched. Each bug's `detour`
(bugs/detours.py, the broken code, each broken line marked `# BUG:`) returns the
(module, name, replacement) swaps that break one thing; `train.train` (and the
train command) applies them for the run when `--inject-bug NAME` is given (`injected` puts the
originals back after, even on error), so a learner can diff the broken piece
against the real one.

The registry and `problems` are pure: `train.problems` asks them before any
communication, and the detours load mpi4py.MPI only when applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minipar.bugs.detours import (
    Swap,
    after_capacity,
    aux_per_rank,
    bias_from_local_load,
    clip_by_local_norm,
    f_without_allreduce,
    first_choice_only,
    found_inf_per_rank,
    fp8_accumulate_in_low,
    fp8_block_straddles_shard,
    fp8_local_amax,
    keys_not_gathered,
    loss_mean_per_microbatch,
    merge_without_lse,
    muon_flat_shard_is_1d,
    muon_per_microbatch,
    muon_tp_local_shard,
    muon_unreduced_slice,
    muon_without_orthogonalization,
    no_allgather,
    no_master_weights,
    one_input_buffer,
    plain_linears,
    replicated_counted_on_every_tp_rank,
    stage_left_out,
    sum_not_mean,
    tp_partials_in_16_bits,
    vocab_loss_without_max,
)
from minipar.bugs.hangs import HANGS, Hang

if TYPE_CHECKING:
    from minipar.settings.config import TrainConfig


@dataclass(frozen=True)
class Bug:
    """One injectable bug: what breaks, what a check then shows, and where it applies.

    `requires` names the flags the bug needs to exist at all and `fits(cfg)`
    checks them; `detour()` builds the swaps; `flags` is a small setting of the
    strategy that shows it (dp left to fill the world). `seen` cites the public
    issue or pull request of a real project where this bug, or its closest
    relative, shipped -- or says that none was found and the bug is only plausible.
    `unseen` says why placement checking (`--check-placements`, placement/__init__.py) cannot
    see the bug -- it is about values, not placements; empty for a placement error,
    which that check stops at the line where it is made."""

    name: str
    strategy: str
    broken: str
    why: str
    requires: str
    fits: Callable[[TrainConfig], bool]
    detour: Callable[[], list[Swap]]
    flags: dict
    seen: str = "plausible: no shipped case found"
    unseen: str = ""


# ------------------------------------------------------- what each needs
def _pipeline(cfg: TrainConfig) -> bool:
    return cfg.pp > 1 and cfg.microbatches > 1


def _tp(cfg: TrainConfig) -> bool:
    return cfg.tp > 1 and not cfg.sp and cfg.model != "moe"  # moe: its experts are split


def _dp_sync(cfg: TrainConfig) -> bool:
    return cfg.dp > 1 and cfg.zero == 0 and cfg.grad_sync == "bucketed"


def _moe(cfg: TrainConfig) -> bool:
    return cfg.model in ("moe", "gpt-moe") and cfg.dp > 1


def _zero(cfg: TrainConfig) -> bool:
    return cfg.zero in (1, 2) and cfg.dp > 1


def _vocab(cfg: TrainConfig) -> bool:
    return cfg.model in ("gpt", "gpt-moe") and cfg.tp > 1 and bool(cfg.vocab_parallel)


def _cp(*modes: str) -> Callable[[TrainConfig], bool]:
    return lambda cfg: cfg.cp > 1 and cfg.cp_mode in modes


def _clip_split(cfg: TrainConfig) -> bool:
    from minipar.compose.clip import group_name  # the ranks holding different pieces, if any

    return cfg.clip_grad_norm is not None and group_name(cfg) is not None


def _ragged(cfg: TrainConfig) -> bool:
    return cfg.documents and (cfg.microbatches > 1 or cfg.dp * cfg.cp > 1)


DOCUMENTS = "lessons/documents.txt"   # short documents, many rows padded (documents.py)
PIPELINE = "--pp 2 or more and --microbatches 2 or more (a stage with several inputs)"
TP = "--tp 2 or more without --sp, and not --model moe"
DP_SYNC = "--dp 2 or more with --zero 0 and --grad-sync bucketed (plain DP's sync)"
MOE = "--model moe or gpt-moe with --dp 2 or more (the expert-parallel block)"


# ---------------------------------------------------------------- the list
_LIST = [
    Bug("pp-one-input-buffer", "pp",
        "a pipeline stage keeps ONE input buffer: every microbatch (the data rows on the "
        "first stage, the received activation on the others) lands in it",
        "after one step only embed.weight is wrong: its gradient x^T g is formed in backward "
        "from the buffer, which by then holds a later microbatch's rows (under GPipe the last "
        "one's, for every microbatch); from step 2 on the wrong embedding moves everything. "
        "The later stages reuse their buffer too, harmlessly here: a block starts with "
        "LayerNorm, which keeps its own normalized copy of its input",
        PIPELINE, _pipeline, one_input_buffer,
        {"pp": 2, "microbatches": 4, "schedule": "gpipe"},
        "a near miss: in deepspeedai/DeepSpeed#2800, taking one buffer out of the pipeline "
        "engine made a RecvActivation overwrite tensors an earlier microbatch's backward still "
        "held; pytorch/pytorch#139404: a pipeline stage kept only its latest backward result",
        unseen="the buffer holds the right kind of tensor (rows sharded over dp), just the "
               "wrong microbatch's values: placements are the same for every microbatch"),
    Bug("tp-copy-to-no-allreduce", "tp",
        "Megatron's f (copy_to, before fc1) without its backward Allreduce",
        "after one step the last block's fc1 and fc2 are still right (their own gradients "
        "need no sum), but the gradient leaving that block through its LayerNorm is only this "
        "rank's share of it: that LayerNorm and everything below (earlier blocks, the "
        "embedding) go wrong, the tp copies of those replicated weights drift apart, and the "
        "ledger is short of the backward half of the tp Allreduces",
        TP, _tp, f_without_allreduce, {"tp": 2},
        "a close relative: nanotron's row-parallel linear handed every tp rank the same input "
        "gradient in its backward, a quarter of it right (huggingface/nanotron#46, fixed by "
        "#172); a missing backward collective in DTensor TP is reported in pytorch/pytorch#157606"),
    Bug("tp-plain-linear", "tp",
        "the column- and row-parallel linears replaced by plain ones holding the full weights",
        "every number is right -- each tp rank computes the whole layer -- so the equivalence "
        "check passes; the ledger shows the missing tp Allreduces and each rank holds the "
        "full fc weights: tensor parallelism silently never happened (--check's ledger and "
        "memory lines, against the formulas, say MISMATCH)",
        TP + " on --model mlp (the transformer's heads would not be whole)",
        lambda cfg: _tp(cfg) and cfg.model == "mlp", plain_linears, {"tp": 2},
        "reported in huggingface/transformers#36222: tensor parallelism was no faster than "
        "none, and the model's weight shapes stayed the same whatever the tp size",
        unseen="every tensor really is replicated over tp and every number is right: "
               "nothing is misplaced, the split itself is missing (ledger, memory)"),
    Bug("dp-stage-not-synced", "dp",
        "one pipeline stage (the last) never Allreduces its gradients over dp",
        "each dp replica of the last stage steps with its own g_i instead of the mean: after "
        "one step exactly that stage's tensors are wrong, their copies disagree across dp and "
        "the stage's dp Allreduce is missing from the ledger -- while the loss falls like the "
        "correct one",
        "--pp 2 or more and " + DP_SYNC, lambda cfg: cfg.pp > 1 and _dp_sync(cfg),
        stage_left_out, {"pp": 2, "microbatches": 2},
        "a close relative: Megatron-LM with pp and the distributed optimizer summed partial "
        "dp results into the shared embedding's gradient (NVIDIA/Megatron-LM#844); tied "
        "weights on two stages left unsynchronized: uw-syfi/piper#13"),
    Bug("dp-sum-not-mean", "dp",
        "the gradient Allreduce sums over dp and never divides by dp",
        "every replica agrees with every other (the same wrong sum everywhere), so only the "
        "comparison with one process sees it: the step is dp times too long, the same as "
        "lr x dp, and the loss even falls faster",
        DP_SYNC, _dp_sync, sum_not_mean, {},
        "a close relative: PyTorch DDP divided each bucket by the world size, not by the "
        "number of replicas, wrong for a process driving several devices (pytorch/pytorch#36516)",
        unseen="the Allreduce is there (Partial -> Replicate over dp); the missing 1/dp is "
               "a scalar factor, a value: a sum and a mean have the same placement"),
    Bug("moe-aux-first-choice", "ep",
        "the load-balancing f counts each token's first choice only",
        "f sums to 1/k instead of 1 and leaves out the second choices, so the aux loss is "
        "wrong from the very first step; its gradient reaches every router and, through them, "
        "every LayerNorm and block below: after one step only the last block's experts are "
        "still right. The same collectives move the same sizes: the ledger cannot see it",
        MOE, _moe, first_choice_only, {"model": "moe", "ep": 2},
        "a close relative: Mixtral's load_balancing_loss_func in Hugging Face transformers "
        "computed the fraction of tokens per expert, f, wrongly (huggingface/transformers"
        "#28255, fixed by #28256; before it, #28093: the loss was a constant, fixed by #28115)",
        unseen="f is a count (a NumPy array, no tensor) summed over dp as it should be; "
               "which assignments it counts is a value"),
    Bug("moe-aux-after-capacity", "ep",
        "the load-balancing f counts the assignments left after capacity drops",
        "an overloaded expert looks less loaded than it is (its dropped tokens vanish from "
        "f), so the aux pushes the router away from it too little, exactly where balance "
        "matters; the loss differs from step 1 on, the ledger not at all",
        "--capacity-factor and " + MOE, lambda cfg: cfg.capacity_factor is not None
        and _moe(cfg), after_capacity, {"model": "moe", "ep": 2, "capacity_factor": 0.75},
        "plausible: no shipped case found",
        unseen="as moe-aux-first-choice: the same placements, other counts in f"),
    Bug("moe-aux-per-rank", "ep",
        "the aux loss computed from each rank's own tokens (f and P not summed over dp)",
        "the mean over ranks of f_r P_r is not f P of the whole microbatch: the loss and the "
        "router gradient are off by a little from step 1 on, which no single rank can notice; "
        "the ledger can: the Allreduces of P (comm.sum_replicated, forward and backward) "
        "are gone",
        MOE, _moe, aux_per_rank, {"model": "moe", "ep": 2},
        "shipped as a design, later corrected: the balance loss of each micro-batch or rank "
        "instead of the global batch; Megatron-LM forks added the global one "
        "(microsoft/ltp-megatron-lm#7); torchtitan proposes it (pytorch/torchtitan#4772)"),
    Bug("moe-bias-local-load", "ep",
        "the sigmoid-bias router's b updated from each rank's own tokens (the per-expert "
        "counts not summed over dp x cp)",
        "every rank steers its router by the load it happened to see: after the first step "
        "the replicas of b differ (the replica check names them), the tokens of different "
        "ranks are routed by different b, and the run is no longer the one-process run; "
        "the ledger is one Allreduce of L x E counts per step short",
        "--router sigmoid-bias and " + MOE,
        lambda cfg: cfg.router == "sigmoid-bias" and _moe(cfg), bias_from_local_load,
        {"model": "moe", "ep": 2, "router": "sigmoid-bias", "bias_rate": 0.01},
        "plausible: no shipped case found",
        unseen="b is no tensor and carries no placement: which counts update it is a value"),
    Bug("tp-vocab-loss-no-max", "tp",
        "the vocabulary-parallel cross-entropy skips the Allreduce(MAX) of each row's "
        "largest logit",
        "each tp rank shifts its own columns by their own maximum, so the sums of exps "
        "added up over tp mix terms shifted differently: the loss and every gradient are "
        "wrong from step 1, yet the model trains; the ledger is one Allreduce of B T "
        "numbers per microbatch short",
        "--model gpt or gpt-moe with --tp 2 or more and the vocabulary split over tp "
        "(--vocab-parallel, the default)", _vocab, vocab_loss_without_max,
        {"model": "gpt", "tp": 2, "steps": 2}),
    Bug("cp-no-allgather", "cp",
        "context parallelism's allgather mode attends to the keys and values of its own "
        "positions only (their Allgather forgotten)",
        "each cp rank's queries see only the earlier positions of their own chunk: a causal "
        "attention over shorter sequences, so the model trains; the loss is wrong from step "
        "1, and the ledger is missing the 2 Allgathers per layer and their Reduce_scatters",
        "--cp 2 or more with --cp-mode allgather", _cp("allgather"), keys_not_gathered,
        {"model": "gpt", "cp": 2, "cp_mode": "allgather", "steps": 2}),
    Bug("cp-ring-no-lse-merge", "cp",
        "ring attention adds up the blocks' partial results as they arrive instead of "
        "merging them with their log-sum-exp weights",
        "every block was normalized by its own softmax, so a query that sees two blocks gets "
        "the sum of two averages instead of one: its output is too large and the loss is "
        "wrong from step 1; the same blocks travel the ring, so the ledger cannot see it",
        "--cp 2 or more with --cp-mode ring or zigzag", _cp("ring", "zigzag"),
        merge_without_lse, {"model": "gpt", "cp": 2, "cp_mode": "ring", "steps": 2},
        unseen="the right blocks meet in the right place (my positions' queries, every "
               "rank's keys: Shard(1) into and out of the ring node); how their results "
               "are weighted in the merge is a value"),
    Bug("zero-no-allgather", "zero",
        "ZeRO-1/2 updates this rank's slice and never Allgathers the parameters back",
        "each rank updates its own slice and keeps every other slice at its old value: the "
        "gathered model is rank 0's copy, right only in rank 0's own slice (the front of the "
        "flat vector: the embedding onward), every other rank's copy disagrees with it, and "
        "the ledger is missing the Allgatherv; under --check-placements the step stops: "
        "ZeRO's flat vector is still sharded over dp when the next forward needs it whole",
        "--zero 1 or 2 with --dp 2 or more (stage 3 gathers in the forward instead)",
        _zero, no_allgather, {"zero": 1},
        "a close relative: DeepSpeed ZeRO-2 with MoE copied the updated fp32 slices back with "
        "the wrong partition ids, so only a fraction of the parameters trained "
        "(deepspeedai/DeepSpeed#2058)"),
]
_LIST += [
    Bug("clip-local-norm", "pp",
        "gradient clipping by each rank's own norm: the Allreduce of the sums of squares "
        "is left out, so each pipeline stage scales its gradients by its own coefficient",
        "every stage's norm is below the whole model's, so each stage clips less than one "
        "process would, and by a different factor: after one clipped step every tensor is "
        "off (the update's direction is no longer the gradient's). Each stage's dp replicas "
        "agree, so only the comparison with one process sees it; the ledger is one "
        "Allreduce of one number short",
        "--clip-grad-norm with ranks holding different pieces (--tp, --pp or --ep 2 or "
        "more, or --zero 1-3 with --dp 2 or more)", _clip_split, clip_by_local_norm,
        {"pp": 2, "microbatches": 2, "clip_grad_norm": 0.01},
        "shipped: torchtitan clipped each pipeline stage by the norm of its own modules "
        "(pytorch/torchtitan#596, fixed by #649)",
        unseen="every tensor keeps its placement: the norm is a plain number, and which "
               "ranks' squares it sums is a value"),
    Bug("clip-replicated-counted-tp", "tp",
        "the gradient norm counts a piece replicated over tp (embedding, LayerNorms, "
        "row-parallel biases, the head) on every tp rank, tp times in the sum of squares",
        "the norm is too large, by the replicated pieces' share, so every step clips too "
        "hard; every rank computes the same wrong coefficient, so the replicas agree and "
        "the ledger is the right one: only the comparison with one process sees it",
        "--clip-grad-norm with --tp 2 or more",
        lambda cfg: cfg.clip_grad_norm is not None and cfg.tp > 1,
        replicated_counted_on_every_tp_rank, {"tp": 2, "clip_grad_norm": 0.01},
        "shipped: Transformer Engine's Linear marked replicated weights tensor-parallel, so "
        "Megatron counted them tp times and reported norms 1.36-1.52x too large "
        "(ROCm/TransformerEngine#715); the same in NVIDIA-NeMo/RL#3788",
        unseen="the gradients are right and in the right places; how often one of them "
               "enters a scalar sum is a value"),
    Bug("loss-mean-per-microbatch", "dp",
        "with ragged documents, each microbatch's loss is the mean over ITS OWN valid "
        "positions, not over those of the global batch",
        "a microbatch (or rank) with few real tokens weighs as much as one with many: its "
        "tokens count more than one process counts them. The loss and every gradient are "
        "off from step 1, the replicas agree (they sum the same wrong gradients) and the "
        "ledger is unchanged: only the comparison with one process sees it",
        "--data PATH --documents with --microbatches or --dp x --cp 2 or more", _ragged,
        loss_mean_per_microbatch,
        {"model": "gpt", "data": DOCUMENTS, "documents": True, "vocab": 256,
         "microbatches": 2, "steps": 2},
        "shipped in many trainers and fixed in 2024-25 by dividing by the whole step's "
        "tokens: meta-pytorch/torchtune#1875, karpathy/nanochat#59, ml-explore/mlx-lm#1413",
        unseen="the mask and the count have no placement: by what the CE is divided is "
               "a value"),
]


def _muon(cfg: TrainConfig) -> bool:
    return cfg.optimizer == "muon" and cfg.dp > 1


MUON = dict(optimizer="muon", lr=0.02)
_LIST += [   # --optimizer muon (core/muon.py): the matrices must meet whole
    Bug("muon-per-microbatch", "zero",
        "ZeRO-2 with gradient accumulation runs Muon's update (momentum and Newton-Schulz) "
        "on each microbatch's reduced gradient slice, as its gradient hook sees it, "
        "instead of once on the step's accumulated gradient",
        "Newton-Schulz is not linear: orthogonalizing two halves is not orthogonalizing "
        "their sum, and the momentum moves twice per step. Every matrix and (through "
        "AdamW stepping twice) every other tensor is off after one step, while the "
        "replicas agree; the equivalence check sees it, and the ledger shows Muon's "
        "pieces travelling once per microbatch",
        "--optimizer muon with --zero 2, --dp 2 or more and --microbatches 2 or more",
        lambda cfg: _muon(cfg) and cfg.zero == 2 and cfg.microbatches > 1,
        muon_per_microbatch, dict(MUON, zero=2, microbatches=2),
        "shipped: DeepSpeed's Muon under ZeRO-3 ran Newton-Schulz once per micro-batch "
        "(deepspeedai/DeepSpeed#8443)",
        unseen="every slice is where it should be; how often the optimizer runs on it "
               "is a value"),
    Bug("muon-no-orthogonalization", "dp",
        "Muon's Newton-Schulz iteration is skipped: the momentum itself is the update",
        "plain momentum SGD at Muon's learning-rate scale: the loss still falls, every "
        "replica agrees and the same pieces move, so neither the replica check nor the "
        "ledger sees it; the equivalence check does, on every block matrix from step 1",
        "--optimizer muon with --dp 2 or more and --zero 0 (not --muon-mode distributed "
        "with --tp)",
        lambda cfg: _muon(cfg) and cfg.zero == 0 and not (
            cfg.tp > 1 and cfg.muon_mode == "distributed"),
        muon_without_orthogonalization, dict(MUON),
        "shipped: DeepSpeed's Muon at ZeRO stage 0, the default, ran no orthogonalization "
        "and raised no error (deepspeedai/DeepSpeed#8441)",
        unseen="the update has the matrix's placement; whether it was orthogonalized is "
               "a value"),
    Bug("muon-flat-shard-is-1d", "zero",
        "Muon decides matrix or not from the array it is handed: ZeRO's flat slices are "
        "1-D, so every matrix is taken for a vector and sent to AdamW",
        "the run is an AdamW run: nothing fails, the loss falls, the replicas agree; the "
        "equivalence check sees every block matrix wrong after one step, and the ledger "
        "is missing all of Muon's piece traffic",
        "--optimizer muon with --zero 1, 2 or 3 and --dp 2 or more",
        lambda cfg: _muon(cfg) and cfg.zero >= 1, muon_flat_shard_is_1d,
        dict(MUON, zero=3),
        "shipped: DeepSpeed's Muon under ZeRO-3 saw every flattened parameter as 1-D and "
        "used AdamW for all of them (deepspeedai/DeepSpeed#8438)",
        unseen="the slices are placed right; which rule updates them is a value"),
    Bug("muon-unreduced-slice", "zero",
        "ZeRO-1 + Muon: where a matrix crosses a partition boundary, each rank fills the "
        "part it does not hold from its OWN unreduced gradient and orthogonalizes alone",
        "the matrices inside one rank's slice are right; each matrix cut by a boundary "
        "gets a different X on each of its holders, each built from one rank's local "
        "gradient: those matrices are wrong after one step (the Allgather then spreads "
        "each rank's slice, so the replicas agree); the equivalence check sees them and "
        "the ledger is missing Muon's pieces",
        "--optimizer muon with --zero 1, --dp 2 or more and --tp 1",
        lambda cfg: _muon(cfg) and cfg.zero == 1 and cfg.tp == 1, muon_unreduced_slice,
        dict(MUON, zero=1),
        "shipped: DeepSpeed's Muon orthogonalized unreduced slices where a matrix crossed "
        "a ZeRO partition, each rank applying a different update "
        "(deepspeedai/DeepSpeed#7807; refused in #8090, fixed in #8141)",
        unseen="every slice is Shard(0) as ZeRO says; what fills the rest of the matrix "
               "is a value"),
    Bug("muon-tp-local-shard", "tp",
        "--muon-mode distributed without its Gram Allreduce: each TP shard of a matrix is "
        "orthogonalized as if it were the whole matrix",
        "the columns (or rows) of each shard come out orthonormal among themselves, not "
        "the matrix: every TP-split matrix is wrong after one step, the replicas over dp "
        "agree; the equivalence check sees it and the ledger is missing the 1 + ns_steps "
        "Allreduces over tp per matrix",
        "--optimizer muon --muon-mode distributed with " + TP,
        lambda cfg: cfg.optimizer == "muon" and cfg.muon_mode == "distributed" and _tp(cfg),
        muon_tp_local_shard, dict(MUON, tp=2, muon_mode="distributed"),
        "a close relative: Megatron-LM's distributed Muon had to gather TP shards before "
        "orthogonalizing (NVIDIA/Megatron-LM#6676)",
        unseen="each shard stays Shard over tp; that its Gram matrix was never summed "
               "is a value"),
]
BUGS: dict[str, Bug] = {bug.name: bug for bug in _LIST}

# The mixed-precision bugs (--mixed, docs/design.md "Mixed precision"): their runs are
# judged by the derived tolerance, the replica check and the ledger, not lesson 08's
# 1e-9 (tests/parallel/test_mixed.py shows each caught).
_MIXED = [
    Bug("mp-found-inf-per-rank", "pp",
        "fp16's overflow check decided by each rank from its own gradients: the MAX-"
        "Allreduce of found_inf is left out",
        "a pipeline stage whose gradients overflowed skips its update and halves S while "
        "the other stage steps and keeps S: from then on the stages scale the loss by "
        "different S, and the replica check stops the run at that step (S is one number "
        "every rank must hold bitwise alike); the ledger is one Allreduce a step short",
        "--mixed fp16 with --pp, --tp or --ep 2 or more (ranks holding different "
        "gradients), --zero 0 and no --clip-grad-norm",
        lambda cfg: cfg.mixed == "fp16" and cfg.zero == 0 and cfg.clip_grad_norm is None
        and (cfg.pp > 1 or cfg.tp > 1 or cfg.ep > 1),
        found_inf_per_rank,
        {"mixed": "fp16", "pp": 2, "layers": 4, "microbatches": 2,
         "loss_scale": 2.0 ** 20, "loss_scale_window": 2, "steps": 6},
        "shipped: Megatron-Bridge's MIMO optimizer let one module grid's scaler halve "
        "before the world-wide found_inf vote, so S differed across ranks "
        "(NVIDIA-NeMo/Megatron-Bridge#5591); DeepSpeed's pipeline with 1-bit Adam hung when "
        "one stage overflowed and another did not (deepspeedai/DeepSpeed#994)"),
    Bug("mp-no-master-weights", "dp",
        "the optimizer's update lands on the 16-bit copy: the master is set back to its "
        "own 16-bit rounding after every step",
        "the first rounding moves every weight by up to half a bf16 step (2^-9 of it), "
        "more than a small update, and any later update smaller than that is rounded "
        "away: at a small learning rate the parameters' movement from init is nothing like "
        "the one-process run's (94x it at --lr 0.002) and the derived tolerance is "
        "exceeded; every replica rounds alike, so the replica check and the ledger see "
        "nothing",
        "--mixed bf16 or fp16 with --zero 0",
        lambda cfg: cfg.mixed is not None and cfg.zero == 0,
        no_master_weights, {"mixed": "bf16", "lr": 0.002, "steps": 3},
        "plausible: the reason mixed-precision training keeps fp32 masters "
        "(Micikevicius et al., 'Mixed Precision Training', 2018)"),
    Bug("mp-tp-partials-in-bf16", "tp",
        "the row-parallel linear's tp shares rounded to 16 bits and Allreduced in 16 bits "
        "(every partial sum rounded), not summed in the master dtype and rounded once",
        "each block's output carries one more rounding per share: an error of the size of "
        "the ones the derived tolerance already allows, so the numbers pass; what the "
        "contract catches is the ledger: every forward tp Allreduce moves 2 bytes an element "
        "where the formula (the master dtype's sum) says 4 or 8 (--check's ledger line: the "
        "bytes MISMATCH)",
        "--mixed bf16 or fp16 with --tp 2 or more without --sp, and not --model moe",
        lambda cfg: cfg.mixed is not None and _tp(cfg),
        tp_partials_in_16_bits, {"mixed": "bf16", "tp": 2},
        "plausible: no shipped case found; many trainers sum tp shares in the compute "
        "dtype by choice, minipar's contract (docs/design.md) sums them in the master one"),
    # --fp8 (core/fp8.py, docs/design.md "FP8")
    Bug("fp8-local-amax", "tp",
        "a tensorwise FP8 scale of a tp-sharded tensor taken from the rank's own shard: "
        "the Allreduce(MAX) of the amax over tp is left out",
        "each shard of fc1 and fc2 (and fc2's input, fc1's output gradient) is quantized "
        "on its own scale, not the whole tensor's: the numbers differ by 8-bit roundings, "
        "which the derived tolerance allows; the ledger does not: the tp Allreduce line "
        "is short of the step's weight-amax call and every activation amax (--check's "
        "ledger line: MISMATCH)",
        "--mixed bf16 --fp8 tensorwise with " + TP,
        lambda cfg: cfg.fp8 == "tensorwise" and _tp(cfg),
        fp8_local_amax, {"mixed": "bf16", "fp8": "tensorwise", "tp": 2},
        "shipped: TransformerEngine's amax reduction group was documented as dp where it "
        "must be dp x tp (NVIDIA/TransformerEngine#656)"),
    Bug("fp8-block-straddles-shard", "zero",
        "blockwise under ZeRO-3: each rank takes its B x B blocks' amaxes from its own flat "
        "slice of the weights, as if a block never crossed a shard (tp's shards are "
        "multiples of B; ZeRO's slices are cut anywhere): the Allreduce(MAX) over dp is "
        "left out",
        "a block that straddles two slices gets a different scale on each rank, and one "
        "in another rank's slice amax 0 (scale 1: its small weights land among e4m3's "
        "subnormals), so each replica multiplies a differently quantized weight; the "
        "ledger's dp Allreduce line is short of the step's one call of the blocks' "
        "amaxes (--check's ledger line: MISMATCH)",
        "--mixed bf16 --fp8 blockwise with --zero 3 and --dp 2 or more",
        lambda cfg: cfg.fp8 == "blockwise" and cfg.zero == 3 and cfg.dp > 1,
        fp8_block_straddles_shard,
        {"mixed": "bf16", "fp8": "blockwise", "fp8_block": 16, "zero": 3},
        "a close relative: torchao's float8 FSDP2 all-gather broke on shards that do not "
        "split a tensor evenly (pytorch/ao#1938)"),
    Bug("fp8-accumulate-in-low", "any",
        "the 8-bit matmul's sum kept in 8 bits: every partial sum of the contraction "
        "rounded to e4m3, where an FP8 tensor core accumulates in fp32",
        "every partial sum is rounded to e4m3 (4 significant bits, subnormal below 2^-6): "
        "a block's small outputs are lost, the layers before them stop learning (their "
        "difference from one process is their whole movement, 1.0 of it where the derived "
        "tolerance allows 0.6 over 2 steps): the equivalence check fails",
        "--mixed bf16 --fp8 (any recipe)",
        lambda cfg: cfg.fp8 is not None,
        fp8_accumulate_in_low, {"mixed": "bf16", "fp8": "rowwise", "steps": 2},
        "plausible: why DeepSeek-V3 promotes the tensor cores' partial sums to fp32 every "
        "128 products (its H800's FP8 accumulator keeps about 14 bits)"),
]
MIXED_BUGS: dict[str, Bug] = {bug.name: bug for bug in _MIXED}


def problems(cfg: TrainConfig) -> list[str]:
    """Why `cfg.inject_bug` cannot be injected into this run (empty if it can, or if no
    bug is asked for): an unknown name, or a mesh that does not use the bug's strategy."""
    name = cfg.inject_bug
    if name is None:
        return []
    known = {**BUGS, **MIXED_BUGS, **HANGS}  # the hangs (bugs/hangs.py) are injected alike
    if name not in known:
        return [f"--inject-bug {name} is not a known bug; choose one of: {', '.join(known)}"]
    bug = known[name]
    return [] if bug.fits(cfg) else [f"--inject-bug {name} needs {bug.requires}"]


@contextmanager
def injected(name: str) -> Iterator[Bug | Hang]:
    """Apply bug `name`'s swaps for the body of the `with`, then put the originals back."""
    bug = {**BUGS, **MIXED_BUGS, **HANGS}[name]
    swaps = bug.detour()
    originals = [(module, attribute, getattr(module, attribute))
                 for module, attribute, _ in swaps]
    for module, attribute, replacement in swaps:
        setattr(module, attribute, replacement)
    try:
        yield bug
    finally:
        for module, attribute, original in originals:
            setattr(module, attribute, original)


def command(bug: Bug | Hang, ranks: int = 4) -> str:
    """A `python -m minipar train` line that shows `bug` on `ranks` ranks (a hang: ended by
    the watchdog, whose line ends with the flight recorder's verdict). A flag whose value
    is True is written alone (`--documents`)."""
    flags = "".join(f" --{key.replace('_', '-')}" + ("" if value is True else f" {value}")
                    for key, value in bug.flags.items())
    end = " --timeout 3" if isinstance(bug, Hang) else " --check"
    return f"mpiexec -n {ranks} python -m minipar train{flags} --inject-bug {bug.name}{end}"


def listing() -> str:
    """`python -m minipar bugs`: every bug, what it breaks, and a run that shows it."""
    lines = [f"{len(BUGS)} bugs to inject with --inject-bug NAME "
             "(mpiexec -n 4 python lessons/08_bugs.py runs them all):"]
    for bug in BUGS.values():
        lines += [f"\n{bug.name}  [{bug.strategy}]", f"  broken: {bug.broken}",
                  f"  needs:  {bug.requires}", f"  try:    {command(bug)}",
                  f"  seen:   {bug.seen}"]
    lines.append(f"\n{len(MIXED_BUGS)} mixed-precision bugs (--mixed; judged by the derived "
                 "tolerance, the replica check and the ledger):")
    for bug in MIXED_BUGS.values():
        lines += [f"\n{bug.name}  [{bug.strategy}]", f"  broken: {bug.broken}",
                  f"  needs:  {bug.requires}", f"  try:    {command(bug)}",
                  f"  seen:   {bug.seen}"]
    lines.append(f"\n{len(HANGS)} hangs (bugs/hangs.py; lessons/15_hangs.py runs them all):")
    for hang in HANGS.values():
        lines += [f"\n{hang.name}  [{hang.strategy}]", f"  broken: {hang.broken}",
                  f"  needs:  {hang.requires}", f"  try:    {command(hang)}"]
    return "\n".join(lines)
