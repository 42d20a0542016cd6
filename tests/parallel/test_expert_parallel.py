"""Expert parallelism (minipar/parallel/expert_parallel.py) against one process.

Equivalence: `--model moe` on (dp, ep) meshes of 8, 4 and 2 ranks, top-1 and top-2, with
and without capacity, 1 and 2 microbatches, SGD and Adam, equals the single-process MoE
(rel 1e-9). Ledger: the Alltoall / Alltoallv / Exscan of a step match, rank by rank,
what routing implies, recomputed here from the dumped initial parameters. Stats: the
block's load statistics match the same recomputation (and capacity really drops).

The 4-rank job runs this file as its rank side
(`mpiexec -n 4 python -m tests.parallel.test_expert_parallel SPEC OUT`): it trains the configs
like `tests.harness.mpi.sweep` and also writes every rank's load statistics and the replica
disagreements, then probes one block directly (uniform routing, tape size against the
number of tokens).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from minipar.checkpoint import shard_files
from minipar.core import autograd as ag
from minipar.core import fused_layers, nn
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import launch, lesson_run, read_dump, sweep

SMALL = {"model": "moe", "layers": 2, "d_in": 8, "d_model": 16, "batch": 32, "seed": 3}

EIGHT = [  # 64 experts, 8 per rank, as in the source text
    dict(SMALL, dp=8, ep=8, experts=64, top_k=2, steps=2),
    dict(SMALL, dp=8, ep=8, experts=64, top_k=1, capacity_factor=1.0, microbatches=2,
         optimizer="adam", steps=2),
]
TWO = [
    dict(SMALL, dp=2, ep=1, top_k=2, capacity_factor=0.75, microbatches=2, optimizer="adam",
         steps=3),
    dict(SMALL, dp=2, ep=1, top_k=1, steps=3),
]
FOUR = [
    dict(SMALL, dp=4, ep=2, top_k=2, capacity_factor=1.0, microbatches=2, optimizer="adam",
         steps=3),
    dict(SMALL, dp=4, ep=4, top_k=1, capacity_factor=1.25, steps=3),
    # one step each: the ledger of the last step is then the step of the dumped init
    dict(SMALL, dp=4, ep=2, top_k=2, capacity_factor=1.0, microbatches=2, steps=1),
    dict(SMALL, dp=4, ep=4, top_k=2, microbatches=2, optimizer="adam", steps=1),
]
# DeepSeek-V3 routing (minipar/core/routing.py), in the same 4-rank job: sigmoid-bias with its
# b, shared experts (split over tp with expert TP), node-limited routing with a group per
# ep rank, dropless; over dp x ep, expert TP, a pipeline (zb-h1) and ZeRO-3 over edp
ROUTED = [
    dict(SMALL, dp=4, ep=2, top_k=3, router="sigmoid-bias", bias_rate=0.01, shared_experts=1,
         route_groups=2, route_top_groups=1, steps=3),
    dict(SMALL, dp=4, ep=2, top_k=3, steps=1),          # the same without the limit
    dict(SMALL, dp=4, ep=4, router="sigmoid-bias", bias_rate=0.01, route_groups=4,
         route_top_groups=2, microbatches=2, optimizer="adam", steps=3),
    dict(SMALL, dp=2, tp=2, ep=2, router="sigmoid-bias", bias_rate=0.01, shared_experts=2,
         steps=3),
    dict(SMALL, dp=2, pp=2, ep=2, router="sigmoid-bias", bias_rate=0.01, shared_experts=1,
         microbatches=2, schedule="zb-h1", steps=2),
    dict(SMALL, dp=4, ep=2, zero=3, router="sigmoid-bias", bias_rate=0.01, shared_experts=1,
         optimizer="adam", steps=2),
]
# b in a checkpoint: saved on dp x ep at step 2, resumed on dp x tp x ep to step 4
# ("{ck}" is the job's checkpoint folder)
ROUTED_CK = dict(SMALL, router="sigmoid-bias", bias_rate=0.003, shared_experts=1,
                 route_groups=2, route_top_groups=1, optimizer="adam", lr=0.01)
SAVE_RESUME = [dict(ROUTED_CK, dp=4, ep=2, steps=2, save="{ck}"),
               dict(ROUTED_CK, dp=2, tp=2, ep=2, steps=4, resume="{ck}")]
# the 4-rank runs without a capacity once more in bf16 (float64 masters), in the same job
# (a capacity's token drop is no rounding: docs/design.md)
BF16 = [dict(c, mixed="bf16") for c in FOUR + ROUTED if not c.get("capacity_factor")]
# shared experts beside experts split over tp (the MLP MoE: both cut over tp; gpt-moe: both
# whole on every tp rank), in the same job: each --grad-sync (buckets of 600 elements: a
# shared expert's 4 arrays fit one as tp shards, 544, not whole, 1072), ZeRO 1-3, with
# ep, in bf16 with 16-bit gradient sums
SHARED_TP = [
    dict(SMALL, dp=2, tp=2, shared_experts=1, grad_sync="naive", steps=2),
    dict(SMALL, dp=2, tp=2, shared_experts=1, bucket_size=600, steps=2),
    dict(SMALL, dp=2, tp=2, shared_experts=2, grad_sync="overlapped", bucket_size=600,
         microbatches=2, steps=2),
    dict(SMALL, dp=2, tp=2, shared_experts=1, zero=1, optimizer="adam", steps=2),
    dict(SMALL, dp=2, tp=2, ep=2, shared_experts=1, zero=2, steps=2),
    dict(SMALL, dp=2, tp=2, shared_experts=1, zero=3, steps=2),
    dict(SMALL, dp=2, tp=2, shared_experts=1, mixed="bf16", grad_reduce_dtype="low", zero=2,
         steps=2),
    dict(model="gpt-moe", layers=2, d_model=16, heads=2, seq_len=8, batch=8, experts=4,
         expert_d_ff=16, dp=2, tp=2, shared_experts=1, zero=1, seed=3, steps=2),
]
JOB = FOUR + ROUTED + BF16 + SHARED_TP + SAVE_RESUME   # the 4-rank job's configs, in order
PROBE = nn.ModelConfig(model="moe", layers=1, d_in=8, d_model=16, experts=8, top_k=2,
                       expert_d_ff=32, capacity_factor=1.0, aux_coef=0.01)


# ----------------------------------------------------------------- rank side
def count_nodes(root: ag.Tensor) -> int:
    """Nodes of the tape behind `root` (a per-token Python loop would grow this)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.parents)
    return len(seen)


def probe_block(world: object) -> dict:
    """One EP block (dp=4, ep=2) called directly: the aux loss with a zero router, and
    the tape size for b and 3b local tokens."""
    from minipar.comm.collectives import Ledger
    from minipar.comm.mesh import Mesh, MeshShape
    from minipar.parallel.expert_parallel import ExpertParallelBlock

    mesh = Mesh(MeshShape(dp=world.Get_size(), ep=2), world, Ledger())
    full = nn.init_params(PROBE, seed=1)
    rng = np.random.default_rng([7, mesh.rank])
    nodes = []
    for rows in (4, 12):
        block = ExpertParallelBlock(full, 0, PROBE, mesh)
        h = ag.Tensor(rng.normal(size=(rows, PROBE.d_model)), requires_grad=True)
        out, aux = block(h)
        loss = out.sum() + aux
        loss.backward()
        nodes.append(count_nodes(loss))
    full["blocks.0.router.weight"][:] = 0.0
    block = ExpertParallelBlock(full, 0, PROBE, mesh)
    out, aux = block(ag.Tensor(rng.normal(size=(8, PROBE.d_model)), requires_grad=True))
    (out.sum() + aux).backward()  # every rank takes part in the backward exchanges
    mesh.free()
    return {"nodes": nodes, "uniform_aux": aux.item(), "uniform_stats": block.last_stats}


def rank_main(spec: Path, out: Path) -> None:
    """Train each config of `spec` (dump like tests.harness.mpi.sweep, plus expert_load.json with
    every rank's load statistics), then write the block probe to probe.json."""
    from mpi4py import MPI

    from minipar.run.results import dump
    from minipar.run.train import train

    world = MPI.COMM_WORLD
    for i, fields in enumerate(json.loads(spec.read_text())):
        cfg = TrainConfig(**fields).resolved(world.Get_size())
        assert not problems(cfg, world.Get_size()), problems(cfg, world.Get_size())
        result = train(cfg, world)
        loads = world.gather(result.extras["expert_load"])
        held = world.gather(int(result.extras["memory"].params))  # bytes of parameters
        if world.Get_rank() == 0:
            dump(out / str(i), cfg, result)
            (out / str(i) / "expert_load.json").write_text(json.dumps(loads))
            (out / str(i) / "params_bytes.json").write_text(json.dumps(held))
            (out / str(i) / "replicas.json").write_text(
                json.dumps(result.extras["replica_disagreements"]))
    probe = probe_block(world)
    if world.Get_rank() == 0:
        (out / "probe.json").write_text(json.dumps(probe))


# ----------------------------------------------------------- the test side
def run_equivalence(runs: list[dict], configs: list[dict]) -> None:
    for run, fields in zip(runs, configs):
        assert_equivalent(run, reference(**fields), label=str(fields))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The 4-rank job: dumps of FOUR, load statistics, and the block probe."""
    folder = tmp_path_factory.mktemp("ep4")
    spec = folder / "configs.json"
    spec.write_text(json.dumps(JOB).replace("{ck}", str(folder / "ck")))
    job = launch(4, ["-m", "tests.parallel.test_expert_parallel", str(spec), str(folder)],
                 timeout=180)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    runs = [read_dump(folder / str(i)) for i in range(len(JOB))]
    for i, run in enumerate(runs):
        run["expert_load"] = json.loads((folder / str(i) / "expert_load.json").read_text())
        run["replica_disagreements"] = json.loads((folder / str(i) / "replicas.json").read_text())
        run["params_bytes"] = json.loads((folder / str(i) / "params_bytes.json").read_text())
    return {"runs": runs, "probe": json.loads((folder / "probe.json").read_text())}


def test_equivalence_eight_ranks_64_experts(tmp_path):
    run_equivalence(sweep(8, EIGHT, tmp_path, timeout=120), EIGHT)


def test_equivalence_two_ranks_ep1(tmp_path):
    run_equivalence(sweep(2, TWO, tmp_path, timeout=120), TWO)


def test_equivalence_four_ranks(four):
    run_equivalence(four["runs"][:len(FOUR)], FOUR)
    assert all(run["ledger"] for run in four["runs"])


def test_the_runs_without_a_capacity_in_bf16_are_within_the_derived_tolerance(four):
    start = len(FOUR + ROUTED)
    for fields, run in zip(BF16, four["runs"][start:start + len(BF16)]):
        assert_within_mixed_tolerance(run, fields, 4, str(fields))


def test_deepseek_routing_equals_one_process_b_included(four):
    """Every ROUTED config equals one process (float64, 1e-9), the bias b of every block
    among the final arrays; b moved, and its replicas on every rank are bitwise equal."""
    runs = four["runs"][len(FOUR):]
    run_equivalence(runs, ROUTED)
    for fields, run in zip(ROUTED, runs):
        if fields.get("router") == "sigmoid-bias":
            b = [run["final"][f"blocks.{i}.router.bias_balance"] for i in range(2)]
            assert max(np.abs(v).max() for v in b) > 0, fields
        assert run["replica_disagreements"] == [], (fields, run["replica_disagreements"])


def test_every_ledger_line_and_memory_of_the_job_is_the_formulas(four):
    """Every run of the 4-rank job, every rank's last-step ledger against the formulas
    (teaching/ledger_tables.py `ledger_differences`: calls, elements and bytes exactly;
    the Alltoallv's by the router), and rank 0's bytes of parameters against the
    planner's memory formula as `--check` takes it: among them the shared experts beside
    experts split over tp, whose dp gradient sync moves their tp shards (SHARED_TP,
    which also equal one process)."""
    from minipar.planner.memory_cost import model_states, rank_shape
    from minipar.planner.workloads import minipar_workload, plan_of
    from minipar.teaching.ledger_tables import ledger_differences, split_experts_shape

    for fields, run in zip(JOB, four["runs"]):
        cfg = TrainConfig(**run["config"]).resolved(4)
        assert ledger_differences(run["ledger"], cfg) == [], fields
        workload, plan = minipar_workload(cfg), plan_of(cfg)
        want = model_states(workload, plan,
                            split_experts_shape(cfg, rank_shape(workload, plan, 0)), 0)
        assert run["params_bytes"][0] == int(want.params), fields
    start = len(FOUR + ROUTED + BF16)
    for fields, run in zip(SHARED_TP, four["runs"][start:start + len(SHARED_TP)]):
        if fields.get("mixed"):
            assert_within_mixed_tolerance(run, fields, 4, str(fields))
        else:
            assert_equivalent(run, reference(**fields), label=str(fields))
        assert run["replica_disagreements"] == [], fields


def test_b_is_checkpointed_and_resumed_on_another_mesh(four):
    """The manifest holds every block's b after step 2 (the one-process b, bit for bit);
    the run resumed on dp x tp x ep equals one process over all 4 steps, b included
    (it could not if b restarted from 0: b after step 2 is not 0)."""

    saved, resumed = four["runs"][-2:]
    fields = {k: v for k, v in SAVE_RESUME[1].items() if k != "resume"}
    manifest = shard_files.read_manifest(saved["job_folder"].parent / "ck")
    at_two = reference(**dict(fields, steps=2)).final
    for i in range(2):
        name = f"blocks.{i}.router.bias_balance"
        assert np.array_equal(manifest["router_bias"][name], at_two[name])
        assert np.abs(at_two[name]).max() > 0
    assert_equivalent(resumed, reference(**fields), label="resumed on dp x tp x ep")
    assert resumed["replica_disagreements"] == []

    from minipar.run.generate import full_params  # generate --resume: b beside the parameters

    held = full_params(TrainConfig(**dict(fields, resume=str(saved["job_folder"].parent
                                                             / "ck"))).resolved(1))
    assert all(np.array_equal(held[name], value)
               for name, value in manifest["router_bias"].items())


def test_node_limited_routing_reaches_at_most_m_groups(four):
    """The routing ledger (parallel/moe/load_stats.py `group_stats`) of the last step: per rank and
    block, the tokens and rows sent to each group (here a group is an ep rank). With
    --route-top-groups 1 of 2 groups no token reaches more than one, so the tokens sent
    across groups add up to at most M x tokens; the same model unlimited reaches both.
    The rows per group are the dispatch's: the Alltoallv elements of the step are the
    sent and received rows, twice each (forward and backward), times d."""
    limited, unlimited = four["runs"][len(FOUR)], four["runs"][len(FOUR) + 1]
    cfg = TrainConfig(**limited["config"]).resolved(4)
    tokens = cfg.batch // cfg.dp
    for rank, blocks in enumerate(limited["expert_load"]):
        for stats in blocks:
            assert stats["groups"] == 2 and stats["most_groups"] == 1, stats
            assert sum(stats["tokens_to_group"]) <= cfg.route_top_groups * tokens
            assert sum(stats["tokens_to_group"]) == tokens   # dropless: everyone goes
            assert stats["rows_to_group"] == stats["sent"]   # a group is an ep rank
        rows = sum(sum(s["sent"]) + sum(s["received"]) for s in blocks)
        assert ledger_of(limited, rank, "Alltoallv", "ep")[1] == 2 * rows * cfg.d_model
    assert max(s["most_groups"] for blocks in unlimited["expert_load"] for s in blocks) == 2


def routing_plan(run: dict) -> list[dict]:
    """Recompute, in one process from the dumped init and data, what every block of every
    microbatch of step 0 routes: per dp rank, rows sent to / received from each ep rank."""
    cfg = TrainConfig(**run["config"])
    model = nn.build_reference(cfg.model_config(), run["init"])
    x = np.load(run["job_folder"] / "data.npz")["x"][0]
    rows, per_rank = cfg.batch // cfg.microbatches, cfg.experts // cfg.ep
    plans = []
    with ag.no_grad():
        for m in range(cfg.microbatches):
            h = model.embed(ag.Tensor(x[m * rows:(m + 1) * rows]))
            for block in model.blocks:
                probs = fused_layers.softmax(block.ln(h) @ block.router).data
                expert_of = nn.route(probs, cfg.top_k).ravel()
                limit = nn.capacity(cfg.capacity_factor, cfg.top_k, rows, cfg.experts)
                kept = nn.keep_within_capacity(expert_of, cfg.experts, limit)
                owner = np.where(kept, expert_of // per_rank, -1).reshape(cfg.dp, -1)
                send = np.stack([(owner == j).sum(axis=1) for j in range(cfg.ep)], axis=1)
                group_of = np.arange(cfg.dp) // cfg.ep
                recv = np.stack([send[group_of == group_of[r], r % cfg.ep]
                                 for r in range(cfg.dp)])
                plans.append({"send": send, "recv": recv, "routed": np.bincount(
                    expert_of, minlength=cfg.experts), "dropped": int((~kept).sum())})
                h, _ = block(h)
    return plans


def ledger_of(run: dict, rank: int, op: str, group: str) -> tuple[int, int]:
    rows = [r for r in run["ledger"] if (r["rank"], r["op"], r["group"]) == (rank, op, group)]
    return sum(r["calls"] for r in rows), sum(r["elements"] for r in rows)


@pytest.mark.parametrize("index", [2, 3])
def test_ledger_matches_routing(four, index):
    run = four["runs"][index]
    cfg = TrainConfig(**run["config"])
    plans = routing_plan(run)
    blocks_microbatches = cfg.layers * cfg.microbatches
    for rank in range(cfg.dp):
        rows = sum(p["send"][rank].sum() + p["recv"][rank].sum() for p in plans)
        # dispatch + combine forward, their conjugates backward: each row of d twice per way
        assert ledger_of(run, rank, "Alltoallv", "ep") == (
            4 * blocks_microbatches, 2 * rows * cfg.d_model)
        # the per-expert counts: E/ep to each of the ep ranks, once per block and microbatch
        assert ledger_of(run, rank, "Alltoall", "ep") == (
            blocks_microbatches, blocks_microbatches * cfg.experts)
        exscans = blocks_microbatches if cfg.capacity_factor else 0
        assert ledger_of(run, rank, "Exscan", "dp") == (exscans, exscans * cfg.experts)
    total = sum(ledger_of(run, r, "Alltoallv", "ep")[1] for r in range(cfg.dp))
    kept = sum(cfg.top_k * cfg.batch // cfg.microbatches - p["dropped"] for p in plans)
    assert total == 4 * kept * cfg.d_model
    if cfg.capacity_factor is None:  # k x tokens x d per direction, four directions
        assert total == 4 * cfg.layers * cfg.top_k * cfg.batch * cfg.d_model


@pytest.mark.parametrize("index", [2, 3])
def test_load_statistics_match_routing(four, index):
    run = four["runs"][index]
    cfg = TrainConfig(**run["config"])
    last = routing_plan(run)[-cfg.layers:]  # the last microbatch, every block
    for rank, blocks in enumerate(run["expert_load"]):
        for stats, plan in zip(blocks, last):
            assert stats["routed"] == plan["routed"].tolist()
            assert stats["dropped"] == plan["dropped"]
            assert stats["sent"] == plan["send"][rank].tolist()
            assert stats["received"] == plan["recv"][rank].tolist()
            assert sum(stats["rank_load"]) == cfg.top_k * cfg.batch // cfg.microbatches \
                - plan["dropped"]
            routed = np.array(stats["routed"])
            assert stats["imbalance"] == pytest.approx(routed.max() / routed.mean())
    if cfg.capacity_factor is not None:
        assert sum(s["dropped"] for s in run["expert_load"][0]) > 0, "capacity dropped nothing"


def test_capacity_drops_tokens_in_every_capacity_run(four):
    for run in four["runs"]:
        if run["config"]["capacity_factor"] is not None:
            assert sum(s["dropped"] for s in run["expert_load"][0]) > 0, run["config"]


def test_uniform_routing_aux_equals_coef():
    full = nn.init_params(PROBE, seed=1)
    full["blocks.0.router.weight"][:] = 0.0
    _, aux = nn.MoEBlock(full, 0, PROBE)(ag.Tensor(np.random.default_rng(0).normal(size=(32, 16))))
    assert aux.item() == pytest.approx(PROBE.aux_coef, rel=1e-12)


def test_uniform_routing_aux_equals_coef_under_ep(four):
    probe = four["probe"]
    assert probe["uniform_aux"] == pytest.approx(PROBE.aux_coef, rel=1e-12)
    # ties go to the lower ids: experts 0 and 1 take every token, capped at ceil(c k B / E)
    stats = probe["uniform_stats"]
    tokens = 8 * 4
    limit = int(np.ceil(PROBE.capacity_factor * PROBE.top_k * tokens / PROBE.experts))
    assert stats["routed"] == [tokens, tokens] + [0] * 6
    assert stats["kept"] == [limit, limit] + [0] * 6
    assert stats["dropped"] == 2 * (tokens - limit)


def test_no_per_token_python_loop(four):
    small, large = four["probe"]["nodes"]
    assert small == large, f"the tape grows with the tokens: {small} nodes vs {large}"


def test_ep_problems_are_refused():
    def first(**fields):
        found = problems(TrainConfig(**dict(SMALL, **fields)).resolved(4), 4)
        return found[0] if found else ""
    assert "--ep 3 must divide --dp 4" in first(dp=4, ep=3, experts=6)
    assert "--ep 4 does not divide --experts 6" in first(dp=4, ep=4, experts=6)
    assert first(dp=4, ep=2) == ""
    assert first(model="mlp", dp=4, ep=2).startswith("--ep needs --model moe")


# expert tensor parallelism: every expert's fc1 split by columns, fc2 by rows over tp
SPLIT = [dict(SMALL, tp=2, dp=2, ep=2, optimizer="adam", steps=2),
         dict(SMALL, tp=4, steps=2),
         dict(SMALL, tp=2, dp=2, top_k=1, microbatches=2, capacity_factor=1.0, steps=2),
         dict(SMALL, tp=2, pp=2, microbatches=2, optimizer="adam", steps=2),
         dict(SMALL, tp=2, dp=2, ep=2, zero=3, optimizer="adam", steps=2),
         # --clip-grad-norm (clip.py) with experts split over tp and ep, on ZeRO's slices
         # and on a pipeline: one Allreduce over the world, C below the norm (it clips)
         dict(SMALL, tp=2, dp=2, ep=2, zero=1, microbatches=2, clip_grad_norm=0.01, steps=2),
         dict(SMALL, tp=2, pp=2, microbatches=2, clip_grad_norm=0.01, optimizer="adam",
              steps=2)]


def test_experts_split_over_tp_equal_one_process_with_two_allreduces_per_block(tmp_path):
    """Equal to one process; per block and microbatch two tp Allreduces (the shares
    forward, the input gradient backward), of the rows an expert rank received: the same
    on every rank of a tp group, and over all ranks tp x 2 x (k B) x L rows of d without
    capacity (every assignment is received by one rank of each tp coordinate)."""
    runs = sweep(4, SPLIT, tmp_path, timeout=180)
    run_equivalence(runs, SPLIT)
    for fields, run in zip(SPLIT, runs):
        cfg = TrainConfig(**fields).resolved(4)
        if cfg.clip_grad_norm is not None:  # it clipped, and the norm's one Allreduce
            assert min(reference(**fields).extras["gnorms"]) > cfg.clip_grad_norm, fields
            assert [(r["calls"], r["elements"]) for r in run["ledger"] if r["rank"] == 0
                    and r["group"] == "world" and r["op"] == "Allreduce"] == [(1, 1)], fields
        mesh = cfg.mesh_shape()
        per_rank = [ledger_of(run, rank, "Allreduce", "tp") for rank in range(4)]
        blocks_here = cfg.layers // cfg.pp
        assert all(calls == 2 * blocks_here * cfg.microbatches for calls, _ in per_rank), \
            (fields, per_rank)
        for group in mesh.groups("tp"):
            assert len({per_rank[r][1] for r in group}) == 1, (fields, per_rank)
        if cfg.capacity_factor is None:
            rows = cfg.tp * 2 * cfg.top_k * cfg.batch * cfg.layers
            assert sum(elements for _, elements in per_rank) == rows * cfg.d_model, fields
        others = [r for r in run["ledger"] if r["group"] == "tp" and r["op"] != "Allreduce"]
        assert others == [], others


def test_expert_tp_refusals():
    def first(**fields):
        found = problems(TrainConfig(**dict(SMALL, **fields)).resolved(4), 4)
        return found[0] if found else ""
    assert first(tp=4, dp=1) == ""
    assert first(tp=4, dp=1, expert_d_ff=18).startswith("--tp 4 does not divide --expert-d-ff")
    assert first(tp=2, dp=2, sp=True).startswith("--sp with --model moe is not built")


def test_lesson_runs_and_matches_one_process():
    # the run tests/teaching/test_lessons.py checks (--quick: part 7a takes 40 steps, not 200)
    job, _ = lesson_run(8, "03_expert_parallel.py", "--quick")
    assert job.returncode == 0 and not job.timed_out, job.explain()
    out = job.stdout
    assert "tokens sent from rank (row) to rank (column)" in out
    matrix = re.findall(r"^ *from rank (\d):((?: +\d+){8}) +\| +(\d+)$", out, re.M)
    assert [int(r) for r, _, _ in matrix[:8]] == list(range(8))
    assert all(sum(map(int, cells.split())) == int(total) for _, cells, total in matrix)
    assert re.search(r"dropped by capacity: [1-9]\d* of \d+ assignments", out)
    diffs = [float(v) for v in re.findall(r"max rel diff ([0-9.e+-]+)", out)]
    assert len(diffs) >= 3 and max(diffs) <= 1e-9, diffs
    ledger = re.search(r"Alltoallv elements \(all ranks, forward\+backward\): (\d+) = "
                       r"4 x kept (\d+) x d (\d+)", out)
    assert ledger and int(ledger[1]) == 4 * int(ledger[2]) * int(ledger[3])
    # part 6: training with the aux loss (coef 0.1) balances the experts sooner than without
    rows = {int(step): [float(v) for v in cells.replace("%", "").split()] for step, cells in
            re.findall(r"^ +(\d+)((?: +[\d.]+ +\d+%){3})$", out, re.M)}
    assert sorted(rows) == [0, 5, 10, 20, 40], out
    assert rows[0][0] == rows[0][2] == rows[0][4] > 5  # one untrained router, imbalanced
    none, strong = (rows[10][0], rows[10][1]), (rows[10][4], rows[10][5])
    assert strong[0] < none[0] and strong[1] < none[1], rows[10]
    assert rows[40][4] < rows[0][4] and rows[40][5] < rows[40][1], rows[40]
    # part 7a: the load per expert, measured; the bias holds the imbalance lowest
    table = {int(step): [float(v) for v in cells.split()] for step, cells in
             re.findall(r"^ +(\d+)((?: +\d+\.\d\d){3})$", out, re.M)}
    assert sorted(table) == [0, 10, 20, 40], out
    assert table[0][0] == table[0][1] == table[0][2]           # one router, three runs
    assert table[40][2] < table[0][2] and table[40][2] < min(table[40][:2]), table
    assert re.search(r"-> OK \(the bias balances best\)", out)
    # part 7b: at most M hosts per token, and the deduplicated cross-host bytes fall
    hosts = {int(m): (int(most), int(tokens), float(kib)) for m, most, tokens, kib in
             re.findall(r"^ +(\d) +max (\d), mean [\d.]+ +(\d+) = +([\d.]+) KiB", out, re.M)}
    assert sorted(hosts) == [1, 2] and hosts[1][0] == 1 and hosts[2][0] == 2, hosts
    # a token is d = 16 float64 numbers: 128 bytes, printed in KiB to one decimal
    assert abs(hosts[1][2] - hosts[1][1] * 16 * 8 / 1024) <= 0.05 and \
        hosts[1][1] < hosts[2][1], hosts
    assert "no token reaches more than 1 host -> OK" in out and "deepseek-v3" in out


if __name__ == "__main__":
    from minipar.comm.job import abort_on_exception  # loads mpi4py.MPI: only in a rank process

    # one rank failing aborts all, with its traceback
    abort_on_exception(lambda: rank_main(Path(sys.argv[1]), Path(sys.argv[2])))
