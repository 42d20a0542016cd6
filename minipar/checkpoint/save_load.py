"""Checkpoints that move between meshes: save the sharded state, load it on any mesh.

What this file teaches: a checkpoint is written in the model's own words, not the
mesh's. Every rank writes what it holds as (canonical name, `full_index` = which
part of the full array, the data, Adam's m and v for that part), so a file means
the same thing whatever mesh wrote it. Loading never needs the old mesh: every
rank reads all the shards, puts each piece into place in the *full* canonical
arrays, and then builds its model from that full dict exactly as at init (each
module keeps its slice), slicing Adam's m and v with each parameter's
`full_index`. So dp=2 can save and tp=2 x pp=2 can resume, and training goes on
as if it had never stopped: the step count comes along, and the data of step s
depends on (seed, s) only. (Every rank reading every shard is wasteful at scale,
as drawing the full model at init is; here it keeps loading to one code path.)

ZeRO keeps no per-parameter optimizer state: rank i of dp holds one flat slice
of all its parameters, m and v. It saves that slice as boxes of the full arrays, so
its shards read like any other; resuming, each rank cuts its own flat slice out of
the full m and v (zero.py, `Zero1.slice_state`). What the files hold and how they
are checked: checkpoint/shard_files.py.

A save must never destroy the checkpoint it would replace: each save goes to
a new step folder inside `--save DIR`, and `DIR/latest` is switched to it only
once it is complete and verified (checkpoint/step_folders.py). In order:

    1. rank 0 makes a staging folder (DIR/.staging-...) nothing points at;
    2. every rank writes its shard there atomically (temporary file, fsync, rename);
       a rank that cannot (a full disk) says so, and every rank learns it;
    3. rank 0 writes `manifest.json` (every shard's sha256, and its own), reads
       the whole folder back (`verify`), renames it to DIR/step-NNNNNN and
       replaces DIR/latest atomically; older step folders beyond --keep go.

A crash anywhere before the last rename leaves `latest` where it was.

Loading checks the manifest and every shard first, on every rank alone and before
any communication (shard_files.verify): a missing, truncated, tampered or
hand-edited file is one clear error line, never a traceback. Saving and loading are
this file; the format is checkpoint/shard_files.py, the folders and the lock
checkpoint/step_folders.py.

    mpiexec -n 2 python -m minipar train --dp 2 --optimizer adam --lr 0.003 --steps 2 \
        --save ckpt
    mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --optimizer adam --lr 0.003 \
        --steps 4 --resume ckpt --check
    python -m minipar reshard ckpt full        # one file holding the full state (reshard.py)
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minipar.checkpoint import owner
from minipar.checkpoint import step_folders as folders

# the format, under the names callers use (save_load.write_shard, save_load.write_manifest, ...)
from minipar.checkpoint.shard_files import (
    CheckpointError,
    decode_index,
    encode_index,
    read_manifest,
    resolve,
    shard_problems,
    verify,
    write_manifest,
    write_shard,
)
from minipar.comm.mesh import Mesh
from minipar.core import nn
from minipar.core.data import corpus_digest
from minipar.core.optim import Optimizer
from minipar.core.shards import held_parts
from minipar.settings.config import TrainConfig

if TYPE_CHECKING:  # dp_updater.py loads mpi4py.MPI; checking a checkpoint needs none
    from minipar.comm.collectives import Group
    from minipar.parallel.dp_updater import Updater


class FolderInUseError(CheckpointError):
    """Another live job holds the lock of the --save folder: a bad setting (exit 2)."""


@dataclass
class Checkpoint:
    """A loaded checkpoint in canonical form: full arrays, whatever mesh saved them."""

    step: int                                  # steps taken; the next one has this index
    params: dict[str, np.ndarray]              # canonical name -> full array
    state: dict[str, dict[str, np.ndarray]]    # optimizer slot ("m", "v") -> name -> full
    optimizer_t: int                           # the optimizer's own step count (Adam's t)
    manifest: dict



# ------------------------------------------------------------- saving
def pieces_to_write(world: Group, params: Sequence[nn.Parameter]) -> list[int]:
    """Which of this rank's params it writes: a replica (the same name and index on several
    ranks, e.g. over dp) is written once, by the lowest rank holding it."""
    keys = [json.dumps([p.name, encode_index(p.full_index)]) for p in params]
    # every rank's list of piece keys (small Python objects) -> every rank
    everyone = world.allgather(keys)
    first: dict[str, int] = {}
    for rank, rank_keys in enumerate(everyone):
        for key in rank_keys:
            first.setdefault(key, rank)
    return [i for i, key in enumerate(keys) if first[key] == world.rank]


def save(folder: str | Path, cfg: TrainConfig, mesh: Mesh, updater: Updater,
         optimizer: Optimizer, step: int, losses: Sequence[float] = (),
         keep: int = 2, router_bias: dict | None = None, run: str | None = None,
         loss_scaler: dict | None = None) -> str:
    """Save this rank's params and optimizer state as a new step folder of `folder`; a
    collective over `mesh.world`. Returns the step folder's name on every rank. `run` is
    the id of the run this continues (`continued_run`); None draws a new one.

    `updater.checkpoint_pieces()` says what this rank holds: plain data parallelism its
    parameters and the optimizer's state for each; ZeRO the boxes of the full arrays its
    one flat slice covers (zero.py). Order of events (the module docstring): staging
    folder, shards, manifest, verify,
    switch. A failure anywhere raises CheckpointError on every rank, the previous
    checkpoint untouched. `router_bias` (rank 0's): every block's b, into the manifest;
    `loss_scaler` (--mixed): S and its counts, into the manifest (the parameters saved
    are the masters: the updater's pieces under --mixed).
    """
    root, world = Path(folder), mesh.world
    held_before = root in folders._HELD
    plan = _start_save(root, step) if world.rank == 0 else None
    # (the staging folder, the lock's token) or an error -> every rank
    staging, token, error = world.bcast(plan)
    if error:
        raise CheckpointError(f"--save {error}")
    params, held = updater.checkpoint_pieces()
    mine = pieces_to_write(world, params)
    state = {slot: [values[i] for i in mine] for slot, values in held.items()}
    meta = {"step": step, "coords": mesh.coords,
            "mesh": {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "ep": cfg.ep, "cp": cfg.cp}}
    try:
        entry, error = write_shard(Path(staging), world.rank, world.size,
                                   [params[i] for i in mine], state, meta), None
    except OSError as failure:   # a full disk, a folder gone: the others must hear of it
        entry, error = None, f"rank {world.rank} could not write its shard ({failure.strerror})"
    # every shard's checksum (or why it is missing) -> rank 0: then every shard is on disk
    entries = world.gather((entry, error))
    outcome = None
    if world.rank == 0:
        outcome = _finish_save(root, Path(staging), token, cfg, step, optimizer.t, entries,
                               losses, keep, held_before, router_bias, run, loss_scaler)
    # the published step folder, or why the save failed -> every rank
    name, error = world.bcast(outcome)
    if error:
        raise CheckpointError(f"--save {root}: {error}; the previous checkpoint is kept")
    return name


@contextlib.contextmanager
def holding(world: object, folder: str | None) -> Iterator[None]:
    """Hold the lock of `folder` (on rank 0) for the whole block; a collective over the
    raw `world` communicator. Raises CheckpointError on every rank when another live job
    holds it: two jobs saving into one folder are refused before the first step."""
    if not folder:
        yield
        return
    error = None
    if world.Get_rank() == 0:
        try:
            folders.acquire(Path(folder))
        except (folders.FolderError, OSError) as failure:
            error = f"--save {failure}"
    error = world.bcast(error, root=0)   # the lock's verdict -> every rank
    if error:
        raise FolderInUseError(error)
    try:
        yield
    finally:
        if world.Get_rank() == 0:
            folders.release(Path(folder))


def _start_save(root: Path, step: int) -> tuple[str | None, str | None, str | None]:
    """Rank 0: the lock (if the job does not hold it already) and an empty staging folder."""
    try:
        token = folders.acquire(root)
        staging = folders.staging_folder(root, step, token)
        staging.mkdir()
    except folders.FolderError as error:
        return None, None, str(error)
    except OSError as error:
        return None, None, f"{root}: cannot make a folder there ({error.strerror})"
    return str(staging), token, None


def _finish_save(root: Path, staging: Path, token: str, cfg: TrainConfig, step: int,
                 optimizer_t: int, entries: list, losses: Sequence[float], keep: int,
                 held_before: bool, router_bias: dict | None = None,
                 run: str | None = None, loss_scaler: dict | None = None
                 ) -> tuple[str | None, str | None]:
    """Rank 0: the manifest, a full read-back, the switch of `latest`; on any failure the
    staging folder is removed and `latest` stays. Returns (step folder, error)."""
    try:
        errors = [error for _, error in entries if error]
        if not errors:
            write_manifest(staging, cfg, step, optimizer_t, [e for e, _ in entries], losses,
                           router_bias, run, loss_scaler)
            errors = verify(staging)
        if not errors:
            return folders.publish(root, staging, step, token, keep), None
        return None, errors[0]
    except folders.FolderError as error:
        return None, str(error)
    except OSError as error:
        return None, f"could not finish the save ({error.strerror})"
    finally:
        shutil.rmtree(staging, ignore_errors=True)   # published: already renamed away
        if not held_before:
            folders.release(root)


# ------------------------------------------------------------- loading
def load(folder: str | Path) -> Checkpoint:
    """Assemble the full canonical params and optimizer state from every shard.

    Each piece is written into its place (`full[name][full_index] = data`); a
    replica lands on the same place with the same values. Every element of every
    array must be covered by some shard, or the checkpoint is refused. `verify`
    has checked each array's dtype and shape against the manifest.
    """
    folder = resolve(Path(folder))
    manifest = read_manifest(folder)
    dtype = np.dtype(manifest["config"]["dtype"])
    shapes = {name: tuple(shape) for name, shape in manifest["shapes"].items()}
    params = {name: np.zeros(shape, dtype) for name, shape in shapes.items()}
    covered = {name: np.zeros(shape, bool) for name, shape in shapes.items()}
    state: dict[str, dict[str, np.ndarray]] = {}
    for name in sorted(manifest["files"]):
        problems_here = shard_problems(folder / name, manifest)
        if problems_here:
            raise CheckpointError(f"{folder}: shard {name} {problems_here[0]}")
        with np.load(folder / name, allow_pickle=False) as shard:
            meta = json.loads(shard["meta"].item())
            for slot in meta["slots"]:
                state.setdefault(slot, {k: np.zeros(s, dtype) for k, s in shapes.items()})
            for i, piece in enumerate(meta["pieces"]):
                where = decode_index(piece["index"])
                params[piece["name"]][where] = shard[f"{i}.data"]
                for slot in meta["slots"]:
                    state[slot][piece["name"]][where] = shard[f"{i}.{slot}"]
                covered[piece["name"]][where] = True
    missing = [name for name, mask in covered.items() if not mask.all()]
    if missing:
        raise CheckpointError(f"{folder}: no shard holds all of {missing[0]} "
                              f"({len(missing)} arrays incomplete)")
    return Checkpoint(int(manifest["step"]), params, state, int(manifest["optimizer_t"]),
                      manifest)

def restore_optimizer(optimizer: Optimizer, params: Sequence[nn.Parameter],
                      saved: Checkpoint, updater: Updater | None = None) -> int:
    """Hand the optimizer this rank's slice of the saved state: the `updater`'s
    `slice_state` (ZeRO: its flat slice), or without one Adam's m and v cut with each
    param's `full_index`, as the params themselves were cut at build time. Returns the
    step to start from."""
    if updater is not None:
        cut = updater.slice_state
    else:
        def cut(full: dict[str, np.ndarray]) -> list[np.ndarray]:
            return held_parts(params, full)
    optimizer.t = saved.optimizer_t
    if saved.state:   # Adam: m and v per slot of what optim.Adam is handed at each step
        optimizer.m = cut(saved.state["m"])
        optimizer.v = cut(saved.state["v"])
    return saved.step


# --------------------------------------------------- refusing, before any communication
def problems(cfg: TrainConfig) -> list[str]:
    """Why `--save` / `--resume` cannot work with `cfg` (resolved); empty if they can.
    Reads files but never communicates: every rank reaches the same verdict alone."""
    out = []
    if cfg.save:
        # (whether another job holds the folder's lock is asked once, by rank 0, in
        # `holding`: here rank 1 could see the lock its own rank 0 just took)
        out += [f"--save {message}" for message in folder_problems(Path(cfg.save))]
    if cfg.resume:
        from minipar.settings.preflight import path_problems  # the same layer

        errors = path_problems(cfg.resume) or verify(cfg.resume)
        if errors:
            return out + [f"--resume {errors[0]}"]
        out += [f"--resume {cfg.resume}: {m}" for m in mismatches(read_manifest(
            Path(cfg.resume)), cfg)]
    if cfg.save and not out:   # the folder must hold only this run's older steps
        out += owner.ownership_problems(cfg.save, continued_run(cfg.resume) or owner.NEW_RUN,
                                        model_of(cfg), cfg.steps)
    return out


# ------------------------------------------------- --outer diloco: K + 1 checkpoints
def diloco_folders(root: str | Path, workers: int) -> dict[str, Path]:
    """Where an --outer diloco checkpoint `root` keeps its parts, each an ordinary
    checkpoint (written and read by the functions above): "outer" (theta as the
    parameters, the outer momentum as the slot "v"; saved by worker 0, with the run's own
    flags) and "worker-k" (worker k's parameters and inner optimizer state, with the
    worker's flags: dp 1 and its B/K rows, `config.worker_config`). Whether fragment p
    has taken its first outer step follows from the step count alone."""
    return {"outer": Path(root) / "outer",
            **{f"worker-{k}": Path(root) / f"worker-{k}" for k in range(workers)}}


def diloco_problems(cfg: TrainConfig) -> list[str]:
    """`problems` for an --outer diloco run: each part's (`diloco_folders`) against the
    flags that part was saved with; and a resume with another number of workers refused
    (each worker's inner optimizer state is its own: K of them cannot become K')."""
    from minipar.settings.config import worker_config  # the same layer

    resumed = diloco_folders(cfg.resume, cfg.dp) if cfg.resume else {}
    if cfg.resume:
        outer = resumed["outer"]
        found = verify(outer)
        if found:
            return [f"--resume {cfg.resume}: not an --outer diloco checkpoint ({found[0]})"]
        saved = read_manifest(outer)["config"].get("dp")
        if saved != cfg.dp:
            return [f"--resume {cfg.resume}: saved by {saved} workers (--dp {saved}), this run "
                    f"has --dp {cfg.dp}: each worker's inner optimizer state is its own, so "
                    "DiLoCo resumes with the same --dp (tp, pp and cp may change)"]
    out = []
    worker = worker_config(cfg)
    for name, folder in diloco_folders(cfg.save or cfg.resume, cfg.dp).items():
        here = cfg if name == "outer" else worker   # the flags that part is saved with
        out += problems(replace(here, save=str(folder) if cfg.save else None,
                                resume=str(resumed[name]) if cfg.resume else None))
    return out


def continued_run(resume: str | None) -> str | None:
    """The run id a run resumed from `resume` continues (None: a fresh run, or a checkpoint
    saved before manifests named their run)."""
    if not resume:
        return None
    run = read_manifest(Path(resume)).get("run")
    return run if isinstance(run, str) else None


def model_of(cfg: TrainConfig) -> dict:
    """The manifest's "model" for `cfg` (owner.model_id)."""
    return owner.model_id(cfg.model, nn.canonical_shapes(cfg.model_config()))


def folder_problems(folder: Path) -> list[str]:
    """Why a checkpoint cannot be written to `folder` (preflight.py: not a folder, not
    writable, an empty name)."""
    from minipar.settings.preflight import folder_problems as problems_of  # the same layer

    return problems_of(folder)


# The flags that define the model (parameter shapes, the loss), the data stream and the
# optimizer state: a resumed run with any of them different would not continue the saved
# one. The mesh, --microbatches, --lr and --clip-grad-norm may change.
MUST_MATCH = ("model", "layers", "d_in", "d_model", "d_ff", "classes", "experts",
              "expert_d_ff", "top_k", "capacity_factor", "aux_coef", "batch", "seed",
              "optimizer", "dtype", "vocab", "seq_len", "heads", "data", "documents",
              "shared_experts", "router", "mixed", "outer", "inner_steps", "fragments",
              "outer_lr", "outer_momentum")


def _number(value: object) -> str:
    """65536 for 65536.0; anything that is not a number as Python shows it."""
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else repr(value)


def _disagreement(name: str, saved: object, mine: object) -> str:
    """One flag that must match the checkpoint's and does not, said with the flag's own
    spelling: "saved with --mixed fp16, this run has --mixed bf16", or "saved without
    --mixed, this run has --mixed bf16" for a flag left out (None)."""
    flag = f"--{name.replace('_', '-')}"
    said = f"without {flag}" if saved is None else f"with {flag} {saved}"
    has = f"no {flag}" if mine is None else f"{flag} {mine}"
    return f"saved {said}, this run has {has} (they must match)"


def mismatches(manifest: dict, cfg: TrainConfig) -> list[str]:
    """The flags that must equal the checkpoint's and do not, and a --steps too small."""
    saved = manifest["config"]
    out = [_disagreement(name, saved[name], getattr(cfg, name))
           for name in MUST_MATCH if name in saved and saved[name] != getattr(cfg, name)
           and not (name == "data" and saved[name] and cfg.data and "data_sha256" in manifest)]
    scaler = manifest.get("loss_scaler")
    if cfg.mixed == "fp16" and saved.get("mixed") == "fp16" and isinstance(scaler, dict):
        # S and its window continue from the checkpoint (train.py): another value would
        # be ignored without a word
        for name in ("loss_scale", "loss_scale_window"):
            if name in saved and saved[name] != getattr(cfg, name):
                now = f", S {_number(scaler.get('scale'))} now" if name == "loss_scale" \
                    else ""
                out.append(f"--{name.replace('_', '-')} {_number(getattr(cfg, name))} would "
                           f"be ignored: the checkpoint's loss scaling continues (saved with "
                           f"--{name.replace('_', '-')} {_number(saved[name])}{now}); give "
                           "the saved value")
    if cfg.data and saved.get("data") and isinstance(manifest.get("data_sha256"), str) \
            and corpus_digest(cfg.data) != manifest["data_sha256"]:   # by content, not path
        out.append(f"--data {cfg.data}: its bytes differ from the file the checkpoint was "
                   f"trained on ({saved['data']}, sha256 {manifest['data_sha256'][:12]}...): "
                   "the run would not continue the saved one")
    if cfg.steps <= manifest["step"]:
        out.append(f"--steps {cfg.steps} leaves nothing to do after the checkpoint's step "
                   f"{manifest['step']} (--steps is the total: use more than "
                   f"{manifest['step']})")
    return out

