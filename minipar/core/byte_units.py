"""Bytes as the lessons print them: one binary family, KiB, MiB, GiB (1024 apart).

What this file teaches: "KB" means 1000 bytes to one reader and 1024 to another,
and a table that mixes kB, KB and MiB cannot be compared by eye. Every lesson and
figure prints bytes through `format_bytes` (or scales them by `byte_unit` for an
axis), so a number is always in KiB = 1024 bytes, MiB = 1024 KiB or GiB = 1024 MiB.
What a hardware sheet or a paper states in decimal units (an H100's "80 GB", the
ZeRO paper's "120 GB") is quoted as the source writes it, and said to be decimal.

    >>> format_bytes(5000)
    '4.9 KiB'
    >>> format_bytes(3 * MiB, digits=0)
    '3 MiB'
"""

from __future__ import annotations

KiB = 1024
MiB = 1024 ** 2
GiB = 1024 ** 3


def byte_unit(top: float) -> tuple[float, str]:
    """The largest binary unit that keeps `top` bytes >= 1: (1024.0, 'KiB') for 5000."""
    for factor, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if top >= factor:
            return float(factor), name
    return 1.0, "bytes"


def format_bytes(n: float, digits: int = 1, unit: str | None = None) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1 (or in `unit`: "KiB",
    "MiB", "GiB", "bytes"), with `digits` decimals: '4.9 KiB' for 5000."""
    factor, name = byte_unit(abs(n)) if unit is None else (
        {"bytes": 1.0, "KiB": KiB, "MiB": MiB, "GiB": GiB}[unit], unit)
    return f"{n / factor:.{digits}f} {name}"
