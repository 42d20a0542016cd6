"""Every 4-D mesh: each factorization of 8 ranks and of 4 into dp x cp x tp x pp trains
`gpt` like one process (float64, rel 1e-9, losses and final parameters).

Where the mesh has a pipeline (pp > 1), once under every schedule (gpipe, 1f1b,
interleaved with V = 2, zb-h1, zb-v, dualpipev, dualpipe), each given what it needs:
pp x V layers (2 pp for the V schedules), M = pp microbatches (2 pp for dualpipev and
dualpipe),
one sequence per microbatch and data-parallel rank. Without a pipeline, once. Along the
sweep the other choices take turns, so that each is met on many meshes: the cp mode
(allgather, ring, zigzag, ulysses, where the sizes allow it: zigzag needs T divisible
by 2 cp, Ulysses cp dividing the H/tp local heads), sequence parallelism where tp > 1
(T/(cp tp) positions per rank), --recompute none/selective/full, SGD and Adam.

Gradient clipping (clip.py) is on in every run, at a C below the step's norm (so it
clips), and every rank's `gnorm` equals the one-process norm; two runs in five train on
ragged documents (documents.py: padded rows, a loss mask, the mean over the global
batch's valid positions), cp modes and pipelines included.

Ledger: every rank's entries are timemodel.traffic's, on every mesh, plus clipping's one
Allreduce of one number and the documents' count (clip.expected_ledger,
documents.expected_ledger).

Timelines: the 4-rank runs are traced (`--trace`), and every event of every trace is
checked (tests/harness/trace_checks.py), its last step's spans against its ledger.

Tiny on purpose: d = 16, H = 8, T = 8, V = 16, one step. ONE `sweep` launch per world
size (tests/harness/mpi.py): 80 configs on 8 ranks, 34 on 4; the 4-rank job trains its
34 once more under --mixed (bf16, every third fp16), within the derived tolerance.
"""

from __future__ import annotations

import json

import pytest

from minipar.comm.mesh import CP_MODES
from minipar.compose import clip
from minipar.core import documents
from minipar.parallel.pipeline.schedules import SCHEDULES, V_SHAPED
from minipar.planner.memory_cost import rank_shape
from minipar.planner.time_cost import ledger_of, traffic
from minipar.planner.workloads import minipar_workload, plan_of
from minipar.run.results import relative_difference
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import ROOT, sweep
from tests.harness.trace_checks import check_trace

TINY = dict(model="gpt", d_model=16, heads=8, seq_len=8, vocab=16, d_ff=32, steps=1)
RECOMPUTE = ("none", "selective", "full")
CLIP = 1e-3   # below every run's first gradient norm: every run clips
# every other run: ragged rows of short documents, byte ids (V = 256)
DOCUMENTS = dict(data=str(ROOT / "lessons" / "documents.txt"), documents=True, vocab=256)


def factorizations(world: int) -> list[tuple[int, int, int, int]]:
    """Every (dp, cp, tp, pp) with dp cp tp pp = world."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [(dp, cp, tp, world // (dp * cp * tp)) for dp in divisors for cp in divisors
            for tp in divisors if world % (dp * cp * tp) == 0]


def cp_mode(cp: int, tp: int, turn: int) -> str:
    """The turn-th mode (cyclically) among those these sizes allow."""
    allowed = [mode for mode in CP_MODES
               if not (mode == "zigzag" and TINY["seq_len"] % (2 * cp))
               and not (mode == "ulysses" and (TINY["heads"] // tp) % cp)]
    return allowed[turn % len(allowed)]


def configs(world: int) -> list[dict]:
    """One config per mesh without a pipeline, one per mesh and schedule with one."""
    out = []
    for dp, cp, tp, pp in factorizations(world):
        for schedule in SCHEDULES if pp > 1 else ("1f1b",):
            turn = len(out)
            virtual = 2 if schedule == "interleaved" else 1
            two = schedule in V_SHAPED
            m = 2 * pp if schedule in ("dualpipev", "dualpipe") else pp
            out.append(dict(
                TINY, dp=dp, cp=cp, tp=tp, pp=pp, schedule=schedule, virtual=virtual,
                layers=pp * (2 if two else virtual), microbatches=m, batch=dp * m,
                cp_mode=cp_mode(cp, tp, turn),
                sp=tp > 1 and (TINY["seq_len"] // cp) % tp == 0 and turn % 2 == 0,
                recompute=RECOMPUTE[turn % 3], clip_grad_norm=CLIP,
                **(DOCUMENTS if turn % 5 in (0, 2) else {}),
                **(dict(optimizer="adam", lr=0.01) if turn % 2 else {})))
    return out


CONFIGS = {n: configs(n) for n in (8, 4)}

# gpt-moe with DeepSeek-V3 routing (minipar/core/routing.py) in the same jobs: sigmoid-bias and
# its b (two steps, so that b steers the second), a shared expert, node-limited routing
# (2 groups, 1 kept), dropless, over ep x the 4-D meshes (cp, attention TP with sp, a
# pipeline, ZeRO over edp, recomputation)
ROUTED_MOE = dict(TINY, model="gpt-moe", experts=4, expert_d_ff=16, top_k=2, steps=2,
                  router="sigmoid-bias", bias_rate=0.001, shared_experts=1, route_groups=2,
                  route_top_groups=1)
ROUTED = {
    4: [dict(ROUTED_MOE, dp=2, cp=2, ep=2, batch=2, recompute="full"),
        dict(ROUTED_MOE, dp=2, tp=2, ep=2, batch=2, sp=True),
        dict(ROUTED_MOE, dp=2, pp=2, ep=2, schedule="interleaved", virtual=2, layers=4,
             microbatches=2, batch=4, optimizer="adam", lr=0.01),
        dict(ROUTED_MOE, dp=2, cp=2, ep=2, batch=2, zero=1, cp_mode="ring")],
    8: [dict(ROUTED_MOE, dp=2, cp=2, tp=2, ep=2, batch=2),
        dict(ROUTED_MOE, dp=2, tp=2, pp=2, ep=2, layers=2, microbatches=2, batch=4)],
}


# The 4-rank sweep once more in 16 bits, in the same job: every mesh and schedule, cp
# mode, sp, recomputation, clipping and ragged documents under --mixed (two in three
# bf16, the rest fp16), each within the derived tolerance of one process in the same
# precision (run/results.py mixed_tolerance), the replica check after every step
# (fp16 at S = 2^10: at the default 2^16 a rank's local-mean gradients, dp x cp times one
# process's per position, overflow where one process's do not: docs/design.md)
MIXED = {4: [dict(c, **(dict(mixed="fp16", loss_scale=1024.0) if i % 3 == 2 else
                        dict(mixed="bf16"))) for i, c in enumerate(CONFIGS[4])],
         8: []}


def label(fields: dict) -> str:
    keys = ("dp", "cp", "tp", "pp", "schedule", "cp_mode", "sp", "recompute", "optimizer")
    return " ".join(f"{k}={fields[k]}" for k in keys if k in fields)


def test_the_sweep_covers_every_mesh_and_schedule():
    """Each world's configs are every (dp, cp, tp, pp) once, and with pp > 1 once per
    schedule; all of them are settings the train command accepts."""
    for n, runs in CONFIGS.items():
        resolved = [TrainConfig(**c).resolved(n) for c in runs]
        assert all(problems(cfg, n) == [] for cfg in resolved), n
        meshes = sorted((c.dp, c.cp, c.tp, c.pp, c.schedule) for c in resolved)
        expected = sorted((*mesh, s) for mesh in factorizations(n)
                          for s in (SCHEDULES if mesh[3] > 1 else ("1f1b",)))
        assert meshes == expected, n
        assert len(factorizations(n)) == {8: 20, 4: 10}[n]
        assert {c.cp_mode for c in resolved if c.cp > 1} == set(CP_MODES), n
        ragged = [c for c in resolved if c.documents]          # on every kind of mesh too
        assert {c.cp_mode for c in ragged if c.cp > 1} == set(CP_MODES), n
        assert any(c.pp > 1 for c in ragged) and any(c.tp > 1 for c in ragged), n


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def swept(request, tmp_path_factory):
    """Every config of one world size, trained in one mpiexec job."""
    world = request.param
    folder = tmp_path_factory.mktemp(f"mesh{world}")
    traced = [dict(c, trace=str(folder / f"trace{i}")) if world == TRACED else c
              for i, c in enumerate(CONFIGS[world])]
    return world, sweep(world, traced + ROUTED[world] + MIXED[world], folder, timeout=300)


TRACED = 4  # the world size whose runs are traced


def test_every_4d_mesh_trace_is_valid_and_is_its_ledger(swept):
    """Every event of every trace: fields, phases, integer microseconds, nesting per
    thread, both ends of every flow; each collective of the last step's ledger appears
    in the trace once per call, with the same bytes (tests/harness/trace_checks.py)."""
    world, runs = swept
    if world != TRACED:
        pytest.skip("the 4-rank sweep is the traced one")
    for fields, run in zip(CONFIGS[world], runs):
        check_trace(run["config"]["trace"], run, label=f"{world} ranks {label(fields)}")


def test_every_4d_mesh_equals_one_process(swept):
    world, runs = swept
    for fields, run in zip(CONFIGS[world] + ROUTED[world], runs):
        assert_equivalent(run, reference(**fields), label=f"{world} ranks {label(fields)}")


def test_every_rank_s_gnorm_is_the_one_process_norm(swept):
    """Clipping was active (the norm above C) and each rank's norm of every step equals
    the reference's (float64, 1e-9): tp, pp, cp, dp and dualpipe's two copies counted
    once each."""
    world, runs = swept
    for fields, run in zip(CONFIGS[world], runs):
        expected = reference(**fields).extras["gnorms"]
        assert len(expected) == fields["steps"] and min(expected) > CLIP, label(fields)
        per_rank = json.loads((run["job_folder"] / "rank_gnorms.json").read_text())
        assert len(per_rank) == world, label(fields)
        for rank, norms in enumerate(per_rank):
            assert relative_difference(norms, expected) <= 1e-9, (
                f"{world} ranks {label(fields)} rank {rank}: {norms} != {expected}")


def test_routed_moe_configs_run_and_move_b():
    """The ROUTED configs are accepted, and b is among the final arrays of each."""
    for n, runs in ROUTED.items():
        for fields in runs:
            cfg = TrainConfig(**fields).resolved(n)
            assert problems(cfg, n) == [], fields
            final = reference(**fields).final
            assert max(abs(final[f"blocks.{i}.router.bias_balance"]).max()
                       for i in range(cfg.layers)) > 0, fields


def test_every_4d_mesh_ledger_is_the_formulas(swept):
    """Every rank's ledger entries (calls and elements per (group, op)) are those
    timemodel.traffic predicts: tp's, cp's per mode, pp's per schedule, dp x cp's."""
    world, runs = swept
    for fields, run in zip(CONFIGS[world], runs):
        cfg = TrainConfig(**fields).resolved(world)
        w, plan, mesh = minipar_workload(cfg), plan_of(cfg), cfg.mesh_shape()
        for rank in range(world):
            predicted = ledger_of(traffic(w, plan, rank_shape(w, plan,
                                                              mesh.coords(rank)["pp"])))
            extra = [clip.expected_ledger(cfg)] + (
                [documents.expected_ledger(cfg.dp * cfg.cp)] if cfg.documents else [])
            for entries in extra:   # one Allreduce of one number each, beside the model's
                for key, (calls, elements) in entries.items():
                    before = predicted.get(key, (0, 0))
                    predicted[key] = (before[0] + calls, before[1] + elements)
            measured = {(r["group"], r["op"]): (r["calls"], r["elements"])
                        for r in run["ledger"] if r["rank"] == rank}
            assert measured == predicted, f"{world} ranks {label(fields)} rank {rank}"


def test_every_4d_mesh_of_4_ranks_in_16_bits_is_within_the_derived_tolerance(swept):
    world, runs = swept
    if not MIXED[world]:
        pytest.skip("the 4-rank sweep carries the 16-bit runs")
    for fields, run in zip(MIXED[world], runs[len(CONFIGS[world]) + len(ROUTED[world]):]):
        assert_within_mixed_tolerance(run, fields, world, label(fields))
