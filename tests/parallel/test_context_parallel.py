"""Context parallelism: the sequence split over cp ranks trains `gpt` like one process.

Equivalence (float64, rel 1e-9, losses and final parameters): every --cp-mode
(allgather, ring, zigzag, ulysses) on cp = 2 and cp = 4; cp x dp (with microbatches and
each gradient sync), ZeRO 1/2/3 over the dp x cp ranks, cp x pp under every schedule,
gpt-moe under cp (the rank's positions are its tokens; capacity and aux over the global
microbatch in global token order) and cp x dp x ep; --recompute selective and full in
every mode (the exchange run again in the backward); cp 2 x tp 2 in every mode (each
rank's T/cp positions of its H/tp heads), with --sp (T/(cp tp) positions between the
blocks), with and without the vocabulary split, under recomputation, gpt-moe; and on 8
ranks cp x tp x dp (ZeRO-1 too), cp x tp x pp (1f1b, interleaved), cp x tp x dp x ep.
SGD and Adam take turns; tiny shapes (L=2, d=16, H=4, T=16, V=16).

Work: the score entries each rank computes in its latest forward (`scores.json`): the
ring's rank r does r+1 blocks of (T/cp)^2 (its causal imbalance), zigzag's ranks all do
the same (2cp+1 quarter blocks), allgather and Ulysses the whole (masked) T x T.

Each mode's attention on its own: outputs and the gradients of q, k, v and the key bias
equal attention.attention on the whole sequence (rel 1e-12), with the collectives the
formulas count per call, on 2, 3, 4 and 8 ranks (`check_context_parallel_attention`, in
the MPI unit suite of tests/harness/rank_tests.py).

Ledger: each rank's entries are the formulas of timemodel.traffic (cp_traffic per mode:
ring 2 (cp-1) K and V blocks forward per layer, Ulysses 4 Alltoalls forward and 4
backward, allgather 2 Allgathers forward; blocks of (b, T/cp, d/tp); recomputation one
forward exchange more), tp's collectives on the rank's T/cp positions, and the gradient
sync over dp x cp.

One `sweep` launch per rank count (tests/harness/mpi.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from minipar.planner.memory_cost import rank_shape
from minipar.planner.time_cost import cp_traffic, ledger_of
from minipar.planner.workloads import minipar_workload, plan_of
from minipar.settings.config import TrainConfig
from tests import shapes
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import sweep
from tests.harness.rank_tests import RANK_COUNTS, agree, suite_report
from tests.reference.formulas import assert_ledger_and_memory_are_the_formulas

GPT = dict(shapes.GPT, seq_len=16, batch=4)   # 16 positions: 4 each over cp 4
MOE = dict(GPT, model="gpt-moe", experts=4, expert_d_ff=16, aux_coef=0.1)
ADAM = dict(optimizer="adam", lr=0.01)
MODES = ("allgather", "ring", "zigzag", "ulysses")

RUNS = {
    2: [dict(GPT, cp=2, cp_mode="allgather"),
        dict(GPT, **ADAM, cp=2, cp_mode="ring"),
        dict(GPT, cp=2, cp_mode="zigzag", microbatches=2),
        dict(GPT, **ADAM, cp=2, cp_mode="ulysses"),
        dict(GPT, **ADAM, cp=2, zero=1, cp_mode="ring"),
        dict(GPT, cp=2, zero=2, microbatches=2),
        dict(GPT, **ADAM, cp=2, zero=3, cp_mode="ulysses"),
        dict(GPT, cp=2, grad_sync="overlapped", cp_mode="allgather"),
        dict(MOE, cp=2, top_k=1, capacity_factor=1.0),              # tokens over cp, ep 1
        dict(MOE, **ADAM, cp=2, cp_mode="ring", capacity_factor=0.75),
        # recomputation repeats the cp exchange of the forward in the backward
        dict(GPT, cp=2, cp_mode="allgather", recompute="selective"),
        dict(GPT, **ADAM, cp=2, cp_mode="ring", recompute="full", microbatches=2),
        dict(GPT, cp=2, cp_mode="zigzag", recompute="selective"),
        dict(GPT, **ADAM, cp=2, cp_mode="ulysses", recompute="full")],
    4: [*(dict(GPT, cp=4, cp_mode=mode, **(ADAM if i % 2 else {}))
          for i, mode in enumerate(MODES)),
        dict(GPT, dp=2, cp=2, cp_mode="ring", microbatches=2),
        dict(GPT, **ADAM, dp=2, cp=2, cp_mode="zigzag", grad_sync="naive"),
        dict(GPT, dp=2, cp=2, cp_mode="ulysses", zero=3),
        dict(GPT, **ADAM, dp=2, cp=2, cp_mode="allgather", zero=1),
        dict(GPT, pp=2, cp=2, schedule="gpipe", microbatches=2),
        dict(GPT, **ADAM, pp=2, cp=2, cp_mode="ring", schedule="1f1b", microbatches=4),
        dict(GPT, pp=2, cp=2, cp_mode="ulysses", layers=4, schedule="interleaved",
             virtual=2, microbatches=2),
        dict(GPT, **ADAM, pp=2, cp=2, cp_mode="allgather", schedule="zb-h1",
             microbatches=2),
        dict(GPT, pp=2, cp=2, layers=4, schedule="zb-v", microbatches=4),
        dict(GPT, **ADAM, pp=2, cp=2, cp_mode="ring", layers=4, schedule="dualpipev",
             microbatches=4),
        dict(MOE, dp=2, cp=2, capacity_factor=0.75, microbatches=2),
        dict(MOE, **ADAM, cp=4, cp_mode="ring", top_k=1, capacity_factor=1.0),
        dict(MOE, dp=2, ep=2, cp=2, capacity_factor=0.75),
        dict(MOE, **ADAM, dp=2, ep=2, cp=2, cp_mode="ulysses", top_k=1, microbatches=2,
             capacity_factor=1.0),
        dict(MOE, dp=2, ep=2, cp=2, cp_mode="ring", batch=8, microbatches=2),
        # cp x tp: my T/cp positions of my H/tp heads; the vocabulary over tp
        *(dict(GPT, cp=2, tp=2, cp_mode=mode, **(ADAM if i % 2 else {}))
          for i, mode in enumerate(MODES)),
        dict(GPT, cp=2, tp=2, cp_mode="zigzag", sp=True),           # T/(cp tp) per rank
        dict(GPT, **ADAM, cp=2, tp=2, cp_mode="ulysses", sp=True, vocab_parallel=False),
        dict(GPT, cp=2, tp=2, cp_mode="ring", vocab_parallel=False, microbatches=2),
        dict(GPT, **ADAM, cp=2, tp=2, cp_mode="allgather", sp=True, recompute="full"),
        dict(GPT, cp=2, tp=2, cp_mode="ulysses", recompute="selective"),
        dict(GPT, **ADAM, cp=2, tp=2, cp_mode="ring", recompute="selective", sp=True),
        dict(GPT, cp=2, tp=2, cp_mode="zigzag", recompute="full"),
        dict(MOE, cp=2, tp=2, cp_mode="ring", capacity_factor=1.0),
        dict(MOE, **ADAM, cp=2, tp=2, cp_mode="zigzag", sp=True, top_k=1,
             capacity_factor=0.75)],
    8: [dict(GPT, dp=2, cp=2, pp=2, cp_mode="zigzag", microbatches=2, schedule="1f1b"),
        dict(MOE, **ADAM, dp=2, ep=2, cp=2, pp=2, cp_mode="ring", microbatches=2,
             capacity_factor=1.0, schedule="zb-h1"),
        dict(MOE, dp=4, ep=2, cp=2, cp_mode="allgather", capacity_factor=0.75),
        dict(GPT, dp=2, tp=2, cp=2, cp_mode="zigzag", microbatches=2),
        dict(GPT, **ADAM, dp=2, tp=2, cp=2, cp_mode="ulysses", sp=True, zero=1),
        dict(GPT, pp=2, tp=2, cp=2, cp_mode="ring", schedule="1f1b", microbatches=2,
             recompute="selective"),
        dict(GPT, **ADAM, pp=2, tp=2, cp=2, cp_mode="allgather", layers=4,
             schedule="interleaved", virtual=2, microbatches=2, sp=True),
        dict(MOE, dp=2, ep=2, tp=2, cp=2, cp_mode="ring", capacity_factor=1.0)],
}


# the 4-rank runs once more in bf16 (float64 masters), in the same job: every mode with
# tp, sp, recomputation and MoE, the ring's K/V blocks and Ulysses' Alltoalls as 16 bits.
# Not the capacity-limited MoE runs: there a rounding can move a token across the
# capacity cut, a whole token's change that no rounding tolerance bounds (docs/design.md)
BF16 = {n: [dict(c, mixed="bf16") for c in RUNS[n] if "capacity_factor" not in c]
        if n == 4 else [] for n in RUNS}


@pytest.fixture(scope="module", params=sorted(RUNS))
def swept(request, tmp_path_factory):
    """Every config of one rank count, trained in one mpiexec job."""
    world = request.param
    runs = sweep(world, RUNS[world] + BF16[world], tmp_path_factory.mktemp(f"cp{world}"),
                 timeout=480)
    return world, runs


def test_every_mode_of_4_ranks_in_bf16_is_within_the_derived_tolerance(swept):
    world, runs = swept
    for fields, run in zip(BF16[world], runs[len(RUNS[world]):]):
        assert_within_mixed_tolerance(run, fields, world, f"{world} ranks {fields}")


def test_every_mode_and_mesh_equals_one_process(swept):
    world, runs = swept
    for fields, run in zip(RUNS[world], runs):
        assert_equivalent(run, reference(**fields), label=f"{world} ranks {fields}")


def test_score_work_per_rank_shows_ring_imbalance_and_zigzag_balance(swept):
    """Measured score entries per rank and block: ring rank r computes r+1 of the cp
    (T/cp)^2 blocks, zigzag every rank 2cp+1 blocks of (T/2cp)^2, the others all cp."""
    world, runs = swept
    for fields, run in zip(RUNS[world], runs):
        cfg = TrainConfig(**fields).resolved(world)
        if cfg.pp > 1:
            continue
        scores = json.loads((run["job_folder"] / "scores.json").read_text())
        b = cfg.batch // cfg.microbatches // cfg.dp
        # one (T/cp)^2 block of this tp rank's heads
        block = b * (cfg.heads // cfg.tp) * (cfg.seq_len // cfg.cp) ** 2
        for rank, per_layer in enumerate(scores):
            r = cfg.mesh_shape().coords(rank)["cp"]
            expected = {"ring": (r + 1) * block, "zigzag": (2 * cfg.cp + 1) * block // 4,
                        "allgather": cfg.cp * block, "ulysses": cfg.cp * block}[cfg.cp_mode]
            assert per_layer == [expected] * cfg.layers, f"{fields} rank {rank}"
        if cfg.cp_mode in ("ring", "zigzag"):
            work = np.array([s[0] for s in scores])
            spread = work.max() / work.min()
            assert (spread == 1.0) == (cfg.cp_mode == "zigzag"), (fields, work)


def test_ledger_and_memory_are_the_formulas(swept):
    """Every rank's ledger entries (calls and elements) are timemodel.traffic's, cp's own
    per mode (2 Allgathers / 2 (cp-1) Isend-Irecv / 4 Alltoalls forward per layer) and the
    gradient sync over dp x cp; its model-state bytes are costmodel.model_states'."""
    world, runs = swept
    for fields, run in zip(RUNS[world], runs):
        assert_ledger_and_memory_are_the_formulas(world, fields, run)

def test_the_cp_formulas_per_layer():
    """The per-layer counts the issue names, read off the formulas for one microbatch."""
    cfg = TrainConfig(**GPT, cp=4).resolved(4)
    # ring, zigzag: K, V posted ahead (Isend/Irecv) 2 x 3 steps forward and backward,
    # dK, dV following them (Sendrecv) 2 x 3 steps and 2 home
    ring = {("cp", "Isend"): 4 * 3, ("cp", "Irecv"): 4 * 3, ("cp", "Sendrecv"): 2 * 3 + 2}
    for mode, expected in {"ring": ring, "zigzag": ring,
                           "ulysses": {("cp", "Alltoall"): 4 + 4},
                           "allgather": {("cp", "Allgather"): 2, ("cp", "Reduce_scatter"): 2}
                           }.items():
        c = TrainConfig(**dict(GPT, cp=4, cp_mode=mode, layers=1)).resolved(4)
        w, plan = minipar_workload(c), plan_of(c)
        found = {k: v[0] for k, v in ledger_of(cp_traffic(w, plan, rank_shape(w, plan, 0)))
                 .items()}
        assert found == expected, mode
    assert cfg.mesh_shape().groups("cp") == [[0, 1, 2, 3]]


# ------------------------------------------------- each mode's attention alone
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_each_mode_is_attention_on_the_whole_sequence(n):
    suite_report(n).assert_passed("tests.parallel.test_context_parallel:check_context_parallel_attention")


# the collectives of one call: forward, backward (cp ranks)
# (the ring: K, V posted ahead under the compute by Isend/Irecv, forward and backward;
# dK, dV following by Sendrecv, and home)
def _ring(cp: int) -> tuple[dict, dict]:
    ahead = {"Isend": 2 * (cp - 1), "Irecv": 2 * (cp - 1)}
    return ahead, dict(ahead, Sendrecv=2 * (cp - 1) + 2)


CALLS = {"allgather": lambda cp: ({"Allgather": 2}, {"Reduce_scatter": 2}),
         "ring": _ring, "zigzag": _ring,
         "ulysses": lambda cp: ({"Alltoall": 4}, {"Alltoall": 4})}


def check_context_parallel_attention(comm):
    """Rank side: random q, k, v, key bias and output gradient of a whole sequence (the
    same on every rank); each rank keeps its positions, runs one mode, and compares its
    output and gradients with attention.attention on the whole sequence."""
    from minipar.comm.collectives import Group, Ledger
    from minipar.core import attention
    from minipar.core.autograd import Tensor
    from minipar.parallel.context_parallel import ContextParallelAttention, positions

    cp = comm.Get_size()
    if cp == 1:
        return
    heads, dh, b = 2 * cp, 3, 2
    t = 4 * cp
    rng = np.random.default_rng(7)
    q, k, v, g = (rng.normal(size=(b, t, heads * dh)) for _ in range(4))
    bias = rng.normal(size=heads * dh)
    whole = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v, bias)]
    attention.attention(*whole[:3], heads, key_bias=whole[3]).backward(g)
    expected_out = attention.attention(*(Tensor(a) for a in (q, k, v)), heads,
                                       key_bias=Tensor(bias)).data
    problems = []
    for mode in CALLS:
        ledger = Ledger()
        cpa = ContextParallelAttention(Group(comm, "cp", ledger), mode, t)
        mine = positions(t, cp, comm.Get_rank(), mode)
        local = [Tensor(a[:, mine].copy(), requires_grad=True) for a in (q, k, v)]
        local_bias = Tensor(bias.copy(), requires_grad=True)
        out = cpa(*local, heads, key_bias=local_bias)
        forward = {op: e.calls for (op, _), e in ledger.entries.items()}
        ledger.reset()
        out.backward(g[:, mine])
        backward = {op: e.calls for (op, _), e in ledger.entries.items()}
        pairs = [("output", out.data, expected_out[:, mine])] + [
            (f"d{name}", got.grad, want.grad[:, mine])
            for name, got, want in zip("qkv", local, whole)]
        pairs.append(("d key_bias", local_bias.grad, np.zeros_like(bias)))
        for name, got, want in pairs:
            if np.max(np.abs(got - want)) > 1e-12 * max(np.max(np.abs(want)), 1.0):
                problems.append(f"{mode} {name}: off by {np.max(np.abs(got - want)):.2e}")
        if (forward, backward) != CALLS[mode](cp):
            problems.append(f"{mode}: calls {forward}, {backward} != {CALLS[mode](cp)}")
    agree(comm, problems)
