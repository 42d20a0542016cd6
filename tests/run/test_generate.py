"""`python -m minipar generate` (docs/design.md, "Inference"): prefill and decode with a
KV cache on every mesh of 4 ranks and a 3-D mesh of 8, greedy and sampled, equal to one
process's full forward of every prefix (float64, 1e-9); the decode step's ledger and the
cache's bytes per rank equal their formulas; a checkpoint saved on one mesh generates the
same on others; bad input is one line and exit 2.

All the mesh runs are two mpiexec jobs (tests/harness/rank_generate.py loops over them).

    python -m pytest -q tests/run/test_generate.py
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minipar.parallel import kvcache
from minipar.run.decode import (
    choose,
    decode_ledger,
    dispatched_elements,
    gumbel,
    reference,
    scores,
)
from minipar.run.generate import config_from_args, full_params, make_parser
from minipar.run.results import relative_difference
from minipar.settings.config import ConfigError
from tests.harness.mpi import ROOT, launch

RTOL = 1e-9
MODEL = ["--layers", "4", "--d-model", "16", "--heads", "4", "--vocab", "32",
         "--seq-len", "16"]
MOE = ["--model", "gpt-moe", "--experts", "4", "--top-k", "2"]
PROMPT = ["--prompt-ids", "3,1,4,1", "--batch", "4", "--new-tokens", "5"]
SAMPLED = ["--temperature", "0.8", "--seed", "7"]
MESHES_OF_4 = {  # every strategy alone and in pairs; ep through gpt-moe
    "tp4": ["--tp", "4"], "pp4": ["--pp", "4"], "cp4": ["--cp", "4"],
    "ep4": [*MOE, "--dp", "4", "--ep", "4"],
    "tp2-pp2": ["--tp", "2", "--pp", "2"], "tp2-cp2": ["--tp", "2", "--cp", "2"],
    "pp2-cp2": ["--pp", "2", "--cp", "2"],
    "tp2-ep2": [*MOE, "--tp", "2", "--dp", "2", "--ep", "2"],
    "pp2-ep2": [*MOE, "--pp", "2", "--dp", "2", "--ep", "2"],
    "cp2-ep2": [*MOE, "--cp", "2", "--dp", "2", "--ep", "2"],
}
MESHES_OF_8 = {
    "tp2-pp2-cp2": ["--tp", "2", "--pp", "2", "--cp", "2"],
    "tp2-pp2-cp2-sampled": ["--tp", "2", "--pp", "2", "--cp", "2", *SAMPLED],
    "moe-dp2-ep2-tp2-pp2-sampled": [*MOE, "--dp", "2", "--ep", "2", "--tp", "2",
                                    "--pp", "2", *SAMPLED],
}
SAVED = {"model": "gpt", "layers": 4, "d_model": 16, "heads": 4, "vocab": 32,
         "seq_len": 16, "batch": 4, "steps": 2, "optimizer": "adam", "lr": 0.01,
         "tp": 2, "pp": 2}
RESUMED = {"resumed-pp2-cp2": ["--pp", "2", "--cp", "2"],
           "resumed-tp4": ["--tp", "4"], "resumed-dp2-tp2": ["--dp", "2", "--tp", "2"]}


def runs_of(n: int, root: Path) -> tuple[list[dict], dict[str, list[str]]]:
    """The job's run list and {label: generate flags} of its generate runs, in order."""
    labelled: dict[str, list[str]] = {}
    runs: list[dict] = []
    if n == 4:
        runs.append({"train": dict(SAVED, save=str(root / "gpt"))})
        runs.append({"train": {"model": "mlp", "layers": 2, "d_model": 8, "d_in": 4,
                               "batch": 4, "steps": 1, "save": str(root / "mlp")}})
        for label, mesh in MESHES_OF_4.items():
            labelled[label] = [*MODEL, *PROMPT, *mesh]
            labelled[label + "-sampled"] = [*MODEL, *PROMPT, *mesh, *SAMPLED]
        for label, mesh in RESUMED.items():
            labelled[label] = ["--resume", str(root / "gpt"), "--prompt-ids", "5,9,2,7",
                               "--batch", "2", "--new-tokens", "6", *mesh]
    else:
        labelled = {label: [*MODEL, *PROMPT, *mesh] for label, mesh in MESHES_OF_8.items()}
    runs += [{"generate": flags} for flags in labelled.values()]
    return runs, labelled


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Both mpiexec jobs; {label: (n, flags, tokens, logits, report)} and the folder."""
    root = tmp_path_factory.mktemp("generate")
    out = {}
    for n in (4, 8):
        runs, labelled = runs_of(n, root)
        folder = root / f"job{n}"
        folder.mkdir()
        (folder / "runs.json").write_text(json.dumps(runs))
        job = launch(n, ["-m", "tests.harness.rank_generate", str(folder / "runs.json"),
                         str(folder)], timeout=240)
        assert job.returncode == 0 and not job.timed_out, job.explain()
        first = len(runs) - len(labelled)
        for i, (label, flags) in enumerate(labelled.items(), start=first):
            with np.load(folder / str(i) / "result.npz") as result:
                report = json.loads((folder / str(i) / "report.json").read_text())
                out[label] = (n, flags, result["tokens"], result["logits"], report)
    return out, root


def parsed(flags: list[str], n: int):
    gcfg, errors = config_from_args(make_parser().parse_args(flags), n)
    assert not errors, errors
    return gcfg


@functools.cache
def expected(flags: tuple[str, ...], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The one-process tokens and logits (no cache) of a run, computed once."""
    gcfg = parsed(list(flags), n)
    return reference(gcfg, full_params(gcfg.train))


LABELS = [*(f"{m}{s}" for m in MESHES_OF_4 for s in ("", "-sampled")), *MESHES_OF_8,
          *RESUMED]


@pytest.mark.parametrize("label", LABELS)
def test_mesh_generates_what_one_process_does_without_a_cache(jobs, label):
    n, flags, tokens, logits, _ = jobs[0][label]
    gcfg = parsed(flags, n)
    expected_tokens, expected_logits = expected(tuple(flags), n)
    assert np.array_equal(tokens, expected_tokens), (label, tokens, expected_tokens)
    assert logits.shape == (gcfg.new_tokens, gcfg.train.batch, gcfg.train.vocab)
    assert relative_difference(logits, expected_logits) <= RTOL, label


def test_sampled_runs_draw_other_tokens_per_row(jobs):
    """Sampling is not greedy, and each row draws its own stream (same prompt, B rows)."""
    greedy, sampled = jobs[0]["tp4"][2], jobs[0]["tp4-sampled"][2]
    assert not np.array_equal(greedy, sampled)
    assert len({tuple(row) for row in sampled}) > 1
    assert len({tuple(row) for row in greedy}) == 1   # greedy: every copy the same


def test_a_checkpoint_saved_on_one_mesh_generates_the_same_on_others(jobs):
    runs = jobs[0]
    base_tokens, base_logits = runs["resumed-pp2-cp2"][2:4]
    for label in RESUMED:
        assert np.array_equal(runs[label][2], base_tokens), label
        assert relative_difference(runs[label][3], base_logits) <= RTOL, label
    # and the saved model is the trained one, not a fresh draw of the same seed
    fresh = parsed([*MODEL, "--prompt-ids", "5,9,2,7", "--batch", "2", "--new-tokens", "6"], 1)
    assert relative_difference(reference(fresh, full_params(fresh.train))[1],
                               base_logits) > 1e-6


@pytest.mark.parametrize("label", LABELS)
def test_decode_ledger_equals_its_formula(jobs, label):
    n, flags, _, _, report = jobs[0][label]
    gcfg = parsed(flags, n)
    shape = gcfg.train.mesh_shape()
    for rank in range(n):
        seen = {(r["group"], r["op"]): (r["calls"], r["elements"])
                for r in report["ledger"] if r["rank"] == rank and r["calls"]}
        formula = decode_ledger(gcfg, shape.coords(rank)["pp"])
        assert set(seen) == set(formula), (label, rank, seen, formula)
        for key, (calls, elements) in formula.items():   # None: the router decides
            assert seen[key][0] == calls and elements in (None, seen[key][1]), (label, key)
    if gcfg.train.ep > 1:   # what the combines return, summed, is what was dispatched
        moved = sum(r["elements"] for r in report["ledger"] if r["op"] == "Alltoallv")
        assert moved == 2 * n * dispatched_elements(gcfg), label


@pytest.mark.parametrize("label", LABELS)
def test_cache_bytes_per_rank_equal_the_formula(jobs, label):
    n, flags, _, _, report = jobs[0][label]
    cfg = parsed(flags, n).train
    P, N = 4, (6 if label.startswith("resumed") else 5)
    for m in report["memory"]:
        cp_rank = cfg.mesh_shape().coords(m["rank"])["cp"]
        positions = P // cfg.cp + len(range(cp_rank, N - 1, cfg.cp))  # prompt, decoded
        by_hand = (2 * (cfg.layers // cfg.pp) * (cfg.batch // cfg.dp) * (cfg.heads // cfg.tp)
                   * positions * (cfg.d_model // cfg.heads) * 8)
        assert m["cache_bytes"] == by_hand == m["formula"], (label, m)


def test_the_cp_merge_is_the_softmax_over_all_keys():
    """Attention to two halves of the keys alone, merged by log-sum-exp, is attention to
    all of them (and a part no query may see changes nothing)."""
    rng = np.random.default_rng(0)
    Q, K, V = (rng.normal(size=(2, 3, 1, 4)), rng.normal(size=(2, 3, 6, 4)),
               rng.normal(size=(2, 3, 6, 4)))
    q_pos, k_pos = np.array([4]), np.arange(6)
    whole, _ = kvcache.attend(Q, K, V, q_pos, k_pos)
    parts = [kvcache.attend(Q, K[:, :, s], V[:, :, s], q_pos, k_pos[s])
             for s in (slice(0, 3), slice(3, 6))]
    merged = kvcache.merge(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    assert np.allclose(merged, whole, rtol=1e-12, atol=1e-14)
    assert not np.allclose(parts[0][0], whole)   # one half alone is not the answer
    assert np.isfinite(parts[1][1]).all()        # keys 3, 4 seen (5 is after the query)
    empty = kvcache.attend(Q, K[:, :, 5:], V[:, :, 5:], q_pos, k_pos[5:])
    assert np.all(empty[0] == 0) and np.all(np.isneginf(empty[1]))


def test_gumbel_max_is_a_draw_from_the_softmax():
    """argmax(logits / t + g) picks token v with probability softmax(logits / t)_v."""
    logits, t, draws = np.array([1.0, 0.0, -1.0, 2.0]), 0.7, 20000
    picks = np.concatenate([choose(scores(np.tile(logits, (100, 1)), t,
                                          gumbel(3, step, 100, 4)), 0)
                            for step in range(draws // 100)])
    expected = np.exp(logits / t) / np.exp(logits / t).sum()
    assert np.abs(np.bincount(picks, minlength=4) / draws - expected).max() < 0.015


def refusal(flags: list[str]) -> str:
    try:
        gcfg, errors = config_from_args(make_parser().parse_args(flags), 1)
    except ConfigError as error:
        return str(error)
    assert errors, flags
    return errors[0]


def test_bad_input_is_refused_with_its_reason(jobs):
    root = jobs[1]
    assert "more than --seq-len 16" in refusal([*MODEL, "--prompt-ids", ",".join(["1"] * 17)])
    assert "runs past --seq-len 16" in refusal([*MODEL, "--prompt-ids", "1,2",
                                                "--new-tokens", "15"])
    assert "--model mlp checkpoint" in refusal(["--resume", str(root / "mlp"),
                                               "--prompt-ids", "1"])
    assert "outside the vocabulary 0..31" in refusal([*MODEL, "--prompt", "hi"])
    assert "outside the vocabulary" in refusal([*MODEL, "--prompt-ids", "1,32"])
    assert "--temperature must be 0" in refusal([*MODEL, "--prompt-ids", "1",
                                                 "--temperature", "-0.5"])
    assert "comma-separated" in refusal(["--prompt-ids", "1,x"])
    assert "dropless" in refusal([*MOE, "--prompt-ids", "1", "--capacity-factor", "1"])


def run_command(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minipar", "generate", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_command_refuses_in_one_line_and_dumps_what_design_says(tmp_path):
    bad = run_command(*MODEL, "--prompt-ids", "1,2", "--temperature", "-1")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("minipar: error: ")
    good = run_command(*MODEL, "--prompt-ids", "1,2,3", "--batch", "2", "--new-tokens", "4",
                       "--temperature", "1", "--check", "--dump", str(tmp_path))
    assert good.returncode == 0, good.stderr
    assert "-> OK" in good.stdout
    tokens = json.loads((tmp_path / "tokens.json").read_text())
    assert tokens["prompt"] == [[1, 2, 3]] * 2 and np.shape(tokens["generated"]) == (2, 4)
    with np.load(tmp_path / "logits.npz") as logits, np.load(tmp_path / "params.npz") as p:
        assert logits["logits"].shape == (4, 2, 32)
        assert p["head.weight"].shape == (16, 32)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["new_tokens"] == 4 and saved["prompt"] == [1, 2, 3] and saved["tp"] == 1
