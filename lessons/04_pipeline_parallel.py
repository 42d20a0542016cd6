"""Lesson 4: pipeline parallelism. 48 layers on 4 ranks: 1-12 / 13-24 / 25-36 / 37-48.

    mpiexec -n 4 python lessons/04_pipeline_parallel.py
    mpiexec -n 2 python lessons/04_pipeline_parallel.py           # a core per rank on 2 cores
    mpiexec -n 4 python lessons/04_pipeline_parallel.py --quick   # narrower layers (tests)
    mpiexec -n 4 python lessons/04_pipeline_parallel.py --plot figures   # + Gantt charts, bubble,
                                                  # and the 1F1B run's trace (figures/trace_1f1b)

The source text's example: a 48-layer model cut by layers into 4 stages, one per
GPU; the forward flows through them like a pipeline, and the price is the
"pipeline bubble". Here:

  1. the source's example by hand, on raw NumPy layers h -> h + tanh(h W) and raw
     mpi4py calls: layers 1-12 / 13-24 / 25-36 / 37-48 on ranks 0-3, GPipe (Huang et
     al. 2019) with M microbatches, each activation passed on by comm.Send/comm.Recv
     and each gradient passed back; the loss and the 48 weight gradients against one
     process; the schedule each rank ran, rank by rank, and its bubble beside the
     formula (p-1)/(M+p-1);
  2. minipar's pipeline on the same cut (48 residual blocks, GPipe, M = 8) against
     one process, with its bubble: formula, simulator, replayed, wall clock.
  Beyond the source:
  3. the schedules as data (1F1B, PipeDream-flush, Narayanan et al. 2021; interleaved
     1F1B, Megatron-LM; ZB-H1, Qi et al. 2023; ZB-V, Qi et al. 2024; DualPipeV and
     DualPipe, DeepSeek-V3 2024), their splits of the layers, each rank's program
     played by the simulator and printed as a text Gantt chart (a wide one cut into
     windows of cells; --plot draws them whole), and the papers' per-rank bubbles
     (ZB-V's zero, DeepSeek-V3's table);
  4. the bubble of 1F1B for M = 1, 4, 8, 16 microbatches: the formula, the simulator,
     a real run's measured compute times replayed on the schedule's dependencies,
     and its wall-clock timeline. The wall clock can only agree with the formula
     with a core per rank (on 2 cores: `-n 2`); with more ranks than cores it
     measures the ranks taking turns, and the replay shows what the same compute
     would give with a core each (the CPU time of each instruction, which a rank
     does not accumulate while it waits for a core);
  5. activation memory: how many microbatches a stage holds at once, every schedule;
  6. the other six schedules against one process: the largest relative difference.

The code behind it: minipar/parallel/pipeline/schedules.py (schedules, simulator),
minipar/parallel/pipeline/v_schedules.py (ZB-V, DualPipeV, DualPipe) and
minipar/parallel/pipeline/executor.py (the Send/Recv executor).
"""

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Ledger
from minipar.comm.job import run_collectively, say_in_order, verdict, wait_for_rank0
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import build_rank_model
from minipar.core import nn, timing
from minipar.core.threads import cores
from minipar.parallel.pipeline.instructions import COMPUTE
from minipar.parallel.pipeline.schedules import (
    SIMULATED_ONLY,
    UNIT_RULE,
    bubble_formula,
    compute_order,
    replay,
    simulate_schedule,
)
from minipar.parallel.pipeline.simulator import bubble_fraction, gantt, in_flight_peak
from minipar.run.reference import RunResult
from minipar.run.results import max_differences
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.settings.validation import problems
from minipar.teaching import trace_files, trace_report

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
CORES = cores()
SHARED = size > CORES  # more ranks than cores: the wall clock measures the sharing
LAYERS = 48
SMALL = dict(layers=LAYERS, d_in=16, d_model=64, d_ff=128, batch=256, steps=2)
if "--quick" in sys.argv[1:]:  # the same lesson on narrower layers: timings mean less
    SMALL.update(d_model=32, d_ff=64, batch=64)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1),
             ("dualpipev", 1), ("dualpipe", 1))
CHUNKS = {"interleaved": 2, "zb-v": 2, "dualpipev": 2}  # chunks per rank, each 1/C stage
# (DualPipe's two chunks are whole stages, of two copies of the model)


def say(*lines: str) -> None:
    """Print from rank 0 only."""
    if rank == 0:
        print(*lines, sep="\n", flush=True)


TRACED = 8   # with --plot DIR, the 1F1B run of M = 8 is traced into DIR/trace_1f1b


def config(schedule: str = "1f1b", microbatches: int = 8, virtual: int = 1,
           trace: Path | None = None) -> TrainConfig:
    cfg = TrainConfig(**SMALL, pp=size, dp=1, schedule=schedule, microbatches=microbatches,
                      virtual=virtual, trace=None if trace is None else str(trace)
                      ).resolved(size)
    errors = problems(cfg, size)
    if errors:  # every rank finds the same problems, so all stop together
        say(f"lesson 4: {errors[0]}")
        sys.exit(2)
    return cfg


def layer_runs(cfg: TrainConfig) -> str:
    """What this rank holds, in the source's words: layers a-b (1-based) per chunk."""
    mesh = Mesh(cfg.mesh_shape(), comm, Ledger())
    chunks = build_rank_model(cfg, mesh, nn.init_params(cfg.model_config(), cfg.seed))
    mesh.free()
    parts = []
    for chunk in chunks:
        blocks = [int(block.ln.weight.name.split(".")[1]) for block in chunk.blocks]
        extra = (" + embedding" if chunk.embed else "") + (" + head" if chunk.head else "")
        parts.append(f"layers {blocks[0] + 1}-{blocks[-1] + 1}{extra}")
    count = sum(p.data.size for chunk in chunks for p in chunk.parameters())
    return f"{', '.join(parts)} ({count} parameters)"


# ------------------------------------------- part 1: the source's example, by hand
HAND_D, HAND_B = 32, 64          # part 1: raw NumPy layers h + tanh(h W), d = 32, batch 64
HAND_M = (4, 8)                  # microbatches: the Gantt chart of the first is printed


def hand_weights() -> list[np.ndarray]:
    """The 48 layers' weights W_l (d, d), the same on every rank (one seeded draw)."""
    rng = np.random.default_rng(4)
    return [rng.normal(scale=0.5 / np.sqrt(HAND_D), size=(HAND_D, HAND_D))
            for _ in range(LAYERS)]


def hand_data() -> tuple[np.ndarray, np.ndarray]:
    """The batch x (B, d) and its target y (B, d); loss = ||out - y||^2 / (2B)."""
    rng = np.random.default_rng(5)
    return rng.normal(size=(HAND_B, HAND_D)), rng.normal(size=(HAND_B, HAND_D))


def layers_forward(h: np.ndarray, ws: list[np.ndarray]) -> tuple[np.ndarray, list]:
    """h -> h + tanh(h W) through each layer; keeps (input, tanh) of every layer."""
    kept = []
    for w in ws:
        t = np.tanh(h @ w)
        kept.append((h, t))
        h = h + t
    return h, kept


def layers_backward(g: np.ndarray, ws: list[np.ndarray], kept: list,
                    grads: list[np.ndarray]) -> np.ndarray:
    """dL/dh of the layers' input from dL/d(output) g; adds dL/dW into grads."""
    for i in reversed(range(len(ws))):
        h, t = kept[i]
        z = g * (1 - t * t)                  # through the tanh
        grads[i] += h.T @ z                  # dW = h^T dz
        g = g + z @ ws[i].T                  # the residual, plus through W
    return g


def gpipe_by_hand(ws: list[np.ndarray], x: np.ndarray, y: np.ndarray, m: int
                  ) -> tuple[list[np.ndarray], float, list]:
    """GPipe on `size` ranks, written out: rank s holds layers 12s+1..12s+12; all M
    forwards (activations passed on by comm.Send / comm.Recv), then all M backwards
    (gradients passed back the same way). Returns this rank's dW, the loss (last
    rank), and what it ran: (kind, microbatch, CPU seconds, wall start, wall end)."""
    per, rows = LAYERS // size, HAND_B // m
    mine = ws[rank * per:(rank + 1) * per]
    grads = [np.zeros_like(w) for w in mine]
    kept, outs, ran, loss = {}, {}, [], 0.0
    for k in range(m):                                     # the forwards, in order
        if rank == 0:
            h = x[k * rows:(k + 1) * rows]
        else:
            h = np.empty((rows, HAND_D))
            comm.Recv(h, source=rank - 1, tag=k)           # activations from the previous stage
        busy, begun = time.process_time(), time.perf_counter()
        outs[k], kept[k] = layers_forward(h, mine)
        ran.append(("F", k, time.process_time() - busy, begun, time.perf_counter()))
        if rank < size - 1:
            comm.Send(outs[k], dest=rank + 1, tag=k)       # ... to the next stage
    for k in range(m):                                     # then the backwards
        if rank == size - 1:
            diff = outs[k] - y[k * rows:(k + 1) * rows]
            loss += float((diff * diff).sum()) / (2 * HAND_B)
            g = diff / HAND_B                              # dL/d(out) of this microbatch
        else:
            g = np.empty((rows, HAND_D))
            comm.Recv(g, source=rank + 1, tag=m + k)       # gradients from the next stage
        busy, begun = time.process_time(), time.perf_counter()
        g = layers_backward(g, mine, kept.pop(k), grads)
        ran.append(("B", k, time.process_time() - busy, begun, time.perf_counter()))
        if rank > 0:
            comm.Send(g, dest=rank - 1, tag=m + k)         # ... back to the previous stage
    return grads, loss, ran


def placed(runs: list[list], cost) -> dict:
    """Each rank's instructions, in the order it ran them, placed on a clock: an
    instruction starts when its rank is free and its input is there (F of stage s
    after F of s-1, B of s after B of s+1, same microbatch). cost(rank, kind, k, cpu)
    is its duration. Returns {(rank, kind, k): (start, end)}."""
    done: dict = {}
    free = [0.0] * size
    nxt = [0] * size
    while any(nxt[s] < len(runs[s]) for s in range(size)):
        for s in range(size):
            while nxt[s] < len(runs[s]):
                kind, k, cpu = runs[s][nxt[s]][:3]
                need = (s - 1, "F", k) if kind == "F" else (s + 1, "B", k)
                if 0 <= need[0] < size and need not in done:
                    break                                  # its input is not there yet
                ready = done[need][1] if 0 <= need[0] < size else 0.0
                start = max(free[s], ready)
                free[s] = start + cost(s, kind, k, cpu)
                done[(s, kind, k)] = (start, free[s])
                nxt[s] += 1
    return done


def bubble_of(done: dict) -> float:
    """1 - busy / (ranks x span): the idle share of stage-time."""
    busy = sum(end - start for start, end in done.values())
    return 1 - busy / (size * max(end for _, end in done.values()))


def the_hand_pipeline() -> None:
    """Part 1: the 48 layers cut 12/12/12/12, GPipe by hand, against one process."""
    ws = hand_weights()
    x, y = hand_data()
    say(f"=== 1. the source's example by hand: {LAYERS} layers cut "
        + "/".join([str(LAYERS // size)] * size) + f" on {size} ranks, GPipe, "
        "comm.Send / comm.Recv",
        f"  raw NumPy layers h -> h + tanh(h W_l), d = {HAND_D}, batch {HAND_B} in M "
        "microbatches, loss ||out - y||^2 / (2B)")
    per = LAYERS // size
    say_in_order(comm, f"layers {rank * per + 1}-{(rank + 1) * per}")
    for m in HAND_M:
        wait_for_rank0(comm)
        grads, loss, ran = gpipe_by_hand(ws, x, y, m)
        everything = comm.gather((grads, loss, ran))
        if rank != 0:
            continue
        hand_grads = [g for rank_grads, _, _ in everything for g in rank_grads]
        hand_loss = everything[-1][1]
        out, kept = layers_forward(x, ws)                  # one process: all 48 layers
        alone = [np.zeros_like(w) for w in ws]
        layers_backward((out - y) / HAND_B, ws, kept, alone)
        alone_loss = float(((out - y) ** 2).sum()) / (2 * HAND_B)
        worst = max(float(np.abs(a - b).max() / np.abs(b).max())
                    for a, b in zip(hand_grads, alone))
        loss_rel = abs(hand_loss - alone_loss) / alone_loss
        runs = [r for _, _, r in everything]
        units = placed(runs, lambda s, kind, k, cpu: 1.0 if kind == "F" else 2.0)
        cpu = placed(runs, lambda s, kind, k, cpu: cpu)
        t0 = min(r[3] for rs in runs for r in rs)
        wall = {(s, kind, k): (a - t0, b - t0) for s, rs in enumerate(runs)
                for kind, k, _, a, b in rs}
        say(f"  M = {m}: one process on all {HAND_B} rows: loss rel diff {loss_rel:.1e}, "
            f"the {LAYERS} dW max rel diff {worst:.1e} -> {verdict(max(worst, loss_rel) <= 1e-9)}")
        if m == HAND_M[0]:
            span = int(max(end for _, end in units.values()))
            say(f"  the schedule each rank ran, placed with F = 1 unit and B = 2 (its input "
                f"there first); '.' = idle, T = {span} units:")
            for s in range(size):
                cells = ["."] * span
                for (r, kind, k), (a, b) in units.items():
                    if r == s:
                        cells[int(a):int(b)] = [f"{kind}{k + 1}"] * int(b - a)
                say(f"    rank {s}: " + " ".join(c.ljust(2) for c in cells).rstrip())
        ms = {kind: 1000 * np.mean([r[2] for rs in runs for r in rs if r[0] == kind])
              for kind in "FB"}
        say(f"  bubble at M = {m}: formula (p-1)/(M+p-1) = {(size - 1) / (m + size - 1):.3f}; "
            f"the schedule it ran, F = 1 and B = 2 units: {bubble_of(units):.3f};",
            f"    its measured CPU times (mean F {ms['F']:.2f} ms, B {ms['B']:.2f} ms) placed "
            f"the same way: {bubble_of(cpu):.3f}; its wall clock {bubble_of(wall):.3f}",
            f"    ({size} ranks on {CORES} cores" + (", taking turns)" if SHARED else ")"))
    say("  (the formula counts F = 1, B = 2; the CPU times are these small layers' own, "
        "Python's fixed costs included)")
    wait_for_rank0(comm)  # the others asleep while rank 0 checked the last M alone


# ------------------------------------------------- part 2: the library's run of it
def the_library(runs: dict, microbatches: int = 8) -> None:
    say(f"\n=== 2. the same cut with minipar's pipeline (minipar/parallel/pipeline/executor.py): "
        f"GPipe, M = {microbatches}",
        f"  minipar's model: {LAYERS} residual blocks (LayerNorm, GELU FFN), the embedding "
        "on rank 0, the head on the last rank;",
        f"  the same Send/Recv of activations and gradients, {SMALL['steps']} SGD steps, "
        "against the same model in one process:")
    say_in_order(comm, layer_runs(config("gpipe", microbatches)))
    runs[("gpipe", microbatches)] = train(config("gpipe", microbatches), comm)
    check_one("gpipe", 1, runs, microbatches)


def other_splits() -> None:
    say(f"the splits of the other schedules: with --virtual 2 (interleaved), each rank holds "
        f"two chunks of {LAYERS // (2 * size)} layers:")
    say_in_order(comm, layer_runs(config("interleaved", 8, 2)))
    say("in a V (ZB-V, DualPipeV), rank s holds chunks s and 2pp-1-s: rank 0 holds the "
        "first and the last")
    say_in_order(comm, layer_runs(config("zb-v", 8)))
    say("DualPipe feeds microbatches from both ends: rank r holds stage r of one copy and",
        "stage pp-1-r of another, twice the parameters (the copies' gradients are summed)")
    say_in_order(comm, layer_runs(config("dualpipe", 8)))


def wrapped(lines: list[str], width: int = 118) -> list[str]:
    """A text Gantt chart (one line per rank, fixed-width cells) cut into windows of
    whole cells, each at most `width` characters wide: the rows of one window, then the
    next window's."""
    if max(len(line) for line in lines) <= width:
        return lines
    prefix = max(line.index(": ") + 2 for line in lines)
    bodies = [line[prefix:] for line in lines]
    stride = max(len(cell) for body in bodies for cell in body.split()) + 1
    cells = (max(len(body) for body in bodies) + 1) // stride
    per = (width - prefix - 2) // stride
    out = []
    for first in range(0, cells, per):
        out.append(f"  cells {first + 1}-{min(cells, first + per)} of {cells}:")
        out += ["  " + line[:prefix] + body.ljust(cells * stride)[first * stride:
                                                               (first + per) * stride].rstrip()
                for line, body in zip(lines, bodies)]
    return out


# ------------------------------------------------------- part 3: the schedules
def the_schedules(microbatches: int = 4) -> None:
    say("\n=== 3. Beyond the source: seven schedules (GPipe, 1F1B, interleaved, ZB-H1, ZB-V, "
        "DualPipeV, DualPipe)")
    other_splits()
    say(f"the schedules as data: each rank's program, simulated (pp={size}, M={microbatches}; "
        f"one rule for every schedule,", f"{UNIT_RULE}", "(split B = W = 1, F&B = 3): an "
        "interleaved chunk 1/V, a V's 1/2; '.' = idle)")
    for name, virtual in SCHEDULES:
        m = max(microbatches, 2 * size) if name in ("dualpipev", "dualpipe") else microbatches
        sim = simulate_schedule(name, size, m, virtual)
        title = f"{name}" + (f" --virtual {virtual} (chunks a, b: each holds 1/{virtual} of "
                             f"the rank's layers, F = {1 / virtual:g}, B = {2 / virtual:g}; "
                             f"one cell = {1 / virtual:g} unit)" if virtual > 1 else "") \
            + (" (chunks a, b in a V: each half a stage, F = B = W = 0.5, F&B = 1.5; one "
               "cell = 0.5 unit)" if name in ("zb-v", "dualpipev") else "") \
            + (f" (a: microbatches 1-{m // 2} enter at rank 0, b: {m // 2 + 1}-{m} at rank "
               f"{size - 1})" if name == "dualpipe" else "") \
            + (f", M = {m}" if m != microbatches else "")
        say(f"{title}:", f"  T = {sim.makespan:g} units, bubble {sim.bubble:.3f}, each rank "
            f"idle between its first and last instruction "
            f"[{', '.join(f'{t:g}' for t in sim.idle)}]",
            *wrapped([line.replace("stage", "rank") for line in gantt(sim, size)]))
    one = simulate_schedule("1f1b", size, microbatches).makespan
    two = simulate_schedule("interleaved", size, microbatches, 2).makespan
    say(f"the same model, the same work per rank (3M = {3 * microbatches} units): 1F1B takes "
        f"T = {one:g}, interleaved {two:g}:", "its warm-up and cool-down are made of half-size "
        f"chunks, 3(pp-1)/V = {3 * (size - 1) / 2:g} units of fill instead of {3 * (size - 1)}.")
    spans = {name: simulate_schedule(name, size, max(8, 2 * size), virtual).makespan
             for name, virtual in SCHEDULES}
    say(f"at M = {max(8, 2 * size)} (the figures), T in these units:",
        "  " + ", ".join(f"{name} {t:g}" for name, t in spans.items()),
        f"(every one does 3M = {3 * max(8, 2 * size)} units of work per rank).")
    the_papers_bubbles()


def the_papers_bubbles() -> None:
    """The papers count the bubble per rank: idle time between a rank's own first and last
    instruction, the worst rank's, in stage units (a stage's F = B = W = 1, F&B = 3; a V's
    chunk half of each)."""
    say("the papers' bubble: the worst rank's idle time between its own first and last "
        "instruction", f"(pp = {size}; a stage's F = B = W = 1, F&B = 3; a V's chunk 0.5, 1.5), "
        "for M microbatches:",
        "     M   1f1b   zb-h1   zb-v   dualpipev   dualpipe")
    for m in (2 * size - 2, 2 * size - 1, 2 * size, 4 * size):
        idle = {name: max(simulate_schedule(name, size, m).idle)
                for name in ("1f1b", "zb-h1", "zb-v")}
        for name in ("dualpipev", "dualpipe"):
            fits = m >= 2 * size and (name == "dualpipev" or m % 2 == 0)
            idle[name] = max(simulate_schedule(name, size, m).idle) if fits else None
        cells = [f"{idle[n]:g}" if idle[n] is not None else "-"
                 for n in ("1f1b", "zb-h1", "zb-v", "dualpipev", "dualpipe")]
        say(f"  {m:4d}   {cells[0]:>4}   {cells[1]:>5}   {cells[2]:>4}   {cells[3]:>9}   "
            f"{cells[4]:>8}")
    say(f"  1F1B (pp-1)(F+B+W) = {3 * (size - 1)}, ZB-H1 (pp-1)(F+B-W) = {size - 1}; ZB-V 0 "
        f"once M >= 2pp-1 = {2 * size - 1};", "  DualPipeV, DeepSeek-V3 Table 2 with PP = 2pp: "
        f"(PP/2-1)(F&B+B-3W) = {size - 1} (its chunk's F&B = 1.5, full B = 1, W = 0.5);",
        f"  DualPipe on PP = pp = {size} ranks: (PP/2-1)(F&B+B-3W) = {2 * (size // 2 - 1)} "
        "(its chunks are whole stages,", "  of two model copies: 2x the parameters).")


# ---------------------------------------------------------- part 4: the bubble
def measured(result: RunResult) -> float:
    """The bubble of the real run's last step, from its wall-clock timeline (rank 0)."""
    intervals = [(r["stage"], r["start"], r["end"]) for r in result.extras["timeline"]
                 if r["kind"] in COMPUTE]
    return bubble_fraction(intervals, size)


def mean_ms(result: RunResult, kind: str) -> float:
    """Mean wall-clock duration of one `kind` instruction (F or B) in milliseconds."""
    times = [r["end"] - r["start"] for r in result.extras["timeline"] if r["kind"] == kind]
    return 1000 * sum(times) / len(times)


def replayed(name: str, result: RunResult, microbatches: int, virtual: int = 1) -> float:
    """The bubble of the real run's compute, each instruction's measured CPU time
    replayed on the schedule's dependencies (communication free)."""
    return replay(name, size, microbatches, virtual, result.extras["timeline"]).bubble


def the_bubble(runs: dict, trace: Path | None = None) -> None:
    say(f"\n=== 4. Beyond the source: the bubble of 1F1B against M: idle share of stage-time, "
        f"pp = {size};",
        f"  the wall clock {timing.where(size)}; F ms, B ms: the mean wall-clock F and B of the "
        "last step",
        "    M   formula (p-1)/(M+p-1)   simulator   replayed CPU times   wall clock   "
        "F ms   B ms")
    for m in (1, 4, 8, 16):
        traced = trace if m == TRACED else None   # --trace DIR, as `train --trace` does
        runs[("1f1b", m)] = result = train(config("1f1b", m, trace=traced), comm)
        if rank == 0:
            sim = simulate_schedule("1f1b", size, m).bubble
            print(f"  {m:3d}   {bubble_formula('1f1b', size, m):21.3f}   {sim:9.3f}   "
                  f"{replayed('1f1b', result, m):18.3f}   {measured(result):10.3f}   "
                  f"{mean_ms(result, 'F'):4.1f}   {mean_ms(result, 'B'):4.1f}", flush=True)
    if rank == 0:
        last = runs[("1f1b", 16)].extras["timeline"]
        spread = {kind: timing.Spread.of([r["end"] - r["start"] for r in last
                                          if r["kind"] == kind]) for kind in ("F", "B")}
        print(f"  M = 16, wall clock of one instruction {timing.where(size)}:\n    F "
              f"{spread['F'].text()}, B {spread['B'].text()}", flush=True)
    say("  replayed: each F and B takes the CPU time it was measured to take in this run,",
        "  and the 1F1B program's dependencies place it; no communication cost.")
    if trace is not None and rank == 0:   # the same M = 8 run, read from its timeline
        measured_trace = trace_report.measure(trace_files.load(trace))
        print(f"  its trace: `python -m minipar trace {trace}` prints the same:\n"
              f"    M = {TRACED} bubble {measured_trace.bubble:.1%}, communication hidden "
              f"under compute {measured_trace.hidden:.1%}; {size} ranks on {CORES} cores"
              + (" (oversubscribed)" if SHARED else ""), flush=True)
    if SHARED:
        say(f"  the wall clock: {size} ranks take turns on {CORES} cores, so a rank is idle",
            "  whenever another has its core; only with a core per rank (here: -n 2) can it",
            "  approach the formula. The replay is what these compute times give with one each.")
    else:
        say("  the wall clock adds what the formula leaves out: every Send/Recv and Python call,",
            "  and other jobs on the machine. With a core per rank and microbatches big enough",
            "  it follows the formula (test_bubble.py: within 0.1 at M = 4 on 2 ranks);",
            "  as M grows each microbatch shrinks, those fixed costs do not, and it stays above.")


# ----------------------------------------------------------- part 5: memory
def the_memory(runs: dict, microbatches: int = 8) -> None:
    say(f"\n=== 5. Beyond the source: activation memory: microbatches a stage holds at once "
        f"(M = {microbatches})")
    for name, virtual in SCHEDULES:
        sim = simulate_schedule(name, size, microbatches, virtual).peak_in_flight
        key = (name, microbatches)
        runs[key] = runs.get(key) or train(config(name, microbatches, virtual), comm)
        if rank == 0:
            timeline = runs[key].extras["timeline"]
            real = [in_flight_peak([r["kind"] for r in timeline
                                    if r["stage"] == s and r["kind"] in COMPUTE])
                    for s in range(size)]
            chunks = CHUNKS.get(name, 1)
            whole = "" if chunks == 1 else (
                f"\n{'':>15}chunk-activations of 1/{chunks} stage = "
                f"{[round(p / chunks, 1) for p in sim]} stages' worth")
            whole += " whole stages of two model copies" if name == "dualpipe" else ""
            print(f"  {name:>11}: simulator {sim}, real run {real}{whole}", flush=True)
    say(f"  GPipe keeps all M = {microbatches} microbatches' activations until the "
        f"backwards start;", "  1F1B at most pp - stage (<= {size}), whatever M is;",
        f"  ZB-V at most 2pp chunks (1F1B's {size} stages' worth) on every rank, DualPipeV one "
        "chunk more (DeepSeek-V3's PP + 1);",
        f"  DualPipe PP + 1 = {size + 1} whole stages, and twice the parameters of the others.")


# ----------------------------------------------------------- part 6: the check
def check_one(name: str, virtual: int, runs: dict, microbatches: int) -> None:
    """One schedule's run against one process: rank 0 reruns the model alone and prints
    the largest relative difference of the losses and parameters, and the bubble."""
    wait_for_rank0(comm)  # the others asleep while rank 0 reran the last one alone
    cfg = config(name, microbatches, virtual)
    result = runs.get((name, microbatches)) or train(cfg, comm)
    runs[(name, microbatches)] = result
    if rank != 0:
        return
    ran = [f"{r['kind']}{r['microbatch'] + 1}" for r in result.extras["timeline"]
           if r["stage"] == 0 and r["kind"] in COMPUTE]
    planned = [f"{i.kind}{i.microbatch + 1}"
               for i in compute_order(name, size, microbatches, 0, virtual)]
    ref = train_reference(cfg)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(result.losses, ref.losses))
    _, param_rel, _ = max_differences(result.final, ref.final)
    formula = "" if name in SIMULATED_ONLY else \
        f"formula {bubble_formula(name, size, microbatches, virtual):.3f}, "
    print(f"  {name:>11}: bubble replayed {replayed(name, result, microbatches, virtual):.3f}"
          f", wall clock {measured(result):.3f} ({formula}"
          f"simulator {simulate_schedule(name, size, microbatches, virtual).bubble:.3f});\n"
          f"{'':>15}rank 0 ran its "
          f"program in order: {verdict(ran == planned, 'yes', 'NO')}; max rel diff "
          f"losses {loss_rel:.1e}, params {param_rel:.1e} "
          f"-> {verdict(max(loss_rel, param_rel) <= 1e-9)}", flush=True)


def the_check(runs: dict, microbatches: int = 8) -> None:
    say(f"\n=== 6. Beyond the source: the other schedules against one process (M = {microbatches}, "
        f"{SMALL['steps']} SGD steps;",
        f"  the wall clock {timing.where(size)[1:-1]}; GPipe's line is part 2's)")
    for name, virtual in SCHEDULES:
        if name != "gpipe":
            check_one(name, virtual, runs, microbatches)
    if rank == 0:
        timeline = runs[("1f1b", microbatches)].extras["timeline"]
        print("  what rank 0 ran under 1F1B, in wall-clock order: " + " ".join(
            f"{r['kind']}{r['microbatch'] + 1}" for r in timeline
            if r["stage"] == 0 and r["kind"] in COMPUTE), flush=True)


def figures(runs: dict, folder: Path, microbatches: int = 8) -> None:
    """Rank 0: each schedule simulated beside its real run (Gantt charts), and the bubble
    against M: formulas, simulator, and the measured 1F1B runs of part 3."""
    from minipar.teaching.load_plots import bubble_figure, gantt_figure, in_flight_memory_figure
    from minipar.teaching.plots import save

    for name, virtual in SCHEDULES:
        sim = simulate_schedule(name, size, microbatches, virtual)
        title = (f"{name}" + (f", V = {virtual} chunks per rank" if virtual > 1 else "")
                 + f": pp = {size}, M = {microbatches}, {LAYERS} layers")
        timeline = runs[(name, microbatches)].extras["timeline"]
        again = replay(name, size, microbatches, virtual, timeline)
        print("figure:", save(gantt_figure(sim, timeline, title, replayed=again, cores=CORES),
                              folder / f"04_gantt_{name}.png"), flush=True)
    wall = {m: measured(runs[("1f1b", m)]) for m in (1, 4, 8, 16)}
    again = {m: replayed("1f1b", runs[("1f1b", m)], m) for m in (1, 4, 8, 16)}
    label = (f"1F1B, real run, wall clock ({size} ranks on {CORES} cores"
             + (": oversubscribed)" if SHARED else ")"))
    every = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1), ("dualpipev", 1),
             ("dualpipe", 1))
    print("figure:", save(bubble_figure(size, schedules=every, measured=wall, replayed=again,
                                        measured_label=label), folder / "04_bubble.png"),
          flush=True)
    print("figure:", save(in_flight_memory_figure(size, microbatches, SCHEDULES, CHUNKS),
                          folder / "04_memory.png"), flush=True)
    doc = trace_files.load(folder / "trace_1f1b")   # the traced 1F1B run of part 3
    print("figure:", save(trace_report.figure(
        doc, f"1F1B, pp = {size}, M = {TRACED}: the measured timeline (train --trace); the "
             f"simulated one beside it in 04_gantt_1f1b.png"), folder / "04_trace_1f1b.png"),
        flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="narrower layers (tests)")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    if size not in (2, 4):  # M = 4 and 8 split in groups of pp; 48 layers in 2 pp chunks
        say("lesson 4 runs on 2 or 4 ranks: mpiexec -n 4 python lessons/04_pipeline_parallel.py")
        sys.exit(2)
    runs: dict = {}
    trace = None if args.plot is None else args.plot / "trace_1f1b"
    if trace is not None:   # a trace folder of an earlier run of this lesson: replaced
        if rank == 0:
            shutil.rmtree(trace, ignore_errors=True)
        comm.Barrier()
    the_hand_pipeline()
    the_library(runs)
    the_schedules()
    the_bubble(runs, trace)
    the_memory(runs)
    the_check(runs)
    if args.plot and rank == 0:
        figures(runs, args.plot)


if __name__ == "__main__":
    run_collectively(main)
