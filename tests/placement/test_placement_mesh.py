"""Placement checking on a mesh, against the transformer's bugs (rank_placement_mesh.py,
one 2-rank job): each placement bug is stopped in its first forward with one line naming
the tensor, the axis, the placement found, the one needed and the line of the model; a
bug about values (the ring's merge without its log-sum-exp weights, ring and zigzag) runs
through the check, and only its numbers tell (`--check`)."""

from __future__ import annotations

import json

import pytest

from tests.harness.mpi import launch

PLACEMENT_BUGS = {
    "tp-copy-to-no-allreduce": ("blocks.0.ln1 output is replicated over tp",
                                "a copy_to is missing", "tensor_parallel.py:"),
    "vocab-embedding-no-allreduce": ("tok_embed output is a partial sum over tp",
                                     "add with pos_embed output needs it replicated",
                                     "an Allreduce is missing", "vocab_parallel.py:"),
    "vocab-loss-no-max": ("the row maxima of the logits is a partial max over tp",
                          "the vocabulary-parallel cross-entropy needs it replicated",
                          "an Allreduce is missing", "vocab_parallel.py:"),
    "cp-no-allgather": ("blocks.0.attn.k output is sharded along dim 1 over cp",
                        "every query needs every earlier key",
                        "an Allgather of K and V along T is missing",
                        "bugs/detours.py:"),
}


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("placement_mesh") / "found.json"
    job = launch(2, ["-m", "tests.harness.rank_placement_mesh", str(out)], timeout=240)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    return json.loads(out.read_text())


def test_the_correct_meshes_run_through_with_checking_on(found):
    for name in ("correct-tp", "correct-cp-allgather", "correct-cp-ring"):
        assert found[name]["stopped"] is None, found[name]["stopped"]


@pytest.mark.parametrize("name", sorted(PLACEMENT_BUGS))
def test_a_placement_bug_is_stopped_with_one_line_naming_it(found, name):
    line = found[name]["stopped"]
    assert line is not None, f"{name} ran through placement checking"
    assert "\n" not in line and " over " in line and " needs it " in line
    for words in PLACEMENT_BUGS[name]:
        assert words in line, line


def test_a_ring_without_its_log_sum_exp_merge_is_a_value_bug(found):
    # the same placements (the node's inputs and output are my positions either way):
    # the check cannot see it, and the loss is no longer the one-process loss
    correct = found["correct-cp-ring"]
    for name in ("ring-no-lse-merge", "zigzag-no-lse-merge"):
        broken = found[name]
        assert broken["stopped"] is None, broken["stopped"]
        assert abs(broken["loss"] - correct["loss"]) > 1e-6 * abs(correct["loss"]), name
