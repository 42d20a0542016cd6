"""What a run is judged by: the tolerance, the one relative-error formula, `--check`, `--dump`.

What this file teaches: "equal to one process" is a number. Two runs agree when,
for every array (the losses, each final parameter), the largest elementwise
difference is small against the array's own scale,

    relative_difference(a, b) = max |a - b| / max |b|

and that number stays under `TOLERANCE[dtype]` (float64: 1e-9). `--check`, the
tour, the lessons and the tests all use this one formula (docs/design.md, "The
train command"). `--dump` writes a run's numbers in the files an independent
program can compare against.

    mpiexec -n 4 python -m minipar train --dp 2 --tp 2 --check --dump out
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minipar.core import fp8, precision, routing
from minipar.core.documents import split_mask
from minipar.run.reference import RunResult, step_batch
from minipar.run.train import train_reference
from minipar.settings import preflight
from minipar.settings.config import TrainConfig

TOLERANCE = {"float64": 1e-9, "float32": 1e-4}


def relative_difference(a: np.ndarray | Sequence[float], b: np.ndarray | Sequence[float],
                        floor: float = 1e-300) -> float:
    """max |a - b| / max |b|: the largest difference against the scale of the reference
    `b`, that scale taken as at least `floor` (0 for empty arrays). The default floor only
    avoids dividing by zero; the tests take 1e-12, so a reference of zeros is met with an
    absolute tolerance instead."""
    a, b = np.asarray(a), np.asarray(b)
    if not b.size:
        return 0.0
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor)


def max_differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float, str]:
    """Largest absolute difference over all tensors, the largest relative one
    (`relative_difference` per tensor), and the tensor where the relative one is."""
    worst_abs, worst_rel, where = 0.0, 0.0, ""
    for name, ref in b.items():
        diff = float(np.max(np.abs(a[name] - ref))) if ref.size else 0.0
        rel = relative_difference(a[name], ref)
        worst_abs = max(worst_abs, diff)
        if rel > worst_rel:
            worst_rel, where = rel, name
    return worst_abs, worst_rel, where


def roundings(cfg: TrainConfig) -> int:
    """D: how many times a value is rounded to 16 bits on its way from the input to the
    loss and back to a weight's gradient in the --mixed MLP (fused_layers.py): the
    embedding's output, 5 per block forward (u, a, z, z W2 + b2, the residual sum), the
    head's logits; backward the logits' gradient, the head's dx, 6 per block (g, dz, da,
    du, LN's dx, dx + g), and the weight gradient itself. The transformer's attention
    half adds 12 a block: forward LN, q/k/v, P, P V, the projection, the residual sum;
    backward the same six. An MoE block is counted as a dense one."""
    attention = 12 * cfg.layers if cfg.model_config().is_gpt else 0
    return 2 + 5 * cfg.layers + 3 + 6 * cfg.layers + attention


def mixed_tolerance(cfg: TrainConfig) -> tuple[float, float]:
    """(losses, parameters): how far a --mixed run on a mesh may be from the one-process
    run in the same precision (docs/design.md, "Mixed precision").

    The derivation. Both runs compute every unrounded value in the master dtype; the
    mesh sums some of them in another order, so before rounding they agree to about the
    master's roundoff. Rounding to 16 bits keeps them equal except where the two values
    straddle a rounding boundary: there they come out one ulp apart, 2u relative (u: the
    unit roundoff, bf16 2^-8, fp16 2^-11). A gradient passes D = `roundings(cfg)`
    roundings. Such straddles are rare and independent, so their effects add like a
    random walk: a gradient's relative difference (2-norm) stays within 2 u sqrt(D),
    the normalized layers carrying each unamplified. The loss, computed from parameters
    that agree that well, through the forward's roundings: relative 2 u sqrt(D).
    An SGD update is lr times the gradient, so one step's parameters differ by
    e = 2 u sqrt(D) of the distance that step moved them; over `steps` steps the
    differences add up and feed into the later gradients: a factor `steps`, parameters
    compared against their movement from init (`moved_difference`).
    Adam divides elementwise: its update lr m / sqrt(v) is lr sign(g) at first, so an
    element whose gradient is within the difference e ||g|| / sqrt(n) of zero may flip
    sign and move 2 lr the other way, however small the roundoff. About a fraction e
    of the n elements lie that close to zero, so the update's relative 2-norm
    difference is 2 sqrt(e) a step (the square root: Adam turns tiny gradient
    differences into whole-step ones).
    Muon (core/muon.py) orthogonalizes each matrix's momentum by a Newton-Schulz
    polynomial whose slope at 0 is a = 3.4445 an iteration: a difference along a small
    singular direction grows up to a^k in k iterations (484 in 5), and two updates of
    singular values near 1 differ by at most twice one update: e a^k a step, never more
    than 2 -- in 16 bits that cap (the parameters are then judged no tighter than their
    movement; the losses keep e), and at least Adam's 2 sqrt(e) for its AdamW tensors.
    The MLP with L = 2: D = 27, bf16 e = 0.041 (losses), parameters 0.041 * steps
    (SGD) or 0.41 * steps (Adam); fp16 e eight times less.
    """
    u = compared_roundoff(cfg)
    per_step = 2.0 * u * math.sqrt(roundings(cfg))
    return per_step, update_rule(cfg, per_step)[0] * cfg.steps


def update_rule(cfg: TrainConfig, e: float) -> tuple[float, str]:
    """How far one step's parameters may differ, relative to that step's movement, when
    the gradients differ by e (`mixed_tolerance`), and the rule's words."""
    if cfg.optimizer == "adam":
        return 2.0 * math.sqrt(e), "2 sqrt(e) a step (Adam)"
    if cfg.optimizer == "muon":
        k = cfg.ns_steps or 5   # e a^k, capped at 2 before it is computed: a^1000 overflows
        amplified = 2.0 if e <= 0 or math.log(e) + k * math.log(3.4445) >= math.log(2.0) \
            else e * 3.4445 ** k
        return max(amplified, 2.0 * math.sqrt(e)), (
            f"min(2, e a^{cfg.ns_steps}) a step (Muon: Newton-Schulz's slope a = 3.4445 an "
            "iteration), at least 2 sqrt(e) (AdamW)")
    return e, "e a step (SGD)"


def compared_roundoff(cfg: TrainConfig) -> float:
    """u of `mixed_tolerance`: the 16-bit format's, or under --fp8 sqrt(u_bf16 u_e4m3).

    The derivation (docs/design.md, "FP8"). Both runs quantize with the same scales (the
    mesh agrees every group's amax: the groups are the unsharded tensor's), so an 8-bit
    rounding comes out differently only where its bf16 input already differed, by one
    bf16 ulp (2 u16 relative) at a straddle. That input crosses an e4m3 rounding boundary
    with probability 2 u16 / 2 u8, and then the two come out one e4m3 ulp (2 u8) apart:
    a difference of RMS sqrt(u16 / u8) 2 u8 = 2 sqrt(u16 u8). So the rule of --mixed
    holds with u = sqrt(2^-8 2^-4) = 2^-6, four times bf16's: the MLP with L = 2 (D = 27)
    e = 0.16."""
    if getattr(cfg, "fp8", None):
        return math.sqrt(precision.unit_roundoff("bf16") * fp8.UNIT_ROUNDOFF["e4m3"])
    return precision.unit_roundoff(cfg.mixed)


def moved_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray],
                     init: dict[str, np.ndarray]) -> tuple[float, str]:
    """The largest ||a - b|| / ||b - init|| over the tensors (2-norms): parameters against
    how far the reference moved them (a tensor that did not move must match exactly),
    and the tensor where it is. A tensor `init` lacks is state that starts at zero (the
    sigmoid-bias router's b): its movement is measured from 0."""
    worst, where = 0.0, ""
    for name, ref in b.items():
        if not ref.size:
            continue
        moved = float(np.linalg.norm(ref - init[name])) if name in init else \
            float(np.linalg.norm(ref))
        diff = float(np.linalg.norm(a[name] - ref))
        rel = diff / moved if moved > 0 else (0.0 if diff == 0 else float("inf"))
        if rel > worst:
            worst, where = rel, name
    return worst, where


# ------------------------------------------------------- the same decisions
@dataclass
class Decisions:
    """A mesh run's discrete decisions, gathered on rank 0 for `--check` (docs/design.md,
    "Mixed precision"): fp16's skip of each step (`skips`, None when not replayed) with
    the largest finite scaled gradient any rank held that step (`largest`), and every
    counted routing call's choice over the whole microbatch (`choices`: (B/M T, k) per
    call, steps, then microbatches, then MoE blocks; None when not replayed). `why_not`
    says what could not be replayed and why (a resumed run, a pipeline...)."""

    skips: list[bool] | None = None
    largest: list[float] = field(default_factory=list)
    choices: list[np.ndarray] | None = None
    why_not: list[str] = field(default_factory=list)


def gather_decisions(world: object, cfg: TrainConfig, result: RunResult,
                     chosen: list[np.ndarray]) -> Decisions | None:
    """Every rank's decisions to rank 0 (one gather over `world`, after the run, outside
    the ledger); `chosen`: this rank's routing choices (routing.recording). Returns the
    Decisions on rank 0, None elsewhere.

    A rank's routing call covers its tokens of the microbatch: the rows of its dp
    coordinate (data.rank_rows, local_rows) and the positions of its cp coordinate
    (context_parallel.positions); token (row r, position t) of microbatch m is the
    reference's token (r - m B/M) T + t. tp ranks route the same tokens (one is read).
    Replayed only where the reference makes the same calls in the same order: no
    pipeline (its schedule orders the blocks' calls per stage), no sequence parallelism,
    every step of --steps run here (not resumed)."""
    coords = cfg.mesh_shape().coords(world.Get_rank())
    largest = result.extras.get("largest_scaled", [])
    everyone = world.gather((coords, chosen, largest), root=0)
    if everyone is None:
        return None
    out = Decisions()
    history = result.extras.get("scale_history")
    if cfg.outer is not None:  # every worker its own skips and its own rows' routing
        out.why_not.append("the workers' decisions (--outer diloco: each worker skips and "
                           "routes on its own, as the reference's workers do)")
        return out
    if cfg.mixed == "fp16" and history is not None:
        if len(history) == cfg.steps:
            out.skips = [bool(skipped) for _, skipped in history]
            out.largest = [max(values) for values in zip(*(r[2] for r in everyone))] \
                if all(r[2] for r in everyone) else []
        else:
            out.why_not.append("the loss scaler's skips (a resumed run: the earlier steps "
                               "were decided by another job)")
    if not cfg.model_config().is_moe:
        return out
    reasons = [why for why, no in (("a pipeline orders each stage's routing calls its own "
                                    "way", cfg.pp > 1),
                                   ("sequence parallelism routes other token sets", cfg.sp),
                                   ("a resumed run", len(result.losses) != cfg.steps
                                    or cfg.resume is not None)) if no]
    if reasons:
        out.why_not.append(f"the routing choices ({reasons[0]})")
        return out
    out.choices = assemble_choices(cfg, everyone)
    return out


def assemble_choices(cfg: TrainConfig, everyone: list[tuple]) -> list[np.ndarray]:
    """The whole microbatch's (B/M T, k) choice of every routing call from each rank's
    (coords, its calls' choices, ...) (`gather_decisions`)."""
    from minipar.core.data import local_rows, rank_rows
    from minipar.parallel import context_parallel  # loads mpi4py.MPI: --check runs on a mesh

    per_mb = cfg.batch // cfg.microbatches
    length = cfg.seq_len if cfg.model_config().is_gpt else 1
    calls = len(everyone[0][1])
    blocks = calls // (cfg.steps * cfg.microbatches) if calls else 0
    out = [np.full((per_mb * length, cfg.top_k), -1, dtype=np.int16) for _ in range(calls)]
    for coords, chosen, _ in everyone:
        if len(chosen) != calls:
            raise RuntimeError(f"rank {coords} routed {len(chosen)} times, rank 0 {calls}")
        positions = context_parallel.positions(cfg.seq_len, cfg.cp, coords["cp"],
                                               cfg.cp_mode) if cfg.cp > 1 else \
            np.arange(length)
        for call, choice in enumerate(chosen):
            m = call // blocks % cfg.microbatches
            rows = rank_rows(cfg.batch, cfg.microbatches, cfg.dp, coords["dp"])[
                local_rows(cfg.batch, cfg.microbatches, cfg.dp, m)] - m * per_mb
            tokens = (rows[:, None] * length + positions[None, :]).ravel()
            out[call][tokens] = choice
    if any((c < 0).any() for c in out):
        raise RuntimeError("a token no rank routed: the choices do not cover the batch")
    return out


FP16_MAX = 65504.0   # fp16's largest finite number: a scaled gradient past it overflows


def short(x: float) -> str:
    """A number in two digits, written 6.6e4."""
    return f"{x:.1e}".replace("e+0", "e").replace("e-0", "e-")


def replayed_reference(cfg: TrainConfig, decisions: Decisions | None
                       ) -> tuple[RunResult, list[str]]:
    """The one-process run under the mesh run's decisions, and one line for each step
    where one of them is not the one process's own ("step 9: ..."). Where every decision
    is its own, the numbers are those of the plain one-process run, bit for bit."""
    if decisions is None or (decisions.skips is None and decisions.choices is None):
        return train_reference(cfg), []
    replay = routing.Replay(decisions.choices) if decisions.choices is not None else None
    with precision.replaying(decisions.skips) as made, routing.replaying(replay):
        reference = train_reference(cfg)
    lines = []
    scaler = made[-1] if made else None
    if decisions.skips is not None and isinstance(scaler, precision.ReplayedScaler):
        for step, (mine, own) in enumerate(zip(decisions.skips, scaler.own)):
            if mine == own:
                continue
            here = decisions.largest[step] if step < len(decisions.largest) else math.nan
            # the margin is the finite side's: how close its largest scaled gradient came to
            # fp16's largest (the side that overflowed has no finite 16-bit maximum to show)
            finite = scaler.largest[step] if mine else here
            over, kept = ("this run", "one process") if mine else ("one process", "this run")
            lines.append(f"step {step + 1}: {over}'s scaled gradients overflowed fp16, "
                         f"{kept}'s stayed finite (its largest {short(finite)}, "
                         f"{abs(FP16_MAX - finite) / FP16_MAX:.0%} "
                         f"{'below' if finite <= FP16_MAX else 'above'} fp16's largest "
                         f"{FP16_MAX:g}); compared under this run's decisions")
    if replay is not None and replay.flips:
        per_step = cfg.microbatches * (len(replay.choices) // (cfg.steps * cfg.microbatches))
        steps: dict[int, list[tuple[int, float]]] = {}
        for call, flip in sorted(replay.flips.items()):
            steps.setdefault(call // per_step, []).append(flip)
        for step, flips in sorted(steps.items()):
            tokens = sum(n for n, _ in flips)
            gap = max(g for _, g in flips)
            lines.append(f"step {step + 1}: {tokens} token(s) chose other top-{cfg.top_k} "
                         f"experts here than in one process (scores {short(gap)} apart at "
                         f"most: a rounding's difference); compared under this run's "
                         "decisions" + (" (their choices, and so the tokens capacity keeps)"
                                        if cfg.capacity_factor is not None else ""))
    return reference, lines


# ------------------------------------------------------------------ --check
# beside each tolerance, where it comes from (docs/design.md, "The train command")
DERIVATION = {
    "float64": "float64's sums in another order: a few ulps (1.1e-16) a step, grown "
               "through the steps; 1e-9 leaves a million times that",
    "float32": "float32's sums in another order: a few ulps (6e-8) a step, grown through "
               "the steps; 1e-4 leaves a thousand times that",
}


def near(value: float, bound: float) -> str:
    """' (within 5% of its bound)' for a check that passes by less than 5%, else ''."""
    return " (within 5% of its bound)" if 0.95 * bound < value <= bound else ""


def check(cfg: TrainConfig, result: RunResult, decisions: Decisions | None = None,
          formulas: Callable[[TrainConfig, RunResult], bool] | None = None) -> int:
    """`--check`: run the single-process reference in this process and compare (rank 0),
    under the mesh run's discrete decisions (`replayed_reference`). Prints the numbers'
    line, a line for each decision that differed, then what `formulas` prints (the
    ledger's and the memory's lines against the planner's formulas:
    teaching/ledger_tables.py `check_ledger`, handed in from above, where the planner
    lives) and a line for each replica that disagrees; returns the exit code (1 if any
    fails)."""
    reference, decided = replayed_reference(cfg, decisions)
    taken = reference.losses[cfg.steps - len(result.losses):]  # a resumed run: its steps
    loss_abs = float(np.max(np.abs(np.subtract(result.losses, taken))))
    loss_rel = relative_difference(result.losses, taken)
    param_abs, param_rel, where = max_differences(result.final, reference.final)
    if cfg.mixed:
        ok = check_mixed(cfg, result, reference, taken, decisions)
    else:
        tolerance = TOLERANCE[cfg.dtype]
        ok = loss_rel <= tolerance and param_rel <= tolerance
        norms = result.extras.get("gnorms") or []   # --clip-grad-norm: this rank's norms
        norm_rel = relative_difference(norms, reference.extras["gnorms"][
            cfg.steps - len(norms):]) if norms else 0.0
        ok = ok and norm_rel <= tolerance
        worst = max(loss_rel, param_rel, norm_rel)
        print(f"check against one process: losses max abs {loss_abs:.3e} rel {loss_rel:.3e}; "
              f"final params max abs {param_abs:.3e} rel {param_rel:.3e}"
              + (f"; gnorm rel {norm_rel:.3e}" if norms else "")
              + (f" (worst: {where})" if where else "")
              + f" -> {'OK' if ok else 'MISMATCH'} (tolerance {tolerance:g}: "
              f"{DERIVATION[cfg.dtype]}){near(worst, tolerance)}", flush=True)
    for line in decided:
        print(f"decision differs, {line}", flush=True)
    for line in (decisions.why_not if decisions is not None else []):
        print(f"decisions not replayed: {line}; compared under one process's own", flush=True)
    ok = (formulas(cfg, result) if formulas is not None else True) and ok
    disagreements = result.extras.get("replica_disagreements", [])
    for line in disagreements[:5]:
        print(f"replicas disagree: {line}", flush=True)
    return 0 if ok and not disagreements else 1


def check_mixed(cfg: TrainConfig, result: RunResult, reference: RunResult,
                taken: list[float], decisions: Decisions | None = None) -> bool:
    """`--check` of a --mixed run: the losses (relative) and the parameters (against
    their movement) under `mixed_tolerance`, the loss scale S and the skipped steps
    equal -- the reference replayed this run's skips, so a differing S is a scaler
    that did not follow them. One line, each tolerance's derivation beside it; True
    when within."""
    loss_tol, param_tol = mixed_tolerance(cfg)
    loss_rel = relative_difference(result.losses, taken)
    param_moved, where = moved_difference(result.final, reference.final, reference.init)
    same_scale = (result.extras.get("loss_scale"), result.extras.get("skipped")) == (
        reference.extras["loss_scale"], reference.extras["skipped"])
    ok = loss_rel <= loss_tol and param_moved <= param_tol and same_scale
    u = compared_roundoff(cfg)   # --fp8: sqrt(u_bf16 u_e4m3) = 2^-6
    d = roundings(cfg)
    step_rule = update_rule(cfg, loss_tol)[1]
    print(f"check against one process in {cfg.mixed}"
          f"{f' --fp8 {cfg.fp8}' if getattr(cfg, 'fp8', None) else ''}: losses rel {loss_rel:.3e} "
          f"(tolerance {loss_tol:.3g} = e = 2u sqrt(D), u = 2^{round(math.log2(u))}, "
          f"D = {d} roundings){near(loss_rel, loss_tol)}; final params / their movement "
          f"{param_moved:.3e} (tolerance {param_tol:.3g} = {step_rule} x {cfg.steps} "
          f"steps){near(param_moved, param_tol)}" + (f" (worst: {where})" if where else "")
          + f"; S {result.extras.get('loss_scale'):g} skipped {result.extras.get('skipped')}"
          + ("" if same_scale else f" vs one process's S {reference.extras['loss_scale']:g} "
             f"skipped {reference.extras['skipped']}")
          + f" -> {'OK' if ok else 'MISMATCH'}", flush=True)
    return ok


def dump(folder: Path, cfg: TrainConfig, result: RunResult) -> None:
    """The `--dump` files (docs/design.md, "The train command"), written by rank 0."""
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "init.npz", **result.init)
    np.savez(folder / "final.npz", **result.final)
    batches = [step_batch(cfg, s) for s in range(cfg.steps)]
    if cfg.documents:  # y padded with 0 beside its loss mask (documents.py)
        ys, masks = zip(*(split_mask(b[1]) for b in batches))
        np.savez(folder / "data.npz", x=np.stack([b[0] for b in batches]), y=np.stack(ys),
                 mask=np.stack(masks))
    else:
        np.savez(folder / "data.npz", x=np.stack([b[0] for b in batches]),
                 y=np.stack([b[1] for b in batches]))
    (folder / "losses.json").write_text(json.dumps(result.losses))
    if result.extras.get("gnorms"):  # --clip-grad-norm: each step's global gradient norm
        (folder / "gnorms.json").write_text(json.dumps(result.extras["gnorms"]))
    (folder / "config.json").write_text(json.dumps(cfg.as_json(), indent=1))
    (folder / "ledger.json").write_text(json.dumps(result.ledger, indent=1))
    # every step's ledger: the records of ledger.json, each with its "step" (1-based)
    (folder / "ledger_steps.json").write_text(json.dumps(result.extras.get("ledger_steps", [])))
    if "fragment_sizes" in result.extras:  # --outer diloco: each rank's elements of each
        (folder / "fragment_sizes.json").write_text(   # fragment (parallel/diloco.py)
            json.dumps(result.extras["fragment_sizes"]))
    written = ["init.npz", "final.npz", "data.npz", "losses.json", "config.json",
               "ledger.json", "ledger_steps.json"] + (
        ["gnorms.json"] if result.extras.get("gnorms") else []) + (
        ["fragment_sizes.json"] if "fragment_sizes" in result.extras else [])
    preflight.sign_dump(folder, "train", written)   # whose files these are (preflight.py)
