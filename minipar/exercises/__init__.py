"""Exercises that grade themselves: rewrite one piece of a strategy, the equivalence
suite says whether it is right.

What this package teaches a class: every strategy here is checked against one
process, so the same checks can grade a student's version of it. An exercise
names a few regions of the library's own source, marked in place by two
comments that leave the code readable: `# exercise: NAME` on the line before the
real code (the reference solution) and `# end exercise` on the line after it.
`python -m minipar exercise start NAME DIR` copies the package to DIR with those
regions replaced by a stub that raises `NotImplementedError` with the exercise's
instructions (regions.py); the stubs are cut from the real code each time, so an
exercise never drifts from it. `python -m minipar exercise check NAME DIR` runs the
exercise's checks on the student's copy in one MPI job (grade.py): equivalence with
one process (float64, relative 1e-9), the ledger against the formulas, the
gradient checks; and prints passed, or the first mismatch in words a student can
act on, naming any region left as the stub or copied from the reference answer.
Each exercise has a hint file in hints/, named after it, in numbered steps (`## Step
1`, ...) that `python -m minipar exercise hint NAME [--step K]` reveals one at a
time: a nudge first, the exact call shapes last, never the answer's code.
docs/design.md, "Exercises".

    python -m minipar exercise list
    python -m minipar exercise start dp-naive ~/work && cd ~/work
    python -m minipar exercise hint dp-naive            (then --step 2, ...)
    python -m minipar exercise check dp-naive .
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

HINTS = Path(__file__).resolve().parent / "hints"
STEP = re.compile(r"^## Step (\d+)\s*$", flags=re.M)   # a hint file's step headings
RANKS = 4  # every check runs on this many ranks: small, yet a ring of 4 and a 2 x 2 mesh

# Tiny shapes for every training check: a few milliseconds a step.
SMALL = {"layers": 4, "d_in": 8, "d_model": 8, "classes": 4, "batch": 16, "steps": 2,
         "experts": 4}


@dataclass(frozen=True)
class Exercise:
    """One exercise: the marked regions it stubs, what the stub tells the student, and
    the checks that grade it. A check is ("train", TrainConfig fields) for a run compared
    with one process and with the ledger formulas, or ("ring" | "schedule" |
    "conjugate" | "linears" | "heads" | "ring-attention", {}) for the unit checks of
    units.py and units_attention.py."""

    name: str
    title: str
    instructions: str
    checks: list[tuple[str, dict]] = field(default_factory=list)

    @property
    def hint_file(self) -> Path:
        return HINTS / f"{self.name}.md"

    def hint_steps(self) -> list[str]:
        """The hint's steps in order, each without its heading: what `exercise hint`
        reveals one at a time. Raises ValueError unless the file is `## Step 1`,
        `## Step 2`, ... in order, each with text, and nothing before the first."""
        text = self.hint_file.read_text()
        parts = STEP.split(text)   # [before, "1", step 1, "2", step 2, ...]
        numbers = [int(n) for n in parts[1::2]]
        steps = [step.strip() for step in parts[2::2]]
        if parts[0].strip() or numbers != list(range(1, len(numbers) + 1)) or \
                not all(steps) or not steps:
            raise ValueError(f"{self.hint_file.name}: a hint is '## Step 1', '## Step 2', "
                             "... in order, each with its text")
        return steps


# The transformer's tiny shapes: 8 positions of a 16-token vocabulary, 4 heads of width 2.
SMALL_GPT = {"model": "gpt", "layers": 2, "d_model": 8, "heads": 4, "seq_len": 8,
             "vocab": 16, "batch": 4, "steps": 2}


def _train(**fields: object) -> tuple[str, dict]:
    return ("train", {**SMALL, **fields})


def _train_gpt(**fields: object) -> tuple[str, dict]:
    return ("train", {**SMALL_GPT, **fields})


EXERCISES = [
    Exercise(
        "dp-naive", "Data parallelism: one Allreduce per parameter",
        "In data_parallel.allreduce_gradients, make every replica's gradient the average "
        "over dp: for each parameter p, Allreduce its gradient grad (grad_or_zeros(p)) in "
        "place over group, its replicas (the dp group, or edp for an expert weight), then "
        "divide by mesh.shape.replicas (dp, times cp under context parallelism). Shapes: "
        "p.grad has p.data's shape; one Allreduce per parameter, none on a group of one "
        "rank.",
        [_train(dp=4, grad_sync="naive"),
         _train(model="moe", dp=4, ep=2, grad_sync="naive")]),
    Exercise(
        "dp-bucketed", "Data parallelism: one Allreduce per bucket",
        "In data_parallel.bucketed_allreduce, for each bucket (a list of parameters of "
        "one sync group): pack its gradients into one flat buffer (pack), Allreduce "
        "the buffer in place over the bucket's group (groups[i], the bucket's replicas "
        "as the precision policy sums), and unpack it back scaled by 1/dp. Shapes: the "
        "flat buffer has sum(p.size) elements; one Allreduce per bucket, none on a group "
        "of one rank.",
        [_train(dp=4, grad_sync="bucketed", bucket_size=100),
         _train(model="moe", dp=4, ep=2, grad_sync="bucketed", bucket_size=100)]),
    Exercise(
        "conjugate-f-g", "Tensor parallelism: the conjugate pair f and g",
        "In comm/collectives.py write Megatron's f and g as autograd nodes (Tensor.from_op(data, "
        "parents, backward)). copy_to (f): forward identity, backward Allreduce(SUM) over "
        "the group of the output gradient (allreduce_sum), accumulated into x with "
        "fresh=True. reduce_from (g): forward Allreduce(SUM) of x.data over the group, "
        "backward identity (x.accumulate(g)). Shapes: (B, d) in, (B, d) out.",
        [("conjugate", {}), _train(tp=2, dp=2), _train(tp=4)]),
    Exercise(
        "column-parallel", "Tensor parallelism: the column-parallel linear",
        "Write ColumnParallelLinear.__call__: this rank holds W[:, cols] (d, f/tp) and "
        "b[cols]; enter the tensor-parallel region through f, copy_to(x, tp) (forward "
        "identity, backward Allreduce), unless self.entered; compute fused.linear(x, "
        "self.weight, self.bias): (B, d) @ (d, f/tp) -> (B, f/tp), and with gather_output "
        "Allgather the columns (gather_from(y, self.tp, axis=-1)) into (B, f).",
        [("linears", {}), _train(tp=2, dp=2), _train(tp=2, dp=2, sp=True)]),
    Exercise(
        "row-parallel", "Tensor parallelism: the row-parallel linear",
        "Write RowParallelLinear's partial and __call__: this rank holds W[rows, :] (f/tp, "
        "d) and all of b. partial(x): if not input_is_parallel, keep my columns "
        "(scatter_to(x, self.tp, axis=-1)); return the partial sum fused.linear(x, "
        "self.weight, partial=True): (B, f/tp) @ (f/tp, d) -> (B, d). __call__(x): add the "
        "partial sums of all tp ranks with reduce_from (g, an Allreduce), and only then "
        "add the bias, once.",
        [("linears", {}), _train(tp=2, dp=2), _train(tp=2, dp=2, sp=True)]),
    Exercise(
        "alltoall-dispatch", "Expert parallelism: the Alltoall dispatch and its counts",
        "In expert_parallel.py: exchange_counts must tell every rank how many rows it "
        "will receive: send[j, l] rows go to local expert l of ep rank j, so one "
        "Alltoall over ep_group of send (ep, E/ep) gives recv (ep, E/ep), recv[i, l] "
        "from rank i. dispatch must take the rows of u for the assignments "
        "(ag.take_rows(u, token_rows): (S, d)) and move them with "
        "comm.alltoallv(rows, ep_group, send counts per rank, recv counts per rank) -> "
        "(R, d).",
        [_train(model="moe", dp=4, ep=4),
         _train(model="moe", dp=4, ep=2, capacity_factor=1.0)]),
    Exercise(
        "one-f-one-b", "Pipeline parallelism: the 1F1B order",
        "Write schedules.one_f_one_b_order(pp, microbatches, stage) "
        "(minipar/parallel/pipeline/schedules.py): the list "
        "of Instruction(FORWARD, m) / Instruction(BACKWARD, m) stage `stage` computes. "
        "Warm-up: min(pp - stage - 1, M) forwards; steady state: one forward, then the "
        "oldest backward; cool-down: the remaining backwards. Every microbatch 0..M-1 "
        "forward once, backward once, in order; at most pp - stage alive at once.",
        [("schedule", {}), _train(pp=4, microbatches=8), _train(pp=2, dp=2, microbatches=4)]),
    Exercise(
        "zero1", "ZeRO-1: Reduce_scatter the gradients, Allgather the parameters",
        "In zero.Space: reduce_scatter(grads, a, b) sums the flat gradients' range "
        "[a, b) over the space's replicas and returns only this rank's part of it: ask "
        "the layout how many elements of [a, b) each rank owns, make the receive buffer "
        "for this rank's count, and let one Reduce_scatter (with those counts, summing) "
        "fill it; the precision policy self.precision says what is sent and how it adds "
        "(reduction), where the sum lands (landing) and hands it back (reduced). "
        "Zero1.allgather_params gives every replica every rank's updated slice "
        "of each space's flat parameters, in place: one Allgatherv over the space's group, "
        "each rank's count from the layout, the displacements their running sums.",
        [_train(dp=4, zero=1, optimizer="adam"), _train(dp=2, tp=2, zero=1)]),
    Exercise(
        "loss-scaler", "Mixed precision: the loss scaler every rank agrees on",
        "Two pieces of fp16 loss scaling. In core/precision.py LossScaler.update(found_inf): "
        "on an overflow count a skipped step (self.skipped), restart the clean-step count "
        "(self.clean = 0), halve self.scale (never below 2**-24) and return True (skip); "
        "otherwise count a clean step, and after self.window clean steps in a row (window "
        "> 0) double self.scale and restart the count; return False. In "
        "comm/low_precision.py any_nonfinite(group, arrays): this rank's 0/1 verdict "
        "(precision.nonfinite(arrays)) as a one-element int32 array, MAX-Allreduced in "
        "place over the group (none on a group of one), returned as a bool: every rank "
        "must skip the same steps.",
        [("loss-scaler", {}),
         # the stages overflow on different steps; the shapes of tests/parallel/test_mixed.py,
         # where the mesh skips the steps one process skips (docs/design.md says when not)
         _train(mixed="fp16", pp=2, microbatches=2, loss_scale=2.0 ** 20,
                loss_scale_window=2, steps=6, d_in=32, d_model=16, classes=10)]),
    Exercise(
        "ring-allreduce", "Collectives by hand: the ring Allreduce",
        "In ring.py write the two phases on group.Sendrecv (rank r sends right to r+1, "
        "receives from the left, r-1). reduce_scatter_in_ring: in N-1 steps, send the "
        "running sum of chunk r-s-1, receive chunk r-s-2 and add it in; afterwards chunk "
        "r of flat holds the full sum. allgather_in_ring: in N-1 steps, send finished "
        "chunk r-s, receive chunk r-s-1 into its place. Chunk i is "
        "flat[offsets[i]:offsets[i+1]]; each rank sends 2n - c_r - c_(r+1) elements.",
        [("ring", {})]),
    Exercise(
        "attention-heads", "Tensor parallelism: attention split by heads",
        "In tensor_parallel.TensorParallelAttention, split the H heads over the tp group. "
        "__init__: self.heads is this rank's number of heads, H/tp; self.q, self.k, self.v "
        "are ColumnParallelLinear(full, f\"{p}.attn.q\", tp, entered=True) (and .k, .v): "
        "my heads' columns of Wq, Wk, Wv (d, d/tp), no entry of their own; self.proj is "
        "RowParallelLinear(full, f\"{p}.attn.proj\", tp): my heads' rows of Wo (d/tp, d), "
        "its partial sums added by g (one Allreduce of (B, T, d)). enter(a): the one f "
        "shared by q, k and v, copy_to over the layer's tp group (forward identity, "
        "backward one Allreduce). Sequence parallelism "
        "(sequence_parallel.SequenceParallelAttention) is built on yours: it wraps proj "
        "and replaces enter.",
        [("heads", {}), _train_gpt(tp=2, dp=2), _train_gpt(tp=4, sp=True),
         _train_gpt(tp=2, cp=2, cp_mode="ring")]),
    Exercise(
        "ring-attention", "Context parallelism: ring attention",
        "In context_parallel.py, three pieces of the ring. pass_along(group, block): one ring"
        " step -- this rank's block goes to the next rank while the previous rank's arrives, "
        "in one blocking exchange (Sendrecv); return what arrived (same shape (B, H, T/cp, "
        "dh)). _merge(Out, L, o, lse): online softmax, in place: Out (B, H, Tq, dh) and its "
        "row log-sum-exp L (B, H, Tq) over the keys so far absorb o, lse of one more block of"
        " keys: L' = log(e^L + e^lse), Out' = Out e^(L - L') + o e^(lse - L'); a row that has"
        " seen no key yet has L = -inf and must stay finite. visible_blocks: for each of my "
        "runs of query positions and each of the source's runs of key positions, the causal "
        "mask of that pair (module core/attention.py has it); skip a pair whose mask hides "
        "every key, else record (the rows of the queries in my local array, the rows of the "
        "keys in the source's, the mask): run i covers local rows i*len .. (i+1)*len - 1.",
        [("ring-attention", {}), _train_gpt(cp=4, cp_mode="ring"),
         _train_gpt(cp=2, dp=2, cp_mode="zigzag")]),
    Exercise(
        "muon-sharded", "Muon: Newton-Schulz on a matrix split over tp",
        "In parallel/muon_mesh.py orthogonalize_sharded: x is this rank's shard of X (X = "
        "U, or U^T when U is tall), split by its columns when split_cols is true, else by "
        "its rows. Divide x by the Frobenius norm of the WHOLE X (at least muon.EPS): its "
        "sum of squares is one Allreduce of a (1,) array over the group. Then `steps` "
        "times: with X's columns split, the Gram matrix A = X X^T (m', m') is the sum over "
        "the ranks of their x x^T, one Allreduce, and x becomes a x + (b A + c A A) x; with "
        "X's rows split, B = X^T X (n', n') is the sum of their x^T x and x becomes "
        "a x + x (b B + c B B). (a, b, c) are muon.NS_COEFFICIENTS; leave the result in x.",
        [("muon", {})]),
]

BY_NAME = {exercise.name: exercise for exercise in EXERCISES}


def get(name: str) -> Exercise:
    """The exercise called `name`, or a ValueError listing the names there are."""
    if name not in BY_NAME:
        raise ValueError(f"no exercise {name!r}; there are: {', '.join(BY_NAME)}")
    return BY_NAME[name]
