"""`plan --fp8` priced (minipar/planner/time_cost.py): the blocks' matmuls at the GPU's
FP8 rate and nothing else, ZeRO-3's weight gathers in one byte a number, one amax
Allreduce a step; refused on a GPU without an FP8 rate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from minipar.__main__ import main
from minipar.planner.memory_cost import Plan, rank_shape, tokens_per_microbatch
from minipar.planner.presets import CLUSTERS, MODELS
from minipar.planner.search import hardware
from minipar.planner.time_cost import compute_seconds, dp_traffic
from minipar.planner.workloads import transformer

H100 = hardware(CLUSTERS["h100"])
W = transformer(MODELS["llama3-8b"], 64)


def test_only_the_blocks_matmuls_go_at_the_fp8_rate():
    """Llama 3 8B, tp 2 x pp 2 (stage 0: 16 layers): the step's compute falls by the
    matmuls' FLOPs (2 per block parameter and token, 3 passes) priced at 1979 instead
    of 989 TFLOP/s; an FP8 rate equal to BF16's changes nothing."""
    plan = Plan(dp=16, tp=2, pp=2, microbatches=4)
    shape = rank_shape(W, plan, 0)
    bf16 = compute_seconds(W, plan, shape, H100)
    fp8 = compute_seconds(W, replace(plan, fp8=True), shape, H100)
    same = compute_seconds(W, replace(plan, fp8=True), shape, replace(H100, fp8_flops=H100.flops))
    assert same == pytest.approx(bf16, rel=1e-12)
    block = sum(size // 2 if split else size for size, split in W.blocks[0].arrays)
    matmuls = 3 * 2 * block * len(shape.blocks)                       # per token
    tokens = W.batch * W.seq_len / plan.replicas
    small = 1 + W.microbatch_overhead / tokens_per_microbatch(W, plan)
    saved = small * tokens * matmuls * (1 / H100.flops - 1 / H100.fp8_flops) / H100.efficiency
    assert bf16 - fp8 == pytest.approx(saved, rel=1e-9)


def test_zero3_gathers_fp8_weights_and_allreduces_their_amax():
    plan = Plan(dp=64, tp=1, pp=1, zero=3, microbatches=1)
    shape = rank_shape(W, plan, 0)
    plain = {(t.op, t.phase): t for t in dp_traffic(W, plan, shape)}
    fp8 = {(t.op, t.phase): t for t in dp_traffic(W, replace(plan, fp8=True), shape)}
    gather = fp8[("Allgatherv", "pipeline")]
    assert gather.bytes == gather.elements == plain[("Allgatherv", "pipeline")].elements
    assert plain[("Allgatherv", "pipeline")].bytes == 2 * gather.elements
    amax = fp8[("Allreduce", "step")]
    assert amax.calls == 1 and amax.elements == 2 * W.layers and amax.bytes == 8 * W.layers
    assert ("Allreduce", "step") not in plain
    one = {(t.op, t.phase) for t in dp_traffic(W, replace(plan, zero=1, fp8=True), shape)}
    assert ("Allreduce", "step") not in one                   # ZeRO-1 gathers its bf16 copy


@pytest.mark.parametrize("flags, named", [
    (["--cluster", "dgx-a100-80gb", "--global-batch", "64"], "no FP8 matmul rate"),
    (["--cluster", "h100", "--serve", "--prompt-len", "8", "--new-tokens", "8"], "--fp8"),
])
def test_fp8_refusals_are_one_line(flags, named, capsys):
    assert main(["plan", "--preset", "llama3-8b", "--gpus", "64", "--fp8", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minipar: error:") and named in err[0]


def test_the_table_says_fp8(capsys):
    assert main(["plan", "--preset", "llama3-8b", "--cluster", "h100", "--gpus", "64",
                 "--global-batch", "64", "--top", "2", "--fp8"]) == 0
    out = capsys.readouterr().out
    assert "--fp8: the blocks' matmuls at 1979 TFLOP/s" in out and "+FP8" in out
