"""The cost model behind `python -m minipar plan`, part one: the job, and what each rank holds.

What this file teaches. Before a team rents 2048 GPUs for a month it sizes the job
by arithmetic, and the first question is whether it fits: what each GPU holds. Each
number here comes from a formula this project already checks against real runs, so
the planner's answer at 2048 GPUs rests on the same arithmetic as minipar's 8 ranks:

  the job        a `Workload` (the model's arrays block by block, the global batch, bytes
                 per number) cut by a `Plan` (mesh, ZeRO stage, microbatches, options);
                 `rank_shape` lists the arrays one pipeline rank keeps.
  model states   ZeRO's per-rank bytes (memory.py; Rajbhandari et al. 2020): p + g + K
                 bytes per parameter, cut over dp by stage, in integer slices
                 (`memory.shard_counts`): exactly what a minipar rank holds.
  activations    Megatron's count per layer and token (Korthikanti et al. 2022):
                 sbh(34 + 5as/h) bytes for a layer; with TP sbh(10 + 24/t + 5as/(ht)),
                 with TP+SP all of it over t, and selective recomputation drops the
                 5as/h attention scores. A stage holds as many microbatches at once as
                 its schedule has in flight (1F1B: pp - stage, GPipe: all M).

What each rank sends in a step, and what the step costs in seconds: planner/time_cost.py.
Tested by `python -m pytest tests/planner/test_plan.py`; used by `python -m minipar plan`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from minipar.core.memory import BytesPerParam, ModelStates, rank_states
from minipar.parallel.pipeline import chunk_layout, schedules
from minipar.parallel.pipeline.schedules import compute_order
from minipar.parallel.pipeline.simulator import in_flight_peak

Array = tuple[int, bool]  # (elements, split over tp?) of one parameter array


# ------------------------------------------------------------ what is trained
@dataclass(frozen=True, eq=False)
class BlockShape:
    """One layer as the planner prices it: its parameter arrays' sizes in order, and its
    per-token activation bytes (the layer that computes is core/gpt.py's `Block`).

    `arrays` are the arrays every rank of the layer's stage holds (tp-split ones cut
    in tp); `expert` lists the arrays of ONE routed expert (E/ep experts per rank).
    `tp_reductions` counts Megatron's reduction points per direction: 1 for an MLP
    block, 2 for a transformer layer (attention and MLP)."""

    arrays: tuple[Array, ...]
    expert: tuple[int, ...] = ()
    experts: int = 0
    top_k: int = 0
    tp_reductions: int = 1
    act_replicated: float = 0.0  # bytes/token TP leaves whole (LayerNorm inputs...): SP cuts
    act_split: float = 0.0       # bytes/token TP cuts (QKV, the FFN's wide tensors...)
    act_scores: float = 0.0      # bytes/token of attention scores, 5as (selective drops it)
    act_input: float = 0.0       # bytes/token of the layer input (all full recompute keeps)
    act_tp_whole: float = 0.0    # bytes/token whole on every rank once tp > 1, SP or not
    act_sp_cut: float = 0.0      # bytes/token SP adds to the cut part (minipar's tape:
    #                              partial sums, gathered inputs; recompute.py counts them)
    act_tp_replicated: float = 0.0  # bytes/token more TP > 1 leaves whole, SP cuts (minipar:
    #                              fc2's output, which its one-node tp = 1 FFN folds away)
    capacity: bool = False       # MoE with an expert capacity: an Exscan of counts over dp
    sp_gathers: int = 0          # SP: Allgathers per pass of a part every tp rank runs whole
    sp_partial: int | None = None  # SP: gradient elements left partial (None: every unsplit)
    kv_width: int = 0            # numbers per token of K and V together (CP gathers them)
    cheap_replicated: float = 0.0  # bytes/token selective recomputation also drops: norms'
    cheap_split: float = 0.0       # outputs (whole) and the FFN's activation (cut by tp)
    attn_flops: float = 0.0      # forward FLOPs per token of QK^T and AV (no parameters)

    @property
    def moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True, eq=False)
class Workload:
    """A model and its step: blocks, the embedding and head pieces, the global batch
    (`batch` sequences of `seq_len` tokens), and bytes per number of each kind."""

    name: str
    blocks: tuple[BlockShape, ...]
    embed: tuple[Array, ...]
    head: tuple[Array, ...]
    d_model: int
    batch: int
    seq_len: int = 1
    param_bytes: int = 2        # 16-bit weights
    grad_bytes: int = 2
    optimizer_bytes: int = 12   # Adam in mixed precision: fp32 master copy, m, v
    act_bytes: int = 2          # one activation number on the wire
    count_bytes: int = 8        # MoE routing counts (int64)
    bucket_size: int = 12_500_000  # gradient bucket, elements (25 MB of 16-bit numbers)
    split_dims: tuple[int, ...] = ()  # sizes tp must divide (d_ff, the attention heads)
    lookup_embedding: bool = False  # a token embedding is a table lookup: no FLOPs
    vocab_parallel: bool = False  # embedding rows and head columns over tp: their traffic
    sp_partial_embed: int = 0     # SP: gradient elements the first stage's embedding and
    sp_partial_head: int = 0      # the last stage's head leave partial over tp
    tied_head: bool = False     # the head's first array is the embedding's (counted once)
    logit_bytes: float = 0.0    # bytes/token the loss keeps of the logits (fp32: 4 V)
    experts_over_tp: bool = True  # MoE: EP spans tp x dp, each tp rank routing its SP share
    #                               (False: minipar's, every tp rank runs the MoE FFN whole)
    master_bytes: int = 0       # the master copy counted apart (--mixed; 0: inside K)
    microbatch_overhead: float = 0.0  # tokens of compute a microbatch costs beyond its own
    #                                   (workloads.small_microbatch_tokens; 0: not priced)
    routing_bias: bool = False  # MoE balanced by a routing bias: one Allreduce of the
    #                             load a step instead of the aux loss's (time_cost.py)
    muon_matrices: tuple = ()   # one layer's block matrices ((rows, cols), tp-split cols?):
    #                             Muon's under --optimizer muon (planner/muon_cost.py)

    @property
    def layers(self) -> int:
        return len(self.blocks)

    @property
    def per_param(self) -> BytesPerParam:
        """Bytes per parameter by kind (memory.bytes_per_param builds the recipes)."""
        return BytesPerParam(self.param_bytes, self.grad_bytes, self.optimizer_bytes,
                             self.master_bytes)

    @cached_property  # a search asks thousands of times; the fields are frozen
    def params(self) -> int:
        per_block = sum(sum(s for s, _ in b.arrays) + b.experts * sum(b.expert)
                        for b in self.blocks)
        head = self.head[1:] if self.tied_head else self.head  # tied: its matrix is embed's
        return per_block + sum(s for s, _ in self.embed + head)

    @cached_property
    def active_params(self) -> int:
        """Parameters one token passes through: k of the E routed experts."""
        return self.params - sum((b.experts - b.top_k) * sum(b.expert) for b in self.blocks)

    @cached_property
    def flop_params(self) -> int:
        """Parameters one token multiplies by: the active ones but a looked-up embedding."""
        return (self.active_params - (sum(s for s, _ in self.embed) if self.lookup_embedding
                                      else 0)
                + (sum(s for s, _ in self.head[:1]) if self.tied_head else 0))


@dataclass(frozen=True)
class Plan:
    """How the step is split: the mesh, the ZeRO stage, the microbatches, and options."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    sp: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "none"     # "none", "selective" (drop attention scores), "full"
    grad_sync: str = "bucketed"
    cp: int = 1                 # context parallelism: each sequence cut in cp pieces
    # how attention reaches the other pieces: "llama3" (the planner's: K, V Allgathered
    # again in the backward) or minipar's --cp-mode (allgather, ring, zigzag, ulysses)
    cp_mode: str = "llama3"
    fp8: bool = False           # FP8 matmuls and 8-bit weight gathers (time_cost.py)
    optimizer: str = "adam"     # "muon": the block matrices' K is Muon's (planner/muon_cost.py)
    muon_mode: str = "layer-sharded"  # how Muon reaches whole matrices (muon_cost.MODES)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: dp x cp (CP ranks share them, like DP)."""
        return self.dp * self.cp

    def label(self) -> str:
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} " + (f"cp={self.cp} " * (self.cp > 1))
                + f"ep={self.ep} zero={self.zero} M={self.microbatches}")


# ------------------------------------------------------------ who holds what
def stage_blocks(layers: int, stages: int, v: int) -> range:
    """Blocks of virtual stage v when `layers` are cut into `stages` runs, the first
    `layers % stages` runs one block longer (minipar's runs are all equal)."""
    base, extra = divmod(layers, stages)
    start = v * base + min(v, extra)
    return range(start, start + base + (1 if v < extra else 0))


def chunks_per_rank(plan: Plan) -> int:
    """Model chunks a pipeline rank holds: V interleaved, 2 in a V (ZB-V, DualPipeV) and
    in DualPipe (two copies of the model)."""
    return schedules.chunks_per_rank(plan.schedule, plan.virtual) \
        if plan.pp > 1 else 1


def virtual_stages(plan: Plan, stage: int) -> list[int]:
    """The virtual stages pipeline rank `stage` runs: stage, stage + pp, ...; in a V
    (ZB-V, DualPipeV) stage and 2pp-1-stage; DualPipe's rank holds stage and
    pp-1-stage of a pp-stage model (of two copies)."""
    layout = schedules.layout_of(plan.schedule) if plan.pp > 1 \
        else chunk_layout.LOOP
    return [chunk_layout.model_stage(
        plan.pp, chunk_layout.virtual_stage(plan.pp, stage, chunk, layout), layout)
        for chunk in range(chunks_per_rank(plan))]


def model_stages(plan: Plan) -> int:
    """How many runs of blocks the model is cut into: pp x chunks per rank, or pp for
    DualPipe (each rank holds two of the pp stages, of two copies)."""
    two_way = plan.schedule in schedules.TWO_WAY and plan.pp > 1
    return plan.pp if two_way else plan.pp * chunks_per_rank(plan)


@dataclass
class RankShape:
    """What one pipeline rank holds under a plan: pieces (embedding, blocks, head) in
    parameter order, its arrays by sync group, and the counts the formulas need."""

    stage: int
    pieces: list[int]     # elements of each piece here (embedding, block, head), in order
    blocks: list[BlockShape]
    first: bool           # holds virtual stage 0 (the embedding)
    last: bool            # holds the last virtual stage (the head)
    dp_arrays: list[int]  # elements of each array synced over dp, in parameter order
    edp_arrays: list[int]  # expert arrays, synced over the expert-data-parallel group

    @cached_property
    def kinds(self) -> Counter:
        """Each distinct BlockShape here and how many times it repeats (most layers are one
        BlockShape): the formulas sum over these, not over every layer. Read only once the
        shape is built (`rank_shape`)."""
        return Counter(self.blocks)


def rank_shape(w: Workload, plan: Plan, stage: int) -> RankShape:
    """The arrays of pipeline rank `stage`: tp-split arrays cut in tp, E/ep experts."""
    def cut(arrays: tuple[Array, ...]) -> list[int]:
        return [size // plan.tp if split else size for size, split in arrays]

    stages = model_stages(plan)
    shape = RankShape(stage, [], [], False, False, [], [])
    for v in virtual_stages(plan, stage):
        parts = [(w.blocks[i].arrays, w.blocks[i]) for i in stage_blocks(w.layers, stages, v)]
        parts = ([(w.embed, None)] if v == 0 else []) + parts + (
            [(w.head, None)] if v == stages - 1 else [])
        for arrays, block in parts:
            mine = cut(arrays)
            experts = list(block.expert) * (block.experts // plan.ep) if block else []
            shape.dp_arrays += mine
            shape.edp_arrays += experts
            shape.pieces.append(sum(mine) + sum(experts))
            shape.blocks += [block] if block else []
        shape.first, shape.last = shape.first or v == 0, shape.last or v == stages - 1
    return shape


def model_states(w: Workload, plan: Plan, shape: RankShape, dp_rank: int = 0) -> ModelStates:
    """Bytes of parameters, gradients and optimizer state on one rank (ZeRO section 5):
    stage >= 1 keeps only my slice of the optimizer state, >= 2 of the gradients,
    3 of the parameters; slices as memory.shard_counts cuts them (the first ranks one
    larger). Expert arrays are sliced over their own group of tp dp cp / ep ranks
    (DeepSpeed-MoE's way, as parallel/zero.py builds it: one flat vector per group). With context
    parallelism the weights' replicas are dp x cp, and so are the slices."""
    dense, experts = sum(shape.dp_arrays), sum(shape.edp_arrays)
    psi = dense + experts
    edp = (plan.tp if w.experts_over_tp else 1) * plan.replicas // plan.ep
    mine = shard_of(dense, plan.replicas, dp_rank) + shard_of(experts, edp,
                                                              dp_rank // plan.ep % edp)

    states = rank_states(w.per_param, psi, mine, plan.zero)  # memory.py's one formula
    if plan.optimizer != "muon" or not psi:
        return states
    # Muon: a block matrix keeps the fp32 master and ONE fp32 momentum (8 bytes), the
    # rest AdamW's master, m and v (w.optimizer_bytes); the share of this rank's numbers
    # that are block matrices (every one cut by tp, by rows or columns), spread evenly
    # over ZeRO's slices
    share = len(shape.blocks) * sum(r * c for (r, c), _ in w.muon_matrices) / plan.tp / psi
    k = w.optimizer_bytes
    return replace(states, optimizer=states.optimizer * (1 - share * (k - MUON_K_BYTES) / k))


MUON_K_BYTES = 8   # Muon's state of a block matrix's number: fp32 master + fp32 momentum


def shard_of(total: int, ranks: int, rank: int) -> int:
    """memory.shard_counts(total, ranks)[rank], without building the list."""
    base, extra = divmod(total, ranks)
    return base + (1 if rank < extra else 0)


def tokens_per_microbatch(w: Workload, plan: Plan) -> int:
    """Tokens of one microbatch on one data-parallel rank: B s / (dp M), of which a
    context-parallel rank holds 1/cp."""
    return w.batch * w.seq_len // (plan.dp * plan.microbatches * plan.cp)


@lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, microbatches: int, stage: int, virtual: int = 1) -> int:
    """Most (chunk, microbatch) pairs whose activations `stage` holds at once: GPipe
    all M, 1F1B min(pp - stage, M) (PipeDream-flush), interleaved its warm-up plus the
    one forward before the first backward, min(pp - stage + (V - 1) pp, V M); others
    counted from the schedule's own instruction order (simulator.in_flight_peak)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - stage, microbatches)
    if schedule == "interleaved":  # the searches ask for thousands of (pp, M, V): no order
        return min(pp - stage + (virtual - 1) * pp, virtual * microbatches)
    order = compute_order(schedule, pp, microbatches, stage, virtual)
    return in_flight_peak([ins.kind for ins in order])


def activation_bytes(block: BlockShape, tokens: int, plan: Plan) -> float:
    """Bytes one block keeps from its forward to its backward for `tokens` tokens:
    Megatron's sbh(10 + 24/t + 5as/(ht)) split as replicated + split/t + scores/t;
    SP cuts the replicated part too; selective recomputation drops the scores (and the
    block's cheap_* bytes: what is cheap to recompute, if the block names any); full
    recomputation keeps only the block input (Megatron: 2sbh), cut by SP too.
    minipar's own tape adds what its tp layers keep besides (`act_tp_whole`,
    `act_tp_replicated`, `act_sp_cut`: recompute.gpt_block_activation_bytes)."""
    cut = plan.tp if plan.sp else 1
    if plan.recompute == "full":  # the layer's input: the residual stream, cut by SP
        return tokens * block.act_input / cut
    selective = plan.recompute == "selective"
    scores = 0.0 if selective else block.act_scores
    replicated = (block.act_replicated - selective * block.cheap_replicated
                  + (block.act_tp_replicated if plan.tp > 1 else 0.0)
                  + (block.act_sp_cut if plan.sp else 0.0)) / cut
    whole = block.act_tp_whole if plan.tp > 1 else 0.0
    split = block.act_split - selective * block.cheap_split
    return tokens * (replicated + whole + (split + scores) / plan.tp)


def stage_activations(w: Workload, plan: Plan, shape: RankShape) -> float:
    """Peak activation bytes of a pipeline rank: microbatches in flight times what one
    microbatch leaves in its blocks (a chunk's worth with interleaving). With full
    recomputation, add the one block being recomputed (all it keeps, for one microbatch);
    on the last stage add the loss's logits of one microbatch (Korthikanti et al. 2022:
    4sbv bytes in fp32, cut by tp)."""
    if not shape.blocks:
        return 0.0
    tokens = tokens_per_microbatch(w, plan)
    kinds = shape.kinds  # most layers are one BlockShape, repeated
    per_microbatch = sum(n * activation_bytes(b, tokens, plan)
                         for b, n in kinds.items()) / chunks_per_rank(plan)
    alive = in_flight(plan.schedule, plan.pp, plan.microbatches, shape.stage, plan.virtual)
    peak = alive * per_microbatch
    if plan.recompute == "full":
        whole = replace(plan, recompute="none")
        peak += max(activation_bytes(b, tokens, whole) for b in kinds)
    return peak + (tokens * w.logit_bytes / plan.tp if shape.last else 0.0)
