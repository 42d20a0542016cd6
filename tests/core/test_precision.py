"""The 16-bit dtypes, their unit roundoff, the casts and the loss scaler (core/precision.py)."""

import ml_dtypes
import numpy as np
import pytest

from minipar.core import fused_layers, precision
from minipar.core.autograd import Tensor


def test_low_dtypes_and_unit_roundoff():
    assert precision.low_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    assert precision.low_dtype("fp16") == np.dtype(np.float16)
    for name in ("bf16", "fp16"):
        u = precision.unit_roundoff(name)
        low = precision.low_dtype(name)
        # 1 + u is the midpoint between 1 and the next number: ties go to even (1)
        assert np.asarray(1.0 + u).astype(low).astype(np.float64) == 1.0
        assert np.asarray(1.0 + 1.5 * u).astype(low).astype(np.float64) == 1.0 + 2 * u
        assert precision.name_of(low) == name
    assert precision.unit_roundoff("bf16") == 2.0 ** -8
    assert precision.unit_roundoff("fp16") == 2.0 ** -11
    assert precision.name_of(np.dtype(np.float32)) is None


def test_rounding_error_within_unit_roundoff():
    x = np.random.default_rng(0).standard_normal(10000)
    for name in ("bf16", "fp16"):
        rounded = precision.to_low(x, precision.low_dtype(name)).astype(np.float64)
        rel = np.abs(rounded - x) / np.abs(x)
        assert rel.max() <= precision.unit_roundoff(name)
        assert rel.max() > precision.unit_roundoff(name) / 2  # and u is not loose


def test_helpers_are_identity_without_policy():
    a = np.arange(6.0).reshape(2, 3)
    assert precision.LOW is None
    assert precision.round_low(a) is a and precision.upcast(a) is a
    assert np.array_equal(precision.matmul(a, a.T), a @ a.T)
    assert precision.grad_dtype(np.dtype(np.float32)) == np.float32


def test_policy_matmul_rounds_operands_and_accumulates_in_master():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 8)), rng.standard_normal((8, 3))
    with precision.use("bf16", "float64"):
        out = precision.matmul(a, b)
        assert out.dtype == np.float64
        low = precision.low_dtype("bf16")
        expect = a.astype(low).astype(np.float64) @ b.astype(low).astype(np.float64)
        assert np.array_equal(out, expect)
        assert precision.round_low(out).dtype == low
        assert precision.grad_dtype(low) == np.float64
    assert precision.LOW is None


def test_loss_scaler_halves_on_overflow_and_grows_after_window():
    s = precision.LossScaler(scale=8.0, window=3)
    assert s.update(True) is True and s.scale == 4.0 and s.skipped == 1
    assert [s.update(False) for _ in range(3)] == [False] * 3 and s.scale == 8.0
    assert s.update(False) is False and s.scale == 8.0   # the count restarted
    s.update(False)
    assert s.update(True) and s.scale == 4.0 and s.skipped == 2
    restored = precision.LossScaler(1.0)
    restored.load(s.state())
    assert restored.state() == s.state()


def test_bf16_has_no_scaling_and_bad_scales_refused():
    s = precision.make_scaler("bf16")
    assert s.scale == 1.0 and s.update(True) is False and s.scale == 1.0
    assert precision.make_scaler("fp16").scale == 65536.0
    for bad in (0.0, -4.0, 3.0, float("inf")):
        with pytest.raises(ValueError):
            precision.LossScaler(bad)
    assert precision.is_power_of_two(0.25) and not precision.is_power_of_two(6)


def test_nonfinite_sees_inf_and_nan_in_16_bits():
    low = precision.low_dtype("fp16")
    assert not precision.nonfinite([np.ones(3, dtype=low)])
    with np.errstate(over="ignore"):
        assert precision.nonfinite([np.array([1e5]).astype(low)])   # overflows to inf
    assert precision.nonfinite([np.array([np.nan]).astype(precision.low_dtype("bf16"))])


def test_round_low_node_rounds_forward_and_passes_the_gradient():
    x = Tensor(np.random.default_rng(2).standard_normal((3, 4)), requires_grad=True)
    with precision.use("bf16", "float64"):
        y = fused_layers.round_low(x)
        assert y.data.dtype == precision.low_dtype("bf16")
        assert np.abs(y.data.astype(np.float64) - x.data).max() <= 2.0 ** -8 * np.abs(
            x.data).max()
        y.backward(np.ones((3, 4)))
    assert np.array_equal(x.grad, np.ones((3, 4)))


def test_mixed_linear_rounds_once_and_keeps_main_gradients_in_master():
    from minipar.core.nn import Parameter

    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((5, 4)), rng.standard_normal((4, 3)), rng.standard_normal(3)
    low = precision.low_dtype("fp16")
    with precision.use("fp16", "float32"):
        weight, bias = Parameter(w.astype(low), "w"), Parameter(b.astype(low), "b")
        out = fused_layers.linear(Tensor(x), weight, bias)
        up = [a.astype(low).astype(np.float32) for a in (x, w, b)]
        assert out.data.dtype == low
        assert np.array_equal(out.data, (up[0] @ up[1] + up[2]).astype(low))
        out.backward(np.ones((5, 3)))
        out2 = fused_layers.linear(Tensor(x), weight, bias)   # a second microbatch
        out2.backward(np.ones((5, 3)))
    assert weight.grad.dtype == np.float32 and bias.grad.dtype == np.float32
    once = (up[0].T @ np.ones((5, 3), dtype=np.float32)).astype(low).astype(np.float32)
    assert np.array_equal(weight.grad, 2 * once)


def test_widening_bf16_by_a_shift_is_ml_dtypes_cast():
    """precision.widen: every bfloat16 bit pattern (all 65536, NaNs and infinities
    among them) widens to the float32 and float64 ml_dtypes gives, bit for bit."""
    bf16 = precision.low_dtype("bf16")
    every = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(bf16)
    for dtype in (np.float32, np.float64):
        with np.errstate(invalid="ignore"):   # signaling NaNs among the patterns
            mine, theirs = precision.widen(every, np.dtype(dtype)), every.astype(dtype)
        assert mine.dtype == dtype
        assert np.array_equal(mine.view(np.uint8), theirs.view(np.uint8)), dtype
