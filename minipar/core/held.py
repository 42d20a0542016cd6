"""What an array handed to an optimizer holds: boxes of canonical parameters.

What this file teaches: the one door between a strategy and its optimizer
(docs/design.md, "Muon"). A strategy updates arrays: whole parameters, TP shards of
them, or ZeRO's flat slices that cut through several. An elementwise rule (SGD,
Adam) needs nothing more; a matrix rule (Muon) must know which parameter, and which
part of it, every element is. `Held` says it, for every box of every array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from minipar.core.shards import in_full_array

if TYPE_CHECKING:
    from minipar.core.nn import Parameter


class Held(NamedTuple):
    """One box of one canonical parameter inside an array handed to `step`.

    `name`: the parameter's canonical name; `box`: where these elements sit in its full
    array (one slice per axis, explicit start and stop); `shard`: the box of the local
    array they belong to (a TP shard: its columns or rows; the whole array when not
    sharded); `where`: where they sit in the handed array, flattened in C order. A plain
    parameter is one `Held` covering it; ZeRO's flat slice is one per box of each
    parameter it cuts (zero.py, `shard_pieces`)."""

    name: str
    box: tuple[slice, ...]
    shard: tuple[slice, ...]
    where: slice


def held_whole(params: Sequence[Parameter]) -> list[list[Held]]:
    """What a strategy that keeps each parameter whole on this rank hands the optimizer:
    one `Held` per parameter, its local array (the full one, or its TP shard)."""
    out = []
    for p in params:
        local = tuple(slice(0, n) for n in p.data.shape)
        shard = in_full_array(local, p.full_index)
        out.append([Held(p.name, shard, shard, slice(0, p.data.size))])
    return out
