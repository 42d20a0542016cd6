"""`plan --optimizer muon` priced (minipar/planner/muon_cost.py): the block matrices'
K, the bytes each --muon-mode adds per GPU, the Newton-Schulz FLOPs, against hand
computations for a tiny model and lesson 17's Llama 3 70B table; refusals one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from minipar.__main__ import main
from minipar.planner.memory_cost import Plan, model_states, rank_shape
from minipar.planner.muon_cost import layer_matrices, muon_modes, muon_price, ns_flops
from minipar.planner.presets import CLUSTERS, MODELS, ModelShape
from minipar.planner.search import evaluate, hardware
from minipar.planner.workloads import transformer

# 2 layers, d 8, 2 heads of 4, 1 key/value head, SwiGLU of 16: per layer Q (8, 8),
# K (8, 4), V (8, 4), O (8, 8), gate and up (8, 16), down (16, 8): 576 numbers
TINY = ModelShape("tiny", layers=2, d_model=8, heads=2, kv_heads=1, d_ff=16, vocab=32,
             seq_len=4, ffn_matrices=3, style="llama")
MATS = layer_matrices(TINY) * 2
F, TP_BW, DP_BW = 1e12, 100.0, 10.0   # FLOP/s, bytes/s over tp, over dp


def test_tiny_matrices_and_flops_by_hand():
    assert [s for s, _ in layer_matrices(TINY)] == [(8, 8), (8, 4), (8, 4), (8, 8),
                                                   (8, 16), (8, 16), (16, 8)]
    # 5 iterations of X X^T (2 s s l), A A (2 s^3), (bA + cAA) X (2 s s l), s the short side
    assert ns_flops(8, 8) == 5 * (2 * 64 * 8 + 2 * 512 + 2 * 64 * 8) == 15360
    assert ns_flops(8, 4) == ns_flops(4, 8) == 5 * (2 * 16 * 8 * 2 + 2 * 64) == 3200
    assert ns_flops(16, 8) == 5 * (2 * 64 * 16 * 2 + 2 * 512) == 25600


def test_tiny_bytes_per_mode_by_hand():
    """tp 2 x dp 4, 14 matrices of 1152 numbers in all."""
    dup = muon_price(MATS, "duplicated", 2, 4, F, TP_BW, DP_BW)
    assert dup.bytes == 4 * 1152                       # every matrix whole, fp32
    assert dup.wire_seconds == pytest.approx(4608 / DP_BW)
    assert dup.compute_seconds == pytest.approx(2 * (2 * 15360 + 2 * 3200 + 3 * 25600) / F)
    dist = muon_price(MATS, "distributed", 2, 4, F, TP_BW, DP_BW)
    shard = 4 * 1152 / 2 * 3 / 4                       # the tp shard gathered over dp
    gram = 14 * 5 * 2 * (1 / 2) * 8 * 8 * 2            # an 8 x 8 bf16 Gram, 5 ring Allreduces
    assert dist.bytes == pytest.approx(shard + gram) and shard + gram == 10688
    assert dist.wire_seconds == pytest.approx(shard / DP_BW + gram / TP_BW)
    # per iteration the two products cut by tp, A A (8^3) whole: Q, O 1024; K, V 768;
    # each FFN matrix 1536 -- x 5 iterations x 2 FLOPs
    assert dist.compute_seconds == pytest.approx(
        2 * 10 * (2 * 1024 + 2 * 768 + 3 * 1536) / F)
    # 8 homes, largest first to the least loaded: 6 FFN matrices alone, the 4 (8, 8)
    # two by two (30720 FLOPs, the busiest), the 4 (8, 4) with FFN matrices (28800)
    home = muon_price(MATS, "layer-sharded", 2, 4, F, TP_BW, DP_BW)
    assert home.bytes == 2 * 4 * 2 * 64                # two 8 x 8 in whole, their pieces out
    assert home.wire_seconds == pytest.approx(1024 / DP_BW)
    assert home.compute_seconds == pytest.approx(2 * 15360 / F)


def test_k_is_muons_one_number_for_block_matrices():
    """ZeRO-0, one GPU: Adam's 12 bytes a parameter, Muon's 8 (fp32 master, momentum)
    for the 1152 block-matrix numbers."""
    w = transformer(TINY, 4)
    plan = Plan(1)
    shape = rank_shape(w, plan, 0)
    adam = model_states(w, plan, shape).optimizer
    muon = model_states(w, replace(plan, optimizer="muon"), shape).optimizer
    assert adam == 12 * w.params
    assert muon == pytest.approx(8 * 1152 + 12 * (w.params - 1152), rel=1e-12)


@pytest.mark.parametrize("dp, across", [(4, False), (16, True)])
def test_the_step_adds_muons_wire_and_newton_schulz(dp, across):
    """A named plan: the step grows by exactly the price's seconds, the 'muon' column
    holds its bytes; tp 2 in a node (NVLink), dp over NVLink while tp x dp fits in a
    node of 8, over InfiniBand once it does not."""
    hw = hardware(CLUSTERS["h100"])
    w = transformer(TINY, 32)
    plan = Plan(dp=dp, tp=2, pp=1, zero=1, microbatches=1)
    base = evaluate(w, hw, plan)
    dp_bw = hw.inter_bw if across else hw.intra_bw
    for mode in ("layer-sharded", "distributed", "duplicated"):
        e = evaluate(w, hw, replace(plan, optimizer="muon", muon_mode=mode))
        price = muon_price(MATS, mode, 2, dp, hw.flops, hw.intra_bw, dp_bw)
        assert e.wire["muon"] == price.bytes
        assert e.timing.total - base.timing.total == pytest.approx(
            price.wire_seconds + price.compute_seconds, rel=1e-9)


def test_lesson_17_llama3_70b_table():
    """Lesson 17 section 3: tp 8 x dp 128 H100s, as it printed before the move."""
    m, c = MODELS["llama3-70b"], CLUSTERS["h100"]
    rows = muon_modes(m, m.layers, 8, 128, c.flops * 1e12, c.intra_bw * 1e9, c.inter_bw * 1e9)
    got = [(p.mode, round(p.bytes / 1e9, 2), round(p.wire_seconds, 2),
            round(p.compute_seconds, 3)) for p in rows]
    assert got == [("duplicated", 273.80, 5.48, 13.370), ("distributed", 691.63, 2.14, 4.530),
                   ("layer-sharded", 1.88, 0.04, 0.044)]


@pytest.mark.parametrize("flags, named", [
    (["--optimizer", "muon", "--muon-mode", "sharded"], "--muon-mode must be one of"),
    (["--muon-mode", "duplicated"], "needs --optimizer muon"),
    (["--optimizer", "muon", "--experts", "8", "--top-k", "2", "--expert-d-ff", "64"],
     "dense multi-head models only"),
])
def test_muon_refusals_are_one_line(flags, named, capsys):
    assert main(["plan", "--preset", "llama3-8b", "--cluster", "h100", "--gpus", "64",
                 "--global-batch", "64", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]


def test_serve_refuses_the_optimizer(capsys):
    assert main(["plan", "--serve", "--preset", "llama3-8b", "--cluster", "h100", "--gpus",
                 "8", "--prompt-len", "8", "--new-tokens", "8", "--optimizer", "muon"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--optimizer is training's" in err[0]
