"""Mixed precision (`--mixed bf16|fp16`, docs/design.md "Mixed precision") on a mesh:
the MLP and MoE models under DP (every sync), ZeRO 1-3, tp, sp, ep, every pipeline
schedule, gradient clipping and checkpoints; the transformer (gpt, gpt-moe) with
vocabulary, context (allgather/ring/zigzag/ulysses) parallelism and recomputation.

One mpiexec job of 4 ranks trains every config below; each is compared with the
one-process run in the same precision under the tolerance derived in
run/results.py (`mixed_tolerance`: from the unit roundoff and the step count), and:
- the replica check ran on every rank after every step (agreement.replica_check raises
  ReplicaError on all ranks at once, which would end the job: the sweep passing means
  every copy of a replicated parameter, and S, was bitwise equal after every step);
- the ledger counts 2 bytes per element for every 16-bit collective (ZeRO's Allgather,
  the pipeline's activations and their gradients, and the gradient reduction under
  --grad-reduce-dtype low), the master dtype's bytes for the rest;
- checkpoints: an fp16 run and a bf16 run saved after 2 steps resume bit for bit on
  their own mesh and within the tolerance on another (ZeRO-0 from ZeRO-2; dp 4 with
  ZeRO-1 from dp 2 x tp 2);
- the three mixed-precision bugs (bugs/catalog.py MIXED_BUGS), each beside the correct
  run of its flags: found_inf decided per rank is stopped by the replica check, no
  master weights exceed the derived tolerance, tp shares summed in 16 bits pass it
  (one rounding more, of the size it allows) and the ledger shows their 2-byte words;
- fp16 with a huge initial S overflows: every rank skips the same steps, S halves
  until the gradients fit, and matches the one-process run's S and skips.

    python -m pytest tests/parallel/test_mixed.py
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from minipar.bugs.catalog import MIXED_BUGS
from minipar.bugs.catalog import listing as catalog_listing
from minipar.core import precision
from minipar.run.agreement import ReplicaError, replica_check
from minipar.run.results import mixed_tolerance, moved_difference, relative_difference
from minipar.run.train import problems
from minipar.settings.config import TrainConfig
from tests.conftest import reference
from tests.harness.mpi import sweep

SMALL = dict(layers=2, d_model=16, batch=16, steps=3, microbatches=2)
GPT = dict(model="gpt", layers=2, d_model=16, heads=2, seq_len=8, batch=8, steps=3)
CONFIGS = [
    dict(SMALL, mixed="bf16", grad_sync="naive"),
    dict(SMALL, mixed="bf16", grad_sync="bucketed", optimizer="adam"),
    dict(SMALL, mixed="bf16", grad_sync="overlapped", grad_reduce_dtype="low"),
    dict(SMALL, mixed="bf16", zero=1, optimizer="adam"),
    dict(SMALL, mixed="bf16", zero=2, grad_reduce_dtype="low"),
    dict(SMALL, mixed="bf16", zero=3, optimizer="adam"),
    dict(SMALL, mixed="fp16", grad_sync="bucketed", optimizer="adam", dtype="float32"),
    dict(SMALL, mixed="fp16", zero=1, grad_reduce_dtype="low"),
    dict(SMALL, mixed="fp16", zero=2, optimizer="adam"),
    dict(SMALL, mixed="fp16", zero=3, grad_reduce_dtype="low"),
    # pipelines: 16-bit activations and activation gradients between the stages
    dict(SMALL, mixed="fp16", dp=2, pp=2, layers=4, microbatches=4),
    dict(SMALL, mixed="bf16", dp=2, pp=2, layers=4, microbatches=4, schedule="zb-h1"),
    dict(SMALL, mixed="fp16", dp=2, pp=2, layers=4, microbatches=4, schedule="interleaved",
         virtual=2, zero=1, optimizer="adam"),
    dict(SMALL, mixed="bf16", dp=2, pp=2, layers=4, microbatches=4, schedule="dualpipe"),
    dict(SMALL, mixed="fp16", pp=4, layers=4, microbatches=4, schedule="gpipe",
         grad_reduce_dtype="low"),
    # tensor (and sequence) parallelism: fc2's partial sums added in the master dtype
    dict(SMALL, mixed="bf16", dp=2, tp=2),
    dict(SMALL, mixed="fp16", dp=2, tp=2, sp=True, zero=1),
    dict(SMALL, mixed="bf16", tp=2, pp=2, layers=4, microbatches=4, sp=True),
    # MoE: the router's probabilities and the aux loss in the master dtype, 16-bit
    # tokens through the Alltoallv; and gradient clipping on the unscaled gradients
    dict(SMALL, mixed="bf16", model="moe", experts=4, expert_d_ff=16, dp=4, ep=2),
    dict(SMALL, mixed="fp16", model="moe", experts=4, expert_d_ff=16, dp=2, ep=2, pp=2,
         zero=1, layers=4, microbatches=4),
    dict(SMALL, mixed="fp16", dp=4, zero=2, clip_grad_norm=0.05),
    dict(SMALL, mixed="bf16", dp=2, tp=2, clip_grad_norm=0.05, optimizer="adam"),
    # the transformer: attention's scores and softmax in the master dtype, P and V 16-bit
    # in P V; vocabulary parallelism, context parallelism (the ring's K/V blocks and
    # Ulysses' Alltoalls as 16-bit words), gpt-moe with recomputation
    dict(GPT, mixed="bf16", tp=2, cp=2, cp_mode="zigzag", sp=True),
    dict(GPT, mixed="fp16", dp=2, cp=2, cp_mode="ring", zero=2),
    dict(GPT, mixed="bf16", cp=2, pp=2, cp_mode="ulysses", microbatches=2),
    dict(GPT, mixed="fp16", model="gpt-moe", experts=4, expert_d_ff=16, dp=2, ep=2, tp=2,
         recompute="full"),
    # the schedules and the cp mode not above: ZB-V and DualPipeV (V chunks), allgather
    # cp; a 4-D mesh of the transformer (tp x pp with cp), gpt-moe's experts under ZeRO-1
    dict(SMALL, mixed="bf16", pp=2, dp=2, layers=4, microbatches=4, schedule="zb-v"),
    dict(SMALL, mixed="fp16", pp=2, dp=2, layers=4, microbatches=4, schedule="dualpipev",
         zero=1),
    dict(GPT, mixed="bf16", dp=2, cp=2, cp_mode="allgather", optimizer="adam"),
    dict(GPT, mixed="fp16", tp=2, pp=2, microbatches=2, layers=4, zero=0),
    dict(GPT, mixed="bf16", model="gpt-moe", experts=4, expert_d_ff=16, dp=4, ep=2, zero=1),
    # --fp8 (core/fp8.py) on top of bf16: each recipe over tp (the weights' amaxes in one
    # tp Allreduce a step, fc2's input and fc1's output gradient agreed over tp), dp
    # (tensorwise: X and dY over the replicas), ZeRO 1-3 (weights whole in compute), a
    # pipeline, the experts over ep (a rank may hold no token of an expert: amax 0)
    dict(SMALL, mixed="bf16", fp8="tensorwise", dp=2, tp=2),
    dict(SMALL, mixed="bf16", fp8="rowwise", dp=2, tp=2, optimizer="adam"),
    dict(SMALL, mixed="bf16", fp8="blockwise", fp8_block=16, dp=2, tp=2, fp8_grad="e4m3"),
    dict(SMALL, mixed="bf16", fp8="tensorwise", zero=3),
    dict(SMALL, mixed="bf16", fp8="rowwise", zero=1),
    dict(SMALL, mixed="bf16", fp8="blockwise", fp8_block=8, zero=2),
    dict(SMALL, mixed="bf16", fp8="tensorwise", dp=2, pp=2, layers=4, microbatches=4,
         schedule="zb-h1"),
    dict(SMALL, mixed="bf16", fp8="tensorwise", model="moe", experts=4, expert_d_ff=16,
         dp=4, ep=2),
    dict(GPT, mixed="bf16", fp8="rowwise", tp=2, dp=2),
    dict(GPT, mixed="bf16", fp8="blockwise", fp8_block=8, model="gpt-moe", experts=4,
         expert_d_ff=16, dp=2, pp=2, layers=4, microbatches=2),
    # --recompute full: each X quantized again in the backward, its amax agreed again;
    # cp cuts every sequence's positions: a tensorwise amax over dp x cp, a row (one
    # position) whole; sp: the linears see all positions (after its Allgather);
    # gpt-moe over tp: every tp rank runs the whole experts
    dict(GPT, mixed="bf16", fp8="tensorwise", dp=2, tp=2, recompute="full"),
    dict(GPT, mixed="bf16", fp8="tensorwise", tp=2, cp=2, cp_mode="ring"),  # dp 1: the
    # amax over dp alone would make no call where the ledger predicts dp x cp's
    dict(GPT, mixed="bf16", fp8="rowwise", tp=2, cp=2, cp_mode="zigzag", sp=True),
    dict(GPT, mixed="bf16", fp8="tensorwise", model="gpt-moe", experts=4, expert_d_ff=16,
         dp=2, ep=2, tp=2, sp=True),
    # ZeRO-3 over tp shards: the slices' amaxes over dp, then the shards' over tp
    dict(SMALL, mixed="bf16", fp8="rowwise", dp=2, tp=2, zero=3, fp8_allgather=True),
    # the MLP MoE's experts split over tp: blockwise (a tile never crosses a shard);
    # tensorwise (fc1's and fc2's amaxes over tp, then X and dY over edp, beside the
    # split experts' gradient Allreduce) and rowwise (a row of fc2's X or fc1's dY over
    # tp: as many amaxes as rows received, the ledger's per-row line), with ep;
    # DualPipe (two model copies, M/2 each) and DualPipeV with fp8
    dict(SMALL, mixed="bf16", fp8="blockwise", fp8_block=8, model="moe", experts=4,
         expert_d_ff=16, dp=2, tp=2, zero=3, fp8_allgather=True),
    dict(SMALL, mixed="bf16", fp8="tensorwise", model="moe", experts=4, expert_d_ff=16,
         dp=2, tp=2),
    dict(SMALL, mixed="bf16", fp8="rowwise", model="moe", experts=4, expert_d_ff=16,
         dp=2, ep=2, tp=2, zero=2, optimizer="adam"),
    dict(SMALL, mixed="bf16", fp8="tensorwise", dp=2, pp=2, layers=4, microbatches=4,
         schedule="dualpipe"),
    dict(SMALL, mixed="bf16", fp8="rowwise", model="moe", experts=4, expert_d_ff=16,
         tp=2, pp=2, layers=4, microbatches=4, schedule="dualpipev"),
    # ZeRO-3's gathers in 8 bits (--fp8-allgather): beside the same run in bf16 words
    dict(SMALL, mixed="bf16", fp8="blockwise", fp8_block=8, zero=3),
    dict(SMALL, mixed="bf16", fp8="blockwise", fp8_block=8, zero=3, fp8_allgather=True),
    dict(GPT, mixed="bf16", fp8="tensorwise", model="gpt-moe", experts=4, expert_d_ff=16,
         dp=4, ep=2, zero=3, fp8_allgather=True),
    # S = 2^20: the scaled gradients overflow fp16 (max 65504) until S has halved; after
    # 2 clean steps S doubles, and overflows again
    dict(SMALL, mixed="fp16", zero=2, steps=6, loss_scale=2.0 ** 20, loss_scale_window=2),
]
# checkpoints hold the masters and S: 2 of the 6 steps above saved, then resumed on the
# same mesh (bitwise the run above) and under another strategy (ZeRO-0: within the
# tolerance, and the one-process run's S)
RESUMES = [dict(CONFIGS[-1], steps=2, save="{ckpt}"),
           dict(CONFIGS[-1], resume="{ckpt}"),
           dict(CONFIGS[-1], zero=0, grad_sync="naive", resume="{ckpt}")]
# and a bf16 run: 4 steps straight, 2 saved on dp 2 x tp 2, then resumed there and on
# dp 4 with ZeRO-1
BF16_RUN = dict(SMALL, mixed="bf16", dp=2, tp=2, steps=4)
RESUMES += [BF16_RUN, dict(BF16_RUN, steps=2, save="{ckpt16}"),
            dict(BF16_RUN, resume="{ckpt16}"),
            dict(BF16_RUN, dp=4, tp=1, zero=1, resume="{ckpt16}")]


# the mixed-precision bugs (bugs/catalog.py MIXED_BUGS, the fp8 ones too), each beside the correct
# run of its own flags, in the same job
BUGS = {name: dict(SMALL, **bug.flags) for name, bug in MIXED_BUGS.items()}
BUG_RUNS = [run for name, flags in BUGS.items()
            for run in (dict(flags, inject_bug=name, check_placements=False), flags)]


# `--check` under the same decisions (run/results.py): two commands, exactly as a user
# types them on 4 ranks, whose one-process run takes other discrete decisions than the
# mesh (an fp16 skip a rounding apart; top-2 choices flipped by a rounding) and which
# pass once the reference replays the mesh's decisions, each differing step named
CHECKS = [
    "train --mixed fp16 --dtype float32 --dp 2 --tp 2 --zero 1 --optimizer adam --lr 0.01 "
    "--loss-scale 67108864 --steps 12 --check",
    "train --model gpt-moe --layers 4 --mixed fp16 --dp 2 --cp 2 --cp-mode ulysses --steps 2 "
    "--check",
    "train --model gpt-moe --layers 4 --mixed fp16 --dp 2 --cp 2 --cp-mode zigzag --steps 1 "
    "--check",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed")
    resumes = [{k: str(folder / v.strip("{}")) if str(v).startswith("{ckpt") else v
                for k, v in c.items()} for c in RESUMES]
    return sweep(4, CONFIGS + resumes + BUG_RUNS + [{"cli": c.split()} for c in CHECKS],
                 folder, timeout=420)


@pytest.mark.parametrize("index", range(len(CHECKS)))
def test_check_replays_the_mesh_runs_decisions_and_passes(runs, index):
    run = runs[len(CONFIGS) + len(RESUMES) + len(BUG_RUNS) + index]
    out = run["out"]
    assert run["code"] == 0, f"{CHECKS[index]}\n{out}"
    verdict = [line for line in out.splitlines() if line.startswith("check against")]
    assert len(verdict) == 1 and verdict[0].endswith("-> OK"), out
    assert "(tolerance " in verdict[0] and "= e = 2u sqrt(D)" in verdict[0], out  # derived
    decided = [line for line in out.splitlines() if line.startswith("decision differs")]
    assert decided, f"{CHECKS[index]}: no decision differed any more\n{out}"
    for line in decided:   # the step, the margin, and what the numbers were compared under
        assert line.startswith("decision differs, step ") and "compared under this run's " \
            "decisions" in line, line
    if index == 0:   # fp16's skips: the largest scaled gradients beside fp16's 65504
        assert all("overflowed fp16" in line and "65504" in line for line in decided), out
    else:            # top-2 choices a rounding apart
        assert all(re.search(r"\d+ token\(s\) chose other top-2 experts here than in one "
                             r"process \(scores \S+ apart", line) for line in decided), out
    assert "ledger against the formulas: every line of 4 ranks as predicted" in out, out
    assert re.search(r"memory against the formulas: rank 0 holds (\d+) bytes of parameters, "
                     r"the formula \1 \(", out), out


def bug_runs(runs: list, name: str) -> tuple[dict, dict, dict]:
    """(the buggy run, the correct run of the same flags, those flags)."""
    i = len(CONFIGS) + len(RESUMES) + 2 * list(BUGS).index(name)
    return runs[i], runs[i + 1], BUGS[name]


def label(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items() if k not in SMALL or k == "model")


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_mixed_run_within_the_derived_tolerance(runs, index):
    cfg, run = CONFIGS[index], runs[index]
    ref = reference(**cfg)
    loss_tol, param_tol = mixed_tolerance(TrainConfig(**cfg).resolved(4))
    loss_rel = relative_difference(run["losses"], ref.losses)
    moved, where = moved_difference(run["final"], ref.final, ref.init)
    assert loss_rel <= loss_tol, f"{label(cfg)}: losses {loss_rel:.3g} > {loss_tol:.3g}"
    assert moved <= param_tol, f"{label(cfg)}: {where} {moved:.3g} > {param_tol:.3g}"
    # the masters are what ends up in final.npz: in --dtype, not rounded to 16 bits
    low = precision.low_dtype(cfg["mixed"])
    name = "embed.weight" if "embed.weight" in run["final"] else "tok_embed.weight"
    assert run["final"][name].dtype == np.dtype(cfg.get("dtype", "float64")), label(cfg)
    assert not np.array_equal(run["final"][name].astype(low).astype(np.float64),
                              run["final"][name]), f"{label(cfg)}: masters look 16-bit"
    # S and the skips: one value on every rank, the one-process run's
    mixed = json.loads((run["job_folder"] / "rank_mixed.json").read_text())
    assert all(m == mixed[0] for m in mixed), f"{label(cfg)}: ranks disagree on S: {mixed}"
    assert (mixed[0]["loss_scale"], mixed[0]["skipped"]) == (
        ref.extras["loss_scale"], ref.extras["skipped"]), label(cfg)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_16_bit_collectives_count_two_bytes(runs, index):
    cfg, run = CONFIGS[index], runs[index]
    master = np.dtype(cfg.get("dtype", "float64")).itemsize
    low_reduce = cfg.get("grad_reduce_dtype") == "low"
    for r in run["ledger"]:
        if r["op"] == "Allreduce" and r["elements"] == r["calls"]:
            # scalars: the found_inf vote (int32, over the world), the clip's norm (float)
            assert r["bytes"] in (4 * r["calls"], master * r["calls"]), r
            continue
        if cfg.get("fp8") and r["op"] == "Allreduce":   # + float32 amaxes: see below
            continue
        if cfg.get("fp8_allgather") and r["op"] == "Allgatherv":   # 8-bit words: below
            continue
        if r["op"] == "Alltoall" and r["group"] == "ep":   # MoE's token counts (int64)
            assert r["bytes"] == 8 * r["elements"], r
            continue
        moves_only = r["op"] in ("Allgatherv", "Allgather", "Isend", "Irecv", "Recv",
                                 "Sendrecv", "Alltoall", "Alltoallv")  # 16-bit words
        if r["op"] == "Sendrecv" and r["group"] == "pp":   # DualPipe's gradient copies
            moves_only = False
        # sums: DP/ZeRO's in 16 bits under --grad-reduce-dtype low; tp's partial sums
        # (and DualPipe's gradient copies) in the master dtype
        low_sum = low_reduce and r["group"] == "dp"
        itemsize = 2 if moves_only or low_sum else master
        assert r["bytes"] == itemsize * r["elements"], f"{label(cfg)}: {r}"


FP8 = [i for i, cfg in enumerate(CONFIGS) if cfg.get("fp8")]


@pytest.mark.parametrize("index", FP8)
def test_fp8_amax_allreduces_are_the_predicted_ledger_lines(runs, index):
    """Every rank's last-step ledger as ledger_tables predicts it, the amax Allreduces
    (float32, core/fp8.py expected_ledger) included: the tensorwise and rowwise runs
    have some (rowwise: with tp), the blockwise none but the model's own (but under
    ZeRO-3: its sliced weights' amaxes, one call)."""
    from minipar.teaching.ledger_tables import ledger_differences

    cfg = TrainConfig(**CONFIGS[index]).resolved(4)
    assert ledger_differences(runs[index]["ledger"], cfg) == [], label(CONFIGS[index])
    amaxes = [r for r in runs[index]["ledger"] if r["op"] == "Allreduce"
              and r["bytes"] < 8 * r["elements"] and r["rank"] == 0]   # float32s in it
    # tensorwise agrees every X and dY; rowwise only rows cut over tp; blockwise nothing
    expected = cfg.fp8 == "tensorwise" or (cfg.fp8 == "rowwise" and cfg.tp > 1) \
        or cfg.zero == 3   # ZeRO-3: the sliced weights' amaxes, whatever the recipe
    assert bool(amaxes) == expected, (label(CONFIGS[index]), amaxes)


def test_fp8_allgather_moves_a_byte_a_weight_and_changes_no_number(runs):
    """--fp8-allgather: the same run as ZeRO-3's 16-bit gathers, bit for bit (the matmul
    requantizes the gathered weight to the same bytes), with 1 byte a block weight's
    element on the wire and 2 for the rest: at this size 0.30 of float32's bytes (the
    weights alone: 0.25), every line as the ledger predicts."""
    index = CONFIGS.index(dict(SMALL, mixed="bf16", fp8="blockwise", fp8_block=8, zero=3,
                               fp8_allgather=True))
    eight, sixteen = runs[index], runs[index - 1]
    assert eight["losses"] == sixteen["losses"]
    for name, value in sixteen["final"].items():
        assert np.array_equal(eight["final"][name], value), name

    def gathered(run: dict) -> dict:
        return next(r for r in run["ledger"] if r["op"] == "Allgatherv" and r["rank"] == 0)
    words, plain = gathered(eight), gathered(sixteen)
    assert words["calls"] == plain["calls"] and plain["bytes"] == 2 * plain["elements"]
    weights = 2 * 2 * 16 * 64 * 2 * 2       # fc1 + fc2 of 2 blocks, 2 gathers x 2 microbatches
    assert words["bytes"] == weights + 2 * (plain["elements"] - weights)
    assert 0.25 < words["bytes"] / (4 * plain["elements"]) < 0.3
    assert weights / (4 * weights) == 0.25


def test_fp16_overflow_skips_on_every_rank_together(runs):
    cfg, run = CONFIGS[-1], runs[len(CONFIGS) - 1]
    mixed = json.loads((run["job_folder"] / "rank_mixed.json").read_text())
    histories = [m["scale_history"] for m in mixed]
    assert all(h == histories[0] for h in histories), histories
    skips = [skipped for _, skipped in histories[0]]
    assert skips[0] and not all(skips), histories[0]   # overflowed first, then trained
    scales = [scale for scale, _ in histories[0]]
    for (s, skipped), nxt in zip(histories[0], scales[1:]):  # halved on a skip
        assert nxt == s / 2 if skipped else nxt in (s, 2 * s), histories[0]
    assert any(b == 2 * a for a, b in zip(scales, scales[1:])), histories[0]  # it grew
    assert scales[0] == 2.0 ** 20 and mixed[0]["skipped"] == sum(skips)
    # the skipped steps left the parameters alone: the loss of the step after a skip
    # is computed from the same parameters, on other data, so only the count is checked
    assert mixed[0]["skipped"] == reference(**cfg).extras["skipped"]


def test_replica_check_stops_on_one_differing_copy():
    """replica_check's verdict: the same on every rank, raised when two ranks' digests
    of one parameter differ (a fake world hands back two ranks' digests)."""
    w = np.ones((2, 2))
    p = SimpleNamespace(name="w", full_index=None, data=w)
    chunk = SimpleNamespace(parameters=lambda: [p])
    updater = SimpleNamespace(precision=SimpleNamespace(scaler=precision.LossScaler(4.0)),
                              masters=None)

    class World:
        def __init__(self, other: np.ndarray) -> None:
            self.other = other

        def allgather(self, mine: dict) -> list[dict]:
            p.data = self.other
            theirs = {}
            replica_check(SimpleNamespace(world=SimpleNamespace(
                allgather=lambda d: theirs.update(d) or [d])), [chunk], updater, 1)
            p.data = w
            return [mine, theirs]

    replica_check(SimpleNamespace(world=World(w.copy())), [chunk], updater, 1)
    bumped = w.copy()
    bumped[0, 0] = np.nextafter(1.0, 2.0)   # one ulp: bitwise different
    with pytest.raises(ReplicaError, match="w on rank 1"):
        replica_check(SimpleNamespace(world=World(bumped)), [chunk], updater, 1)


def test_resume_continues_from_the_masters_and_s(runs):
    whole, resumed, elsewhere = runs[len(CONFIGS) - 1], *runs[len(CONFIGS) + 1:len(CONFIGS) + 3]
    assert resumed["losses"] == whole["losses"]      # the same mesh: bit for bit
    for name, value in whole["final"].items():
        assert np.array_equal(resumed["final"][name], value), name
    cfg = CONFIGS[-1]
    mixed = [json.loads((r["job_folder"] / "rank_mixed.json").read_text())[0]
             for r in (whole, resumed, elsewhere)]
    assert mixed[1]["scale_history"] == mixed[0]["scale_history"][2:]  # S went on
    ref = reference(**cfg)                            # another mesh: within tolerance
    for m in mixed:
        assert (m["loss_scale"], m["skipped"]) == (ref.extras["loss_scale"],
                                                   ref.extras["skipped"]), mixed
    loss_tol, param_tol = mixed_tolerance(TrainConfig(**cfg).resolved(4))
    assert relative_difference(elsewhere["losses"], ref.losses) <= loss_tol
    assert moved_difference(elsewhere["final"], ref.final, ref.init)[0] <= param_tol


def within(run: dict, cfg: dict) -> tuple[bool, bool, str]:
    """(losses within the derived tolerance, parameters within it, what was measured)."""
    ref = reference(**cfg)
    loss_tol, param_tol = mixed_tolerance(TrainConfig(**cfg).resolved(4))
    loss_rel = relative_difference(run["losses"], ref.losses)
    moved, where = moved_difference(run["final"], ref.final, ref.init)
    return (loss_rel <= loss_tol, moved <= param_tol,
            f"losses {loss_rel:.3g} (<= {loss_tol:.3g}?), {where} {moved:.3g} "
            f"(<= {param_tol:.3g}?)")


def test_found_inf_per_rank_is_stopped_by_the_replica_check(runs):
    buggy, correct, cfg = bug_runs(runs, "mp-found-inf-per-rank")
    # one stage overflowed alone, halved its S and skipped; the other stepped
    assert "loss scale S" in buggy.get("replica_error", ""), buggy.keys()
    assert "not bitwise equal" in buggy["replica_error"]
    assert all(within(correct, cfg)[:2]), within(correct, cfg)[2]     # the vote: fine
    mixed = json.loads((correct["job_folder"] / "rank_mixed.json").read_text())
    assert mixed[0]["skipped"] >= 1 and all(m == mixed[0] for m in mixed), mixed


def test_no_master_weights_exceeds_the_derived_tolerance(runs):
    buggy, correct, cfg = bug_runs(runs, "mp-no-master-weights")
    assert all(within(correct, cfg)[:2]), within(correct, cfg)[2]
    losses_ok, params_ok, said = within(buggy, cfg)
    assert not params_ok, f"the lost updates went unseen: {said}"


def tp_allreduce_bytes(run: dict) -> set[int]:
    """Bytes per element of the tp Allreduces in the last step's ledger."""
    return {r["bytes"] // r["elements"] for r in run["ledger"]
            if r["group"] == "tp" and r["op"] == "Allreduce" and r["elements"]}


def test_tp_partials_in_16_bits_pass_the_tolerance_and_the_ledger_catches_them(runs):
    buggy, correct, cfg = bug_runs(runs, "mp-tp-partials-in-bf16")
    assert all(within(correct, cfg)[:2]), within(correct, cfg)[2]
    # one more rounding a share: within what the tolerance allows (docs/design.md says
    # why it cannot be otherwise), but measurably not the correct run
    assert all(within(buggy, cfg)[:2]), within(buggy, cfg)[2]
    assert buggy["losses"] != correct["losses"]
    master = np.dtype(cfg.get("dtype", "float64")).itemsize
    # per block one Allreduce forward (g: the shares) and one backward (f's gradient),
    # the same elements: correct, both in the master dtype; the bug's forward ones in 2
    assert tp_allreduce_bytes(correct) == {master}
    assert tp_allreduce_bytes(buggy) == {(master + 2) // 2}
    calls = {(r["rank"], r["calls"], r["elements"]) for r in correct["ledger"]
             if r["group"] == "tp" and r["op"] == "Allreduce"}
    assert calls == {(r["rank"], r["calls"], r["elements"]) for r in buggy["ledger"]
                     if r["group"] == "tp" and r["op"] == "Allreduce"}


@pytest.mark.parametrize("bug,line", [
    ("fp8-local-amax", "tp Allreduce: "),                 # shards on their own scales
    ("fp8-block-straddles-shard", "dp Allreduce: 0 calls"),  # other scales for some blocks
])
def test_an_fp8_scale_bug_passes_the_tolerance_and_the_ledger_catches_it(runs, bug, line):
    from minipar.teaching.ledger_tables import ledger_differences

    buggy, correct, cfg = bug_runs(runs, bug)
    assert all(within(correct, cfg)[:2]), within(correct, cfg)[2]
    assert buggy["losses"] != correct["losses"]
    resolved = TrainConfig(**cfg).resolved(4)
    assert ledger_differences(correct["ledger"], resolved) == []
    missing = ledger_differences(buggy["ledger"], resolved)
    assert len(missing) == 1 and missing[0].startswith(line), missing


def test_fp8_accumulate_in_low_exceeds_the_derived_tolerance(runs):
    buggy, correct, cfg = bug_runs(runs, "fp8-accumulate-in-low")
    assert all(within(correct, cfg)[:2]), within(correct, cfg)[2]
    losses_ok, params_ok, said = within(buggy, cfg)
    assert not params_ok, f"8-bit partial sums went unseen: {said}"


@pytest.mark.parametrize("name", list(MIXED_BUGS))
def test_a_mixed_bug_fits_its_flags_and_needs_mixed(name):
    bug = MIXED_BUGS[name]
    assert problems(TrainConfig(**BUGS[name], inject_bug=name).resolved(4), 4) == []
    without = {k: v for k, v in BUGS[name].items()
               if k not in ("mixed", "loss_scale", "loss_scale_window", "fp8", "fp8_block")}
    assert problems(TrainConfig(**without, inject_bug=name).resolved(4), 4) == [
        f"--inject-bug {name} needs {bug.requires}"]
    lesson_8 = problems(TrainConfig(**BUGS[name], inject_bug="dp-sum-not-mean").resolved(4), 4)
    assert any("lesson 08's full-precision bugs" in line for line in lesson_8), lesson_8
    assert f"--inject-bug {name} --check" in catalog_listing()


def test_a_bf16_run_resumes_bit_for_bit_on_its_mesh_and_within_the_tolerance_elsewhere(runs):
    start = len(CONFIGS) + 3
    whole, _, same, other = runs[start:start + 4]
    assert same["losses"] == whole["losses"]           # the masters went on, bit for bit
    for name, value in whole["final"].items():
        assert np.array_equal(same["final"][name], value), name
    ref = reference(**BF16_RUN)                        # another mesh: within the tolerance
    loss_tol, param_tol = mixed_tolerance(TrainConfig(**BF16_RUN).resolved(4))
    assert relative_difference(other["losses"], ref.losses) <= loss_tol
    assert moved_difference(other["final"], ref.final, ref.init)[0] <= param_tol


def test_moved_difference_measures_state_without_an_initial_value_from_zero():
    """The router's b is no parameter (init has none): its movement is measured from 0,
    as it starts (`--check --mixed` with --router sigmoid-bias compares it too)."""
    init = {"w": np.zeros(2)}
    ref = {"w": np.array([1.0, 0.0]), "b": np.array([0.0, 2.0])}
    mine = {"w": np.array([1.0, 0.0]), "b": np.array([0.0, 2.2])}
    moved, where = moved_difference(mine, ref, init)
    assert where == "b" and moved == pytest.approx(0.1)


# --------------------------------------------- the replay, in one process (no MPI)
def test_replaying_ones_own_decisions_is_the_plain_run_bit_for_bit():
    """The float64 checks keep 1e-9: handed its own skips and routing choices, the
    reference is the plain one-process run exactly, and no decision line is printed;
    one token handed another expert, and one step handed a skip it did not take, are
    each named with their step."""
    from minipar.core import routing
    from minipar.run.results import Decisions, replayed_reference
    from minipar.run.train import train_reference

    cfg = TrainConfig(model="moe", experts=4, top_k=2, expert_d_ff=16, layers=2,
                      d_model=16, batch=16, steps=3, mixed="fp16", loss_scale=2.0 ** 20,
                      loss_scale_window=2).resolved(1)
    with routing.recording() as chosen, precision.replaying([]) as made:
        plain = train_reference(cfg)   # [] decisions: every step its own verdict
    own = made[-1].own
    assert any(own) and not all(own), own            # S = 2^20 overflows, then fits
    same, lines = replayed_reference(cfg, Decisions(skips=own, choices=chosen))
    assert lines == [] and same.losses == plain.losses
    assert all(np.array_equal(same.final[k], v) for k, v in plain.final.items())
    flipped = [c.copy() for c in chosen]
    flipped[-1][0] = (flipped[-1][0] + 1) % cfg.experts   # token 0 of the last call: others
    skips = [not own[0], *own[1:]]
    other, lines = replayed_reference(cfg, Decisions(skips=skips, largest=[7e4] * 3,
                                                     choices=flipped))
    assert lines[0].startswith("step 1: one process's scaled gradients overflowed fp16, this "
                               "run's stayed finite (its largest 7.0e4, 7% above") \
        and "65504" in lines[0], lines[0]
    assert lines[-1].startswith(f"step {cfg.steps}: 1 token(s) chose other top-2 experts")
    assert other.extras["skipped"] == sum(skips)     # the reference followed the skips
