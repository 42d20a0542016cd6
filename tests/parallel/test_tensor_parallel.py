"""Tensor and sequence parallelism (minipar/parallel/tensor_parallel.py).

Three kinds of checks:

- training on tp = 2, 4, 8 (and dp x tp), with and without --sp, SGD and Adam,
  1 and 2 microbatches, equals one process (rtol 1e-9), and the ledger of the last
  step holds exactly Megatron's collectives on the tp group;
- the pieces on their own: every rank's forward output, INPUT gradient and weight
  gradients of each parallel linear and of the block against one process
  (a missing `copy_to` leaves each rank only its shard's share of dx);
- bad settings are refused before any communication.

The rank side of the piece tests is this file run under MPI:
`mpiexec -n 4 python -m tests.parallel.test_tensor_parallel OUTDIR` (each rank writes
OUTDIR/rank<r>.npz). The pytest process itself never imports mpi4py.MPI.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from minipar.core import autograd as ag
from minipar.core import nn
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import launch, lesson_run, minipar, sweep

SMALL = {"layers": 4, "d_model": 16, "d_in": 8, "batch": 16, "steps": 3}
# (sp, optimizer, microbatches): every pair of choices appears for each tp
VARIANTS = [(False, "sgd", 1), (False, "adam", 2), (True, "sgd", 2), (True, "adam", 1)]
MESHES = {2: [(1, 2)], 4: [(1, 4), (2, 2)], 8: [(1, 8), (2, 4)]}


def configs_for(world: int) -> list[dict]:
    out = []
    for dp, tp in MESHES[world]:
        variants = VARIANTS if dp == 1 else [(False, "sgd", 2), (True, "adam", 2)]
        out += [dict(SMALL, dp=dp, tp=tp, sp=sp, optimizer=optimizer, microbatches=m)
                for sp, optimizer, m in variants]
    return out


def expected_tp_ledger(cfg: dict) -> dict[str, tuple[int, int]]:
    """op -> (calls, elements) on the tp group of every rank for one step.

    B = rows of a microbatch on a rank; per block and microbatch Megatron's TP makes
    one Allreduce of B x d forward and one backward. SP turns each into an Allgather
    and a Reduce_scatter of B x d (in both directions), adds the Allgathers of
    entering (backward) and leaving (forward) the row-split stream, and one
    Allreduce of the row shards' LayerNorm gamma, beta and fc2 bias gradients."""
    L, M, d = cfg["layers"], cfg["microbatches"], cfg["d_model"]
    rows = cfg["batch"] // cfg["dp"] // M
    if not cfg["sp"]:
        return {"Allreduce": (2 * L * M, 2 * L * M * rows * d)}
    return {"Allgather": ((2 * L + 2) * M, (2 * L + 2) * M * rows * d),
            "Reduce_scatter": (2 * L * M, 2 * L * M * rows * d),
            "Allreduce": (1, 3 * d * L)}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_training_equals_one_process_with_megatron_ledger(world, tmp_path):
    configs = configs_for(world)
    # and on 4 ranks each config once more in bf16 (float64 masters), in the same job
    low = [dict(c, mixed="bf16") for c in configs] if world == 4 else []
    runs = sweep(world, configs + low, tmp_path / "sweep", timeout=240)
    for cfg, run in zip(low, runs[len(configs):]):
        assert_within_mixed_tolerance(run, cfg, world, f"n={world} {cfg}")
    for cfg, run in zip(configs, runs):
        label = f"n={world} {cfg}"
        assert_equivalent(run, reference(**cfg), label=label)
        expected = expected_tp_ledger(cfg)
        for rank in range(world):
            mine = [r for r in run["ledger"] if r["rank"] == rank]
            tp = {r["op"]: (r["calls"], r["elements"]) for r in mine if r["group"] == "tp"}
            assert tp == expected, f"{label} rank {rank}: tp ledger {tp} != {expected}"
            assert {r["group"] for r in mine} <= {"tp", "dp"}, f"{label} rank {rank}: {mine}"


# ---------------------------------------------------------- the pieces alone
B, D, F = 8, 8, 16   # rows, model width, FFN width: divisible by tp = 2 and 4


def piece_params() -> dict[str, np.ndarray]:
    """One block's parameters, every one of them random (non-zero biases and beta,
    gamma away from 1), so a bias added tp times or a lost LN share would show."""
    rng = np.random.default_rng(11)
    shapes = {"ln.weight": (D,), "ln.bias": (D,), "fc1.weight": (D, F), "fc1.bias": (F,),
              "fc2.weight": (F, D), "fc2.bias": (D,)}
    return {f"blocks.0.{k}": rng.normal(size=s) + (1.0 if k == "ln.weight" else 0.0)
            for k, s in shapes.items()}


def piece_inputs() -> dict[str, np.ndarray]:
    """The inputs and the fixed weights R of the loss sum(out * R)."""
    rng = np.random.default_rng(12)
    return {"x": rng.normal(size=(B, D)), "z": rng.normal(size=(B, F)),
            "r_f": rng.normal(size=(B, F)), "r_d": rng.normal(size=(B, D))}


def run_pieces(tp: object, out: dict[str, np.ndarray]) -> None:
    """Rank side: forward, backward of loss = sum(out * R) for each piece on group
    `tp`; stores the output, the input gradient and every parameter gradient."""
    from minipar.parallel import sequence_parallel
    from minipar.parallel import tensor_parallel as tpl

    full, inputs = piece_params(), piece_inputs()
    fc1, fc2 = "blocks.0.fc1", "blocks.0.fc2"
    cols_f = tpl.shard(F, tp.size, tp.rank)
    rows_b = tpl.shard(B, tp.size, tp.rank)
    pieces = {  # name -> (module, input array, loss weights matching the output)
        "col": (tpl.ColumnParallelLinear(full, fc1, tp), inputs["x"], inputs["r_f"][:, cols_f]),
        "col_gather": (tpl.ColumnParallelLinear(full, fc1, tp, gather_output=True),
                       inputs["x"], inputs["r_f"]),
        "row": (tpl.RowParallelLinear(full, fc2, tp), inputs["z"][:, cols_f], inputs["r_d"]),
        "row_scatter": (tpl.RowParallelLinear(full, fc2, tp, input_is_parallel=False),
                        inputs["z"], inputs["r_d"]),
        "block": (tpl.TensorParallelBlock(full, 0, tp), inputs["x"], inputs["r_d"]),
        "block_sp": (sequence_parallel.SequenceParallelBlock(full, 0, tp),
                     inputs["x"][rows_b], inputs["r_d"][rows_b]),
    }
    key = f"tp{tp.size}"
    for name, (module, x_data, weights) in pieces.items():
        tp.ledger.reset()
        x = ag.Tensor(x_data.copy(), requires_grad=True)
        y = module(x)
        y = y[0] if isinstance(y, tuple) else y
        (y * weights).sum().backward()
        out[f"{key}/{name}/out"], out[f"{key}/{name}/dx"] = y.data, x.grad
        for p in module.parameters():
            out[f"{key}/{name}/{p.name}"] = p.grad.copy()
        if name == "block_sp":  # the shares before the tp sum, then the sum
            sequence_parallel.allreduce_sequence_parallel_grads(
                [nn.Model(None, [module], None)], tp)
            for p in module.parameters():
                out[f"{key}/{name}/synced/{p.name}"] = p.grad.copy()
        for (op, _group), entry in tp.ledger.entries.items():
            out[f"{key}/{name}/ledger/{op}"] = np.array([entry.calls, entry.elements])


def rank_main(folder: Path) -> None:
    """Run the pieces on a tp group of 2 (split of the world) and of the whole world."""
    from mpi4py import MPI

    from minipar.comm.collectives import Group, Ledger

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    out: dict[str, np.ndarray] = {}
    pairs = world.Split(rank // 2, key=rank)  # ranks {0,1}, {2,3}: tp groups of 2
    for comm in (pairs, world):
        run_pieces(Group(comm, "tp", Ledger()), out)
    pairs.Free()
    np.savez(folder / f"rank{rank}.npz", **out)


def reference_pieces() -> dict[str, dict[str, np.ndarray]]:
    """The same pieces in one process: output, dx and parameter gradients."""
    full, inputs = piece_params(), piece_inputs()
    block = nn.DenseBlock(full, 0)
    pieces = {"col": (block.fc1, "x", "r_f"), "row": (block.fc2, "z", "r_d"),
              "block": (lambda h: block(h)[0], "x", "r_d")}
    out = {}
    for name, (module, x_name, r_name) in pieces.items():
        block.zero_grad()
        x = ag.Tensor(inputs[x_name].copy(), requires_grad=True)
        y = module(x)
        (y * inputs[r_name]).sum().backward()
        out[name] = {"out": y.data, "dx": x.grad,
                     **{p.name: p.grad.copy() for p in block.parameters() if p.grad is not None}}
    return out


def close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.max(np.abs(a - b)) <= 1e-12 * max(np.max(np.abs(b)), 1.0)


def test_parallel_pieces_match_one_process_on_every_rank(tmp_path):
    job = launch(4, ["-m", "tests.parallel.test_tensor_parallel", str(tmp_path)], timeout=120)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    ref = reference_pieces()
    full = piece_params()
    for rank in range(4):
        with np.load(tmp_path / f"rank{rank}.npz") as saved:
            got = dict(saved)
        for size in (2, 4):
            check_rank(got, ref, full, size, rank % size, f"rank {rank} tp{size}")


def check_rank(got: dict, ref: dict, full: dict, size: int, tp_rank: int, label: str) -> None:
    """One rank's pieces against one process: its slice of each reference value."""
    cols = slice(tp_rank * F // size, (tp_rank + 1) * F // size)
    rows = slice(tp_rank * B // size, (tp_rank + 1) * B // size)
    everything = slice(None)
    wanted = {  # piece -> (reference piece, slice of out, slice of dx, params: index)
        "col": ("col", (everything, cols), everything),
        "col_gather": ("col", everything, everything),
        "row": ("row", everything, (everything, cols)),
        "row_scatter": ("row", everything, everything),
        "block": ("block", everything, everything),
        "block_sp": ("block", rows, rows),
    }
    index = {"fc1.weight": (everything, cols), "fc1.bias": cols,
             "fc2.weight": (cols, everything)}
    for piece, (source, out_index, dx_index) in wanted.items():
        key = f"tp{size}/{piece}"
        assert close(got[f"{key}/out"], ref[source]["out"][out_index]), f"{label} {piece} out"
        assert close(got[f"{key}/dx"], ref[source]["dx"][dx_index]), f"{label} {piece} dx"
        prefix = "synced/" if piece == "block_sp" else ""
        names = [n for n in ref[source] if n.startswith("blocks.")]
        assert names and all(f"{key}/{prefix}{n}" in got for n in names), f"{label} {piece}"
        for name in names:
            expected = ref[source][name][index.get(name.split(".", 2)[2], everything)]
            assert close(got[f"{key}/{prefix}{name}"], expected), f"{label} {piece} {name}"
    check_ledgers(got, size, label)
    # before the sync, SP's LayerNorm and fc2-bias gradients are this rank's rows' share
    for name in ("blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.fc2.bias"):
        share = got[f"tp{size}/block_sp/{name}"]
        assert not close(share, ref["block"][name]), f"{label}: {name} was already whole"


def check_ledgers(got: dict, size: int, label: str) -> None:
    """Exact collectives of one forward + backward of each piece on the tp group."""
    rows_d, rows_f = B * D, B * F
    expected = {
        "col": {"Allreduce": (1, rows_d)},                       # copy_to's backward
        "col_gather": {"Allreduce": (1, rows_d), "Allgather": (1, rows_f)},
        "row": {"Allreduce": (1, rows_d)},                       # reduce_from's forward
        "row_scatter": {"Allreduce": (1, rows_d), "Allgather": (1, rows_f)},
        "block": {"Allreduce": (2, 2 * rows_d)},                 # Megatron: 2 x (B x d)
        "block_sp": {"Allgather": (2, 2 * rows_d), "Reduce_scatter": (2, 2 * rows_d),
                     "Allreduce": (1, 3 * D)},                   # + the LN / bias share sum
    }
    for piece, ops in expected.items():
        key = f"tp{size}/{piece}/ledger/"
        seen = {k[len(key):]: tuple(v) for k, v in got.items() if k.startswith(key)}
        assert seen == ops, f"{label} {piece}: ledger {seen} != {ops}"


# ----------------------------------------------------------------- the lesson
def test_lesson_runs_and_shows_the_source_examples():
    """On 4 ranks (its run line), scaled by 1/8: the source's W 8192 x 8192 on 2 ranks as
    two column blocks, its W 4096 x 4096 on 4 as 4096 x 1024 blocks, the row split, each
    by hand with the mpi4py call printed, then the library's layers equal to them."""
    job, _ = lesson_run(4, "02_tensor_parallel.py")  # test_lessons' run
    assert job.returncode == 0 and not job.timed_out, job.explain()
    out = job.stdout
    assert "W 8192 x 8192 on 2 ranks as two 8192 x 4096 column blocks" in out, out
    assert "W 4096 x 4096 on 4 ranks as 4 column blocks of 4096 x 1024" in out, out
    assert out.count("scaled by 1/8; --full for the source's size") == 2, out
    for rank in range(2):  # the first example: ranks 0 and 1, W 1024 x 1024 in halves
        assert f"[rank {rank}] holds W[:, {rank * 512}:{(rank + 1) * 512}] (1024 x 512," in out
    assert "[rank 2] holds W[:, 0:512]" not in out, out
    for rank in range(4):  # the second: W 512 x 512 in quarters, by columns, then by rows
        cols = f"{rank * 128}:{(rank + 1) * 128}"
        assert f"[rank {rank}] holds W[:, {cols}] (512 x 128," in out, out
        assert f"computes Y[:, {cols}] (32 x 128)" in out, out
        assert f"[rank {rank}] holds W[{cols}, :] (128 x 512) and X[:, {cols}]" in out, out
    assert out.count("comm.Allgather(y_k, blocks) rebuilds Y") == 2, out
    assert out.count("comm.Allreduce(partial, y, op=MPI.SUM) adds the shares") == 1, out
    assert "ColumnParallelLinear(W, tp) on 2 ranks, 1024 x 1024: 1 x Allgather" in out, out
    assert "ColumnParallelLinear(W, tp) on 4 ranks, 512 x 512: 1 x Allgather" in out, out
    assert "RowParallelLinear(W, tp) on 4 ranks, 512 x 512: 1 x Allreduce" in out, out
    diffs = re.findall(r"max \|[YZ] - [^=]+= ([0-9.e+-]+)", out)
    assert len(diffs) == 8 and max(float(v) for v in diffs) < 1e-12, out
    assert "1 x Allreduce (2048 elements)" in out and "2 x Allgather (10240" in out, out
    assert out.count("-> matches") == 4 and "DIFFERS" not in out, out
    assert out.count("-> OK") == 8 and "MISMATCH" not in out, out
    assert "parameters per rank:" in out, out
    heads = re.findall(r"^=== (\d+)\. (Beyond the source: )?", out, re.MULTILINE)
    assert [int(n) for n, _ in heads] == list(range(1, 7)), heads
    assert [bool(beyond) for _, beyond in heads] == [False] * 4 + [True] * 2, heads
    ratio = re.search(r"--sp sends ([\d.]+) x plain TP's bytes", out)
    assert ratio and 1.0 < float(ratio[1]) < 1.5, out  # same per block, + 2 Allgathers


def test_lesson_on_one_rank_refuses_up_front_in_one_line():
    job = launch(1, ["lessons/02_tensor_parallel.py"], timeout=60)
    assert job.returncode == 2 and not job.timed_out, job.explain()
    assert job.stdout == "" and job.stderr.strip().count("\n") == 0, job.explain()
    assert "run it on 2 or more" in job.stderr, job.explain()


# ------------------------------------------------------------ bad settings
def test_tp_not_dividing_d_ff_is_refused():
    cfg = TrainConfig(tp=2, d_ff=63, layers=2).resolved(2)
    assert any("--tp 2 does not divide --d-ff 63" in p for p in problems(cfg, 2))
    ok = TrainConfig(tp=2, d_ff=64, layers=2).resolved(2)
    assert problems(ok, 2) == []
    sp_rows = TrainConfig(tp=4, sp=True, batch=8, microbatches=4).resolved(4)
    assert any("--sp needs --tp 4" in p for p in problems(sp_rows, 4))
    assert any("--sp" in p for p in problems(TrainConfig(sp=True).resolved(2), 2))
    job = minipar(2, ["train", "--tp", "2", "--d-ff", "63", "--steps", "1"], timeout=60)
    assert job.returncode == 2 and not job.timed_out, job.explain()
    assert job.stderr.count("does not divide --d-ff 63") == 1, job.explain()


if __name__ == "__main__":
    from minipar.comm.job import abort_on_exception  # loads mpi4py.MPI: only in a rank process

    abort_on_exception(lambda: rank_main(Path(sys.argv[1])))
