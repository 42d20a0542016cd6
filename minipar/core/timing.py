"""When a timing may say "faster": repeats, their spread, and the cores they ran on.

What this file teaches: one timing is not a result. The same step timed again on a
shared machine comes out different, so a lesson times every candidate several
times, interleaved (`timed`: a busy moment hits them all alike), keeps the
median and the spread -- the range from the fastest repeat to the slowest -- and
calls one candidate faster than another only when the two spreads do not
overlap: its slowest repeat beats the other's fastest (`verdict`, `change`).
Otherwise the difference is "within the spread": this machine cannot tell them
apart. And a wall clock measures the work only with a core per rank: with more
ranks than cores (`where`), it measures the ranks taking turns, and the line says
so ("8 ranks on 2 cores: oversubscribed").

    >>> verdict({"a": [1.0, 1.1], "b": [2.0, 2.2]})
    'fastest: a'
    >>> verdict({"a": [1.0, 2.1], "b": [2.0, 2.2]})
    'within the spread: no fastest'
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from minipar.core.threads import cores

WITHIN = "within the spread"


@dataclass(frozen=True)
class Spread:
    """Repeats of one timing: their median, fastest and slowest, and how many."""

    median: float
    low: float
    high: float
    repeats: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """The spread of `samples` (at least one)."""
        values = np.asarray(samples, dtype=float)
        if not values.size:
            raise ValueError("a spread needs at least one repeat")
        return cls(float(np.median(values)), float(values.min()), float(values.max()),
                   int(values.size))

    def text(self, scale: float = 1e3, unit: str = "ms", digits: int = 2) -> str:
        """`12.30 ms (11.90..14.00 over 7 repeats)`: the median and its spread, `scale`
        times the samples' unit (seconds -> ms by default)."""
        f = f"{{:.{digits}f}}"
        return (f"{f.format(self.median * scale)} {unit} ({f.format(self.low * scale)}.."
                f"{f.format(self.high * scale)} over {self.repeats} repeats)")


def faster(a: Sequence[float], b: Sequence[float]) -> bool:
    """Is `a` faster than `b` beyond the spread: a's slowest repeat below b's fastest?"""
    return max(a) < min(b)


def verdict(times: dict[str, Sequence[float]]) -> str:
    """`fastest: NAME` when NAME (the lowest median) has its slowest repeat below every
    other candidate's fastest, else `within the spread: no fastest`."""
    best = min(times, key=lambda name: float(np.median(times[name])))
    if all(faster(times[best], times[other]) for other in times if other != best):
        return f"fastest: {best}"
    return f"{WITHIN}: no fastest"


def change(base: Sequence[float], other: Sequence[float]) -> str:
    """`other` against `base`: `+31% time (+12%..+48%): slower` -- the change of the
    medians, its range from the most favourable pair of repeats to the least, and a
    verdict that is `faster` / `slower` only when the spreads do not overlap."""
    b, o = Spread.of(base), Spread.of(other)
    word = "faster" if faster(other, base) else "slower" if faster(base, other) else WITHIN
    return (f"{o.median / b.median - 1:+.0%} time ({o.low / b.high - 1:+.0%}.."
            f"{o.high / b.low - 1:+.0%}): {word}")


def where(ranks: int, available: int | None = None) -> str:
    """`(4 ranks on 2 cores: oversubscribed)`, or `(2 ranks on 2 cores)`: what a wall
    clock of `ranks` processes measured on this machine's cores (`threads.cores`)."""
    available = cores() if available is None else available
    text = f"{ranks} rank{'s' * (ranks != 1)} on {available} core{'s' * (available != 1)}"
    return f"({text}: oversubscribed)" if ranks > available else f"({text})"


def timed(candidates: dict[str, Callable[[], object]], repeats: int,
          clock: Callable[[float], float] = float) -> dict[str, list[float]]:
    """Seconds of each candidate, `repeats` times, interleaved and rotating who goes
    first (a slow moment of the machine hits every candidate alike). `clock` maps each
    duration before it is kept: e.g. the slowest rank's, through an Allreduce(MAX) --
    which every rank must then call, the same number of times."""
    names = list(candidates)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(clock(time.perf_counter() - start))
    return samples
