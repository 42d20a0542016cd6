"""ZeRO stages 1-3 (minipar/parallel/zero.py) and the memory arithmetic (minipar/core/memory.py).

- Without MPI: the slices of a flat vector (unequal when dp does not divide it),
  ZeRO's memory formulas and the paper's worked example (7.5 B parameters on 64
  ranks: 120 / 31.4 / 16.6 / 1.9 GB), the wire volume 2 Psi vs 3 Psi, and the
  settings refused before any communication.
- Training: `--zero 1|2|3` with SGD and Adam, 1 and 2 microbatches, on dp = 3, 4
  and 8 (the model's 8954 parameters divide none of them; a second model's 8988
  divide 3 and 4), and dense ZeRO beside tp and pp, equals one process (rtol
  1e-9). The ledger of the last step has exactly ZeRO's collectives: stages 1-2
  Reduce_scatter + Allgather the parameter count (2 Psi on the wire, as DP's
  Allreduce), stage 3 one Reduce_scatter and two Allgathers (3 Psi).
- On the ranks (`check_memory_accounting`): the bytes each rank holds equal the
  formulas, exactly.

Rank side by hand: `mpiexec -n 4 python -m tests.harness.rank_tests /tmp/out
tests.parallel.test_zero:check_memory_accounting`.
"""

from __future__ import annotations

import numpy as np
import pytest

from minipar.core import nn
from minipar.core.memory import (
    FlatLayout,
    bytes_per_param,
    bytes_per_param_held,
    ledger_formula,
    optimizer_bytes_per_param,
    paper_example,
    rank_states,
    shard_counts,
    wire_formula,
    zero_formula,
)
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import sweep
from tests.harness.rank_tests import run_checks
from tests.harness.trace_checks import check_trace
from tests.reference.formulas import assert_ledger_and_memory_are_the_formulas

SMALL = {"layers": 4, "d_model": 16, "d_in": 8, "batch": 48, "steps": 3}
EVEN = {"classes": 12}  # 8988 parameters: divisible by 3 and 4 (8954 with 10 classes is not)


def psi(cfg: dict) -> int:
    model = TrainConfig(**cfg).resolved(1).model_config()
    return sum(int(np.prod(s)) for s in nn.canonical_shapes(model).values())


# ------------------------------------------------------------ without MPI
def test_slices_of_a_flat_vector_cover_it_once_and_differ_by_at_most_one():
    assert shard_counts(10, 4) == [3, 3, 2, 2] and shard_counts(8, 4) == [2, 2, 2, 2]
    layout = FlatLayout([(2, 3), (4,), (1,)], ranks=4, rank=1)  # 11 numbers: 3 3 3 2
    assert (layout.total, layout.counts, layout.starts) == (11, [3, 3, 3, 2], [0, 3, 6, 9])
    assert layout.span(1, 2) == (6, 11)
    assert layout.overlap(2, 7) == [1, 3, 1, 0]   # [2, 7) meets slices [0,3) [3,6) [6,9)
    assert layout.mine(2, 7) == slice(0, 3) and layout.mine(7, 11) == slice(0, 0)
    flat = np.arange(5.0)
    first, second = layout.views(flat, 1, 2)
    flat[4] = 9.0  # views share the buffer
    assert second.tolist() == [9.0] and first.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_zero_paper_example_is_reproduced():
    """Rajbhandari et al., Figure 1: 7.5 B parameters, N_d = 64, K = 12, fp16."""
    totals = [round(states.total / 1e9, 1) for states in paper_example()]
    assert totals == [120.0, 31.4, 16.6, 1.9]


def test_bytes_per_parameter_of_mixed_precision_are_the_papers():
    """Adam, bf16, fp32 masters and main gradients: Megatron's 2 + 4 + 4 + 8 = 18; with
    16-bit main gradients the ZeRO paper's 2 + 2 + 12 = 16; ZeRO divides them over N."""
    megatron = bytes_per_param("adam", 4, 2)
    assert (megatron.params, megatron.masters, megatron.grads, megatron.optimizer) == (2, 4, 4, 8)
    held = [bytes_per_param_held(megatron, 8, stage) for stage in range(4)]
    assert held == [18, 2 + 4 + 12 / 8, 2 + 16 / 8, 18 / 8]
    paper = bytes_per_param("adam", 4, 2, main_grad_bytes=2)
    assert [bytes_per_param_held(paper, 64, s) for s in range(4)] == [
        zero_formula(1, 64, s).total for s in range(4)] == [16, 4 + 12 / 64, 2 + 14 / 64, 0.25]
    full = bytes_per_param("adam", 8, None)  # float64, no --mixed: 8 + 8 + 16, no masters
    assert (full.total, full.masters) == (32, 0)
    assert bytes_per_param("sgd", 4, 2).total == 2 + 4 + 4


def test_formulas_shard_exactly_the_stage_kinds():
    full = zero_formula(100, 4, 0, 8, 8, 16)
    assert (full.params, full.grads, full.optimizer) == (800, 800, 1600)
    assert zero_formula(100, 4, 1, 8, 8, 16).optimizer == 400
    two = zero_formula(100, 4, 2, 8, 8, 16)
    assert (two.params, two.grads, two.optimizer) == (800, 200, 400)
    assert zero_formula(100, 4, 3, 8, 8, 16).total == 800
    assert optimizer_bytes_per_param("adam", 8) == 16 and optimizer_bytes_per_param("sgd", 8) == 0


def ring(op: str, ranks: int) -> float:
    """Share of a collective's buffer one rank sends with ring algorithms."""
    return (2 if op == "Allreduce" else 1) * (ranks - 1) / ranks


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_ledger_formula_gives_the_papers_wire_volume(ranks):
    for stage in range(4):
        wire = sum(ring(op, ranks) * n for op, n in ledger_formula(999, stage).items())
        assert wire == pytest.approx(wire_formula(999, ranks, stage), rel=1e-12)
    assert wire_formula(999, ranks, 3) / wire_formula(999, ranks, 0) == 1.5


@pytest.mark.parametrize("fields, flag", [
    ({"zero": 1, "grad_sync": "overlapped"}, "--grad-sync overlapped"),
    ({"zero": 3, "tp": 2, "dp": 2, "sp": True}, "--zero 3 takes"),
    ({"grad_sync": "overlapped", "tp": 2, "dp": 2, "sp": True}, "--grad-sync overlapped takes"),
    ({"bucket_size": 0}, "--bucket-size"),
    ({"grad_sync": "ring"}, "--grad-sync must be one of"),
])
def test_settings_that_cannot_run_are_refused_naming_the_flag(fields, flag):
    cfg = TrainConfig(**dict(SMALL, **fields)).resolved(4)
    found = problems(cfg, 4)
    assert any(line.startswith(flag) for line in found), found


def test_zero_beside_tp_pp_and_experts_is_allowed():
    for fields in ({"zero": 2, "model": "moe", "dp": 4, "ep": 2},
                   {"zero": 3, "model": "moe", "dp": 2, "pp": 2, "microbatches": 2},
                   {"zero": 3, "dp": 2, "tp": 2, "pp": 2, "microbatches": 2},
                   {"zero": 2, "dp": 2, "pp": 2, "microbatches": 4, "schedule": "zb-h1"},
                   {"zero": 1, "dp": 2, "tp": 2, "sp": True}):
        world = fields["dp"] * fields.get("tp", 1) * fields.get("pp", 1)
        fields = dict(fields, layers=4)
        assert problems(TrainConfig(**dict(SMALL, **fields)).resolved(world), world) == []


# ----------------------------------------------------------------- training
def zero_configs(world: int) -> list[dict]:
    """Every stage with (SGD, 1 microbatch) and (Adam, 2); on 8 ranks (Adam, 2) only,
    on 4 also stage 3's other two pairs."""
    pairs = [("adam", 2)] if world == 8 else [("sgd", 1), ("adam", 2)]
    out = [dict(SMALL, dp=world, zero=stage, optimizer=optimizer, microbatches=m)
           for stage in (1, 2, 3) for optimizer, m in pairs]
    if world == 4:
        out += [dict(SMALL, dp=world, zero=3, optimizer=optimizer, microbatches=m)
                for optimizer, m in (("adam", 1), ("sgd", 2))]
        # --clip-grad-norm on the slices (clip.py): each rank's squares of its slice, one
        # Allreduce over dp; C below the norm, so every step clips
        out += [dict(SMALL, dp=world, zero=stage, optimizer="adam", microbatches=2,
                     clip_grad_norm=CLIP) for stage in (1, 2, 3)]
    if world == 3:
        out += [dict(SMALL, **EVEN, dp=world, zero=stage, optimizer="adam") for stage in (1, 3)]
    return out


CLIP = 0.01
HYBRIDS = {8: [dict(SMALL, dp=2, tp=2, pp=2, zero=3, microbatches=2, optimizer="adam"),
               dict(SMALL, dp=4, pp=2, zero=2, microbatches=2, schedule="zb-h1"),
               dict(SMALL, dp=2, tp=4, zero=1, optimizer="adam")]}


def expected_ledger(cfg: dict) -> dict[str, tuple[int, int]]:
    """op -> (calls, elements) on the dp group for one step of a dp-only mesh: one
    collective per step (stage 1), per piece and microbatch (stage 2's Reduce_scatter),
    per piece, microbatch and direction (stage 3's Allgathers)."""
    stage, pieces, m = cfg["zero"], cfg["layers"] + 2, cfg.get("microbatches", 1)
    times = {1: {"Reduce_scatter": 1, "Allgatherv": 1},        # how often per step
             2: {"Reduce_scatter": m, "Allgatherv": 1},
             3: {"Reduce_scatter": m, "Allgatherv": m}}[stage]
    calls = {1: {"Reduce_scatter": 1, "Allgatherv": 1},
             2: {"Reduce_scatter": pieces * m, "Allgatherv": 1},
             3: {"Reduce_scatter": pieces * m, "Allgatherv": 2 * pieces * m}}[stage]
    return {op: (calls[op], n * times[op]) for op, n in ledger_formula(psi(cfg), stage).items()}


# The 4-rank ZeRO runs once more in fp16 over float64 masters, in the same job, within the
# derived tolerance (run/results.py mixed_tolerance); at S = 2^10 (docs/design.md: a
# rank's local-mean gradients overflow where one process's do not)
FP16 = {4: [dict(c, mixed="fp16", loss_scale=1024.0) for c in zero_configs(4)]}


@pytest.mark.parametrize("world", [3, 4, 8])
def test_zero_equals_one_process_with_zeros_ledger(world, tmp_path):
    configs = zero_configs(world) + HYBRIDS.get(world, [])
    runs = sweep(world, configs + FP16.get(world, []), tmp_path / "sweep", timeout=240)
    for cfg, run in zip(FP16.get(world, []), runs[len(configs):]):
        assert_within_mixed_tolerance(run, cfg, world, f"n={world} {cfg}")
    for cfg, run in zip(configs, runs):
        label = f"n={world} {cfg}"
        assert_equivalent(run, reference(**cfg), label=label)
        if cfg.get("clip_grad_norm"):   # it clipped: the norm above C on every step
            assert min(reference(**cfg).extras["gnorms"]) > cfg["clip_grad_norm"], label
        if cfg.get("tp", 1) * cfg.get("pp", 1) > 1:
            continue
        expected = expected_ledger(cfg)
        if cfg.get("clip_grad_norm"):   # clip.py: one Allreduce of one number over dp
            expected["Allreduce"] = (1, 1)
        for rank in range(world):
            mine = {r["op"]: (r["calls"], r["elements"])
                    for r in run["ledger"] if r["rank"] == rank and r["group"] == "dp"}
            assert mine == expected, f"{label} rank {rank}: {mine} != {expected}"
            if cfg.get("microbatches", 1) == 1:  # stages 1-2: 2 Psi (N-1)/N, stage 3: 3
                wire = sum(ring(op, world) * n for op, (_, n) in mine.items())
                assert wire == pytest.approx(wire_formula(psi(cfg), world, cfg["zero"]))
            assert {r["group"] for r in run["ledger"] if r["rank"] == rank} == {"dp"}


# ZeRO beside experts: the router and LayerNorms sliced over dp, each expert's weights
# over its edp group (dp / ep ranks; 1 when ep = dp, all dp ranks when ep = 1)
MOE = dict(SMALL, model="moe", experts=4, expert_d_ff=16, aux_coef=0.1, batch=16)
MOE_RUNS = [dict(MOE, dp=4, ep=2, zero=1, optimizer="adam", microbatches=2),
            dict(MOE, dp=4, ep=2, zero=2, capacity_factor=1.0),
            dict(MOE, dp=4, ep=2, zero=3, optimizer="adam", microbatches=2),
            dict(MOE, dp=4, ep=4, zero=2, optimizer="adam"),
            dict(MOE, dp=4, zero=3, optimizer="adam", top_k=1),
            dict(MOE, dp=2, ep=2, pp=2, zero=1, optimizer="adam", microbatches=2)]


def test_zero_with_experts_equals_one_process_ledger_and_memory_formulas(tmp_path):
    traced = [dict(c, trace=str(tmp_path / f"trace{i}")) for i, c in enumerate(MOE_RUNS)]
    runs = sweep(4, traced, tmp_path / "sweep", timeout=240)
    for cfg, run in zip(MOE_RUNS, runs):
        assert_equivalent(run, reference(**cfg), label=f"n=4 {cfg}")
        check_trace(run["config"]["trace"], run, f"n=4 {cfg}")  # timelines (trace_checks.py)
        assert_ledger_and_memory_are_the_formulas(4, cfg, run)
        assert {r["group"] for r in run["ledger"] if r["op"] == "Reduce_scatter"} == (
            {"dp", "edp"} if cfg.get("ep", 1) < cfg["dp"] else {"dp"}), cfg


def test_each_rank_holds_what_the_formulas_say(tmp_path):
    name = "tests.parallel.test_zero:check_memory_accounting"
    run_checks(4, [name], tmp_path, timeout=120).assert_passed(name)


# ------------------------------------------------------------------ rank side
def check_memory_accounting(comm: object) -> None:
    """Measured bytes per rank (after a step) against ZeRO's formulas, stages 0-3, Adam
    on both models. A sharded kind: rank r holds exactly counts[r]
    numbers (the formula's Psi/N when N divides Psi) and the ranks together exactly
    Psi. A replicated kind: every rank exactly the formula."""
    from tests.harness.rank_tests import agree

    found = []
    # float64 Adam; then --mixed (bf16 over float32 masters: Megatron's 18 bytes per
    # parameter; fp16 over float64 masters, SGD: 2 + 8 + 8)
    for extra, optimizer in (({}, "adam"), (EVEN, "adam"),
                             (dict(EVEN, mixed="bf16", dtype="float32"), "adam"),
                             (dict(mixed="fp16"), "sgd")):
        for stage in range(4):
            fields = dict(SMALL, **extra, steps=1, dp=comm.Get_size(), zero=stage,
                          optimizer=optimizer)
            found += memory_problems(comm, fields)
    agree(comm, found)


def memory_problems(comm: object, fields: dict) -> list[str]:
    from minipar.run.train import train

    world, rank = comm.Get_size(), comm.Get_rank()
    measured = train(TrainConfig(**fields).resolved(world), comm).extras["memory"]
    count, stage = psi(fields), fields["zero"]
    itemsize = np.dtype(fields.get("dtype", "float64")).itemsize
    per = bytes_per_param(fields["optimizer"], itemsize, 2 if fields.get("mixed") else None)
    per_param = {"params": per.params, "grads": per.grads, "optimizer": per.optimizer,
                 "masters": per.masters}
    formula = rank_states(per, count, count / world, stage)  # the planner's formula too
    found = []
    if count % world == 0 and measured.total != bytes_per_param_held(per, world, stage) * count:
        found.append(f"{fields}: {measured.total} bytes, formula "
                     f"{bytes_per_param_held(per, world, stage)} per parameter")
    for kind, bytes_each in per_param.items():
        sharded = stage >= {"params": 3, "grads": 2, "optimizer": 1, "masters": 1}[kind]
        value, want = getattr(measured, kind), getattr(formula, kind)
        together = sum(comm.allgather(value))  # every rank's bytes, summed
        numbers = shard_counts(count, world)[rank] if sharded else count
        wrong = [value != bytes_each * numbers,
                 count % world == 0 and value != want,
                 sharded and together != bytes_each * count]
        if any(wrong):
            found.append(f"{fields}: {kind} {value} bytes, formula {want}")
    return found
