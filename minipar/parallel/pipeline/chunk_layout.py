"""Where a pipeline rank's chunks sit, and whom its messages go to.

A schedule's chunks either loop round the ranks (1F1B, interleaved: rank s holds
virtual stages s, s + pp, ...), sit in a V (ZB-V, DualPipeV: stages s and 2pp-1-s), or
lie on two chains running opposite ways (DualPipe: two copies of the model). From the
layout follow which virtual stage a chunk is, which rank holds a virtual stage, and so
whom each send and receive talks to and what it carries. parallel/pipeline/schedules.py builds
the programs on these; parallel/pipeline/simulator.py and the executor
(parallel/pipeline/executor.py)
follow them.
"""

from __future__ import annotations

from collections.abc import Iterator

from minipar.parallel.pipeline.instructions import (
    COMPUTE,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    Instruction,
)

LOOP, V, DUAL = "loop", "v", "dual"  # where a rank's chunks sit: `layout_of`


# ---------------------------------------------------- adding communication
def virtual_stage(pp: int, stage: int, chunk: int, layout: str = LOOP) -> int:
    """Which virtual stage chunk `chunk` of pipeline rank `stage` is: chunk * pp + stage
    when chunks loop round the ranks (interleaved), stage or 2pp-1-stage in a V (ZB-V,
    DualPipeV). DualPipe's two chains are virtual stages 0..pp-1 (chunk 0: stage s on
    rank s) and pp..2pp-1 (chunk 1: stage s on rank pp-1-s), each a whole model."""
    if layout == V:
        return stage if chunk == 0 else 2 * pp - 1 - stage
    if layout == DUAL:
        return chunk * pp + (stage if chunk == 0 else pp - 1 - stage)
    return chunk * pp + stage


def rank_and_chunk(pp: int, v: int, layout: str = LOOP) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage v: the inverse of `virtual_stage`."""
    if layout == V:
        return (v, 0) if v < pp else (2 * pp - 1 - v, 1)
    if layout == DUAL:
        chunk, position = divmod(v, pp)
        return (position if chunk == 0 else pp - 1 - position), chunk
    return v % pp, v // pp


def model_stage(pp: int, v: int, layout: str = LOOP) -> int:
    """Which run of blocks virtual stage v computes: v itself, except in DualPipe, whose
    two chains are two copies of one model of pp stages (v mod pp)."""
    return v % pp if layout == DUAL else v


def first_stage(pp: int, v: int, layout: str = LOOP) -> bool:
    """Whether virtual stage v takes the batch (holds the embedding)."""
    return model_stage(pp, v, layout) == 0


def last_stage(pp: int, v: int, chunks: int, layout: str = LOOP) -> bool:
    """Whether virtual stage v computes the loss (holds the head), with `chunks` per rank."""
    return model_stage(pp, v, layout) == (pp if layout == DUAL else pp * chunks) - 1


def local_boundary(pp: int, stage: int, boundary: int, layout: str = LOOP) -> bool:
    """Whether both sides of boundary b (virtual stages b, b + 1) are on this rank: the
    bottom of the V, where rank pp-1 hands its chunk 0's output to its chunk 1 itself."""
    return layout == V and \
        rank_and_chunk(pp, boundary, V)[0] == rank_and_chunk(pp, boundary + 1, V)[0]


def peer(kind: str, pp: int, stage: int, chunk: int = 0, layout: str = LOOP) -> int:
    """The pipeline rank a message of `kind` about `chunk` goes to or comes from.

    Activations flow to the next virtual stage, gradients to the previous one. When
    chunks loop (interleaved) that is rank stage + 1 or stage - 1 around the ring
    (mod pp): the last rank's chunk c feeds rank 0's chunk c + 1. In a V, chunk 0
    flows down the ranks and chunk 1 back up; in DualPipe chunk 0 flows down, chunk 1 up."""
    downstream = kind in (SEND_ACT, RECV_GRAD)
    if layout != LOOP:
        v = virtual_stage(pp, stage, chunk, layout)
        return rank_and_chunk(pp, v + 1 if downstream else v - 1, layout)[0]
    return (stage + 1) % pp if downstream else (stage - 1) % pp


def message(ins: Instruction, pp: int, stage: int, layout: str = LOOP
            ) -> tuple[str, int, int]:
    """What a send or receive carries: (activation or gradient, the boundary it crosses,
    microbatch). Boundary b lies between virtual stages b and b + 1."""
    v = virtual_stage(pp, stage, ins.chunk, layout)
    boundary = {SEND_ACT: v, RECV_ACT: v - 1, SEND_GRAD: v - 1, RECV_GRAD: v}[ins.kind]
    return ("act" if ins.kind in (SEND_ACT, RECV_ACT) else "grad", boundary, ins.microbatch)


def iter_messages(progs: list[list[Instruction]], layout: str = LOOP
                  ) -> Iterator[tuple[int, int, tuple]]:
    """Every send and receive as (stage, peer, (direction, boundary, microbatch)), each
    stage's in program order: what the pairwise matching test compares."""
    pp = len(progs)
    for s, program in enumerate(progs):
        for ins in program:
            if ins.kind not in COMPUTE:
                yield s, peer(ins.kind, pp, s, ins.chunk, layout), (
                    ins.kind.startswith("send"), message(ins, pp, s, layout))
