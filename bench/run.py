"""`make bench`: every performance figure as a ratio measured side by side in one run.

    make bench          (or: python -m bench.run)

Sections: what one process measures alone (bench/one_process.py: the autograd against
hand-written NumPy and, when installed, PyTorch; the transformer's step against
hand-written NumPy and PyTorch eager; the attention node); data-parallel speed-up
at a fixed global batch and against its limit; the hand-written ring collectives
against MPI's own; the pipeline's measured bubble against the formula; context
parallelism's four modes against one rank on the same sequences (bench/cp_rank.py);
the flight recorder's share of a call-heavy step (bench/flight_rank.py);
a pipeline step traced (`--trace`) against the same step untraced (bench/trace_rank.py);
a bf16 step against a float32 step, and their DP wire bytes (bench/mixed_rank.py);
the bf16 and fp8 steps against their floors, and Muon's Newton-Schulz against its
matmuls, in one process (bench/precision_floor.py); the test suite's last wall time.
Prints one table and writes bench/results.json.

    python -m bench.run --only precision    those last rows alone, merged into the json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.one_process import (
    GPT_SHAPES,
    SHAPES,
    attention_vs_matmuls,
    autograd_profile,
    autograd_vs_numpy,
    gpt_vs_numpy,
)
from bench.timing import spread

ROOT = Path(__file__).resolve().parent.parent
def dp_scaling(ranks: list[int], steps: int) -> dict:
    """Step time of `train --dp N` at global batch 256 for each N (bench/dp_rank.py)."""
    results = {n: _mpi_json(n, "bench.dp_rank", [str(steps)]) for n in ranks}
    base = results[ranks[0]]["median"]
    out = {str(n): {**r, "speedup_vs_1": base / r["median"]} for n, r in results.items()}
    if _has_torch():  # the same model and batch under PyTorch DDP over gloo on loopback
        for n in (r for r in ranks if r in (2, 4)):
            ddp = _mpi_json(n, "bench.ddp_rank", [str(steps)])
            out[str(n)]["ddp"] = ddp
            out[str(n)]["ddp/minipar"] = ddp["median"] / out[str(n)]["median"]
    return out


def dp_limit(repeats: int) -> dict:
    """2-rank data parallelism against its limit, one rank's share (B/2) alone, measured
    side by side in one job (bench/dp_limit_rank.py). Per repetition the ratio of the
    slowest rank's step to the share's, and the speed-up over one process alone with the
    whole batch; their medians and ranges over the repetitions. Beside them the two
    limits of this machine: whole / share (the best speed-up, with ranks side by side
    sharing memory bandwidth and cache) and (share + a bare Allreduce) / share."""
    r = _mpi_json(2, "bench.dp_limit_rank", [str(repeats)])
    share, whole = np.array(r["share"]["steps"]), np.array(r["whole"]["steps"])
    for name, v in r.items():
        if isinstance(v, dict) and "steps" in v and name != "share":
            v["vs_share"] = spread(np.array(v["steps"]) / share)
            if name not in ("whole", "allreduce"):  # one process alone / this step
                v["speedup"] = spread(whole / np.array(v["steps"]))
    # the floor of a blocking sync: the step's limit plus the bare Allreduce of its bytes
    r["floor_vs_share"] = spread((share + np.array(r["allreduce"]["steps"])) / share)
    # and of a sync that divides after it: one more pass over the gradient (x *= 1/dp)
    r["averaged_floor_vs_share"] = spread((share + np.array(r["averaged"]["steps"])) / share)
    bucketed = r["bucketed"]["sync"]["median"]
    for name in [n for n in r if n.startswith("overlapped")]:
        r[name]["hidden_fraction"] = 1.0 - r[name]["sync"]["median"] / bucketed
        r[name]["vs_bucketed"] = r[name]["step"]["median"] / r["bucketed"]["step"]["median"]
    return r


def cp_vs_one(repeats: int) -> dict:
    """Context parallelism on 2 ranks against one rank alone on the same sequences, in one
    job (bench/cp_rank.py): per repetition the slowest rank's cp step over the `one` step;
    1/cp would be perfect (each rank holds T/cp positions), above it the exchanges."""
    r = _mpi_json(2, "bench.cp_rank", [str(repeats)])
    one = np.array(r["one"]["steps"])
    for name, v in r.items():
        if isinstance(v, dict) and name != "one":
            v["vs_one"] = spread(np.array(v["steps"]) / one)
    return r


def trace_cost(repeats: int) -> dict:
    """One pipeline step traced (`--trace`'s recorder on) against the same step untraced,
    interleaved in one 2-rank job (bench/trace_rank.py); the goal: at most 5% more."""
    return _mpi_json(2, "bench.trace_rank", [str(repeats)])


def mixed_cost(repeats: int) -> dict:
    """`--mixed bf16 --grad-reduce-dtype low` against float32 on the same model, dp = 2, in
    one job (bench/mixed_rank.py): step time per repetition (goal <= 1.5) and the dp
    wire bytes of a step (goal 0.5)."""
    return _mpi_json(2, "bench.mixed_rank", [str(repeats)])


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _mpi_json(n: int, module: str, args: list[str], bind: bool = False) -> dict:
    """Run `mpiexec -n n python -m module <args> OUT.json` and read OUT.json. `bind`: each
    rank bound to a core of its own (`-bind-to core`, the spelling of MPICH's and Open
    MPI's launchers), so the kernel never moves a rank away from its caches."""
    mpiexec = os.environ.get("MINIPAR_MPIEXEC", str(Path(sys.executable).parent / "mpiexec"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        binding = ["-bind-to", "core"] if bind else []
        subprocess.run([mpiexec, *binding, "-n", str(n), sys.executable, "-m", module, *args,
                        str(out)],
                       cwd=ROOT, check=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                                UCX_NET_DEVICES="lo"))
        return json.loads(out.read_text())


def suite_time() -> float | None:
    """The wall time `make test` wrote after its last run, if any."""
    path = ROOT / "bench" / "last_test_seconds"
    return float(path.read_text()) if path.exists() else None


def precision_rows(quick: bool) -> tuple[dict, list[str]]:
    """The bf16 and fp8 steps against their floors, fp8 against bf16, Muon's Newton-Schulz
    against its matmuls (bench/precision_floor.py): results and table rows."""
    from bench import precision_floor

    floors = precision_floor.floor_rows(repeats=4 if quick else 12, blockwise=not quick)
    ns = precision_floor.muon_vs_matmuls(repeats=4 if quick else 12)
    return {"precision_floor": floors, "muon": ns}, precision_floor.lines(floors, ns)


def main() -> None:
    quick = "--quick" in sys.argv
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv[:-1] else None
    if only == "precision":
        found, rows = precision_rows(quick)
        print("\n".join(rows))
        path = ROOT / "bench" / "results.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **found}, indent=1))
        return
    results: dict = {"autograd": {}}
    lines = ["minipar benchmarks (ratios of medians measured side by side; lower is faster)",
             f"{'what':<58} {'ratio':>8}  {'medians':>26}"]
    for label, shape in SHAPES.items():
        for dtype in ("float32", "float64"):
            r = autograd_vs_numpy(shape, dtype, repeats=5 if quick else 20)
            results["autograd"][f"{label} {dtype}"] = r
            t = r["times"]
            goal = " (goal <= 1.05)" if label.startswith("reference") else ""
            lines.append(f"{'autograd / numpy, ' + label + ' ' + dtype + goal:<58} "
                         f"{r['minipar/numpy']:>8.3f}  {t['minipar']['median'] * 1e3:>9.2f} ms "
                         f"vs {t['numpy']['median'] * 1e3:>8.2f} ms")
            if label.startswith("tiny"):
                lines.append(f"{'  the tape per step (minipar - numpy), us':<58} "
                             f"{(t['minipar']['median'] - t['numpy']['median']) * 1e6:>8.0f}")
            if "torch/numpy" in r:
                lines.append(f"{'  torch / numpy':<58} {r['torch/numpy']:>8.3f}")
    results["autograd_profile"] = {}
    for dtype in ("float32", "float64"):
        shares = results["autograd_profile"][dtype] = autograd_profile(dtype, 10 if quick else 50)
        lines.append(f"{'  profile, reference MLP ' + dtype + ' (own time by file)':<58} "
                     + ", ".join(f"{k} {v:.0%}" for k, v in list(shares.items())[:5]))
    results["gpt"] = {}
    for label, shape in GPT_SHAPES.items():
        for dtype in ("float32", "float64"):
            r = gpt_vs_numpy(shape, dtype, repeats=3 if quick else 10)
            results["gpt"][f"{label} {dtype}"] = r
            t = r["times"]
            lines.append(f"{'gpt step / numpy, ' + label + ' ' + dtype:<58} "
                         f"{r['minipar/numpy']:>8.3f}  {t['minipar']['median'] * 1e3:>9.2f} ms "
                         f"vs {t['numpy']['median'] * 1e3:>8.2f} ms")
            if "minipar/torch" in r:
                lines.append(f"{'  gpt step / PyTorch eager (same weights, same 1st loss)':<58} "
                             f"{r['minipar/torch']:>8.3f}  {t['torch']['median'] * 1e3:>9.2f} ms"
                             f" torch; torch / numpy {r['torch/numpy']:.3f}")
            a = attention_vs_matmuls(shape, dtype, repeats=5 if quick else 20)
            results["gpt"][f"{label} {dtype}"]["attention"] = a
            lines.append(f"{'  attention node / its matmuls alone':<58} "
                         f"{a['attention/matmuls']:>8.3f}  "
                         f"{a['times']['attention']['median'] * 1e3:>9.2f} ms vs "
                         f"{a['times']['matmuls']['median'] * 1e3:>8.2f} ms")
    ranks = [1, 2] if quick else [1, 2, 4, 8]
    results["dp"] = dp_scaling(ranks, steps=6 if quick else 12)
    for n, r in results["dp"].items():
        lines.append(f"{'DP speed-up, ' + n + ' ranks vs 1 (global batch 256, f64)':<58} "
                     f"{r['speedup_vs_1']:>8.3f}  {r['median'] * 1e3:>9.2f} ms/step")
        if "ddp/minipar" in r:
            lines.append(f"{'  PyTorch DDP (gloo) step / minipar DP step, ' + n + ' ranks':<58} "
                         f"{r['ddp/minipar']:>8.3f}  {r['ddp']['median'] * 1e3:>9.2f} ms/step")
    results["dp_limit"] = limit = dp_limit(repeats=4 if quick else 12)
    ms = lambda v: f"{v['median'] * 1e3:.0f}"  # noqa: E731
    for name in ["naive", "bucketed"] + [n for n in limit if n.startswith("overlapped")] + [
            "divided after"]:
        v = limit[name]
        q = v["vs_share"]
        lines.append(f"{'DP 2 ranks, ' + name + ' step / one rank share (goal <= 1.10)':<58} "
                     f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}] compute "
                     f"{ms(v['compute'])} sync {ms(v['sync'])} (waiting {ms(v['waiting'])}) "
                     f"opt {ms(v['optimizer'])} ms")
        if "hidden_fraction" in v:
            lines.append(f"{'  overlapped / bucketed step; sync hidden (1 - sync/bucketed)':<58} "
                         f"{v['vs_bucketed']:>8.3f}  hidden {v['hidden_fraction']:.2f}, "
                         f"{limit['buckets'][name]} buckets")
    lines.append(f"{'  one rank share step (B/2, no sync), ms':<58} "
                 f"{limit['share']['step']['median'] * 1e3:>8.1f}")
    sp, lim, floor = limit["bucketed"]["speedup"], limit["whole"]["vs_share"], \
        limit["floor_vs_share"]
    lines.append(f"{'DP 2 ranks, bucketed: speed-up over one process (goal >= 1.7)':<58} "
                 f"{sp['median']:>8.3f}  [{sp['min']:.2f}-{sp['max']:.2f}]; its limit here, "
                 f"one process alone / one rank share: {lim['median']:.2f} "
                 f"[{lim['min']:.2f}-{lim['max']:.2f}]")
    lines.append(f"{'  floor of a blocking sync: (share + bare Allreduce) / share':<58} "
                 f"{floor['median']:>8.3f}  [{floor['min']:.2f}-{floor['max']:.2f}], Allreduce "
                 f"of {ms(limit['allreduce']['sync'])} ms")
    q = limit["averaged_floor_vs_share"]
    lines.append(f"{'  (share + that Allreduce, then divided by dp) / share':<58} "
                 f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}], "
                 f"{ms(limit['averaged']['sync'])} ms")
    results["ring"] = {n: _mpi_json(n, "bench.ring_rank", []) for n in ranks if n > 1}
    for n, r in results["ring"].items():
        for label in ("8 KB", "1 MB", "16 MB"):
            lines.append(f"{f'ring / MPI Allreduce, {label}, {n} ranks':<58} "
                         f"{r[label]['ring/mpi']:>8.3f}  bus {r[label]['ring_bus_GBps']:.2f} vs "
                         f"{r[label]['mpi_bus_GBps']:.2f} GB/s")
        lines.append(f"{'  (memcpy bandwidth of this machine, GB/s)':<58} {r['memcpy_GBps']:>8.2f}")
    results["pipeline"] = _mpi_json(2, "bench.pipeline_rank", ["3" if quick else "7"],
                                    bind=True)
    message = results["pipeline"].pop("message")
    for label, r in results["pipeline"].items():
        goal = " (goal <= 1.15)" if label.endswith("M=8") else ""
        q = r["measured/formula"]
        lines.append(f"{'pipeline bubble measured / formula, pp=2 ' + label + goal:<58} "
                     f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}]; replayed / formula "
                     f"{r['replayed/formula']['median']:.3f}, measured / replayed "
                     f"{r['measured/replayed']['median']:.3f}")
        lines.append(f"{'  per instruction: between / in Isend / in Recv; stage imbalance':<58} "
                     f"{r['between_per_instruction'] * 1e6:>6.1f}us  "
                     f"{r['send_per_instruction'] * 1e6:.1f} us / "
                     f"{r['recv_wait_per_instruction'] * 1e3:.2f} ms; slowest / fastest stage "
                     f"{r['imbalance_range']['median']:.3f}")
    results["pipeline"]["message"] = message
    lines.append(f"{'  one 64 KB hop: Isend / one-way, back to back (us)':<58} "
                 f"{message['isend back to back'] * 1e6:>6.1f}us  "
                 f"{message['one-way back to back'] * 1e6:.1f} us")
    lines.append(f"{'  the same right after 3 ms of matmuls (every hop of a pipeline)':<58} "
                 f"{message['isend after compute'] * 1e6:>6.1f}us  "
                 f"{message['one-way after compute'] * 1e6:.1f} us")
    results["cp"] = cp = cp_vs_one(repeats=3 if quick else 8)
    for mode in ("allgather", "ring", "zigzag", "ulysses"):
        q = cp[mode]["vs_one"]
        lines.append(f"{'gpt cp=2 ' + mode + ' step / one rank, same sequences (1/cp = 0.5)':<58} "
                     f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}] "
                     f"{cp[mode]['step']['median'] * 1e3:.0f} vs "
                     f"{cp['one']['step']['median'] * 1e3:.0f} ms")
    results["flight"] = f = _mpi_json(2, "bench.flight_rank", ["2" if quick else "6"])
    lines.append(f"{'flight recorder, share of a tp=2 M=4 step (goal <= 0.02)':<58} "
                 f"{f['share_of_step']:>8.4f}  {f['calls_per_step']} calls x "
                 f"{f['seconds_per_call'] * 1e6:.1f} us of a {f['off']['median'] * 1e3:.0f} ms "
                 f"step; with / without it {f['on/off']:.3f}")
    results["trace"] = tr = trace_cost(repeats=4 if quick else 12)
    q = tr["traced/untraced"]
    lines.append(f"{'pp=2 1F1B M=8 step traced / untraced (goal <= 1.05)':<58} "
                 f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}] "
                 f"{tr['traced']['step']['median'] * 1e3:.1f} vs "
                 f"{tr['untraced']['step']['median'] * 1e3:.1f} ms, "
                 f"{tr['events_per_step']} spans per rank and step; fastest / fastest "
                 f"{tr['fastest traced/untraced']:.3f}")
    results["mixed"] = mx = mixed_cost(repeats=4 if quick else 12)
    q, ql = mx["bf16/float32"], mx["bf16 low/float32"]
    lines.append(f"{'bf16 step / float32 step, MLP dp=2 (goal <= 1.5)':<58} "
                 f"{q['median']:>8.3f}  [{q['min']:.2f}-{q['max']:.2f}] "
                 f"{mx['bf16']['step']['median'] * 1e3:.1f} vs "
                 f"{mx['float32']['step']['median'] * 1e3:.1f} ms; in it the master -> bf16 "
                 f"casts after the update {mx['casts']['median'] * 1e3:.1f} ms and the replica "
                 f"check {mx['replica check']['median'] * 1e3:.1f} ms (the matmuls' operand "
                 f"casts, no bf16 BLAS in NumPy, are most of the rest)")
    lines.append(f"{'  the same, --grad-reduce-dtype low (16-bit sum in Python)':<58} "
                 f"{ql['median']:>8.3f}  [{ql['min']:.2f}-{ql['max']:.2f}] "
                 f"{mx['bf16 low']['step']['median'] * 1e3:.1f} ms: the MPI.Op adding 16-bit "
                 f"words is a Python function called per chunk")
    lines.append(f"{'  dp wire bytes, bf16 --grad-reduce-dtype low / float32 (goal 0.5)':<58} "
                 f"{mx['wire bf16/float32']:>8.3f}  {mx['wire']['bf16 low'] / 2**20:.2f} vs "
                 f"{mx['wire']['float32'] / 2**20:.2f} MiB per step")
    found, rows = precision_rows(quick)
    results.update(found)
    lines.extend(rows)
    from bench import step_rate  # (a) data, (b) step against DGEMM, (c) against torch

    with step_rate.one_blas_thread():
        a = step_rate.data_vs_generator(repeats=10 if quick else 45)
        b = step_rate.step_vs_dgemm(repeats=3 if quick else 9)
    results["step_rate"] = {"data_vs_generator": a, "step_vs_dgemm": b}
    lines.extend(step_rate.lines(a, b))
    results["suite_seconds"] = suite_time()
    if results["suite_seconds"] is not None:
        lines.append(f"{'make test wall time, seconds (last run)':<58} "
                     f"{results['suite_seconds']:>8.1f}")
    print("\n".join(lines))
    (ROOT / "bench" / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
