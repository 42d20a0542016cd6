"""minipar's single-process reference against an independent implementation of docs/design.md.

`train_reference` (autograd.py + nn.py + optim.py) is what every parallel run is
compared with, so it is itself compared with `tests/reference/independent.py`: plain NumPy
with hand-written gradients, sharing nothing with it but the data. Losses and
final parameters must agree to relative 1e-9 after 4 steps, for the dense MLP
and for MoE (top-1/top-2, with and without capacity drops), SGD and Adam, one
or two microbatches. Then properties of the model itself: it learns, float32
stays float32, and uniform routing gives an aux loss of exactly alpha.

    python -m pytest tests/core/test_reference.py
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from minipar.core import autograd as ag
from minipar.core import nn
from minipar.run.reference import step_batch
from minipar.run.train import train_reference
from minipar.settings.config import TrainConfig
from tests.conftest import assert_equivalent
from tests.reference import independent

SMALL = {"layers": 2, "d_in": 8, "d_model": 16, "d_ff": 40, "classes": 5, "batch": 16,
         "steps": 4}
MOE = {"model": "moe", "experts": 4, "expert_d_ff": 24}
LR = {"sgd": 0.05, "adam": 0.01}


def config(**fields: object) -> TrainConfig:
    return TrainConfig(**{**SMALL, **fields}).resolved(1)


def compare(cfg: TrainConfig) -> independent.Run:
    """Run both implementations; assert losses and final parameters agree (rtol 1e-9)."""
    mine = independent.train(cfg)
    ref = train_reference(cfg)
    assert_equivalent({"losses": mine.losses, "final": mine.final}, ref, label=str(cfg))
    return mine


@pytest.mark.parametrize("model", ["mlp", "moe"])
def test_init_rule(model):
    """The independent draw of docs/design.md's init rule is nn.init_params, bit for bit."""
    cfg = config(**(MOE if model == "moe" else {}), layers=3)
    for dtype in ("float64", "float32"):
        mine = independent.init_params(cfg, 5, dtype)
        theirs = nn.init_params(cfg.model_config(), 5, dtype)
        assert list(mine) == list(theirs)            # canonical names, canonical order
        for name, value in theirs.items():
            assert value.dtype == np.dtype(dtype) and np.array_equal(mine[name], value), name


@pytest.mark.parametrize("optimizer,microbatches", list(itertools.product(LR, (1, 2))))
def test_dense_matches_independent(optimizer, microbatches):
    compare(config(optimizer=optimizer, lr=LR[optimizer], microbatches=microbatches))


@pytest.mark.parametrize("top_k,capacity,optimizer,microbatches", list(itertools.product(
    (1, 2), (None, 0.75), LR, (1, 2))))
def test_moe_matches_independent(top_k, capacity, optimizer, microbatches):
    cfg = config(**MOE, top_k=top_k, capacity_factor=capacity, optimizer=optimizer,
                 lr=LR[optimizer], microbatches=microbatches, aux_coef=0.1)
    run = compare(cfg)
    if capacity is None:
        assert sum(run.dropped) == 0
    else:                                  # capacity 0.75 < 1 must drop assignments
        assert sum(run.dropped) > 0, "no assignment was dropped: capacity is not exercised"


@pytest.mark.parametrize("top_k,capacity", [(1, None), (2, 1.0)])
def test_tied_router_picks_lower_expert_ids(top_k, capacity):
    """A zero router ties every expert: both implementations send every token to experts
    0..k-1 (capacity then drops the later tokens), with equal loss and gradients; the
    experts nobody chose get a zero gradient, not a missing one."""
    cfg = config(**MOE, top_k=top_k, capacity_factor=capacity, aux_coef=0.1)
    params = independent.init_params(cfg, cfg.seed)
    for i in range(cfg.layers):
        params[f"blocks.{i}.router.weight"][:] = 0.0
    x, y = step_batch(cfg, 0)
    loss, grads, dropped = independent.loss_and_grads(params, cfg, x, y)
    model = nn.build_reference(cfg.model_config(), params)
    got = nn.loss_fn(model, x, y)
    got.backward()
    assert abs(got.item() - loss) <= 1e-12 * abs(loss)
    assert dropped == (0 if capacity is None else cfg.layers * cfg.batch)
    for p in model.parameters():
        expected = grads[p.name]
        assert p.grad is not None, p.name
        assert np.max(np.abs(p.grad - expected)) <= 1e-9 * max(np.max(np.abs(expected)),
                                                                1e-300), p.name
        if ".experts." in p.name and int(p.name.split(".")[3]) >= top_k:
            assert not np.any(p.grad), p.name


def test_loss_decreases_on_the_synthetic_task():
    """The default MLP learns the teacher's labels: the loss falls far below ln(C)."""
    result = train_reference(TrainConfig(steps=200, optimizer="adam", lr=3e-3).resolved(1))
    first, last = np.mean(result.losses[:10]), np.mean(result.losses[-10:])
    assert first > 0.8 * np.log(10)
    assert last < 0.5 * first, (first, last)


@pytest.mark.parametrize("model", ["mlp", "moe"])
def test_float32_stays_float32(model):
    fields = {**(MOE if model == "moe" else {}), "optimizer": "adam", "lr": 0.01}
    single = train_reference(config(dtype="float32", **fields))
    double = train_reference(config(**fields))
    for name, value in single.final.items():
        assert single.init[name].dtype == np.float32 and value.dtype == np.float32, name
        np.testing.assert_allclose(value, double.final[name], rtol=0,
                                   atol=1e-4 * np.max(np.abs(double.final[name])))
    assert all(np.isfinite(single.losses))
    np.testing.assert_allclose(single.losses, double.losses, rtol=1e-5)


@pytest.mark.parametrize("experts,top_k", [(4, 1), (4, 2), (8, 2), (3, 3)])
def test_uniform_routing_aux_loss_is_alpha(experts, top_k):
    """Switch Transformer: with a uniform router, f_e P_e sums to 1/E, so aux = alpha
    (its minimum). A zero router weight makes every p_be = 1/E exactly."""
    cfg = nn.ModelConfig(model="moe", layers=1, d_in=4, d_model=8, experts=experts,
                         top_k=top_k, expert_d_ff=6, aux_coef=0.37)
    full = nn.init_params(cfg, 0)
    full["blocks.0.router.weight"][:] = 0.0
    block = nn.MoEBlock(full, 0, cfg)
    h = ag.Tensor(np.random.default_rng(0).standard_normal((10, 8)))
    _, aux = block(h)
    assert abs(aux.item() - 0.37) <= 1e-15


def test_counter_based_data_rows_are_the_same_in_any_split_and_well_distributed():
    """Every number is a hash of (seed, step, row, column): a row drawn alone, in a
    microbatch, in another mesh's shard or in a wider batch has the same bits; the
    normals have mean 0 and variance 1, the uniforms lie in [0, 1) with variance 1/12,
    the integers cover [0, n) evenly."""
    from minipar.core import data

    batch, d_in = 24, 9
    whole = data.row_normals(4, 2, batch, None, d_in)
    for microbatches, dp in [(1, 3), (2, 2), (4, 3), (3, 8)]:
        if batch % (microbatches * dp):
            continue
        for r in range(dp):
            rows = data.rank_rows(batch, microbatches, dp, r)
            assert data.row_normals(4, 2, batch, rows, d_in).tobytes() == whole[rows].tobytes()
            for m in range(microbatches):
                piece = data.shard_rows(batch, microbatches, dp, m, r)
                assert np.array_equal(whole[piece], data.row_normals(
                    4, 2, batch, np.arange(batch)[piece], d_in))
    assert np.array_equal(data.row_normals(4, 2, 2 * batch, None, d_in)[:batch], whole)
    assert np.array_equal(data.row_normals(4, 2, batch, None, d_in + 3)[:, :d_in], whole)
    x, y = data.make_batch(4, 2, batch, d_in, 5, rows=np.array([7, 3]))
    full_x, full_y = data.make_batch(4, 2, batch, d_in, 5)
    assert np.array_equal(x, full_x[[7, 3]]) and np.array_equal(y, full_y[[7, 3]])
    assert not np.array_equal(whole, data.row_normals(4, 3, batch, None, d_in))   # step
    assert not np.array_equal(whole, data.row_normals(5, 2, batch, None, d_in))   # seed

    normals = data.row_normals(0, 0, 512, None, 256).ravel()          # 131072 numbers
    assert abs(normals.mean()) < 5 / np.sqrt(normals.size)           # 5 standard errors
    assert abs(normals.var() - 1) < 5 * np.sqrt(2 / normals.size)
    assert abs(np.mean(np.abs(normals) < 1) - 0.6827) < 0.01        # the normal's shape
    assert abs(np.corrcoef(normals[0::2], normals[1::2])[0, 1]) < 0.02   # a pair: independent
    u = data.row_uniforms(0, 0, 512, None, 256)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    assert abs(u.var() - 1 / 12) < 0.002
    counts = np.bincount(data.row_integers(0, 0, 512, None, 70, 7).ravel(), minlength=7)
    assert counts.size == 7 and np.all(np.abs(counts / counts.sum() - 1 / 7) < 0.01)
