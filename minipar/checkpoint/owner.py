"""Whose checkpoints a folder holds: a run id and a model in every manifest.

What this file teaches: a folder of step folders is only safe to prune, or to
point `latest` somewhere new in, when everything in it belongs to the run that is
writing. So every manifest names

    "run":   a random id drawn when a run starts fresh, carried along by every run
             resumed from it and by `reshard` (the same training, continued or moved);
    "model": the model's kind and a digest of its canonical shapes.

and before the first step (every rank alone, no communication), a `--save DIR` or a
reshard's DST is refused in one line when DIR holds

- the checkpoints of another model (a mixed folder, whose `--keep` would delete them),
- the checkpoints of another run of the same model (start it with `--resume DIR`, or
  save elsewhere),
- a newer step of this same run than the one about to be saved (`latest` would move
  back, and `--keep` would delete the newer step).

Pruning (`step_folders.prune`) then removes only step folders of the writing run,
and `publish` refuses to move `latest` back even if the folder changed since the check.
Step folders written before manifests named their run (no "run" field) are never
pruned and never block: they are kept beside.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from pathlib import Path

NEW_RUN = "(a new run)"   # what a fresh run's id is before its first save draws one
_STEP = re.compile(r"^step-(\d{6,})")


def new_run_id() -> str:
    """A fresh run's id: 12 random hex digits (drawn once, on rank 0, at its first save)."""
    return secrets.token_hex(6)


def model_id(kind: str, shapes: dict) -> dict:
    """The manifest's "model": the kind (`--model`) and a digest of every canonical shape,
    so two configs that build the same arrays name the same model."""
    text = json.dumps({k: list(v) for k, v in shapes.items()}, sort_keys=True)
    count = sum(_elements(v) for v in shapes.values())
    return {"kind": kind, "parameters": count,
            "shapes_sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}


def _elements(shape: object) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def step_of(name: str) -> int | None:
    """The step a step folder's name says (`step-000004-ab12` -> 4), or None."""
    found = _STEP.match(name)
    return int(found.group(1)) if found else None


def run_of(folder: Path) -> str | None:
    """The run id in a step folder's manifest; None when it has none or cannot be read
    (such a folder is never pruned)."""
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    run = manifest.get("run") if isinstance(manifest, dict) else None
    return run if isinstance(run, str) else None


def _summary(folder: Path) -> dict | None:
    """(run, model, step) of one step folder, read without any checking but the JSON."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(manifest, dict):
        return None
    return {"run": manifest.get("run") if isinstance(manifest.get("run"), str) else None,
            "model": manifest.get("model") if isinstance(manifest.get("model"), dict) else None,
            "step": step_of(folder.name), "name": folder.name}


def describe(model: dict) -> str:
    return f"--model {model.get('kind')}, {model.get('parameters')} parameters"


def ownership_problems(root: str | Path, run: str, model: dict, step: int,
                       flag: str = "--save") -> list[str]:
    """Why the run `run` (NEW_RUN for a fresh one) of `model` must not save step `step`
    into `root`: the folder holds another model's or another run's checkpoints, or a
    newer step of this run. A pure read of small JSON files: every rank alone agrees."""
    root = Path(root)
    if not root.is_dir():
        return []
    try:
        entries = sorted(p for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None)
    except OSError:
        return []
    found = [s for s in (_summary(p) for p in entries) if s is not None]
    for other in found:
        if other["model"] is not None and (
                other["model"].get("kind") != model["kind"]
                or other["model"].get("shapes_sha256") != model["shapes_sha256"]):
            return [f"{flag} {root}: holds {other['name']} of another model "
                    f"({describe(other['model'])}; this run: {describe(model)}), which its "
                    "--keep would delete: save into another folder"]
    for other in found:
        if other["run"] is not None and other["run"] != run:
            fix = ("resume from it (--resume) to continue that run, or save into another "
                   "folder") if run == NEW_RUN else "save into another folder"
            return [f"{flag} {root}: holds {other['name']} of another run (run "
                    f"{other['run']}; this is {'a new run' if run == NEW_RUN else 'run ' + run}"
                    f"): {fix}"]
    newer = [s for s in found if s["step"] is not None and s["step"] > step]
    if newer:
        top = max(newer, key=lambda s: s["step"])
        return [f"{flag} {root}: holds {top['name']}, newer than the step {step} this would "
                f"save (latest would move back): save into another folder"]
    return []
