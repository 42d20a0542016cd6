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

A save must never leave a checkpoint that loads wrong. In order:

    1. rank 0 removes the old manifest: from here on the folder holds no checkpoint;
    2. every rank writes its shard atomically (temporary file, fsync, rename);
    3. the shards' sha256 checksums go to rank 0, which writes `manifest.json`
       last, atomically. A crash before 3 leaves no manifest: nothing loads.

Loading checks the manifest and every checksum first, on every rank alone and
before any communication (`verify`): a missing, truncated or tampered file is
one clear error line, never a traceback. The layout follows sharded checkpoints
such as PyTorch's Distributed Checkpoint (a global manifest, per-rank shards
described in global coordinates, replicas written once).

    mpiexec -n 2 python -m minipar train --dp 2 --optimizer adam --lr 0.003 --steps 2 \
        --save ckpt
    mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --optimizer adam --lr 0.003 \
        --steps 4 --resume ckpt --check
    python -m minipar reshard ckpt full        # one file holding the full state (reshard.py)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minipar import nn
from minipar.config import TrainConfig
from minipar.mesh import Mesh
from minipar.optim import Optimizer
from minipar.shards import held_parts

if TYPE_CHECKING:  # data_parallel.py loads mpi4py.MPI; checking a checkpoint needs none
    from minipar.comm import Group
    from minipar.parallel.data_parallel import Updater

FORMAT = "minipar-checkpoint/1"
MANIFEST = "manifest.json"
# What must match between the checkpoint and the run resuming it: the parameter shapes,
# the optimizer (its state slots), and the dtype (equal to the last bit after resuming).
MUST_MATCH = ("model", "layers", "d_in", "d_model", "d_ff", "classes", "experts",
              "expert_d_ff", "optimizer", "dtype")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line naming the folder."""


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
def fsync_folder(folder: Path) -> None:
    """Make a rename inside `folder` durable (the directory entry itself is data)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new, never half."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())     # the bytes are on disk before a name points at them
    os.replace(temporary, path)       # atomic on POSIX: readers see the old or the new file
    fsync_folder(path.parent)


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
    """The last file of a save: what was saved, from which mesh, and every shard's checksum.
    Shard files of an earlier save that this one does not list, and temporary files of
    a save that crashed, are removed after it."""
    saved_config = {k: v for k, v in cfg.as_json().items() if k not in ("save", "resume")}
    manifest = {
        "format": FORMAT, "step": step, "optimizer_t": optimizer_t,
        "losses": list(losses),  # steps 1..step: a resumed run reports all S of them
        "mesh": {"world": len(entries), "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
                 "ep": cfg.ep, "virtual": cfg.virtual},
        "config": saved_config,
        "shapes": {k: list(v) for k, v in nn.canonical_shapes(cfg.model_config()).items()},
        "files": {e["file"]: {k: e[k] for k in ("rank", "bytes", "sha256")} for e in entries},
    }
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    for stale in [*folder.glob("shard-*.npz"), *folder.glob(".shard-*.tmp-*")]:
        if stale.name not in manifest["files"]:
            stale.unlink()


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
         optimizer: Optimizer, step: int, losses: Sequence[float] = ()) -> None:
    """Save this rank's params and optimizer state; a collective over `mesh.world`.

    `updater.checkpoint_pieces()` says what this rank holds: plain data parallelism its
    parameters and the optimizer's state for each; ZeRO the boxes of the full arrays its
    one flat slice covers (zero.py). Order of events (the module docstring): old
    manifest gone, shards, manifest.
    """
    folder, world = Path(folder), mesh.world
    if world.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)   # from now on nothing here loads
    world.Barrier()  # no shard is replaced while an old manifest could still vouch for it
    params, held = updater.checkpoint_pieces()
    mine = pieces_to_write(world, params)
    state = {slot: [values[i] for i in mine] for slot, values in held.items()}
    meta = {"step": step, "coords": mesh.coords,
            "mesh": {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "ep": cfg.ep}}
    entry = write_shard(folder, world.rank, world.size, [params[i] for i in mine], state, meta)
    # every shard's checksum -> rank 0; when it has them all, every shard is on disk
    entries = world.gather(entry)
    if world.rank == 0:
        write_manifest(folder, cfg, step, optimizer.t, entries, losses)
    world.Barrier()  # nobody goes on (or resumes from it) before the manifest is there


# ------------------------------------------------------------- reading
def read_manifest(folder: Path) -> dict:
    """The manifest, with its shape checked; raises CheckpointError if absent or corrupt."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (not a checkpoint, or its save "
                              "never finished)")
    try:
        manifest = json.loads(path.read_text())
        if manifest["format"] != FORMAT:
            raise ValueError(f"format {manifest['format']!r}, expected {FORMAT!r}")
        int(manifest["step"]), int(manifest["optimizer_t"]), dict(manifest["config"])
        if not manifest["files"] or not manifest["shapes"]:
            raise ValueError("no shard files listed")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{folder}: {MANIFEST} is corrupt ({error})") from None
    return manifest


def verify(folder: str | Path) -> list[str]:
    """Every reason the checkpoint in `folder` cannot be trusted; empty if it can.

    Reads the manifest and every shard, compares sizes and sha256 checksums, and
    checks each shard says the same step as the manifest. No communication: every
    rank runs it alone and reaches the same verdict.
    """
    folder = Path(folder)
    try:
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
        elif _shard_meta(data)["step"] != manifest["step"]:
            out.append(f"{folder}: shard {name} is from another step than {MANIFEST}")
    return out


def _shard_meta(data: bytes) -> dict:
    with np.load(io.BytesIO(data), allow_pickle=False) as shard:
        return json.loads(shard["meta"].item())


def load(folder: str | Path) -> Checkpoint:
    """Assemble the full canonical params and optimizer state from every shard.

    Each piece is written into its place (`full[name][full_index] = data`); a
    replica lands on the same place with the same values. Every element of every
    array must be covered by some shard, or the checkpoint is refused.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    dtype = np.dtype(manifest["config"]["dtype"])
    shapes = {name: tuple(shape) for name, shape in manifest["shapes"].items()}
    params = {name: np.zeros(shape, dtype) for name, shape in shapes.items()}
    covered = {name: np.zeros(shape, bool) for name, shape in shapes.items()}
    state: dict[str, dict[str, np.ndarray]] = {}
    for name in sorted(manifest["files"]):
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
        out += [f"--save {message}" for message in folder_problems(Path(cfg.save))]
    if cfg.resume:
        errors = verify(cfg.resume)
        if errors:
            return out + [f"--resume {errors[0]}"]
        out += [f"--resume {cfg.resume}: {m}" for m in mismatches(read_manifest(
            Path(cfg.resume)), cfg)]
    return out


def folder_problems(folder: Path) -> list[str]:
    """Why a checkpoint cannot be written to `folder` (not a folder, not writable)."""
    if folder.exists() and not folder.is_dir():
        return [f"{folder}: exists and is not a folder"]
    parent = folder
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        return [f"{folder}: {parent} is not writable"]
    return []


def mismatches(manifest: dict, cfg: TrainConfig) -> list[str]:
    """The flags that must equal the checkpoint's and do not, and a --steps too small."""
    saved = manifest["config"]
    out = [f"saved with --{name.replace('_', '-')} {saved.get(name)}, this run has "
           f"{getattr(cfg, name)} (they must match)"
           for name in MUST_MATCH if saved.get(name) != getattr(cfg, name)]
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
    elif fields.get("schedule") in ("zb-v", "dualpipev") and fields.get("pp", 1) == 1:
        fields["schedule"] = "1f1b"  # a V needs a pipeline; one stage runs any order
    known = set(TrainConfig.__dataclass_fields__)
    return TrainConfig(**{k: v for k, v in fields.items() if k in known})
