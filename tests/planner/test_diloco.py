"""`plan --sites S` priced (minipar/planner/diloco_cost.py): DP's gradient Allreduce every
step against DiLoCo's parameter Allreduce every H steps, and streaming DiLoCo's
fragments, on the slow link between sites: bytes and seconds against hand-derived
formulas for a tiny model and for Llama 3 70B; refusals one line, exit 2."""

from __future__ import annotations

import json

import pytest

from minipar.__main__ import main
from minipar.planner.diloco_cost import (
    OUTER_STATE_BYTES,
    crossing_bytes,
    fragment_params,
    link_bandwidth,
    link_schedule,
    site_prices,
)
from minipar.planner.memory_cost import Plan
from minipar.planner.presets import CLUSTERS, MODELS, ModelShape
from minipar.planner.search import evaluate, hardware
from minipar.planner.workloads import transformer

# 4 layers, d 8, 2 heads of 4, 1 key/value head, SwiGLU of 16, llama style. A layer:
# two RMSNorms 2 x 8, attention Q and O 2 x 8 x 8 + K and V 8 x 8 = 192, the FFN
# 3 x 8 x 16 = 384: 592. The embedding 32 x 8 = 256, the final norm 8 and the head 256.
TINY = ModelShape("tiny", layers=4, d_model=8, heads=2, kv_heads=1, d_ff=16, vocab=32,
                  seq_len=4, ffn_matrices=3, style="llama")
BLOCK, OUTSIDE = 16 + 192 + 384, 256 + 8 + 256
H100 = hardware(CLUSTERS["h100"])


def test_tiny_fragments_by_hand():
    w = transformer(TINY, 8)
    assert w.params == 4 * BLOCK + OUTSIDE == 2888
    assert fragment_params(w, 1) == [2888]
    assert fragment_params(w, 2) == [2 * BLOCK + OUTSIDE, 2 * BLOCK] == [1704, 1184]
    assert fragment_params(w, 4) == [BLOCK + OUTSIDE, BLOCK, BLOCK, BLOCK]
    with pytest.raises(ValueError, match="--fragments 3 does not divide the 4 layers"):
        fragment_params(w, 3)


def test_what_crosses_is_a_ring_over_the_site_sums():
    """2 (S-1)/S of the numbers, each of `itemsize` bytes: two sites send each number once
    each way, four sites 1.5 times."""
    assert crossing_bytes(2888, 2, 2) == 2888 * 2
    assert crossing_bytes(2888, 4, 2) == pytest.approx(1.5 * 2888 * 2, rel=1e-15)
    assert link_bandwidth(100) == 12.5e9


def test_the_link_schedule_step_by_step():
    """H 4, P 2 over 12 steps: fragment 0 after steps 4, 8, 12, fragment 1 after 6, 10;
    DP (H 1, one fragment) every step; DiLoCo H 4 (one fragment) every 4th step, the
    whole model; and over any whole number of periods each strategy sends 1/H of DP."""
    b0, b1 = 1704 * 2, 1184 * 2
    assert link_schedule([1704, 1184], 4, 12, 2, 2) == [0, 0, 0, b0, 0, b1, 0, b0, 0, b1, 0,
                                                         b0]
    assert link_schedule([2888], 1, 5, 2, 2) == [2888 * 2] * 5
    assert link_schedule([2888], 4, 8, 2, 2) == [0, 0, 0, 5776, 0, 0, 0, 5776]
    streaming = link_schedule(fragment_params(transformer(TINY, 8), 4), 16, 16 * 10, 2, 2)
    steady = streaming[16 * 2:]                    # every fragment has started: 8 periods
    assert sum(steady) == pytest.approx(8 * 5776, rel=1e-15)
    assert max(steady) == (BLOCK + OUTSIDE) * 2 and sum(1 for b in steady if b) == 8 * 4
    with pytest.raises(ValueError, match="--fragments 3 does not divide --inner-steps 4"):
        link_schedule([1, 1, 1], 4, 8, 2, 2)


def test_tiny_prices_by_hand():
    """dp 4 (two replicas a site) x tp 1 x pp 1, 100 Gb/s between the sites: DP's link
    seconds are the model's 2888 bf16 numbers once each way, every step; its in-site part
    the gradient Allreduce over the 2 replicas of a site (one bucket, inside a node: alpha
    + 2 (2-1)/2 x 2888 x 2 bytes at NVLink); DiLoCo divides both by H on average, and its
    worst step carries the largest fragment; +8 bytes a parameter per GPU."""
    w = transformer(TINY, 8)
    e = evaluate(w, H100, Plan(dp=4, microbatches=1))
    one_site = e.timing.step_comm["dp"]
    assert one_site == pytest.approx(2 * H100.latency + 1.5 * 2888 * 2 / H100.intra_bw,
                                     rel=1e-12)
    dp, h4, h4p2 = site_prices(w, H100, [e], 2, 100.0, [(4, 1), (4, 2)])
    link = 2888 * 2 / 12.5e9
    inside = H100.latency + 2888 * 2 / H100.intra_bw
    rest = e.timing.total - one_site
    assert (dp.average_bytes, dp.worst_bytes) == (5776, 5776)
    assert dp.link_average == pytest.approx(link, rel=1e-12) == dp.link_worst
    assert dp.in_site == pytest.approx(inside, rel=1e-12)
    assert dp.step_average == pytest.approx(rest + inside + link, rel=1e-12)
    assert h4.average_bytes == 5776 / 4 and h4.worst_bytes == 5776
    assert h4.link_average == pytest.approx(link / 4, rel=1e-12)
    assert h4.link_worst == pytest.approx(link, rel=1e-12)
    assert h4.in_site == pytest.approx(inside / 4, rel=1e-12)
    assert h4.step_worst == pytest.approx(rest + inside + link, rel=1e-12)
    assert h4p2.worst_bytes == 1704 * 2 and h4p2.average_bytes == 5776 / 4
    assert h4p2.link_worst == pytest.approx(1704 * 2 / 12.5e9, rel=1e-12)
    assert h4p2.in_site_worst == pytest.approx(inside * 1704 / 2888, rel=1e-12)
    assert h4.extra_memory == OUTER_STATE_BYTES * 2888 and dp.extra_memory == 0


def test_one_replica_a_site_has_nothing_to_sum_inside():
    w = transformer(TINY, 8)
    e = evaluate(w, H100, Plan(dp=2, microbatches=1))
    dp, h16 = site_prices(w, H100, [e], 2, 100.0, [(16, 1)])
    assert dp.in_site == 0 == h16.in_site
    assert dp.step_average == pytest.approx(e.timing.total - e.timing.step_comm["dp"]
                                            + 5776 / 12.5e9, rel=1e-12)


LLAMA = ["plan", "--preset", "llama3-70b", "--cluster", "h100", "--global-batch", "1024",
         "--dp", "16", "--tp", "8", "--pp", "4", "--sites", "2"]


def test_llama3_70b_over_two_sites(capsys, tmp_path):
    """Llama 3 70B, dp 16 (8 a site) x tp 8 x pp 4, 100 Gb/s: DP puts the 70.6 B bf16
    numbers on the link every step (141 GB, 11.3 s); DiLoCo H = 16 one sixteenth on
    average, the whole on its worst step; P = 4 (the default for 80 layers) a quarter of
    the blocks plus the embedding and head on its worst."""
    assert main([*LLAMA, "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    w = transformer(MODELS["llama3-70b"], 1024)
    whole = 2 * w.params
    rows = {line.split("|")[0].strip(): line.split("|")[1].split()
            for line in out.splitlines() if line.strip().startswith(("DP |", "DiLoCo H="))}
    assert list(rows) == ["DP", "DiLoCo H=4", "DiLoCo H=4 P=4", "DiLoCo H=16",
                          "DiLoCo H=16 P=4", "DiLoCo H=64", "DiLoCo H=64 P=4"]
    assert float(rows["DP"][0]) == pytest.approx(whole / 1e9, abs=0.01)
    assert float(rows["DP"][1]) == pytest.approx(whole / 12.5e9, abs=1e-3)
    assert float(rows["DiLoCo H=16"][1]) == pytest.approx(whole / 16 / 12.5e9, abs=1e-3)
    assert float(rows["DiLoCo H=16"][2]) == pytest.approx(whole / 12.5e9, abs=1e-3)
    block = sum(s for s, _ in w.blocks[0].arrays)
    largest = 20 * block + (w.params - 80 * block)
    assert float(rows["DiLoCo H=16 P=4"][2]) == pytest.approx(2 * largest / 12.5e9, abs=1e-3)
    assert "DiLoCo keeps the outer theta" in out and "(fits)" in out
    sites = json.loads((tmp_path / "p.json").read_text())["sites"]
    assert [s["strategy"] for s in sites] == list(rows)
    assert sites[0]["link_s_average"] == pytest.approx(whole / 12.5e9, rel=1e-12)


def test_the_default_fragments_divide_the_layers(capsys):
    """Llama 3 405B has 126 layers: 4 does not divide them, 2 does."""
    assert main(["plan", "--preset", "llama3-405b", "--cluster", "h100", "--global-batch",
                 "2048", "--dp", "64", "--tp", "8", "--pp", "16", "--sites", "2",
                 "--inner-steps", "8", "--slow-link-gbps", "400"]) == 0
    out = capsys.readouterr().out
    assert "DiLoCo H=8 P=2 |" in out and "P=4" not in out
    assert "one link of 400 Gb/s (50 GB/s)" in out


@pytest.mark.parametrize("flags, named", [
    (["--sites", "1"], "--sites: must be more than 1"),
    (["--sites", "3"], "--sites 3 does not divide --dp 16"),
    (["--sites", "2", "--slow-link-gbps", "0"], "--slow-link-gbps: must be more than 0"),
    (["--sites", "2", "--slow-link-gbps", "nan"], "--slow-link-gbps: must be more than 0"),
    (["--sites", "2", "--inner-steps", "0"], "--inner-steps: must be more than 0"),
    (["--sites", "2", "--fragments", "3"], "--fragments 3 does not divide the 80 layers"),
    (["--sites", "2", "--fragments", "8", "--inner-steps", "4"],
     "--fragments 8 does not divide --inner-steps 4"),
    (["--sites", "2", "--zero", "1"], "--zero 0 only"),
    (["--sites", "2", "--optimizer", "muon"], "no --optimizer muon"),
    (["--inner-steps", "4"], "--inner-steps prices DiLoCo across sites: add --sites"),
    (["--slow-link-gbps", "10"], "--slow-link-gbps prices DiLoCo across sites: add --sites"),
])
def test_site_refusals_are_one_line(flags, named, capsys):
    assert main(["plan", "--preset", "llama3-70b", "--cluster", "h100", "--global-batch",
                 "1024", "--dp", "16", "--tp", "8", "--pp", "4", *flags]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and captured.out == "", err


@pytest.mark.parametrize("argv, named", [
    (["--preset", "llama3-70b", "--gpus", "512", "--global-batch", "1024", "--sites", "2"],
     "--sites prices one named plan"),
    (["--preset", "mixtral-8x7b", "--global-batch", "64", "--dp", "4", "--tp", "8", "--pp",
      "1", "--sites", "2"], "--sites prices dense models only"),
    (["--serve", "--preset", "llama3-70b", "--gpus", "8", "--prompt-len", "8",
      "--new-tokens", "8", "--sites", "2"], "--sites is training's"),
])
def test_sites_needs_a_named_dense_training_plan(argv, named, capsys):
    assert main(["plan", "--cluster", "h100", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
