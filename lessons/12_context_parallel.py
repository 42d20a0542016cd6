"""Lesson 12: context parallelism, one sequence split over ranks, four ways.

    mpiexec -n 4 python lessons/12_context_parallel.py
    mpiexec -n 2 python lessons/12_context_parallel.py --quick
    mpiexec -n 4 python lessons/12_context_parallel.py --plot figures   # + 12_ring_blocks.png,
                                          # the ring's traces (figures/trace_ring, ...)

A long sequence does not fit one rank; every layer but attention works position by
position, so cp ranks can each hold T/cp positions of every sequence. Attention needs
the keys and values of every earlier position, and there are four ways to bring them
(minipar/parallel/context_parallel.py; docs/design.md, "Context parallelism"):

  allgather  Allgather K and V (Llama 3): two collectives, but K, V of all T positions;
  ring       K, V blocks go round the ring (Ring Attention), cp - 1 neighbour steps,
             partial results merged by log-sum-exp; masked blocks skipped;
  zigzag     the ring with rank r holding chunks r and 2cp-1-r: the same causal work
             on every rank;
  ulysses    an Alltoall from (B, T/cp, H) to (B, T, H/cp) (DeepSpeed-Ulysses): whole
             sequences of fewer heads, then back; needs cp to divide H.

The lesson trains the same transformer on the same sequences in each mode and prints:

1. what each rank holds (its global positions; Ulysses' heads inside attention);
2. per mode: wire bytes per layer on the cp axis (ledger, with the formula's
   prediction), score blocks computed per rank (measured), peak memory of one
   forward + backward (tracemalloc) and its time (wall clock, slowest rank, median
   and spread of 3 runs, the ranks and cores named: on a shared laptop a noisy
   number, and NumPy's small matmuls favour few big calls),
   and the check against one process;
3. when each one wins, read off those numbers;
4. with --plot, which (query, key) blocks each rank computes at each ring step.
"""

from __future__ import annotations

import argparse
import shutil
import time
import tracemalloc
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Ledger
from minipar.comm.job import run_collectively, verdict
from minipar.comm.mesh import Mesh, MeshShape
from minipar.compose.parallelize import build_rank_model, context_positions
from minipar.core import nn, timing
from minipar.core.byte_units import KiB, format_bytes
from minipar.core.memory import wire_elements
from minipar.core.threads import cores
from minipar.parallel import context_parallel as cpar
from minipar.planner.memory_cost import rank_shape
from minipar.planner.time_cost import cp_traffic
from minipar.planner.workloads import minipar_workload, plan_of
from minipar.run.mesh_step import forward_backward
from minipar.run.reference import step_batch
from minipar.run.results import relative_difference
from minipar.run.train import problems, train, train_reference
from minipar.settings.config import ConfigError, TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.teaching import trace_files, trace_report
from minipar.teaching.ledger_tables import RECEIVES, group_sizes, wire_bytes
from minipar.teaching.lines import print  # the builtin, a line wider than the page wrapped

MODES = ("allgather", "ring", "zigzag", "ulysses")


def holdings(cfg: TrainConfig, cp: int) -> None:
    """Section 1: the global positions (and Ulysses' heads) of every rank."""
    t, h = cfg.seq_len, cfg.heads
    print(f"\n=== 1. what each of the {cp} ranks holds of a sequence of T = {t} positions, "
          f"H = {h} heads", flush=True)
    for r in range(cp):
        runs = {m: cpar.chunks(t, cp, r, m) for m in ("ring", "zigzag")}
        text = {m: " + ".join(f"{c[0]}..{c[-1]}" for c in runs[m]) for m in runs}
        first, last = r * h // cp, (r + 1) * h // cp - 1
        mine = f"head {first}" if first == last else f"heads {first}..{last}"
        print(f"rank {r}: allgather, ring, ulysses positions {text['ring']:>10}   zigzag "
              f"{text['zigzag']:>14}   inside Ulysses' attention: all {t} positions of "
              f"{mine}", flush=True)


def measure_step(cfg: TrainConfig, comm: MPI.Comm, repeats: int = 3
                 ) -> tuple[float, list[float]]:
    """(peak bytes allocated, seconds of each of `repeats` runs) of one forward + backward
    of step 0 on this rank, each run's time the slowest rank's: NumPy reports its
    allocations to tracemalloc, so the peak is what attention and the rest of the model
    keep alive at once (activations, their gradients, weight grads)."""
    mesh = Mesh(cfg.mesh_shape(), comm, Ledger())
    chunks = build_rank_model(cfg, mesh, nn.init_params(cfg.model_config(), cfg.seed))
    x, y = step_batch(cfg, 0)
    if cfg.cp > 1:  # (B, T) -> (B, T/cp), as train does
        x, y = x[:, context_positions(cfg, mesh)], y[:, context_positions(cfg, mesh)]
    forward_backward(cfg, mesh, chunks, x, y)             # warm up
    seconds = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        forward_backward(cfg, mesh, chunks, x, y)
        seconds.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    tracemalloc.start()
    forward_backward(cfg, mesh, chunks, x, y)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    mesh.free()
    return float(peak), seconds


def run_mode(base: dict, mode: str, world: MPI.Comm, trace: Path | None = None) -> dict:
    """Train `base` with --cp world --cp-mode mode; every rank's measurements on rank 0.
    With `trace`, the run is traced there (`train --trace`)."""
    cp = world.Get_size()
    cfg = TrainConfig(**base, cp=cp, cp_mode=mode,
                      trace=None if trace is None else str(trace)).resolved(cp)
    result = train(cfg, world)
    scores = world.gather(result.extras["attention_scores"][0])   # layer 0, every rank
    peak, seconds = measure_step(cfg, world)
    return {"cfg": cfg, "result": result, "scores": scores, "peaks": world.gather(peak),
            "times": seconds}


def predicted_wire_per_layer(cfg: TrainConfig) -> float:
    """The formula's cp wire bytes of one layer (timemodel.cp_traffic, each entry's buffer
    put on the wire by the ring formulas, `memory.wire_elements`; a receive puts nothing
    on the wire: its message is the sender's Isend)."""
    w, plan = minipar_workload(cfg), plan_of(cfg)
    entries = cp_traffic(w, plan, rank_shape(w, plan, 0))
    return sum(wire_elements(t.op, t.elements, cfg.cp) * t.bytes / t.elements
               for t in entries if t.elements and t.op not in RECEIVES) / cfg.layers


def table(runs: dict[str, dict], one: dict, alone: tuple[float, float], cp: int) -> None:
    """Section 2: one line per mode, measured beside predicted."""
    cfg = next(iter(runs.values()))["cfg"]
    block = cfg.batch * cfg.heads * (cfg.seq_len // cp) ** 2     # scores of one block
    print(f"\n=== 2. the four modes on the same sequences (cp = {cp}, B = {cfg.batch}, "
          f"d = {cfg.d_model}, L = {cfg.layers}; a score block is (T/cp)^2 per row and head)",
          flush=True)
    print(f"  cp wire KiB/layer: what rank 0 put on the wire per layer (ring formulas: an "
          f"Allgather's or Alltoall's (cp-1)/cp of its buffer, a Sendrecv its message);\n"
          f"  step ms: one forward + backward, slowest rank, median (min..max) of "
          f"{len(next(iter(runs.values()))['times'])} runs {timing.where(cp)}", flush=True)
    print(f"{'mode':>10} {'cp wire KiB/layer':>18} {'formula':>8} "
          f"{'score blocks per rank':>22} {'peak KiB':>9} {'step ms':>22}  "
          "equal to one process", flush=True)
    sizes = group_sizes(cfg.mesh_shape())
    for mode, run in runs.items():
        mine = [r for r in run["result"].ledger if r["rank"] == 0 and r["group"] == "cp"]
        moved = sum(wire_bytes(r, sizes) for r in mine) / cfg.layers
        predicted = predicted_wire_per_layer(run["cfg"])
        blocks = " ".join(f"{s / block:g}" for s in run["scores"])
        worst = max(relative_difference(run["result"].final[k], v, floor=1e-12)
                    for k, v in one.items())
        same = abs(moved - predicted) <= 1e-9 * max(predicted, 1.0)
        print(f"{mode:>10} {moved / KiB:>18.2f} {verdict(same, '= ok', 'DIFF'):>8} "
              f"{blocks:>22} {max(run['peaks']) / KiB:>9.0f} {step_ms(run['times']):>22}"
              f"  {worst:.1e} {verdict(worst <= 1e-9)}", flush=True)
    print(f"{'one rank':>10} {'-':>18} {'':>8} {cp * cp:>22g} {alone[0] / KiB:>9.0f} "
          f"{step_ms(alone[1]):>22}  (the whole sequence: {cp * cp} blocks of which the mask "
          f"keeps {cp * (cp + 1) // 2}; timed alone {timing.where(1)})", flush=True)
    print(f"  step time: {timing.verdict({m: r['times'] for m, r in runs.items()})} among the "
          "four modes (a mode is fastest only if its slowest run beats every other's fastest)",
          flush=True)


def step_ms(seconds: list[float]) -> str:
    """`12.3 (11.0..15.2)`: the median run and the spread, milliseconds."""
    spread = timing.Spread.of(seconds)
    return f"{spread.median * 1e3:.1f} ({spread.low * 1e3:.1f}..{spread.high * 1e3:.1f})"


def when_each_wins(runs: dict[str, dict], cp: int) -> None:
    """Section 3: the trade-offs, each read off the numbers above."""
    cfg = runs["ring"]["cfg"]
    ring = np.array(runs["ring"]["scores"], dtype=float)
    zig = np.array(runs["zigzag"]["scores"], dtype=float)
    peak = {m: max(r["peaks"]) for m, r in runs.items()}
    print("\n=== 3. when each wins", flush=True)
    print(f"ring: rank {cp - 1} computes {ring.max() / ring.min():g}x the scores of rank 0 "
          f"(the causal mask leaves rank 0 one block): the step waits for the busiest; "
          f"zigzag evens it to {zig.max() / zig.min():g}x {verdict(zig.max() == zig.min())}",
          flush=True)
    print(f"ring and zigzag: {4 * (cp - 1)} Isend/Irecv pairs (K, V, posted before each "
          f"block's compute and waited after it) and {2 * (cp - 1) + 2} Sendrecv (dK, dV) "
          f"per layer and microbatch, cp - 1 = "
          f"{cp - 1} steps one after the other: latency grows with cp, memory does not "
          f"(peak {format_bytes(peak['zigzag'], 0, 'KiB')})", flush=True)
    print(f"allgather: 2 collectives forward, 2 backward, but K and V of all {cfg.seq_len} "
          f"positions on every rank, and all T keys scored (peak "
          f"{format_bytes(peak['allgather'], 0, 'KiB')}): fine while T fits, the first to "
          "run out of memory as T grows", flush=True)
    print(f"ulysses: 8 Alltoalls per layer whatever cp, each of 1/cp of the data, and plain "
          f"attention inside; but cp must divide the H = {cfg.heads} heads (cp <= H), and "
          f"each rank scores whole T x T sequences of its heads (peak "
          f"{format_bytes(peak['ulysses'], 0, 'KiB')})", flush=True)


def ring_pictures(cfg: TrainConfig, cp: int) -> dict[str, list]:
    """modes -> rank -> ring step -> the blocks it computes, in positions: what
    context_parallel.visible_blocks decides, the function ring_attention calls."""
    out = {}
    for mode in ("ring", "zigzag"):
        held = [cpar.chunks(cfg.seq_len, cp, r, mode) for r in range(cp)]
        where = [np.concatenate(h) for h in held]
        out[mode] = [[[(int(where[me][a][0]), int(where[me][a][-1]) + 1,
                        int(where[(me - s) % cp][b][0]), int(where[(me - s) % cp][b][-1]) + 1,
                        not keep.all())
                       for a, b, keep in cpar.visible_blocks(held, me, (me - s) % cp)]
                      for s in range(cp)] for me in range(cp)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter sequences")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    world = MPI.COMM_WORLD
    cp = world.Get_size()
    if cp < 2:
        raise ConfigError("lesson 12 splits sequences over the ranks: run it on 2 or more, "
                          "mpiexec -n 4 python lessons/12_context_parallel.py")
    heads = max(4, cp)  # Ulysses: cp divides H
    base = dict(model="gpt", layers=2, d_model=8 * heads, heads=heads,
                seq_len=(8 if args.quick else 16) * cp, vocab=32, batch=2, steps=2,
                d_ff=32)
    for mode in MODES:   # every mode's refusal (Ulysses: cp must divide H) before the first
        refusals = problems(TrainConfig(**base, cp=cp, cp_mode=mode).resolved(cp), cp)
        if refusals:
            raise ConfigError(f"lesson 12 on {cp} ranks, --cp-mode {mode}: {refusals[0]}")
    traces = {}   # --plot DIR: the ring and zigzag runs traced into DIR/trace_<mode>
    if args.plot:
        traces = {mode: args.plot / f"trace_{mode}" for mode in ("ring", "zigzag")}
        if world.Get_rank() == 0:   # a trace of an earlier run of this lesson: replaced
            for folder in traces.values():
                shutil.rmtree(folder, ignore_errors=True)
        world.Barrier()
    runs = {mode: run_mode(base, mode, world, traces.get(mode)) for mode in MODES}
    alone = measure_step(TrainConfig(**base).resolved(1), MPI.COMM_SELF) if \
        world.Get_rank() == 0 else (0.0, [0.0])
    if world.Get_rank() != 0:
        return
    cfg = runs["ring"]["cfg"]
    holdings(cfg, cp)
    one = train_reference(TrainConfig(**base).resolved(1)).final
    table(runs, one, alone, cp)
    when_each_wins(runs, cp)
    for mode, folder in traces.items():   # what the ring's posted Isend/Irecv hide
        m = trace_report.measure(trace_files.load(folder))
        print(f"{mode}: its cp traffic hidden under compute {m.hidden_by_axis.get('cp', 0):.1%} "
              f"(measured, the K, V blocks posted before each block's compute; "
              f"`python -m minipar trace {folder}` prints the same; {cp} ranks on "
              f"{cores()} cores{' (oversubscribed)' if cp > cores() else ''})", flush=True)
    print("\nthe mesh: " + MeshShape(cp=cp).table().splitlines()[0], flush=True)
    if args.plot:
        from minipar.teaching.load_plots import ring_blocks_figure
        from minipar.teaching.plots import save

        print("figure:", save(ring_blocks_figure(
            ring_pictures(cfg, cp), cfg.seq_len,
            f"ring attention, T = {cfg.seq_len} on {cp} ranks: which (query, key) blocks "
            "each rank computes at each ring step"), args.plot / "12_ring_blocks.png"),
            flush=True)


if __name__ == "__main__":
    run_collectively(main)
