"""Placement checking against lesson 8's bugs (minipar/bugs/catalog.py): every bug that is a
placement error is stopped in its first step with one line naming the tensor, the
axis and the model line (or, for a gradient left partial, the parameter); every bug
about values runs through, as its `unseen` says it must. In the same 4-rank job, every
bug's own `try:` line (`python -m minipar bugs`), run exactly as printed, ends with exit
1 and the message of the check that catches it."""

from __future__ import annotations

import json
import re

import pytest

from minipar.bugs.catalog import BUGS, MIXED_BUGS
from tests.harness.mpi import launch, minipar

WORLD = 4
PLACEMENT_BUGS = [name for name, bug in BUGS.items() if not bug.unseen]


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[dict[str, str | None], dict[str, dict]]:
    """(bug -> the placement line that stopped it, bug -> its try line's exit code and
    output): one job."""
    folder = tmp_path_factory.mktemp("bugs_placement")
    out, tried = folder / "found.json", folder / "try.json"
    job = launch(WORLD, ["-m", "tests.harness.rank_bugs_placement", str(out), str(tried)],
                 timeout=480)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    return json.loads(out.read_text()), json.loads(tried.read_text())


@pytest.fixture(scope="module")
def stopped(both) -> dict[str, str | None]:
    return both[0]


# the check each try line must fail, by the start of its message; a bug not named here
# must fail one of them (ANY_CHECK)
ANY_CHECK = ["check against one process", "ledger against the formulas",
             "memory against the formulas", "replicas disagree", "minipar: error:"]
CAUGHT_BY = {
    **{name: ["check against one process"] for name in (
        "pp-one-input-buffer", "tp-copy-to-no-allreduce", "dp-stage-not-synced",
        "dp-sum-not-mean", "moe-aux-first-choice", "moe-aux-after-capacity",
        "moe-aux-per-rank", "tp-vocab-loss-no-max", "cp-no-allgather",
        "cp-ring-no-lse-merge", "zero-no-allgather", "clip-local-norm",
        "clip-replicated-counted-tp", "loss-mean-per-microbatch", "mp-no-master-weights")},
    "tp-plain-linear": ["ledger against the formulas", "memory against the formulas"],
    "mp-tp-partials-in-bf16": ["ledger against the formulas"],
    "fp8-local-amax": ["ledger against the formulas"],
    "fp8-block-straddles-shard": ["ledger against the formulas"],
    "fp8-accumulate-in-low": ["check against one process"],
    "mp-found-inf-per-rank": ["minipar: error: step 1: loss scale S"],
    "moe-bias-local-load": ["check against one process", "replicas disagree"],
}


@pytest.mark.parametrize("name", [*BUGS, *MIXED_BUGS])
def test_each_try_line_ends_non_zero_with_its_checks_message(both, name):
    run = both[1][name]
    assert run["code"] == 1, f"{run['line']}\n{run['out']}"
    lines = run["out"].splitlines()

    def failed(line: str) -> bool:   # a check's line that says it failed
        return "MISMATCH" in line or line.startswith(("replicas disagree", "minipar: error:"))
    if name not in CAUGHT_BY:
        assert any(failed(line) for line in lines if line.startswith(tuple(ANY_CHECK))), \
            f"{run['line']}: no check says it failed\n{run['out']}"
    for start in CAUGHT_BY.get(name, []):
        said = [line for line in lines if line.startswith(start)]
        assert said and failed(said[0]), f"{run['line']}: no failing {start!r}\n{run['out']}"


def test_the_ledger_shows_the_16_bit_partials_and_the_missing_split(both):
    partials = both[1]["mp-tp-partials-in-bf16"]["out"]
    # forward shares in 2 bytes, backward sums in 8: 163840 bytes where float64's 262144
    assert re.search(r"ledger: tp Allreduce: 16 calls, 32768 elements, 163840 bytes "
                     r"\(5 B/elem\) where the formulas say 16, 32768, 262144 bytes "
                     r"\(float64\)", partials), partials
    assert "-> OK" in partials   # the numbers are within the derived tolerance
    plain = both[1]["tp-plain-linear"]["out"]
    assert "ledger: tp Allreduce: 0 calls, 0 elements, 0 bytes (absent)" in plain, plain
    assert re.search(r"rank 0 holds (\d+) bytes of parameters, the formula (\d+) MISMATCH",
                     plain), plain


def test_the_placement_bugs_are_the_expected_ones():
    assert PLACEMENT_BUGS == ["tp-copy-to-no-allreduce", "dp-stage-not-synced",
                              "moe-aux-per-rank", "tp-vocab-loss-no-max", "cp-no-allgather",
                              "zero-no-allgather"]


@pytest.mark.parametrize("name", PLACEMENT_BUGS)
def test_each_placement_bug_is_stopped_with_its_line(stopped, name):
    line = stopped[name]
    assert line is not None, f"{name} ran through placement checking"
    assert "\n" not in line and " over " in line and " needs it " in line


def test_the_lines_name_where_each_bug_is_made(stopped):
    assert "ln output is replicated over tp" in stopped["tp-copy-to-no-allreduce"]
    assert "a copy_to is missing" in stopped["tp-copy-to-no-allreduce"]
    assert "[at minipar/parallel/tensor_parallel.py:" in stopped["tp-copy-to-no-allreduce"]
    assert "gradient is a partial sum over dp" in stopped["dp-stage-not-synced"]
    assert "an Allreduce over dp is missing" in stopped["dp-stage-not-synced"]
    assert "aux loss is a partial sum over dp" in stopped["moe-aux-per-rank"]
    assert "[at minipar/" in stopped["moe-aux-per-rank"]
    assert "the row maxima of the logits is a partial max over tp" in \
        stopped["tp-vocab-loss-no-max"]
    assert "[at minipar/parallel/vocab_parallel.py:" in stopped["tp-vocab-loss-no-max"]
    assert "blocks.0.attn.k output is sharded along dim 1 over cp" in stopped["cp-no-allgather"]
    assert "an Allgather of K and V along T is missing" in stopped["cp-no-allgather"]
    assert "[at minipar/bugs/detours.py:" in stopped["cp-no-allgather"]   # the broken line
    assert ("ZeRO's flat vector of the dense parameters is sharded along dim 0 over dp; "
            "the next forward needs it replicated (an Allgather is missing)"
            in stopped["zero-no-allgather"])
    assert "[at minipar/parallel/zero.py:" in stopped["zero-no-allgather"]


@pytest.mark.parametrize("name", [n for n in BUGS if n not in PLACEMENT_BUGS])
def test_a_bug_about_values_runs_through(stopped, name):
    assert stopped[name] is None, stopped[name]


def test_the_command_stops_with_one_line_and_exit_1():
    job = minipar(2, ["train", "--tp", "2", "--layers", "2", "--d-model", "16", "--batch", "8",
                      "--steps", "2", "--check-placements",
                      "--inject-bug", "tp-copy-to-no-allreduce"], timeout=90)
    assert job.returncode == 1 and not job.timed_out, job.explain()
    lines = [line for line in job.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, job.stderr
    assert lines[0].startswith("minipar: error: blocks.0.ln output is replicated over tp")
    assert "step" not in job.stdout  # stopped in the first forward, before any loss
