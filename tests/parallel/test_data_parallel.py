"""Data parallelism (minipar/parallel/data_parallel.py): naive, bucketed, overlapped.

- Training on dp = 2, 3, 4, 8 with each `--grad-sync`, SGD and Adam, 1 and 2
  microbatches (gradient accumulation: one sync per step), equals one process
  (rtol 1e-9); the model's 8954 parameters do not divide 3, 4 or 8.
- The ledger of the last step: every rank Allreduces exactly its parameter count,
  in one call per parameter (naive) or one per bucket (bucketed, overlapped).
- Hybrids (dp with pp, tp, ep; a zero-bubble schedule) stay equal to one process.
- On the ranks themselves (`check_*`, run by `tests.harness.rank_tests`): overlap starts
  every bucket during backward, and only in the last microbatch's backward.
- A batch not divisible by dp is refused by the CLI: one line, exit 2.
- Each rank draws only its own rows of the batch (`data.rank_rows`), bitwise equal
  to those rows of the global batch, for the MLP data, the copy task and text windows;
  the buckets' reused flat buffers give the same gradients as new ones, bit for bit.

Rank side by hand: `mpiexec -n 4 python -m tests.harness.rank_tests /tmp/out
tests.parallel.test_data_parallel:check_overlap_starts_buckets_in_backward`.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from minipar.core import nn
from minipar.settings.config import GRAD_SYNCS, TrainConfig
from tests.conftest import assert_equivalent, assert_within_mixed_tolerance, reference
from tests.harness.mpi import lesson_run, minipar, sweep
from tests.harness.rank_tests import run_checks
from tests.harness.trace_checks import check_trace

SMALL = {"layers": 4, "d_model": 16, "d_in": 8, "batch": 48, "steps": 3}
BUCKET = 1000  # elements: the small model's fc weights (1024) each get a bucket of their own


def shapes(cfg: dict) -> list[tuple[int, ...]]:
    """Canonical parameter shapes of a config, in forward order."""
    model = TrainConfig(**cfg).resolved(1).model_config()
    return list(nn.canonical_shapes(model).values())


def expected_buckets(cfg: dict) -> list[int]:
    """Sizes of the buckets, worked out here independently: parameters in reverse
    order, a new bucket whenever the next one would pass the bucket size."""
    buckets: list[int] = []
    for size in reversed([int(np.prod(s)) for s in shapes(cfg)]):
        if buckets and buckets[-1] + size <= cfg["bucket_size"]:
            buckets[-1] += size
        else:
            buckets.append(size)
    return buckets


def plain_configs(world: int) -> list[dict]:
    """Each sync mode with SGD and one microbatch; with Adam and two microbatches the
    overlapped one (it counts microbatches before it starts a bucket), and on 4 ranks
    the bucketed one too. (Naive and bucketed sync after backward, whatever M is.)"""
    out = []
    for optimizer, microbatches in (("sgd", 1), ("adam", 2)):
        syncs = GRAD_SYNCS
        if microbatches == 2:
            syncs = ("bucketed", "overlapped") if world == 4 else ("overlapped",)
        out += [dict(SMALL, dp=world, grad_sync=sync, bucket_size=BUCKET, optimizer=optimizer,
                     microbatches=microbatches) for sync in syncs]
    return out


HYBRIDS = {  # world -> dp with other strategies, equivalence only
    4: [dict(SMALL, dp=2, pp=2, grad_sync="overlapped", bucket_size=BUCKET, microbatches=4,
             schedule="zb-h1"),
        dict(SMALL, model="moe", experts=4, dp=4, ep=2, grad_sync="overlapped",
             bucket_size=BUCKET)],
    8: [dict(SMALL, dp=2, tp=2, pp=2, grad_sync="overlapped", bucket_size=BUCKET,
             microbatches=2, optimizer="adam")],
}


def check_ledger(run: dict, cfg: dict, world: int, label: str) -> None:
    """Every rank: one Allreduce per parameter / per bucket, the parameter count in all."""
    sizes = [int(np.prod(s)) for s in shapes(cfg)]
    op = "Iallreduce" if cfg["grad_sync"] == "overlapped" else "Allreduce"
    calls = len(sizes) if cfg["grad_sync"] == "naive" else len(expected_buckets(cfg))
    for rank in range(world):
        mine = {(r["group"], r["op"]): (r["calls"], r["elements"])
                for r in run["ledger"] if r["rank"] == rank}
        assert mine == {("dp", op): (calls, sum(sizes))}, f"{label} rank {rank}: {mine}"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_every_grad_sync_equals_one_process_and_allreduces_the_parameter_count(world, tmp_path):
    plain = plain_configs(world)
    configs = plain + HYBRIDS.get(world, [])
    traced = [dict(c, trace=str(tmp_path / f"trace{i}")) if world == 4 else c
              for i, c in enumerate(configs)]   # 4 ranks: timelines too (trace_checks.py)
    # and on 4 ranks every sync once more in bf16 (float64 masters), in the same job
    low = [dict(c, mixed="bf16") for c in plain] if world == 4 else []
    runs = sweep(world, traced + low, tmp_path / "sweep", timeout=240)
    for cfg, run in zip(low, runs[len(configs):]):
        assert_within_mixed_tolerance(run, cfg, world, f"n={world} {cfg}")
    for cfg, run in zip(configs, runs):
        label = f"n={world} {cfg}"
        assert_equivalent(run, reference(**cfg), label=label)
        if cfg in plain:
            check_ledger(run, cfg, world, label)
        if world == 4:
            check_trace(run["config"]["trace"], run, label)
    if world == 2:  # overlapped's backward starts from 1/dp, bucketed divides the sum by dp:
        # with dp = 2 (a + b in any order, halved exactly) the same bits (data_parallel.py)
        bucketed, overlapped = (runs[[c["grad_sync"] for c in plain].index(sync)]
                                for sync in ("bucketed", "overlapped"))
        assert bucketed["losses"] == overlapped["losses"]
        for name, value in bucketed["final"].items():
            assert np.array_equal(overlapped["final"][name], value), name


def test_bucket_arithmetic_of_the_test_itself():
    """Buckets pass the size only when one parameter does; no two neighbours would fit
    in one; together they hold every parameter."""
    cfg = dict(SMALL, bucket_size=BUCKET)
    sizes = expected_buckets(cfg)
    params = [int(np.prod(s)) for s in shapes(cfg)]
    assert sum(sizes) == sum(params) and len(sizes) > 1
    assert all(size <= BUCKET or size in params for size in sizes)
    assert all(a + b > BUCKET for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("batch,microbatches,dp", [(12, 1, 3), (24, 2, 3), (16, 4, 2)])
def test_a_rank_draws_only_its_rows_bitwise_equal_to_the_global_batch(batch, microbatches,
                                                                       dp, tmp_path):
    from minipar.core import data

    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(256)) * 3)
    draws = {"mlp": lambda rows: data.make_batch(5, 3, batch, 7, 4, "float32", rows),
             "copy": lambda rows: data.make_sequences(5, 3, batch, 9, 11, rows),
             "text": lambda rows: data.make_text_windows(str(text), 5, 3, batch, 9, rows)}
    for name, draw in draws.items():
        whole = draw(None)
        mine = [data.rank_rows(batch, microbatches, dp, r) for r in range(dp)]
        assert sorted(np.concatenate(mine).tolist()) == list(range(batch)), name
        for r, rows in enumerate(mine):
            part = draw(rows)
            for array, full in zip(part, whole):
                assert array.tobytes() == full[rows].tobytes(), (name, r)  # bit for bit
            for m in range(microbatches):  # microbatch m of rank r: the same rows both ways
                local = data.local_rows(batch, microbatches, dp, m)
                mine_global = data.shard_rows(batch, microbatches, dp, m, r)
                assert np.array_equal(part[0][local], whole[0][mine_global]), (name, r, m)
    # a row's numbers do not depend on the batch it is drawn in
    assert np.array_equal(data.make_batch(5, 3, 6, 7, 4)[0], data.make_batch(5, 3, 12, 7, 4)[0][:6])
    assert not np.array_equal(data.make_batch(5, 3, 6, 7, 4)[0], data.make_batch(5, 4, 6, 7, 4)[0])


def test_reused_bucket_buffers_give_the_same_bits_as_new_ones():
    from minipar.parallel.buckets import flat_buffers, make_buckets, pack, unpack

    rng = np.random.default_rng(0)
    params = [nn.Parameter(rng.normal(size=shape), name=str(i))
              for i, shape in enumerate([(3, 4), (5,), (2, 2, 2), (7,)])]
    buckets = make_buckets(params, 16)  # [(7,), (2, 2, 2)], [(5,)], [(3, 4)]
    assert [len(b) for b in buckets] == [2, 1, 1]
    flats = flat_buffers(buckets)
    for step in range(2):  # the second step reuses the buffers the first one filled
        for p in params:
            p.grad = rng.normal(size=p.data.shape)
        expected = []
        for bucket in buckets:
            fresh = np.concatenate([p.grad.ravel() for p in bucket])
            expected += [(fresh[a:a + p.grad.size] * 0.25).reshape(p.grad.shape)
                         for a, p in zip(np.cumsum([0] + [q.grad.size for q in bucket]), bucket)]
        for bucket, flat in zip(buckets, flats):
            packed = pack(bucket, flat)
            if len(bucket) == 1:  # no buffer, no copy: the gradient itself, seen flat
                assert flat is None and np.shares_memory(packed, bucket[0].grad)
            else:
                assert packed is flat
            assert np.array_equal(packed, pack(bucket))
            unpack(bucket, packed, 0.25)
        got = [p.grad for bucket in buckets for p in bucket]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, expected)), step


def test_a_batch_not_divisible_by_dp_is_refused_in_one_line():
    job = minipar(3, ["train", "--dp", "3", "--batch", "16"], timeout=60)
    assert job.returncode == 2 and not job.timed_out, job.explain()
    lines = job.stderr.strip().splitlines()
    assert lines == ["minipar: error: --batch 16 is not divisible by --dp 3 "
                     "(every data-parallel rank takes an equal slice)"], job.explain()


def test_overlap_starts_every_bucket_in_the_last_backward(tmp_path):
    name = "tests.parallel.test_data_parallel:check_overlap_starts_buckets_in_backward"
    run_checks(4, [name], tmp_path, timeout=120).assert_passed(name)


# ------------------------------------------------------------------ rank side
def check_overlap_starts_buckets_in_backward(comm: object) -> None:
    """With 2 microbatches, no bucket starts in the first backward; all of them start
    in the second, each as soon as its pieces are done; and the synced gradient
    equals the bucketed sync of the same gradients."""
    from minipar.comm.collectives import Ledger
    from minipar.comm.mesh import Mesh
    from minipar.compose.parallelize import build_rank_model, make_updater
    from minipar.core.data import shard_rows
    from minipar.core.optim import SGD
    from minipar.parallel.data_parallel import bucketed_allreduce
    from minipar.run.mesh_step import microbatch_loss
    from minipar.run.reference import step_batch
    from tests.harness.rank_tests import agree

    world = comm.Get_size()
    cfg = TrainConfig(**dict(SMALL, dp=world, microbatches=2, grad_sync="overlapped",
                             bucket_size=BUCKET)).resolved(world)
    mesh = Mesh(cfg.mesh_shape(), comm, Ledger())
    chunks = build_rank_model(cfg, mesh, nn.init_params(cfg.model_config(), cfg.seed))
    updater = make_updater(cfg, mesh, chunks, SGD(cfg.lr))
    overlap, problems = updater.overlap, []
    x, y = step_batch(cfg, 0)
    started = []
    for m in range(2):   # backward from what train_step starts it from: 1/dp (overlapped)
        rows = shard_rows(cfg.batch, 2, world, m, mesh.coords["dp"])
        microbatch_loss(chunks[0], x[rows], y[rows], 0.5).backward(updater.backward_seed)
        started.append(len(overlap.in_flight))
    if started != [0, len(updater.buckets)]:
        problems.append(f"buckets started after each microbatch {started}, "
                        f"expected [0, {len(updater.buckets)}]")
    order = [i for i, _, _ in overlap.in_flight]
    if order != sorted(order):  # buckets are cut from the back: they finish in that order
        problems.append(f"buckets started in order {order}")
    updater.step()
    if updater.started_in_backward != len(updater.buckets):
        problems.append(f"{updater.started_in_backward} buckets started in backward")
    # the same microbatches on a second copy of the model, synced bucketed after backward
    # (a bucket of one gradient is reduced in place: the first copy's local gradients
    # are gone by now)
    plain = replace(cfg, grad_sync="bucketed")
    again = build_rank_model(plain, mesh, nn.init_params(cfg.model_config(), cfg.seed))
    reference_updater = make_updater(plain, mesh, again, SGD(cfg.lr))
    for m in range(2):
        rows = shard_rows(cfg.batch, 2, world, m, mesh.coords["dp"])
        microbatch_loss(again[0], x[rows], y[rows], 0.5).backward()
    bucketed_allreduce(reference_updater.buckets, mesh)
    for p, q in zip(updater.params, reference_updater.params):
        if not np.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-18):
            problems.append(f"{p.name}: overlapped sync differs from bucketed")
    mesh.free()
    agree(comm, problems)


def test_lesson_times_the_three_syncs_and_says_where():
    job, _ = lesson_run(8, "01_data_parallel.py")  # the run tests/teaching/test_lessons.py checks
    assert job.returncode == 0 and not job.timed_out, job.explain()
    # timed on as many ranks as there are cores, never more, and saying so
    where = re.search(r"on dp = (\d+) \((\d+) ranks? on (\d+) cores?\)", job.stdout)
    assert where and where[1] == where[2] and int(where[2]) <= int(where[3]), job.stdout
    timed = dict(re.findall(r"^ +(naive|bucketed|overlapped): +([\d.]+) ms \([\d.]+\.\.[\d.]+ "
                            r"over 7 repeats\)", job.stdout, re.M))
    assert set(timed) == {"naive", "bucketed", "overlapped"}, job.stdout
    assert all(float(ms) > 0 for ms in timed.values())
    assert re.search(r"^  (fastest: \w+|within the spread: no fastest) ", job.stdout, re.M)
