"""FP8 quantization (`--fp8`, docs/design.md "FP8") against small hand computations: the
scale from the amax, saturation at the format's max, an all-zero group, and what a
1 x B block does to an outlier that a tensorwise scale spreads over the whole tensor.
One-process runs of the three recipes, the refusals, and config.json's fields."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from minipar.core import fp8
from minipar.run.train import problems, train_reference
from minipar.settings.config import TrainConfig

TINY = dict(layers=2, d_model=32, batch=8, steps=2, mixed="bf16", fp8_block=16)


def test_the_scale_maps_the_amax_onto_the_formats_max_and_saturates():
    x = np.array([[1.0, -2.0, 0.75, 3.0]], dtype=np.float32)
    # tensorwise: s = 3 / 448; 3 -> 448 exactly, 0.75 -> 112 exactly, 1 -> 149.33 -> 144
    # (e4m3 between 128 and 256 steps by 16: 149.33 is nearer 144 than 160)
    q = fp8.fake_quantize(x, "tensorwise", "act", "e4m3", 16)
    s = np.float32(3.0) / np.float32(448.0)
    assert q[0, 3] == np.float32(448.0) * s and q[0, 2] == np.float32(112.0) * s
    assert q[0, 0] == np.float32(144.0) * s
    # a scale too small for the values: clipped to +-448, not NaN (e4m3fn has no inf)
    sat = fp8.quantize(np.array([1000.0, -1e9, 447.0]), np.float32(1.0), "e4m3")
    assert sat.astype(np.float32).tolist() == [448.0, -448.0, 448.0]
    # e5m2 (gradients): max 57344, 2 mantissa bits: 5 -> 5, 9 -> 8 (a tie: to even)
    e5 = fp8.quantize(np.array([5.0, 9.0, 1e6]), np.float32(1.0), "e5m2")
    assert e5.astype(np.float32).tolist() == [5.0, 8.0, 57344.0]


def test_an_all_zero_group_has_scale_one_and_stays_zero():
    x = np.zeros((2, 4), dtype=np.float32)
    x[1] = [0.5, 0.25, 0.0, 1.0]
    amax = fp8.amax(x, "rowwise", "act", 16)
    assert amax.ravel().tolist() == [0.0, 1.0]
    assert fp8.scale_of(amax, "e4m3").ravel().tolist() == [1.0, np.float32(1.0 / 448.0)]
    q = fp8.fake_quantize(x, "rowwise", "act", "e4m3", 16)
    assert np.array_equal(q[0], np.zeros(4)) and np.array_equal(q[1], x[1])  # exact: 2^-k


def test_a_block_keeps_an_outlier_from_spoiling_the_other_tiles():
    # one row of 2 tiles of B = 4: an outlier 100 in tile 0, small values everywhere
    x = np.array([[0.3, 0.3, 0.3, 100.0, 0.3, 0.3, 0.3, 0.3]], dtype=np.float32)
    whole = fp8.fake_quantize(x, "tensorwise", "act", "e4m3", 4)
    tiles = fp8.fake_quantize(x, "blockwise", "act", "e4m3", 4)
    # tensorwise: s = 100/448, 0.3/s = 1.344 -> 1.375 (steps of 1/8): 2.3% off
    s = np.float32(100.0) / np.float32(448.0)
    assert whole[0, 4] == np.float32(1.375) * s
    # the outlier-free tile: s = 0.3/448, every 0.3 lands on 448 exactly
    assert np.allclose(tiles[0, 4:], 0.3, rtol=1e-7, atol=0)
    assert abs(whole[0, 4] / 0.3 - 1) > 0.02 > abs(tiles[0, 4] / 0.3 - 1)
    # weights: a B x B block's own amax (blocks of 2 x 2 of a 4 x 4 weight)
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    blocks = fp8.amax(w, "blockwise", "weight", 2)
    assert blocks.reshape(2, 2).tolist() == [[5.0, 7.0], [13.0, 15.0]]
    assert fp8.amax(w, "rowwise", "weight", 2).ravel().tolist() == [12.0, 13.0, 14.0, 15.0]


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_each_recipe_trains_near_bf16_and_differs_from_it(recipe):
    bf16 = train_reference(TrainConfig(**{**TINY, "fp8_block": 128}).resolved(1))
    run = train_reference(TrainConfig(**TINY, fp8=recipe).resolved(1))
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, bf16.losses))
    assert 0 < rel < 2.0 ** -4, rel   # 8-bit operands: not bf16's numbers, close to them
    assert run.final["blocks.0.fc1.weight"].dtype == np.float64   # masters as --mixed


def test_recompute_runs_the_forward_again_on_the_same_scales_bit_for_bit():
    """--recompute full quantizes each X again in the backward: the same numbers, so the
    same amax and scale, so the same 8-bit operand -- the run is the one without it."""
    gpt = dict(TINY, model="gpt", heads=2, seq_len=8, fp8="tensorwise")
    plain = train_reference(TrainConfig(**gpt).resolved(1))
    again = train_reference(TrainConfig(**gpt, recompute="full").resolved(1))
    assert plain.losses == again.losses
    assert all(np.array_equal(plain.final[k], again.final[k]) for k in plain.final)


@pytest.mark.parametrize("flags, said", [
    (dict(fp8="rowwise", mixed=None), "--fp8 rowwise runs on top of --mixed bf16 (got no "
                                      "--mixed)"),
    (dict(fp8="rowwise", mixed="fp16"), "runs on top of --mixed bf16 (got --mixed fp16)"),
    (dict(fp8="columnwise"), "--fp8 must be one of tensorwise, rowwise, blockwise"),
    (dict(fp8="blockwise", fp8_block=24), "--fp8-block 24 does not divide d_model = 32, "
                                          "d_ff / tp = 128: a block would straddle a shard; "
                                          "the nearest sizes that work: --fp8-block 16 or 32"),
    (dict(fp8="blockwise", fp8_block=32, tp=2, d_ff=96), "--fp8-block 32 does not divide "
                                                          "d_ff / tp = 48: a block would "
                                                          "straddle a shard; the nearest "
                                                          "sizes that work: --fp8-block 16"),
    (dict(fp8_grad="e4m3", fp8_block=128), "--fp8-grad applies to --fp8 only"),
    (dict(fp8="rowwise", fp8_allgather=True), "--fp8-allgather gathers ZeRO-3's weights "
                                              "in 8 bits: it needs --fp8 and --zero 3 "
                                              "(got --zero 0)"),
    (dict(fp8="blockwise", model="moe", experts=4, expert_d_ff=32, tp=2, fp8_block=32),
     "--fp8-block 32 does not divide expert_d_ff / tp = 16: a block would straddle a "
     "shard; the nearest sizes that work: --fp8-block 16"),
])
def test_refusals_are_one_line_before_any_step(flags, said):
    cfg = TrainConfig(**{**TINY, **flags}).resolved(2 if flags.get("tp") else 1)
    found = problems(cfg, 2 if flags.get("tp") else 1)
    assert found and said in found[0], found


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_mlp_moes_experts_split_over_tp_run_every_recipe(recipe):
    cfg = TrainConfig(**{**TINY, "model": "moe", "experts": 4, "expert_d_ff": 32, "tp": 2,
                         "fp8": recipe}).resolved(2)
    assert problems(cfg, 2) == []


@pytest.mark.parametrize("recipe, fixed, per_row", [
    # weights: 1 call, every fc1 and fc2 of 2 blocks x 4 experts (16 amaxes); X of fc2
    # and dY of fc1, per expert and microbatch: 2 x 2 x 4 x 2 = 32 calls of 1 amax
    ("tensorwise", (33, 48, 192), (32, 256)),
    # weights: 1 call, fc2's 16 output columns of 8 experts (128); the 32 activation
    # calls carry one amax a row the expert received: 2 float32 a row
    ("rowwise", (33, 128, 512), (34, 264)),
])
def test_split_experts_tp_line_is_calls_plus_whole_rows(recipe, fixed, per_row):
    """The tp Allreduce line of the MLP MoE with its experts split over tp (dp 2 x tp 2,
    L = 2, d = 16, M = 2): the amaxes above, and the experts' own sums (forward shares
    and backward input gradients: 2 calls a block and microbatch, 8, of 16 float64 a
    row received a pass, 32 numbers and 256 bytes a row). Measured lines fit it with
    one whole number of rows; a missing amax, or sums of another width, do not."""
    from minipar.teaching.ledger_tables import Line, predicted_lines

    cfg = TrainConfig(model="moe", experts=4, expert_d_ff=16, layers=2, d_model=16,
                      batch=16, microbatches=2, mixed="bf16", fp8=recipe, dp=2, tp=2,
                      zero=1).resolved(4)
    line = predicted_lines(cfg)[0][("tp", "Allreduce")]
    calls, elements, size = fixed
    assert (line.calls, line.elements, line.bytes, line.per_row) == (
        calls + 8, elements, size, per_row)
    assert isinstance(line, Line) and line.dtype == "float64+float32"
    rows = 32   # 2 blocks x 2 microbatches x 8 assignments (ep 1: every one mine)
    got = {"calls": line.calls, "elements": elements + rows * per_row[0],
           "bytes": size + rows * per_row[1]}
    assert line.matches(got)
    assert not line.matches(dict(got, calls=got["calls"] - 1))   # a call left out
    assert not line.matches(dict(got, elements=got["elements"] - 1,   # one amax short
                                 bytes=got["bytes"] - 4))
    assert not line.matches(dict(got, bytes=got["bytes"] - rows * 32 * 6))  # sums in bf16


def test_dump_records_the_recipe_and_a_refusal_exits_2(tmp_path):
    cmd = [sys.executable, "-m", "minipar", "train", "--layers", "2", "--d-model", "32",
           "--batch", "8", "--steps", "1", "--mixed", "bf16"]
    done = subprocess.run(cmd + ["--fp8", "blockwise", "--fp8-block", "16", "--fp8-grad",
                                 "e4m3", "--dump", str(tmp_path)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["fp8"], saved["fp8_block"], saved["fp8_grad"]) == ("blockwise", 16, "e4m3")
    refused = subprocess.run(cmd + ["--fp8", "blockwise"], capture_output=True, text=True)
    assert refused.returncode == 2 and "step" not in refused.stdout
    assert len((refused.stdout + refused.stderr).strip().splitlines()) == 1


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_slices_that_cut_blocks_anywhere_agree_on_the_whole_weights_amaxes(recipe):
    """ZeRO-3's case in one process: three ranks' flat slices of a 32 x 32 weight, cut
    at row 10 (through a 16 x 16 block) and one rank holding none of it. Each rank's
    amaxes from its part, then their MAX: exactly the whole weight's (what the
    Allreduce(MAX) over dp gives); the empty rank contributes zeros."""
    from types import SimpleNamespace

    w = np.random.default_rng(0).normal(0, 0.02, (32, 32)).astype(np.float32)
    p = SimpleNamespace(name="blocks.0.fc1.weight", shape=w.shape)
    parts = [[(p, (slice(0, 10), slice(None)), np.abs(w[:10]))],
             [(p, (slice(10, 32), slice(None)), np.abs(w[10:]))], []]
    sent = []
    for pieces in parts:   # what each rank puts into the Allreduce
        fp8.Recipe(recipe, 16).begin_sliced_step(
            [([p], pieces, lambda a: sent.append(a.copy()) or a)])
    assert not sent[2].any()                                  # I hold nothing: zeros
    whole = fp8.amax(w, recipe, "weight", 16)
    assert not np.array_equal(sent[0].reshape(whole.shape), whole) or recipe == "tensorwise"
    agreed = np.maximum.reduce(sent)
    r = fp8.Recipe(recipe, 16)
    r.begin_sliced_step([([p], parts[2], lambda a: agreed)])
    assert np.array_equal(r.weight_amax[p.name], whole)


def test_an_empty_shard_has_amax_zero_and_quantizes_to_nothing():
    empty = np.zeros((0, 32), dtype=np.float32)
    for recipe in fp8.RECIPES:
        assert not fp8.amax(empty, recipe, "act", 16).any()
        assert fp8.fake_quantize(empty, recipe, "act", "e5m2", 16).shape == (0, 32)


def test_wire_words_are_one_byte_a_weight_two_for_the_rest_and_decode_back():
    """--fp8-allgather's words: 3 weight elements as e4m3 bytes with their scales, 2
    others as their bf16 bytes; decoded, the weights are Q(w) (requantized with the same
    scale: the same bytes again) and the others exact."""
    from minipar.core import precision

    bf16 = precision.low_dtype("bf16")
    values = np.array([0.5, -0.3, 0.02, 1.5, -7.0], dtype=np.float32).astype(bf16)
    widths = np.array([1, 1, 1, 2, 2])
    scales = np.array([0.5 / 448, 0.5 / 448, 0.5 / 448, 1, 1], dtype=np.float32)
    data = fp8.encode(values, widths, scales)
    assert data.dtype == np.uint8 and data.size == 3 + 2 * 2
    back = fp8.decode(data, widths, scales, bf16)
    assert back[3] == values[3] and back[4] == values[4]
    assert back[0] == values[0]                               # 0.5 / s = 448: exact
    again = fp8.encode(back, widths, scales)
    assert np.array_equal(again, data)                        # the same bytes again
