"""`train --ledger`: every line of the printed ledger agrees with the formulas.

The table puts each (axis, op) of the busiest rank beside what the cost model
predicts for that rank; a line that says DIFFERS (or a missing prediction)
fails here.
"""

from __future__ import annotations

import pytest

from tests.harness.mpi import minipar

SMALL = ["--layers", "4", "--d-model", "16", "--d-in", "8", "--batch", "32", "--steps", "2"]
MESHES = [
    ["--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2"],
    ["--dp", "4", "--zero", "3", "--pp", "2", "--schedule", "zb-h1", "--microbatches", "2"],
    ["--dp", "2", "--tp", "2", "--pp", "2", "--schedule", "dualpipev", "--microbatches", "4"],
    ["--dp", "2", "--tp", "2", "--pp", "2", "--schedule", "dualpipe", "--microbatches", "4"],
    ["--model", "moe", "--dp", "4", "--ep", "2", "--pp", "2", "--microbatches", "2",
     "--capacity-factor", "1.0"],
]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: " ".join(m))
def test_every_ledger_line_matches_its_formula(mesh):
    job = minipar(8, ["train", *mesh, *SMALL, "--ledger"], timeout=120)
    assert job.returncode == 0, job.explain()
    head = job.stdout.index("ledger of the last step")
    rows = [line for line in job.stdout[head:].splitlines()[2:]
            if line.strip() and not line.startswith("done")]
    assert len(rows) >= 3, job.stdout
    for row in rows:
        assert row.rstrip().endswith(" ok"), f"not predicted exactly: {row}\n{job.stdout}"
