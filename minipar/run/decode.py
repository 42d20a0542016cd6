"""Inference on the training meshes, prefill then decode: what each rank does and sends.

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

`reference` is the one process doing the slowest correct thing: a full forward of the
whole prefix, no cache, at every step; `decode_ledger` and `decode_cache_bytes` are the
formulas the mesh's ledger and cache are held to. The command around it (flags,
refusals, `--check`, `--ledger`, `--dump`) is generate.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from minipar.comm.mesh import Mesh
from minipar.compose import parallelize
from minipar.core import autograd, gpt, nn
from minipar.parallel import kvcache
from minipar.settings.config import TrainConfig

PAIR = np.dtype([("value", np.float64), ("index", np.int32)], align=True)  # MPI DOUBLE_INT


# ------------------------------------------------------- what to generate
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
