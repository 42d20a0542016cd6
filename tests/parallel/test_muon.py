"""`--optimizer muon` (core/muon.py): the one-process rule against an independent one, then
every mesh against one process (float64, rel 1e-9), every replica bitwise equal, and the
ledger of each `--muon-mode` against its formula.

One 4-rank job trains every 4-rank config below (tests/harness/rank_muon.py), one 8-rank
job the 4-D gpt-moe meshes: dp and ZeRO 1/2/3 (a matrix split across two ZeRO
partitions), tp column- and row-sharded matrices in the three modes, ep (experts whole
on their rank; with --model moe each expert split over tp), pp under every schedule, cp,
sp, gradient accumulation, a checkpoint saved on one mesh and resumed on another. Tiny
shapes, two steps (the ledger is the second step's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from minipar.core import nn
from minipar.core.memory import FlatLayout
from minipar.core.muon import is_matrix, orthogonalize
from minipar.run.train import train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.conftest import assert_equivalent, reference
from tests.harness.mpi import ROOT, launch, read_dump
from tests.reference import independent_muon

MUON = dict(optimizer="muon", lr=0.02, steps=2)
MLP = dict(MUON, layers=2, d_in=8, d_model=12, d_ff=20, classes=5, batch=8)
GPT = dict(MUON, model="gpt", layers=2, d_model=16, heads=4, seq_len=8, vocab=16, d_ff=32,
           batch=4)
MOE = dict(MLP, model="moe", experts=4, expert_d_ff=10, top_k=2)
GPT_MOE = dict(GPT, model="gpt-moe", experts=4, expert_d_ff=16, top_k=2, d_ff=None)
MODES = ("layer-sharded", "distributed", "duplicated")
SAVED = Path(tempfile.mkdtemp(prefix="minipar-muon-ckpt-"))

CONFIGS = {4: [
    dict(MLP, dp=4, muon_mode="layer-sharded"),                                  # 0
    dict(MLP, dp=4, muon_mode="duplicated"),                                     # 1
    dict(MLP, dp=4, zero=1, muon_mode="layer-sharded", microbatches=2),          # 2
    dict(MLP, dp=4, zero=1, muon_mode="duplicated"),                             # 3
    dict(MLP, dp=4, zero=2, muon_mode="distributed", nesterov=False),            # 4
    dict(MLP, dp=4, zero=3, muon_mode="layer-sharded", ns_steps=3),              # 5
    *[dict(GPT, dp=2, tp=2, muon_mode=mode) for mode in MODES],                  # 6, 7, 8
    dict(GPT, dp=2, tp=2, zero=1, muon_mode="layer-sharded", sp=True),           # 9
    dict(MOE, dp=4, ep=4, muon_mode="duplicated"),                               # 10
    dict(GPT, dp=2, pp=2, microbatches=2, muon_mode="layer-sharded"),            # 11
    dict(GPT, dp=2, cp=2, muon_mode="distributed", zero=2),                      # 12
    dict(GPT, dp=4, zero=1, steps=1, save=str(SAVED)),                           # 13
    dict(GPT, dp=2, tp=2, muon_mode="distributed", resume=str(SAVED)),           # 14
    dict(GPT, dp=2, pp=2, schedule="dualpipe", microbatches=4, batch=8,          # 15
         muon_mode="duplicated"),
    dict(GPT, dp=2, pp=2, schedule="interleaved", virtual=2, layers=4,           # 16
         microbatches=2, zero=1),
    dict(GPT, dp=2, pp=2, schedule="zb-v", microbatches=2, layers=4, zero=2),    # 17
    dict(MOE, dp=2, ep=2, tp=2, muon_mode="distributed"),                       # 18
    dict(GPT, dp=2, pp=2, schedule="gpipe", microbatches=2, zero=3,              # 19
         muon_mode="duplicated"),
    dict(GPT, dp=2, pp=2, schedule="dualpipev", layers=4, microbatches=4,        # 20
         batch=8),
    dict(GPT, pp=4, schedule="zb-h1", layers=4, microbatches=4, zero=1),          # 21
], 8: [
    dict(GPT_MOE, dp=2, cp=2, tp=2, ep=2, batch=2, muon_mode="distributed"),
    dict(GPT_MOE, dp=2, tp=2, pp=2, ep=2, layers=2, microbatches=2, zero=1),
]}
SAVED_FIELDS = ("resume", "save", "muon_mode", "dp", "tp", "pp", "ep", "cp", "zero", "sp",
                "schedule", "virtual")


# ----------------------------------------------------------- one process
@pytest.mark.parametrize("fields", [dict(MLP, microbatches=2), dict(MLP, nesterov=False,
                                    ns_steps=3, momentum=0.5, weight_decay=0.0),
                                    dict(MOE, steps=3), dict(GPT, microbatches=2)],
                         ids=["mlp", "mlp-plain-momentum", "moe", "gpt"])
def test_one_process_matches_independent(fields):
    """minipar's one-process Muon + AdamW equals tests/reference/independent_muon.py."""
    cfg = TrainConfig(**fields).resolved(1)
    mine = independent_muon.train(cfg)
    assert_equivalent({"losses": mine.losses, "final": mine.final}, train_reference(cfg),
                      label=str(fields))


def test_which_tensors_take_muon():
    """The blocks' 2-D weights but the router; never a flat (1-D) view of one."""
    assert is_matrix("blocks.0.fc1.weight", 2)
    assert is_matrix("blocks.3.experts.1.fc2.weight", 2)
    assert is_matrix("blocks.1.attn.q.weight", 2)
    assert not is_matrix("blocks.0.router.weight", 2)
    assert not is_matrix("blocks.0.ln.weight", 1)
    assert not is_matrix("embed.weight", 2) and not is_matrix("head.weight", 2)
    assert not is_matrix("blocks.0.fc1.weight", 1)       # a ZeRO slice's shape says nothing


def test_orthogonalize_is_nearly_orthogonal():
    """Five quintic steps bring every singular value of X into about [0.7, 1.2]."""
    u = np.random.default_rng(0).standard_normal((12, 30))
    for x in (orthogonalize(u, 5), orthogonalize(u.T, 5)):
        s = np.linalg.svd(x, compute_uv=False)
        assert 0.6 < s.min() and s.max() < 1.25, s


def test_refusals_and_config():
    """Bad Muon flags: one line each; the rule lands in config.json."""
    def said(**fields: object) -> list[str]:
        return problems(TrainConfig(**fields).resolved(1), 1)
    assert said(optimizer="muon", momentum=1.0) == ["--momentum must be in [0, 1) (got 1.0)"]
    assert said(optimizer="muon", ns_steps=0) == ["--ns-steps must be between 1 and 1000 (got 0)"]
    assert said(optimizer="muon", ns_steps=10**9) == [
        "--ns-steps must be between 1 and 1000 (got 1000000000)"]   # a step that never ends
    assert said(optimizer="adam", nesterov=False) == [
        "--nesterov applies to --optimizer muon only"]
    assert said(optimizer="sgd", muon_mode="duplicated") == [
        "--muon-mode applies to --optimizer muon only"]
    saved = TrainConfig(optimizer="muon").resolved(1).as_json()
    assert {k: saved[k] for k in ("momentum", "nesterov", "ns_steps", "weight_decay")} == {
        "momentum": 0.95, "nesterov": True, "ns_steps": 5, "weight_decay": 0.1}


def test_cli_refusal_exit_2():
    """One line from the command line, exit 2, before any step."""
    run = subprocess.run([sys.executable, "-m", "minipar", "train", "--optimizer", "muon",
                          "--momentum", "-0.1"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "minipar: error: --momentum must be in [0, 1) (got -0.1)"]


# ------------------------------------------------------------- the mesh
@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """Every config of CONFIGS, one job per world size."""
    out = {}
    for n, configs in CONFIGS.items():
        folder = Path(tempfile.mkdtemp(prefix=f"minipar-muon-{n}-"))
        spec = folder / "configs.json"
        spec.write_text(json.dumps(configs))
        job = launch(n, ["-m", "tests.harness.rank_muon", str(spec), str(folder)], 300)
        assert job.returncode == 0 and not job.timed_out, job.explain()
        out[n] = [dict(read_dump(folder / str(i)), replicas=json.loads(
            (folder / str(i) / "replicas.json").read_text()), memory=json.loads(
            (folder / str(i) / "memory.json").read_text())) for i in range(len(configs))]
    return out


def reference_of(fields: dict) -> object:
    one = {k: v for k, v in fields.items() if k not in SAVED_FIELDS}
    return reference(**one)


@pytest.mark.parametrize("n,i", [(n, i) for n in CONFIGS for i in range(len(CONFIGS[n]))])
def test_mesh_equals_one_process(runs, n, i):
    """Losses and final parameters equal one process (1e-9); replicas bitwise equal. The
    resumed run (its momentum saved on dp 4 ZeRO-1, resumed on dp 2 x tp 2) equals an
    unbroken one."""
    fields = CONFIGS[n][i]
    run = runs[n][i]
    assert run["replicas"] == [], run["replicas"][:3]
    assert_equivalent(run, reference_of(fields), label=str(fields))


def matrices(fields: dict) -> dict[str, tuple[int, int]]:
    """Muon's matrices of a config and their shapes."""
    cfg = TrainConfig(**fields).resolved(1)
    shapes = nn.canonical_shapes(cfg.model_config())
    return {k: s for k, s in shapes.items() if is_matrix(k, len(s))}


def sent(run: dict, op: str = "Isend") -> int:
    """Elements every rank sent point to point over the world (Muon's pieces)."""
    return sum(r["elements"] for r in run["ledger"] if r["op"] == op and r["group"] == "world")


def flat_holders(fields: dict, dp: int) -> dict[str, list[int]]:
    """ZeRO: the elements of each matrix each dp rank's flat slice holds."""
    cfg = TrainConfig(**fields).resolved(dp)
    full = nn.init_params(cfg.model_config(), 0, "float64")
    params = nn.build_reference(cfg.model_config(), full).parameters()
    out = {}
    for rank in range(dp):
        layout = FlatLayout([p.data.shape for p in params], dp, rank)
        for p, offset, size in zip(params, layout.offsets, layout.sizes):
            if is_matrix(p.name, p.data.ndim):
                held = max(0, min(offset + size, layout.stop) - max(offset, layout.start))
                out.setdefault(p.name, []).append(held)
    return out


def test_ledger_plain_dp(runs):
    """dp 4, no ZeRO: duplicated moves nothing (each replica has U whole: 4x the compute);
    layer-sharded homes each matrix on one rank, which sends X to the 3 others."""
    total = sum(m * n for m, n in matrices(CONFIGS[4][0]).values())
    assert sent(runs[4][0]) == sent(runs[4][0], "Irecv") == 3 * total
    assert sent(runs[4][1]) == 0


def test_ledger_zero_crossing_matrix(runs):
    """ZeRO-1 over dp 4: a matrix cut by the partition boundary (one is, by construction
    of these sizes) is brought whole. duplicated: each holder receives what it lacks,
    sum (holders - 1) m n; layer-sharded: the home receives what it lacks and sends
    each other holder its part back, 2 (m n - held by the home)."""
    shapes = matrices(CONFIGS[4][3])
    held = flat_holders(CONFIGS[4][3], 4)
    assert any(sum(h > 0 for h in parts) >= 2 for parts in held.values()), held  # crossing
    duplicated = sum((sum(h > 0 for h in held[k]) - 1) * m * n
                     for k, (m, n) in shapes.items())
    assert sent(runs[4][3]) == duplicated
    # layer-sharded: the home of a matrix is its least-loaded holder (LPT): we only know
    # it lies between the two extremes of "holds most" and "holds least"
    lo = sum(2 * (m * n - max(held[k])) for k, (m, n) in shapes.items())
    hi = sum(2 * (m * n - min(h for h in held[k] if h)) for k, (m, n) in shapes.items())
    assert lo <= sent(runs[4][2]) <= hi


def test_ledger_tp_modes(runs):
    """dp 2 x tp 2, every matrix split in two over tp (q, k, v, fc1 by columns; proj,
    fc2 by rows). duplicated: each rank receives the other half, sum m n / 2 per rank;
    layer-sharded: the home receives the other half and sends 3 halves back, 2 m n over
    the 4 ranks; distributed: no piece moves, and per matrix one Allreduce of ||U||^2
    and ns_steps Allreduces of the d x d Gram matrix over tp, on every rank."""
    shapes = matrices(CONFIGS[4][6])
    total = sum(m * n for m, n in shapes.values())
    layer, dist, dup = runs[4][6], runs[4][7], runs[4][8]
    assert sent(dup) == 4 * total // 2
    assert sent(layer) == 2 * total
    assert sent(dist) == 0

    def tp_allreduce(run: dict, field: str) -> int:
        return sum(r[field] for r in run["ledger"]
                   if r["op"] == "Allreduce" and r["group"] == "tp")
    d, steps = GPT["d_model"], 5
    assert tp_allreduce(dist, "calls") - tp_allreduce(dup, "calls") == \
        4 * len(shapes) * (1 + steps)
    assert tp_allreduce(dist, "elements") - tp_allreduce(dup, "elements") == \
        4 * len(shapes) * (1 + steps * d * d)


def test_ledger_experts_move_nothing(runs):
    """ep 4 = dp 4: each expert's matrices whole on one rank: no piece travels."""
    assert sent(runs[4][10]) == 0


def test_optimizer_state_is_one_number_per_matrix_element(runs):
    """Muon keeps one number of state (its momentum) per element of a block matrix and
    AdamW's two (m, v) per element of the rest: measured bytes on every rank, whole
    (dp 4) and per ZeRO-1 slice (dp 4, the slices cut through matrices)."""
    fields = CONFIGS[4][0]
    cfg = TrainConfig(**fields).resolved(4)
    shapes = nn.canonical_shapes(cfg.model_config())
    numbers = sum((1 if is_matrix(k, len(s)) else 2) * int(np.prod(s)) for k, s in shapes.items())
    assert [r["optimizer"] for r in runs[4][0]["memory"]] == [8 * numbers] * 4
    assert numbers < 2 * sum(int(np.prod(s)) for s in shapes.values())   # AdamW's
    held = flat_holders(CONFIGS[4][3], 4)
    full = nn.init_params(cfg.model_config(), 0, "float64")
    params = nn.build_reference(cfg.model_config(), full).parameters()
    for rank, measured in enumerate(runs[4][3]["memory"]):
        layout = FlatLayout([p.data.shape for p in params], 4, rank)
        matrix = sum(held[k][rank] for k in held)
        assert measured["optimizer"] == 8 * (matrix + 2 * (layout.stop - layout.start - matrix))


STRATEGIES = ("parallel/data_parallel.py", "parallel/zero.py", "parallel/tensor_parallel.py",
              "parallel/expert_parallel.py", "parallel/context_parallel.py",
              "parallel/pipeline/executor.py")


def test_strategies_name_no_optimizer():
    """A strategy hands its arrays to any optimizer through one door (core/held.py): no
    name, attribute, import or string in its code says sgd, adam(w) or muon (docstrings
    and comments may)."""
    import re

    from tests.parallel.test_seams import named  # the one walk of the strategies' code

    kind = re.compile(r"\b(sgd|adam|adamw|muon)\b", re.I)
    for path in STRATEGIES:
        found = named(path, kind)
        assert not found, f"{path}: names an optimizer: {found}"
