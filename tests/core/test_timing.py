"""The verdict rule (minipar/core/timing.py): "faster" / "fastest" only outside the spread.

A candidate is faster than another only when its slowest repeat beats the other's
fastest; overlapping spreads are "within the spread", whatever the medians say. And a
timing line names the ranks and cores it ran on, "oversubscribed" with more ranks.
"""

from __future__ import annotations

import pytest

from minipar.core import timing


def test_fastest_only_when_the_spreads_do_not_overlap():
    assert timing.verdict({"a": [1.0, 1.1, 1.05], "b": [1.2, 1.3]}) == "fastest: a"
    # medians 1.0 vs 1.001: a 0.1% difference inside the spread is no verdict
    assert timing.verdict({"a": [0.9, 1.0, 1.2], "b": [0.95, 1.001, 1.1]}) == \
        "within the spread: no fastest"
    # the best median must beat every other candidate, not only the slowest one
    assert timing.verdict({"a": [1.0, 1.1], "b": [1.05, 1.2], "c": [5.0, 6.0]}).startswith(
        "within the spread")
    assert timing.verdict({"a": [1.0, 1.1], "b": [1.5, 1.6], "c": [5.0, 6.0]}) == "fastest: a"


def test_change_is_faster_or_slower_only_outside_the_spread():
    assert timing.change([1.0, 1.1], [1.3, 1.4]).endswith(": slower")
    assert timing.change([1.0, 1.1], [0.5, 0.6]).endswith(": faster")
    text = timing.change([1.0, 1.2], [0.63, 1.1])  # a -37% median inside the spread
    assert text.endswith(": within the spread"), text
    assert text.startswith("-") and "%.." in text
    assert timing.change([1.0, 1.0], [1.5, 1.5]) == "+50% time (+50%..+50%): slower"


def test_spread_text_and_where():
    spread = timing.Spread.of([0.012, 0.010, 0.020])
    assert (spread.median, spread.low, spread.high, spread.repeats) == (0.012, 0.010, 0.020, 3)
    assert spread.text() == "12.00 ms (10.00..20.00 over 3 repeats)"
    assert timing.where(8, 2) == "(8 ranks on 2 cores: oversubscribed)"
    assert timing.where(2, 2) == "(2 ranks on 2 cores)"
    assert timing.where(1, 4) == "(1 rank on 4 cores)"


def test_timed_interleaves_every_candidate_and_maps_its_clock():
    calls: list[str] = []
    samples = timing.timed({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                           repeats=3, clock=lambda t: -1.0)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # who goes first rotates
    assert samples == {"a": [-1.0] * 3, "b": [-1.0] * 3}
    with pytest.raises(ValueError):
        timing.Spread.of([])
