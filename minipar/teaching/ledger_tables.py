"""Turning the ledger into tables a learner can read.

What this file teaches: a ledger record says how big a buffer an operation was
defined on; what crosses the wire per rank depends on the algorithm. With ring
algorithms an Allreduce of N elements over n ranks sends 2(n-1)/n N from each
rank, an Allgather or Reduce_scatter (n-1)/n N (`memory.wire_elements`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from minipar.comm.mesh import MeshShape
from minipar.core.memory import wire_elements
from minipar.parallel import diloco
from minipar.planner.memory_cost import RankShape, model_states, rank_shape
from minipar.planner.time_cost import Traffic, traffic
from minipar.planner.workloads import minipar_workload, plan_of
from minipar.run.reference import RunResult
from minipar.settings.config import TrainConfig

# Mesh axis -> the flag that sets its size (edp is dp/ep).
_AXIS_SIZE = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "cp": "cp"}
AXES = ["dp", "tp", "pp", "ep", "edp", "cp", "world"]  # the ledger's group names, mesh order


def group_size(cfg: TrainConfig, group: str) -> int:
    """How many ranks a group of this axis has under `cfg`."""
    if group == "edp":  # with context parallelism: every cp coordinate's too
        return cfg.dp // cfg.ep * cfg.cp
    if group == "dp":   # the replicas of a weight: dp x cp ranks (mesh.py)
        return cfg.dp * cfg.cp
    if group == "world":
        return cfg.dp * cfg.cp * cfg.tp * cfg.pp
    return getattr(cfg, _AXIS_SIZE[group])


RECEIVES = ("Recv", "Irecv")  # the sender's record counts the message; the receiver puts none


def group_sizes(shape: MeshShape) -> dict[str, int]:
    """Ranks per group of each mesh axis, by the ledger's group names: dp, cp, tp, pp,
    ep, edp (the dp ranks that hold the same experts, dp/ep) and world. With context
    parallelism the gradient sync runs over the dp x cp replicas, which the ledger
    names `dp` (and `edp`): those groups count their cp ranks too."""
    return {"dp": shape.dp * shape.cp, "cp": shape.cp, "tp": shape.tp, "pp": shape.pp,
            "ep": shape.ep, "edp": shape.dp // shape.ep * shape.cp, "world": shape.world}


def wire_bytes(record: dict, sizes: Mapping[str, int]) -> float:
    """Bytes one ledger record's rank put on the wire, by the ring formulas
    (`memory.wire_elements`: Allreduce 2(N-1)/N of the buffer, Allgather and
    Reduce_scatter (N-1)/N, Alltoall(v) (N-1)/N, Send the message; a receive 0).
    `sizes` maps the record's group to its rank count (`group_sizes`)."""
    if record["op"] in RECEIVES or not record["elements"]:
        return 0.0
    itemsize = record["bytes"] / record["elements"]
    return wire_elements(record["op"], record["elements"], sizes[record["group"]]) * itemsize


def sent_per_axis(records: Sequence[dict], sizes: Mapping[str, int]) -> dict[str, float]:
    """Bytes the busiest rank of each axis put on the wire in the step (`wire_bytes`,
    summed over its operations on that axis), axes in mesh order: dp, tp, pp, ep, edp."""
    per_axis: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        if r["op"] not in RECEIVES:
            per_axis[r["group"]][r["rank"]] += wire_bytes(r, sizes)
    return {axis: max(per_axis[axis].values()) for axis in
            sorted(per_axis, key=lambda a: AXES.index(a) if a in AXES else len(AXES))}


@dataclass(frozen=True)
class Line:
    """One predicted ledger line of a rank: `calls` calls moving `elements` numbers in
    `bytes` bytes, each number a `dtype` ("float64", "bf16", "int64", or two names
    joined by "+" for a line that moves both). `routed`: the elements follow the router
    (an MoE's Alltoallv), so only the calls and the bytes an element are predicted.
    `per_row`: (elements, bytes) each row an expert rank *received* adds (the MLP MoE's
    experts split over tp: their tp sums, and under --fp8 rowwise their row amaxes):
    the line is then `elements` + k per_row[0] and `bytes` + k per_row[1] for one
    whole k, the rows the router sent, and is judged exactly so (`matches`)."""

    calls: int
    elements: int
    bytes: int
    dtype: str
    routed: bool = False
    per_row: tuple[int, int] = (0, 0)

    def matches(self, got: Mapping[str, int]) -> bool:
        """Does a measured line (calls, elements, bytes) fit this prediction? Exactly,
        or a routed line: its calls and bytes an element, or a per-row line: its calls,
        and a whole number k >= 0 of rows adding k per_row to elements and bytes."""
        if self.per_row != (0, 0):
            rows, left = divmod(got["elements"] - self.elements, self.per_row[0])
            return got["calls"] == self.calls and rows >= 0 and not left and \
                got["bytes"] == self.bytes + rows * self.per_row[1]
        if self.routed:
            return got["calls"] == self.calls and \
                got["bytes"] == got["elements"] * self.itemsize
        return (got["calls"], got["elements"], got["bytes"]) == (
            self.calls, self.elements, self.bytes)

    def text(self, table: bool = False) -> str:
        """The prediction as `ledger_differences` prints it (calls, elements, bytes),
        or as `ledger_table`'s last column (`table`: a routed line's bytes an element)."""
        if self.per_row != (0, 0):
            return (f"{self.calls}, {self.elements} + {self.per_row[0]} k, {self.bytes} + "
                    f"{self.per_row[1]} k bytes, k the rows received ({self.dtype})")
        if self.routed:
            return (f"{self.calls}, (router), {self.itemsize:g} B/elem ({self.dtype})" if table
                    else f"{self.calls}, (router), (router) bytes ({self.dtype})")
        return f"{self.calls}, {self.elements}, {self.bytes}{'' if table else ' bytes'} " \
            f"({self.dtype})"

    @property
    def itemsize(self) -> float:
        """Bytes an element (a line of two dtypes: their mean, by the formula's counts)."""
        return self.bytes / self.elements if self.elements else 0.0


# what only moves bytes (no sum): under --mixed a 16-bit activation travels as its
# 16-bit words (docs/design.md, "Mixed precision", "On the wire")
_MOVES = {"Isend", "Recv", "Irecv", "Send", "Sendrecv", "Allgather", "Alltoallv"}


def _dtype_name(itemsize: int, cfg: TrainConfig) -> str:
    """The dtype of `itemsize` bytes in this run: 2 its 16-bit format, the master's
    itemsize its --dtype, 8 otherwise int64 (counts), 4 int32 (the found_inf vote)."""
    if itemsize == 2 and cfg.mixed:
        return cfg.mixed
    if itemsize == np.dtype(cfg.dtype).itemsize:
        return cfg.dtype
    return {8: "int64", 4: "int32"}.get(itemsize, f"{itemsize}-byte")


def _line(t: Traffic, cfg: TrainConfig) -> Line:
    """A planner entry as this run's ledger writes it. The planner prices activations in
    the master dtype; the run's contract (docs/design.md, "Mixed precision") moves
    16-bit words wherever a message only carries an activation or its gradient (the
    pipeline's, context parallelism's, sequence parallelism's Allgathers, the experts'
    Alltoallv), and sums gradients in 16 bits with --grad-reduce-dtype low."""
    itemsize = None
    if cfg.mixed:
        moves = t.group in ("pp", "cp", "tp", "ep") and (
            t.op in _MOVES or (t.group == "cp" and t.op == "Alltoall"))
        if moves and not (t.group == "pp" and t.op == "Sendrecv"):  # DualPipe: gradients
            itemsize = 2
        low_sync = t.group in ("dp", "edp") and (
            t.op == "Reduce_scatter" or (t.op in ("Allreduce", "Iallreduce")
                                         and t.phase == "step"))
        if cfg.grad_reduce_dtype == "low" and low_sync:
            itemsize = 2
    if itemsize is None and t.elements and t.bytes % t.elements == 0:
        itemsize = t.bytes // t.elements
    if itemsize is None:  # counts beside numbers of the master dtype (the MoE statistics)
        return Line(t.calls, t.elements, t.bytes, f"int64+{cfg.dtype}")
    return Line(t.calls, t.elements, t.elements * itemsize, _dtype_name(itemsize, cfg))


def _merged(a: Line | None, b: Line) -> Line:
    """Two predicted contributions to one (group, op) line, added up."""
    if a is None:
        return b
    names = a.dtype.split("+") + [n for n in b.dtype.split("+") if n not in a.dtype.split("+")]
    return Line(a.calls + b.calls, a.elements + b.elements, a.bytes + b.bytes,
                "+".join(names), a.routed or b.routed,
                (a.per_row[0] + b.per_row[0], a.per_row[1] + b.per_row[1]))


def split_experts_shape(cfg: TrainConfig, shape: RankShape) -> RankShape:
    """`shape` with the expert arrays as the MLP MoE's ranks hold them under --tp (the
    planner's MoE keeps every expert whole): fc1's columns, its bias and fc2's rows cut
    over tp, fc2's bias whole (parallel/moe/expert_tp.py `TensorParallelExpert`), so that
    the edp gradient sync, DualPipe's gradient copies and the bytes of parameters
    (`check_ledger`) count what is there. The shared experts, cut the same way, are the
    workload's own (planner/workloads.py `minipar_workload`)."""
    if cfg.model != "moe" or cfg.tp == 1:
        return shape
    from minipar.core.nn import canonical_shapes

    cut = ("fc1.weight", "fc1.bias", "fc2.weight")
    one = [math.prod(size) // (cfg.tp if name.endswith(cut) else 1)
           for name, size in canonical_shapes(cfg.model_config()).items()
           if name.startswith("blocks.0.experts.0.")]    # one expert's arrays, in order
    experts = [size for block in shape.blocks if block.moe
               for size in one * (block.experts // cfg.ep)]
    return replace(shape, edp_arrays=experts)


def split_expert_sums(cfg: TrainConfig, blocks: Sequence[object]) -> Line | None:
    """The tp Allreduces of the MLP MoE's experts split over tp (parallel/moe/expert_tp.py
    `run_local_experts_split`, moe/shared_experts.py `SharedExperts`), in the master dtype:
    per MoE block and microbatch one of the (R, d) shares of the rows R the rank received
    (forward, and again under --recompute full) and one of their input gradients
    (backward); the shared experts the same on the rank's own b rows. R follows the router: a row
    received adds d elements a pass (`Line.per_row`)."""
    if cfg.model != "moe" or cfg.tp == 1:
        return None
    from minipar.teaching import fp8_ledger

    moe = sum(1 for block in blocks if block.moe)
    passes = 3 if cfg.recompute == "full" else 2
    calls = passes * fp8_ledger.block_feeds(cfg) * moe   # DualPipe: each copy half of them
    if not calls:
        return None
    itemsize, d = np.dtype(cfg.dtype).itemsize, cfg.d_model
    shared = calls * cfg.batch // (cfg.microbatches * cfg.dp) * d if cfg.shared_experts else 0
    return Line(calls * (1 + (cfg.shared_experts > 0)), shared, shared * itemsize, cfg.dtype,
                per_row=(passes * d, passes * d * itemsize))


def predicted_lines(cfg: TrainConfig, skipped: bool = False
                    ) -> dict[int, dict[tuple[str, str], Line]]:
    """Every rank's ledger as the formulas predict it, bytes and dtype included: rank ->
    (group, op) -> Line. The planner's traffic (minipar.planner.time_cost) in this run's
    dtypes (`_line`), plus what a step adds beside the model: the loss scaler's
    found_inf vote (fp16: one MAX-Allreduce of one int32 over the world,
    parallel/mixed.py), the clipping norm's Allreduce of one float64 (compose/clip.py),
    the masked loss's count of valid positions (one int64 over dp x cp, documents.py)
    and the sigmoid-bias router's loads (one Allreduce of every block's E int64 counts
    over dp x cp, core/routing.py). `skipped`: the step was one fp16's loss scaler
    skipped (parallel/mixed.py), so no update: no clipping norm, no ZeRO-1/2 Allgatherv
    of the updated slices."""
    from minipar.compose import clip
    from minipar.core import documents
    from minipar.teaching import fp8_ledger

    workload, plan, mesh = minipar_workload(cfg), plan_of(cfg), cfg.mesh_shape()
    out: dict[int, dict[tuple[str, str], Line]] = {}
    for rank in range(mesh.world):
        shape = split_experts_shape(cfg, rank_shape(workload, plan, mesh.coords(rank)["pp"]))
        lines: dict[tuple[str, str], Line] = {}
        for t in traffic(workload, plan, shape):
            if skipped and t.op == "Allgatherv" and cfg.zero in (1, 2):
                continue   # the update skipped: nothing new to gather
            line = _line(t, cfg)
            routed = t.op == "Alltoallv" or (cfg.model == "moe" and t.group == "tp")
            lines[(t.group, t.op)] = _merged(lines.get((t.group, t.op)),
                                             replace(line, routed=routed))
        extra: list[tuple[tuple[str, str], Line]] = []
        if cfg.mixed == "fp16" and mesh.world > 1:
            extra.append((("world", "Allreduce"), Line(1, 1, 4, "int32")))
        for key, (calls, elements) in ({} if skipped else clip.expected_ledger(cfg)).items():
            extra.append((key, Line(calls, elements, 8 * elements, "float64")))
        if cfg.documents:
            for key, (calls, elements) in documents.expected_ledger(
                    cfg.dp * cfg.cp).items():
                extra.append((key, Line(calls, elements, 8 * elements, "int64")))
        if getattr(cfg, "fp8_allgather", False):   # ZeRO-3's gathers: 8-bit words (fp8.py)
            covered = dict(zip(("dp", "edp"), fp8_ledger.covered_elements(cfg, shape.blocks)))
            for group, psi in (("dp", sum(shape.dp_arrays)), ("edp", sum(shape.edp_arrays))):
                line = lines.get((group, "Allgatherv"))
                if line is not None and psi:   # 1 byte a weight word, 2 for the rest
                    words = 2 * line.elements - line.elements * covered[group] // psi
                    lines[(group, "Allgatherv")] = Line(line.calls, words, words, "e4m3+bf16")
        sums = split_expert_sums(cfg, shape.blocks)
        if sums is not None:
            extra.append((("tp", "Allreduce"), sums))
        rows = fp8_ledger.routed_rows(cfg, shape.blocks)
        for key, (calls, elements) in fp8_ledger.expected_ledger(cfg, shape.blocks).items():
            extra.append((key, Line(calls, elements, 4 * elements, "float32",  # amaxes
                                    per_row=(rows.get(key, 0), 4 * rows.get(key, 0)))))
        moe_blocks = sum(1 for block in shape.blocks if block.moe)
        if cfg.router == "sigmoid-bias" and moe_blocks and cfg.dp * cfg.cp > 1:
            counts = moe_blocks * cfg.experts
            extra.append((("dp", "Allreduce"), Line(1, counts, 8 * counts, "int64")))
        for key, line in extra:
            lines[key] = _merged(lines.get(key), line)
        out[rank] = lines
    return out


def predicted_ledgers(cfg: TrainConfig) -> dict[int, dict[tuple[str, str], tuple[int, int]]]:
    """Every rank's ledger as the formulas predict it: rank -> (group, op) -> (calls,
    elements) (`predicted_lines` without the bytes)."""
    return {rank: {key: (line.calls, line.elements) for key, line in lines.items()}
            for rank, lines in predicted_lines(cfg).items()}


def itemsizes_text(record: dict, cfg: TrainConfig) -> str:
    """What a measured line's bytes say of its dtype: one name when every element took
    the same bytes, else the bytes an element (a line moving two dtypes)."""
    if not record["elements"]:
        return "-"
    each = record["bytes"] / record["elements"]
    if each in (2, 4, 8):
        return _dtype_name(int(each), cfg)
    return f"{each:.3g} B/elem"   # two dtypes in one line (e.g. 2-byte and 8-byte calls)


def ledger_differences(records: list[dict], cfg: TrainConfig, skipped: bool = False
                       ) -> list[str]:
    """Every predicted line a rank's ledger does not match, one sentence each with the
    ranks it is true of (empty when all match): calls, elements and bytes (a routed
    line: calls and the bytes an element). A line the formulas do not predict is not
    judged (the table shows "-"). `skipped`: fp16 skipped the step (`predicted_lines`)."""
    out: dict[str, list[int]] = {}   # a sentence -> the ranks it is true of
    for rank, lines in sorted(predicted_lines(cfg, skipped).items()):
        measured = {(r["group"], r["op"]): r for r in records if r["rank"] == rank}
        for (group, op), want in sorted(lines.items()):
            got = measured.get((group, op), {"calls": 0, "elements": 0, "bytes": 0})
            if not want.matches(got):
                out.setdefault(f"{group} {op}: {got['calls']} calls, "
                               f"{got['elements']} elements, {got['bytes']} bytes "
                               f"({itemsizes_text(got, cfg) if got['calls'] else 'absent'}) "
                               f"where the formulas say {want.text()}", []).append(rank)
    return [f"{text} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
            for text, ranks in out.items()]


def ledger_table(records: list[dict], cfg: TrainConfig, skipped: bool = False) -> str:
    """One line per (group, op) for the busiest rank: calls, elements, bytes and the
    dtype they imply, the ring-algorithm wire volume, and what the formulas predict for
    that rank (`predicted_lines`: calls, elements, bytes and dtype; Alltoallv elements
    follow the router, so only calls and the bytes an element are predicted for them;
    the tp Allreduces of split experts, --tp with --model moe, sum the rows an expert
    rank received: their calls, and elements and bytes a whole number of rows above
    the fixed part, `Line.per_row`). `--check` judges every rank's lines the same way
    (`ledger_differences`)."""
    predicted = predicted_lines(cfg, skipped)
    if cfg.outer == "diloco":  # dp carries the outer step: its own formula, every step
        predicted = {rank: {key: line for key, line in lines.items() if key[0] != "dp"}
                     for rank, lines in predicted.items()}
    per: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        per[(r["group"], r["op"])].append(r)
    lines = [f"ledger of the last step ({len(records)} records from "
             f"{len({r['rank'] for r in records})} ranks; the busiest rank of each line)",
             f"{'group':>6} {'op':>15} {'rank':>4} {'calls':>6} {'elements':>10} "
             f"{'bytes':>10} {'dtype':>8} {'wire bytes':>11}  "
             "predicted calls, elements, bytes (dtype)"]
    for (group, op), rows in sorted(per.items()):
        worst = max(rows, key=lambda r: (r["bytes"], -r["rank"]))
        wire = wire_bytes(worst, {group: group_size(cfg, group)})  # a receive: 0
        want = predicted[worst["rank"]].get((group, op))
        if want is None:
            verdict = "-"
        else:
            verdict = f"{want.text(table=True)} {'ok' if want.matches(worst) else 'DIFFERS'}"
        lines.append(f"{group:>6} {op:>15} {worst['rank']:>4} {worst['calls']:>6} "
                     f"{worst['elements']:>10} {worst['bytes']:>10} "
                     f"{itemsizes_text(worst, cfg):>8} {wire:>11.0f}  {verdict}")
    missing = sorted({key for lines_ in predicted.values() for key in lines_} - set(per))
    for group, op in missing:   # predicted, never called: a line of its own
        want = next(lines_[(group, op)] for lines_ in predicted.values()
                    if (group, op) in lines_)
        lines.append(f"{group:>6} {op:>15} {'-':>4} {0:>6} {0:>10} {0:>10} {'-':>8} "
                     f"{0:>11}  {want.calls}, {want.elements}, {want.bytes} ({want.dtype}) "
                     "DIFFERS (never called)")
    if len(lines) == 2:
        lines.append("  (no communication: a mesh of one rank)")
    if cfg.outer == "diloco":
        lines.append("  dp: the outer step's Allreduce of the fragments due (--check judges "
                     "every step's against diloco.dp_allreduce_elements)")
    return "\n".join(lines)


def check_diloco_ledger(cfg: TrainConfig, result: RunResult) -> bool:
    """--outer diloco: every step's dp lines of every rank against the formula
    (parallel/diloco.py `ledger_differences`, `dp_allreduce_elements`); the workers' own
    tp / pp / cp traffic is a dp = 1 run's and is not judged here. One line; True when
    every dp line matches."""
    differences = diloco.ledger_differences(
        result.extras["ledger_steps"], result.extras["fragment_sizes"], cfg.inner_steps,
        cfg.fragments, cfg.steps, np.dtype(cfg.dtype).itemsize,
        result.extras.get("first_step", 1))
    ranks = len(result.extras["fragment_sizes"])
    if differences:
        print(f"ledger against the formulas: {len(differences)} dp line(s) differ, MISMATCH",
              flush=True)
        for line in differences[:6]:
            print(f"  ledger: {line}", flush=True)
        return False
    print(f"ledger against the formulas: the dp Allreduce of every step on {ranks} ranks as "
          f"diloco.dp_allreduce_elements predicts (exact: integers; the workers' own "
          f"traffic not judged here)", flush=True)
    return True


def check_ledger(cfg: TrainConfig, result: RunResult) -> bool:
    """The ledger of the last step against its formulas, every rank's every line: calls,
    elements, bytes and dtype (`ledger_differences`), and rank
    0's bytes of parameters against the planner's memory formula
    (planner/memory_cost.py `model_states`, the MLP MoE's experts as `split_experts_shape`
    cuts them). Both are exact: integers. Two lines; True when both match."""
    if cfg.outer == "diloco":
        return check_diloco_ledger(cfg, result)
    ok = True
    try:
        workload = minipar_workload(cfg)   # the planner's model of this run
    except (KeyError, ValueError) as error:   # a recipe the planner does not price yet
        print(f"ledger and memory against the formulas: not predicted (the planner has no "
              f"formula for {error})", flush=True)
        return True
    if result.ledger:
        history = result.extras.get("scale_history") or [(1.0, False)]
        differences = ledger_differences(result.ledger, cfg, skipped=bool(history[-1][1]))
        ranks = len({r["rank"] for r in result.ledger})
        if differences and cfg.optimizer == "muon":   # its own collectives: not priced yet
            print(f"ledger against the formulas: {len(differences)} line(s) differ, not "
                  "judged (Muon's own collectives, core/muon.py, are not in the planner's "
                  "formulas)", flush=True)
            for line in differences[:6]:
                print(f"  ledger: {line}", flush=True)
        elif differences:
            ok = False
            print(f"ledger against the formulas: {len(differences)} line(s) differ, MISMATCH "
                  "(exact: calls, elements and bytes are integers the formulas give)",
                  flush=True)
            for line in differences[:6]:
                print(f"  ledger: {line}", flush=True)
        else:
            print(f"ledger against the formulas: every line of {ranks} ranks as predicted, "
                  "calls, elements, bytes and dtype (exact: integers)", flush=True)
    memory = result.extras.get("memory")
    if memory is not None and cfg.mesh_shape().world > 1:
        plan = plan_of(cfg)
        want = model_states(workload, plan,
                            split_experts_shape(cfg, rank_shape(workload, plan, 0)), 0)
        same = int(memory.params) == int(want.params)
        ok = ok and same
        print(f"memory against the formulas: rank 0 holds {int(memory.params)} bytes of "
              f"parameters, the formula {int(want.params)}"
              + ("" if same else " MISMATCH") + " (exact: bytes of the arrays held)",
              flush=True)
    return ok
