"""Rank side of the tracing benchmark: one training step traced against the same step
untraced, in one job.

    mpiexec -n 2 python -m bench.trace_rank REPEATS OUT.json

The pipeline benchmark's run (pp = 2, 1F1B, M = 8, d = 256, float64: spans, flows and
counters on every instruction) built once; each repetition takes one step untraced and
one traced (a `trace.Recorder` installed, as `train --trace` does), the order rotating.
Rank 0 writes the slowest rank's step per repetition for both. Writing the files at
the end of a run is not part of a step and is not timed.
"""

from __future__ import annotations

import json
import sys
import time

from mpi4py import MPI

from bench.dp_limit_rank import build
from bench.timing import spread
from minipar.comm import trace
from minipar.run.mesh_step import train_step
from minipar.settings.config import TrainConfig

SHAPE = dict(layers=4, d_in=64, d_model=256, d_ff=1024, batch=256, microbatches=8,
             schedule="1f1b")


def main() -> None:
    world = MPI.COMM_WORLD
    repeats, out = int(sys.argv[1]), sys.argv[2]
    pp = world.Get_size()
    cfg, mesh, chunks, updater = setup = build(TrainConfig(**SHAPE, pp=pp).resolved(pp),
                                               world)
    recorder = trace.Recorder(mesh.rank, trace.label(mesh.rank, mesh.coords), "here", 0, "")
    trace.RECORDER = recorder
    trace.instrument(updater.optimizer, updater.memory)   # as train does
    trace.RECORDER = None
    samples: dict[str, list[float]] = {"untraced": [], "traced": []}
    for rep in range(repeats + 2):  # the first two: warm-up, not kept
        for name in (("untraced", "traced") if rep % 2 else ("traced", "untraced")):
            trace.RECORDER = recorder if name == "traced" else None
            world.Barrier()
            start = time.perf_counter()
            with trace.step(rep + 1):
                train_step(cfg, mesh, chunks, updater, rep, [])
            if rep >= 2:
                samples[name].append(time.perf_counter() - start)
            trace.RECORDER = None
    del setup
    everyone = world.gather(samples)
    if world.Get_rank() == 0:
        results = {}
        for name in samples:
            slowest = [max(r[name][i] for r in everyone) for i in range(repeats)]
            results[name] = {"steps": slowest, "step": spread(slowest)}
        results["traced/untraced"] = spread([t / u for t, u in zip(
            results["traced"]["steps"], results["untraced"]["steps"])])
        # the fastest step of each: the least disturbed by other work on the machine
        results["fastest traced/untraced"] = (results["traced"]["step"]["min"]
                                              / results["untraced"]["step"]["min"])
        results["events_per_step"] = len(recorder.spans) // (repeats + 2)  # one traced each
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
