"""Hybrid meshes: data x tensor x pipeline parallelism (and MoE over dp x ep x pp) at once.

Equivalence: EVERY factorization of 8 ranks and of 4 ranks into (dp, tp, pp) trains
the dense model exactly like one process (rel 1e-9), under 1F1B and GPipe where there
is a pipeline; interleaved and ZB-H1 on the 3-D mesh and on tp x pp / dp x pp meshes;
sequence parallelism inside pipeline stages; ZeRO-1/3 and the overlapped gradient sync
on the 3-D mesh; SGD and Adam taking turns. The MoE model over every (dp, ep, pp) of
8 and 4 ranks with ep | dp (top-2, some with capacity).

Ledger: on dp = tp = pp = 2 every axis carries exactly what its strategy promises
(Megatron's two Allreduces of B x d per block, one activation and one gradient per
microbatch per stage boundary, one gradient Allreduce of this rank's parameters).

Lessons 05 (TP vs PP, 4 ranks) and 06 (the 3-D grid, 8 ranks) run and their numbers
bear out the source text's claims.

One `sweep` launch per rank count runs every config (tests/harness/mpi.py).
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import pytest

from minipar.comm.mesh import MeshShape
from minipar.core import nn
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import lesson_run, sweep

SMALL = dict(layers=4, d_in=8, d_model=16, d_ff=32, batch=16, steps=2)
MOE = dict(model="moe", experts=8, top_k=2, expert_d_ff=16, batch=32)


def factorizations(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp = world."""
    return [(dp, tp, world // (dp * tp)) for dp in range(1, world + 1) if world % dp == 0
            for tp in range(1, world // dp + 1) if (world // dp) % tp == 0]


def dense_configs(world: int) -> list[dict]:
    """Each mesh once without a pipeline; with one, under 1F1B (M = 4 where the per-rank
    batch allows, else 2) and GPipe (M = 2). pp = 8 needs 8 layers."""
    out = []
    for i, (dp, tp, pp) in enumerate(factorizations(world)):
        base = dict(SMALL, dp=dp, tp=tp, pp=pp, layers=max(SMALL["layers"], pp))
        most = 4 if (base["batch"] // dp) % 4 == 0 else 2
        runs = [("1f1b", most), ("gpipe", 2)] if pp > 1 else [("1f1b", 2)]
        for j, (schedule, m) in enumerate(runs):
            out.append(dict(base, schedule=schedule, microbatches=m,
                            optimizer=("sgd", "adam")[(i + j) % 2]))
    return out


def moe_configs(world: int) -> list[dict]:
    """Every (dp, ep, pp) with dp * pp = world, ep | dp (tp = 1); top-2, capacity 1.0 on
    every other mesh, 1F1B and GPipe taking turns."""
    out = []
    for i, (dp, _, pp) in enumerate(m for m in factorizations(world) if m[1] == 1):
        for ep in (e for e in range(1, dp + 1) if dp % e == 0):
            out.append(dict(SMALL, **MOE, dp=dp, ep=ep, pp=pp, layers=max(4, pp),
                            microbatches=2, schedule=("1f1b", "gpipe")[i % 2],
                            capacity_factor=1.0 if len(out) % 2 else None,
                            optimizer=("sgd", "adam")[len(out) % 3 == 2]))
    return out


EXTRAS = {
    8: [  # the other schedules on the 3-D mesh and on tp x pp, dp x pp; SP inside stages;
        # ZeRO and the overlapped gradient sync around a pipeline of tensor-parallel stages
        dict(SMALL, dp=2, tp=2, pp=2, schedule="interleaved", virtual=2, microbatches=4),
        dict(SMALL, dp=2, tp=2, pp=2, schedule="zb-h1", microbatches=4, optimizer="adam"),
        dict(SMALL, dp=1, tp=2, pp=4, layers=8, schedule="interleaved", virtual=2,
             microbatches=4, optimizer="adam"),
        dict(SMALL, dp=2, tp=1, pp=4, schedule="zb-h1", microbatches=4),
        dict(SMALL, dp=1, tp=4, pp=2, sp=True, microbatches=2, optimizer="adam"),
        dict(SMALL, dp=2, tp=2, pp=2, sp=True, schedule="gpipe", microbatches=2),
        dict(SMALL, dp=2, tp=2, pp=2, zero=1, sp=True, microbatches=2, optimizer="adam"),
        dict(SMALL, dp=2, tp=2, pp=2, zero=3, schedule="zb-h1", microbatches=2,
             optimizer="adam"),
        dict(SMALL, dp=2, tp=2, pp=2, grad_sync="overlapped", schedule="interleaved",
             virtual=2, microbatches=2),
        dict(SMALL, **MOE, dp=4, ep=2, pp=2, schedule="zb-h1", microbatches=2,
             capacity_factor=1.0, optimizer="adam"),
    ],
    4: [
        dict(SMALL, dp=1, tp=2, pp=2, schedule="interleaved", virtual=2, microbatches=2),
        dict(SMALL, dp=2, tp=1, pp=2, schedule="zb-h1", microbatches=4, optimizer="adam"),
        dict(SMALL, dp=1, tp=2, pp=2, sp=True, microbatches=4),
    ],
}
LEDGER = dict(SMALL, dp=2, tp=2, pp=2, schedule="1f1b", microbatches=2)  # the ledger test
CONFIGS = {n: dense_configs(n) + EXTRAS[n] + moe_configs(n) + ([LEDGER] if n == 8 else [])
           for n in (8, 4)}
CASES = [(n, i) for n in CONFIGS for i in range(len(CONFIGS[n]))]


def label(fields: dict) -> str:
    keys = ("model", "dp", "tp", "pp", "ep", "schedule", "virtual", "microbatches", "sp",
            "zero", "grad_sync", "capacity_factor", "optimizer")
    return " ".join(f"{k}={fields[k]}" for k in keys if fields.get(k) not in (None, False))


# the 4-rank meshes once more in bf16 (float64 masters), in the same job; not the
# capacity-limited MoE runs (a token across the capacity cut is no rounding: docs/design.md)
BF16 = {n: [dict(c, mixed="bf16") for c in CONFIGS[n] if not c.get("capacity_factor")]
        if n == 4 else [] for n in CONFIGS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    return {n: sweep(n, CONFIGS[n] + BF16[n], tmp_path_factory.mktemp(f"hybrid{n}"),
                     timeout=240) for n in CONFIGS}


def test_every_mesh_of_4_ranks_in_bf16_is_within_the_derived_tolerance(runs):
    for fields, run in zip(BF16[4], runs[4][len(CONFIGS[4]):]):
        assert_within_mixed_tolerance(run, fields, 4, label(fields))


def test_the_sweep_covers_every_mesh():
    for n in CONFIGS:
        resolved = [TrainConfig(**c).resolved(n) for c in CONFIGS[n]]
        assert all(problems(cfg, n) == [] for cfg in resolved)
        dense = {(c.dp, c.tp, c.pp, c.schedule) for c in resolved if c.model == "mlp"}
        for dp, tp, pp in factorizations(n):
            for schedule in ("1f1b", "gpipe") if pp > 1 else ("1f1b",):
                assert (dp, tp, pp, schedule) in dense, (n, dp, tp, pp, schedule)
        moe = {(c.dp, c.ep, c.pp) for c in resolved if c.model == "moe"}
        assert moe == {(dp, ep, pp) for dp, tp, pp in factorizations(n) if tp == 1
                       for ep in range(1, dp + 1) if dp % ep == 0}, n
    assert len(factorizations(8)) == 10 and len(factorizations(4)) == 6


@pytest.mark.parametrize("n,index", CASES, ids=[f"n{n}-" + label(CONFIGS[n][i]).replace(" ", ",")
                                               for n, i in CASES])
def test_mesh_equals_one_process(runs, n, index):
    fields = CONFIGS[n][index]
    run = runs[n][index]
    assert_equivalent(run, reference(**fields), label=label(fields))


# ------------------------------------------------------------- the ledger
def expected_ledger(cfg: TrainConfig, rank: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(group, op) -> (calls, elements) on one rank of a dense dp x tp x pp mesh in a step.

    rows = B/(M dp) per microbatch on a rank; the stage holds L/pp blocks.
    tp: Megatron: an Allreduce of (rows, d) ending each block's forward and one starting
        its backward, for every block this stage holds and every microbatch.
    pp: per boundary this stage touches, one activation out and one gradient back per
        microbatch (Isend); the same number received (Recv).
    dp: one bucketed Allreduce of every gradient this rank holds (one bucket: small)."""
    stage = MeshShape(cfg.dp, cfg.tp, cfg.pp).coords(rank)["pp"]
    rows, d, m = cfg.batch // cfg.microbatches // cfg.dp, cfg.d_model, cfg.microbatches
    blocks = cfg.layers // cfg.pp
    boundaries = (stage > 0) + (stage < cfg.pp - 1)
    return {("tp", "Allreduce"): (2 * blocks * m, 2 * blocks * m * rows * d),
            ("pp", "Isend"): (boundaries * m, boundaries * m * rows * d),
            ("pp", "Recv"): (boundaries * m, boundaries * m * rows * d),
            ("dp", "Allreduce"): (1, parameters_held(cfg, stage))}


def split_by_tp(name: str) -> bool:
    """Megatron cuts fc1's weight and bias by columns and fc2's weight by rows."""
    return re.search(r"\.fc1\.|\.fc2\.weight$", name) is not None


def parameters_held(cfg: TrainConfig, stage: int) -> int:
    """Elements of the parameters one rank of `stage` holds, from the canonical shapes:
    its blocks (the tp-split ones 1/tp each), the embedding on the first stage, the
    head on the last."""
    per_stage = cfg.layers // cfg.pp
    prefixes = tuple(f"blocks.{i}." for i in range(stage * per_stage, (stage + 1) * per_stage))
    prefixes += ("embed.",) * (stage == 0) + ("head.",) * (stage == cfg.pp - 1)
    return sum(int(np.prod(shape)) // (cfg.tp if split_by_tp(name) else 1)
               for name, shape in nn.canonical_shapes(cfg.model_config()).items()
               if name.startswith(prefixes))


def test_ledger_per_axis_on_2x2x2(runs):
    cfg = TrainConfig(**LEDGER).resolved(8)
    ledger = runs[8][CONFIGS[8].index(LEDGER)]["ledger"]
    per_rank: dict[int, dict] = defaultdict(dict)
    for r in ledger:
        assert r["bytes"] == 8 * r["elements"], r
        per_rank[r["rank"]][(r["group"], r["op"])] = (r["calls"], r["elements"])
    for rank in range(8):
        assert per_rank[rank] == expected_ledger(cfg, rank), rank
    # 2 blocks per stage, 2 microbatches of 4 rows, d = 16: 8 Allreduces of 64 numbers
    assert per_rank[0][("tp", "Allreduce")] == (8, 512)
    # one replica of the model (dp rank 0: ranks 0, 1, 4, 5) holds the split weights
    # once and the replicated ones tp times: what crosses the dp axis is the whole model
    shapes = nn.canonical_shapes(cfg.model_config())
    total = sum(int(np.prod(s)) for s in shapes.values())
    split = sum(int(np.prod(s)) for name, s in shapes.items() if split_by_tp(name))
    replica = [r for r in range(8) if MeshShape(2, 2, 2).coords(r)["dp"] == 0]
    assert sum(per_rank[r][("dp", "Allreduce")][1] for r in replica) == \
        split + cfg.tp * (total - split)


# ------------------------------------------------------------- the lessons
def table_row(out: str, title: str) -> list[float]:
    """The three numbers (TP, PP, TP+PP) of one row of lesson 5's table."""
    found = re.search(rf"^{re.escape(title)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert found, f"no row {title!r} in:\n{out}"
    return [float(v) for v in found.groups()]


def test_lesson_05_measures_tp_against_pp():
    job, _ = lesson_run(4, "05_tp_vs_pp.py")  # the run tests/teaching/test_lessons.py checks
    assert job.returncode == 0 and not job.timed_out, job.explain()
    out = job.stdout
    L, B, M, d = 8, 64, 4, 64  # the lesson's model
    for k in range(4):  # TP: fc1's columns split four ways; PP: the layers
        assert f"[rank {k}] blocks 1-8 + embedding + head; fc1 W[:, {64 * k}:{64 * k + 64}]" \
            in out, out
    assert "[rank 0] blocks 1-2 + embedding; fc1 W[:, 0:256]" in out, out
    assert "[rank 3] blocks 7-8 + head; fc1 W[:, 0:256]" in out, out
    # the ledger against the formulas: TP 2 Allreduces of (B/M, d) per block per microbatch,
    # PP one activation and one gradient of (B/M, d) per microbatch per boundary
    assert table_row(out, "communication calls / rank") == [2 * L * M, 2 * M, L * M + M]
    assert table_row(out, "  buffer KiB / rank (ledger)") == [
        2 * L * B * d * 8 / 1024, 2 * B * d * 8 / 1024, (L * B * d + B * d) * 8 / 1024]
    tp_wire, pp_wire, _ = table_row(out, "  wire KiB / rank (ring)")
    assert tp_wire == 1.5 * 2 * L * B * d * 8 / 1024 and tp_wire > pp_wire
    simulated = table_row(out, "bubble, simulator")
    assert simulated == table_row(out, "bubble, formula (p-1)/(M+p-1)")
    assert simulated == [0.0, round(3 / 7, 3), round(1 / 5, 3)]
    for name in ("TP", "PP", "TP+PP"):
        assert re.search(rf"^{re.escape(name)} against one process: .* -> OK$", out, re.M), out
    # each step time with its spread: median (min..max over the steps timed)
    bubble = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) ms \(([\d.]+)\.\."
                        r"([\d.]+) over \d+ repeats\)\s+losses .* -> OK$", out, re.M)
    assert [int(m) for m, *_ in bubble] == [1, 4, 8], out
    for m, formula, simulator, median, low, high in bubble:
        assert formula == simulator == f"{3 / (int(m) + 3):.3f}"
        assert float(low) <= float(median) <= float(high), (m, median, low, high)
    assert [float(b[2]) for b in bubble] == sorted((float(b[2]) for b in bubble), reverse=True)
    assert "TP bytes > PP bytes: True." in out and "; decreasing: True." in out, out


def test_lesson_06_shows_the_grid_partners_and_ledger_per_axis():
    job, _ = lesson_run(8, "06_hybrid.py")  # the run tests/teaching/test_lessons.py checks
    assert job.returncode == 0 and not job.timed_out, job.explain()
    out = job.stdout
    shape = MeshShape(2, 2, 2)
    assert shape.table() in out, out
    for rank in range(8):
        c = shape.coords(rank)
        partners = "; ".join(f"{axis} with " + ",".join(map(str, next(
            g for g in shape.groups(axis) if rank in g))) for axis in ("tp", "pp", "dp"))
        assert f"[rank {rank}] (dp {c['dp']}, tp {c['tp']}, pp {c['pp']}): {partners}" \
            in out, out
    assert "communicators agree with the table on every rank: True" in out
    cfg = TrainConfig(layers=8, d_in=16, d_model=32, d_ff=128, batch=32, microbatches=2,
                      dp=2, tp=2, pp=2).resolved(8)  # the lesson's model
    rows = re.findall(r"^\s+(\d)\s+\d,\d,\d\s+" + r"\s+".join([r"(\d+) x (\d+)"] * 4)
                      + r"\s+match$", out, re.M)
    assert len(rows) == 8, out
    for rank, *cells in rows:
        expected = expected_ledger(cfg, int(rank))
        keys = [("tp", "Allreduce"), ("pp", "Isend"), ("pp", "Recv"), ("dp", "Allreduce")]
        for key, calls, each in zip(keys, cells[::2], cells[1::2]):
            assert (int(calls), int(calls) * int(each)) == expected[key], (rank, key)
    assert "every rank's ledger equals the formulas: True" in out
    assert re.search(r"against one process .* -> OK$", out, re.M), out
