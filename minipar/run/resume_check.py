"""Whether `--check` after `--resume` compares like with like: `check_problems`, before any step.

What this file teaches: the reference of `--check` is one process trained from step 0
with *this* run's flags, so a resumed run may be checked only when every flag that
shapes the numbers (--lr, --clip-grad-norm, Muon's --momentum, ...) is the checkpoint's.
`LAYOUT_FLAGS` are the ones it may change freely: the mesh and its layout (every layout
is proven equal to one process) and where files go. A run that differs elsewhere is
refused in one line that says both values as the command line spells them (`spelled`):

    --check after --resume reruns one process from step 0 with this run's flags, but this
    run has --lr 0.01 where the checkpoint was trained with --lr 0.05; ...

The comparison itself is results.py's `check`.
"""

from __future__ import annotations

from pathlib import Path

from minipar.settings.config import TrainConfig

# The flags `--check` may differ in from the saved run without changing its numbers: the
# mesh and how it is laid out (every layout is proven equal to one process), and where
# files go. Every other flag of a resumed run (--lr, --clip-grad-norm, Muon's --momentum,
# --nesterov, --ns-steps, --weight-decay, the FP8 recipe, ...) shapes the numbers, and the
# reference of `--check` reruns one process from step 0 with this run's values.
LAYOUT_FLAGS = frozenset((
    "dp", "tp", "pp", "ep", "cp", "schedule", "virtual", "zero", "grad_sync", "bucket_size",
    "sp", "microbatches", "vocab_parallel", "recompute", "cp_mode", "muon_mode",
    "fp8_allgather", "save", "resume", "keep", "timeout", "trace", "check_placements",
    "inject_bug", "steps", "data"))


def check_problems(cfg: TrainConfig) -> list[str]:
    """Why `--check` could not compare like with like, before any step: a run resumed
    with a flag that shapes the numbers set otherwise than the checkpoint's (it may
    continue so without --check, e.g. with a new --lr). The one-process reference starts
    at step 0 with this run's flags: the steps before the checkpoint were taken with the
    saved ones, and the verdict would be a MISMATCH that names nothing."""
    if not cfg.resume:
        return []
    from minipar.checkpoint.save_load import diloco_folders  # the layer below, when used
    from minipar.checkpoint.shard_files import CheckpointError, read_manifest

    # an --outer diloco checkpoint keeps the run's own flags in its "outer" part
    folder = diloco_folders(cfg.resume, cfg.dp)["outer"] if cfg.outer else Path(cfg.resume)
    try:
        saved = read_manifest(folder).get("config", {})
    except CheckpointError as error:   # said as a refusal, not a traceback
        return [f"--resume {cfg.resume}: {error}"]
    for name, mine in cfg.as_json().items():
        if name in LAYOUT_FLAGS or name not in saved or saved[name] == mine:
            continue
        return [f"--check after --resume reruns one process from step 0 with this run's "
                f"flags, but this run has {spelled(name, mine)} where the checkpoint was "
                f"trained with {spelled(name, saved[name])}; resume with "
                f"{spelled(name, saved[name])} to check, or without --check to continue with "
                "the new value"]
    return []


def spelled(name: str, value: object) -> str:
    """A flag and its value as the command line says it: --lr 0.01, --no-nesterov,
    no --clip-grad-norm (a flag left out)."""
    flag = f"--{name.replace('_', '-')}"
    if value is None:
        return f"no {flag}"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value}"
