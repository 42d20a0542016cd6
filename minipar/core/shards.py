"""Where a shard sits in the full array: a flat run as boxes, a local box as a full one.

What this file teaches: a rank's piece of a parameter is described in the model's
own coordinates. A tensor-parallel shard is a box of the full array (its
`full_index`, e.g. the columns of a column-parallel linear); a ZeRO shard is a run
[a, b) of the flattened parameters, which cuts rows in the middle. `flat_boxes`
turns such a run into rectangular boxes, `in_full_array` moves a box of a local
array into the full one. ZeRO (parallel/zero.py) uses both to say which parts of
the full arrays its slice holds; checkpoints (checkpoint/save_load.py) store pieces that way,
so a file means the same thing whatever mesh wrote it. Pure NumPy, no MPI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from minipar.core.nn import Parameter


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[slice, ...]]:
    """Elements [a, b) of an array of `shape` in C order, as rectangular boxes (one slice
    per axis), in order: a run of a flat vector is a box only when it covers whole rows.

    A run crossing rows is cut into the end of its first row, the whole rows in the
    middle, and the start of its last row (recursively, for the rows' own axes):
    (3, 4) elements [2, 9) -> rows 0 cols 2:4, row 1 all, row 2 col 0:1."""
    if a >= b:
        return []
    if not shape:
        return [()]
    rest = int(np.prod(shape[1:], dtype=np.int64))
    first, last = a // rest, (b - 1) // rest
    if first == last:  # inside one row: that row, and a run of it
        return [(slice(first, first + 1),) + box
                for box in flat_boxes(shape[1:], a - first * rest, b - first * rest)]
    whole = [slice(0, n) for n in shape[1:]]
    head, tail = -(-a // rest), b // rest   # the whole rows are [head, tail)
    boxes = flat_boxes(shape, a, head * rest)
    if head < tail:
        boxes.append((slice(head, tail), *whole))
    return boxes + flat_boxes(shape, tail * rest, b)


def in_full_array(box: tuple[slice, ...], full_index: tuple | None) -> tuple[slice, ...]:
    """A box of a rank's LOCAL array as a box of the full canonical array: shift each axis
    by where the local array starts in the full one (its `full_index`, slices of step 1,
    e.g. the columns a column-parallel linear holds)."""
    if full_index is None:
        return box
    out = []
    for axis, part in enumerate(box):
        held = full_index[axis] if axis < len(full_index) else slice(None)
        if not isinstance(held, slice) or held.step not in (None, 1):
            raise ValueError(f"full_index {full_index} is not made of step-1 slices")
        start = held.start or 0
        out.append(slice(start + part.start, start + part.stop))
    return tuple(out)


def held_parts(params: Sequence[Parameter], full: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each parameter's part of full canonical arrays (name -> array), cut with its
    `full_index` as the parameter itself was cut at build time: a copy per parameter."""
    return [np.array(full[p.name][... if p.full_index is None else p.full_index])
            for p in params]
