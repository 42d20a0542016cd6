"""DiLoCo (`--outer diloco`, parallel/diloco.py) equals its one-process definition.

ONE mpiexec job of 4 ranks trains every config below (tests/harness/mpi.py `sweep`):
workers that are plain ranks (dp 4), tp x dp, pp x dp, cp x dp meshes; the MLP, the MoE
MLP without expert parallelism and the transformer; SGD, Adam and Muon inside; one and
several fragments; a --mixed bf16 run checked by `train --check`. Each is compared with
`train_reference` (K one-process workers and the outer Nesterov step, written plainly),
float64 at 1e-9; H = 1, eta = 1, mu = 0 with SGD with plain data parallelism's own
reference; and every step's dp lines of every rank with the ledger formula
(`diloco.dp_allreduce_elements`). The refusals are in tests/run/test_config_errors.py.

    python -m pytest tests/parallel/test_diloco.py
"""

from __future__ import annotations

import json
import re

import pytest

from minipar.parallel import diloco
from minipar.run.train import train_reference
from minipar.settings.config import TrainConfig
from tests.conftest import assert_equivalent, reference
from tests.harness.mpi import sweep
from tests.shapes import GPT

WORLD = 4
MLP = dict(layers=4, d_in=8, d_model=8, d_ff=16, classes=4, batch=16, check_placements=False)
OUTER = dict(outer="diloco", outer_lr=0.7, outer_momentum=0.9)
CONFIGS = [
    # H = 1, eta = 1, mu = 0, SGD: plain data parallelism
    dict(MLP, steps=3, dp=4, outer="diloco", inner_steps=1, outer_lr=1.0, outer_momentum=0.0),
    dict(MLP, **OUTER, steps=4, dp=2, tp=2, inner_steps=2, optimizer="adam", lr=0.01,
         microbatches=2),
    dict(MLP, **OUTER, steps=8, dp=2, pp=2, inner_steps=4, fragments=2, microbatches=2),
    dict(MLP, **OUTER, steps=8, dp=4, inner_steps=4, fragments=4, optimizer="adam", lr=0.01),
    dict(GPT, **OUTER, steps=4, dp=2, cp=2, inner_steps=2, fragments=2, optimizer="muon",
         lr=0.02, check_placements=False),
    dict(MLP, **OUTER, model="moe", experts=4, steps=4, dp=2, tp=2, inner_steps=2,
         optimizer="adam", lr=0.01),
]
PLAIN_DP = dict(MLP, steps=3, dp=4)   # beside them: plain DP's traffic, step by step
MIXED = ["train", "--model", "gpt", "--layers", "2", "--d-model", "16", "--heads", "4",
         "--seq-len", "8", "--vocab", "16", "--d-ff", "32", "--batch", "8", "--dp", "2",
         "--tp", "2", "--mixed", "bf16", "--optimizer", "adam", "--lr", "0.01", "--outer",
         "diloco", "--inner-steps", "2", "--fragments", "2", "--steps", "4", "--check"]


def label(fields: dict) -> str:
    mesh = " ".join(f"{a}={fields[a]}" for a in ("dp", "tp", "pp", "cp") if a in fields)
    return (f"{fields.get('model', 'mlp')} {mesh} {fields.get('optimizer', 'sgd')} "
            f"H={fields['inner_steps']} P={fields.get('fragments', 1)}")


# --save on dp 2 x tp 2 at step 4 (fragment 1 synced at step 3, its workers apart since),
# --resume on dp 2 x pp 2 to step 8 and --save again into the same folder, --check against
# the 8 steps in one process; a resume on --dp 4 refused by name
SAVED = ["train", "--layers", "4", "--d-model", "16", "--batch", "16", "--outer", "diloco",
         "--inner-steps", "2", "--fragments", "2", "--optimizer", "adam", "--lr", "0.01"]
SAVES = [[*SAVED, "--dp", "2", "--tp", "2", "--steps", "4", "--save", "{ck}"],
         [*SAVED, "--dp", "2", "--pp", "2", "--steps", "8", "--resume", "{ck}", "--save",
          "{ck}", "--check", "--ledger"],
         [*SAVED, "--dp", "4", "--steps", "10", "--resume", "{ck}"]]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Every config trained in one 4-rank job, then the command lines: --mixed, the
    checkpoints."""
    folder = tmp_path_factory.mktemp("diloco")
    saves = [{"cli": [str(folder / "ck") if a == "{ck}" else a for a in argv]}
             for argv in SAVES]
    return sweep(WORLD, CONFIGS + [PLAIN_DP, {"cli": MIXED}] + saves, folder, timeout=240)


def test_the_sweep_covers_meshes_models_optimizers_and_fragments():
    resolved = [TrainConfig(**c).resolved(WORLD) for c in CONFIGS]
    assert {a for c in resolved for a in ("tp", "pp", "cp") if getattr(c, a) > 1} == \
        {"tp", "pp", "cp"}
    assert {c.model for c in resolved} == {"mlp", "moe", "gpt"}
    assert {c.optimizer for c in resolved} == {"sgd", "adam", "muon"}
    assert {c.fragments for c in resolved} >= {1, 2, 4}
    assert all(c.outer == "diloco" and c.ep == 1 for c in resolved)


def test_every_config_equals_its_one_process_definition(swept):
    for fields, run in zip(CONFIGS, swept):
        ref = train_reference(TrainConfig(**fields).resolved(WORLD))
        assert_equivalent(run, ref, label=label(fields))


def test_h1_eta1_mu0_with_sgd_is_plain_data_parallelism(swept):
    fields = CONFIGS[0]
    plain = {k: v for k, v in fields.items()
             if k not in ("outer", "inner_steps", "outer_lr", "outer_momentum")}
    assert_equivalent(swept[0], reference(**plain), label="H=1 eta=1 mu=0 SGD vs DP")


def test_the_reference_is_not_data_parallelism_once_h_is_more_than_one():
    """The check above could pass by ignoring H: with H = 2 the definition differs from DP."""
    fields = dict(MLP, steps=4, dp=4, outer="diloco", inner_steps=2, outer_lr=1.0,
                  outer_momentum=0.0)
    ours = train_reference(TrainConfig(**fields).resolved(WORLD))
    plain = reference(**{k: v for k, v in fields.items()
                         if k not in ("outer", "inner_steps", "outer_lr", "outer_momentum")})
    assert max(abs(a - b) for a, b in zip(ours.losses, plain.losses)) > 1e-6


def test_every_step_s_dp_traffic_is_the_formula(swept):
    """Line by line, every rank, every step: one dp Allreduce per fragment due, of the
    elements the rank holds of it; nothing over dp on the other steps."""
    for fields, run in zip(CONFIGS, swept):
        cfg = TrainConfig(**fields).resolved(WORLD)
        folder = run["job_folder"]
        steps = json.loads((folder / "ledger_steps.json").read_text())
        sizes = json.loads((folder / "fragment_sizes.json").read_text())
        assert diloco.ledger_differences(steps, sizes, cfg.inner_steps, cfg.fragments,
                                         cfg.steps, 8) == [], label(fields)
        quiet = [s for s in range(1, cfg.steps + 1)
                 if not diloco.due(s, cfg.inner_steps, cfg.fragments)]
        assert not any(r["group"] == "dp" and r["step"] in quiet for r in steps)


def test_fragment_sizes_are_the_canonical_arrays(swept):
    """The formula's input, from the model alone: with workers of one rank each fragment's
    elements are its canonical arrays' sizes; on a pipeline, those of the stage's blocks
    (the embedding on the first, the head on the last)."""
    for fields, run in zip(CONFIGS, swept):
        cfg = TrainConfig(**fields).resolved(WORLD)
        if cfg.tp > 1 or cfg.cp > 1:
            continue
        shapes = {name: a.size for name, a in run["init"].items()}
        per_stage = cfg.layers // cfg.pp
        for rank, sizes in enumerate(json.loads(
                (run["job_folder"] / "fragment_sizes.json").read_text())):
            stage = cfg.mesh_shape().coords(rank)["pp"]
            want = [0] * cfg.fragments
            for name, size in shapes.items():
                block = re.match(r"blocks\.(\d+)\.", name)
                if block is None:
                    held = name.startswith("embed") and stage == 0 or \
                        name.startswith("head") and stage == cfg.pp - 1
                    where = 0
                else:
                    held = int(block.group(1)) // per_stage == stage
                    where = int(block.group(1)) // (cfg.layers // cfg.fragments)
                want[where] += size if held else 0
            assert sizes == want, (label(fields), rank)


def test_streaming_fragments_stagger_and_split_the_traffic():
    """P = 4, H = 4: fragment p syncs after steps p + 4, p + 8, ...; no step carries two."""
    assert [diloco.due(s, 4, 4) for s in range(1, 9)] == \
        [[], [], [], [0], [1], [2], [3], [0]]
    assert [diloco.dp_allreduce_elements([5, 1, 2, 3], 4, 1, s) for s in range(1, 9)] == \
        [0, 0, 0, 5, 0, 0, 0, 5]
    assert diloco.fragment_of("blocks.5.fc1.weight", 8, 4) == 2
    assert diloco.fragment_of("head.weight", 8, 4) == 0


def test_mixed_bf16_passes_check(swept):
    out = swept[len(CONFIGS) + 1]
    assert out["code"] == 0, out["out"]
    assert re.search(r"check against one process in bf16.*-> OK", out["out"]), out["out"]
    assert "ledger against the formulas: the dp Allreduce of every step" in out["out"]



def test_plain_dp_s_ledger_is_the_same_every_step(swept):
    """ledger_steps.json of plain DP: every step the last step's ledger (one gradient
    Allreduce of the whole model a step), what DiLoCo's steps are read beside."""
    run = swept[len(CONFIGS)]
    steps = json.loads((run["job_folder"] / "ledger_steps.json").read_text())
    assert run["ledger"] and any(r["group"] == "dp" for r in run["ledger"])
    for step in range(1, PLAIN_DP["steps"] + 1):
        mine = [{k: v for k, v in r.items() if k != "step"} for r in steps if r["step"] == step]
        assert mine == run["ledger"], step


def test_resume_on_another_mesh_continues_exactly(swept):
    """Theta, v and each worker's parameters and Adam state come back on another tp x pp
    mesh: the 8 steps (4 saved, 4 resumed) equal one process's 8; a second save into the
    same folder works; another --dp is refused by name, exit 2."""
    saved, resumed, other_dp = swept[-3:]
    assert saved["code"] == 0, saved["out"]
    assert resumed["code"] == 0, resumed["out"]
    assert re.search(r"check against one process: .* -> OK", resumed["out"]), resumed["out"]
    assert "the dp Allreduce of every step on 4 ranks as" in resumed["out"], resumed["out"]
    assert "dp: the outer step's Allreduce of the fragments due" in resumed["out"]
    assert other_dp["code"] == 2, other_dp["out"]
    assert "saved by 2 workers (--dp 2), this run has --dp 4" in other_dp["out"]
