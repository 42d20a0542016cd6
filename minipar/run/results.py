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
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from minipar.core import precision
from minipar.core.documents import split_mask
from minipar.run.train import RunResult, step_batch, train_reference
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
    The MLP with L = 2: D = 27, bf16 e = 0.041 (losses), parameters 0.041 * steps
    (SGD) or 0.41 * steps (Adam); fp16 e eight times less.
    """
    u = precision.unit_roundoff(cfg.mixed)
    per_step = 2.0 * u * math.sqrt(roundings(cfg))
    update = 2.0 * math.sqrt(per_step) if cfg.optimizer == "adam" else per_step
    return per_step, update * cfg.steps


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


def check(cfg: TrainConfig, result: RunResult) -> int:
    """`--check`: run the single-process reference in this process and compare (rank 0).
    Prints one line; returns the exit code (1 if either difference is above tolerance)."""
    reference = train_reference(cfg)
    taken = reference.losses[cfg.steps - len(result.losses):]  # a resumed run: its steps
    loss_abs = float(np.max(np.abs(np.subtract(result.losses, taken))))
    loss_rel = relative_difference(result.losses, taken)
    param_abs, param_rel, where = max_differences(result.final, reference.final)
    if cfg.mixed:
        return check_mixed(cfg, result, reference, taken)
    tolerance = TOLERANCE[cfg.dtype]
    ok = loss_rel <= tolerance and param_rel <= tolerance
    norms = result.extras.get("gnorms") or []   # --clip-grad-norm: this rank's norms
    norm_rel = relative_difference(norms, reference.extras["gnorms"][
        cfg.steps - len(norms):]) if norms else 0.0
    ok = ok and norm_rel <= tolerance
    print(f"check against one process: losses max abs {loss_abs:.3e} rel {loss_rel:.3e}; "
          f"final params max abs {param_abs:.3e} rel {param_rel:.3e}"
          + (f"; gnorm rel {norm_rel:.3e}" if norms else "")
          + (f" (worst: {where})" if where else "")
          + f" -> {'OK' if ok else 'MISMATCH'} (tolerance {tolerance:g})", flush=True)
    for line in result.extras.get("replica_disagreements", [])[:5]:
        print(f"replicas disagree: {line}", flush=True)
    return 0 if ok else 1


def check_mixed(cfg: TrainConfig, result: RunResult, reference: RunResult,
                taken: list[float]) -> int:
    """`--check` of a --mixed run: the losses (relative) and the parameters (against
    their movement) under `mixed_tolerance`; the loss scale S and the skipped steps
    equal. One line; the exit code (1 if above)."""
    loss_tol, param_tol = mixed_tolerance(cfg)
    loss_rel = relative_difference(result.losses, taken)
    param_moved, where = moved_difference(result.final, reference.final, reference.init)
    same_scale = (result.extras.get("loss_scale"), result.extras.get("skipped")) == (
        reference.extras["loss_scale"], reference.extras["skipped"])
    ok = loss_rel <= loss_tol and param_moved <= param_tol and same_scale
    print(f"check against one process in {cfg.mixed}: losses rel {loss_rel:.3e} "
          f"(tolerance {loss_tol:.3g}); final params / their movement {param_moved:.3e} "
          f"(tolerance {param_tol:.3g})" + (f" (worst: {where})" if where else "")
          + f"; S {result.extras.get('loss_scale'):g} skipped {result.extras.get('skipped')}"
          + ("" if same_scale else f" vs one process's S {reference.extras['loss_scale']:g} "
             f"skipped {reference.extras['skipped']}")
          + f" -> {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


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
