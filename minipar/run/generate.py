"""The `python -m minipar generate` command: its flags, what it refuses, what it reports.

What this file teaches: an inference command on the training meshes reads the training
flags it needs (the model, the mesh, the checkpoint) and refuses the rest by name, with
the model's shape taken from the checkpoint under `--resume`; like `train`, every
rank reaches the same verdict before the first collective. The prefill and decode on
the mesh, and their formulas, are decode.py.

`--check` compares with one process doing the slowest correct thing: a full forward of
the whole prefix, no cache, at every step (float64, 1e-9). `--ledger` prints the last
decode step's calls beside their formula; `--dump DIR` writes params.npz, config.json,
tokens.json and logits.npz (docs/design.md, "Inference").

    python -m minipar generate --prompt-ids 1,2,3 --new-tokens 8 --check
    mpiexec -n 4 python -m minipar generate --tp 2 --pp 2 --batch 2 --temperature 0.8 \
        --prompt-ids 5,6,7,8 --check --ledger
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from minipar.checkpoint import shard_files
from minipar.comm import watchdog
from minipar.comm.mesh import Mesh
from minipar.core import nn
from minipar.run.decode import (
    GenerateConfig,
    MeshResult,
    decode_ledger,
    generate_on_mesh,
    reference,
)
from minipar.run.results import TOLERANCE, relative_difference
from minipar.settings import flags, preflight, validation
from minipar.settings.config import ConfigError, TrainConfig

# ---------------------------------------------------------------- the flags
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
    """`flags.add_train_flags` onto a parser, keeping only `USED_TRAIN_FLAGS`."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_argument(self, *names: str, **options: object) -> None:
        if names[0] in USED_TRAIN_FLAGS:
            self.parser.add_argument(*names, **options)


class _Parser(flags.Parser):
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
    flags.add_train_flags(_UsedFlags(parser))
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
    train_cfg = flags.config_from_args(args)
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
    out = validation.problems(replace(cfg, resume=None, data=None), world_size)
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
    preflight.sign_dump(folder, "generate", ["params.npz", "config.json", "tokens.json",
                                             "logits.npz"])


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
            errors = preflight.dump_problems(args.dump, "generate")
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
