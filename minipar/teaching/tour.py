"""The guided tour (`make demo`): each strategy of the source text, run once, checked once.

    mpiexec -n 8 python -m minipar tour [--plot DIR]

For every strategy the tour trains the same small model on a mesh of the 8
ranks, then reruns it in one process and prints one line: the mesh in brackets
([dp2 tp4]: 2 replicas of a model split 4 ways), what the busiest rank of each
axis put on the wire in the last step (KiB, from the ledger by the ring
formulas: an Allreduce of N bytes over n ranks sends 2(n-1)/n N from each) and
the largest difference from the single-process run. Figures go to the folder
named at the end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from minipar.core import timing
from minipar.run.results import TOLERANCE, max_differences, relative_difference
from minipar.run.train import problems, train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import output_problems
from minipar.teaching.ledger_tables import group_sizes, sent_per_axis

# (title, flags): the source text's strategies in its order, then what it leads to.
STOPS: list[tuple[str, dict]] = [
    ("DP   data parallel: 8 replicas, g = 1/8 sum g_i", dict(dp=8)),
    ("TP   tensor parallel: fc1 by columns, fc2 by rows", dict(dp=2, tp=4)),
    ("EP   expert parallel: 64 experts, 8 per rank, Alltoall", dict(
        model="moe", dp=8, ep=8, experts=64, top_k=2, capacity_factor=1.25)),
    ("PP   pipeline: 8 blocks on 4 stages, 1F1B", dict(dp=2, pp=4, microbatches=4)),
    ("TP+PP  tensor inside stages, pipeline across", dict(dp=1, tp=2, pp=4, microbatches=4)),
    ("3-D  dp x tp x pp = 2 x 2 x 2", dict(dp=2, tp=2, pp=2, microbatches=2)),
    ("ZeRO-3  parameters, gradients, optimizer state sharded", dict(dp=8, zero=3,
                                                                   optimizer="adam", lr=0.003)),
    # the same strategies on a transformer (gpt.py): the rows are now B*T positions
    ("GPT-DP  a transformer: 8 replicas, the same Allreduce", dict(model="gpt", dp=8)),
    ("GPT-TP  heads, vocabulary over tp; SP along T", dict(model="gpt", dp=2, tp=4,
                                                          sp=True)),
    ("GPT-PP  (B/M dp, T, d) between stages, interleaved", dict(
        model="gpt", dp=2, pp=4, microbatches=4, schedule="interleaved", virtual=2)),
    ("GPT-EP  every position a token, Alltoall to its expert", dict(
        model="gpt-moe", dp=8, ep=8, experts=8, capacity_factor=1.25)),
    ("GPT-ZeRO-3  a transformer's states sharded", dict(model="gpt", dp=8, zero=3,
                                                       optimizer="adam", lr=0.003)),
    ("GPT-3-D  dp x ep x pp = 4 x 2 x 2 on gpt-moe", dict(
        model="gpt-moe", dp=4, ep=2, pp=2, microbatches=2)),
]
TRACED = "PP "   # with --plot DIR, this stop is traced (`train --trace DIR/trace_pp`)
SMALL = dict(layers=8, d_in=16, d_model=32, batch=64, steps=3)
GPT_SMALL = dict(layers=8, d_model=32, heads=4, seq_len=16, batch=16, steps=3)


def mesh_name(cfg: TrainConfig) -> str:
    """'dp2 tp4': the mesh axes of more than one rank."""
    axes = [f"{axis}{getattr(cfg, axis)}" for axis in ("dp", "tp", "pp", "ep")
            if getattr(cfg, axis) > 1 and not (axis == "ep" and not cfg.model_config().is_moe)]
    return " ".join(axes) or "one rank"


def moved(ledger: list[dict], cfg: TrainConfig) -> str:
    """Bytes one rank put on the wire per axis in the last step (the busiest rank of
    each axis; ring formulas, `report.wire_bytes`), axes with nothing to send left out."""
    sent = sent_per_axis(ledger, group_sizes(cfg.mesh_shape()))
    parts = [f"{axis} {value / 1024:.0f} KiB" for axis, value in sent.items() if value]
    return ", ".join(parts) if parts else "nothing"


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI  # here: importing the tour (tests, `--help`) needs no MPI

    from minipar.comm.job import agreed, wait_for_rank0

    parser = argparse.ArgumentParser(prog="python -m minipar tour")
    parser.add_argument("--plot", metavar="DIR", default=None, help="write figures here")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    # before the first stop: a folder one rank cannot write (another host's disk) is every
    # rank's refusal, and a rank launched with other flags is named (comm/job.py)
    unwritable = agreed(world, output_problems({"--plot": args.plot}), ["tour", *(argv or [])])
    if unwritable:
        if rank == 0:
            print(f"minipar: error: {unwritable[0]}", file=sys.stderr, flush=True)
        return 2
    if size != 8:
        if rank == 0:
            print("minipar: error: the tour runs on 8 ranks: mpiexec -n 8 python -m minipar tour",
                  file=sys.stderr)
        return 2
    worst, skipped = 0.0, 0
    start = time.perf_counter()
    if rank == 0:
        print("each line: the strategy, its mesh of the 8 ranks [dp2 tp4 = 2 replicas of a "
              "model split 4 ways],\nthe KiB the busiest rank of each axis put on the wire "
              "in the last step (ring formulas),\nand the largest difference from one "
              "process\n", flush=True)
    stops: list[dict] = []  # what the figures need, kept on rank 0 (with --plot)
    traced = Path(args.plot) / "trace_pp" if args.plot else None
    if traced is not None:   # the trace of an earlier tour: replaced
        if rank == 0:
            shutil.rmtree(traced, ignore_errors=True)
        world.Barrier()
    for title, flags in STOPS:
        base = GPT_SMALL if flags.get("model", "").startswith("gpt") else SMALL
        cfg = TrainConfig(**{**base, **flags}).resolved(size)
        if traced is not None and title.startswith(TRACED):
            cfg = replace(cfg, trace=str(traced))
        errors = problems(cfg, size)
        if errors:  # the same verdict on every rank: skip together
            if rank == 0:
                print(f"{title:<58} skipped: {errors[0]}", flush=True)
            skipped += 1
            continue
        result = train(cfg, world)
        # each rank's bytes of params, grads and optimizer state -> rank 0 (for a figure)
        memory = world.gather(result.extras["memory"], root=0) if args.plot else None
        if rank == 0:
            ref = train_reference(cfg)
            stops.append(dict(title=title, cfg=cfg, losses=result.losses, ledger=result.ledger,
                              reference=ref.losses, memory=memory, extras=result.extras))
            loss_diff = float(np.max(np.abs(np.subtract(result.losses, ref.losses))))
            _, rel, _ = max_differences(result.final, ref.final)
            worst = max(worst, rel, relative_difference(result.losses, ref.losses))
            print(f"{title:<58} [{mesh_name(cfg)}] on the wire {moved(result.ledger, cfg)}; "
                  f"vs one process: loss {loss_diff:.1e}, params rel {rel:.1e}", flush=True)
            if cfg.trace is not None:   # the measured timeline (trace_report.measure)
                from minipar.teaching.trace_files import load
                from minipar.teaching.trace_report import by_axis_text, measure

                m = measure(load(cfg.trace))
                print(f"{'':<5}traced ({cfg.trace}): bubble {m.bubble:.1%}, communication "
                      f"hidden under compute {m.hidden:.1%}{by_axis_text(m)}; wall clock "
                      f"{timing.where(world.Get_size())[1:-1]}", flush=True)
        wait_for_rank0(world)  # the others asleep while rank 0 reruns the stop alone
    ok = worst <= TOLERANCE["float64"] and not skipped
    if rank == 0:
        print(f"every strategy equals one process to {worst:.1e} (relative); "
              f"{time.perf_counter() - start:.1f} s" if ok else
              f"minipar: error: the tour failed: worst relative difference {worst:.1e} "
              f"(tolerance {TOLERANCE['float64']:g}), {skipped} stop(s) skipped", flush=True)
        if args.plot:
            from minipar.teaching.plots import tour_figures  # matplotlib loads only with --plot

            folder = tour_figures(Path(args.plot), stops)
            if traced is not None and (traced / "trace.json").exists():
                from minipar.teaching.plots import save
                from minipar.teaching.trace_files import load
                from minipar.teaching.trace_report import figure

                save(figure(load(traced), "the tour's pipeline stop (dp 2 x pp 4, 1F1B), "
                                          "measured: train --trace"),
                     folder / "tour_trace_pp.png")
            print(f"figures written to {folder}/", flush=True)
    wait_for_rank0(world)
    return world.bcast(0 if ok else 1, root=0)  # rank 0 saw the differences: all exit alike
