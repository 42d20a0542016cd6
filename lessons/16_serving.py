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

  1. prefill against decode, measured (one process, one prompt: B = 1): time per
     token of each, the median and range of several runs, and the cores they ran on;
  2. decode's bytes per token (parameters + cache) against its FLOPs, by formula, for
     section 1's model and for Llama 3 70B;
  3. tp 2 against pp 2 on this machine, the same model: one prompt (latency per token)
     and B = 8 prompts (throughput), each run checked against one process's full
     forwards (no cache);
  4. the same comparison priced at real scale with the planner's cluster numbers
     (`decode_price` of minipar/planner/serving.py, what `python -m minipar plan
     --serve` ranks layouts by), at B = 1 and B = 64;
  5. a model trained on this repository's README (`--data`, on dp 2) completing a
     prompt on another mesh (tp 2), from its checkpoint.

Sections 1-3 use one toy model (MODEL below: d = 256, 4 layers, float64); `--quick`
a smaller one (d = 64, 2 layers) and fewer runs, and says so in its headings.

The command behind it: `python -m minipar generate` (minipar/run/generate.py;
the decoding in minipar/run/decode.py, the cache in kvcache.py).
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
from minipar.planner import presets, search, workloads
from minipar.planner.serving import DecodePrice, decode_price
from minipar.run.decode import GenerateConfig, MeshResult, generate_on_mesh, reference
from minipar.run.generate import text_of
from minipar.run.results import relative_difference
from minipar.run.train import train
from minipar.settings.config import TrainConfig
from minipar.teaching.lines import print  # the builtin, a line wider than the page wrapped

ROOT = Path(__file__).resolve().parent.parent
# One toy model for sections 1-3: big enough (3.2 M float64 weights, 25 MiB) that a
# decode step's reads spill out of the caches, small enough for a few seconds of runs.
# B = 1 in section 1: one prompt; section 3 adds B = 8.
MODEL = dict(model="gpt", layers=4, d_model=256, heads=4, seq_len=96, vocab=64, batch=1)
QUICK_MODEL = dict(MODEL, layers=2, d_model=64)
H100 = search.hardware(presets.CLUSTERS["h100"])   # the planner's numbers, HBM included
STEPS = 200   # section 5: training steps on README.md


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
def prefill_against_decode(world: MPI.Comm, fields: dict, repeats: int, prompt: int,
                           new: int) -> dict:
    """Rank 0 alone (the others asleep): `repeats` runs of one prompt (B = the config's
    batch, 1), each's prefill time per prompt token and median decode step. Every rank
    calls it; rank 0 returns {"prefill": spread, "decode": spread}, the others {}."""
    out: dict = {}
    if world.Get_rank() == 0:
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
              f"{cfg.layers}, float64, prompt {prompt}, {new} new tokens, B = {cfg.batch} "
              f"row; {repeats} runs, median (min..max), {timing.where(1)[1:-1]}, the other "
              f"rank{'s' * (world.Get_size() > 2)} asleep)", flush=True)
        print(f"  prefill: {shown(p)} ms per prompt token ({prompt} positions in one forward)")
        print(f"  decode:  {shown(d)} ms per generated token (one position a step)")
        print(f"  {compare_line('prefill', p, 'decode', d, 'per token')}", flush=True)
        out = {"prefill": p, "decode": d}
    wait_for_rank0(world)
    return out


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
    print(f"  section 1's model, float64, d = {d}, L = {L}, {weights} weights, context "
          f"{cfg.seq_len}:")
    for batch in (1, 8, 64):
        moved, flops = decode_intensity(weights, 2 * d, L, batch, cfg.seq_len, 8, d, L)
        print(f"    B = {batch:>3}: {moved / MiB:7.2f} MiB, {flops / 1e6:8.2f} MFLOP, "
              f"{flops / moved:6.2f} FLOP per byte")
    m = presets.MODELS["llama3-70b"]
    w = workloads.transformer(m, 1)
    sizes = workloads.layer_sizes(m)
    weights = w.params - m.vocab * m.d_model
    balance = H100.flops / H100.hbm_bw
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
def tp_against_pp(world: MPI.Comm, fields: dict, repeats: int, batches: tuple[int, ...]
                  ) -> dict:
    """tp 2 and pp 2 of section 1's model, `repeats` runs each (alternating), for each
    batch; every rank calls it, rank 0 returns {batch: ({mesh: spread}, {mesh: checked})}."""
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
        print(f"\n=== 3. tp 2 against pp 2 on this machine, section 1's model (d = "
              f"{fields['d_model']}, L = {fields['layers']}), prompt 8, 9 new tokens "
              f"{timing.where(n)}"
              + (": the times measure the ranks' sharing" if n > cores() else "")
              + f"; {repeats} runs each, median (min..max));\n  tokens and logits against "
              "one process's full forwards", flush=True)
        for batch, (spreads, checked) in out.items():
            for name, s in spreads.items():
                rate = batch / s[0]
                print(f"  B = {batch}: {name}: {shown(s)} ms per decode step -> "
                      f"{rate:7.1f} tokens/s; tokens, logits = one process's: "
                      f"{verdict(checked[name])}")
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
CASES = (("llama3-70b", 8, 1), ("llama3-70b", 1, 8), ("llama3-70b", 4, 2),
         ("llama3-405b", 16, 1), ("llama3-405b", 8, 2))
BATCHES = (1, 64)


def priced(context: int = 4096) -> list[tuple[str, DecodePrice]]:
    """Each case of CASES at B = 1 and 64, priced by the planner's `decode_price`
    (minipar/planner/serving.py, the arithmetic of `python -m minipar plan --serve`)."""
    print(f"\n=== 4. priced at real scale (planner/serving.py's decode_price, as `python -m "
          f"minipar plan --serve`: H100 numbers, HBM {H100.hbm_bw / 1e12:.2f} TB/s, context "
          f"{context}, bf16; GB = 1e9 bytes). A step advances each of its B rows by one "
          "token: one row waits a step's ms for its next token (ms a token below), and the B "
          "rows make B tokens a step (tokens/s in all)", flush=True)
    out = []
    for model, tp, pp in CASES:
        m = presets.MODELS[model]
        for batch in BATCHES:
            p = decode_price(m, H100, tp, pp, batch, context)
            label = f"{m.name}, {p.label()}"
            print(f"  {label:>27}, B = {batch:>2}: {p.latency * 1e3:6.2f} ms a token "
                  f"(reads {p.reads * 1e3:5.2f}, waits {p.waits * 1e3:5.2f}), "
                  f"{p.throughput:5.0f} tokens/s in all, {p.memory / 1e9:5.1f} GB per GPU",
                  flush=True)
            out.append((label, p))
    for model in dict.fromkeys(case[0] for case in CASES):
        name = presets.MODELS[model].name
        mine = [(label.split(", ")[1], p) for label, p in out if label.startswith(name + ",")]
        fast = min((x for x in mine if x[1].batch == 1), key=lambda x: x[1].latency)
        many = max((x for x in mine if x[1].batch == 64), key=lambda x: x[1].throughput)
        print(f"  {name}: lowest latency {fast[0]} (B = 1), most tokens/s {many[0]} "
              "(B = 64)", flush=True)
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
                  optimizer="adam", lr=0.01, save=folder)
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
        print(f"\n=== 5. a model trained on README.md (d = {cfg.d_model}, L = {cfg.layers}, "
              f"{steps} steps of {cfg.batch} x {cfg.seq_len} bytes on dp {n}, final loss "
              f"{result.losses[-1]:.3f}) completing a prompt on tp {n}, 2 rows, from its "
              "checkpoint", flush=True)
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


def serving_figure(first: dict, third: dict, fourth: list, fields: dict) -> object:
    """Panel 1: section 1's prefill and decode per token; panel 3: section 3's decode
    steps (the same model); panel 4: section 4's priced latency, B = 1 and 64 side by
    side. Returns the matplotlib Figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.2), layout="constrained")
    a, b, c = fig.subplots(1, 3, width_ratios=(1, 1.2, 1.4))
    for i, name in enumerate(("prefill", "decode")):
        med, lo, hi = (x * 1e3 for x in first[name])
        a.bar(i, med, yerr=[[med - lo], [hi - med]], color=f"C{i}", capsize=4)
    a.set_xticks([0, 1], ["prefill\nper prompt token", "decode\nper new token"])
    a.set(ylabel="ms (median, min..max)",
          title=f"1. one process, B = 1\n(d = {fields['d_model']}, L = {fields['layers']})")
    for j, (spreads, _) in enumerate(third.values()):
        for i, (name, s) in enumerate(spreads.items()):
            med, lo, hi = (x * 1e3 for x in s)
            b.bar(j * 3 + i, med, yerr=[[med - lo], [hi - med]], color=f"C{i + 2}",
                  capsize=4, label=name if j == 0 else None)
    b.set_xticks([j * 3 + 0.5 for j in range(len(third))], [f"B = {k}" for k in third])
    b.set(ylabel="ms per decode step (median, min..max)",
          title="3. tp 2 against pp 2, this machine\n(the same model as 1)")
    b.legend(fontsize=8)
    layouts = list(dict.fromkeys(label for label, _ in fourth))
    height = 0.4
    for k, batch in enumerate(BATCHES):
        values = [next(p.latency for label, p in fourth if label == lay and p.batch == batch)
                  for lay in layouts]
        c.barh([i + (k - 0.5) * height for i in range(len(layouts))],
               [v * 1e3 for v in values], height=height, color=f"C{4 + k}",
               label=f"B = {batch}")
    c.set_yticks(range(len(layouts)), [lay.replace(", ", "\n") for lay in layouts],
                 fontsize=8)
    c.set(xlabel="ms for a row's next token (priced; one decode step)",
          title="4. at real scale, H100, context 4096\n(planner/serving.py)")
    c.invert_yaxis()
    c.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
             title="rows decoding together", title_fontsize=8)
    return fig


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
    fields = QUICK_MODEL if args.quick else MODEL
    first = prefill_against_decode(world, fields, 2 if args.quick else 5,
                                   32 if args.quick else 64, 6 if args.quick else 16)
    if rank == 0:
        bytes_against_flops(fields)
    third = tp_against_pp(world, fields, 2 if args.quick else 3,
                          (1, 4) if args.quick else (1, 8))
    fourth = priced() if rank == 0 else []
    wait_for_rank0(world)
    trained_completion(world, 20 if args.quick else STEPS, args.quick)
    if rank == 0 and args.plot:
        from minipar.teaching.plots import save

        figure = serving_figure(first, third, fourth, fields)
        print("figure:", save(figure, args.plot / "16_serving.png"), flush=True)


if __name__ == "__main__":
    run_collectively(main)
