"""The planner's arithmetic, checked against published numbers and against minipar's runs.

- ZeRO's worked example (7.5 B parameters on 64 GPUs: 120 / 31.4 / 16.6 / 1.9 GB)
  through the planner's own memory path;
- Megatron's bubble (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), and the step time it
  implies; the in-flight microbatches against the schedule simulator;
- Megatron's activation count sbh(34 + 5as/h), with TP and TP+SP, and the paper's
  savings of selective recomputation (GPT-3 70%, MT-NLG 65%);
- DeepSeek-V3's 37 B active parameters of 671 B from its published sizes;
- minipar's own 8-rank runs: every rank's parameter / gradient / optimizer bytes and
  every ledger entry (calls and elements) predicted exactly, in one mpiexec job;
- the command line: a good run, and one error line with exit 2 for bad flags.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from minipar.__main__ import main
from minipar.config import TrainConfig
from minipar.costmodel import (
    Block,
    Plan,
    Workload,
    activation_bytes,
    in_flight,
    model_states,
    rank_shape,
)
from minipar.memory import zero_formula
from minipar.mesh import MeshShape
from minipar.parallel.pipeline_schedules import simulate_schedule
from minipar.plan import evaluate, minipar_workload, plan_of, search, transformer
from minipar.timemodel import Hardware, ledger_of, traffic
from tests.mpi import ROOT, sweep

GB = 1e9
H100 = Hardware(80 * GB, 989e12, 0.5, 450 * GB, 50 * GB, 8, 5e-6)


def test_zero_paper_example_through_the_planner():
    """Psi = 7.5 B, N_d = 64, mixed-precision Adam (2 + 2 + 12 bytes): Figure 1 of ZeRO."""
    w = Workload("7.5B", (Block(((7_500_000_000, False),)),), (), (), 4096, 64)
    totals = []
    for stage in range(4):
        plan = Plan(dp=64, zero=stage)
        states = model_states(w, plan, rank_shape(w, plan, 0))
        assert states.total == pytest.approx(zero_formula(7.5e9, 64, stage).total, rel=1e-12)
        totals.append(round(states.total / GB, 1))
    assert totals == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("pp, m", [(2, 1), (4, 4), (4, 8), (8, 16), (8, 64)])
def test_bubble_is_megatrons_and_the_step_pays_it(pp, m):
    """(p-1)/(m+p-1), as the simulator measures it; with free communication the step
    lasts (m + p - 1) microbatch slots of the busiest stage."""
    w = transformer("dense", 1e9, 8 * pp, 1024, 64 * m, 512, heads=8, ffn_matrices=2)
    free = replace(H100, intra_bw=1e30, inter_bw=1e30, latency=0.0)
    estimate = evaluate(w, free, Plan(dp=1, pp=pp, microbatches=m, recompute="selective"))
    assert estimate.bubble == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
    assert estimate.bubble == pytest.approx(simulate_schedule("1f1b", pp, m).bubble, rel=1e-12)
    slot = estimate.timing.compute / m
    assert estimate.timing.total == pytest.approx((m + pp - 1) * slot, rel=1e-9)


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_interleaved_bubble_is_megatrons(pp, m, v):
    w = transformer("dense", 1e9, pp * v * 2, 1024, 64 * m, 512, heads=8)
    plan = Plan(dp=1, pp=pp, microbatches=m, schedule="interleaved", virtual=v)
    expected = (pp - 1) / (v * m + pp - 1)
    assert evaluate(w, H100, plan).bubble == pytest.approx(expected, rel=1e-12)
    assert simulate_schedule("interleaved", pp, m, v).bubble == pytest.approx(expected)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                         ("zb-h1", 1)])
def test_microbatches_in_flight_are_the_simulators(schedule, v):
    for pp, m in [(2, 2), (4, 4), (4, 8), (3, 6)]:
        peaks = simulate_schedule(schedule, pp, m, v).peak_in_flight
        assert [in_flight(schedule, pp, m, s, v) for s in range(pp)] == peaks, (pp, m)


def gpt_layer(params: float, layers: int, h: int, heads: int, s: int = 2048) -> Block:
    return transformer("gpt", params, layers, h, 1, s, heads=heads, ffn_matrices=2).blocks[0]


def test_megatron_activation_formula():
    """Korthikanti et al. 2022, Table 2 on GPT-3 175B (a=96, s=2048, h=12288, b=1):
    5as/h = 80, so sbh(34 + 80) per layer; TP t=8: sbh(10 + 24/8 + 80/8); TP+SP: /8."""
    s, h, a, t = 2048, 12288, 96, 8
    layer, sbh = gpt_layer(175e9, 96, h, a, s), s * h
    assert 5 * a * s / h == 80
    assert activation_bytes(layer, s, Plan(1)) == sbh * (34 + 80)
    assert activation_bytes(layer, s, Plan(1, tp=t)) == pytest.approx(
        sbh * (10 + 24 / t + 80 / t), rel=1e-12)
    assert activation_bytes(layer, s, Plan(1, tp=t, sp=True)) == pytest.approx(
        sbh * (34 + 80) / t, rel=1e-12)
    assert activation_bytes(layer, s, Plan(1, tp=t, sp=True, recompute="selective")) == \
        pytest.approx(34 * sbh / t, rel=1e-12)
    assert activation_bytes(layer, s, Plan(1, recompute="full")) == 2 * sbh


@pytest.mark.parametrize("name, params, layers, h, heads, saved", [
    ("GPT-3", 175e9, 96, 12288, 96, 0.70), ("MT-NLG", 530e9, 105, 20480, 128, 0.65)])
def test_selective_recomputation_saves_what_the_paper_says(name, params, layers, h, heads,
                                                            saved):
    layer = gpt_layer(params, layers, h, heads)
    full = activation_bytes(layer, 2048, Plan(1))
    selective = activation_bytes(layer, 2048, Plan(1, recompute="selective"))
    assert round(1 - selective / full, 2) == saved, name


def test_deepseek_v3_has_37b_active_of_671b():
    """61 layers (3 dense, d_ff 18432), d 7168, 256 routed experts top-8 + 1 shared,
    expert d_ff 2048, SwiGLU, vocabulary 129280: DeepSeek-V3's '37 B activated' (to within
    the 0.9 B input embedding, which a lookup passes through without multiplying)."""
    w = transformer("V3", 671e9, 61, 7168, 1, 4096, d_ff=18432, vocab=129280, experts=256,
                    top_k=8, expert_d_ff=2048, shared_experts=1, dense_layers=3)
    assert w.params == pytest.approx(671e9, rel=1e-6)
    embedding = 129280 * 7168
    assert 36.5e9 < w.active_params - embedding < 37e9 < w.active_params < 37.6e9


def test_tp_crossing_the_node_is_slower():
    """70B (Llama-2-70B's shape): the fastest plan keeps tp inside a node of 8; the best
    plan with tp = 16 (two nodes per tp group) is slower than the best with tp = 8."""
    w = transformer("70B", 70e9, 80, 8192, 256, 4096, d_ff=28672, heads=64)
    found = search(w, H100, 256, Plan(1, recompute="selective", sp=True), (1,))
    assert found.feasible[0].plan.tp <= 8
    best = {tp: min(e.timing.total for e in found.feasible if e.plan.tp == tp) for tp in (8, 16)}
    assert best[16] > 1.5 * best[8]


# ------------------------------------------------- minipar's own runs, predicted
SMALL = dict(layers=4, d_model=16, d_in=8, batch=16, steps=2, optimizer="adam", microbatches=2)
RUNS = [dict(SMALL, dp=8, bucket_size=186),  # DP, many buckets; the first exactly full:
        #                                     head (10 + 160) + the last fc2 bias (16)
        dict(SMALL, dp=2, tp=2, pp=2),
        dict(SMALL, dp=2, tp=2, pp=2, sp=True, zero=1),
        dict(SMALL, dp=8, zero=3),
        dict(SMALL, dp=4, pp=2, schedule="interleaved", virtual=2, zero=2),
        dict(SMALL, model="moe", dp=4, ep=2, pp=2),
        dict(SMALL, model="moe", dp=8, ep=8, microbatches=1)]


def test_planner_predicts_minipars_runs_exactly(tmp_path):
    """Per rank: parameter, gradient and optimizer bytes, and every ledger entry's calls and
    elements. Alltoallv elements depend on where the router sends tokens: a rank sends
    its b k rows and sends back what it received, so only their sum over an ep group is
    fixed, and that sum is predicted exactly (the planner assumes balance: b k each)."""
    runs = sweep(8, RUNS, tmp_path / "sweep", timeout=240)
    for fields, run in zip(RUNS, runs):
        cfg = TrainConfig(**fields).resolved(8)
        w, plan, mesh = minipar_workload(cfg), plan_of(cfg), cfg.mesh_shape()
        memory = json.loads((run["job_folder"] / "memory.json").read_text())
        predicted = {}
        for rank in range(8):
            where = mesh.coords(rank)
            shape = rank_shape(w, plan, where["pp"])
            states = model_states(w, plan, shape, where["dp"])
            assert vars(states) == memory[rank], f"{fields} rank {rank}"
            predicted[rank] = ledger_of(traffic(w, plan, shape))
            measured = {(r["group"], r["op"]): (r["calls"], r["elements"])
                        for r in run["ledger"] if r["rank"] == rank}
            assert measured.keys() == predicted[rank].keys(), f"{fields} rank {rank}"
            for key, (calls, elements) in measured.items():
                assert calls == predicted[rank][key][0], f"{fields} rank {rank} {key}"
                if key != ("ep", "Alltoallv"):
                    assert elements == predicted[rank][key][1], f"{fields} rank {rank} {key}"
        check_alltoallv_sums(fields, run["ledger"], predicted, cfg.mesh_shape())


def check_alltoallv_sums(fields: dict, ledger: list[dict], predicted: dict,
                         mesh: MeshShape) -> None:
    if fields.get("model") != "moe":
        return
    for group in mesh.groups("ep"):
        measured = sum(r["elements"] for r in ledger if r["rank"] in group
                       and r["op"] == "Alltoallv")
        assert measured == sum(predicted[r][("ep", "Alltoallv")][1] for r in group), \
            f"{fields} ep group {group}"


# ------------------------------------------------------------- the command line
DEEPSEEK = ["--params", "671B", "--layers", "61", "--d-model", "7168", "--d-ff", "18432",
            "--experts", "256", "--top-k", "8", "--expert-d-ff", "2048", "--shared-experts",
            "1", "--dense-layers", "3", "--vocab", "129280", "--gpus", "2048",
            "--gpu-memory", "80", "--flops", "989", "--intra-bw", "450", "--inter-bw",
            "50", "--global-batch", "4096", "--recompute", "full"]


def test_plan_command_ranks_plans_and_counts_the_rest(capsys):
    assert main(["plan", *DEEPSEEK, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "37.5 B active per token" in out and "#1: dp=" in out
    assert "tp > 1 with experts" in out and "needs more than 80 GB per GPU" in out


@pytest.mark.parametrize("flags, named", [
    (["--params", "70e9"], "required"),
    (["--efficiency", "1.5"], "--efficiency"),
    (["--top-k", "4"], "--experts"),
    (["--params", "lots"], "--params"),
    (["--params", "1e6"], "--params"),
    (["--d-ff", "-5"], "--d-ff"),
    (["--heads", "-8"], "--heads"),
    (["--top", "0"], "--top"),
])
def test_bad_flags_are_one_error_line(flags, named, capsys):
    good = DEEPSEEK[:DEEPSEEK.index("--experts")] + DEEPSEEK[DEEPSEEK.index("--vocab"):]
    argv = flags if named == "required" else good + flags
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("minipar: error:"), captured.err
    assert named in lines[0] and not captured.out


def test_the_planner_imports_no_mpi():
    probe = ("import sys, minipar.plan, minipar.costmodel, minipar.timemodel; "
             "print('mpi4py.MPI' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
