"""`train --ledger`: every line of the printed ledger agrees with the formulas.

The table puts each (axis, op) of the busiest rank beside what the cost model
predicts for that rank -- calls, elements, bytes and the dtype -- and a line that
says DIFFERS (or a missing prediction) fails here. Two of the meshes run --mixed
(16-bit words where only activations move, sums in the master dtype), one fp16 with
its found_inf vote; `--check` judges every rank's lines the same way (run/results.py).
"""

from __future__ import annotations

import re

import pytest

from minipar.settings.config import TrainConfig
from minipar.teaching.ledger_tables import ledger_differences, ledger_table, predicted_lines
from tests.harness.mpi import sweep

SMALL = ["--layers", "4", "--d-model", "16", "--d-in", "8", "--batch", "32", "--steps", "2"]
MESHES = [
    ["--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2", "--mixed", "bf16"],
    ["--dp", "4", "--zero", "3", "--pp", "2", "--schedule", "zb-h1", "--microbatches", "2"],
    ["--dp", "2", "--tp", "2", "--pp", "2", "--schedule", "dualpipev", "--microbatches", "4",
     "--mixed", "fp16", "--dtype", "float32"],
    ["--dp", "2", "--tp", "2", "--pp", "2", "--schedule", "dualpipe", "--microbatches", "4"],
    ["--model", "moe", "--dp", "4", "--ep", "2", "--pp", "2", "--microbatches", "2",
     "--capacity-factor", "1.0"],
]
# a predicted line: calls, elements (or "(router)" and the bytes an element), bytes, dtype
PREDICTED = re.compile(r"  (\d+), (?:(\d+), (\d+)|\(router\), [\d.]+ B/elem) \(([\w+]+)\) ok$")


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> list[dict]:
    """Every mesh's `train ... --ledger` exactly as typed, all in one 8-rank job: its exit
    code and what rank 0 printed."""
    return sweep(8, [{"cli": ["train", *mesh, *SMALL, "--ledger"]} for mesh in MESHES],
                 tmp_path_factory.mktemp("ledger_cli"), timeout=180)


@pytest.mark.parametrize("index", range(len(MESHES)), ids=[" ".join(m) for m in MESHES])
def test_every_ledger_line_matches_its_formula(printed, index):
    mesh, run = MESHES[index], printed[index]
    assert run["code"] == 0, run["out"]
    head = run["out"].index("ledger of the last step")
    rows = [line for line in run["out"][head:].splitlines()[2:]
            if line.strip() and not line.startswith("done")]
    assert len(rows) >= 3, run["out"]
    dtypes = set()
    for row in rows:
        assert row.rstrip().endswith(" ok"), f"not predicted exactly: {row}\n{run['out']}"
        found = PREDICTED.search(row)
        assert found, f"no bytes or dtype predicted: {row}"
        dtypes.add(found.group(4))
        if found.group(3):   # the measured bytes column equals the predicted bytes
            assert row.split()[5] == found.group(3), row
    if "--mixed" in mesh:    # the pipeline's activations as 16-bit words
        assert mesh[mesh.index("--mixed") + 1] in dtypes, run["out"]
    if "fp16" in mesh:       # the found_inf vote: one int32 over the world
        assert any(r.split()[:2] == ["world", "Allreduce"] and "(int32)" in r for r in rows)


def records(cfg: TrainConfig, **changes: tuple[int, int, int]) -> list[dict]:
    """Every rank's ledger exactly as predicted, with some (group, op) lines changed to
    (calls, elements, bytes) ("group op" keys, spaces as underscores)."""
    out = []
    for rank, lines in predicted_lines(cfg).items():
        for (group, op), line in lines.items():
            calls, elements, size = changes.get(f"{group}_{op}", (line.calls, line.elements,
                                                                  line.bytes))
            if calls:
                out.append({"rank": rank, "group": group, "op": op, "calls": calls,
                            "elements": elements, "bytes": size})
    return out


def test_bytes_differ_where_calls_and_elements_agree():
    """mp-tp-partials-in-bf16's ledger (16-bit forward shares): the same calls and
    elements, other bytes -- a line of its own in --check and DIFFERS in the table."""
    cfg = TrainConfig(mixed="bf16", tp=2, dp=2, layers=2, d_model=16, d_in=8,
                      batch=16).resolved(4)
    tp = predicted_lines(cfg)[0][("tp", "Allreduce")]
    assert (tp.dtype, tp.bytes) == ("float64", 8 * tp.elements)   # summed in the master
    half = tp.elements // 2                                       # forward in 2 bytes
    broken = records(cfg, tp_Allreduce=(tp.calls, tp.elements, 2 * half + 8 * half))
    assert ledger_differences(records(cfg), cfg) == []
    differences = ledger_differences(broken, cfg)
    assert differences == [f"tp Allreduce: {tp.calls} calls, {tp.elements} elements, "
                           f"{10 * half} bytes (5 B/elem) where the formulas say {tp.calls}, "
                           f"{tp.elements}, {tp.bytes} bytes (float64) (ranks 0, 1, 2, 3)"]
    assert "5 B/elem" in ledger_table(broken, cfg) and "DIFFERS" in ledger_table(broken, cfg)


def test_a_missing_line_and_an_fp16_skip():
    """A predicted line never called is a difference (tp-plain-linear's tp Allreduces);
    an fp16 step the scaler skipped gathers nothing after ZeRO-1's update."""
    cfg = TrainConfig(tp=2, dp=2, layers=2, d_model=16, d_in=8, batch=16).resolved(4)
    plain = records(cfg, tp_Allreduce=(0, 0, 0))
    assert all("(absent)" in line for line in ledger_differences(plain, cfg))
    assert "DIFFERS (never called)" in ledger_table(plain, cfg)
    fp16 = TrainConfig(mixed="fp16", zero=1, dp=4, layers=2, d_model=16, d_in=8,
                       batch=16).resolved(4)
    assert ("dp", "Allgatherv") in predicted_lines(fp16)[0]
    assert ("dp", "Allgatherv") not in predicted_lines(fp16, skipped=True)[0]
    assert predicted_lines(fp16)[0][("world", "Allreduce")].dtype == "int32"
