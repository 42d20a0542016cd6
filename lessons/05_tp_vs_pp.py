"""Lesson 5: tensor vs pipeline parallelism, measured on the same model and the same 4 ranks.

    mpiexec -n 4 python lessons/05_tp_vs_pp.py
    mpiexec -n 4 python lessons/05_tp_vs_pp.py --plot figures   # + 05_traffic.png, 05_memory.png

The source text's comparison (its section 5). TP splits the weight matrix of
every layer (W 4096 x 4096 on 4 GPUs as four 4096 x 1024 blocks) and must
AllReduce / AllGather in every forward and every backward: frequent
communication, low memory. PP cuts the stack of layers into stages and passes
only activations from stage to stage: less communication, but a stage waits for
the one before it -- the pipeline bubble, bad when the batch is cut into few
microbatches. Big models combine them: TP inside a stage, PP across stages.

Here each claim is a number from a real run of minipar's model (8 residual MLP
blocks) on the same global batch:

  1. what each rank holds under TP (Megatron-LM, Shoeybi et al. 2019), PP with
     the 1F1B schedule (PipeDream-flush, Narayanan et al. 2021) and tp=2 x pp=2;
  2. one table: communication per step from the ledger (calls, buffer bytes,
     ring wire bytes; the busiest rank and all ranks), parameter bytes and the
     peak bytes of saved activations per rank, the bubble (pipeline simulator
     and formula), and the step time on this machine;
  3. the bubble of PP for M = 1, 4, 8 microbatches;
  4. the source's conclusions, each stated from the numbers above.

Every run is checked against one process on the same global batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Ledger
from minipar.comm.job import run_collectively, say_in_order, verdict
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import build_rank_model
from minipar.core import autograd as ag
from minipar.core import nn, timing
from minipar.core.byte_units import KiB
from minipar.core.recompute import tape_bytes  # node outputs and what their closures hold
from minipar.parallel.pipeline.instructions import COMPUTE
from minipar.parallel.pipeline.schedules import bubble_formula, simulate_schedule
from minipar.parallel.pipeline.simulator import in_flight_peak
from minipar.run.reference import RunResult
from minipar.run.results import max_differences
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.settings.validation import problems
from minipar.teaching.ledger_tables import group_sizes, wire_bytes

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
MODEL = dict(layers=8, d_in=32, d_model=64, d_ff=256, batch=64, steps=5)  # 4 timed steps
MESHES = {"TP": dict(tp=4, pp=1), "PP": dict(tp=1, pp=4), "TP+PP": dict(tp=2, pp=2)}


def say(*lines: str) -> None:
    """Print from rank 0 only."""
    if rank == 0:
        print(*lines, sep="\n", flush=True)


def config(tp: int, pp: int, microbatches: int = 4) -> TrainConfig:
    cfg = TrainConfig(**MODEL, dp=1, tp=tp, pp=pp, microbatches=microbatches,
                      schedule="1f1b").resolved(size)
    errors = problems(cfg, size)
    if errors:  # every rank finds the same problem: all stop together
        say(f"lesson 5: {errors[0]} (run it with mpiexec -n 4)")
        sys.exit(2)
    return cfg


# ------------------------------------------------------------ measuring
def holdings(cfg: TrainConfig) -> tuple[str, int, int]:
    """This rank's model pieces (text), their parameter bytes, and the tape bytes of one
    microbatch's forward through them (a random input for a stage that is not first:
    the shapes, not the values, set the bytes). Every rank calls it together (TP talks)."""
    mesh = Mesh(cfg.mesh_shape(), comm, Ledger())
    chunk = build_rank_model(cfg, mesh, nn.init_params(cfg.model_config(), cfg.seed))[0]
    rows = cfg.batch // cfg.microbatches
    width = cfg.d_in if chunk.embed else cfg.d_model
    x = ag.Tensor(np.random.default_rng(rank).normal(size=(rows, width)),
                  requires_grad=chunk.embed is None)
    out, _ = chunk.forward(x)
    mesh.free()
    index = [int(block.ln.weight.name.split(".")[1]) for block in chunk.blocks]
    fc1 = chunk.blocks[0].fc1.weight
    cols = fc1.full_index[1] if fc1.full_index else slice(0, cfg.d_ff)
    text = (f"blocks {index[0] + 1}-{index[-1] + 1}" + (" + embedding" if chunk.embed else "")
            + (" + head" if chunk.head else "") + f"; fc1 W[:, {cols.start}:{cols.stop}] "
            f"({fc1.data.shape[0]} x {fc1.data.shape[1]}) of each")
    params = sum(p.data.nbytes for p in chunk.parameters())
    return text, params, tape_bytes(out)


def model_bytes() -> int:
    """Bytes of the whole model's parameters: what one process holds."""
    return sum(v.nbytes for v in nn.init_params(TrainConfig(**MODEL).resolved(1)
                                                .model_config(), 0).values())


def traffic(result: RunResult, cfg: TrainConfig) -> list[dict]:
    """Per rank, what it sent in the last step: calls, buffer bytes, ring wire bytes
    (receives are the other end of a send and are not counted again)."""
    per_rank = [{"calls": 0, "bytes": 0, "wire": 0.0} for _ in range(size)]
    sizes = group_sizes(cfg.mesh_shape())
    for r in result.ledger:
        if r["op"] in ("Recv", "Irecv"):
            continue
        mine = per_rank[r["rank"]]
        mine["calls"] += r["calls"]
        mine["bytes"] += r["bytes"]
        mine["wire"] += wire_bytes(r, sizes)  # the same function the figure draws with
    return per_rank


def in_flight(result: RunResult, cfg: TrainConfig) -> list[int]:
    """Peak microbatches whose activations each stage held at once in the real run (from
    its timeline); without a pipeline, one: each forward is followed by its backward."""
    if cfg.pp == 1:
        return [1] * size
    timeline = result.extras["timeline"]
    peak = [in_flight_peak([r["kind"] for r in timeline if r["stage"] == s
                            and r["kind"] in COMPUTE]) for s in range(cfg.pp)]
    return [peak[cfg.mesh_shape().coords(r)["pp"]] for r in range(size)]


def timed_train(cfg: TrainConfig) -> tuple[RunResult, list[float]]:
    """Train; return the result and the wall time (seconds) of every step after the
    first (rank 0's clock; a step ends on every rank together, at its loss)."""
    stamps: list[float] = []
    result = train(cfg, comm, on_step=lambda step, loss: stamps.append(time.perf_counter()))
    return result, [b - a for a, b in zip(stamps, stamps[1:])]


def checked(name: str, cfg: TrainConfig, result: RunResult, refs: dict) -> str:
    """One line: this run against one process on the same global batch (rank 0)."""
    if cfg.microbatches not in refs:
        refs[cfg.microbatches] = train_reference(cfg)
    ref = refs[cfg.microbatches]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(result.losses, ref.losses))
    _, param_rel, _ = max_differences(result.final, ref.final)
    ok = loss_rel <= 1e-9 and param_rel <= 1e-9
    return (f"{name} against one process: losses rel {loss_rel:.1e}, params rel "
            f"{param_rel:.1e} -> {verdict(ok)}")


# ------------------------------------------------------------ the lesson
def the_split() -> dict[str, dict]:
    """Part 1: every rank's pieces under each mesh; returns the measured holdings."""
    d, f = MODEL["d_model"], MODEL["d_ff"]
    say(f"=== 1. the same model on {size} ranks: {MODEL['layers']} blocks, d={d}, f={f}, "
        f"batch {MODEL['batch']} in 4 microbatches",
        f"TP cuts each fc1 ({d} x {f}) into {size} column blocks of {d} x {f // size}, as the "
        f"source cuts W 4096 x 4096 into 4096 x 1024;",
        "PP cuts the stack of blocks into runs, as the source's 48 layers into 1-12, 13-24, ...")
    held = {}
    for name, mesh in MESHES.items():
        cfg = config(**mesh)
        text, params, tape = holdings(cfg)
        say(f"{name} (tp={cfg.tp}, pp={cfg.pp}):")
        say_in_order(comm, text)
        held[name] = {"params": comm.gather(params), "tape": comm.gather(tape)}
    return held


def run_all(held: dict) -> dict[str, dict]:
    """Train each mesh; collect its row of the table (meaningful on rank 0)."""
    rows, refs = {}, {}
    for name, mesh in MESHES.items():
        cfg = config(**mesh)
        result, seconds = timed_train(cfg)
        if rank != 0:
            continue
        sent = traffic(result, cfg)
        flight = in_flight(result, cfg)
        sim = simulate_schedule("1f1b", cfg.pp, cfg.microbatches).bubble if cfg.pp > 1 else 0.0
        rows[name] = {
            "calls": max(r["calls"] for r in sent), "bytes": max(r["bytes"] for r in sent),
            "wire": max(r["wire"] for r in sent), "total": sum(r["wire"] for r in sent),
            "params": max(held[name]["params"]),
            "acts": max(t * f for t, f in zip(held[name]["tape"], flight)),
            "acts_per_rank": [t * f for t, f in zip(held[name]["tape"], flight)],
            "flight": flight, "simulated": sim,
            "formula": bubble_formula("1f1b", cfg.pp, cfg.microbatches) if cfg.pp > 1 else 0.0,
            "ms": 1000 * float(np.median(seconds)), "steps": seconds,
            "check": checked(name, cfg, result, refs),
            "ledger": result.ledger, "sizes": group_sizes(cfg.mesh_shape())}
    return rows


def the_table(rows: dict[str, dict]) -> None:
    """Part 2: the measured table, one column per mesh (rank 0)."""
    whole = model_bytes()
    say("\n=== 2. TP vs PP, measured (one training step, M = 4, 1F1B; busiest rank "
        "unless said)", f"{'':38}" + "".join(f"{name:>14}" for name in rows))
    lines = [
        ("communication calls / rank", "calls", "{:.0f}"),
        ("  buffer KiB / rank (ledger)", "bytes", "{:.1f}"),
        ("  wire KiB / rank (ring)", "wire", "{:.1f}"),
        ("  wire KiB, all ranks", "total", "{:.1f}"),
        (f"parameter KiB / rank (model {whole / KiB:.0f})", "params", "{:.1f}"),
        ("saved activations KiB / rank, peak", "acts", "{:.1f}"),
        ("bubble, simulator", "simulated", "{:.3f}"),
        ("bubble, formula (p-1)/(M+p-1)", "formula", "{:.3f}"),
        ("step time, ms, median", "ms", "{:.1f}"),
    ]
    for title, key, fmt in lines:
        scale = KiB if key in ("bytes", "wire", "total", "params", "acts") else 1
        say(f"{title:38}" + "".join(f"{fmt.format(row[key] / scale):>14}"
                                     for row in rows.values()))
    if not rows:  # the rows are rank 0's
        return
    say(f"  step time {timing.where(size)}, min..max over {len(rows['TP']['steps'])} steps:\n    "
        + ", ".join(f"{name} {1e3 * min(row['steps']):.1f}..{1e3 * max(row['steps']):.1f}"
                    for name, row in rows.items())
        + f"; {timing.verdict({name: row['steps'] for name, row in rows.items()})}")
    say("  activations: tape bytes of one microbatch x microbatches in flight per rank\n    ("
        + ", ".join(f"{name} {row['flight']}" for name, row in rows.items()) + ")")
    say(*[row["check"] for row in rows.values()])


def unbroken(values: list) -> str:
    """`[4,3,2,1]`: a list without spaces, which a wrapped title keeps on one line."""
    return "[" + ",".join(map(str, values)) + "]"


def the_bubble(rows: dict[str, dict]) -> list[float]:
    """Part 3: PP's bubble for M = 1, 4, 8 (M = 4 is the run of part 2)."""
    say(f"\n=== 3. PP's bubble against microbatches (pp = {size}, 1F1B, the same batch)",
        "    M   formula   simulator     step ms: median (min..max over steps)   "
        "against one process")
    bubbles, refs = [], {}
    for m in (1, 4, 8):
        cfg = config(tp=1, pp=size, microbatches=m)
        if m == 4:
            row = rows.get("PP", {})
            seconds, check = row.get("steps") or [0.0], row.get("check", "")
        else:
            result, seconds = timed_train(cfg)
            check = checked("", cfg, result, refs) if rank == 0 else ""
        sim = simulate_schedule("1f1b", size, m).bubble
        bubbles.append(sim)
        spread = timing.Spread.of(seconds).text(digits=1)
        say(f"  {m:3d}   {bubble_formula('1f1b', size, m):7.3f}   {sim:9.3f}   "
            f"{spread:>40}   {check.split(': ')[-1]}")
    say("  (the simulator plays the 1F1B programs with F = 1, B = 2 time units; the step",
        "   time holds more microbatches' fixed costs as M grows -- Python, Send/Recv --",
        f"   and these steps ran as {timing.where(size)[1:-1]}; lessons/04 compares the "
        "wall clock)")
    return bubbles


def conclusions(rows: dict[str, dict], bubbles: list[float]) -> None:
    """Part 4: the source's claims, each with the numbers that bear it out (rank 0)."""
    tp, pp, both = rows["TP"], rows["PP"], rows["TP+PP"]
    cfg = config(tp=size, pp=1)
    L, M, d = cfg.layers, cfg.microbatches, cfg.d_model
    whole = model_bytes()
    least = min(rows, key=lambda name: rows[name]["acts"])
    said = timing.verdict({name: row["steps"] for name, row in rows.items()})
    fastest = said.removeprefix("fastest: ") if said.startswith("fastest") else None
    latency = ("each of TP's many small Allreduces waits for all 4 ranks ('latency may "
               "limit throughput',\n  says the source; here 4 ranks share the cores, so "
               "every wait costs more)" if fastest not in ("TP", None) else
               "here TP's Allreduces cost less than PP's bubble" if fastest == "TP" else
               "the meshes' steps overlap: no mesh is faster beyond the spread of its steps")
    say("\n=== 4. the source's conclusions, from the numbers",
        f"TP communicates in every forward and backward: {tp['calls']:.0f} Allreduces per "
        f"step on every rank (2 per",
        f"  block per microbatch, 2 x {L} x {M}), each of B/M x d = {cfg.batch // M} x {d}; "
        f"PP's busiest rank sends {pp['calls']:.0f} messages",
        "  (an activation and a gradient per microbatch per boundary). On the wire per rank",
        f"  TP puts {tp['wire'] / pp['wire']:.1f} x PP's bytes ({tp['wire'] / KiB:.1f} vs "
        f"{pp['wire'] / KiB:.1f} KiB): TP bytes > PP bytes: {tp['wire'] > pp['wire']}.",
        f"Both cut parameter memory to about 1/{size}: {tp['params'] / whole:.0%} of the model "
        "per rank with TP (embedding,",
        f"  head, LayerNorms stay whole), {pp['params'] / whole:.0%} on PP's largest stage.",
        f"Saved activations, peak per rank: {least} holds the least "
        f"({rows[least]['acts'] / KiB:.1f} KiB); TP keeps one",
        "  microbatch at a time with its f-wide activations cut by tp; PP keeps "
        f"{pp['flight'][0]} microbatches in flight",
        f"  on stage 0 under 1F1B ({pp['acts'] / KiB:.1f} KiB).",
        "PP's bubble shrinks with more microbatches: " + ", ".join(
            f"M={m} {b:.3f}" for m, b in zip((1, 4, 8), bubbles))
        + f"; decreasing: {all(a > b for a, b in zip(bubbles, bubbles[1:]))}.",
        f"Step time {timing.where(size)}: {said} (medians "
        + ", ".join(f"{name} {row['ms']:.0f} ms" for name, row in rows.items()) + ");",
        f"  {latency}.",
        f"TP+PP (tp=2 x pp=2) sits between: {both['wire'] / KiB:.1f} KiB on the wire per rank, "
        f"bubble {both['simulated']:.3f} with 2 stages:",
        "  TP inside a stage (fast links), PP across stages, as large models are deployed.")


def figures(rows: dict[str, dict], held: dict[str, dict], folder: Path) -> None:
    """Rank 0: what each mesh put on the wire per axis, and the parameter and peak
    saved-activation bytes of every rank."""
    from minipar.core.memory import ModelStates
    from minipar.teaching.plots import ledger_compare_figure, memory_figure, save

    tp, pp = rows["TP"]["wire"], rows["PP"]["wire"]
    say("figure: " + str(save(ledger_compare_figure(
        {name: row["ledger"] for name, row in rows.items()},
        {name: row["sizes"] for name, row in rows.items()},
        f"one step on {size} ranks, M = 4: wire bytes of the busiest rank per axis "
        f"(ring formulas); TP puts {tp / pp:.1f} x PP's bytes on the wire"),
        folder / "05_traffic.png")))
    whole = ModelStates(params=model_bytes(), grads=0, optimizer=0)
    say("figure: " + str(save(memory_figure(
        {name: [ModelStates(params=p, grads=0, optimizer=0) for p in held[name]["params"]]
         for name in rows}, {name: whole for name in rows}, "the whole model's parameters",
        f"parameters and peak saved activations on each of the {size} ranks (1F1B, M=4): "
        f"microbatches alive at once per rank, TP {unbroken(rows['TP']['flight'])}, "
        f"PP {unbroken(rows['PP']['flight'])}",
        activations={name: row["acts_per_rank"] for name, row in rows.items()}),
        folder / "05_memory.png")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    if size != 4:
        say("lesson 5 compares TP and PP on 4 ranks: mpiexec -n 4 python lessons/05_tp_vs_pp.py")
        sys.exit(2)
    held = the_split()
    rows = run_all(held)
    the_table(rows)
    bubbles = the_bubble(rows)
    if rank == 0:
        conclusions(rows, bubbles)
    if rank == 0 and args.plot:
        figures(rows, held, args.plot)


if __name__ == "__main__":
    run_collectively(main)
