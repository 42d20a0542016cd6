"""Placement checking against lesson 8's bugs (minipar/bugs/catalog.py): every bug that is a
placement error is stopped in its first step with one line naming the tensor, the
axis and the model line (or, for a gradient left partial, the parameter); every bug
about values runs through, as its `unseen` says it must. One 4-rank job."""

from __future__ import annotations

import json

import pytest

from minipar.bugs.catalog import BUGS
from tests.harness.mpi import launch, minipar

WORLD = 4
PLACEMENT_BUGS = [name for name, bug in BUGS.items() if not bug.unseen]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, str | None]:
    out = tmp_path_factory.mktemp("bugs_placement") / "found.json"
    job = launch(WORLD, ["-m", "tests.harness.rank_bugs_placement", str(out)], timeout=240)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    return json.loads(out.read_text())


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
