"""The words of a pipeline schedule: the instructions a stage's program is made of.

What this file teaches: the vocabulary shared by the schedules
(parallel/pipeline/schedules.py: GPipe, 1F1B, interleaved, ZB-H1; parallel/pipeline/v_schedules.py:
the V-shaped
ZB-V, DualPipeV and the two-way DualPipe), the simulator that plays them and the
executor that runs them (parallel/pipeline/executor.py). A stage's program is a list of
`Instruction`s: compute (F forward, B input gradient, W weight gradient, F&B an
overlapped step) and messages (receive / send an activation or a gradient), each
about one microbatch of one model chunk.

Run the checks: `python -m pytest tests/parallel/test_pipeline_schedules.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
OVERLAPPED = "F&B"  # DualPipe's step: the forward of one microbatch, the backward of another
RECV_ACT, SEND_ACT = "recv_act", "send_act"
RECV_GRAD, SEND_GRAD = "recv_grad", "send_grad"
COMPUTE = (FORWARD, BACKWARD, WEIGHT, OVERLAPPED)


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's program: `kind` on microbatch `microbatch` of model chunk
    `chunk` (always 0 unless the schedule has several chunks per rank).

    An `F&B` step carries two: the forward of (`chunk`, `microbatch`) and the full
    backward (B, then its W) of (`back_chunk`, `back_microbatch`)."""

    kind: str
    microbatch: int
    chunk: int = 0
    back_microbatch: int = -1
    back_chunk: int = -1

    def __str__(self) -> str:
        if self.kind == OVERLAPPED:
            return (f"F{self.microbatch + 1}/{self.chunk}"
                    f"&B{self.back_microbatch + 1}/{self.back_chunk}")
        suffix = f"/{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch + 1}{suffix}"

    def parts(self) -> list[Instruction]:
        """The plain F, B, W this step stands for, in the order they run: an F&B step
        is its F, then its B and W; any other instruction is itself."""
        if self.kind != OVERLAPPED:
            return [self]
        back = (self.back_microbatch, self.back_chunk)
        return [Instruction(FORWARD, self.microbatch, self.chunk),
                Instruction(BACKWARD, *back), Instruction(WEIGHT, *back)]
