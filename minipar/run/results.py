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
from collections.abc import Sequence
from pathlib import Path

import numpy as np

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


def check(cfg: TrainConfig, result: RunResult) -> int:
    """`--check`: run the single-process reference in this process and compare (rank 0).
    Prints one line; returns the exit code (1 if either difference is above tolerance)."""
    reference = train_reference(cfg)
    taken = reference.losses[cfg.steps - len(result.losses):]  # a resumed run: its steps
    loss_abs = float(np.max(np.abs(np.subtract(result.losses, taken))))
    loss_rel = relative_difference(result.losses, taken)
    param_abs, param_rel, where = max_differences(result.final, reference.final)
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
