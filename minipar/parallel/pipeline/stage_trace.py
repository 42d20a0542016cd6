"""What is recorded around a pipeline stage's instructions. Under `--trace` (comm/trace.py):
a span per F, B, W and F&B, and the activation bytes each leaves held (a forward keeps
its tape, the backward frees it; its W does when the backward is split); the worker
(executor.py) knows nothing of it: `spanned` hands it handlers that record. And every
rank's timeline of instructions, gathered on rank 0 (`gather_timeline`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from minipar.comm import trace
from minipar.parallel.pipeline.instructions import (
    BACKWARD,
    FORWARD,
    OVERLAPPED,
    WEIGHT,
    Instruction,
)

if TYPE_CHECKING:
    from minipar.comm.collectives import Group



class StageWorker(Protocol):
    """What the spans read of a stage worker (executor.py's `StageWorker`)."""

    handlers: dict[str, Callable[[Instruction], None]]   # instruction kind -> its method
    outputs: dict[tuple[int, int], tuple]                # (chunk, microbatch) -> output


# the --trace spans of the compute instructions (B is "backward (B)" when split)
SPAN_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "backward (W)",
              OVERLAPPED: "F&B"}


def spanned(worker: StageWorker) -> dict[str, Callable[[Instruction], None]]:
    """The worker's handlers, each compute instruction's inside its span."""
    return {kind: (lambda ins, run=run: traced(worker, ins, run)) if kind in SPAN_NAMES
            else run for kind, run in worker.handlers.items()}


def traced(worker: StageWorker, ins: Instruction, run: Callable[[Instruction], None]) -> None:
    """`run(ins)`, a compute instruction, inside its --trace span, and the activation
    bytes it leaves held."""
    split = getattr(worker, "split_backward", False)
    name = "backward (B)" if ins.kind == BACKWARD and split else SPAN_NAMES[ins.kind]
    with trace.span(name, microbatch=ins.microbatch, chunk=ins.chunk, kind=ins.kind):
        run(ins)
    forward, backward, weight = ins.parts() if ins.kind == OVERLAPPED else (
        ins if ins.kind == FORWARD else None, ins if ins.kind == BACKWARD else None,
        ins if ins.kind == WEIGHT else None)
    if forward is not None:
        trace.hold((forward.chunk, forward.microbatch),
                   worker.outputs[(forward.chunk, forward.microbatch)][0])
    done = weight if weight is not None else None if split else backward
    if done is not None:
        trace.release((done.chunk, done.microbatch))


def gather_timeline(world: Group, timeline: list[dict]) -> list[dict] | None:
    """Every rank's timeline on world rank 0 (None elsewhere), times in seconds from the
    earliest start on any rank. A collective over `world` (a `comm.Group`)."""
    everything = world.gather(timeline)  # small Python lists of records -> rank 0
    if everything is None:
        return None
    records = [dict(record) for rank in everything for record in rank]
    origin = min((r["start"] for r in records), default=0.0)
    for r in records:
        r["start"] -= origin
        r["end"] -= origin
    return records
