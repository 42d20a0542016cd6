"""Lesson 16: serving -- prefill, decode with a KV cache; tp against pp for one prompt and many.

    mpiexec -n 2 python lessons/16_serving.py
    mpiexec -n 2 python lessons/16_serving.py --plot figures   # + 16_serving.png
    mpiexec -n 2 python lessons/16_serving.py --quick          # smaller, fewer repeats

Tensor parallelism exists to train *and serve* models too big for one device. Serving
is two phases that cost differently (Pope et al. 2022, "Efficiently Scaling Transformer
Inference"; the JAX scaling book's inference chapters):

    prefill  the P prompt positions in one forward: every weight read once for P rows
             of work, matmuls like training's
    decode   one new token per row and step: every weight AND each row's KV cache
             read for one row of work each. The weights cost ~2 bytes per parameter
             (bf16) for ~2 FLOPs per parameter and row: about B FLOPs per byte of
             weights, against an H100's ~300; and each row brings its own cache, which
             grows with the context, so at long context more rows barely help --
             decode stays memory-bound

The sections:

  1. prefill against decode, measured (one process): time per token of each, the
     median and range of several runs, and the cores they ran on;
  2. decode's bytes per token (parameters + cache) against its FLOPs, by formula, here
     and for Llama 3 70B;
  3. tp 2 against pp 2 on this machine: one prompt (latency per token) and B prompts
     (throughput), each run checked against one process's full forwards (no cache);
  4. the same comparison priced at real scale with the planner's cluster numbers
     (`decode_price`: one function over timemodel and presets);
  5. a model trained on this repository's README (`--data`, on dp 2) completing a
     prompt on another mesh (tp 2), from its checkpoint.

The command behind it: `python -m minipar generate` (minipar/run/generate.py, kvcache.py).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.checkpoint.save_load import holding, load
from minipar.comm.collectives import Ledger
from minipar.comm.job import run_collectively, verdict, wait_for_rank0
from minipar.comm.mesh import Mesh
from minipar.core import timing
from minipar.core.byte_units import MiB
from minipar.core.nn import init_params
from minipar.core.threads import cores
from minipar.planner import presets, search, time_cost, workloads
from minipar.planner.memory_cost import Plan
from minipar.run.generate import GenerateConfig, MeshResult, generate_on_mesh, reference, text_of
from minipar.run.results import relative_difference
from minipar.run.train import train
from minipar.settings.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
# HBM bandwidth per GPU, bytes/s (NVIDIA datasheets: H100 SXM 3.35 TB/s, A100 80GB
# 2.04 TB/s; the H800 keeps the H100's memory). The planner's presets carry FLOP/s and
# link speeds; decode is priced by this one more number.
HBM = {"h100": 3.35e12, "h800": 3.35e12, "dgx-a100-80gb": 2.04e12}


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max): how every time of this lesson is kept."""
    return float(np.median(values)), float(np.min(values)), float(np.max(values))


def shown(s: tuple[float, float, float], scale: float = 1e3) -> str:
    return f"{s[0] * scale:.2f} ({s[1] * scale:.2f}..{s[2] * scale:.2f})"


def compare_line(a: str, sa: tuple, b: str, sb: tuple, what: str) -> str:
    """Which is lower, claimed only outside the spread (the ranges do not overlap:
    `timing.faster`, the rule of every lesson's timings)."""
    if timing.faster(sa[1:], sb[1:]):
        return f"{a} {what} lower than {b}: {sb[0] / sa[0]:.1f}x (ranges apart)"
    if timing.faster(sb[1:], sa[1:]):
        return f"{b} {what} lower than {a}: {sa[0] / sb[0]:.1f}x (ranges apart)"
    return f"{a} and {b}: within each other's range, no winner claimed"


def run(gcfg: GenerateConfig, comm: MPI.Comm, full: dict) -> MeshResult:
    mesh = Mesh(gcfg.train.mesh_shape(), comm, Ledger())
    result = generate_on_mesh(gcfg, mesh, full)
    mesh.free()
    return result


def config(fields: dict, prompt: int, new: int, world: int, **mesh: int) -> GenerateConfig:
    cfg = TrainConfig(**fields, **mesh).resolved(world)
    ids = tuple(int(i) for i in np.random.default_rng(1).integers(0, cfg.vocab, prompt))
    return GenerateConfig(cfg, ids, new)


# ------------------------------------------------------------ 1. prefill, decode
def prefill_against_decode(fields: dict, repeats: int, prompt: int, new: int) -> dict:
    """Rank 0 alone: `repeats` runs, each's prefill time per prompt token and median
    decode step (one token per row)."""
    gcfg = config(fields, prompt, new, 1)
    full = init_params(gcfg.train.model_config(), 0)
    run(gcfg, MPI.COMM_SELF, full)                       # warm up
    prefill, decode = [], []
    for _ in range(repeats):
        seconds = run(gcfg, MPI.COMM_SELF, full).seconds
        prefill.append(seconds[0] / prompt)
        decode.append(float(np.median(seconds[1:])))
    p, d = spread(prefill), spread(decode)
    cfg = gcfg.train
    print(f"\n=== 1. prefill against decode, one process (d = {cfg.d_model}, L = "
          f"{cfg.layers}, prompt {prompt}, {new} new tokens, B = 1; {repeats} runs on "
          f"1 rank of {cores()} cores, the other rank asleep)", flush=True)
    print(f"  prefill: {shown(p)} ms per prompt token ({prompt} positions in one forward)")
    print(f"  decode:  {shown(d)} ms per generated token (one position a step)")
    print(f"  {compare_line('prefill', p, 'decode', d, 'per token')}", flush=True)
    return {"prefill": p, "decode": d}


# ----------------------------------------------------------- 2. bytes and FLOPs
def decode_intensity(params: float, kv_per_token: float, layers_kv: float, batch: int,
                     context: int, itemsize: int, attn_width: int, layers: int
                     ) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of `batch` rows at `context` positions: every
    weight read once (params x itemsize), each row's cache read (2 x K, V widths x
    context); 2 FLOPs per weight and row, and attention's q.K and p.V, 4 x width x
    context per layer and row."""
    moved = params * itemsize + batch * context * kv_per_token * layers_kv * itemsize
    flops = 2 * params * batch + 4 * layers * attn_width * context * batch
    return moved, flops


def bytes_against_flops(fields: dict) -> None:
    cfg = TrainConfig(**fields).resolved(1)
    d, L = cfg.d_model, cfg.layers
    weights = sum(v.size for k, v in init_params(cfg.model_config(), 0).items()
                  if not k.startswith(("tok_embed", "pos_embed")))  # a lookup reads B rows
    print("\n=== 2. one decode step: bytes moved against FLOPs (formula: every weight read "
          "once, each row's K and V read once; 2 FLOPs per weight and row)", flush=True)
    print(f"  here, float64, d = {d}, L = {L}, {weights} weights, context {cfg.seq_len}:")
    for batch in (1, 8, 64):
        moved, flops = decode_intensity(weights, 2 * d, L, batch, cfg.seq_len, 8, d, L)
        print(f"    B = {batch:>3}: {moved / MiB:7.2f} MiB, {flops / 1e6:8.2f} MFLOP, "
              f"{flops / moved:6.2f} FLOP per byte")
    m = presets.MODELS["llama3-70b"]
    w = workloads.transformer(m, 1)
    sizes = workloads.layer_sizes(m)
    weights = w.params - m.vocab * m.d_model
    balance = presets.CLUSTERS["h100"].flops * 1e12 / HBM["h100"]
    print(f"  {m.name}, bf16, context 8192 (K and V {sizes['kv_width']} wide per layer, "
          f"grouped-query; GB = 1e9 bytes, as the datasheets); an H100 does {balance:.0f} FLOPs "
          "per byte of HBM:")
    for batch in (1, 64, 512):
        moved, flops = decode_intensity(weights, sizes["kv_width"], m.layers, batch, 8192, 2,
                                        sizes["q_width"], m.layers)
        bound = "memory-bound" if flops / moved < balance else "compute-bound"
        print(f"    B = {batch:>3}: {moved / 1e9:7.1f} GB, {flops / 1e12:6.2f} TFLOP, "
              f"{flops / moved:6.1f} FLOP per byte -> {bound}", flush=True)


# ----------------------------------------------------------- 3. tp against pp
def tp_against_pp(fields: dict, world: MPI.Comm, repeats: int, batches: tuple[int, ...]
                  ) -> dict:
    """tp 2 and pp 2, `repeats` runs each (alternating), for each batch; every rank."""
    n, rank = world.Get_size(), world.Get_rank()
    out: dict = {}
    for batch in batches:
        runs = {name: config(dict(fields, batch=batch), 8, 9, n, **mesh)
                for name, mesh in (("tp 2", {"tp": 2}), ("pp 2", {"pp": 2}))}
        full = init_params(next(iter(runs.values())).train.model_config(), 0)
        times: dict[str, list[float]] = {name: [] for name in runs}
        checked = {}
        for rep in range(repeats + 1):
            for name, gcfg in runs.items():
                result = run(gcfg, world, full)
                if rank == 0 and rep == 0:    # warm-up run: checked, not timed
                    tokens, logits = reference(gcfg, full)
                    checked[name] = (np.array_equal(tokens, result.tokens)
                                     and relative_difference(result.logits, logits) <= 1e-9)
                elif rank == 0:
                    times[name].append(float(np.median(result.seconds[1:])))
                wait_for_rank0(world)
        out[batch] = ({name: spread(t) for name, t in times.items()} if rank == 0 else {},
                      checked)
    if rank == 0:
        print(f"\n=== 3. tp 2 against pp 2 on this machine {timing.where(n)}"
              + (", so the times measure the ranks' sharing" if n > cores() else "")
              + f"; {repeats} runs each, median (min..max))", flush=True)
        for batch, (spreads, checked) in out.items():
            for name, s in spreads.items():
                rate = batch / s[0]
                print(f"  B = {batch}: {name}: {shown(s)} ms per decode step -> "
                      f"{rate:7.1f} tokens/s; tokens and logits equal to one process's "
                      f"full forwards: {verdict(checked[name])}")
            what = "latency" if batch == 1 else "step time"
            print(f"    {compare_line('tp 2', spreads['tp 2'], 'pp 2', spreads['pp 2'], what)}",
                  flush=True)
        layers = fields["layers"]
        print(f"  a decode step of tp 2 waits in {2 * layers + 2} Allreduces (the embedding, "
              f"2 per layer, the token's MAXLOC); pp 2 in 2 messages per row (the activation "
              f"forward, the token back). The toy's matmuls are small, so here the waits "
              f"weigh most; section 4 splits a real GPU's token into its reads and its "
              f"waits", flush=True)
    return out


# ------------------------------------------------------------ 4. at real scale
def decode_price(model: str, cluster: str, tp: int, pp: int, batch: int, context: int
                 ) -> dict[str, float]:
    """One decode step of `batch` rows at `context` positions on tp x pp GPUs, priced.

    Each GPU reads its 1/(tp pp) of the bf16 weights and of the cache at HBM speed, or
    computes its FLOPs at the planner's efficiency, whichever is slower (decode's
    roofline). tp adds 2 Allreduces of (b, d) per layer (attention's proj, the FFN's
    down projection); pp passes (b, d) between stages, with the rows split in M = pp
    microbatches in flight (fewer if fewer rows): a row's token crosses all pp stages
    before its next can start, so a token takes pp stage times and a step of all rows
    max(M, pp) of them. Collectives and messages are priced by timemodel.seconds (the
    planner's alpha-beta, in-node or across nodes by the mesh's placement)."""
    m, hw = presets.MODELS[model], search.hardware(presets.CLUSTERS[cluster])
    sizes = workloads.layer_sizes(m)
    params = workloads.transformer(m, 1).params - m.vocab * m.d_model  # no lookup
    weights = 2 * params                                      # bf16 bytes
    plan = Plan(dp=1, tp=tp, pp=pp)
    M = min(batch, pp)
    rows = batch / M                                          # rows per microbatch
    cache = m.layers * rows * context * sizes["kv_width"] * 2
    flops = 2 * params * rows + 4 * m.layers * sizes["q_width"] * context * rows
    per_gpu = max((weights + cache) / (tp * pp) / HBM[cluster],
                  flops / (tp * pp) / (hw.flops * hw.efficiency))
    elements = int(rows * m.d_model)
    tp_comm = time_cost.seconds(time_cost.Traffic(
        "tp", "Allreduce", 2 * m.layers // pp, 2 * m.layers // pp * elements,
        2 * m.layers // pp * elements * 2), plan, hw) if tp > 1 else 0.0
    hop = time_cost.seconds(time_cost.Traffic("pp", "Recv", 1, elements, 2 * elements),
                            plan, hw) if pp > 1 else 0.0
    stage = per_gpu + tp_comm + hop                           # one microbatch, one stage
    token = pp * stage
    step = max(M, pp) * stage
    return {"latency": token, "step": step, "throughput": batch / step,
            "reads": pp * per_gpu, "waits": pp * (tp_comm + hop),
            "memory": (weights + m.layers * batch * context * sizes["kv_width"] * 2)
            / (tp * pp)}


def priced() -> list[tuple[str, dict]]:
    cases = [("llama3-70b", "h100", 8, 1), ("llama3-70b", "h100", 1, 8),
             ("llama3-70b", "h100", 4, 2),
             ("llama3-405b", "h100", 16, 1), ("llama3-405b", "h100", 8, 2)]
    print("\n=== 4. priced at real scale (decode_price: the planner's H100 numbers, HBM "
          f"{HBM['h100'] / 1e12:.2f} TB/s, context 4096, bf16; GB = 1e9 bytes)", flush=True)
    out = []
    for model, cluster, tp, pp in cases:
        for batch in (1, 64):
            p = decode_price(model, cluster, tp, pp, batch, 4096)
            label = f"{presets.MODELS[model].name}, tp {tp} x pp {pp}, B = {batch}"
            print(f"  {label:>34}: {p['latency'] * 1e3:7.2f} ms per token (reads "
                  f"{p['reads'] * 1e3:6.2f}, waits {p['waits'] * 1e3:5.2f}), "
                  f"{p['throughput']:8.0f} tokens/s, {p['memory'] / 1e9:6.1f} GB per GPU",
                  flush=True)
            out.append((label, p))
    for model in dict.fromkeys(case[0] for case in cases):
        mine = [(label, p) for label, p in out if presets.MODELS[model].name + "," in label]
        fast = min((x for x in mine if x[0].endswith("B = 1")), key=lambda x: x[1]["latency"])
        many = max((x for x in mine if x[0].endswith("B = 64")),
                   key=lambda x: x[1]["throughput"])
        print(f"  {presets.MODELS[model].name}: lowest latency {fast[0].split(', ')[1]} "
              f"(B = 1), most tokens/s {many[0].split(', ')[1]} (B = 64)", flush=True)
    print("  tp divides every token's reads over its GPUs; pp only stacks them (a token "
          "still crosses every stage, so pp's reads per token stay those of one GPU reading "
          "the model); tp 16 spans 2 nodes, its Allreduces on the 50 GB/s network instead "
          "of NVLink", flush=True)
    return out


# ------------------------------------------------------------ 5. a trained model
def trained_completion(world: MPI.Comm, steps: int, quick: bool) -> None:
    n, rank = world.Get_size(), world.Get_rank()
    folder = world.bcast(tempfile.mkdtemp(prefix="minipar-serving-") if rank == 0 else None)
    fields = dict(model="gpt", data=str(ROOT / "README.md"), layers=2,
                  d_model=32 if quick else 64, heads=4, seq_len=48, batch=16, steps=steps,
                  optimizer="adam", lr=0.01 if quick else 0.005, save=folder)
    cfg = TrainConfig(**fields).resolved(n)
    with holding(world, cfg.save):
        result = train(cfg, world)
    prompt = tuple(b"python -m minipar ")
    gen = replace(cfg, dp=1, tp=n, save=None, resume=folder, batch=2, steps=1,
                  vocab_parallel=None).resolved(n)
    full = load(folder).params
    runs = {"greedy": GenerateConfig(gen, prompt, 48 - len(prompt)),
            "sampled at temperature 0.7": GenerateConfig(gen, prompt, 48 - len(prompt),
                                                         0.7, seed=3)}
    outs = {name: run(gcfg, world, full) for name, gcfg in runs.items()}
    if rank == 0:
        print(f"\n=== 5. a model trained on README.md ({steps} steps on dp {n}, final loss "
              f"{result.losses[-1]:.3f}) completing a prompt on tp {n}, from its checkpoint",
              flush=True)
        for name, gcfg in runs.items():
            tokens, _ = reference(gcfg, full)
            rows = outs[name].tokens if gcfg.temperature else outs[name].tokens[:1]
            for row in rows:
                print(f"  {name}: {text_of(prompt)!r} -> {text_of(row)!r}")
            print(f"    the same tokens as one process's full forwards: "
                  f"{verdict(np.array_equal(tokens, outs[name].tokens))}", flush=True)
        print("  (greedy repeats what is likeliest, loops included; each sampled row draws "
              "its own stream)", flush=True)
        shutil.rmtree(folder, ignore_errors=True)


def figure(first: dict, third: dict, fourth: list, folder: Path) -> None:
    from matplotlib.figure import Figure

    from minipar.teaching.plots import save

    fig = Figure(figsize=(12, 3.8), layout="constrained")
    a, b, c = fig.subplots(1, 3)
    for i, name in enumerate(("prefill", "decode")):
        med, lo, hi = (x * 1e3 for x in first[name])
        a.bar(i, med, yerr=[[med - lo], [hi - med]], color=f"C{i}", capsize=4)
    a.set_xticks([0, 1], ["prefill\nper prompt token", "decode\nper new token"])
    a.set(ylabel="ms (median, range)", title="1. one process")
    for j, (spreads, _) in enumerate(third.values()):
        for i, (name, s) in enumerate(spreads.items()):
            med, lo, hi = (x * 1e3 for x in s)
            b.bar(j * 3 + i, med, yerr=[[med - lo], [hi - med]], color=f"C{i + 2}",
                  capsize=4, label=name if j == 0 else None)
    b.set_xticks([j * 3 + 0.5 for j in range(len(third))], [f"B = {k}" for k in third])
    b.set(ylabel="ms per decode step", title="3. tp 2 against pp 2, this machine")
    b.legend(fontsize=8)
    labels = [label for label, _ in fourth]
    c.barh(range(len(fourth)), [p["latency"] * 1e3 for _, p in fourth],
           color=["C4" if "B = 1" in label else "C5" for label in labels])
    c.set_yticks(range(len(fourth)), labels, fontsize=7)
    c.set(xlabel="ms per token (priced)", title="4. at real scale, H100")
    c.invert_yaxis()
    print("figure:", save(fig, folder / "16_serving.png"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repeats")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    if n != 2:
        if rank == 0:
            print("lesson 16 runs on 2 ranks: mpiexec -n 2 python lessons/16_serving.py")
        raise SystemExit(2)
    big = dict(model="gpt", layers=2 if args.quick else 4, d_model=64 if args.quick else 256,
               heads=4, seq_len=96, vocab=64)
    first = None
    if rank == 0:
        first = prefill_against_decode(big, 2 if args.quick else 5, 32 if args.quick else 64,
                                       6 if args.quick else 16)
        bytes_against_flops(big)
    wait_for_rank0(world)     # rank 1 asleep while rank 0 measured alone
    mesh_model = dict(model="gpt", layers=2 if args.quick else 4,
                      d_model=32 if args.quick else 128, heads=4, seq_len=32, vocab=64)
    third = tp_against_pp(mesh_model, world, 2 if args.quick else 5,
                          (1, 4) if args.quick else (1, 8))
    fourth = priced() if rank == 0 else []
    wait_for_rank0(world)
    trained_completion(world, 20 if args.quick else 300, args.quick)
    if rank == 0 and args.plot:
        figure(first, third, fourth, args.plot)


if __name__ == "__main__":
    run_collectively(main)
