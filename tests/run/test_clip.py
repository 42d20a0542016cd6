"""Gradient clipping (minipar/compose/clip.py) and ragged documents (minipar/core/documents.py), no
MPI.

- The counting rule: on every mesh of 8 ranks (dp, cp, tp, pp, ep, ZeRO or not), every
  distinct piece of the gradient -- dense or expert, whole or cut over tp, a ZeRO slice
  or not -- is counted by exactly one rank of each group the norm's Allreduce spans; the
  bug `clip-replicated-counted-tp`'s rule counts a whole piece tp times.
- The one-process clip: the update of one SGD step is lr x min(1, C/(norm+1e-6)) x g.
- Ragged documents: rows are windows of one document, padded with 0 and masked; a rank's
  rows are the global batch's; the masked loss makes the step independent of how the
  batch is cut into microbatches (what the bug `loss-mean-per-microbatch` breaks); the
  masked cross-entropy gives padded positions no loss and no gradient; `--dump` writes
  the mask.

The MPI side (every mesh equal to one process with clipping on, every rank's gnorm) is
in the existing sweeps: tests/parallel/test_every_mesh.py, test_zero.py, test_expert_parallel.py;
the bugs in tests/bugs/test_bugs.py, the refusals in tests/run/test_config_errors.py.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import numpy as np
import pytest

from minipar.comm.mesh import MeshShape
from minipar.compose import clip
from minipar.core import documents, fused_layers
from minipar.core.autograd import Tensor
from minipar.core.nn import Parameter
from minipar.run.results import dump
from minipar.run.train import train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.harness.mpi import ROOT, lesson_run

SAMPLE = str(ROOT / "lessons" / "documents.txt")
GPT = dict(model="gpt", layers=2, d_model=16, heads=4, seq_len=8, d_ff=32, batch=8,
           steps=2, data=SAMPLE, documents=True)


# ------------------------------------------------------------ the counting rule
def meshes(world: int = 8) -> list[TrainConfig]:
    """Every (dp, cp, tp, pp) of `world`, with ep dividing dp, ZeRO on or off."""
    out = []
    for dp, cp, tp in itertools.product((1, 2, 4, 8), repeat=3):
        if world % (dp * cp * tp):
            continue
        pp = world // (dp * cp * tp)
        for ep, zero in itertools.product((1, 2, 4, 8), (0, 1)):
            if dp % ep == 0:
                out.append(TrainConfig(model="gpt-moe", dp=dp, cp=cp, tp=tp, pp=pp, ep=ep,
                                       zero=zero))
    return out


SHAPE = (4, 6)
KINDS = {  # a parameter of each kind: (sync, cut over tp?)
    "dense whole": ("dp", False), "dense cut": ("dp", True),
    "expert whole": ("edp", False), "expert cut": ("edp", True)}


def held(kind: str, cfg: TrainConfig, c: dict[str, int]) -> tuple[Parameter, tuple]:
    """The parameter of `kind` on the rank at coordinates `c`, and what identifies the
    numbers it holds: the stage, the tp column block if cut, the experts (ep) of an
    expert weight, and the ZeRO slice (dp x cp, or edp x cp for experts)."""
    sync, cut = KINDS[kind]
    index = (slice(None), slice(c["tp"] * 3, c["tp"] * 3 + 3)) if cut and cfg.tp > 1 else None
    p = Parameter(np.zeros(SHAPE), "w", full_index=index, sync=sync)
    identity = (c["pp"], c["tp"] if index else None, c["ep"] if sync == "edp" else None)
    if cfg.zero:
        identity += (c["edp_cp"] if sync == "edp" else c["dp_cp"],)
    return p, identity


def norm_groups(cfg: TrainConfig) -> list[list[int]]:
    """The ranks of each Allreduce of the norm (each rank alone if there is none)."""
    shape, name = cfg.mesh_shape(), clip.group_name(cfg)
    if name is None:
        return [[r] for r in range(shape.world)]
    if name == "world":
        return [list(range(shape.world))]
    return shape.groups("dp_cp" if name == "dp" else name)


def counts(cfg: TrainConfig, kind: str, rule=clip.replicated_axes) -> list[int]:
    """How many ranks of its norm group count each distinct piece of `kind`."""
    shape: MeshShape = cfg.mesh_shape()
    spanned = clip.SPANS[clip.group_name(cfg)] if clip.group_name(cfg) else ()
    out = []
    for group in norm_groups(cfg):
        seen: dict[tuple, int] = {}
        for rank in group:
            c = shape.coords(rank)
            p, identity = held(kind, cfg, c)
            seen.setdefault(identity, 0)
            if clip.counted(rule(p, cfg, SHAPE, bool(cfg.zero)), spanned, c):
                seen[identity] += 1
        out += list(seen.values())
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_piece_is_counted_once_in_each_group_on_every_mesh(kind):
    cfgs = meshes()
    assert len(cfgs) > 60
    for cfg in cfgs:
        assert set(counts(cfg, kind)) == {1}, (kind, cfg.mesh_shape(), cfg.zero)


def test_the_bug_s_rule_counts_a_whole_piece_tp_times():
    def bug(*args):
        return clip.replicated_axes(*args) - {"tp"}
    cfg = TrainConfig(model="gpt-moe", dp=2, tp=4, pp=1, zero=0)
    assert set(counts(cfg, "dense whole", bug)) == {4}
    assert set(counts(cfg, "dense cut", bug)) == {1}   # a cut piece is right either way


def test_the_norm_s_group_is_the_axes_holding_different_pieces():
    def name(**sizes):
        return clip.group_name(TrainConfig(**{"dp": 1, **sizes}))
    assert name(dp=8) is None                      # replicas only: each rank alone
    assert name(dp=2, tp=4) == "tp" and name(dp=4, pp=2) == "pp"
    assert name(dp=4, ep=4, model="moe") == "ep"
    assert name(dp=8, zero=1) == "dp" and name(dp=4, ep=2, zero=3, model="moe") == "dp"
    assert name(dp=2, tp=2, pp=2) == "world" and name(dp=4, tp=2, zero=2) == "world"
    cfg = TrainConfig(dp=2, tp=2, pp=2, clip_grad_norm=1.0)
    assert clip.expected_ledger(cfg) == {("world", "Allreduce"): (1, 1)}
    assert clip.expected_ledger(replace(cfg, clip_grad_norm=None)) == {}


# --------------------------------------------------------- the one-process clip
def test_coefficient_and_the_reference_clip():
    grads = [np.array([3.0, 0.0]), np.array([[0.0, 4.0]])]
    assert clip.clip_reference(grads, 10.0) == 5.0 and grads[0][0] == 3.0   # not clipped
    norm = clip.clip_reference(grads, 1.0)
    assert norm == 5.0
    np.testing.assert_allclose(grads[0], [3.0 / (5.0 + 1e-6), 0.0], rtol=1e-15)
    assert clip.coefficient(0.5, 1.0) == 1.0


def test_one_clipped_sgd_step_moves_by_lr_c_over_norm_times_the_gradient():
    cfg = TrainConfig(layers=2, d_in=8, d_model=16, batch=8, steps=1, lr=0.1).resolved(1)
    free = train_reference(cfg)
    clipped = train_reference(replace(cfg, clip_grad_norm=0.01))
    grads = {k: (free.init[k] - free.final[k]) / cfg.lr for k in free.init}
    norm = float(np.sqrt(sum(np.vdot(g, g) for g in grads.values())))
    assert clipped.extras["gnorms"] == [pytest.approx(norm, rel=1e-9)] and norm > 0.01
    scale = 0.01 / (norm + 1e-6)
    for k, g in grads.items():
        np.testing.assert_allclose(clipped.final[k], free.init[k] - cfg.lr * scale * g,
                                   rtol=1e-9, atol=1e-15)


# ----------------------------------------------------------------- documents
def test_documents_are_split_at_blank_lines(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"first doc\nline two\n\n\nsecond\n  \n\nx\n\nlast one")
    starts, lengths = documents.read_documents(str(path))
    data = path.read_bytes()
    found = [data[s:s + n] for s, n in zip(starts, lengths)]
    assert found == [b"first doc\nline two", b"second", b"last one"]  # "x": 1 byte, left out
    assert documents.documents_problem(str(path)) is None
    (tmp_path / "none.txt").write_bytes(b"a\n\nb\n")
    assert "no document of at least 2 bytes" in documents.documents_problem(
        str(tmp_path / "none.txt"))


def test_rows_are_padded_masked_windows_of_one_document_and_a_rank_s_rows_its_own():
    x, y = documents.make_documents(SAMPLE, 0, 3, 16, 8)
    starts, lengths = documents.read_documents(SAMPLE)
    corpus = open(SAMPLE, "rb").read()
    texts = [corpus[s:s + n] for s, n in zip(starts, lengths)]
    valid = y != documents.IGNORE
    assert x.shape == y.shape == (16, 8) and 0 < valid.sum() < valid.size   # ragged
    for row in range(16):
        n = int(valid[row].sum())
        assert valid[row, :n].all() and not valid[row, n:].any()   # padding at the end
        window = bytes(x[row, :n].tolist() + [int(y[row, n - 1])])
        assert any(window in text for text in texts)              # inside ONE document
        assert (x[row, n + 1:] == 0).all()
    rows = np.array([5, 2, 11])
    xr, yr = documents.make_documents(SAMPLE, 0, 3, 16, 8, rows)
    assert (xr == x[rows]).all() and (yr == y[rows]).all()
    padded, mask = documents.split_mask(y)
    assert (mask == valid).all() and (padded[~valid] == 0).all()


def test_masked_cross_entropy_counts_only_valid_positions():
    rng = np.random.default_rng(0)
    logits = Tensor(rng.normal(size=(2, 3, 5)), requires_grad=True)
    labels = np.array([[1, 4, documents.IGNORE], [0, documents.IGNORE, documents.IGNORE]])
    loss = fused_layers.cross_entropy(logits, labels)
    loss.backward()
    flat = logits.data.reshape(-1, 5)
    keep = labels.reshape(-1) >= 0
    log_p = flat - np.log(np.exp(flat).sum(-1, keepdims=True))
    expected = -log_p[keep, labels.reshape(-1)[keep]].sum() / 6     # the mean over all 6
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    grad = logits.grad.reshape(-1, 5)
    assert (grad[~keep] == 0).all() and np.abs(grad[keep]).sum() > 0


def test_the_masked_loss_does_not_depend_on_the_microbatches():
    """sum CE over valid positions / N of the global batch: cutting the batch into 1, 2
    or 4 microbatches changes nothing but rounding; the per-microbatch mean does."""
    runs = [train_reference(TrainConfig(**GPT, microbatches=m).resolved(1)) for m in (1, 2, 4)]
    for run in runs[1:]:
        np.testing.assert_allclose(run.losses, runs[0].losses, rtol=1e-12)
        for name, value in runs[0].final.items():
            np.testing.assert_allclose(run.final[name], value, rtol=1e-9, atol=1e-14)
    from minipar.bugs import catalog
    with catalog.injected("loss-mean-per-microbatch"):
        broken = train_reference(TrainConfig(**GPT, microbatches=4).resolved(1))
    assert abs(broken.losses[0] - runs[0].losses[0]) > 1e-6


def test_dump_writes_the_mask_and_the_refusals(tmp_path):
    cfg = TrainConfig(**GPT, clip_grad_norm=0.5).resolved(1)
    assert problems(cfg, 1) == []
    result = train_reference(cfg)
    dump(tmp_path, cfg, result)
    with np.load(tmp_path / "data.npz") as data:
        assert data["mask"].shape == data["y"].shape == (2, 8, 8)
        assert data["y"].min() >= 0 and 0 < data["mask"].mean() < 1
    assert (tmp_path / "gnorms.json").exists()
    bad = [dict(clip_grad_norm=0.0), dict(clip_grad_norm=float("nan")),
           dict(clip_grad_norm=-2.0), dict(data=None)]
    for change in bad:
        found = problems(replace(cfg, **change), 1)
        assert len(found) == 1 and ("--clip-grad-norm" in found[0] or "--documents" in found[0])


def test_lesson_10_trains_on_documents_like_one_process():
    """Lesson 10's part 4 (the run tests/teaching/test_lessons.py makes, shared): the README's
    paragraphs as ragged rows, clipped, on dp = 2 with 2 microbatches, equal to one
    process, its gnorm printed beside the reference's."""
    job, _ = lesson_run(2, "10_transformer.py", "--quick")
    assert job.returncode == 0 and not job.timed_out, job.explain()
    part = job.stdout[job.stdout.index("=== 4."):]
    assert "valid positions of" in part and "gnorm per step:" in part
    mesh, one = re.search(r"gnorm per step: (.*) \(one process: (.*)\)", part).groups()
    assert mesh == one
    assert re.search(r"params rel \S+ -> OK", part), part
