"""The transformer on every strategy: each mesh trains `gpt` / `gpt-moe` like one process.

Equivalence (float64, rel 1e-9, losses and final parameters): data parallelism with
each gradient sync (naive, bucketed, overlapped) on 2 and 4 ranks, ZeRO 1/2/3, the
pipeline on 2 and 4 stages under every schedule (GPipe, 1F1B, interleaved, ZB-H1; what
crosses a boundary is (B/(M dp), T, d)), expert parallelism for gpt-moe on 2 and 4 ranks
(the B*T positions are the tokens; capacity over the global microbatch), dp x pp and
dp x ep x pp, ZeRO 1/2/3 beside experts (dense weights sliced over dp, expert
weights over their edp group; edp of 1, 2 and all dp ranks). SGD and Adam take turns;
tiny shapes (L=2, d=16, H=2, T=8, V=16, B=8).

Ledger and memory: every rank's ledger entries and its parameter, gradient and optimizer
bytes are what the planner's formulas predict for the transformer (plan.minipar_workload;
Alltoallv rows follow the router, so their sum over an ep group is checked, without
capacity drops).

Every bug of bugs/catalog.py that applies to these meshes, injected: the check catches each.

One `sweep` launch per rank count (tests/harness/mpi.py).
"""

from __future__ import annotations

import pytest

from minipar.bugs import catalog
from tests import shapes
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import ROOT, sweep
from tests.reference.formulas import assert_ledger_and_memory_are_the_formulas

GPT = dict(shapes.GPT, heads=2)
DOCUMENTS = str(ROOT / "lessons" / "documents.txt")   # short ragged documents
MOE = dict(GPT, model="gpt-moe", experts=4, expert_d_ff=16, aux_coef=0.1)
ADAM = dict(optimizer="adam", lr=0.01)

RUNS = {
    2: [dict(GPT, dp=2, grad_sync="naive"),
        dict(GPT, **ADAM, dp=2, bucket_size=300),              # several buckets
        dict(GPT, dp=2, grad_sync="overlapped", microbatches=2),
        dict(GPT, **ADAM, dp=2, zero=1),
        dict(GPT, dp=2, zero=2, microbatches=2),
        dict(GPT, **ADAM, dp=2, zero=3),
        dict(GPT, pp=2, schedule="gpipe", microbatches=2),
        dict(GPT, **ADAM, pp=2, schedule="1f1b", microbatches=4),
        dict(GPT, pp=2, layers=4, schedule="interleaved", virtual=2, microbatches=2),
        dict(GPT, **ADAM, pp=2, schedule="zb-h1", microbatches=2),
        dict(MOE, dp=2, ep=2, top_k=1, capacity_factor=1.0),
        dict(MOE, **ADAM, dp=2, ep=2, top_k=2, microbatches=2),
        dict(MOE, dp=2, top_k=2, capacity_factor=0.75),         # tokens over dp, ep = 1
        dict(MOE, **ADAM, pp=2, microbatches=2, capacity_factor=0.75),
        dict(MOE, **ADAM, dp=2, zero=2, microbatches=2)],           # experts' edp = dp
    4: [dict(GPT, dp=4, microbatches=2),
        dict(GPT, **ADAM, dp=4, zero=3),
        dict(GPT, pp=4, layers=4, schedule="gpipe", microbatches=4),
        dict(GPT, **ADAM, pp=4, layers=4, schedule="1f1b", microbatches=4),
        dict(GPT, pp=4, layers=8, schedule="interleaved", virtual=2, microbatches=4),
        dict(GPT, **ADAM, pp=4, layers=4, schedule="zb-h1", microbatches=4),
        dict(GPT, **ADAM, dp=2, pp=2, microbatches=2),
        dict(GPT, dp=2, pp=2, zero=1, schedule="interleaved", virtual=2, layers=4,
             microbatches=2),
        dict(MOE, dp=4, ep=4, capacity_factor=1.0),
        dict(MOE, **ADAM, dp=4, ep=2, top_k=1, microbatches=2),
        dict(MOE, dp=2, ep=2, pp=2, microbatches=2, capacity_factor=1.0),
        dict(MOE, **ADAM, dp=2, ep=2, pp=2, microbatches=2, schedule="zb-h1"),
        # ZeRO with experts: dense weights sliced over dp, expert weights over edp
        dict(MOE, **ADAM, dp=4, ep=2, zero=1, microbatches=2),
        dict(MOE, dp=4, ep=2, zero=2, capacity_factor=1.0),
        dict(MOE, **ADAM, dp=4, ep=2, zero=3, microbatches=2),
        dict(MOE, **ADAM, dp=4, ep=4, zero=3),                    # edp of one rank
        dict(MOE, **ADAM, dp=2, ep=2, pp=2, zero=1, microbatches=2)],
}
# Every bug of bugs/catalog.py that the transformer's meshes can show, each on 4 ranks: the
# equivalence check must catch it (tp's bugs: tests/parallel/test_gpt_tensor_parallel.py).
BUGGED = [dict(GPT, dp=2, pp=2, microbatches=2, schedule="gpipe",
               inject_bug="pp-one-input-buffer"),
          dict(GPT, dp=2, pp=2, microbatches=2, inject_bug="dp-stage-not-synced"),
          dict(GPT, dp=4, inject_bug="dp-sum-not-mean"),
          dict(GPT, dp=4, zero=1, inject_bug="zero-no-allgather"),
          dict(MOE, dp=4, ep=2, inject_bug="moe-aux-first-choice"),
          dict(MOE, dp=4, ep=2, capacity_factor=0.75, inject_bug="moe-aux-after-capacity"),
          dict(MOE, dp=4, ep=2, inject_bug="moe-aux-per-rank"),
          dict(MOE, dp=4, ep=2, router="sigmoid-bias", bias_rate=0.01, aux_coef=0.0,
               inject_bug="moe-bias-local-load"),
          dict(GPT, dp=2, cp=2, cp_mode="allgather", inject_bug="cp-no-allgather"),
          dict(GPT, dp=2, cp=2, cp_mode="ring", inject_bug="cp-ring-no-lse-merge"),
          dict(GPT, dp=2, pp=2, microbatches=2, clip_grad_norm=1e-3,
               inject_bug="clip-local-norm"),
          # ragged documents: every cp rank's positions a different count of valid ones
          dict(GPT, dp=2, cp=2, cp_mode="zigzag", microbatches=2, data=DOCUMENTS,
               documents=True, vocab=256, inject_bug="loss-mean-per-microbatch"),
          # Muon's (bugs/detours.py): the matrices whole, on the transformer's meshes too
          dict(GPT, dp=4, zero=2, microbatches=2, optimizer="muon", lr=0.02,
               inject_bug="muon-per-microbatch"),
          dict(GPT, dp=4, optimizer="muon", lr=0.02, inject_bug="muon-no-orthogonalization"),
          dict(GPT, dp=4, zero=3, optimizer="muon", lr=0.02, inject_bug="muon-flat-shard-is-1d"),
          dict(GPT, dp=4, zero=1, optimizer="muon", lr=0.02, inject_bug="muon-unreduced-slice")]


# the 4-rank meshes once more in bf16 (float64 masters), after the bugs, in the same job;
# not the capacity-limited MoE runs (a token across the capacity cut is no rounding)
BF16 = {4: [dict(c, mixed="bf16") for c in RUNS[4] if not c.get("capacity_factor")]}


@pytest.fixture(scope="module", params=sorted(RUNS))
def swept(request, tmp_path_factory):
    """Every config of one rank count, trained in one mpiexec job."""
    world = request.param
    # the broken runs are judged by their numbers: placement checking would stop some
    # (tests/bugs/test_bugs_placement.py checks those)
    configs = RUNS[world] + ([{**c, "check_placements": False} for c in BUGGED]
                             if world == 4 else [])
    runs = sweep(world, configs + BF16.get(world, []), tmp_path_factory.mktemp(f"gpt{world}"),
                 timeout=420)
    return world, runs


def test_every_mesh_of_4_ranks_in_bf16_is_within_the_derived_tolerance(swept):
    world, runs = swept
    if world not in BF16:
        pytest.skip("the 4-rank job carries the bf16 runs")
    start = len(RUNS[world]) + len(BUGGED)
    for fields, run in zip(BF16[world], runs[start:]):
        assert_within_mixed_tolerance(run, fields, world, f"{world} ranks {fields}")


def test_every_mesh_equals_one_process(swept):
    world, runs = swept
    for fields, run in zip(RUNS[world], runs):
        assert_equivalent(run, reference(**fields), label=f"{world} ranks {fields}")


@pytest.mark.parametrize("swept", [4], indirect=True)      # the bugs run in the 4-rank job
def test_every_injected_bug_is_caught(swept):
    world, runs = swept
    assert {bug["inject_bug"] for bug in BUGGED} == {
        name for name, bug in catalog.BUGS.items() if bug.strategy != "tp"}
    for fields, run in zip(BUGGED, runs[len(RUNS[world]):]):
        clean = {k: v for k, v in fields.items() if k != "inject_bug"}
        with pytest.raises(AssertionError):
            assert_equivalent(run, reference(**clean), label=fields["inject_bug"])


def test_ledger_and_memory_are_the_formulas(swept):
    world, runs = swept
    for fields, run in zip(RUNS[world], runs):
        assert_ledger_and_memory_are_the_formulas(world, fields, run)
