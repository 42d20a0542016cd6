"""The checkpoint on disk: one shard per rank in the model's own words, and a manifest.

What this file teaches: a checkpoint is written in the model's own words, not the
mesh's. Every rank writes what it holds as (canonical name, `full_index` = which
part of the full array, the data, Adam's m and v for that part), so a file means
the same thing whatever mesh wrote it. ZeRO's one flat slice of all its parameters
cuts them mid-row; it is saved as boxes of the full arrays (the end of one row, whole
rows, the start of another: `shards.flat_boxes`), so its shards read like any other.

    DIR/step-000004/shard-00000-of-00004.npz   rank 0's pieces: "{i}.data", "{i}.m", ...,
                                               and `meta` (JSON: each piece's name, index)
    DIR/step-000004/manifest.json              the format, the step, the mesh, the config,
                                               every array's shape, every shard's sha256,
                                               and the manifest's own sha256 (`seal`)

The manifest is the last file a save writes (checkpoint/save_load.py says in which order, and
checkpoint/step_folders.py how the step folders, `latest` and the lock keep a failed save
harmless). Reading it back checks everything before anything is used (`verify`): the
manifest's own checksum, its structure, the shapes its config implies, and every
shard's size, checksum, step, and each array's dtype and shape, on every rank alone
and before any communication, so a missing, truncated, tampered or hand-edited file
is one clear error line, never a traceback. The layout follows sharded checkpoints
such as PyTorch's Distributed Checkpoint and Megatron-LM's (a global manifest,
per-rank shards described in global coordinates, replicas written once, one folder
per saved step).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from minipar.checkpoint import owner
from minipar.checkpoint import step_folders as folders
from minipar.checkpoint.step_folders import atomic_write
from minipar.core import nn
from minipar.core.data import corpus_digest
from minipar.settings.config import TrainConfig

FORMAT = "minipar-checkpoint/1"
MANIFEST = "manifest.json"


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line naming the folder."""



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
                   entries: list[dict], losses: Sequence[float] = (),
                   router_bias: dict | None = None, run: str | None = None,
                   loss_scaler: dict | None = None) -> None:
    """The last file of a save: what was saved, from which mesh, every shard's checksum,
    which run and model it belongs to (checkpoint/owner.py: `run` None draws a new id),
    and the manifest's own checksum (`seal`), so a hand edit of any field is caught.
    `router_bias`: the sigmoid-bias router's b of every block by name (routing.py), not
    a parameter and replicated everywhere, so kept whole here (JSON floats read back
    bit for bit). `loss_scaler`: --mixed's S and its counts (precision.LossScaler.state),
    the same on every rank."""
    saved_config = {k: v for k, v in cfg.as_json().items() if k not in RUN_ONLY}
    shapes = nn.canonical_shapes(cfg.model_config())
    manifest = {
        "format": FORMAT, "step": step, "optimizer_t": optimizer_t,
        "run": run or owner.new_run_id(), "model": owner.model_id(cfg.model, shapes),
        "losses": list(losses),  # steps 1..step: a resumed run reports all S of them
        "mesh": {"world": len(entries), "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
                 "ep": cfg.ep, "virtual": cfg.virtual, "cp": cfg.cp},
        "config": saved_config,
        # --data by its contents: the same file spelled another way is the same data
        "data_sha256": corpus_digest(cfg.data) if cfg.data else None,
        "shapes": {k: list(v) for k, v in shapes.items()},
        "files": {e["file"]: {k: e[k] for k in ("rank", "bytes", "sha256")} for e in entries},
    }
    if router_bias:
        manifest["router_bias"] = {name: [float(x) for x in np.asarray(value)]
                                   for name, value in sorted(router_bias.items())}
    if loss_scaler is not None:
        manifest["loss_scaler"] = loss_scaler
    atomic_write(folder / MANIFEST, json.dumps(seal(manifest), indent=1).encode())


def seal(manifest: dict) -> dict:
    """`manifest` with its own sha256 (of its canonical JSON without that field) added."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return dict(body, sha256=hashlib.sha256(text.encode()).hexdigest())


# Flags of one run, not of the model or the training: not kept in the manifest.
RUN_ONLY = ("save", "resume", "keep", "timeout", "trace")


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
        raise CheckpointError(f"{folder}: {MANIFEST} is corrupt ({str(error)[:120]})") from None
    except RecursionError:   # JSON nested thousands deep: no manifest looks like that
        raise CheckpointError(f"{folder}: {MANIFEST} is corrupt (nested too deep)") from None
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
                    shard_problems(io.BytesIO(data), manifest)[:1]]
    if not out:
        out += [f"{folder}: {problem}" for problem in coverage_problems(folder, manifest)]
    return out


def coverage_problems(folder: Path, manifest: dict) -> list[str]:
    """Whether the shards together hold every element of every array (a manifest resealed
    without one shard lists only intact files, yet leaves a hole): read from each shard's
    `meta`, no array loaded."""
    covered = {name: np.zeros(shape, bool) for name, shape in manifest["shapes"].items()}
    for name in sorted(manifest["files"]):
        with np.load(folder / name, allow_pickle=False) as shard:
            for piece in json.loads(shard["meta"].item())["pieces"]:
                covered[piece["name"]][decode_index(piece["index"])] = True
    missing = [name for name, mask in covered.items() if not mask.all()]
    return [f"no shard holds all of {missing[0]} ({len(missing)} arrays incomplete)"
            ] if missing else []


def _array_header(shard: np.lib.npyio.NpzFile, key: str) -> tuple[np.dtype, tuple, int]:
    """(dtype, shape, bytes stored) of one array of an open .npz, read from its npy header
    alone: a header claiming 186 TiB is refused before anything is allocated."""
    info = shard.zip.getinfo(f"{key}.npy")
    with shard.zip.open(info) as handle:
        version = np.lib.format.read_magic(handle)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read(handle)
    return dtype, shape, info.file_size


def shard_problems(source: object, manifest: dict) -> list[str]:
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
                    kind, shape, stored = _array_header(shard, key)
                    if kind != dtype or tuple(shape) != box:
                        return [f"holds {piece['name']} ({key}) as {kind} "
                                f"{list(shape)}, the manifest says {dtype} {list(box)}"]
                    if stored < math.prod(box) * dtype.itemsize:
                        return [f"holds {piece['name']} ({key}) in {stored} bytes, fewer "
                                "than its shape needs"]
                    if not np.isfinite(shard[key]).all():   # NaN or inf: no run resumes
                        return [f"holds NaN or infinite numbers in {piece['name']} ({key})"]
    except (ValueError, KeyError, TypeError, IndexError, OSError, AttributeError) as error:
        return [f"cannot be read ({type(error).__name__}: {str(error)[:80]})"]
    except RecursionError:
        return ["cannot be read (its meta is nested too deep)"]
    return []


# ------------------------------------------- the saved run, on another mesh
def config_for(manifest: dict, **mesh: int) -> TrainConfig:
    """The saved run's config with another mesh (`dp=.., tp=.., pp=.., ep=.., virtual=..`);
    `--steps` is the checkpoint's step (the total so far)."""
    microbatches = mesh.pop("microbatches", None)
    fields = dict(manifest["config"], steps=int(manifest["step"]), zero=0, **mesh)
    # how the new mesh lays out what it holds, not what was saved: derived again for it
    fields["vocab_parallel"] = None                       # its default for the new tp
    fields["sp"] = bool(fields.get("sp")) and fields.get("tp", 1) > 1
    if microbatches is not None:
        fields["microbatches"] = microbatches
    if fields.get("virtual", 1) > 1:
        fields["schedule"] = "interleaved"
    elif fields.get("schedule") in ("zb-v", "dualpipev", "dualpipe") \
            and fields.get("pp", 1) == 1:
        fields["schedule"] = "1f1b"  # a V needs a pipeline; one stage runs any order
    known = set(TrainConfig.__dataclass_fields__)
    return TrainConfig(**{k: v for k, v in fields.items() if k in known})


def for_mesh(cfg: TrainConfig) -> TrainConfig:
    """`cfg` (resolved) with the flags its mesh needs and the checkpoint does not fix,
    derived: the interleaved schedule takes microbatches in groups of pp, so M becomes
    the smallest multiple of pp that splits each dp rank's rows (M changes no saved
    number: it only orders the work of a step)."""
    if cfg.pp > 1 and cfg.schedule == "interleaved" and cfg.microbatches % cfg.pp:
        rows = cfg.batch // cfg.dp
        fits = [m for m in range(cfg.pp, rows + 1, cfg.pp) if rows % m == 0]
        if fits:
            return replace(cfg, microbatches=fits[0])
    return cfg
