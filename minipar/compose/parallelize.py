"""The model this rank holds: every strategy of the mesh applied to the reference model.

What this file teaches: how the strategies compose. `parallelize` is the list, in the
order they wrap each other (pipeline stages, tensor and expert parallelism inside a
block, context parallelism inside attention, data parallelism and ZeRO around the
optimizer step); `build_rank_model`, `make_block` and `make_updater` are its steps.
train.py runs the result; nothing here talks before the first step.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from minipar.comm.mesh import Mesh
from minipar.core import gpt, nn
from minipar.core.optim import Optimizer
from minipar.core.recompute import Recomputed
from minipar.parallel.pipeline import chunk_layout, schedules
from minipar.settings.config import TrainConfig

if TYPE_CHECKING:  # dp_updater.py loads mpi4py.MPI
    from minipar.parallel.dp_updater import Updater


def parallelize(cfg: TrainConfig, mesh: Mesh, full: dict[str, np.ndarray],
                optimizer: Optimizer) -> tuple[list[nn.Model], Updater]:
    """The model of this rank with every strategy of the mesh applied, in this order:

    1. pipeline parallelism: the blocks cut into pp x V stages; this rank keeps the
       chunks of its stages (`build_rank_model`);
    2. tensor parallelism (and sequence parallelism): each dense block's fc1 split by
       columns, fc2 by rows over `mesh.tp` (`make_block`);
    3. expert parallelism: each MoE block's experts split over `mesh.ep`, tokens sent
       to their experts by Alltoall (`make_block`);
    4. context parallelism (the transformer): each sequence's positions split over
       `mesh.cp`, the embedding adding the rows of the positions held and attention
       reaching the others' keys by Allgather, ring or Alltoall (`make_block`; the
       step keeps the rank's positions of the batch, `context_positions`); with tp,
       the attention of this tp rank's heads does so;
    5. data parallelism: the gradients synchronized over `mesh.dp` (over dp x cp,
       `mesh.dp_cp`, with context parallelism) after backward, plainly or with
       ZeRO 1/2/3, then the optimizer step (`make_updater`).

    The transformer (gpt.py) goes through the same steps: each of its blocks is
    attention (replicated, synced over dp like any weight) followed by the FFN block
    that 2 and 3 split, and its pipeline stages pass (B/(M dp), T, d).

    Each strategy is handed what it needs (its groups, sizes, the optimizer); returns
    the model chunks and the updater that turns their gradients into a step.
    """
    chunks = build_rank_model(cfg, mesh, full)           # 1, 2, 3, 4
    updater = make_updater(cfg, mesh, chunks, optimizer)  # 5: may wrap the chunks' pieces
    return chunks, updater


def build_rank_model(cfg: TrainConfig, mesh: Mesh, full: dict[str, np.ndarray]
                     ) -> list[nn.Model]:
    """The model pieces this rank holds: one `Model` per pipeline chunk it runs.

    Pipeline rank s with V virtual chunks holds virtual stages s, s+pp, ...; in a
    V (ZB-V, DualPipeV: two chunks) stages s and 2pp-1-s;
    virtual stage v holds blocks [v L/(pp V), (v+1) L/(pp V)); the embedding
    sits on virtual stage 0 and the head on the last. DualPipe holds two copies
    of a pp-stage model: stage s of one and pp-1-s of the other (2 L/pp blocks).
    Blocks are the reference blocks, or their tensor-/expert-parallel versions when
    the mesh asks.
    """
    model_cfg = cfg.model_config()
    chunks_here = schedules.chunks_per_rank(cfg.schedule, cfg.virtual) \
        if cfg.pp > 1 else 1
    layout = schedules.layout_of(cfg.schedule)
    stages = cfg.pp if layout == chunk_layout.DUAL else cfg.pp * chunks_here
    per_stage = cfg.layers // stages
    chunks = []
    enter = leave = None
    if cfg.sp:  # the residual stream is split by rows (the transformer: positions) over
        # tp from the embedding to the head, so pipeline stages pass those shards along
        from minipar.parallel import sequence_parallel  # here: it loads mpi4py.MPI

        enter, leave = sequence_parallel.sequence_parallel_hooks(
            mesh.tp, axis=1 if model_cfg.is_gpt else 0)
    embed, head = (gpt.Embedding, gpt.Head) if model_cfg.is_gpt else (nn.Embed, nn.Head)
    # context parallelism: the embedding adds the rows of the positions this rank holds
    held = context_positions(cfg, mesh) if cfg.cp > 1 else None
    if cfg.cp > 1:
        embed = partial(gpt.Embedding, positions=held, positions_over=mesh.cp)
    if cfg.vocab_parallel:  # rows of tok and columns of the head over tp (vocab_parallel.py)
        from minipar.parallel import vocab_parallel  # here: it loads mpi4py.MPI

        def embed(full: dict) -> nn.Module:
            return vocab_parallel.VocabParallelEmbedding(full, mesh.tp, cfg.sp, held,
                                                         mesh.cp if cfg.cp > 1 else None)

        def head(full: dict) -> nn.Module:
            return vocab_parallel.VocabParallelHead(full, mesh.tp, cfg.sp)
        enter = leave = None  # under SP, the embedding's Reduce_scatter and the head's
        # Allgather are the residual stream's way in and out of its split along T
    for chunk in range(chunks_here):
        v = chunk_layout.model_stage(cfg.pp, chunk_layout.virtual_stage(
            cfg.pp, mesh.coords["pp"], chunk, layout), layout)
        blocks = [make_block(cfg, model_cfg, mesh, full, i)
                  for i in range(v * per_stage, (v + 1) * per_stage)]
        chunks.append(nn.Model(embed(full) if v == 0 else None, blocks,
                               head(full) if v == stages - 1 else None,
                               enter=enter, leave=leave))
    return chunks


def make_block(cfg: TrainConfig, model_cfg: nn.ModelConfig, mesh: Mesh,
               full: dict[str, np.ndarray], index: int) -> nn.Module:
    """Block `index` as this mesh needs it (reference, tensor- or expert-parallel), under
    `--recompute full` wrapped to keep only its input (recompute.py). A transformer
    block is attention (split by heads over tp) followed by that same FFN block
    (LayerNorm `ln2`)."""
    block = make_ffn_block(cfg, model_cfg, mesh, full, index,
                           ln="ln2" if model_cfg.is_gpt else "ln")
    if model_cfg.is_gpt:
        selective = cfg.recompute == "selective"
        core = None
        if cfg.cp > 1:  # attention over the sequence split on cp (context_parallel.py)
            from minipar.parallel import context_parallel  # here: it loads mpi4py.MPI

            core = context_parallel.ContextParallelAttention(mesh.cp, cfg.cp_mode,
                                                              cfg.seq_len)
        if cfg.tp > 1:
            # here: they load mpi4py.MPI; looked up at call time for --inject-bug
            from minipar.parallel import sequence_parallel, tensor_parallel

            kind = sequence_parallel.SequenceParallelAttention if cfg.sp \
                else tensor_parallel.TensorParallelAttention
            attn = kind(full, index, model_cfg.heads, mesh.tp, selective=selective, core=core)
        else:
            attn = gpt.Attention(full, index, model_cfg.heads, selective=selective,
                                 core=core)
        block = gpt.Block(full, index, model_cfg.heads, block, attn=attn)
    return Recomputed(block) if cfg.recompute == "full" else block


def make_ffn_block(cfg: TrainConfig, model_cfg: nn.ModelConfig, mesh: Mesh,
                   full: dict[str, np.ndarray], index: int, ln: str = "ln") -> nn.Module:
    """The FFN block h + FFN(LN(h)) of block `index`, split as the mesh asks. The MoE
    FFN is not split over tp: every tp rank runs it whole (its experts over ep).
    The classes are looked up in their modules at call time, so `--inject-bug` can
    swap what they use."""
    # here: these load mpi4py.MPI, which the one-process reference never needs
    from minipar.parallel import (
        context_parallel,
        expert_parallel,
        sequence_parallel,
        tensor_parallel,
    )

    if model_cfg.is_moe:
        split = cfg.model == "moe" and cfg.tp > 1   # the MLP model: each expert over tp
        if cfg.dp > 1 or cfg.ep > 1 or cfg.cp > 1 or split:
            # tokens split over dp (and cp), experts over ep (and with `split` each expert
            # over tp): the Alltoall dispatch (expert_parallel.py); under cp, capacity
            # needs where each token sits
            layout = None if cfg.cp == 1 else context_parallel.TokenLayout(
                cfg.seq_len, cfg.cp, cfg.cp_mode, cfg.dp, mesh.coords["dp"],
                mesh.coords["cp"])
            moe: nn.Module = expert_parallel.ExpertParallelBlock(full, index, model_cfg, mesh,
                                                                 ln=ln, layout=layout,
                                                                 split_over_tp=split)
        else:
            moe = nn.MoEBlock(full, index, model_cfg, ln=ln)
        if cfg.sp:  # my positions -> all of them, and back (sequence_parallel.py)
            return sequence_parallel.ReplicatedOverTp(moe, mesh.tp)
        return moe
    if cfg.tp > 1:
        if cfg.sp:  # the same block on my rows (positions), sequence_parallel.py
            return sequence_parallel.SequenceParallelBlock(full, index, mesh.tp, ln=ln,
                                                           axis=1 if model_cfg.is_gpt else 0)
        return tensor_parallel.TensorParallelBlock(full, index, mesh.tp, ln=ln)
    return nn.DenseBlock(full, index, ln=ln)


def context_positions(cfg: TrainConfig, mesh: Mesh) -> np.ndarray:
    """The global positions of every sequence this cp rank holds (context_parallel.py)."""
    from minipar.parallel import context_parallel  # here: it loads mpi4py.MPI

    return context_parallel.positions(cfg.seq_len, cfg.cp, mesh.coords["cp"], cfg.cp_mode)


def make_updater(cfg: TrainConfig, mesh: Mesh, chunks: list[nn.Model],
                 optimizer: Optimizer) -> Updater:
    """The object that turns this rank's gradients into updated parameters after each
    step's backward: plain data parallelism (`--grad-sync`) or a ZeRO stage (`--zero`).
    Built once, before the first forward (it may wrap the pieces of `chunks`)."""
    from minipar.core import precision
    from minipar.parallel import dp_updater, fp8_scales, muon_mesh, zero  # here: MPI
    from minipar.parallel.mixed import FullPrecision, MixedStep

    # the precision policy the updater is handed (parallel/mixed.py). --mixed: masters,
    # main gradients, S and the found_inf vote; the vote runs over the world, which holds
    # every axis whose ranks hold different grads. Without: one dtype throughout
    # --fp8-allgather: ZeRO-3 gathers the 8-bit weights as e4m3 bytes, quantized with the
    # scales of the run's recipe (the one the blocks' matmuls use, set by train.py)
    recipe = precision.FP8
    gather = fp8_scales.EightBitGather(recipe) if recipe and recipe.allgather else None
    policy = MixedStep(cfg.mixed, cfg.grad_reduce_dtype, cfg.loss_scale,
                       cfg.loss_scale_window, mesh.world, gather) if cfg.mixed else FullPrecision()
    # how a matrix's pieces meet over the mesh (Muon needs them whole; SGD and Adam never
    # ask): parallel/muon_mesh.py
    optimizer.bind(muon_mesh.MeshMeeting(mesh))
    if cfg.zero == 0:
        updater = dp_updater.DataParallel(chunks, mesh, optimizer, cfg.grad_sync,
                                          cfg.bucket_size, cfg.microbatches, policy)
    else:
        updater = zero.make_zero(cfg.zero, chunks, mesh, optimizer, policy)
    if cfg.clip_grad_norm is not None:  # --clip-grad-norm: between the sync and the step
        from minipar.compose.clip import Clipper

        updater.clipper = Clipper(cfg, mesh, chunks)
    return updater
