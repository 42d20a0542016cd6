"""Lesson 11: the transformer on a tp group -- heads, vocabulary, SP along T, recomputation.

    mpiexec -n 4 python lessons/11_transformer_tp.py          # tp = 4
    mpiexec -n 2 python lessons/11_transformer_tp.py          # tp = 2
    mpiexec -n 4 python lessons/11_transformer_tp.py --plot figures   # + 11_tp_memory.png

Megatron-LM (Shoeybi et al. 2019) splits a whole transformer block over the tp group,
and Korthikanti et al. (2022) then cut its activation memory. On minipar's `gpt`:

1. What each rank holds: attention split by heads (rank k: heads k H/tp ..; q, k, v
   columns, proj rows), fc1 columns and fc2 rows, vocabulary rows of the embedding and
   columns of the head.
2. One step's tp ledger beside its prediction: per block and microbatch FOUR Allreduces
   of (B T, d) -- after attention and after the FFN forward (g), before each backward
   (f) -- plus the vocabulary-parallel embedding's, the head's and the parallel
   cross-entropy's two small ones.
3. Vocabulary-parallel vs replicated embedding and head: bytes held, bytes sent, and the
   largest array on a rank's tape: the full (B, T, V) logits are never formed.
4. Sequence parallelism (--sp) along T, and recomputation (--recompute selective/full):
   one block's tape bytes per rank, measured, beside minipar's formula; recomputation's
   memory against its extra time.
5. Every setting above against one process (float64, relative 1e-9).

The code: minipar/parallel/tensor_parallel.py (heads), vocab_parallel.py (vocabulary),
minipar/core/recompute.py (recomputation and the tape's bytes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Ledger
from minipar.comm.job import run_collectively, say_in_order, verdict, wait_for_rank0
from minipar.comm.mesh import Mesh
from minipar.compose.parallelize import build_rank_model, make_block
from minipar.core import nn, timing
from minipar.core.autograd import Tensor
from minipar.core.byte_units import KiB
from minipar.core.memory import wire_elements
from minipar.core.recompute import gpt_block_activation_bytes, tape_bytes
from minipar.core.threads import cores
from minipar.planner.memory_cost import rank_shape
from minipar.planner.time_cost import ledger_of, traffic
from minipar.planner.workloads import minipar_workload, plan_of
from minipar.run.reference import step_batch
from minipar.run.results import TOLERANCE, max_differences, relative_difference
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.settings.validation import problems
from minipar.teaching.lines import fit

SHAPE = dict(model="gpt", layers=2, d_model=64, heads=8, seq_len=32, vocab=256, batch=8,
             d_ff=256, steps=2)
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def say(text: str) -> None:
    """Print from rank 0, a line wider than the page wrapped (teaching/lines.py)."""
    if rank == 0:
        print(fit(text), flush=True)


def config(**fields: object) -> TrainConfig:
    """The lesson's transformer with tp = every rank; refused like the command line."""
    cfg = TrainConfig(**{**SHAPE, **fields}, tp=size).resolved(size)
    errors = problems(cfg, size)
    if errors:  # every rank finds the same problem: all stop together
        say(f"lesson 11: {errors[0]} (run it with mpiexec -n 2 or 4)")
        raise SystemExit(2)
    return cfg


# ------------------------------------------------------------ 1. holdings
def holdings() -> None:
    cfg = config()
    mesh = Mesh(cfg.mesh_shape(), comm, Ledger())
    chunk = build_rank_model(cfg, mesh, nn.init_params(cfg.model_config(), cfg.seed))[0]
    mesh.free()
    dh = cfg.d_model // cfg.heads
    cols = chunk.blocks[0].attn.q.weight.full_index[1]
    fc1 = chunk.blocks[0].ffn.fc1.weight.full_index[1]
    rows = chunk.embed.tok.full_index[0]
    say(f"\n=== 1. gpt L={cfg.layers} d={cfg.d_model} H={cfg.heads} T={cfg.seq_len} "
        f"V={cfg.vocab} d_ff={cfg.d_ff} on tp = {size}: what each rank holds\n"
        "(tokens: the embedding's rows and the head's columns)")
    say_in_order(comm, f"heads {cols.start // dh}..{cols.stop // dh - 1} (q, k, v columns "
                 f"{cols.start}:{cols.stop}, proj rows {cols.start}:{cols.stop}); fc1 "
                 f"columns {fc1.start}:{fc1.stop}; tokens {rows.start}..{rows.stop - 1}")


# ------------------------------------------------------------ 2. the ledger
def ledger_lines(cfg: TrainConfig, records: list[dict]) -> tuple[bool, float]:
    """Rank 0's tp ledger beside timemodel.traffic; (all equal, wire elements)."""
    w, plan = minipar_workload(cfg), plan_of(cfg)
    predicted = ledger_of(traffic(w, plan, rank_shape(w, plan, 0)))
    ok, wire = True, 0.0
    for r in records:
        if r["rank"] != 0 or r["group"] != "tp":
            continue
        expected = predicted.get(("tp", r["op"]), (0, 0))
        same = (r["calls"], r["elements"]) == expected
        ok &= same
        wire += wire_elements(r["op"], r["elements"], size)
        say(f"  tp {r['op']:>14}: {r['calls']:3d} calls, {r['elements']:7d} elements; "
            f"predicted {expected[0]:3d}, {expected[1]:7d} -> {verdict(same)}")
    return ok, wire


def one_step(vocab_parallel: bool) -> dict:
    cfg = config(steps=1, vocab_parallel=vocab_parallel)
    result = train(cfg, comm)
    b, d, L = cfg.batch * cfg.seq_len, cfg.d_model, cfg.layers
    say(f"{'vocabulary-parallel' if vocab_parallel else 'replicated'} embedding and head, "
        f"B T = {b} positions, d = {d}:")
    _, wire = ledger_lines(cfg, result.ledger)
    say(f"  the blocks: {4 * L} Allreduces of B T x d = {b * d} (4 per block: g after "
        "attention and after the FFN, f before each in the backward)" + (
            f";\n  + the embedding's g and the head's f ({b * d} each), the loss's row "
            f"max ({b}) and sums of exps with target logits ({2 * b})" if vocab_parallel
            else ""))
    say(f"  on the wire per rank: {wire * 8 / KiB:.1f} KiB")
    return {"wire": wire * 8, "ledger": result.ledger}


# ------------------------------------------------------ 3. the vocabulary
def largest_on_tape(out: Tensor) -> tuple[int, tuple[int, ...]]:
    """The largest array of any node behind `out` (its elements and shape)."""
    seen, stack, best = set(), [out], (0, ())
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.requires_grad and node.data.size > best[0]:
            best = (node.data.size, node.data.shape)
        stack.extend(node.parents)
    return best


def vocabulary(sent: dict[bool, float]) -> None:
    say("\n=== 3. vocabulary-parallel vs replicated: bytes held, bytes sent, logits formed")
    for vocab_parallel in (True, False):
        cfg = config(vocab_parallel=vocab_parallel)
        mesh = Mesh(cfg.mesh_shape(), comm, Ledger())
        chunk = build_rank_model(cfg, mesh, nn.init_params(cfg.model_config(), cfg.seed))[0]
        x, y = step_batch(cfg, 0)
        logits, _ = chunk.forward(Tensor(x))
        loss = nn.output_loss(chunk.head, logits, y)
        mesh.free()
        held = sum(p.data.nbytes for p in chunk.embed.parameters() + chunk.head.parameters())
        elements, shape = largest_on_tape(loss)
        full = cfg.batch * cfg.seq_len * cfg.vocab
        name = "vocab-parallel" if vocab_parallel else "replicated"
        say(f"  {name:>14}: embedding + head {held / KiB:6.1f} KiB per rank, tp traffic "
            f"{sent[vocab_parallel] / KiB:6.1f} KiB per rank per step; logits {logits.shape}, "
            f"largest array on the tape {shape}")
        if vocab_parallel:
            say(f"  full logits (B, T, V) = {full} numbers never formed: "
                f"{verdict(elements < full, 'none on any rank', 'FORMED')}")
    say("  The price of the split: two more Allreduces of (B T, d) a step (the embedding's\n"
        "  sum, the head's input gradient) and two of B T and 2 B T numbers (the loss); the\n"
        "  gain: (V - V/tp) x 2d parameters (with their gradients and optimizer state) and a\n"
        "  (B, T, V) logits array fewer per rank -- at V = 50k and d = 4k, far the larger.")


# -------------------------------------------- 4. SP and recomputation memory
def block_bytes(cfg: TrainConfig) -> int:
    mesh = Mesh(cfg.mesh_shape(), comm, Ledger())
    block = make_block(cfg, cfg.model_config(), mesh,
                       nn.init_params(cfg.model_config(), cfg.seed), 0)
    positions = cfg.seq_len // size if cfg.sp else cfg.seq_len
    h = Tensor(np.random.default_rng(0).normal(size=(cfg.batch, positions, cfg.d_model)),
               requires_grad=True)
    out, _ = block(h)
    mesh.free()
    return tape_bytes(out, exclude=(h,))


def step_seconds(repeats: int = 5) -> tuple[int, dict[str, list[float]]]:
    """Forward + backward of one microbatch under each recomputation mode, `repeats`
    times, the modes interleaved; on tp = as many ranks as cores (the first ranks; the
    others asleep): with more ranks than cores the wall clock measures the ranks taking
    turns, not the recomputation. Each time is the slowest timed rank's (seconds)."""
    k = max(t for t in range(1, min(size, cores()) + 1) if size % t == 0)
    sub = comm.Split(0 if rank < k else MPI.UNDEFINED, rank)
    times: dict[str, list[float]] = {}
    if sub != MPI.COMM_NULL:
        meshes, steps = [], {}
        for mode in ("none", "selective", "full"):
            cfg = TrainConfig(**{**SHAPE, "recompute": mode}, tp=k).resolved(k)
            mesh = Mesh(cfg.mesh_shape(), sub, Ledger())
            chunk = build_rank_model(cfg, mesh, nn.init_params(cfg.model_config(), cfg.seed))[0]
            x, y = step_batch(cfg, 0)
            steps[mode] = (lambda c=chunk, x=x, y=y: (sub.Barrier(),
                                                      nn.loss_fn(c, x, y).backward()))
            meshes.append(mesh)
        times = timing.timed(steps, repeats, clock=lambda t: sub.allreduce(t, op=MPI.MAX))
        for mesh in meshes:
            mesh.free()
        sub.Free()
    wait_for_rank0(comm)
    return k, times


def memory_and_time() -> dict[str, dict[str, int]]:
    say("\n=== 4. one block's activations per rank (tape bytes of one microbatch), "
        "measured and by formula")
    found: dict[str, dict[str, int]] = {}
    layouts = (("one process", 1, False), (f"tp {size}", size, False),
               (f"tp {size} + sp", size, True))
    for label, tp, sp in layouts:
        found[label] = {}
        for mode in ("none", "selective", "full"):
            if tp == 1:  # the one-process block, built on every rank alike
                cfg = TrainConfig(**{**SHAPE, "recompute": mode}).resolved(1)
                measured = tape_bytes_single(cfg)
            else:
                cfg = config(sp=sp, recompute=mode)
                measured = block_bytes(cfg)
            formula = gpt_block_activation_bytes(cfg.batch * cfg.seq_len, cfg.d_model,
                                                 cfg.d_ff, cfg.heads, cfg.seq_len, 8, tp,
                                                 sp, mode)
            found[label][mode] = measured
            say(f"  {label:>22} recompute {mode:>9}: {measured / KiB:7.1f} KiB, formula "
                f"{formula / KiB:7.1f} KiB -> {verdict(measured == formula)}")
    say("  (per position: 12d + (5d + 3f + Hs + H)/t + 2 numbers with tp, "
        "4d + (15d + 3f + Hs + H + 2)/t with sp; Korthikanti: sbh(34 + 5as/h) bytes)")
    k, times = step_seconds()
    base = found[f"tp {size}"]
    if rank != 0:  # the times are rank 0's
        return found
    say(f"  recomputation's time: forward + backward of one microbatch at tp = {k} "
        + (f"on ranks 0-{k - 1} (the memory above is tp = {size}'s) " if k < size else "")
        + timing.where(k)
        + f", slowest rank, {len(times['none'])} repeats of each mode, interleaved:")
    for mode in ("none", "selective", "full"):
        say(f"  recompute {mode:>9}: {timing.Spread.of(times[mode]).text()}")
    for mode in ("selective", "full"):
        say(f"  recompute {mode:>9}: {1 - base[mode] / base['none']:4.0%} less block memory "
            f"for {timing.change(times['none'], times[mode])}")
    return found


def tape_bytes_single(cfg: TrainConfig) -> int:
    """One process's block on this rank: no communicator needed."""
    from minipar.core import gpt

    full = nn.init_params(cfg.model_config(), cfg.seed)
    ffn = gpt.reference_ffn(cfg.model_config(), full)(0)
    block = gpt.Block(full, 0, cfg.heads, ffn,
                      attn=gpt.Attention(full, 0, cfg.heads,
                                         selective=cfg.recompute == "selective"))
    if cfg.recompute == "full":
        from minipar.core.recompute import Recomputed

        block = Recomputed(block)
    h = Tensor(np.random.default_rng(0).normal(size=(cfg.batch, cfg.seq_len, cfg.d_model)),
               requires_grad=True)
    out, _ = block(h)
    return tape_bytes(out, exclude=(h,))


# ----------------------------------------------------------- 5. equivalence
def equivalence() -> None:
    say("\n=== 5. against one process (float64): losses and final parameters")
    settings = [dict(), dict(vocab_parallel=False), dict(sp=True),
                dict(sp=True, recompute="selective"), dict(sp=True, recompute="full",
                                                           optimizer="adam", lr=0.01)]
    for fields in settings:
        wait_for_rank0(comm)  # the others asleep while rank 0 reran the last one alone
        cfg = config(**fields)
        result = train(cfg, comm)
        if rank != 0:
            continue
        ref = train_reference(cfg)
        _, worst, _ = max_differences(result.final, ref.final)
        loss = relative_difference(result.losses, ref.losses)
        label = ", ".join(f"{k}={v}" for k, v in fields.items()) or "defaults"
        tolerance = TOLERANCE[cfg.dtype]
        print(f"  {label:>44}: losses rel diff {loss:.1e}, params max rel diff {worst:.1e} "
              f"-> {verdict(worst <= tolerance and loss <= tolerance)}", flush=True)


def figure(found: dict[str, dict[str, int]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minipar.teaching.plots import save

    fig, ax = plt.subplots(figsize=(7, 3.8))
    modes = ("none", "selective", "full")
    width = 0.8 / len(found)
    for i, (label, values) in enumerate(found.items()):
        ax.bar(np.arange(len(modes)) + i * width, [values[m] / KiB for m in modes], width,
               label=label)
    ax.set_xticks(np.arange(len(modes)) + width * (len(found) - 1) / 2, modes)
    ax.set_xlabel("--recompute")
    ax.set_ylabel("KiB per rank, one block, one microbatch")
    ax.set_title("What a transformer block keeps for its backward (measured)")
    ax.legend()
    fig.tight_layout()
    return save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    if size not in (2, 4):
        say("lesson 11 runs on 2 or 4 ranks (mpiexec -n 4 python lessons/11_transformer_tp.py)")
        raise SystemExit(2)
    holdings()
    say("\n=== 2. one step's tp ledger (rank 0) beside timemodel.traffic")
    sent = {vp: one_step(vp)["wire"] for vp in (True, False)}
    vocabulary(sent)
    found = memory_and_time()
    equivalence()
    if args.plot and rank == 0:
        print(f"figure: {figure(found, args.plot / '11_tp_memory.png')}", flush=True)


if __name__ == "__main__":
    run_collectively(main)
