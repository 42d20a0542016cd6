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
of all its parameters, m and v, which cuts parameters mid-row. It saves that
slice as boxes of the full arrays (the end of one row, whole rows, the start of
another: `shards.flat_boxes`), so its shards read like any other; resuming, each rank
cuts its own flat slice out of the full m and v (zero.py, `Zero1.slice_state`).

A save must never destroy the checkpoint it would replace: each save goes to
a new step folder inside `--save DIR`, and `DIR/latest` is switched to it only
once it is complete and verified (checkpoint_folder.py). In order:

    1. rank 0 makes a staging folder (DIR/.staging-...) nothing points at;
    2. every rank writes its shard there atomically (temporary file, fsync, rename);
       a rank that cannot (a full disk) says so, and every rank learns it;
    3. rank 0 writes `manifest.json` (every shard's sha256, and its own), reads
       the whole folder back (`verify`), renames it to DIR/step-NNNNNN and
       replaces DIR/latest atomically; older step folders beyond --keep go.

A crash anywhere before the last rename leaves `latest` where it was.

Loading checks the manifest (its own checksum, its structure, the shapes its
config implies) and every shard (checksum, and each array's dtype and shape)
first, on every rank alone and before any communication (`verify`): a missing,
truncated, tampered or hand-edited file is one clear error line, never a
traceback. The layout follows sharded checkpoints such as PyTorch's Distributed
Checkpoint and Megatron-LM's (a global manifest, per-rank shards described in
global coordinates, replicas written once, one folder per saved step).

    mpiexec -n 2 python -m minipar train --dp 2 --optimizer adam --lr 0.003 --steps 2 \
        --save ckpt
    mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --optimizer adam --lr 0.003 \
        --steps 4 --resume ckpt --check
    python -m minipar reshard ckpt full        # one file holding the full state (reshard.py)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minipar import checkpoint_folder as folders
from minipar import nn
from minipar.checkpoint_folder import atomic_write, fsync_folder  # noqa: F401
from minipar.config import TrainConfig
from minipar.mesh import Mesh
from minipar.optim import Optimizer
from minipar.shards import held_parts

if TYPE_CHECKING:  # data_parallel.py loads mpi4py.MPI; checking a checkpoint needs none
    from minipar.comm import Group
    from minipar.parallel.data_parallel import Updater

FORMAT = "minipar-checkpoint/1"
MANIFEST = "manifest.json"


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line naming the folder."""


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


# ------------------------------------------------ full_index <-> JSON
def encode_index(index: tuple | None) -> list | None:
    """A `full_index` as JSON: a slice becomes [start, stop, step], an int stays."""
    if index is None:
        return None
    def plain(value: object) -> int | None:   # NumPy integers are not JSON
        return None if value is None else int(value)

    return [[plain(part.start), plain(part.stop), plain(part.step)]
            if isinstance(part, slice) else int(part) for part in index]


def decode_index(spec: list | None) -> tuple:
    """The inverse of `encode_index`; `None` (the whole array) becomes `...`."""
    if spec is None:
        return (Ellipsis,)
    return tuple(slice(*part) if isinstance(part, list) else part for part in spec)


# ------------------------------------------------------------- writing
def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.npz"


def write_shard(folder: Path, rank: int, world: int, pieces: Sequence[nn.Parameter],
                state: dict[str, Sequence[np.ndarray]], meta: dict) -> dict:
    """Write one rank's pieces (data and each optimizer slot) atomically to its shard file;
    returns the manifest entry `{"file", "rank", "bytes", "sha256"}`.

    `state[slot][i]` is the optimizer's array for `pieces[i]`. Arrays are stored under
    `"{i}.data"`, `"{i}.m"`, ... and `meta` (JSON) lists each piece's name and index.
    """
    arrays = {}
    for i, p in enumerate(pieces):
        arrays[f"{i}.data"] = p.data
        for slot, values in state.items():
            arrays[f"{i}.{slot}"] = values[i]
    listing = [{"name": p.name, "index": encode_index(p.full_index)} for p in pieces]
    meta = dict(meta, rank=rank, world=world, pieces=listing, slots=sorted(state))
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.array(json.dumps(meta)), **arrays)
    data = buffer.getvalue()
    name = shard_name(rank, world)
    atomic_write(folder / name, data)
    return {"file": name, "rank": rank, "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def write_manifest(folder: Path, cfg: TrainConfig, step: int, optimizer_t: int,
                   entries: list[dict], losses: Sequence[float] = ()) -> None:
    """The last file of a save: what was saved, from which mesh, every shard's checksum,
    and the manifest's own checksum (`seal`), so a hand edit of any field is caught."""
    saved_config = {k: v for k, v in cfg.as_json().items() if k not in RUN_ONLY}
    manifest = {
        "format": FORMAT, "step": step, "optimizer_t": optimizer_t,
        "losses": list(losses),  # steps 1..step: a resumed run reports all S of them
        "mesh": {"world": len(entries), "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
                 "ep": cfg.ep, "virtual": cfg.virtual, "cp": cfg.cp},
        "config": saved_config,
        "shapes": {k: list(v) for k, v in nn.canonical_shapes(cfg.model_config()).items()},
        "files": {e["file"]: {k: e[k] for k in ("rank", "bytes", "sha256")} for e in entries},
    }
    atomic_write(folder / MANIFEST, json.dumps(seal(manifest), indent=1).encode())


def seal(manifest: dict) -> dict:
    """`manifest` with its own sha256 (of its canonical JSON without that field) added."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return dict(body, sha256=hashlib.sha256(text.encode()).hexdigest())

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
         keep: int = 2) -> str:
    """Save this rank's params and optimizer state as a new step folder of `folder`; a
    collective over `mesh.world`. Returns the step folder's name on every rank.

    `updater.checkpoint_pieces()` says what this rank holds: plain data parallelism its
    parameters and the optimizer's state for each; ZeRO the boxes of the full arrays its
    one flat slice covers (zero.py). Order of events (the module docstring): staging
    folder, shards, manifest, verify,
    switch. A failure anywhere raises CheckpointError on every rank, the previous
    checkpoint untouched.
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
                               losses, keep, held_before)
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
                 held_before: bool) -> tuple[str | None, str | None]:
    """Rank 0: the manifest, a full read-back, the switch of `latest`; on any failure the
    staging folder is removed and `latest` stays. Returns (step folder, error)."""
    try:
        errors = [error for _, error in entries if error]
        if not errors:
            write_manifest(staging, cfg, step, optimizer_t, [e for e, _ in entries], losses)
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


# ------------------------------------------------------------- reading
def read_manifest(folder: Path) -> dict:
    """The manifest of the checkpoint `folder` holds (its `latest` step folder, or a step
    folder itself), checked: its own checksum, its structure, its shapes against its
    config. Raises CheckpointError (one line) if absent, corrupt or edited."""
    folder = resolve(Path(folder))
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
        if seal(manifest)["sha256"] != manifest.get("sha256"):
            raise ValueError("it fails its own sha256 check: edited since saved")
        _check_structure(manifest)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{folder}: {MANIFEST} is corrupt ({error})") from None
    except OSError as error:
        raise CheckpointError(f"{folder}: cannot read {MANIFEST} ({error.strerror})") from None
    return manifest


def resolve(folder: Path) -> Path:
    """The step folder to read: `folder` itself when it holds a manifest (or shards: a
    step folder that lost its manifest), else the one `folder/latest` names."""
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        return folder
    if any(folder.glob("shard-*.npz")):
        raise CheckpointError(f"{folder}: no {MANIFEST} (its save never finished)")
    try:
        return folders.latest(folder)
    except folders.FolderError as error:
        raise CheckpointError(str(error)) from None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_structure(manifest: dict) -> None:
    """Raise ValueError naming the first field of the wrong kind (the checksum vouches for
    the bytes; this vouches that they mean what the loader expects)."""
    if not _is_count(manifest["step"]) or not _is_count(manifest["optimizer_t"]):
        raise ValueError("step and optimizer_t must be counts")
    losses, shapes, files = manifest["losses"], manifest["shapes"], manifest["files"]
    if not isinstance(losses, list) or len(losses) != manifest["step"] or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses):
        raise ValueError(f"losses must be {manifest['step']} numbers, one per step")
    if not isinstance(manifest["config"], dict) or not isinstance(shapes, dict) or not shapes:
        raise ValueError("config and shapes must be objects")
    if not isinstance(files, dict) or not files:
        raise ValueError("files must be an object of shard name -> rank, bytes, sha256")
    for name, entry in files.items():
        if not re.fullmatch(r"shard-\d{5}-of-\d{5}\.npz", name) or not isinstance(
                entry, dict) or not _is_count(entry.get("bytes")) or not _is_count(
                entry.get("rank")) or not isinstance(entry.get("sha256"), str):
            raise ValueError(f"files entry {name[:40]!r} is malformed")
    expected = {k: list(v) for k, v in nn.canonical_shapes(
        config_for(manifest).resolved(1).model_config()).items()}
    if shapes != expected:
        wrong = sorted(k for k in set(shapes) | set(expected)
                       if shapes.get(k) != expected.get(k))
        raise ValueError(f"shapes of {wrong[0]} do not match the saved config")
    if np.dtype(manifest["config"]["dtype"]) not in (np.float64, np.float32):
        raise ValueError(f"dtype {manifest['config']['dtype']!r}")


def verify(folder: str | Path) -> list[str]:
    """Every reason the checkpoint in `folder` cannot be trusted; empty if it can.

    Reads the manifest and every shard, compares sizes and sha256 checksums, and
    checks each shard says the same step as the manifest and holds arrays of the
    manifest's dtype and shapes. No communication: every rank runs it alone and
    reaches the same verdict.
    """
    try:
        folder = resolve(Path(folder))
        manifest = read_manifest(folder)
    except CheckpointError as error:
        return [str(error)]
    out = []
    for name, entry in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            out.append(f"{folder}: shard {name} is missing")
            continue
        data = path.read_bytes()
        if len(data) != entry["bytes"]:
            out.append(f"{folder}: shard {name} has {len(data)} bytes, the manifest says "
                       f"{entry['bytes']} (truncated or overwritten)")
        elif hashlib.sha256(data).hexdigest() != entry["sha256"]:
            out.append(f"{folder}: shard {name} fails its sha256 check (changed since saved)")
        else:
            out += [f"{folder}: shard {name} {problem}" for problem in
                    _shard_problems(io.BytesIO(data), manifest)[:1]]
    return out


def _shard_problems(source: object, manifest: dict) -> list[str]:
    """What in one shard disagrees with the manifest: its step, a name it does not list,
    an array of another dtype or shape than the piece's box of the full array."""
    dtype = np.dtype(manifest["config"]["dtype"])
    try:
        with np.load(source, allow_pickle=False) as shard:
            meta = json.loads(shard["meta"].item())
            if meta["step"] != manifest["step"]:
                return [f"is from another step than {MANIFEST}"]
            for i, piece in enumerate(meta["pieces"]):
                if piece["name"] not in manifest["shapes"]:
                    return [f"holds {piece['name']!r}, which the manifest does not list"]
                full = tuple(manifest["shapes"][piece["name"]])
                box = np.empty(full, np.bool_)[decode_index(piece["index"])].shape
                for key in [f"{i}.data", *(f"{i}.{slot}" for slot in meta["slots"])]:
                    array = shard[key]
                    if array.dtype != dtype or array.shape != box:
                        return [f"holds {piece['name']} ({key}) as {array.dtype} "
                                f"{list(array.shape)}, the manifest says {dtype} {list(box)}"]
    except (ValueError, KeyError, TypeError, IndexError, OSError) as error:
        return [f"cannot be read ({type(error).__name__}: {str(error)[:80]})"]
    return []


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
        problems_here = _shard_problems(folder / name, manifest)
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
        errors = verify(cfg.resume)
        if errors:
            return out + [f"--resume {errors[0]}"]
        out += [f"--resume {cfg.resume}: {m}" for m in mismatches(read_manifest(
            Path(cfg.resume)), cfg)]
    return out


def folder_problems(folder: Path) -> list[str]:
    """Why a checkpoint cannot be written to `folder` (preflight.py: not a folder, not
    writable, an empty name)."""
    from minipar.preflight import folder_problems as problems_of  # the same layer

    return problems_of(folder)


# The flags that define the model (parameter shapes, the loss), the data stream and the
# optimizer state: a resumed run with any of them different would not continue the saved
# one. The mesh, --microbatches and --lr may change.
MUST_MATCH = ("model", "layers", "d_in", "d_model", "d_ff", "classes", "experts",
              "expert_d_ff", "top_k", "capacity_factor", "aux_coef", "batch", "seed",
              "optimizer", "dtype", "vocab", "seq_len", "heads", "data")
# Flags of one run, not of the model or the training: not kept in the manifest.
RUN_ONLY = ("save", "resume", "keep", "timeout")


def mismatches(manifest: dict, cfg: TrainConfig) -> list[str]:
    """The flags that must equal the checkpoint's and do not, and a --steps too small."""
    saved = manifest["config"]
    out = [f"saved with --{name.replace('_', '-')} {saved.get(name)}, this run has "
           f"{getattr(cfg, name)} (they must match)"
           for name in MUST_MATCH if name in saved and saved[name] != getattr(cfg, name)]
    if cfg.steps <= manifest["step"]:
        out.append(f"--steps {cfg.steps} leaves nothing to do after the checkpoint's step "
                   f"{manifest['step']} (--steps is the total: use more than "
                   f"{manifest['step']})")
    return out


# ---------------------------------------------------------- offline reshard
def config_for(manifest: dict, **mesh: int) -> TrainConfig:
    """The saved run's config with another mesh (`dp=.., tp=.., pp=.., ep=.., virtual=..`);
    `--steps` is the checkpoint's step (the total so far)."""
    fields = dict(manifest["config"], steps=int(manifest["step"]), zero=0, **mesh)
    if fields.get("virtual", 1) > 1:
        fields["schedule"] = "interleaved"
    elif fields.get("schedule") in ("zb-v", "dualpipev", "dualpipe") \
            and fields.get("pp", 1) == 1:
        fields["schedule"] = "1f1b"  # a V needs a pipeline; one stage runs any order
    known = set(TrainConfig.__dataclass_fields__)
    return TrainConfig(**{k: v for k, v in fields.items() if k in known})
