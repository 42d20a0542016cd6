"""Lesson 6: the 3-D mesh. Data x tensor x pipeline parallelism on 8 ranks, dp=tp=pp=2.

    mpiexec -n 8 python lessons/06_hybrid.py
    mpiexec -n 8 python lessons/06_hybrid.py --plot figures   # + 06_ledger.png, 06_pipeline.png

The source text ends with "large models usually combine TP and PP"; in practice
the combination is replicated as well, and each replica takes a slice of the
batch (DP). With 8 ranks, dp = tp = pp = 2 (Megatron-LM's 3-D parallelism,
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters"): every rank has a coordinate on each of the three axes, and talks on
each axis to a different set of partners about a different thing.

  1. the grid: rank = tp_rank + tp (dp_rank + dp pp_rank), tp fastest (minipar/comm/mesh.py);
  2. who talks to whom: each rank asks its own three communicators who is in them,
     and they match the table;
  3. one training step's ledger, per rank and per axis, beside the formulas:
       tp  2 Allreduces of (B/(M dp)) x d per block per microbatch (Megatron)
       pp  one activation and one gradient of (B/(M dp)) x d per microbatch per boundary
       dp  one Allreduce of every gradient this rank holds, once per step;
  4. the same formulas over every way of cutting 8 ranks into dp x tp x pp;
  5. the run against one process.

The code behind it: minipar/run/train.py (each rank builds its piece of the model from the
full initial weights) and minipar/run/mesh_step.py (its step), tensor_parallel.py,
parallel/pipeline/executor.py, data_parallel.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Ledger
from minipar.comm.job import run_collectively, say_in_order, verdict
from minipar.comm.mesh import Mesh, MeshShape
from minipar.core import nn
from minipar.run.reference import RunResult
from minipar.run.results import max_differences
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.settings.validation import problems
from minipar.teaching.ledger_tables import ledger_table

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
MODEL = dict(layers=8, d_in=16, d_model=32, d_ff=128, batch=32, microbatches=2, steps=2,
             schedule="1f1b")
TALK = {"tp": "Allreduce of activations in every block, forward and backward",
        "pp": "Send/Recv of activations forward, their gradients backward",
        "dp": "Allreduce of the gradients, once per step"}


def say(*lines: str) -> None:
    """Print from rank 0 only."""
    if rank == 0:
        print(*lines, sep="\n", flush=True)


def config(dp: int = 2, tp: int = 2, pp: int = 2) -> TrainConfig:
    return TrainConfig(**MODEL, dp=dp, tp=tp, pp=pp).resolved(dp * tp * pp)


# ---------------------------------------------------------- the formulas
def split_by_tp(name: str) -> bool:
    """Megatron cuts fc1 (weight and bias) by columns and fc2's weight by rows."""
    return ".fc1." in name or name.endswith(".fc2.weight")


def parameters_held(cfg: TrainConfig, stage: int) -> int:
    """Parameters of one rank of pipeline stage `stage`: its L/pp blocks (the tp-split
    weights 1/tp each), plus the embedding on the first stage and the head on the last."""
    per_stage = cfg.layers // cfg.pp
    prefixes = tuple(f"blocks.{i}." for i in range(stage * per_stage, (stage + 1) * per_stage))
    prefixes += ("embed.",) * (stage == 0) + ("head.",) * (stage == cfg.pp - 1)
    return sum(int(np.prod(shape)) // (cfg.tp if split_by_tp(name) else 1)
               for name, shape in nn.canonical_shapes(cfg.model_config()).items()
               if name.startswith(prefixes))


def formula(cfg: TrainConfig, stage: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(axis, op) -> (calls, elements) one rank of `stage` records in one step."""
    rows, m, d = cfg.batch // cfg.microbatches // cfg.dp, cfg.microbatches, cfg.d_model
    blocks = cfg.layers // cfg.pp
    boundaries = (stage > 0) + (stage < cfg.pp - 1)   # stages this one talks to
    out = {}
    if cfg.tp > 1:
        out[("tp", "Allreduce")] = (2 * blocks * m, 2 * blocks * m * rows * d)
    if cfg.pp > 1:
        out[("pp", "Isend")] = out[("pp", "Recv")] = (boundaries * m, boundaries * m * rows * d)
    if cfg.dp > 1:
        out[("dp", "Allreduce")] = (1, parameters_held(cfg, stage))
    return out


# ----------------------------------------------------------- the lesson
def the_grid(shape: MeshShape) -> None:
    say(f"=== 1. the grid: {shape.world} ranks as dp x tp x pp = {shape.dp} x {shape.tp} x "
        f"{shape.pp}; rank = tp_rank + tp (dp_rank + dp pp_rank)", shape.table(),
        "tp neighbours are adjacent ranks (on a cluster: one node, the fastest links);",
        "the two pipeline stages are the lower and upper half of the ranks.")


def who_talks(shape: MeshShape) -> None:
    """Each rank asks its real communicators who is in them (not the table)."""
    say("\n=== 2. who talks to whom: each rank's partners on each axis, asked of its own "
        "communicators")
    mesh = Mesh(shape, comm, Ledger())
    groups = {axis: getattr(mesh, axis).comm.allgather(rank)  # world ranks of my group
              for axis in ("tp", "pp", "dp")}
    mesh.free()
    c = shape.coords(rank)
    say_in_order(comm, f"(dp {c['dp']}, tp {c['tp']}, pp {c['pp']}): " + "; ".join(
        f"{axis} with {','.join(map(str, members))}" for axis, members in groups.items()))
    agree = all(sorted(members) in shape.groups(axis) for axis, members in groups.items())
    verdicts = comm.gather(agree)  # did every rank find the table's groups?
    say(*[f"  {axis}: {TALK[axis]}" for axis in TALK],
        f"  communicators agree with the table on every rank: {verdicts and all(verdicts)}")


def the_ledger(cfg: TrainConfig, result: RunResult) -> None:
    """Each rank's ledger of the last step beside the formulas (rank 0)."""
    rows = cfg.batch // cfg.microbatches // cfg.dp
    say(f"\n=== 3. one step's ledger (L={cfg.layers}, B={cfg.batch}, M={cfg.microbatches}, "
        f"d={cfg.d_model}: {rows} rows per microbatch on a rank, {cfg.layers // cfg.pp} "
        "blocks per stage), calls x elements")
    shape = cfg.mesh_shape()
    say(f"{'rank':>4}  {'dp,tp,pp':>8}  {'tp Allreduce':>16}  {'pp Isend':>13}  "
        f"{'pp Recv':>13}  {'dp Allreduce':>14}  formulas")
    every = True
    for r in range(shape.world):
        c = shape.coords(r)
        seen = {(e["group"], e["op"]): (e["calls"], e["elements"])
                for e in result.ledger if e["rank"] == r}
        expected = formula(cfg, c["pp"])
        every &= seen == expected
        cells = [seen.get(key, (0, 0)) for key in (("tp", "Allreduce"), ("pp", "Isend"),
                                                   ("pp", "Recv"), ("dp", "Allreduce"))]
        say(f"{r:>4}  {c['dp']:>4},{c['tp']},{c['pp']}  " + "  ".join(
            f"{calls:>{w - 8}} x {elements // max(calls, 1):<5}" for (calls, elements), w in
            zip(cells, (16, 13, 13, 14))) + f"  {verdict(seen == expected, 'match', 'DIFFER')}")
    say(f"every rank's ledger equals the formulas: {every}",
        f"  tp: 2 x {cfg.layers // cfg.pp} blocks x {cfg.microbatches} microbatches "
        f"Allreduces of {rows} x {cfg.d_model}",
        f"  pp: {cfg.microbatches} activations out + {cfg.microbatches} gradients in per "
        "boundary (and their Recvs on the other side)",
        "  dp: the gradients of this rank's parameters (stage 0: embedding, stage 1: head)",
        "", ledger_table(result.ledger, cfg))


def every_factorization() -> None:
    """The formulas of part 3 over every dp x tp x pp of 8 (pure arithmetic)."""
    say("\n=== 4. the same step on every mesh of 8 ranks (the formulas of part 3, elements "
        "per rank, busiest rank)",
        f"{'dp':>3} {'tp':>3} {'pp':>3} {'tp Allreduce':>13} {'pp Isend':>9} "
        f"{'dp Allreduce':>13}")
    for dp in (1, 2, 4, 8):
        for tp in (t for t in (1, 2, 4, 8) if dp * t <= 8):
            cfg = config(dp, tp, 8 // (dp * tp))
            stages = [formula(cfg, s) for s in range(cfg.pp)]
            cells = [max(f.get(key, (0, 0))[1] for f in stages)
                     for key in (("tp", "Allreduce"), ("pp", "Isend"), ("dp", "Allreduce"))]
            say(f"{dp:>3} {tp:>3} {cfg.pp:>3} {cells[0]:>13} {cells[1]:>9} {cells[2]:>13}")
    say("  tp's traffic grows with the blocks a stage holds and the rows it sees; pp's with",
        "  the rows only; dp's with the parameters a rank holds, which tp and pp both cut.")


def the_check(cfg: TrainConfig, result: RunResult) -> None:
    ref = train_reference(cfg)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(result.losses, ref.losses))
    _, param_rel, _ = max_differences(result.final, ref.final)
    ok = loss_rel <= 1e-9 and param_rel <= 1e-9
    say(f"\n=== 5. dp=2 x tp=2 x pp=2 against one process ({cfg.steps} steps, "
        f"the same batch): losses rel {loss_rel:.1e}, params rel {param_rel:.1e} "
        f"-> {verdict(ok)}")


def figures(cfg: TrainConfig, result: RunResult, folder: Path) -> None:
    """Rank 0: the step's ledger per axis and operation, and the pipeline's timeline."""
    from minipar.core.threads import cores
    from minipar.parallel.pipeline.schedules import replay, simulate_schedule
    from minipar.teaching.ledger_tables import group_sizes
    from minipar.teaching.load_plots import gantt_figure
    from minipar.teaching.plots import ledger_figure, save

    mesh = f"dp = tp = pp = 2, M = {cfg.microbatches}"
    say("figure: " + str(save(ledger_figure(result.ledger, group_sizes(cfg.mesh_shape()),
                                            f"one step on {mesh}: every axis, wire bytes"),
                              folder / "06_ledger.png")))
    sim = simulate_schedule(cfg.schedule, cfg.pp, cfg.microbatches)
    timeline = result.extras["timeline"]
    again = replay(cfg.schedule, cfg.pp, cfg.microbatches, 1, timeline)
    say("figure: " + str(save(gantt_figure(sim, timeline,
                                           f"{mesh}: the 1F1B pipeline of every rank",
                                           replayed=again, cores=cores()),
                              folder / "06_pipeline.png")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    if size != 8:
        say("lesson 6 builds a 2 x 2 x 2 grid: mpiexec -n 8 python lessons/06_hybrid.py")
        sys.exit(2)
    cfg = config()
    errors = problems(cfg, size)
    if errors:  # every rank reaches the same verdict: all stop together
        say(f"lesson 6: {errors[0]}")
        sys.exit(2)
    the_grid(cfg.mesh_shape())
    who_talks(cfg.mesh_shape())
    result = train(cfg, comm)
    if rank == 0:
        the_ledger(cfg, result)
        every_factorization()
        the_check(cfg, result)
        if args.plot:
            figures(cfg, result, args.plot)


if __name__ == "__main__":
    run_collectively(main)
