"""Pipeline parallelism under MPI: every schedule equals one process, and each stage
boundary carries exactly one activation and one gradient per microbatch.

Two `sweep` launches (2 and 4 ranks) run every config; the reference runs in
this process (tests/conftest.py).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import pytest

from minipar.comm.mesh import MeshShape
from minipar.run.mesh_step import boundary_shape
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import lesson_run, sweep

SMALL = dict(layers=8, d_in=8, d_model=16, d_ff=32, batch=16, steps=2)
MOE = dict(model="moe", experts=4, top_k=2, expert_d_ff=16)
# the transformer (tests/parallel/test_gpt_parallel.py runs it under the other schedules)
GPT = dict(model="gpt", d_model=16, heads=2, seq_len=8, vocab=16, batch=8, steps=2, d_ff=32)
GPT_MOE = dict(GPT, model="gpt-moe", experts=4, expert_d_ff=16, aux_coef=0.1)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
V_SHAPED = ("zb-v", "dualpipev")
# DualPipe: two copies of the model, half the microbatches fed from each end (M even, >= 2pp)
DUALPIPE = dict(SMALL, dp=1, schedule="dualpipe")


def pipeline_configs(pp: int) -> list[dict]:
    """Every schedule with M = 1, 2, 4, 8 on pp stages (interleaved also with V = 2
    where pp divides M; dualpipev with M = 2pp and 8), SGD and Adam taking turns."""
    out = []
    for i, (schedule, m) in enumerate((s, m) for s in SCHEDULES for m in (1, 2, 4, 8)):
        out.append(dict(SMALL, pp=pp, dp=1, schedule=schedule, microbatches=m,
                        optimizer=("sgd", "adam")[i % 2]))
    for m in (2, 4, 8):
        if m % pp == 0:
            out.append(dict(SMALL, pp=pp, dp=1, schedule="interleaved", virtual=2,
                            microbatches=m, optimizer="adam" if m == 4 else "sgd"))
    for m in sorted({2 * pp, 8, 16}):
        out.append(dict(SMALL, pp=pp, dp=1, schedule="dualpipev", microbatches=m,
                        optimizer="adam" if m == 8 else "sgd"))
    for m in sorted({2 * pp, 8, 16}):
        out.append(dict(DUALPIPE, pp=pp, microbatches=m, optimizer="adam" if m == 8 else "sgd"))
    return out


CONFIGS = {
    2: pipeline_configs(2) + [
        # MoE: the aux loss of the blocks on a stage that is not the last
        dict(SMALL, **MOE, pp=2, dp=1, schedule="1f1b", microbatches=4),
        dict(SMALL, **MOE, pp=2, dp=1, schedule="zb-h1", microbatches=2, optimizer="adam"),
        dict(SMALL, **MOE, pp=2, dp=1, schedule="interleaved", virtual=2, microbatches=2),
        dict(SMALL, **MOE, pp=2, dp=1, schedule="zb-v", microbatches=4, optimizer="adam"),
        dict(SMALL, **MOE, pp=2, dp=1, schedule="dualpipev", microbatches=4),
        dict(GPT, layers=4, pp=2, dp=1, schedule="zb-v", microbatches=2, optimizer="adam",
             lr=0.01),
        dict(GPT, layers=4, pp=2, dp=1, schedule="dualpipev", microbatches=4),
        dict(GPT_MOE, layers=4, pp=2, dp=1, schedule="dualpipev", microbatches=4,
             optimizer="adam", lr=0.01),
        dict(GPT, layers=4, pp=2, dp=1, schedule="dualpipe", microbatches=4),
        dict(GPT, layers=2, pp=2, dp=1, schedule="dualpipe", microbatches=8,
             optimizer="adam", lr=0.01),
        dict(DUALPIPE, **MOE, pp=2, microbatches=4),
    ],
    4: pipeline_configs(4) + [
        dict(SMALL, pp=2, dp=2, schedule="1f1b", microbatches=4),
        dict(SMALL, pp=2, dp=2, schedule="gpipe", microbatches=1, optimizer="adam"),
        dict(SMALL, pp=2, dp=2, schedule="zb-h1", microbatches=2),
        dict(SMALL, pp=2, dp=2, schedule="interleaved", virtual=2, microbatches=4,
             optimizer="adam"),
        # the V schedules with the other axes: dp (plain and ZeRO), tp (+ sp), MoE's ep
        dict(SMALL, pp=2, dp=2, schedule="zb-v", microbatches=2),
        dict(SMALL, pp=2, dp=2, schedule="dualpipev", microbatches=4, optimizer="adam",
             grad_sync="overlapped"),
        dict(SMALL, pp=2, dp=2, schedule="zb-v", microbatches=4, zero=2, optimizer="adam"),
        dict(SMALL, pp=2, dp=2, schedule="dualpipev", microbatches=4, zero=3),
        dict(SMALL, pp=2, dp=1, tp=2, schedule="zb-v", microbatches=4),
        dict(SMALL, pp=2, dp=1, tp=2, sp=True, schedule="dualpipev", microbatches=4),
        dict(SMALL, **MOE, pp=2, dp=2, ep=2, schedule="dualpipev", microbatches=4),
        dict(SMALL, **MOE, pp=2, dp=2, ep=2, schedule="zb-v", microbatches=2,
             optimizer="adam"),
        dict(GPT, layers=8, pp=4, dp=1, schedule="zb-v", microbatches=4),
        dict(GPT, layers=8, pp=4, dp=1, schedule="dualpipev", microbatches=8,
             optimizer="adam", lr=0.01),
        dict(GPT, layers=4, pp=2, dp=2, schedule="zb-v", microbatches=2),
        dict(GPT_MOE, layers=4, pp=2, dp=2, ep=2, schedule="dualpipev", microbatches=4),
        # DualPipe on 4 stages (the transformer too), and with dp, tp (+ sp) and MoE's ep
        dict(GPT, layers=8, pp=4, dp=1, schedule="dualpipe", microbatches=8),
        dict(GPT, layers=4, pp=4, dp=1, schedule="dualpipe", microbatches=8,
             optimizer="adam", lr=0.01),
        dict(DUALPIPE, pp=2, dp=2, microbatches=4, optimizer="adam"),
        dict(DUALPIPE, pp=2, tp=2, sp=True, microbatches=4),
        dict(GPT, layers=2, pp=2, tp=2, schedule="dualpipe", microbatches=4),  # vocab over tp:
        # rank pp-1's head is on its chunk 0 (stage pp-1 of the copy fed from rank 0)
        dict(DUALPIPE, **MOE, pp=2, dp=2, ep=2, microbatches=4),
    ],
}
CASES = [(n, i) for n in CONFIGS for i in range(len(CONFIGS[n]))]
# The 4-rank sweep once more in fp16 over float64 masters, in the same job: every schedule
# with dp, ZeRO, tp (+ sp), MoE's ep and the transformer, 16-bit activations and their
# gradients between the stages, within the derived tolerance (run/results.py
# mixed_tolerance); at S = 2^10 (docs/design.md: a rank's local-mean gradients overflow
# where one process's do not)
FP16 = {4: [dict(c, mixed="fp16", loss_scale=1024.0) for c in CONFIGS[4]]}


def label(fields: dict) -> str:
    keys = ("model", "dp", "tp", "sp", "ep", "pp", "schedule", "virtual", "microbatches",
            "optimizer", "zero", "grad_sync")
    return " ".join(f"{k}={fields[k]}" for k in keys if k in fields)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    return {n: sweep(n, CONFIGS[n] + FP16.get(n, []), tmp_path_factory.mktemp(f"pipeline{n}"),
                     timeout=240) for n in CONFIGS}


@pytest.mark.parametrize("n,index", CASES, ids=[label(CONFIGS[n][i]) for n, i in CASES])
def test_schedule_equals_one_process(runs, n, index):
    fields = CONFIGS[n][index]
    assert_equivalent(runs[n][index], reference(**fields), label=label(fields))


def test_every_schedule_of_4_ranks_in_fp16_is_within_the_derived_tolerance(runs):
    for index, fields in enumerate(FP16[4]):
        assert_within_mixed_tolerance(runs[4][len(CONFIGS[4]) + index], fields, 4,
                                      label(fields))


def expected_messages(cfg: TrainConfig, stage: int) -> dict[str, int]:
    """Messages one rank of pipeline stage `stage` sends and receives in a step: for each
    of its chunks (virtual stage v of pp V), M activations out unless v is last, M
    gradients back unless v is first; receives mirror that."""
    if cfg.schedule == "dualpipe":  # stage s and pp-1-s of two chains, M/2 microbatches each
        ends = sum((k > 0) + (k < cfg.pp - 1) for k in (stage, cfg.pp - 1 - stage))
        return {"Isend": cfg.microbatches // 2 * ends, "Recv": cfg.microbatches // 2 * ends}
    if cfg.schedule in V_SHAPED:  # chunks s and 2pp-1-s; the V's bottom needs no message
        last = 2 * cfg.pp - 1
        places = [stage, last - stage]
        crossing = [b for b in range(last) if b != cfg.pp - 1]
    else:
        last = cfg.pp * cfg.virtual - 1
        places = [chunk * cfg.pp + stage for chunk in range(cfg.virtual)]
        crossing = list(range(last))
    sends = recvs = 0
    for v in places:
        sends += cfg.microbatches * ((v in crossing) + (v - 1 in crossing))
        recvs += cfg.microbatches * ((v - 1 in crossing) + (v in crossing))
    return {"Isend": sends, "Recv": recvs}


@pytest.mark.parametrize("n,index", CASES, ids=[label(CONFIGS[n][i]) for n, i in CASES])
def test_ledger_one_activation_and_one_gradient_per_boundary(runs, n, index):
    cfg = TrainConfig(**CONFIGS[n][index]).resolved(n)
    size = math.prod(boundary_shape(cfg))  # elements of one message
    ledger = runs[n][index]["ledger"]
    per_rank: dict[int, dict[str, dict]] = defaultdict(dict)
    for record in ledger:
        if record["group"] == "pp":
            per_rank[record["rank"]][record["op"]] = record
    shape = MeshShape(cfg.dp, cfg.tp, cfg.pp)
    memory = json.loads((runs[n][index]["job_folder"] / "memory.json").read_text())
    for rank in range(n):
        expected = expected_messages(cfg, shape.coords(rank)["pp"])
        got = per_rank[rank]
        if cfg.schedule == "dualpipe":  # the gradients of both copies, once, to the mirror
            sent = got.pop("Sendrecv")
            assert sent["calls"] == 1 and sent["bytes"] == memory[rank]["grads"], (rank, sent)
        assert set(got) == {"Isend", "Recv"}, (rank, got)
        for op, calls in expected.items():
            assert got[op]["calls"] == calls, (rank, op, got[op])
            assert got[op]["elements"] == calls * size, (rank, op, got[op])
            assert got[op]["bytes"] == calls * size * 8, (rank, op, got[op])
    # across the pipeline: pp V - 1 boundaries, each one activation + one gradient per
    # microbatch, on every (dp, tp) replica of the pipeline
    total = sum(r["calls"] for r in ledger if r["group"] == "pp" and r["op"] == "Isend")
    boundaries = 2 * cfg.pp - 2 if cfg.schedule in V_SHAPED else cfg.pp * cfg.virtual - 1
    if cfg.schedule == "dualpipe":  # two chains of pp - 1 boundaries, M/2 microbatches each
        boundaries = cfg.pp - 1
    assert total == 2 * cfg.microbatches * boundaries * cfg.dp * cfg.tp


def test_dualpipe_holds_twice_the_parameters(runs):
    """DualPipe's rank r holds stage r and stage pp-1-r (of two copies): 1F1B's ranks r and
    pp-1-r together, so over the pipeline exactly twice the parameters (memory.json: the
    bytes each rank measured), and as many gradients."""
    def bytes_held(fields: dict) -> list[dict]:
        at = next(i for i, c in enumerate(CONFIGS[4]) if c == fields)
        return json.loads((runs[4][at]["job_folder"] / "memory.json").read_text())

    pp = 4
    one = bytes_held(dict(SMALL, pp=pp, dp=1, schedule="1f1b", microbatches=8,
                          optimizer="adam"))
    two = bytes_held(dict(DUALPIPE, pp=pp, microbatches=8, optimizer="adam"))
    for r in range(pp):
        for kind in ("params", "grads", "optimizer"):
            assert two[r][kind] == one[r][kind] + one[pp - 1 - r][kind], (r, kind)
    assert sum(m["params"] for m in two) == 2 * sum(m["params"] for m in one)


def test_pipeline_flags_are_checked_before_any_communication():
    def first_problem(**fields: object) -> list[str]:
        return problems(TrainConfig(**fields).resolved(4), 4)

    assert first_problem(pp=4, microbatches=4) == []
    assert first_problem(pp=2, schedule="zb-h1", microbatches=2) == []
    assert first_problem(pp=4, schedule="interleaved", virtual=2, microbatches=4) == []
    assert first_problem(pp=4, schedule="interleaved", microbatches=2) == []  # V = 1: 1F1B
    bad = first_problem(pp=4, schedule="interleaved", virtual=2, microbatches=2)
    assert bad and "--microbatches divisible by --pp 4" in bad[0]
    bad = problems(TrainConfig(schedule="interleaved", virtual=2).resolved(1), 1)
    assert bad and "--virtual 2 needs --pp 2" in bad[0]
    bad = first_problem(pp=4, virtual=2, microbatches=4)
    assert bad and "needs --schedule interleaved" in bad[0]
    assert first_problem(pp=4, schedule="zb-v", microbatches=1, layers=8) == []
    assert first_problem(pp=2, schedule="dualpipev", microbatches=4, layers=4) == []
    bad = first_problem(pp=4, schedule="dualpipev", microbatches=4, layers=8)
    assert bad and "at least 2 x --pp = 8 (got 4)" in bad[0]
    bad = first_problem(pp=4, schedule="zb-v", microbatches=4, layers=4)
    assert bad and "--layers divisible by 2 x --pp 4" in bad[0]
    bad = problems(TrainConfig(schedule="zb-v").resolved(1), 1)
    assert bad and "needs --pp 2 or more" in bad[0]
    assert first_problem(pp=4, schedule="dualpipe", microbatches=8, layers=8) == []
    bad = problems(TrainConfig(pp=3, schedule="dualpipe", microbatches=8, layers=6
                               ).resolved(3), 3)
    assert bad and "needs an even --pp, 2 or more (got 3)" in bad[0]
    bad = first_problem(pp=4, schedule="dualpipe", microbatches=6, layers=8, batch=48)
    assert bad and "even --microbatches, at least 2 x --pp = 8 (got 6)" in bad[0]
    bad = first_problem(pp=2, schedule="dualpipe", microbatches=5, layers=4, batch=40)
    assert bad and "even --microbatches" in bad[0]
    bad = first_problem(pp=2, dp=2, schedule="dualpipe", microbatches=4, layers=4, zero=1)
    assert bad and "--zero 0 and --grad-sync bucketed only" in bad[0]


def test_boundary_shape_is_a_microbatch_of_rows_by_d():
    cfg = TrainConfig(batch=64, microbatches=4, dp=2, pp=2, d_model=16).resolved(4)
    assert boundary_shape(cfg) == (8, 16)
    assert boundary_shape(TrainConfig(batch=64, microbatches=4, dp=1, tp=2, pp=2, sp=True,
                                      d_model=16).resolved(4)) == (8, 16)


# ----------------------------------------------------------------- the lesson
def test_lesson_shows_the_48_layer_example_bubble_memory_and_equivalence():
    # tests/teaching/test_lessons.py's run
    job, _ = lesson_run(4, "04_pipeline_parallel.py", "--quick")
    assert job.returncode == 0 and not job.timed_out, job.explain()
    out = job.stdout
    for rank, (first, last) in enumerate([(1, 12), (13, 24), (25, 36), (37, 48)]):
        assert re.search(rf"\[rank {rank}\] layers {first}-{last}\b", out), out
    assert "[rank 0] layers 1-6 + embedding, layers 25-30" in out  # --virtual 2
    assert "[rank 0] layers 1-6 + embedding, layers 43-48 + head" in out  # the V
    assert "[rank 3] layers 19-24, layers 25-30 (" in out
    # 1F1B, pp = 4, M = 4, worked by hand: warm-up F1-F3, F4, then B1 once it is back
    assert "rank 0: F1 F2 F3 F4 .  .  .  .  .  .  B1 B1 .  B2 B2 .  B3 B3 .  B4 B4" in out
    table = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+"
                       r"\s+[\d.]+$", out, re.M)
    assert [int(row[0]) for row in table] == [1, 4, 8, 16], out
    for m, formula, simulated, replayed, measured in table:
        expected = f"{3 / (int(m) + 3):.3f}"
        assert formula == simulated == expected, (m, formula, simulated)
        assert 0.0 <= float(measured) < 1.0 and 0.0 <= float(replayed) < 1.0
    assert "4 ranks on" in out and "replayed CPU times" in out
    assert "gpipe: simulator [8, 8, 8, 8], real run [8, 8, 8, 8]" in out
    assert "1f1b: simulator [4, 3, 2, 1], real run [4, 3, 2, 1]" in out
    assert "zb-v: simulator [8, 8, 8, 8], real run [8, 8, 8, 8]" in out
    assert "dualpipev: simulator [9, 9, 9, 9], real run [9, 9, 9, 9]" in out
    assert "dualpipe: simulator [5, 5, 5, 5], real run [5, 5, 5, 5]" in out
    # the papers' per-rank bubble: M, 1f1b, zb-h1, zb-v, dualpipev, dualpipe (pp = 4), in
    # stage units: a V's chunk is half a stage (F = B = W = 0.5), DualPipe's a whole one
    bubbles = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\S+)\s+(\S+)$", out,
                         re.M)
    assert bubbles == [("6", "9", "3", "0.5", "-", "-"), ("7", "9", "3", "0", "-", "-"),
                       ("8", "9", "3", "0", "3", "2"), ("16", "9", "3", "0", "3", "2")], out
    # one unit rule: at M = 8 ZB-V does 1F1B's work (3M = 24 units) in T = 25.5 against 33
    assert "1f1b 33," in out and "zb-v 25.5," in out, out
    checks = re.findall(r"(\S+): bubble replayed .*\n\s+rank 0 ran its program in order: "
                        r"(\w+); max rel diff "
                        r"losses (\S+), params (\S+) -> (\w+)$", out, re.M)
    assert [c[0] for c in checks] == ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v",
                                      "dualpipev", "dualpipe"], out
    for name, in_order, losses, params, verdict in checks:
        assert in_order == "yes" and float(losses) <= 1e-9 and float(params) <= 1e-9, name
        assert verdict == "OK", name
