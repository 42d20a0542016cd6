"""The run on a mesh of ranks: its loop, one training step, and the end of the run.

What this file teaches: the skeleton every strategy plugs into. One step is

    1. every rank computes the step's global batch from (seed, step) and keeps
       its rows (data.py);
    2. forward and backward over the microbatches: a plain loop, or the
       pipeline schedule when pp > 1 (parallel/pipeline/executor.py); tensor- and
       expert-parallel blocks talk inside the model (comm/collectives.py);
    3. gradients summed over the replicas of each weight and divided by dp
       (data_parallel.py);
    4. the optimizer updates what this rank holds (optim.py);
    5. the ranks check that they agree: the loss finite, the replicas equal
       (agreement.py, which also assembles the full model from their pieces).

`train_step` is that step, `finish` what follows the last one (the ledger, the final
parameters on rank 0, the checkpoint). `train_on_mesh` is the loop around them: the
mesh built, every strategy applied to the model (`start_on_mesh`, compose/parallelize.py),
then `--steps` of `train_step`; run/train.py's `train` and `python -m minipar train`
call it. diloco_train.py's `train_workers` loops over `train_step` too.

Loss bookkeeping: each rank's microbatch loss is its local mean cross-entropy
plus the MoE aux loss, times 1/M; gradients are then summed over the dp ranks
and divided by dp (the source text's g = 1/8 sum_i g_i). The reported loss of
a step is taken before its update, averaged the same way.

    mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --check
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from minipar import placement
from minipar.checkpoint import save_load
from minipar.comm import flight, trace, watchdog
from minipar.comm.mesh import AXES as MESH_AXES
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import context_positions, parallelize
from minipar.core import autograd as ag
from minipar.core import documents, fp8, nn, precision, routing
from minipar.core.data import (
    local_rows,
    rank_rows,
)
from minipar.core.optim import make_optimizer
from minipar.parallel.pipeline import (
    chunk_layout,
    executor,
    schedules,
    stage_trace,
    v_executor,
)
from minipar.run import agreement
from minipar.run.agreement import (
    DivergedError,
    blame,
    gather_biases,
    nonfinite_count,
    replica_check,
    report_loss,
    scaler_of,
)
from minipar.run.reference import RunResult, step_batch, step_done
from minipar.settings.config import TrainConfig

if TYPE_CHECKING:  # dp_updater.py loads mpi4py.MPI; train_reference needs none
    # (run/train.py imports this file and runs train_reference without MPI)
    from minipar.parallel.dp_updater import Updater


def train_on_mesh(cfg: TrainConfig, world: object,
                  on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """The run on a mesh: build it over `world`, apply every strategy to the model
    (`start_on_mesh`), take `--steps` of `train_step`, then `finish`. `cfg` must be
    resolved and free of problems (run/train.py's `train` checks them; the command line
    checks them on every rank before it calls this). Every rank returns the losses; rank 0
    also the full parameters (init and final) and the ledger of the last step from every
    rank."""
    from minipar.comm.collectives import (
        Ledger,  # here: comm/collectives.py loads mpi4py.MPI, train_reference not
    )
    from minipar.parallel import fp8_scales

    mesh = Mesh(cfg.mesh_shape(), world, Ledger())
    try:  # overflow shows up as a DivergedError line, not as NumPy warnings burying it
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"), \
                placement.checking(cfg.check_placements,   # placement/__init__.py: on or off
                                   {axis: getattr(mesh, axis).size for axis in MESH_AXES}), \
                trace.recording(cfg.trace, mesh, cfg.as_json()), \
                precision.use(cfg.mixed, cfg.dtype,   # --mixed: 16-bit ops (precision.py)
                              fp8_scales.over_mesh(fp8.recipe_of(cfg), mesh)):  # --fp8
            chunks, updater, init, losses, start = start_on_mesh(cfg, mesh)
            timeline: list[dict] = []  # the pipeline's instructions of the last step, timed
            steps_ledger: list[dict] = []  # every step's ledger records, each with its "step"
            for step in range(start, cfg.steps):  # --steps is the total, resumed or not
                watchdog.doing(f"step {step + 1} of {cfg.steps}")  # named if a rank gets stuck
                timeline.clear()
                with trace.step(step + 1):   # --trace: one span per step
                    losses.append(train_step(cfg, mesh, chunks, updater, step, timeline))
                steps_ledger += [{"step": step + 1, **r} for r in mesh.ledger.records(mesh.rank)]
                if on_step is not None:
                    step_done(on_step, step, losses[-1], norms_of(updater), scaler_of(updater))
            watchdog.doing("the end of the run (gathering results, saving the checkpoint)")
            return finish(cfg, mesh, chunks, updater, losses, init, timeline, steps_ledger)
    finally:  # also when a step diverges: a sweep or a notebook builds many meshes
        mesh.free()


def start_on_mesh(cfg: TrainConfig, mesh: Mesh
                  ) -> tuple[list[nn.Model], Updater, dict, list[float], int]:
    """Before the first step, on a mesh already built: this rank's chunks and updater,
    the full initial parameters (on rank 0), the losses of the steps already taken (a
    resumed run reports all --steps of them) and the step to start from."""
    # --resume: the full arrays assembled from any mesh's shards, sliced below like init
    saved = save_load.load(cfg.resume) if cfg.resume else None
    full = saved.params if saved else nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)
    optimizer = make_optimizer(cfg.optimizer, cfg.lr, **cfg.optimizer_rule())
    chunks, updater = parallelize(cfg, mesh, full, optimizer)
    trace.instrument(optimizer, updater.memory)  # --trace: optimizer spans, bytes held
    params = [p for chunk in chunks for p in chunk.parameters()]
    # the model as built, read from `full` (ZeRO-3 has dropped p.data by now)
    init, _ = agreement.gather_full_params(mesh, params, cfg, values=full)
    # the saved optimizer state, cut as the updater keeps it (ZeRO: its flat slice)
    start = save_load.restore_optimizer(optimizer, params, saved, updater) if saved else 0
    if saved:  # sigmoid-bias: every block's b as saved (replicated: any mesh takes it whole)
        routing.set_bias_values(chunks, saved.manifest.get("router_bias", {}))
    if saved and scaler_of(updater) is not None and "loss_scaler" in saved.manifest:
        scaler_of(updater).load(saved.manifest["loss_scaler"])  # --mixed: S continues
    losses = list(saved.manifest.get("losses", [])) if saved else []
    return chunks, updater, init, losses, start


def microbatch_loss(chunk: nn.Model, x: np.ndarray | ag.Tensor, y: np.ndarray, scale: float,
                    weight: float = 1.0) -> ag.Tensor:
    """scale * (weight * local mean CE + aux) for a chunk that holds the whole model
    (`weight`: documents.loss_weight with --documents, else 1): nn.loss_fn, scaled."""
    return scaled_loss(chunk, *chunk.forward(ag.as_tensor(x)), y, scale, weight)


def scaled_loss(chunk: nn.Model, logits: ag.Tensor, aux: ag.Tensor | None, y: np.ndarray,
                scale: float, weight: float = 1.0) -> ag.Tensor:
    """`microbatch_loss` from the chunk's forward already run: its logits and aux."""
    loss = nn.output_loss(chunk.head, logits, y)
    loss = loss if weight == 1.0 else loss * weight
    return (loss if aux is None else loss + aux) * scale


def boundary_shape(cfg: TrainConfig) -> tuple[int, ...]:
    """What crosses a stage boundary per microbatch: (B/(M dp), d) rows of the residual
    stream, or (B/(M dp tp), d) with sequence parallelism (the stream is row-split);
    for the transformer (B/(M dp), T/cp, d), the positions of those sequences it holds
    (with sequence parallelism T/(cp tp) of them)."""
    rows = cfg.batch // cfg.microbatches // cfg.dp
    if cfg.model_config().is_gpt:  # cp and sequence parallelism cut positions
        positions = cfg.seq_len // cfg.cp
        return (rows, positions // cfg.tp if cfg.sp else positions, cfg.d_model)
    return (rows // cfg.tp if cfg.sp else rows, cfg.d_model)


def forward_backward(cfg: TrainConfig, mesh: Mesh, chunks: list[nn.Model],
                     x: np.ndarray, y: np.ndarray, timeline: list[dict] | None = None,
                     valid: int | None = None, loss_scale: float = 1.0) -> float:
    """Forward and backward of every microbatch of this rank's rows `x, y` (its rows of
    the global batch, `data.rank_rows`: microbatch after microbatch); returns this
    rank's share of the step loss (sum over microbatches of loss/M). With pp > 1
    the pipeline schedule decides the order (parallel/pipeline/executor.py) and appends the
    wall-clock start/end of each of its instructions to `timeline`. `valid`: with
    --documents, the valid positions of the global batch (documents.global_valid).
    `loss_scale`: the gradient backward starts from (the loss itself is reported
    unscaled): S of --mixed fp16, times 1/dp where the updater averages in the seed
    (overlapped DP, parallel/data_parallel.py)."""
    scale = 1.0 / cfg.microbatches
    positions = cfg.batch * cfg.seq_len   # of the global batch: the masked loss's P

    def weight(labels: np.ndarray) -> float:  # documents.py: the CE's factor P / N
        return 1.0 if valid is None else documents.loss_weight(labels, positions, valid)
    slices = [local_rows(cfg.batch, cfg.microbatches, cfg.dp, m)  # of this rank's rows
              for m in range(cfg.microbatches)]
    # placements (placement/__init__.py): the rows of x are Shard(0) over dp (its positions
    # Shard(1) over cp); so are those that cross a stage boundary, and under sequence
    # parallelism over tp as well (the transformer's positions, dim 1)
    gpt_model = cfg.model_config().is_gpt
    rows_over = (mesh.dp, (mesh.cp, 1)) if cfg.cp > 1 else (mesh.dp,)
    boundary_rows_over = (*rows_over, (mesh.tp, 1) if gpt_model else mesh.tp) if cfg.sp \
        else rows_over
    if cfg.pp > 1:
        def last_stage_loss(logits: ag.Tensor, aux: ag.Tensor | None,
                            labels: np.ndarray) -> ag.Tensor:
            head = next(c.head for c in chunks if c.head is not None)  # the chunk with it
            loss = nn.output_loss(head, logits, labels) * (scale * weight(labels))  # CE / M
            loss = loss if aux is None else loss + aux * scale      # + aux / M
            if placement.ON:  # what the gradient sync expects: at most a mean over dp (x cp)
                placement.loss("the gradient sync", loss, mesh.dp_cp)
            return loss

        # looked up at call time: --inject-bug swaps executor.StageWorker
        worker_class, extension = executor.StageWorker, {}
        layout, split = schedules.layout_of(cfg.schedule), cfg.schedule in schedules.SPLIT_BACKWARD
        if layout != chunk_layout.LOOP or split:   # a V, two chains, B and W apart
            worker_class = v_executor.extended(worker_class)
            extension = dict(layout=layout, split_backward=split)
        worker = worker_class(
            mesh.pp, chunks, x, y, slices, last_stage_loss, scale, boundary_shape(cfg),
            len(chunks), rank=mesh.rank, dtype=precision.LOW if cfg.mixed else cfg.dtype,
            rows_over=rows_over, boundary_rows_over=boundary_rows_over,  # 16-bit between
            **extension)                                                 # stages under --mixed
        worker.backward_seed = loss_scale
        return executor.forward_backward(worker, cfg.schedule, cfg.microbatches,
                                                  timeline)
    total = 0.0
    for m, rows in enumerate(slices):  # gradient accumulation: grads add up in .grad
        flight.set_microbatch(m)  # the flight recorder's calls of this microbatch
        with trace.span("forward", microbatch=m, chunk=0):
            logits, aux = chunks[0].forward(executor.rows_of(ag.Tensor(x[rows]), rows_over))
            loss = scaled_loss(chunks[0], logits, aux, y[rows], scale, weight(y[rows]))
        trace.hold((0, m), loss)  # --trace: the activations the tape keeps
        if placement.ON:  # what the gradient sync expects: at most a mean over dp (x cp)
            placement.loss("the gradient sync", loss, mesh.dp_cp)
        with trace.span("backward", microbatch=m, chunk=0):
            loss.backward(loss_scale)
        trace.release((0, m))
        total += loss.item()
    return total


def train_step(cfg: TrainConfig, mesh: Mesh, chunks: list[nn.Model], updater: Updater,
               step: int, timeline: list[dict],
               rows: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """One training step on this rank; returns the step loss (the same on every rank).
    The ledger holds this step's traffic afterwards (the loss report left out). `rows`:
    the (x, y) this rank trains on, by default its dp rows of the step's global batch
    (--outer diloco hands its worker's rows: diloco_train.py's `train_workers`)."""
    from minipar.parallel import sequence_parallel  # here: it loads mpi4py.MPI

    ledger = mesh.ledger
    ledger.reset()
    # this rank's rows only (B/dp of them), each drawn from its own stream (data.py)
    x, y = rows or step_batch(cfg, step, rank_rows(cfg.batch, cfg.microbatches, cfg.dp,
                                                   mesh.coords["dp"]))
    if cfg.cp > 1:  # (B/dp, T) -> (B/dp, T/cp): the positions of every sequence I hold
        x, y = x[:, context_positions(cfg, mesh)], y[:, context_positions(cfg, mesh)]
    for chunk in chunks:
        for p in chunk.parameters():
            p.grad = None
    valid = None
    if cfg.documents:  # N: the global batch's valid positions (documents.py), before
        from minipar.comm.collectives import (
            allreduce_sum,  # backward (here: comm/collectives.py loads mpi4py.MPI)
        )

        # my rows' (over dp) and positions' (over cp) count -> the global batch's, on every
        # rank; tp and pp ranks hold the labels of their dp x cp peers and sum alike
        valid = int(allreduce_sum(mesh.dp_cp, np.array([documents.valid_positions(y)],
                                                       dtype=np.int64))[0])
    scaler = scaler_of(updater)   # --mixed fp16: the backward starts from S
    if precision.FP8 is not None:  # --fp8: the step's weight amaxes, agreed (fp8_scales.py)
        from minipar.parallel import fp8_scales
        fp8_scales.begin_step(precision.FP8, chunks, updater)
    # backward starts from S (fp16), times 1/dp where the updater averages that way
    seed = (1.0 if scaler is None else scaler.scale) * updater.backward_seed
    local = forward_backward(cfg, mesh, chunks, x, y, timeline, valid, seed)
    flight.set_microbatch(None)  # the syncs below belong to the whole step
    if cfg.schedule in schedules.TWO_WAY and cfg.pp > 1:  # DualPipe: copy + copy
        v_executor.sum_the_two_copies(chunks, mesh.pp)
    if cfg.sp:  # LayerNorm / fc2-bias gradients of row shards: sum over tp first
        sequence_parallel.allreduce_sequence_parallel_grads(chunks, mesh.tp)
    # data parallelism: sum each weight's gradient over its replicas, divide by dp;
    # then the optimizer updates what this rank holds (ZeRO: its slice)
    updater.step()
    if cfg.router == "sigmoid-bias":  # b of every MoE block against the global load: one
        routing.update_biases(chunks, mesh.dp_cp, cfg.bias_rate)  # Allreduce over dp x cp
    ledger.enabled = False  # reporting the loss is not part of training's traffic
    if placement.ON:  # no gradient left a partial sum by the syncs above (placement/__init__.py);
        # every rank learns of any rank's finding, so all stop at this same step
        problem = placement.unsummed_gradient({axis: getattr(mesh, axis).size
                                               for axis in ("dp", "tp", "ep", "edp", "cp")})
        found = [line for line in mesh.world.allgather(problem) if line]
        if found:
            raise placement.PlacementError(found[0])
    loss = report_loss(mesh, local)
    if not math.isfinite(loss):  # the same number on every rank: all stop here
        raise DivergedError(step + 1, cfg.steps, f"the loss is {loss}", blame(cfg, step == 0))
    broken = nonfinite_count(mesh, chunks, updater)   # a finite loss, a broken update
    if broken:
        raise DivergedError(step + 1, cfg.steps, f"the update left {broken} numbers of the "
                            "ranks' parameters NaN or infinite", blame(cfg, first=False))
    # every replica, and S, bitwise equal on every rank after every step (one rank: none)
    if cfg.mixed and mesh.world.size > 1:
        replica_check(mesh, chunks, updater, step + 1)
    ledger.enabled = True
    return loss


def finish(cfg: TrainConfig, mesh: Mesh, chunks: list[nn.Model], updater: Updater,
           losses: list[float], init: dict[str, np.ndarray] | None,
           timeline: list[dict], steps_ledger: list[dict] | None = None) -> RunResult:
    """After the last step: gather the ledger (the last step's, and `steps_ledger`: every
    step's), the timeline and the final parameters on rank 0, and save the checkpoint
    (`--save`)."""
    ledger = mesh.ledger
    last_ledger = ledger.records(mesh.rank)
    ledger.enabled = False
    gathered = mesh.world.gather(last_ledger)
    every_step = mesh.world.gather(steps_ledger or [])
    timelines = stage_trace.gather_timeline(mesh.world, timeline)
    memory = updater.memory()  # bytes of params, grads, optimizer state on this rank
    updater.materialize()  # ZeRO-3: gather every parameter whole before reading p.data
    if cfg.mixed:  # --mixed: what is read and saved from here on are the masters
        updater.use_masters()
    params = [p for chunk in chunks for p in chunk.parameters()]
    final, disagreements = agreement.gather_full_params(mesh, params, cfg)
    biases = gather_biases(mesh, chunks)
    if final is not None:
        final.update(biases[0])
        disagreements += biases[1]
    if cfg.save:  # every rank writes its shard; rank 0 the manifest, last
        with trace.span("checkpoint save", "checkpoint", folder=cfg.save):
            save_load.save(cfg.save, cfg, mesh, updater, updater.optimizer, cfg.steps,
                            losses, keep=cfg.keep, router_bias=biases[0],
                            run=save_load.continued_run(cfg.resume),
                            loss_scaler=None if scaler_of(updater) is None
                            else scaler_of(updater).state())
    return RunResult(losses, init, final,
                     [r for rank in gathered for r in rank] if gathered else [],
                     {"replica_disagreements": disagreements,
                      # every step's ledger of every rank (rank 0): ledger_steps.json
                      "ledger_steps": [r for rank in every_step or [] for r in rank],
                      # --clip-grad-norm: each step's global gradient norm on this rank
                      "gnorms": norms_of(updater),
                      # --mixed: S after the last step and the steps skipped (parallel/mixed.py)
                      # and each step's (S it ran with, skipped?) on this rank
                      **({} if scaler_of(updater) is None else
                         {"loss_scale": scaler_of(updater).scale,
                          "skipped": scaler_of(updater).skipped,
                          "scale_history": updater.precision.history,
                          # fp16: each step's largest finite scaled gradient on this rank
                          "largest_scaled": updater.precision.largest}),
                      "memory": memory,  # memory.ModelStates of this rank, after the last step
                      # stage_trace.gather_timeline: every rank's instructions of the
                      # last step with wall-clock start/end (rank 0; empty with pp = 1)
                      "timeline": timelines or [],
                      # MoE load of the last microbatch, per expert-parallel block of this
                      # rank (parallel/moe/load_stats.py): tokens per expert, drops, ...
                      "expert_load": [block.last_stats for chunk in chunks
                                      for block in chunk.blocks if hasattr(block, "last_stats")],
                      # context parallelism: score entries of each attention's latest
                      # forward on this rank (the work a ring step does or skips)
                      "attention_scores": [getattr(block.attn.core, "last_scores", None)
                                           for chunk in chunks for block in chunk.blocks
                                           if hasattr(block, "attn")]})


def norms_of(updater: Updater) -> list[float]:
    """The global gradient norm of each step taken (clip.Clipper), [] without clipping."""
    clipper = getattr(updater, "clipper", None)
    return clipper.norms if clipper is not None else []

