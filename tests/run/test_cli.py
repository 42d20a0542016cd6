"""The `python -m minipar train` contract of docs/design.md ("The train command"), on one process.

`--dump DIR` writes init/final params, the data, the losses, every flag and the
ledger, and they equal the in-process reference; `--check` says OK; a bad
setting is one `minipar: error:` line on stderr and exit code 2, never a
traceback. The command runs in a subprocess with a timeout (`tests.harness.mpi`): the
pytest process never imports `mpi4py.MPI`.

    python -m pytest tests/run/test_cli.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from minipar.run.reference import step_batch
from minipar.run.train import train_reference
from minipar.settings.config import TrainConfig
from tests.conftest import assert_equivalent
from tests.harness.mpi import ROOT, minipar, read_dump

FLAG_NAMES = ["model", "layers", "d_in", "d_model", "d_ff", "classes", "experts", "top_k",
              "expert_d_ff", "capacity_factor", "aux_coef", "batch", "microbatches", "steps",
              "lr", "optimizer", "seed", "dtype", "dp", "tp", "pp", "ep", "schedule",
              "virtual", "zero", "vocab", "seq_len", "heads", "data"]

RUNS = {
    "mlp": {"layers": 2, "d_in": 6, "d_model": 16, "batch": 8, "steps": 3, "lr": 0.02,
            "optimizer": "adam", "microbatches": 2, "seed": 4},
    "gpt": {"model": "gpt", "layers": 2, "d_model": 16, "heads": 2, "seq_len": 6, "vocab": 12,
            "batch": 4, "steps": 3, "optimizer": "adam", "lr": 0.01, "microbatches": 2},
    "gpt-text": {"model": "gpt-moe", "layers": 2, "d_model": 16, "heads": 4, "seq_len": 10,
                 "data": str(ROOT / "README.md"), "experts": 4, "top_k": 1,
                 "capacity_factor": 1.0, "batch": 4, "steps": 2},
    "moe": {"model": "moe", "layers": 2, "d_in": 6, "d_model": 16, "experts": 4, "top_k": 2,
            "capacity_factor": 0.75, "aux_coef": 0.05, "batch": 8, "steps": 3},
}


def as_flags(fields: dict) -> list[str]:
    return [part for name, value in fields.items()
            for part in (f"--{name.replace('_', '-')}", str(value))]


@pytest.fixture(scope="module", params=sorted(RUNS))
def dumped(request, tmp_path_factory):
    """One `train --dump DIR --check` run per model, and the fields it was given."""
    fields = RUNS[request.param]
    folder = tmp_path_factory.mktemp(f"dump_{request.param}")
    job = minipar(1, ["train", *as_flags(fields), "--dump", str(folder), "--check"], 120)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    return fields, folder, job


def test_dump_writes_every_file(dumped):
    _, folder, _ = dumped
    names = {"init.npz", "final.npz", "data.npz", "losses.json", "config.json", "ledger.json"}
    assert names <= {p.name for p in folder.iterdir()}


def test_dump_equals_the_reference(dumped):
    fields, folder, _ = dumped
    cfg = TrainConfig(**fields).resolved(1)
    ref = train_reference(cfg)
    run = read_dump(folder)
    assert list(run["init"]) == list(ref.init)              # canonical names and order
    for name, value in ref.init.items():
        assert np.array_equal(run["init"][name], value), name
    assert isinstance(run["losses"], list) and len(run["losses"]) == cfg.steps
    assert all(isinstance(v, float) for v in run["losses"])
    assert_equivalent(run, ref, label="--dump")
    with np.load(folder / "data.npz") as data:
        x, y = data["x"], data["y"]
    if cfg.model.startswith("gpt"):     # token ids, x and y both (S, B, T)
        assert x.shape == y.shape == (cfg.steps, cfg.batch, cfg.seq_len)
        assert x.dtype.kind == y.dtype.kind == "i" and x.max() < cfg.vocab
    else:
        assert x.shape == (cfg.steps, cfg.batch, cfg.d_in) and y.shape == (cfg.steps, cfg.batch)
    for step in range(cfg.steps):
        expect_x, expect_y = step_batch(cfg, step)
        assert np.array_equal(x[step], expect_x) and np.array_equal(y[step], expect_y)


def test_dump_config_has_every_flag(dumped):
    fields, folder, _ = dumped
    written = json.loads((folder / "config.json").read_text())
    assert set(FLAG_NAMES) <= set(written), set(FLAG_NAMES) - set(written)
    resolved = TrainConfig(**fields).resolved(1)
    for name in FLAG_NAMES:
        assert written[name] == getattr(resolved, name), name
    assert written["dp"] == 1 and written["d_ff"] == 4 * fields["d_model"]


def test_dump_ledger_records(dumped):
    _, folder, _ = dumped
    ledger = json.loads((folder / "ledger.json").read_text())
    assert isinstance(ledger, list)
    keys = {"rank", "op", "group", "calls", "elements", "bytes"}
    assert all(set(record) == keys for record in ledger), ledger[:3]
    assert all(record["rank"] == 0 for record in ledger)     # a single rank


def test_check_prints_ok(dumped):
    _, _, job = dumped
    verdicts = [line for line in job.stdout.splitlines() if line.startswith("check against")]
    assert len(verdicts) == 1 and "-> OK" in verdicts[0], job.explain()


BAD = [
    (["--steps", "-1"], "--steps"),
    (["--lr", "nan"], "--lr"),
    (["--layers", "0"], "--layers"),
    (["--dtype", "float16"], "--dtype"),
    (["--model", "moe", "--experts", "2", "--top-k", "3"], "--top-k"),
    (["--no-such-flag", "3"], "--no-such-flag"),
    (["--layers", "2.5"], "--layers"),
    (["--model", "gpt", "--data", "no/such/file.txt"], "--data"),
]


@pytest.mark.parametrize("flags,named", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_setting_is_one_error_line(flags, named):
    job = minipar(1, ["train", *flags], 60)
    lines = [line for line in job.stderr.splitlines() if line.strip()]
    assert job.returncode == 2 and not job.timed_out, job.explain()
    assert len(lines) == 1 and lines[0].startswith("minipar: error:"), job.explain()
    assert named in lines[0], job.explain()                  # the message names the flag
    assert "Traceback" not in job.stdout + job.stderr


def help_entries(text: str) -> dict[str, str]:
    """Each flag (or positional) of an argparse --help text -> its help text."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   "):   # an entry starts
            invocation, _, rest = line.strip().partition("  ")
            current = invocation.split(", ")[-1].split()[0]
            entries[current] = rest.strip()
        elif line.startswith("   ") and current is not None:      # its help, continued
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", ["train", "mesh", "tour", "reshard", "bugs", "plan"])
def test_help_prints_once_with_text_for_every_flag(command):
    job = minipar(2, [command, "--help"], 30)
    assert job.returncode == 0 and job.stdout.count("usage:") == 1, job.explain()
    entries = help_entries(job.stdout)
    assert "--help" in entries, job.stdout
    assert [flag for flag, text in entries.items() if not text] == [], job.stdout
    if command == "train":   # every flag of the contract is there, with its help
        assert {f"--{name.replace('_', '-')}" for name in FLAG_NAMES} <= set(entries)


def test_these_tests_import_no_mpi():
    """What this file imports (the reference, the config, the launcher) starts no MPI:
    checked in a fresh interpreter, so other test files' imports cannot hide it."""
    probe = "import sys, tests.run.test_cli; print('mpi4py.MPI' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
