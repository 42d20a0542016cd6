"""Inference on the training meshes: `python -m minipar generate`, prefill then decode.

What this file teaches: serving splits the same model as training, with two phases
that cost differently (Pope et al. 2022; the JAX scaling book's inference chapters):

    prefill   the P prompt positions in one forward: matmuls of P rows, like training
    decode    one new token per row at a time: every weight and the whole KV cache
              (kvcache.py) read for one row of work, a step bounded by memory, not FLOPs

The mesh splits each step as in training, one token's worth at a time:

    tp   heads and the cache split by heads; proj and fc2 end in one Allreduce of
         (b, 1, d) each; the head is vocabulary-parallel and the next token is chosen
         WITHOUT gathering the logits: each rank takes its best (score, global id) and
         one Allreduce(MAXLOC) of those pairs gives the winner. Sampling is the same
         argmax (Gumbel-max): token = argmax(logits / temperature + g), g Gumbel noise
         drawn from (seed, step) over the global vocabulary, identical on every rank,
         so the sample is exact and gather-free.
    pp   stages pass each token's activation (b, 1, d) by Send/Recv; the B rows ride the
         pipeline as B microbatches in flight; the last stage sends the chosen ids back
         to the first, which embeds them at the next step.
    cp   the prompt's positions split over cp, prefilled by the ring
         (context_parallel.ring_attention); decoded positions go round-robin to the cp
         ranks' caches, every rank attends its part, one Allgather of (o | lse) and the
         log-sum-exp merge (kvcache.merge_over).
    ep   each token's expert inputs exchanged by Alltoallv (expert_parallel.py), dropless.
    dp   the B rows split over dp; nothing exchanged (each row is its own sequence).

`--check` compares with one process doing the slowest correct thing: a full forward of
the whole prefix, no cache, at every step (float64, 1e-9). `--dump DIR` writes
params.npz, config.json, tokens.json and logits.npz (docs/design.md, "Inference").

    python -m minipar generate --prompt-ids 1,2,3 --new-tokens 8 --check
    mpiexec -n 4 python -m minipar generate --tp 2 --pp 2 --batch 2 --temperature 0.8 \
        --prompt-ids 5,6,7,8 --check --ledger
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from minipar.checkpoint import shard_files
from minipar.comm import watchdog
from minipar.comm.mesh import Mesh
from minipar.compose import parallelize
from minipar.core import autograd, gpt, nn
from minipar.parallel import kvcache
from minipar.run.results import TOLERANCE, relative_difference
from minipar.settings import config, preflight
from minipar.settings.config import ConfigError, TrainConfig

PAIR = np.dtype([("value", np.float64), ("index", np.int32)], align=True)  # MPI DOUBLE_INT


# ---------------------------------------------------------------- the flags
@dataclass(frozen=True)
class GenerateConfig:
    """A generate run: the model and mesh (as `train` spells them: `--batch` is the rows
    generated, `--seed` seeds a fresh model and the sampling) plus the prompt."""

    train: TrainConfig
    prompt: tuple[int, ...] = ()
    new_tokens: int = 8
    temperature: float = 0.0
    seed: int = 0            # the sampling's stream (with --resume, not the model's seed)

    def as_json(self) -> dict:
        """`config.json` of `--dump`: the train flags plus the generate ones."""
        return dict(self.train.as_json(), prompt=list(self.prompt),
                    new_tokens=self.new_tokens, temperature=self.temperature,
                    sample_seed=self.seed)


# The train flags generate reads (the model, the mesh, the numbers, the checkpoint); the
# others (--steps, --lr, --optimizer, --save, --trace, --mixed, ...) are training's and
# not offered: a flag the command would ignore is refused by argparse instead. --virtual,
# --zero, --sp, --recompute and --capacity-factor stay, to be refused by name (`problems`).
USED_TRAIN_FLAGS = frozenset({
    "--model", "--layers", "--d-model", "--d-ff", "--experts", "--top-k", "--expert-d-ff",
    "--batch", "--seed", "--dp", "--tp", "--pp", "--ep", "--cp", "--shared-experts",
    "--router", "--route-groups", "--route-top-groups", "--dtype", "--resume", "--timeout",
    "--vocab", "--seq-len", "--heads", "--data",
    "--virtual", "--zero", "--sp", "--recompute", "--capacity-factor"})
# with --resume the model is the checkpoint's: one of these given otherwise is refused
MODEL_FLAGS = ("model", "layers", "d_model", "d_ff", "experts", "top_k", "expert_d_ff",
               "shared_experts", "router", "route_groups", "route_top_groups", "dtype",
               "vocab", "seq_len", "heads", "data")

# offered only to be refused (`problems`); with --resume, refused here by name
TRAINING_FLAGS = ("virtual", "zero", "sp", "recompute", "capacity_factor")


class _UsedFlags:
    """`config.add_train_flags` onto a parser, keeping only `USED_TRAIN_FLAGS`."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_argument(self, *names: str, **options: object) -> None:
        if names[0] in USED_TRAIN_FLAGS:
            self.parser.add_argument(*names, **options)


class _Parser(config.Parser):
    """The generate parser: `args.given` holds the flags the command line gave (a
    second parse over a namespace of markers: argparse fills in only what is absent)."""

    def parse_args(self, args: list[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        marker = object()
        probed = super().parse_args(args, argparse.Namespace(
            **{name: marker for name in vars(parsed)}))
        parsed.given = frozenset(name for name, value in vars(probed).items()
                                 if value is not marker)
        return parsed


def make_parser() -> argparse.ArgumentParser:
    """The train flags generate uses (model and mesh) with the generate ones."""
    parser = _Parser(prog="python -m minipar generate",
                     description="Generate tokens with a KV cache on a mesh of ranks.")
    config.add_train_flags(_UsedFlags(parser))
    parser.set_defaults(model="gpt", batch=1)
    add = parser.add_argument
    add("--prompt", metavar="TEXT", help="the prompt as bytes (a --data model reads bytes)")
    add("--prompt-ids", metavar="IDS", help="the prompt as comma-separated token ids")
    add("--new-tokens", type=int, default=8, help="tokens to generate after the prompt")
    add("--temperature", type=float, default=0.0,
        help="0: greedy; otherwise sample from softmax(logits / temperature), seeded")
    add("--check", action="store_true",
        help="compare with one process's full forward of every prefix (no cache)")
    add("--dump", metavar="DIR", help="write params, config, tokens and logits")
    add("--ledger", action="store_true", help="print the decode step's communication")
    return parser


def parse_prompt(args: argparse.Namespace) -> tuple[int, ...]:
    """The prompt's ids from `--prompt TEXT` (its UTF-8 bytes) or `--prompt-ids 1,2,3`."""
    if (args.prompt is None) == (args.prompt_ids is None):
        raise ConfigError("give the prompt once: --prompt TEXT or --prompt-ids 1,2,3")
    if args.prompt is not None:
        return tuple(args.prompt.encode("utf-8"))
    try:
        return tuple(int(part) for part in args.prompt_ids.split(","))
    except ValueError:
        raise ConfigError(f"--prompt-ids {args.prompt_ids!r} is not comma-separated "
                          "integers (e.g. 1,2,3)") from None


def config_from_args(args: argparse.Namespace, world_size: int
                     ) -> tuple[GenerateConfig | None, list[str]]:
    """The run's config, or the reasons it cannot run (pure: no communication). With
    `--resume DIR` the model flags come from the checkpoint's manifest, the mesh and
    the generate flags from this command line."""
    prompt = parse_prompt(args)
    train_cfg = config.config_from_args(args)
    if args.resume:

        errors = shard_files.verify(args.resume)
        if errors:
            return None, [f"--resume {errors[0]}"]
        saved = shard_files.read_manifest(Path(args.resume))
        if saved["config"].get("model") not in nn.GPT_MODELS:
            return None, [f"--resume {args.resume} holds a --model "
                          f"{saved['config'].get('model')} checkpoint: generate needs a "
                          "transformer (--model gpt or gpt-moe)"]
        differ = [name for name in MODEL_FLAGS if name in getattr(args, "given", ())
                  and name in saved["config"] and getattr(args, name) != saved["config"][name]]
        if differ:   # the checkpoint's shape runs: a flag saying otherwise is refused
            flag = f"--{differ[0].replace('_', '-')}"
            return None, [f"--resume {args.resume}: saved with {flag} "
                          f"{saved['config'][differ[0]]}, this run has {flag} "
                          f"{getattr(args, differ[0])} (generate runs the checkpoint's "
                          "model: leave the flag out)"]
        training = [name for name in TRAINING_FLAGS if name in getattr(args, "given", ())]
        if training:   # set aside below for a resumed model: said, not ignored
            return None, [f"--{training[0].replace('_', '-')} is training's: generate runs "
                          "without it"]
        mesh = {axis: getattr(args, axis) for axis in ("dp", "tp", "pp", "ep", "cp")}
        train_cfg = replace(shard_files.config_for(saved, **mesh), batch=args.batch,
                            microbatches=1, steps=1, resume=args.resume, save=None,
                            timeout=args.timeout, schedule="1f1b", virtual=1, sp=False,
                            recompute="none", vocab_parallel=None,
                            capacity_factor=None)   # generation is dropless
    elif args.data is not None:   # the file is not read, but a path to nothing is a mistake
        unusable = preflight.path_problems(args.data) or (
            [] if Path(args.data).is_file() else [f"{args.data}: no such file"])
        if unusable:
            return None, [f"--data {unusable[0]}"]
    train_cfg = replace(train_cfg, vocab_parallel=None).resolved(world_size)
    gcfg = GenerateConfig(train_cfg, prompt, args.new_tokens, args.temperature, args.seed)
    return gcfg, problems(gcfg, world_size)


def problems(gcfg: GenerateConfig, world_size: int) -> list[str]:
    """Every reason `gcfg` cannot run on `world_size` ranks (pure, every rank alike)."""
    cfg = gcfg.train
    if cfg.model not in nn.GPT_MODELS:
        return [f"generate needs a transformer: --model gpt or gpt-moe (got {cfg.model})"]
    # (the --data text is training's: generating needs only the vocabulary it implies)
    out = config.problems(replace(cfg, resume=None, data=None), world_size)
    if out:
        return out
    P, N, T = len(gcfg.prompt), gcfg.new_tokens, cfg.seq_len
    if N < 1:
        out.append(f"--new-tokens must be at least 1 (got {N})")
    if not math.isfinite(gcfg.temperature) or gcfg.temperature < 0:
        out.append(f"--temperature must be 0 (greedy) or positive (got {gcfg.temperature})")
    if P == 0:
        out.append("the prompt is empty: give at least one token")
    elif P > T:
        out.append(f"the prompt has {P} tokens, more than --seq-len {T} (the positions "
                   "the model has embeddings for)")
    elif P + N > T:
        out.append(f"--new-tokens {N} after a prompt of {P} runs past --seq-len {T} "
                   f"(at most {T - P} new tokens)")
    outside = [t for t in gcfg.prompt if not 0 <= t < cfg.vocab]
    if outside:
        out.append(f"the prompt holds {outside[0]}, outside the vocabulary 0..{cfg.vocab - 1}"
                   + (" (--prompt TEXT reads bytes: use --prompt-ids, or a --data model)"
                      if cfg.data is None else ""))
    if cfg.model_config().is_moe and cfg.capacity_factor is not None:
        out.append("--capacity-factor: generation is dropless (every token reaches its "
                   "experts); drop the flag")
    if cfg.sp or cfg.recompute != "none" or cfg.virtual > 1 or cfg.zero:
        out.append("--sp, --recompute, --virtual and --zero are training's: generate "
                   "runs without them")
    if cfg.cp > 1 and P % cfg.cp:
        out.append(f"--cp {cfg.cp} does not divide the prompt's {P} tokens (each cp rank "
                   "prefills P/cp positions by the ring)")
    if not out and not cfg.resume:
        out += preflight.memory_problems(cfg, world_size)
    return out


# ----------------------------------------------------------- choosing a token
def gumbel(seed: int, step: int, rows: int, vocab: int) -> np.ndarray:
    """(rows, vocab) Gumbel noise -log(-log u) of step `step`: row b's is row b of one
    draw seeded by (seed, step), the same on every rank and every mesh."""
    u = np.random.default_rng([seed, step]).random((rows, vocab))
    with np.errstate(divide="ignore"):
        return -np.log(-np.log(u))


def scores(logits: np.ndarray, temperature: float, noise: np.ndarray | None) -> np.ndarray:
    """What the token is the argmax of: the logits (greedy), or logits/temperature + g
    (Gumbel-max: that argmax is a draw from softmax(logits / temperature))."""
    logits = logits.astype(np.float64)
    return logits if temperature == 0 else logits / temperature + noise


def choose(score: np.ndarray, first: int, tp: object | None = None) -> np.ndarray:
    """(b,) the global id of each row's largest score; `score` (b, V/tp) holds columns
    first .. first + V/tp - 1. With tp > 1: ONE Allreduce(MAXLOC) of b (score, id) pairs
    -- the logits never move. Ties go to the lowest id, as np.argmax's do."""
    local = score.argmax(axis=1)
    if tp is None or tp.size == 1:
        return local + first
    from mpi4py import MPI  # here: the one-process reference never loads MPI

    pairs = np.empty(score.shape[0], dtype=PAIR)
    pairs["value"] = score[np.arange(score.shape[0]), local]
    pairs["index"] = local + first
    best = np.empty_like(pairs)
    # my best (score, id) of each row -> the best of every tp rank
    tp.Allreduce([pairs, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MAXLOC)
    return best["index"].astype(np.int64)


# ------------------------------------------------------------ the reference
def reference(gcfg: GenerateConfig, full: dict[str, np.ndarray]
              ) -> tuple[np.ndarray, np.ndarray]:
    """One process, no cache: at every step the full forward of the whole prefix, the
    last position's logits, the token. Returns tokens (B, N) and logits (N, B, V)."""
    cfg = gcfg.train
    model = gpt.build_reference(cfg.model_config(), full)
    seq = np.tile(np.asarray(gcfg.prompt, dtype=np.int64), (cfg.batch, 1))
    steps = []
    with autograd.no_grad():
        for step in range(gcfg.new_tokens):
            logits = model.forward(seq)[0].data[:, -1]                 # (B, V)
            noise = gumbel(gcfg.seed, step, cfg.batch, cfg.vocab) if gcfg.temperature else None
            ids = choose(scores(logits, gcfg.temperature, noise), 0)
            seq = np.concatenate([seq, ids[:, None]], axis=1)
            steps.append(logits)
    return seq[:, len(gcfg.prompt):], np.stack(steps)


# ------------------------------------------------------------- on the mesh
@dataclass
class Stage:
    """This rank's part of the model: the embedding (first stage), its blocks, the head
    (last stage), each tensor-parallel when tp > 1 (vocabulary-parallel ends)."""

    embed: nn.Module | None
    blocks: list[gpt.Block]
    head: nn.Module | None
    first_layer: int

    def parameter_bytes(self) -> int:
        pieces = [p for p in (self.embed, *self.blocks, self.head) if p is not None]
        return sum(p.data.nbytes for piece in pieces for p in piece.parameters())


def build_stage(cfg: TrainConfig, mesh: Mesh, full: dict[str, np.ndarray]) -> Stage:
    """The pieces of pipeline stage `mesh.coords["pp"]`, built by training's own
    assemble.make_block (its attention called through kvcache.cached_attention)."""
    model_cfg = cfg.model_config()
    per_stage = cfg.layers // cfg.pp
    s = mesh.coords["pp"]
    # the blocks as training builds them, without cp's attention strategy (the cache
    # does attention) and, with cp alone, with the tokens' FFN run locally
    plain = replace(cfg, cp=1)
    blocks = [parallelize.make_block(plain, model_cfg, mesh, full, i)
              for i in range(s * per_stage, (s + 1) * per_stage)]
    embed = head = None
    if cfg.tp > 1:
        from minipar.parallel import vocab_parallel  # here: it loads mpi4py.MPI

        if s == 0:
            embed = vocab_parallel.VocabParallelEmbedding(full, mesh.tp)
        if s == cfg.pp - 1:
            head = vocab_parallel.VocabParallelHead(full, mesh.tp)
    else:
        embed = gpt.Embedding(full) if s == 0 else None
        head = gpt.Head(full) if s == cfg.pp - 1 else None
    return Stage(embed, blocks, head, s * per_stage)


def held_positions(prompt: int, new_tokens: int, cp: int, rank: int) -> np.ndarray:
    """The positions cp rank `rank` keeps in its cache: its P/cp run of the prompt and
    every cp-th decoded position from P + rank (the last token is never fed back)."""
    chunk = prompt // cp
    return np.concatenate([np.arange(rank * chunk, (rank + 1) * chunk),
                           np.arange(prompt + rank, prompt + new_tokens - 1, cp)])


@dataclass
class MeshResult:
    """What a generate run on a mesh gives; `tokens`, `logits`, `ledger`, `memory` are
    gathered on rank 0 (None elsewhere)."""

    tokens: np.ndarray | None
    logits: np.ndarray | None
    ledger: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)   # each step's wall time, rank 0


def generate_on_mesh(gcfg: GenerateConfig, mesh: Mesh, full: dict[str, np.ndarray]
                     ) -> MeshResult:
    """Prefill and decode on this rank's part of the mesh (every rank calls it)."""
    cfg, coords = gcfg.train, mesh.coords
    stage = build_stage(cfg, mesh, full)
    model_cfg = cfg.model_config()
    P, N = len(gcfg.prompt), gcfg.new_tokens
    first_stage, last_stage = coords["pp"] == 0, coords["pp"] == cfg.pp - 1
    rows = cfg.batch // cfg.dp
    row0 = coords["dp"] * rows                          # my rows of the global batch
    M = rows if cfg.pp > 1 else 1                       # pipeline: one row per microbatch
    b = rows // M
    heads, dh = model_cfg.heads // cfg.tp, cfg.d_model // model_cfg.heads
    held = held_positions(P, N, cfg.cp, coords["cp"])
    dtype = np.dtype(cfg.dtype)
    caches = [[kvcache.LayerCache(b, heads, held.size, dh, dtype) for _ in stage.blocks]
              for _ in range(M)]
    ring = None
    if cfg.cp > 1:
        from minipar.parallel import context_parallel  # here: it loads mpi4py.MPI

        ring = context_parallel.ContextParallelAttention(mesh.cp, "ring", P)
    first_vocab = getattr(stage.head, "first", 0)
    width = cfg.vocab // cfg.tp
    ids = [np.tile(np.asarray(gcfg.prompt, dtype=np.int64), (b, 1)) for _ in range(M)]
    tokens = np.zeros((rows, N), dtype=np.int64)
    logits_here = np.zeros((N, rows, width), dtype=dtype)
    sends: list = []
    seconds = []
    with autograd.no_grad():
        for step in range(N):
            if step == N - 1:            # the ledger of one decode step: the last one
                mesh.ledger.reset()      # (with one new token: the prefill's)
            start = time.perf_counter()
            prefill = step == 0
            fed = held[:P // cfg.cp] if prefill else np.array([P + step - 1])
            noise = gumbel(gcfg.seed, step, cfg.batch, cfg.vocab)[row0:row0 + rows,
                                                            first_vocab:first_vocab + width] \
                if gcfg.temperature else None
            for m in range(M):
                if first_stage:
                    if not prefill and cfg.pp > 1:   # the ids the last stage chose
                        ids[m] = np.empty((b, 1), dtype=np.int64)
                        mesh.pp.Recv(ids[m], source=cfg.pp - 1)
                    h = stage.embed(ids[m][:, fed] if prefill else ids[m][:, -1:], positions=fed)
                else:
                    buf = np.empty((b, fed.size, cfg.d_model), dtype=dtype)
                    mesh.pp.Recv(buf, source=coords["pp"] - 1)   # the previous stage's h
                    h = autograd.Tensor(buf)
                owner = prefill or (step - 1) % cfg.cp == coords["cp"]  # held_positions
                for block, cache in zip(stage.blocks, caches[m]):
                    h = kvcache.cached_attention(block.attn, h, cache, fed, store=owner,
                                                 cp=mesh.cp, ring=ring if prefill else None)
                    h, _ = block.ffn(h)
                if not last_stage:
                    # my (b, t, d) activation -> the next stage
                    mesh.pp.Send(np.ascontiguousarray(h.data), dest=coords["pp"] + 1)
                    continue
                last = h.data[:, -1:]
                if prefill and cfg.cp > 1:   # the prompt's last position is on cp rank cp-1
                    last = np.ascontiguousarray(last)
                    mesh.cp.Bcast(last, root=cfg.cp - 1)
                out = stage.head(autograd.Tensor(last)).data[:, 0]          # (b, V/tp)
                here = slice(m * b, (m + 1) * b)
                chosen = choose(scores(out, gcfg.temperature,
                                       None if noise is None else noise[here]),
                                first_vocab, mesh.tp)
                tokens[here, step], logits_here[step, here] = chosen, out
                ids[m] = chosen[:, None] if cfg.pp > 1 else \
                    np.concatenate([ids[m], chosen[:, None]], axis=1)
                if cfg.pp > 1:               # my rows' ids -> the first stage
                    message = np.ascontiguousarray(chosen)
                    sends.append((mesh.pp.Isend(message, dest=0), message))
            if sends:
                for request, _ in sends:
                    request.Wait()
                sends.clear()
            seconds.append(time.perf_counter() - start)
    mesh.ledger.enabled = False          # gathering the results is not the decode step
    if first_stage and cfg.pp > 1:       # the last step's ids, sent like every step's
        for _ in range(M):
            mesh.pp.Recv(np.empty(b, dtype=np.int64), source=cfg.pp - 1)
    ledger = mesh.world.gather(mesh.ledger.records(mesh.rank))
    cache_bytes = sum(c.nbytes for mb in caches for c in mb)
    memory = mesh.world.gather({"rank": mesh.rank, "cache_bytes": cache_bytes,
                                "parameter_bytes": stage.parameter_bytes(),
                                "formula": decode_cache_bytes(gcfg, coords["cp"])})
    keep = last_stage and coords["cp"] == 0
    parts = mesh.world.gather((row0, first_vocab, tokens, logits_here) if keep else None)
    mesh.ledger.enabled = True
    if mesh.rank != 0:
        return MeshResult(None, None)
    all_tokens = np.zeros((cfg.batch, N), dtype=np.int64)
    all_logits = np.zeros((N, cfg.batch, cfg.vocab), dtype=dtype)
    for part in parts:
        if part is not None:
            r, c, t, lg = part
            all_tokens[r:r + t.shape[0]] = t
            all_logits[:, r:r + t.shape[0], c:c + lg.shape[2]] = lg
    return MeshResult(all_tokens, all_logits, [r for rank in ledger for r in rank], memory,
                      seconds)


# ------------------------------------------------------------- formulas
def decode_cache_bytes(gcfg: GenerateConfig, cp_rank: int = 0) -> int:
    """The KV cache of one rank: 2 (K, V) x L/pp layers x B/dp rows x H/tp heads x the
    positions this cp rank holds (P/cp of the prompt, every cp-th decoded one) x dh."""
    cfg = gcfg.train
    positions = held_positions(len(gcfg.prompt), gcfg.new_tokens, cfg.cp, cp_rank).size
    return kvcache.cache_bytes(cfg.layers // cfg.pp, cfg.batch // cfg.dp,
                               cfg.heads // cfg.tp, positions, cfg.d_model // cfg.heads,
                               np.dtype(cfg.dtype).itemsize)


def decode_ledger(gcfg: GenerateConfig, pp_rank: int
                  ) -> dict[tuple[str, str], tuple[int, int | None]]:
    """One decode step's calls and elements on a rank of pipeline stage `pp_rank`, by
    formula: (group, op) -> (calls, elements). M microbatches of b rows (M = B/dp with a
    pipeline, else 1), L/pp layers here:

        tp  Allreduce of (b, 1, d): the embedding's, attention proj's and (dense) fc2's
            per layer; Allreduce(MAXLOC) of b (score, id) pairs at the head
        cp  Allgather of (o | lse), cp x b x H/tp x (dh + 1), per layer
        pp  Send / Recv of (b, 1, d) between stages; the last stage Isends the b chosen
            ids to the first, which Recvs them
        dp  gpt-moe on dp > 1 or ep > 1 (expert_parallel.ExpertParallelBlock): per layer
            2 Allreduces of E (the experts' counts, the aux loss's mean probabilities)
        ep  per layer one Alltoall of the E counts, and 2 Alltoallv: the dispatch sends
            this rank's b x k rows of d (dropless), the combine returns what the router
            brought here -- its elements follow the router (None); summed over the ranks
            the combine returns what was dispatched"""
    cfg = gcfg.train
    rows = cfg.batch // cfg.dp
    M = rows if cfg.pp > 1 else 1
    b, d, layers = rows // M, cfg.d_model, cfg.layers // cfg.pp
    first, last = pp_rank == 0, pp_rank == cfg.pp - 1
    moe = cfg.model_config().is_moe
    out: dict[tuple[str, str], tuple[int, int | None]] = {}
    if cfg.tp > 1:
        per_layer = 1 if moe else 2
        activations = int(first) + per_layer * layers
        out[("tp", "Allreduce")] = (M * (activations + int(last)),
                                    M * (activations * b * d + int(last) * b))
    if cfg.cp > 1:
        dh = d // cfg.heads
        out[("cp", "Allgather")] = (M * layers,
                                    M * layers * cfg.cp * b * (cfg.heads // cfg.tp) * (dh + 1))
    if cfg.pp > 1:
        out[("pp", "Recv")] = (M, M * (b if first else b * d))
        if last:
            out[("pp", "Isend")] = (M, M * b)
        else:
            out[("pp", "Send")] = (M, M * b * d)
    if moe and (cfg.dp > 1 or cfg.ep > 1):
        E = cfg.experts
        out[("dp", "Allreduce")] = (2 * M * layers, 2 * M * layers * E)
        if cfg.ep > 1:
            out[("ep", "Alltoall")] = (M * layers, M * layers * E)
            out[("ep", "Alltoallv")] = (2 * M * layers, None)
    return out


def dispatched_elements(gcfg: GenerateConfig) -> int:
    """Elements one rank's dispatch Alltoallvs send in a decode step (gpt-moe, ep > 1):
    M x L/pp x b rows x k experts x d, the same on every rank (dropless)."""
    cfg = gcfg.train
    rows = cfg.batch // cfg.dp
    return (cfg.layers // cfg.pp) * rows * cfg.top_k * cfg.d_model


def ledger_lines(gcfg: GenerateConfig, records: list[dict]) -> list[str]:
    """One line per (rank, group, op) of the decode step, beside its formula."""
    shape = gcfg.train.mesh_shape()
    lines = [f"ledger of one decode step ({len({r['rank'] for r in records})} ranks)",
             f"{'rank':>4} {'group':>5} {'op':>10} {'calls':>6} {'elements':>9} "
             f"{'bytes':>9}  formula (calls, elements)"]
    for r in records:
        if r["calls"] == 0:
            continue
        predicted = decode_ledger(gcfg, shape.coords(r["rank"])["pp"]).get(
            (r["group"], r["op"]))
        if predicted is None:
            verdict = "- (no formula)"
        elif predicted[1] is None:
            verdict = f"{predicted[0]}, (router) " + (
                "ok" if predicted[0] == r["calls"] else "DIFFERS")
        else:
            verdict = f"{predicted[0]}, {predicted[1]} " + (
                "ok" if predicted == (r["calls"], r["elements"]) else "DIFFERS")
        lines.append(f"{r['rank']:>4} {r['group']:>5} {r['op']:>10} {r['calls']:>6} "
                     f"{r['elements']:>9} {r['bytes']:>9}  {verdict}")
    if len(lines) == 2:
        lines.append("  (no communication: a mesh of one rank)")
    return lines


def memory_lines(gcfg: GenerateConfig, memory: list[dict]) -> list[str]:
    """The cache's and the parameters' bytes per rank, the cache beside its formula."""
    cfg = gcfg.train
    lines = ["memory per rank: parameters, KV cache (formula 2 x L/pp x B/dp x H/tp x "
             "positions held x dh x itemsize)"]
    for m in memory:
        ok = "ok" if m["cache_bytes"] == m["formula"] else "DIFFERS"
        lines.append(f"  rank {m['rank']}: parameters {m['parameter_bytes']} B, cache "
                     f"{m['cache_bytes']} B (formula {m['formula']} {ok})")
    del cfg
    return lines


# ------------------------------------------------------------- outputs
def compare(gcfg: GenerateConfig, full: dict[str, np.ndarray], result: MeshResult
            ) -> tuple[bool, str]:
    """`--check`: the mesh's tokens and logits against `reference` (rank 0)."""
    tokens, logits = reference(gcfg, full)
    same = bool(np.array_equal(tokens, result.tokens))
    abs_diff = float(np.max(np.abs(logits - result.logits)))
    rel = relative_difference(result.logits, logits)
    tolerance = TOLERANCE[gcfg.train.dtype]
    ok = same and rel <= tolerance
    return ok, (f"check against one process (a full forward of every prefix, no cache): "
                f"tokens {'equal' if same else 'DIFFER'} ({tokens.shape[0]} x "
                f"{tokens.shape[1]}); logits max abs {abs_diff:.3e} rel {rel:.3e} -> "
                f"{'OK' if ok else 'MISMATCH'} (tolerance {tolerance:g})")


def dump(folder: Path, gcfg: GenerateConfig, full: dict[str, np.ndarray],
         result: MeshResult) -> None:
    """The `--dump` files (docs/design.md, "Inference"), written by rank 0."""
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "params.npz", **full)
    (folder / "config.json").write_text(json.dumps(gcfg.as_json(), indent=1))
    prompt = [list(gcfg.prompt)] * gcfg.train.batch
    (folder / "tokens.json").write_text(json.dumps(
        {"prompt": prompt, "generated": result.tokens.tolist()}))
    np.savez(folder / "logits.npz", logits=result.logits)


def full_params(cfg: TrainConfig) -> dict[str, np.ndarray]:
    """The full model: the checkpoint's (`--resume`, saved on any mesh) or a seeded one."""
    if cfg.resume:
        from minipar.checkpoint import save_load

        saved = save_load.load(cfg.resume)
        # sigmoid-bias: every block's b (routing.py) beside the parameters, whole
        return {**saved.params, **{name: np.array(b) for name, b in
                                   saved.manifest.get("router_bias", {}).items()}}
    return nn.init_params(cfg.model_config(), cfg.seed, cfg.dtype)


def text_of(ids: np.ndarray) -> str:
    """Byte ids as text (a --data model), undecodable bytes shown as escapes."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="backslashreplace")


# ------------------------------------------------------------- the command
def command(argv: list[str], world: object) -> int:
    """`python -m minipar generate ...` on the ranks of `world`: refuse a bad setting
    (one line from rank 0, exit 2 on every rank, when any rank refuses: one allgather, the
    first communication), generate, report, check."""
    from minipar.comm.collectives import Ledger  # here: comm/collectives.py loads mpi4py.MPI
    from minipar.comm.job import agreed, wait_for_rank0

    rank, size = world.Get_rank(), world.Get_size()
    try:
        args = make_parser().parse_args(argv)
        gcfg, errors = config_from_args(args, size)
        if not errors:
            errors = preflight.output_problems({"--dump": args.dump})
    except ConfigError as error:
        gcfg, errors = None, [str(error)]
    errors = agreed(world, errors, ["generate", *argv])   # any rank's refusal reaches all
    if errors:
        if rank == 0:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            print(f"minipar: error: {errors[0]}{more}", flush=True, file=sys.stderr)
        return 2
    cfg = gcfg.train
    full = full_params(cfg)
    if cfg.timeout and size > 1:   # a rank stuck in one call that long ends the job
        from minipar.comm.job import abort_all

        watchdog.start(cfg.timeout, rank, abort_all)
    mesh = Mesh(cfg.mesh_shape(), world, Ledger())
    try:
        result = generate_on_mesh(gcfg, mesh, full)
    finally:
        watchdog.stop()
    verdict = 0
    if rank == 0:
        prompt = np.asarray(gcfg.prompt)
        for row in range(min(cfg.batch, 4)):
            generated = result.tokens[row]
            line = f"row {row}: {prompt.tolist()} -> {generated.tolist()}"
            if cfg.data is not None:
                line += f"   {text_of(prompt)!r} -> {text_of(generated)!r}"
            print(line, flush=True)
        if args.ledger:
            print("\n".join(ledger_lines(gcfg, result.ledger)), flush=True)
            print("\n".join(memory_lines(gcfg, result.memory)), flush=True)
        if args.dump:
            dump(Path(args.dump), gcfg, full, result)
        if args.check:
            ok, line = compare(gcfg, full, result)
            print(line, flush=True)
            verdict = 0 if ok else 1
        decode = result.seconds[1:]
        print(f"done: {gcfg.new_tokens} new tokens x {cfg.batch} rows on dp={cfg.dp} "
              f"tp={cfg.tp} pp={cfg.pp} cp={cfg.cp}"
              + (f" ep={cfg.ep}" if cfg.model_config().is_moe else "")
              + f"; prefill {1e3 * result.seconds[0]:.2f} ms"
              + (f", decode {1e3 * float(np.median(decode)):.2f} ms per token (median)"
                 if decode else ""), flush=True)
    if args.check:
        wait_for_rank0(world)   # the others asleep while rank 0 reruns it alone
    verdict = world.bcast(verdict, root=0)
    mesh.free()
    return verdict
