"""Lesson 10: a transformer on a mesh -- attention learns to look back, then reads a README.

    mpiexec -n 2 python lessons/10_transformer.py
    mpiexec -n 4 python lessons/10_transformer.py --corpus README.md
    mpiexec -n 2 python lessons/10_transformer.py --plot figures   # + 10_losses.png

Every strategy so far split an MLP whose rows are examples. minipar's transformer
(`--model gpt`, minipar/core/gpt.py and minipar/core/attention.py) has rows that are POSITIONS of
a sequence, and one layer, attention, that mixes them. This lesson trains it with data
parallelism over all the ranks and prints:

1. that the mesh run equals one process (a few steps, float64, relative 1e-9);
2. the copy task (data.make_sequences): the second half of every sequence repeats the
   first. The first half is random, so its loss can never go below log V; the second
   half is predictable only by an attention head that has learned to look back half a
   sequence. The per-position loss after training shows exactly that split;
3. the same model on a text file, byte by byte (V = 256, `--data`): the loss curve
   and a few characters it writes, greedily, after a prompt from the file;
4. the same file as DOCUMENTS (`--data --documents`): each paragraph (split at blank
   lines) a row, padded to T+1 bytes and masked, so rows hold different numbers of real
   tokens; the loss is the mean over the valid positions of the global batch (one
   Allreduce of the count per step), clipped at a global gradient norm (`--clip-grad-
   norm`): a few steps on dp x 2 microbatches against one process, and how ragged the
   batch was.

The code behind it: minipar/core/gpt.py, minipar/core/attention.py, minipar/core/data.py,
minipar/core/documents.py, minipar/compose/clip.py.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.job import run_collectively, verdict
from minipar.core import autograd as ag
from minipar.core.data import make_sequences, read_corpus, repeated_positions
from minipar.core.documents import read_documents, valid_positions
from minipar.run.reference import build_reference, step_batch
from minipar.run.results import max_differences
from minipar.run.train import train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments

ROOT = Path(__file__).resolve().parent.parent
COPY = dict(model="gpt", layers=2, d_model=32, heads=2, seq_len=16, vocab=8, batch=16,
            optimizer="adam", lr=0.005)
TEXT = dict(model="gpt", layers=2, d_model=64, heads=4, seq_len=32, batch=32,
            optimizer="adam", lr=0.003)


def position_losses(cfg: TrainConfig, final: dict[str, np.ndarray]) -> np.ndarray:
    """Mean next-token loss at each position t of fresh copy-task sequences, (T,)."""
    model = build_reference(cfg, final)
    x, y = make_sequences(cfg.seed, 10**6, 256, cfg.seq_len, cfg.vocab)   # unseen batch
    with ag.no_grad():
        logits, _ = model.forward(ag.Tensor(x))
    z = logits.data - logits.data.max(axis=-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -np.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0].mean(axis=0)


def generate(cfg: TrainConfig, final: dict[str, np.ndarray], prompt: bytes, count: int) -> str:
    """`count` bytes after `prompt`, each the model's most likely next byte (greedy), the
    model seeing the last T bytes. One process, no tape."""
    model = build_reference(cfg, final)
    tokens = list(prompt)
    with ag.no_grad():
        for _ in range(count):
            window = np.array([tokens[-cfg.seq_len:]])          # (1, <= T)
            logits, _ = model.forward(ag.Tensor(window))
            tokens.append(int(np.argmax(logits.data[0, -1])))
    return bytes(tokens[len(prompt):]).decode("utf-8", errors="replace")


def curve(losses: list[float], every: int) -> str:
    return "  ".join(f"{i + 1}: {loss:.3f}" for i, loss in enumerate(losses)
                     if i % every == 0 or i == len(losses) - 1)


def figure(copy: list[float], text: list[float], floor: float, vocab: int,
           folder: Path) -> None:
    from matplotlib.figure import Figure

    from minipar.teaching.plots import save

    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(np.arange(1, len(copy) + 1), copy, color="C0", label="training loss")
    left.axhline(np.log(vocab), color="0.5", ls="--", lw=1, label="log V: no attention")
    left.axhline(floor, color="black", ls=":", lw=1,
                 label="a perfect copier: log V on the first half, 0 on the repeat")
    left.set(xlabel="step", ylabel="loss", title="the copy task: attention learns to look back")
    left.legend(fontsize=8, loc="center left")  # between the two lines, over no data
    right.plot(np.arange(1, len(text) + 1), text, color="C1")
    right.set(xlabel="step", ylabel="loss (nats per byte)", title="a text file, byte by byte")
    print("figure:", save(fig, folder / "10_losses.png"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "README.md",
                        help="the text file of part 3 (default: the repository's README)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (for the tests)")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    copy_steps, text_steps = (150, 40) if args.quick else (300, 300)

    check = TrainConfig(**COPY, steps=3, dp=n).resolved(n)
    mesh_run = train(check, world)
    if rank == 0:
        _, worst, _ = max_differences(mesh_run.final, train_reference(check).final)
        print(f"=== 1. gpt on dp = {n} against one process, 3 steps: params rel {worst:.1e} "
              f"-> {verdict(worst <= 1e-9)}", flush=True)

    cfg = TrainConfig(**COPY, steps=copy_steps, dp=n).resolved(n)
    copy = train(cfg, world)
    text_cfg = TrainConfig(**TEXT, steps=text_steps, dp=n, data=str(args.corpus)).resolved(n)
    text = train(text_cfg, world)
    ragged_cfg = TrainConfig(**TEXT, steps=3, dp=n, microbatches=2, data=str(args.corpus),
                             documents=True, clip_grad_norm=1.0).resolved(n)
    ragged = train(ragged_cfg, world)
    if rank != 0:
        return
    repeated = repeated_positions(cfg.seq_len)
    floor = np.log(cfg.vocab) * (~repeated).mean()
    print(f"\n=== 2. the copy task, V = {cfg.vocab}, T = {cfg.seq_len}: log V = "
          f"{np.log(cfg.vocab):.3f}; a perfect copier's mean loss {floor:.3f}", flush=True)
    print("step losses:", curve(copy.losses, copy_steps // 6), flush=True)
    per_position = position_losses(cfg, copy.final)
    print("loss by position:", " ".join(f"{v:.2f}" for v in per_position), flush=True)
    looked_back = per_position[repeated].mean() < 0.3 * np.log(cfg.vocab)
    print(f"  repeated positions {per_position[repeated].mean():.3f}, first half "
          f"{per_position[~repeated].mean():.3f}: attention looks back -> "
          + (verdict(looked_back, "yes", "NO") if not args.quick else
             f"{'yes' if looked_back else 'not yet'} (--quick: too few steps to require it)"),
          flush=True)

    corpus = read_corpus(str(args.corpus))
    print(f"\n=== 3. {args.corpus.name}, {corpus.size} bytes, windows of T = "
          f"{text_cfg.seq_len} + 1: log 256 = {np.log(256):.3f}", flush=True)
    print("step losses:", curve(text.losses, max(1, text_steps // 6)), flush=True)
    fell = text.losses[-1] < text.losses[0] - 1.0
    print(f"  the loss fell by {text.losses[0] - text.losses[-1]:.2f} nats per byte -> "
          f"{verdict(fell, 'learning', 'NOT LEARNING')}", flush=True)
    prompt = bytes(corpus[:text_cfg.seq_len].tolist())
    print(f"  after {prompt.decode('utf-8', errors='replace')!r} it writes: "
          f"{generate(text_cfg, text.final, prompt, 60)!r}", flush=True)
    words = Counter(w for w in bytes(corpus.tolist()).decode("utf-8", errors="replace")
                    .lower().split() if w.isalpha())
    top, count = words.most_common(1)[0]
    print(f"  (why it repeats itself: a tiny model trained {text_steps} steps, decoded "
          f"greedily -- each byte its most likely one --\n   loops on the corpus's commonest "
          f"pieces: its commonest word is {top!r}, {count} of {sum(words.values())})",
          flush=True)
    documents(ragged_cfg, ragged)
    if args.plot:
        figure(copy.losses, text.losses, floor, cfg.vocab, args.plot)


def documents(cfg: TrainConfig, run: object) -> None:
    """Part 4: ragged rows of documents, masked loss, clipped gradients, on the mesh and
    on one process."""
    starts, lengths = read_documents(cfg.data)
    _, y = step_batch(cfg, 0)
    print(f"\n=== 4. {len(starts)} documents of {int(lengths.min())}-{int(lengths.max())} "
          f"bytes as rows of T + 1 = {cfg.seq_len + 1}:\nstep 1 has {valid_positions(y)} "
          f"valid positions of {y.size}; the loss is their mean, the gradient clipped at "
          f"norm {cfg.clip_grad_norm:g}", flush=True)
    ref = train_reference(cfg)
    _, worst, _ = max_differences(run.final, ref.final)
    norms = run.extras["gnorms"]
    print("  gnorm per step: " + "  ".join(f"{g:.3f}" for g in norms)
          + f" (one process: {'  '.join(f'{g:.3f}' for g in ref.extras['gnorms'])})",
          flush=True)
    print(f"  dp = {cfg.dp}, M = {cfg.microbatches}, {cfg.steps} steps against one process: "
          f"params rel {worst:.1e} -> {verdict(worst <= 1e-9)}", flush=True)


if __name__ == "__main__":
    run_collectively(main)
