"""The 16-bit cast helpers are exact where the emulation relies on it (core/precision.py):
checked on every one of the 65536 16-bit words, in a few milliseconds."""

import numpy as np
import pytest

from minipar.core import precision


def every_word(name: str) -> np.ndarray:
    """All 65536 values of the 16-bit format `name`, NaNs and infinities included."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(precision.low_dtype(name))


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_count_nonfinite_reads_the_words_as_isfinite_reads_the_values(name):
    words = every_word(name)
    with np.errstate(invalid="ignore"):
        expected = int(np.count_nonzero(~np.isfinite(words.astype(np.float32))))
    assert expected == {"bf16": 256, "fp16": 2048}[name]   # exponent all ones, either sign
    assert precision.count_nonfinite(words) == expected
    assert precision.count_nonfinite(words[::-3].reshape(-1, 1)) == int(np.count_nonzero(
        ~np.isfinite(words[::-3].astype(np.float32))))   # strided too


def test_count_nonfinite_of_a_wide_array():
    assert precision.count_nonfinite(np.array([1.0, np.inf, -np.inf, np.nan, 0.0])) == 3


@pytest.mark.parametrize("wide", [np.float32, np.float64])
def test_widen_gives_the_bits_of_the_shift_for_every_bf16_word(wide):
    words = every_word("bf16")
    shifted = (words.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    got = precision.widen(words, np.dtype(wide))
    assert got.dtype == wide
    if wide == np.float32:
        assert np.array_equal(got.view(np.uint32), shifted.view(np.uint32))
    else:
        finite = np.isfinite(shifted)
        assert np.array_equal(got[finite], shifted[finite].astype(np.float64))
        assert np.array_equal(np.isnan(got), np.isnan(shifted))
        assert np.array_equal(np.isinf(got) & (got > 0), np.isinf(shifted) & (shifted > 0))


def test_a_widened_operand_multiplies_as_the_words_it_was_widened_from():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((7, 3)).astype(np.float32)
    with precision.use("bf16", np.float32):
        words = precision.to_low(a)
        once = precision.widened_once(words, words, precision.upcast(words))
        assert isinstance(once, precision.Widened)
        assert np.array_equal(precision.matmul(once, b), precision.matmul(words, b))
        assert np.array_equal(precision.matmul(b.T, once.T), precision.matmul(b.T, words.T))
        other = object()   # an 8-bit operand (or any other) is handed back as it is
        assert precision.widened_once(other, words, precision.upcast(words)) is other
