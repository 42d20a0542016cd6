"""Serving priced (minipar/planner/serving.py, `python -m minipar plan --serve`).

- one decode step's reads and FLOPs against the formula written out by hand (Llama 3
  70B on 8 H100s: every weight but the embedding and the cache, read at HBM speed);
- the pipeline's per-token latency (pp stage times) and its step (max(M, pp) of them);
- an MoE step reads the experts its rows chose: k of them at B = 1, all at large B;
- `plan --serve` prints lesson 16's numbers (section 4: tp 8 at 7.65 ms a token against
  pp 8 at 41.94, B = 1, context 4096), and the lesson prices through the planner;
- its bad flags are one error line, exit 2.
"""

from __future__ import annotations

import json

import pytest

from minipar.__main__ import main
from minipar.planner.presets import CLUSTERS, MODELS
from minipar.planner.search import hardware
from minipar.planner.serving import decode_price, touched_experts
from minipar.planner.workloads import layer_sizes, transformer
from tests.harness.mpi import ROOT

H100 = hardware(CLUSTERS["h100"])
LLAMA = MODELS["llama3-70b"]
SERVE = ["plan", "--serve", "--preset", "llama3-70b", "--cluster", "h100", "--gpus", "8",
         "--prompt-len", "4000", "--new-tokens", "96"]


def test_a_decode_step_reads_every_weight_and_the_cache():
    """tp 8, B = 1, context 4096: bf16 weights (the embedding is a lookup) and K, V of
    4096 positions in 80 layers, an eighth each, at 3.35 TB/s; FLOPs far below."""
    p = decode_price(LLAMA, H100, 8, 1, 1, 4096)
    weights = 2 * (transformer(LLAMA, 1).params - LLAMA.vocab * LLAMA.d_model)
    cache = LLAMA.layers * 4096 * layer_sizes(LLAMA)["kv_width"] * 2
    assert p.reads == pytest.approx((weights + cache) / 8 / 3.35e12, rel=1e-12)
    assert p.cache == pytest.approx(cache / 8, rel=1e-12)
    assert p.latency == pytest.approx(p.reads + p.waits, rel=1e-12) and p.waits > 0


def test_the_pipeline_stacks_the_reads_of_a_token():
    """pp 8: each GPU reads an eighth, but a token crosses the 8 stages one after the
    other, so its reads are the whole model's; 64 rows ride as 8 microbatches of 8."""
    one, many = (decode_price(LLAMA, H100, 1, 8, b, 4096) for b in (1, 64))
    tp = decode_price(LLAMA, H100, 8, 1, 1, 4096)
    assert one.reads == pytest.approx(8 * tp.reads, rel=1e-3)
    assert one.step == pytest.approx(one.latency, rel=1e-12)          # M = 1: pp stage times
    assert many.step == pytest.approx(many.latency, rel=1e-12)        # M = pp = 8
    assert many.throughput == pytest.approx(64 / many.step, rel=1e-12)
    assert tp.latency < one.latency / 5


def test_an_moe_step_reads_the_experts_its_rows_chose():
    assert touched_experts(8, 2, 1) == pytest.approx(2)
    assert touched_experts(8, 2, 1000) == pytest.approx(8)
    mixtral = MODELS["mixtral-8x7b"]
    one, many = (decode_price(mixtral, H100, 8, 1, b, 128) for b in (1, 512))
    assert one.reads < 0.4 * many.reads      # 12.9 B active of 46.7 B: most experts idle


def test_plan_serve_prints_lesson_16s_numbers(capsys, tmp_path):
    """Lesson 16, section 4, prices through the planner's decode_price and prints tp 8
    x pp 1 at 7.65 ms a token and tp 1 x pp 8 at 41.94 (B = 1, context 4096): the
    table of `plan --serve` has the same rows, the lowest latency first."""
    lesson = (ROOT / "lessons" / "16_serving.py").read_text()
    assert "from minipar.planner.serving import" in lesson and "def decode_price" not in lesson
    assert main(SERVE) == 0
    out = capsys.readouterr().out
    rows = {tuple(int(x) for x in line.split("|")[0].split()): line.split("|")[-1].split()
            for line in out.splitlines() if line.count("|") == 3 and line.split()[0] != "tp"}
    assert rows[(8, 1, 1)][0] == "7.65" and rows[(1, 8, 1)][0] == "41.94"
    first = next(line for line in out.splitlines() if line.count("|") == 3
                 and line.split()[0] != "tp")
    assert first.split()[:3] == ["8", "1", "1"]
    assert "lowest latency: tp 8 x pp 1" in out
    assert main([*SERVE, "--batch", "64", "--json", str(tmp_path / "s.json")]) == 0
    layouts = json.loads((tmp_path / "s.json").read_text())["layouts"]
    tp8 = next(r for r in layouts if (r["tp"], r["pp"]) == (8, 1))
    assert round(tp8["latency_s"] * 1e3, 2) == 11.44 and round(tp8["tokens_per_s"]) == 5592


@pytest.mark.parametrize("flags, named", [
    (["--dp", "2"], "--dp"),
    (["--global-batch", "8"], "--global-batch"),
    (["--tp", "3"], "--tp 3"),
    (["--ep", "2"], "--ep"),
])
def test_bad_serve_flags_are_one_error_line(flags, named, capsys):
    assert main([*SERVE, *flags]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("minipar: error:"), captured.err
    assert named in lines[0] and not captured.out


def test_serving_flags_need_serve_and_serve_needs_them(capsys):
    base = ["plan", "--preset", "llama3-70b", "--cluster", "h100", "--gpus", "8"]
    assert main([*base, "--global-batch", "8", "--batch", "4"]) == 2
    assert main([*base, "--serve", "--new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "add --serve" in err and "--prompt-len required with --serve" in err
