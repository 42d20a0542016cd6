"""Checkpoints: sharded saves that load on any other mesh and continue exactly.

Without MPI: the shard files assemble into the full canonical arrays, Adam's
state is sliced like the params, and a truncated, tampered or unfinished
checkpoint is refused. With MPI: 2 steps on one mesh + 2 on another equal 4
steps of one process (float64, relative 1e-9) for every pair of meshes built
in this tree, and `python -m minipar reshard` moves a checkpoint between meshes
without changing a bit.

    python -m pytest tests/checkpoint/test_checkpoint.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from minipar.checkpoint import save_load, shard_files, step_folders
from minipar.core import nn, shards
from minipar.core.optim import Adam
from minipar.settings.config import TrainConfig
from tests.conftest import assert_equivalent, reference
from tests.harness.mpi import minipar, sweep

MODELS = {
    "mlp": {"layers": 4, "d_model": 16, "d_in": 8, "batch": 16, "optimizer": "adam",
            "lr": 0.01, "seed": 3},
    "moe": {"model": "moe", "layers": 4, "d_model": 16, "d_in": 8, "batch": 16,
            "experts": 4, "expert_d_ff": 16, "capacity_factor": 1.0, "optimizer": "adam",
            "lr": 0.01, "seed": 3},
    # 9005 parameters, not divisible by 3 (ZeRO slices 3002, 3002, 3001); a batch of 12
    # splits over dp = 2, 3, 4; with tp=2 the dp=2 slices meet inside a row of fc1
    "odd": {"layers": 4, "d_model": 16, "d_in": 8, "batch": 12, "classes": 13,
            "optimizer": "adam", "lr": 0.01, "seed": 3},
    "gpt": {"model": "gpt", "layers": 2, "d_model": 16, "heads": 2, "seq_len": 8,
            "vocab": 16, "batch": 8, "optimizer": "adam", "lr": 0.01, "seed": 3},
    "gpt-moe": {"model": "gpt-moe", "layers": 2, "d_model": 16, "heads": 2, "seq_len": 8,
                "vocab": 16, "batch": 8, "experts": 4, "expert_d_ff": 16,
                "capacity_factor": 1.0, "optimizer": "adam", "lr": 0.01, "seed": 3},
}
# (model, first mesh, its ranks, second mesh, its ranks): 2 steps on the first, 2 on the
# second.
PAIRS = [
    ("mlp", {"dp": 2}, 2, {"dp": 4}, 4),
    ("mlp", {"dp": 4}, 4, {}, 1),
    ("mlp", {}, 1, {"dp": 2, "microbatches": 2}, 2),
    ("moe", {}, 1, {"dp": 2, "ep": 2}, 2),
    ("moe", {"dp": 4, "ep": 2}, 4, {}, 1),
    ("mlp", {"dp": 2, "tp": 2}, 4, {"tp": 2}, 2),
    ("mlp", {"tp": 2, "sp": True}, 2, {"dp": 2, "tp": 2}, 4),
    ("mlp", {"dp": 2, "pp": 2, "microbatches": 2}, 4, {"pp": 2, "tp": 2}, 4),
    ("mlp", {"pp": 2, "virtual": 2, "schedule": "interleaved", "microbatches": 2}, 2,
     {"dp": 2}, 2),
    ("moe", {"dp": 2, "ep": 2, "pp": 2}, 4, {"dp": 2}, 2),
    # the V placement: rank s saves chunks s and 2pp-1-s, a loop of chunks resumes them
    ("mlp", {"pp": 2, "schedule": "zb-v", "microbatches": 2}, 2,
     {"pp": 2, "virtual": 2, "schedule": "interleaved", "microbatches": 2}, 2),
    ("mlp", {"dp": 2, "pp": 2, "schedule": "dualpipev", "microbatches": 4}, 4,
     {"pp": 2, "schedule": "zb-v", "microbatches": 4}, 2),
    # ZeRO keeps flat slices of the optimizer state (slices cut rows; with tp, of the
    # rank's local columns): saved as boxes of the full arrays, cut again on resume
    ("mlp", {"dp": 4, "zero": 1}, 4, {"dp": 2, "zero": 3}, 2),
    ("mlp", {"dp": 2, "zero": 3}, 2, {}, 1),
    ("odd", {}, 1, {"dp": 3, "zero": 2}, 3),
    ("odd", {"dp": 2, "tp": 2, "zero": 1}, 4, {"dp": 4}, 4),
    # the transformer: ZeRO slices to a pipeline, one process to ZeRO-2 over 4 ranks,
    # experts over ep to experts over ep in a pipeline (M = 1 on both: the MoE statistics
    # are per microbatch, so M is part of its math)
    ("gpt", {"dp": 2, "zero": 1}, 2, {"pp": 2, "microbatches": 2}, 2),
    ("gpt", {}, 1, {"dp": 4, "zero": 2}, 4),
    ("gpt-moe", {"dp": 2, "ep": 2}, 2, {"dp": 2, "ep": 2, "pp": 2}, 4),
    # ZeRO with experts: expert slices over edp, dense slices over dp, Adam's m and v
    ("moe", {"dp": 4, "ep": 2, "zero": 2}, 4, {"dp": 2, "ep": 2, "zero": 3}, 2),
    ("gpt-moe", {"dp": 2, "zero": 3}, 2, {"dp": 4, "ep": 2, "zero": 1}, 4),
    # experts split over tp (their columns and rows as boxes) to ZeRO over experts
    ("moe", {"dp": 2, "ep": 2, "tp": 2}, 4, {"dp": 2, "zero": 2}, 2),
    # lesson 13's recipes: the Llama-like mesh (tp x pp x dp, ZeRO-1) to the DeepSeek-like
    # one (pp x dp with ep over all dp ranks, ZeRO-1, no tp) and back (M = 1, as above)
    ("gpt-moe", {"tp": 2, "pp": 2, "dp": 2, "zero": 1}, 8,
     {"pp": 2, "dp": 4, "ep": 4, "zero": 1}, 8),
    ("gpt-moe", {"pp": 2, "dp": 4, "ep": 4, "zero": 1}, 8,
     {"tp": 2, "pp": 2, "dp": 2, "zero": 1}, 8),
    # context parallelism: every weight replicated over cp (ZeRO slices over dp x cp)
    ("gpt", {"cp": 2, "cp_mode": "ring", "zero": 1}, 2,
     {"dp": 2, "cp": 2, "cp_mode": "ulysses"}, 4),
    ("gpt", {"dp": 2, "cp": 2}, 4, {}, 1),
    ("gpt-moe", {"cp": 2, "cp_mode": "allgather"}, 2, {"dp": 2, "ep": 2}, 2),
    # lesson 13's long-context Llama-like mesh (tp x cp x pp, ZeRO-1 over dp x cp) to the
    # DeepSeek-like one and back
    ("gpt-moe", {"tp": 2, "cp": 2, "pp": 2, "zero": 1, "cp_mode": "allgather"}, 8,
     {"pp": 2, "dp": 4, "ep": 4, "zero": 1}, 8),
    ("gpt-moe", {"pp": 2, "dp": 4, "ep": 4, "zero": 1}, 8,
     {"tp": 2, "cp": 2, "pp": 2, "zero": 1, "cp_mode": "ring"}, 8),
]
RUNNABLE = PAIRS


# ------------------------------------------------------------- without MPI
def small_config() -> TrainConfig:
    return TrainConfig(layers=2, d_model=8, d_in=4, d_ff=12, optimizer="adam").resolved(1)


def two_rank_shards(folder: Path, cfg: TrainConfig) -> dict[str, np.ndarray]:
    """A checkpoint as two tensor-parallel ranks would write it: fc1 weights split by
    columns, everything else on rank 0. Adam's m = 2 p and v = p^2, to tell slots apart."""
    full = nn.init_params(cfg.model_config(), seed=1)
    half = cfg.d_ff // 2
    entries = []
    for rank in range(2):
        pieces = []
        for name, value in full.items():
            if name.endswith("fc1.weight"):
                index = (slice(None), slice(rank * half, (rank + 1) * half))
                pieces.append(nn.Parameter(value[index], name, full_index=index))
            elif rank == 0:
                pieces.append(nn.Parameter(value, name))
        state = {"m": [2 * p.data for p in pieces], "v": [p.data ** 2 for p in pieces]}
        entries.append(shard_files.write_shard(folder, rank, 2, pieces, state, {"step": 3}))
    shard_files.write_manifest(folder, cfg, step=3, optimizer_t=3, entries=entries,
                              losses=[2.5, 2.25, 2.0])
    return full


def test_index_survives_json():
    for index in [None, (slice(None), slice(4, 8)), (slice(np.int64(2), 6),),
                  (3, slice(0, 2, 1))]:
        spec = json.loads(json.dumps(shard_files.encode_index(index)))
        expect = (Ellipsis,) if index is None else index
        assert shard_files.decode_index(spec) == expect


def test_shards_assemble_into_full_arrays_and_slice_for_another_mesh(tmp_path):
    cfg = small_config()
    full = two_rank_shards(tmp_path, cfg)
    assert shard_files.verify(tmp_path) == []
    saved = save_load.load(tmp_path)
    assert saved.step == 3 and saved.optimizer_t == 3
    assert list(saved.params) == list(full)
    for name, value in full.items():
        assert np.array_equal(saved.params[name], value), name
        assert np.array_equal(saved.state["m"][name], 2 * value), name
        assert np.array_equal(saved.state["v"][name], value ** 2), name
    # another mesh: a rank holding the second half of the rows of fc2 (as a row-parallel
    # linear would) gets exactly those rows of the params and of m and v
    name = "blocks.1.fc2.weight"
    index = (slice(cfg.d_ff // 2, cfg.d_ff), slice(None))
    params = [nn.Parameter(saved.params[name][index], name, full_index=index),
              nn.Parameter(saved.params["head.bias"], "head.bias")]
    optimizer = Adam(0.01)
    assert save_load.restore_optimizer(optimizer, params, saved) == 3 and optimizer.t == 3
    assert np.array_equal(optimizer.m[0], 2 * full[name][index])
    assert np.array_equal(optimizer.v[0], full[name][index] ** 2)
    assert np.array_equal(optimizer.m[1], 2 * full["head.bias"])


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), ()])
def test_every_flat_run_is_boxes_in_order(shape):
    """ZeRO's slices are runs of a flattened array: as boxes, read in order, they give
    back exactly the run, in at most 2 ndim - 1 boxes."""
    numbers = np.arange(int(np.prod(shape))).reshape(shape)
    for a in range(numbers.size + 1):
        for b in range(a, numbers.size + 1):
            boxes = shards.flat_boxes(shape, a, b)
            read = [numbers[box].ravel() for box in boxes]
            assert np.array_equal(np.concatenate(read or [[]]), np.arange(a, b)), (a, b)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
    assert shards.flat_boxes((3, 4), 2, 9) == [(slice(0, 1), slice(2, 4)),
                                                   (slice(1, 2), slice(0, 4)),
                                                   (slice(2, 3), slice(0, 1))]


def test_a_box_of_a_tp_shard_lands_in_its_columns_of_the_full_array():
    """A rank holding columns 6:12 of fc1 (its `full_index`): a box of its local array is
    the same rows, columns shifted by 6, of the full one; without tp nothing moves."""
    full = np.arange(8 * 12).reshape(8, 12)
    index = (slice(None), slice(6, 12))
    local = full[index]
    for box in shards.flat_boxes(local.shape, 5, 20):
        assert np.array_equal(full[shards.in_full_array(box, index)], local[box])
    assert shards.in_full_array((slice(1, 3),), (slice(6, 12),)) == (slice(7, 9),)
    assert shards.in_full_array((slice(1, 3),), None) == (slice(1, 3),)


def test_a_shard_missing_from_the_manifest_leaves_arrays_incomplete(tmp_path):
    cfg = small_config()
    two_rank_shards(tmp_path, cfg)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["files"][shard_files.shard_name(1, 2)]
    (tmp_path / "manifest.json").write_text(json.dumps(shard_files.seal(manifest)))
    errors = shard_files.verify(tmp_path)                     # what is listed is intact ...
    assert len(errors) == 1 and "no shard holds all of" in errors[0], errors
    with pytest.raises(shard_files.CheckpointError, match="fc1.weight"):
        save_load.load(tmp_path)                            # ... but half of fc1 is nowhere


def corrupt(folder: Path, how: str) -> None:
    shard = folder / shard_files.shard_name(1, 2)
    manifest = folder / "manifest.json"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "tampered":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
    elif how == "shard missing":
        shard.unlink()
    elif how == "no manifest":
        manifest.unlink()
    elif how == "manifest not json":
        manifest.write_text(manifest.read_text()[:50])
    elif how.startswith("manifest"):   # a hand edit, and the same edit re-sealed
        edit(manifest, how.split(": ")[1], reseal="resealed" in how)


def edit(path: Path, what: str, reseal: bool) -> None:
    """Change one field of a manifest the way a hand edit would; `reseal` recomputes the
    manifest's own checksum, so only the structure and shape checks stand in the way."""
    manifest = json.loads(path.read_text())
    if what == "step":
        manifest["step"] = 2
        manifest["losses"] = manifest["losses"][:2]
    elif what == "optimizer_t":
        manifest["optimizer_t"] = 7
    elif what == "losses":
        manifest["losses"][0] = 0.5
    elif what == "files a list":
        manifest["files"] = list(manifest["files"])
    elif what == "a shape":
        manifest["shapes"]["blocks.0.fc1.weight"] = [8, 13]
    elif what == "the dtype":
        manifest["config"]["dtype"] = "float32"
    elif what == "a file name":
        manifest["files"]["../../etc/passwd"] = manifest["files"].popitem()[1]
    path.write_text(json.dumps(shard_files.seal(manifest) if reseal else manifest))


REFUSALS = {"truncated": "truncated", "tampered": "sha256", "shard missing": "missing",
            "no manifest": "no manifest.json", "manifest not json": "corrupt",
            **{f"manifest: {what}": "edited since saved" for what in (
                "step", "optimizer_t", "losses", "files a list", "a shape", "the dtype")},
            "manifest resealed: step": "another step",
            "manifest resealed: files a list": "files must be an object",
            "manifest resealed: a shape": "shapes of blocks.0.fc1.weight",
            "manifest resealed: the dtype": "as float64",   # the shards hold float64
            "manifest resealed: a file name": "malformed"}


@pytest.mark.parametrize("how", sorted(REFUSALS))
def test_a_damaged_checkpoint_is_refused(tmp_path, how):
    two_rank_shards(tmp_path, small_config())
    corrupt(tmp_path, how)
    errors = shard_files.verify(tmp_path)
    assert errors and REFUSALS[how] in errors[0], errors
    assert all("\n" not in e and e.startswith(str(tmp_path)) for e in errors)


def test_a_damaged_checkpoint_cannot_be_loaded_either(tmp_path):
    two_rank_shards(tmp_path, small_config())
    edit(tmp_path / "manifest.json", "the dtype", reseal=True)
    with pytest.raises(shard_files.CheckpointError, match="as float64"):
        save_load.load(tmp_path)


def test_atomic_write_keeps_the_old_file_when_the_rename_never_happens(tmp_path, monkeypatch):
    target = tmp_path / "file.bin"
    step_folders.atomic_write(target, b"old contents")

    def crash(*args: object) -> None:
        raise OSError("power cut")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        step_folders.atomic_write(target, b"new contents")
    assert target.read_bytes() == b"old contents"


# --------------------------------------------------------------- with MPI
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Every runnable pair: first half saved, a reshard chain, second half resumed.
    One mpiexec job per (phase, rank count); returns {label: (first, second)} dumps."""
    root = tmp_path_factory.mktemp("checkpoints")
    first, second = {}, {}
    for i, (model, mesh_a, n_a, mesh_b, n_b) in enumerate(RUNNABLE):
        folder = str(root / f"pair{i}")
        first.setdefault(n_a, []).append((i, dict(MODELS[model], **mesh_a, steps=2,
                                                  save=folder)))
        second.setdefault(n_b, []).append((i, dict(MODELS[model], **mesh_b, steps=4,
                                                   resume=folder)))
    runs: dict[str, list] = {}
    for phase, jobs in (("first", first), ("second", second)):
        if phase == "second":   # pair 0's checkpoint, resharded: full state, then tp=2
            reshard_chain(root, second)
        for n, items in sorted(jobs.items()):
            dumps = sweep(n, [fields for _, fields in items], root / f"{phase}{n}")
            for (i, _), dump in zip(items, dumps):
                runs.setdefault(i, []).append(dump)
    return root, runs


def reshard_chain(root: Path, second: dict) -> None:
    """pair0 (dp=2) -> one file with the full state -> a tp=2 (or dp=2) checkpoint, and
    a run resumed from it on dp=2 joins the second phase as pair "reshard"."""
    target_mesh = ["--tp", "2"]
    for n, source, destination, flags in ((1, "pair0", "full", []),
                                          (2, "full", "moved", target_mesh)):
        job = minipar(n, ["reshard", str(root / source), str(root / destination), *flags], 60)
        assert job.returncode == 0 and not job.timed_out, job.explain()
    second.setdefault(2, []).append(("reshard", dict(MODELS["mlp"], dp=2, steps=4,
                                                     resume=str(root / "moved"))))


@pytest.mark.parametrize("i", range(len(RUNNABLE)),
                         ids=[f"{m} {a} -> {b}" for m, a, _, b, _ in RUNNABLE])
def test_two_steps_here_and_two_there_equal_four_straight(resumed, i):
    _, runs = resumed
    first, second = runs[i]
    model = RUNNABLE[i][0]
    for name, value in first["final"].items():   # the resumed run starts from the saved bits
        assert np.array_equal(second["init"][name], value), name
    # the resumed run's losses.json holds all S = 4 steps, the first two from the checkpoint
    assert len(first["losses"]) == 2 and len(second["losses"]) == 4
    assert second["losses"][:2] == first["losses"]
    assert_equivalent(second, reference(**MODELS[model], steps=4), label=str(RUNNABLE[i]))
    assert second["config"]["resume"] and first["config"]["save"]   # --dump shows the flags


def saved_pieces(folder: Path) -> list[tuple[str, list, int]]:
    """(name, index as saved, elements) of every piece of every shard in `folder`."""
    out = []
    for path in sorted(folder.glob("shard-*.npz")):
        with np.load(path) as shard:
            meta = json.loads(shard["meta"].item())
            out += [(p["name"], p["index"], shard[f"{i}.data"].size)
                    for i, p in enumerate(meta["pieces"])]
    return out


def test_zero_saves_each_number_once_in_boxes_that_cut_rows(resumed):
    """A ZeRO save: the dp ranks' flat slices are disjoint and tp replicas are written
    once, so the shards hold every parameter exactly once; slices end inside rows, and
    a tp rank's part of a row is saved at its own columns of the full fc1."""
    root, _ = resumed
    part_rows = []
    for i, (model, mesh, *_) in enumerate(RUNNABLE):
        if not mesh.get("zero"):
            continue
        pieces = saved_pieces(shard_files.resolve(root / f"pair{i}"))
        shapes = nn.canonical_shapes(TrainConfig(**MODELS[model]).resolved(1).model_config())
        assert sum(size for *_, size in pieces) == sum(
            int(np.prod(shape)) for shape in shapes.values()), mesh
        part_rows += [(name, index, mesh) for name, index, size in pieces
                      if len(shapes[name]) == 2 and size < shapes[name][1]]
    assert part_rows, "no ZeRO slice ended inside a row: the boxes went untested"
    d_ff = TrainConfig(**MODELS["odd"]).resolved(1).d_ff
    assert any(name.endswith("fc1.weight") and mesh.get("tp") and index[1][0] >= d_ff // 2
               for name, index, mesh in part_rows), part_rows


def test_resharded_checkpoint_holds_the_same_bits_and_continues(resumed):
    root, runs = resumed
    original, full = save_load.load(root / "pair0"), save_load.load(root / "full")
    assert [p.name for p in sorted(shard_files.resolve(root / "full").glob("shard-*"))] == [
        "shard-00000-of-00001.npz"]
    assert full.step == original.step == 2
    for name, value in original.params.items():
        assert np.array_equal(full.params[name], value), name
        for slot in ("m", "v"):
            assert np.array_equal(full.state[slot][name], original.state[slot][name])
    moved_folder = shard_files.resolve(root / "moved")   # reshard writes a step folder too
    assert moved_folder.name == "step-000002"
    moved = json.loads((moved_folder / "manifest.json").read_text())
    assert moved["mesh"]["world"] == 2 and len(moved["files"]) == 2
    if moved["mesh"]["tp"] == 2:   # each tp rank wrote its own columns of every fc1
        with np.load(moved_folder / shard_files.shard_name(1, 2)) as shard:
            pieces = json.loads(shard["meta"].item())["pieces"]
        assert any(p["name"].endswith("fc1.weight") and p["index"] for p in pieces)
    first, second = runs[0][0], runs["reshard"][0]
    assert full.manifest["losses"] == moved["losses"] == first["losses"]  # carried along
    assert second["losses"][:2] == first["losses"]
    assert_equivalent(second, reference(**MODELS["mlp"], steps=4), label="resharded")


def test_reshard_refuses_a_missing_source_and_a_mesh_that_does_not_fit(resumed):
    root, _ = resumed
    for args, named in ((["reshard", str(root / "nothing"), str(root / "x")], "SRC"),
                        (["reshard", str(root / "pair0"), str(root / "y"), "--tp", "2"],
                         "--dp/--tp/--pp")):
        job = minipar(1, args, 60)
        lines = [line for line in job.stderr.splitlines() if line.strip()]
        assert job.returncode == 2 and len(lines) == 1, job.explain()
        assert lines[0].startswith("minipar: error:") and named in lines[0], job.explain()
    assert not (root / "x").exists() and not (root / "y").exists()
