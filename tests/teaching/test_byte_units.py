"""One byte unit family (minipar/core/byte_units.py): KiB, MiB, GiB, 1024 apart, everywhere.

The formatter's arithmetic, and a grep: no lesson, notebook or figure module prints
"KB", "kB" or "MB" (decimal or ambiguous units). Decimal "GB" stays only where a paper
or a hardware sheet states it (the ZeRO paper's 120 GB, an H100's 80 GB).
"""

from __future__ import annotations

import re

import pytest

from minipar.core.byte_units import GiB, KiB, MiB, byte_unit, format_bytes
from tests.harness.mpi import ROOT

AMBIGUOUS = re.compile(r"\b(KB|kB|MB|Kb|mb)\b")


def test_format_bytes_is_binary():
    assert (KiB, MiB, GiB) == (1024, 1024 ** 2, 1024 ** 3)
    assert format_bytes(5000) == "4.9 KiB"
    assert format_bytes(1023) == "1023.0 bytes"
    assert format_bytes(3 * MiB + 512 * KiB) == "3.5 MiB"
    assert format_bytes(2 * GiB, digits=0) == "2 GiB"
    assert format_bytes(2048, 0, "KiB") == "2 KiB"
    assert byte_unit(MiB) == (float(MiB), "MiB")


@pytest.mark.parametrize("path", sorted((ROOT / "lessons").glob("*.py"))
                         + sorted((ROOT / "lessons").glob("*.ipynb"))
                         + [ROOT / "minipar" / "teaching" / name for name in (
                             "plots.py", "load_plots.py", "tour.py", "classroom.py")],
                         ids=lambda path: path.name)
def test_no_lesson_or_figure_prints_decimal_or_ambiguous_bytes(path):
    hits = [f"{path.name}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1) if AMBIGUOUS.search(line)]
    assert not hits, "\n".join(hits)
