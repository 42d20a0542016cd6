"""Side-by-side timing: interleaved repetitions, median and range.

Two things compared in one run, each repetition alternating between them (and
rotating which goes first), so a slow moment of the machine hits both and
neither always runs in the caches the other left; a figure is the ratio of
the medians.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np


def interleaved(candidates: dict[str, Callable[[], object]], repeats: int = 20,
                warmup: int = 3) -> dict[str, dict[str, float]]:
    """Time each candidate `repeats` times, alternating; seconds: median, min, max."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for rep in range(repeats):
        # rotate who goes first: what one leaves in the caches never favours the other
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: spread(s) for name, s in samples.items()}


def spread(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """The median of `values` and their range: how every figure of the bench is kept."""
    return {"median": float(np.median(values)), "min": float(np.min(values)),
            "max": float(np.max(values))}


def ratio(times: dict[str, dict[str, float]], numerator: str, denominator: str) -> float:
    """median(numerator) / median(denominator)."""
    return times[numerator]["median"] / times[denominator]["median"]


def against(base: str, candidates: dict[str, Callable[[], object]], repeats: int = 20
            ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Each candidate timed against `base` in a pair of its own, never three at a time:
    in a rotation of three, one of them would follow the same third one two times in
    three and run in the caches (and the allocator's state) it left. Returns the times
    (the base's from its first pair) and every ratio name/base."""
    times: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    for name, fn in candidates.items():
        if name == base:
            continue
        pair = interleaved({name: fn, base: candidates[base]}, repeats=repeats)
        times.setdefault(base, pair[base])
        times[name] = pair[name]
        ratios[f"{name}/{base}"] = ratio(pair, name, base)
    return times, ratios
