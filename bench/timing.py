"""Side-by-side timing: interleaved repetitions, median and range.

Two things compared in one run, each repetition alternating between them, so a
slow moment of the machine hits both; a figure is the ratio of the medians.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def interleaved(candidates: dict[str, Callable[[], object]], repeats: int = 20,
                warmup: int = 3) -> dict[str, dict[str, float]]:
    """Time each candidate `repeats` times, alternating; seconds: median, min, max."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: {"median": float(np.median(s)), "min": float(np.min(s)),
                   "max": float(np.max(s))} for name, s in samples.items()}


def ratio(times: dict[str, dict[str, float]], numerator: str, denominator: str) -> float:
    """median(numerator) / median(denominator)."""
    return times[numerator]["median"] / times[denominator]["median"]
