"""Lesson 8's bugs (minipar/bugs/catalog.py): every injected bug is caught, and without one nothing
is.

- Without MPI: the registry (at least 8 bugs, each explained), `python -m minipar
  bugs`, `train.problems` refusing an unknown name and a bug whose strategy the
  mesh does not use (one line naming --inject-bug), accepting each bug's own flags;
  `injected` puts back what it swapped, even after an error.
- ONE sweep on 4 ranks (tests.harness.mpi.sweep): each bug's run and the correct run of the
  same mesh against the single-process reference (conftest). Every bug's run fails
  `assert_equivalent` -- the suite would catch it -- except tp-plain-linear, whose
  numbers are right and whose ledger lacks every tp Allreduce; every correct run
  passes. After ONE step, the tensors that differ are the ones the explanation names.
- The lesson, `--quick` on 4 ranks (one more launch): every bug caught, the replica
  check firing exactly for the bugs that split replicas, the correct runs clean; then
  the three 16-bit bugs, each caught by the check the catalog names, their correct runs
  within the derived tolerance.

    python -m pytest tests/bugs/test_bugs.py
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from minipar.__main__ import main
from minipar.bugs import catalog, detours
from minipar.core import nn
from minipar.run.train import problems
from minipar.settings.config import TrainConfig
from minipar.settings.flags import config_from_args, make_parser
from tests.conftest import assert_equivalent, reference
from tests.harness.mpi import LESSON_FLAGS, lesson_run, sweep

WORLD = 4
SMALL = dict(layers=4, d_in=8, d_model=16, batch=16, steps=2)
SMALL_MOE = dict(SMALL, experts=4, top_k=2, expert_d_ff=16)
SMALL_GPT = dict(layers=2, d_model=16, batch=8, seq_len=8, vocab=16, steps=2)
# bugs whose run keeps the dp/tp copies of a parameter equal (the same mistake everywhere)
SPLITS_REPLICAS = {"tp-copy-to-no-allreduce", "dp-stage-not-synced", "zero-no-allgather",
                   "moe-bias-local-load"}


def fields(bug: catalog.Bug, **changes: object) -> dict:
    """The TrainConfig fields of `bug`'s demo run on the small model."""
    sizes = {"moe": SMALL_MOE, "gpt": SMALL_GPT}.get(bug.flags.get("model"), SMALL)
    return {**sizes, **bug.flags, **changes}


def ref_of(config: dict) -> object:
    return reference(**{k: v for k, v in config.items() if k != "inject_bug"})


# ------------------------------------------------------------ without MPI
def test_registry_has_at_least_eight_explained_bugs():
    assert len(catalog.BUGS) >= 8
    for name, bug in catalog.BUGS.items():
        assert name == bug.name and re.fullmatch(r"[a-z0-9-]+", name)
        assert bug.strategy in ("dp", "tp", "pp", "ep", "zero", "cp"), name
        assert len(bug.broken) > 30 and len(bug.why) > 60 and bug.requires, name


def test_bugs_command_lists_every_bug_with_a_command(capsys):
    assert main(["bugs"]) == 0
    out = capsys.readouterr().out
    for name, bug in catalog.BUGS.items():
        assert f"--inject-bug {name} --check" in out and bug.broken in out


def config(world: int = WORLD, *flags: str) -> TrainConfig:
    args = make_parser().parse_args(["--layers", "4", "--d-model", "16", "--batch", "16",
                                     *flags])
    return config_from_args(args).resolved(world)


def test_an_unknown_bug_is_refused_in_one_line_naming_the_choices():
    errors = problems(config(WORLD, "--inject-bug", "off-by-one"), WORLD)
    assert len(errors) == 1 and errors[0].startswith("--inject-bug off-by-one")
    assert all(name in errors[0] for name in catalog.BUGS) and "\n" not in errors[0]


@pytest.mark.parametrize("flags,name", [
    (["--dp", "4"], "tp-copy-to-no-allreduce"),                       # tp = 1
    (["--tp", "2", "--sp"], "tp-plain-linear"),                       # sequence parallel
    (["--tp", "4"], "dp-sum-not-mean"),                               # dp = 1
    (["--dp", "4", "--zero", "1"], "dp-sum-not-mean"),                # ZeRO, not plain DP
    (["--dp", "4"], "dp-stage-not-synced"),                           # no pipeline
    (["--pp", "2", "--dp", "2"], "pp-one-input-buffer"),              # one microbatch
    (["--dp", "4"], "moe-aux-per-rank"),                              # a dense model
    (["--model", "moe", "--dp", "4"], "moe-aux-after-capacity"),      # no capacity
    (["--dp", "4"], "zero-no-allgather"),                             # --zero 0
    (["--dp", "4", "--zero", "3"], "zero-no-allgather"),              # stage 3
    (["--dp", "4", "--zero", "2"], "muon-per-microbatch"),            # not Muon
    (["--dp", "4", "--optimizer", "muon"], "muon-flat-shard-is-1d"),  # --zero 0
    (["--tp", "2", "--optimizer", "muon"], "muon-tp-local-shard"),    # layer-sharded
])
def test_a_bug_the_mesh_cannot_show_is_refused(flags, name):
    errors = problems(config(WORLD, *flags, "--inject-bug", name), WORLD)
    assert errors == [f"--inject-bug {name} needs {catalog.BUGS[name].requires}"]


@pytest.mark.parametrize("name", list(catalog.BUGS))
def test_each_bug_fits_its_own_flags(name):
    cfg = TrainConfig(**fields(catalog.BUGS[name], inject_bug=name)).resolved(WORLD)
    assert problems(cfg, WORLD) == []
    assert problems(replace(cfg, inject_bug=None), WORLD) == []


def test_injected_puts_the_originals_back_even_after_an_error():
    from minipar.parallel import tensor_parallel

    original = tensor_parallel.copy_to
    with pytest.raises(RuntimeError), catalog.injected("tp-copy-to-no-allreduce"):
        assert tensor_parallel.copy_to is detours.copy_to_without_allreduce
        raise RuntimeError("a failing run")
    assert tensor_parallel.copy_to is original


# ------------------------------------------------------ one sweep, 4 ranks
def sweep_configs() -> list[tuple[str, dict]]:
    """(label, fields): each bug's run, its one-step run, and the correct run of each mesh."""
    out, clean = [], {}
    for name, bug in catalog.BUGS.items():
        # the numbers of a broken run, so its placements go unchecked here (a placement
        # bug would stop it): tests/bugs/test_bugs_placement.py checks those
        out.append((name, fields(bug, inject_bug=name, check_placements=False)))
        out.append((f"{name} one step", fields(bug, inject_bug=name, steps=1,
                                               check_placements=False)))
        clean.setdefault(json.dumps(fields(bug), sort_keys=True), fields(bug))
    return out + [(f"correct {i}", c) for i, c in enumerate(clean.values())]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """label -> (the run's dump, its config fields), all from one mpiexec job."""
    configs = sweep_configs()
    dumps = sweep(WORLD, [c for _, c in configs], tmp_path_factory.mktemp("bugs"))
    return {label: (dump, c) for (label, c), dump in zip(configs, dumps)}


@pytest.mark.parametrize("name", [n for n in catalog.BUGS if n != "tp-plain-linear"])
def test_each_bug_fails_the_equivalence_check(runs, name):
    run, config = runs[name]
    with pytest.raises(AssertionError):
        assert_equivalent(run, ref_of(config), label=name)


def test_the_correct_runs_of_the_same_meshes_pass(runs):
    labels = [label for label in runs if label.startswith("correct")]
    assert len(labels) >= 6
    for label in labels:
        run, config = runs[label]
        assert_equivalent(run, ref_of(config), label=f"{label} {config}")


def tp_allreduces(run: dict) -> dict[int, tuple[int, int]]:
    """rank -> (calls, elements) of Allreduce on the tp axis in the last step."""
    return {r["rank"]: (r["calls"], r["elements"]) for r in run["ledger"]
            if r["group"] == "tp" and r["op"] == "Allreduce"}


def test_plain_linears_pass_the_equivalence_check_and_the_ledger_catches_them(runs):
    run, config = runs["tp-plain-linear"]
    assert_equivalent(run, ref_of(config), label="plain linears compute the right numbers")
    correct = next(r for label, (r, c) in runs.items()
                   if label.startswith("correct") and c == fields(catalog.BUGS["tp-plain-linear"]))
    rows = SMALL["batch"] // (WORLD // 2)                 # B/dp rows, M = 1
    blocks = SMALL["layers"]
    assert tp_allreduces(correct) == {r: (2 * blocks, 2 * blocks * rows * SMALL["d_model"])
                                      for r in range(WORLD)}  # Megatron: 2 per block
    assert tp_allreduces(run) == {}  # tensor parallelism never happened
    dp_elements = {r["rank"]: r["elements"] for r in run["ledger"] if r["group"] == "dp"}
    full = sum(int(np.prod(s)) for s in nn.canonical_shapes(
        TrainConfig(**config).resolved(WORLD).model_config()).values())
    assert dp_elements == {r: full for r in range(WORLD)}  # every rank syncs the full model


def differing_after_one_step(runs: dict, name: str) -> set[str]:
    run, config = runs[f"{name} one step"]
    ref = ref_of(config)
    return {k for k, v in ref.final.items()
            if np.max(np.abs(run["final"][k] - v)) > 1e-9 * max(np.max(np.abs(v)), 1e-12)}


def names(prefixes: tuple[str, ...], model: str = "mlp") -> set[str]:
    cfg = TrainConfig(**(SMALL_MOE if model == "moe" else SMALL), model=model).resolved(1)
    return {n for n in nn.canonical_shapes(cfg.model_config()) if n.startswith(prefixes)}


def test_one_step_damage_is_where_the_explanations_say(runs):
    last = f"blocks.{SMALL['layers'] - 1}."
    assert differing_after_one_step(runs, "pp-one-input-buffer") == {"embed.weight"}
    tp = differing_after_one_step(runs, "tp-copy-to-no-allreduce")
    assert tp == names(("embed.", "blocks.")) - names((last + "fc",))  # last fc1/fc2 right
    stage = differing_after_one_step(runs, "dp-stage-not-synced")
    assert stage == names(("blocks.2.", "blocks.3.", "head."))  # the last pipeline stage
    routers = {f"blocks.{i}.router.weight" for i in range(SMALL["layers"])}
    for aux in ("moe-aux-first-choice", "moe-aux-after-capacity", "moe-aux-per-rank"):
        found = differing_after_one_step(runs, aux)
        assert routers <= found, aux                                  # the aux reaches them
        assert not found & names((last + "experts",), "moe"), aux    # above every router
    zero = differing_after_one_step(runs, "zero-no-allgather")
    assert "embed.weight" not in zero and "head.weight" in zero  # rank 0's slice is the front


def muon_traffic(run: dict) -> tuple[int, int]:
    """(elements of Muon's pieces sent over the world, Allreduce calls over tp), summed
    over the ranks, in the last step."""
    return (sum(r["elements"] for r in run["ledger"]
                if r["op"] == "Isend" and r["group"] == "world"),
            sum(r["calls"] for r in run["ledger"]
                if r["op"] == "Allreduce" and r["group"] == "tp"))


def test_the_muon_bugs_are_named_by_the_ledger(runs):
    """Beside the equivalence check, the ledger names four of the five Muon bugs: the
    pieces sent once per microbatch (twice the correct run's), never sent (matrices
    taken for vectors; unreduced slices orthogonalized alone), the Gram Allreduces over
    tp missing (1 + ns_steps per matrix); skipping Newton-Schulz moves the same bytes."""
    def pair(name: str) -> tuple[tuple[int, int], tuple[int, int]]:
        run, config = runs[name]
        correct = next(r for label, (r, c) in runs.items()
                       if label.startswith("correct") and c == fields(catalog.BUGS[name]))
        return muon_traffic(run), muon_traffic(correct)
    bug, correct = pair("muon-per-microbatch")
    assert bug[0] == 2 * correct[0] > 0
    for name in ("muon-flat-shard-is-1d", "muon-unreduced-slice"):
        bug, correct = pair(name)
        assert bug[0] == 0 < correct[0], name
    bug, correct = pair("muon-tp-local-shard")
    matrices = 2 * SMALL["layers"]                      # fc1, fc2 of each block
    assert correct[1] - bug[1] == WORLD * matrices * (1 + 5)   # on every rank
    bug, correct = pair("muon-no-orthogonalization")
    assert bug == correct


# ------------------------------------------------------------- the lesson
def test_lesson_08_catches_every_bug_and_passes_every_correct_run():
    job, folder = lesson_run(WORLD, "08_bugs.py", "--quick", *LESSON_FLAGS["08_bugs.py"])
    assert job.returncode == 0 and not job.timed_out, job.explain()   # test_lessons' run
    found = json.loads((folder / "findings.json").read_text())
    assert set(found) == set(catalog.BUGS) | set(catalog.MIXED_BUGS)
    mixed = {name: found.pop(name) for name in catalog.MIXED_BUGS}
    for name, result in found.items():
        assert result["caught_by"], f"{name} was not caught"
        assert ("replicas" in result["caught_by"]) == (name in SPLITS_REPLICAS), name
        assert result["correct_loss_rel"] <= 1e-9 and result["correct_param_rel"] <= 1e-9
        assert result["correct_replicas"] == [], name
        assert f"{name} [" in job.stdout and name in job.stdout
        # the placements column: a placement error is stopped, a bug about values is not
        assert ("placements" in result["caught_by"]) == (not catalog.BUGS[name].unseen), name
    assert found["tp-plain-linear"]["caught_by"] == ["ledger", "memory"]
    assert "caught by: NOTHING" not in job.stdout
    # the 16-bit bugs: each correct run within the derived tolerance, with one process's S
    for name, result in mixed.items():
        correct = result["correct"]
        assert correct["loss_rel"] <= result["loss_tol"], name
        assert correct["moved"] <= result["param_tol"], name
        assert [correct["S"], correct["skipped"]] == result["one_process_S"], name
        assert "16-bit" in job.stdout and f"{name} [" in job.stdout
    assert mixed["mp-found-inf-per-rank"]["caught_by"] == ["replicas"]
    assert "loss scale S" in mixed["mp-found-inf-per-rank"]["replicas"]
    assert mixed["mp-no-master-weights"]["caught_by"] == ["parameters"]
    assert mixed["mp-tp-partials-in-bf16"]["caught_by"] == ["ledger"]
    assert any(line.startswith("tp Allreduce:") for line in
               mixed["mp-tp-partials-in-bf16"]["ledger"])


def test_every_bug_says_where_it_shipped_or_that_it_is_plausible():
    """Each bug cites a public issue or pull request (owner/repo#N) of a real project, or
    says plainly that no shipped case was found."""
    for bug in [*catalog.BUGS.values(), *catalog.MIXED_BUGS.values()]:
        cited = re.search(r"\b[\w.-]+/[\w.-]+#\d+", bug.seen)
        assert cited or bug.seen.startswith("plausible"), (bug.name, bug.seen)
