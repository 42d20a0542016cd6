"""Pipeline schedules as data, and a simulator that plays them in logical time.

(The simulator itself is parallel/pipeline/simulator.py, where the chunks sit and whom the
messages go to parallel/pipeline/chunk_layout.py; their names are importable from here too.)

What this file teaches: a pipeline schedule is nothing but, for each stage, an
ordered list of instructions -- receive an activation, run a forward, send it
on, receive a gradient, run a backward, send it back. Written as data, a
schedule can be printed, simulated and tested without a single MPI process;
the executor (parallel/pipeline/executor.py) then runs the same list with Send/Recv.

The schedules, each from its paper:

- GPipe (Huang et al. 2019): every forward, then every backward. Simple; a
  stage holds the activations of all M microbatches at once.
- 1F1B, PipeDream-flush (Narayanan et al. 2021): warm-up forwards, then one
  forward / one backward in a steady state, then cool-down backwards. Same
  bubble as GPipe, but stage s holds at most pp - s microbatches.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): each rank holds V
  model chunks (virtual stages s, s + pp, ...); the bubble shrinks by V.
- ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward is
  split into B (input gradient: the previous stage waits for it) and W (weight
  gradient: nobody waits for it); putting W off fills the cool-down bubble.
- The V-shaped ones, two chunks per rank (parallel/pipeline/v_schedules.py): ZB-V (Qi et al. 2024),
  zero bubble; DualPipeV (DeepSeek-V3), overlapped F&B steps; and DualPipe, the
  two-way pipeline with two copies of the model. Here they are only dispatched
  (`compute_order`) and placed (`virtual_stage`: a V, or two opposite chains).

Bubble, as measured here: run the instruction lists with F = 1 time unit and
B = 2 for a stage's share of the model (B = W = 1 for the split schedules), one
unit rule for every schedule: a chunk costs its share of a stage (`chunk_share`:
an interleaved chunk holds 1/V of a stage's layers, F = 1/V, B = 2/V; a V's chunk
half a stage, F = B = W = 1/2), communication free (`Costs` weighs F, B, W and the F&B pair
otherwise). With T the time from the start to the moment the last stage
finishes, the bubble fraction is

    bubble = (pp * T - total busy time of all stages) / (pp * T),

the share of stage-time spent idle. It comes out exactly (pp-1)/(M+pp-1) for
GPipe and 1F1B, (pp-1)/(V M+pp-1) for interleaved, and (pp-1)/(3M+pp-1) for
ZB-H1 when M >= pp: its idle time is pp-1 units against 1F1B's 3(pp-1), a third.
Interleaving does the same work in 3M + 3(pp-1)/V units where 1F1B needs
3M + 3(pp-1): the warm-up and cool-down are made of chunks V times smaller.

The simulator also replays a real run (`replay`): each instruction takes the
compute time it was measured to take, and the dependencies of the schedule do
the rest. That is what a pipeline would do on one core per rank, even when the
run was timed with more ranks than cores.

The papers' tables count the bubble per rank instead: the time a rank idles
between its own first and its own last instruction (`Simulation.idle`; with
the optimizer step not synchronized, each rank's next step starts right after
its own last one, so that is what a step costs). The worst rank's: 1F1B
(pp-1)(F+B+W), ZB-H1 (pp-1)(F+B-W), ZB-V 0 (F = B = W, M >= 2pp - 1),
DualPipeV (pp-1)(F&B+B-2W) and DualPipe on PP ranks (PP/2-1)(F&B+B-2W) --
DeepSeek-V3's table writes B for the *full* backward (our B + W) and PP for the
ranks of DualPipe, the unfolded DualPipeV (PP = 2 pp): (PP/2-1)(F&B+B-3W). The
simulator reproduces 1F1B's and ZB-H1's for any durations, ZB-V's, DualPipeV's
and DualPipe's in logical time (F = B = W, F&B = F + B + W; for the V schedules F,
B, W are a chunk's, half a stage's).

Run the checks: `python -m pytest tests/parallel/test_pipeline_schedules.py`.
"""

from __future__ import annotations

# the layout and the simulator live in their own files; callers import them from here too
from minipar.parallel.pipeline.chunk_layout import (
    DUAL,
    LOOP,
    V,
    first_stage,
    last_stage,
    local_boundary,
    virtual_stage,
)
from minipar.parallel.pipeline.instructions import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    WEIGHT,
    Instruction,
)
from minipar.parallel.pipeline.simulator import (
    Costs,
    Simulation,
    simulate,
)
from minipar.parallel.pipeline.v_schedules import dualpipe_order, dualpipev_order, zb_v_order

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev",  # `--schedule`
             "dualpipe")
V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank, placed in a V
TWO_WAY = ("dualpipe",)  # two copies of the model, microbatches fed from both ends
SIMULATED_ONLY = V_SHAPED + TWO_WAY  # no closed-form bubble fraction: the simulator's
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev", "dualpipe")  # B (input grad), W apart
LOGICAL = Costs()  # F = 1, B = W = 1 (B + W = 2 unsplit), F&B = F + B + W


# ----------------------------------------------------------- compute order
def gpipe_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """GPipe: all forwards, then all backwards (in the same microbatch order)."""
    return ([Instruction(FORWARD, m) for m in range(microbatches)]
            + [Instruction(BACKWARD, m) for m in range(microbatches)])


def one_f_one_b_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """1F1B (PipeDream-flush): warm-up, steady state, cool-down.

    Stage s starts with pp - s - 1 forwards: just enough that when the first
    gradient comes back, the pipe behind it is full. From then on every forward
    is followed by the oldest backward, so at most pp - s microbatches are alive.
    """
    # exercise: one-f-one-b
    warmup = min(pp - stage - 1, microbatches)
    steady = microbatches - warmup
    order = [Instruction(FORWARD, m) for m in range(warmup)]          # warm-up
    for i in range(steady):                                           # steady: 1F, 1B
        order += [Instruction(FORWARD, warmup + i), Instruction(BACKWARD, i)]
    order += [Instruction(BACKWARD, m) for m in range(steady, microbatches)]  # cool-down
    return order
    # end exercise


def interleaved_order(pp: int, microbatches: int, stage: int, virtual: int
                      ) -> list[Instruction]:
    """Interleaved 1F1B (Megatron-LM): 1F1B over (chunk, microbatch) pairs.

    Forwards go in groups of pp microbatches: microbatches 1..pp through chunk 0,
    the same pp through chunk 1, ..., then the next pp. Backwards walk the chunks
    in reverse. Needs M divisible by pp (every group full). Warm-up is 1F1B's
    pp - s - 1 plus (V - 1) pp: the first backward needs a microbatch through all V
    chunks. With V = 1 this is exactly 1F1B.
    """
    total = virtual * microbatches

    def unit(k: int, forward: bool) -> Instruction:
        group, within = divmod(k, pp * virtual)
        chunk = within // pp
        microbatch = group * pp + within % pp
        if forward:
            return Instruction(FORWARD, microbatch, chunk)
        return Instruction(BACKWARD, microbatch, virtual - 1 - chunk)

    warmup = min(pp - stage - 1 + (virtual - 1) * pp, total)
    steady = total - warmup
    order = [unit(k, True) for k in range(warmup)]                    # warm-up
    for i in range(steady):                                           # steady: 1F, 1B
        order += [unit(warmup + i, True), unit(i, False)]
    order += [unit(k, False) for k in range(steady, total)]           # cool-down
    return order


def zb_h1_order(pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """ZB-H1: 1F1B with each backward split into B (input gradient) and W (weights).

    Stage s runs W of microbatch i only `stage` microbatches after its B: the
    last stages, whose B's the whole pipe waits for, put their W's off the most,
    and those W's fill the cool-down where 1F1B sits idle. Alive microbatches (F
    done, W not yet) stay at most pp, the memory of 1F1B.
    """
    warmup = min(pp - stage - 1, microbatches)
    steady = microbatches - warmup
    lag = stage  # W of microbatch i runs `lag` microbatches after its B

    def put_off_weight(i: int) -> list[Instruction]:
        return [Instruction(WEIGHT, i - lag)] if i >= lag else []

    order = [Instruction(FORWARD, m) for m in range(warmup)]          # warm-up
    for i in range(steady):                                           # steady: F, B, W
        order += [Instruction(FORWARD, warmup + i), Instruction(BACKWARD, i)]
        order += put_off_weight(i)
    for m in range(steady, microbatches):                             # cool-down: B, W
        order += [Instruction(BACKWARD, m)] + put_off_weight(m)
    order += [Instruction(WEIGHT, m)                                  # the last W's fill
              for m in range(max(microbatches - lag, 0), microbatches)]  # the tail
    return order


def compute_order(schedule: str, pp: int, microbatches: int, stage: int,
                  virtual: int = 1) -> list[Instruction]:
    """The F/B/W order of one stage under `schedule`, without communication."""
    if schedule == "gpipe":
        return gpipe_order(pp, microbatches, stage)
    if schedule == "1f1b":
        return one_f_one_b_order(pp, microbatches, stage)
    if schedule == "interleaved":
        return interleaved_order(pp, microbatches, stage, virtual)
    if schedule == "zb-h1":
        return zb_h1_order(pp, microbatches, stage)
    if schedule == "zb-v":
        return zb_v_order(pp, microbatches, stage)
    if schedule == "dualpipev":
        return dualpipev_order(pp, microbatches, stage)
    if schedule == "dualpipe":
        return dualpipe_order(pp, microbatches, stage)
    raise ValueError(f"unknown schedule {schedule!r} (one of {', '.join(SCHEDULES)})")


def chunks_per_rank(schedule: str, virtual: int = 1) -> int:
    """How many model chunks a pipeline rank holds: 2 for the V schedules and DualPipe,
    V for interleaved, else 1."""
    return 2 if schedule in SIMULATED_ONLY else virtual


def layout_of(schedule: str) -> str:
    """Where a rank's chunks sit: in a V (`V`: ZB-V, DualPipeV), on two chains running
    opposite ways (`DUAL`: DualPipe), or looping round the ranks (`LOOP`: the rest)."""
    return V if schedule in V_SHAPED else DUAL if schedule in TWO_WAY else LOOP


# ---------------------------------------------------- adding communication
def with_communication(order: list[Instruction], pp: int, stage: int, virtual: int = 1,
                       layout: str = LOOP) -> list[Instruction]:
    """Wrap each compute instruction in the messages it needs and produces.

    A forward receives its input from the previous virtual stage (unless it is
    the first) and sends its output to the next (unless it is the last); a
    backward receives the gradient of its output from the next virtual stage and
    sends the gradient of its input back. Receives sit right before the compute
    that needs them, sends right after the compute that produced them. An F&B
    step receives both its inputs first and sends both its outputs after. A
    boundary inside the rank (the bottom of the V) needs no message.
    """
    chunks = 2 if layout != LOOP else virtual

    def before_me(v: int) -> bool:  # a message crosses the boundary into v
        return not first_stage(pp, v, layout) and not local_boundary(pp, stage, v - 1, layout)

    def after_me(v: int) -> bool:   # a message crosses the boundary out of v
        return not last_stage(pp, v, chunks, layout) and not local_boundary(pp, stage, v,
                                                                            layout)

    program: list[Instruction] = []
    for ins in order:
        before, after = [], []
        for part in ins.parts():
            v = virtual_stage(pp, stage, part.chunk, layout)
            at = (part.microbatch, part.chunk)
            if part.kind == FORWARD:
                before += [Instruction(RECV_ACT, *at)] if before_me(v) else []
                after += [Instruction(SEND_ACT, *at)] if after_me(v) else []
            elif part.kind == BACKWARD:
                before += [Instruction(RECV_GRAD, *at)] if after_me(v) else []
                after += [Instruction(SEND_GRAD, *at)] if before_me(v) else []
        program += before + [ins] + after
    return program


def schedule(name: str, pp: int, microbatches: int, stage: int, virtual: int = 1
             ) -> list[Instruction]:
    """The full program of pipeline rank `stage`: compute and communication in order.

    `schedule("1f1b", 4, 8, 3)` is the last stage's list; the executor runs it
    with Send/Recv, the simulator with a logical clock.
    """
    return with_communication(compute_order(name, pp, microbatches, stage, virtual),
                              pp, stage, chunks_per_rank(name, virtual), layout_of(name))


def programs(name: str, pp: int, microbatches: int, virtual: int = 1
             ) -> list[list[Instruction]]:
    """Every stage's program, stage 0 first."""
    return [schedule(name, pp, microbatches, s, virtual) for s in range(pp)]


UNIT_RULE = "stage units: a stage's F = 1, B + W = 2; a chunk costs its share"


def chunk_share(schedule: str, virtual: int = 1) -> float:
    """The share of one stage's layers (a stage: 1/pp of the model) a chunk holds: 1/V
    for interleaved (V pp chunks), 1/2 for the V schedules (2 pp chunks), 1 for DualPipe
    (each of its two model copies cut into pp stages) and the one-chunk schedules."""
    if schedule == "interleaved":
        return 1.0 / virtual
    return 0.5 if schedule in V_SHAPED else 1.0


def costs(schedule: str, virtual: int = 1, weights: Costs = LOGICAL) -> dict[str, float]:
    """Logical durations, in stage units (`UNIT_RULE`), one rule for every schedule: a
    stage's share of the layers costs F = 1, B = 2 (a backward is two matmuls per forward
    one); the split schedules (ZB-H1, ZB-V, DualPipeV, DualPipe) cut the backward into
    B = 1 (input gradient) and W = 1 (weights). A chunk is charged its `chunk_share` of
    each: an interleaved chunk 1/V, a V's chunk 1/2 (F = B = W = 1/2, F&B = 3/2). So
    every schedule does the same work per rank and step, M (F + B + W) = 3M units, in
    pieces of different sizes. `weights` sets other durations for a whole stage."""
    durations = weights.durations(schedule in SPLIT_BACKWARD)
    share = chunk_share(schedule, virtual)
    return {kind: share * d for kind, d in durations.items()}


def simulate_schedule(name: str, pp: int, microbatches: int, virtual: int = 1,
                      synchronous_sends: bool = False, weights: Costs = LOGICAL
                      ) -> Simulation:
    """`simulate` the programs of schedule `name` with its logical costs (or `weights`)."""
    return simulate(programs(name, pp, microbatches, virtual), costs(name, virtual, weights),
                    synchronous_sends, layout_of(name))


def replay(name: str, pp: int, microbatches: int, virtual: int,
           timeline: list[dict]) -> Simulation:
    """Play schedule `name` with each compute instruction taking the time it took in a
    real run (`timeline`: the records of `RunResult.extras["timeline"]`, seconds),
    communication free: the pipeline the measured compute times would make on one
    core per rank. A record's "cpu" (the CPU time of the instruction, which a rank
    waiting for a shared core does not accumulate) is used where present, else its
    wall-clock end - start; with several replicas of a stage (dp > 1) the slowest one's,
    as a step waits for its slowest replica. Times come out in seconds."""
    measured: dict[tuple, float] = {}
    for r in timeline:
        if r["kind"] in COMPUTE:
            key = (r["stage"], r["kind"], r["chunk"], r["microbatch"])
            measured[key] = max(measured.get(key, 0.0), r.get("cpu", r["end"] - r["start"]))
    return simulate(programs(name, pp, microbatches, virtual), measured,
                    layout=layout_of(name))


def bubble_formula(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The papers' bubble fractions, which the simulator reproduces exactly:
    (pp-1)/(M+pp-1) for GPipe and 1F1B, (pp-1)/(V M+pp-1) interleaved, and for ZB-H1
    (pp-1)/(3M+pp-1) -- idle pp-1 units where 1F1B idles 3(pp-1) -- when M >= pp."""
    if schedule in SIMULATED_ONLY:
        raise ValueError(f"{schedule} has no closed-form bubble on this measure: simulate "
                         "it (its per-rank idle time is in Simulation.idle)")
    per_stage_work = {"interleaved": virtual * microbatches, "zb-h1": 3 * microbatches}
    return (pp - 1) / (per_stage_work.get(schedule, microbatches) + pp - 1)
