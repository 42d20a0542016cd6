"""DeepSeek-V3 routing (minipar/core/routing.py) in one process: the pieces, and the model.

- sigmoid: its gradient against finite differences, and no overflow at large |z|;
- choice: top-k of s + b with ties to the lower id; node-limited choice keeps every
  token inside its M groups, and those are the groups of largest top-2 sum (a loop
  over tokens written out here, against the vectorized mask);
- b: `bias_step` moves each b_e by rate towards balance; applied step after step on
  fixed skewed scores it drives the max/mean load down (what the bias is for);
- the reference model (nn.MoEBlock under train_reference) with sigmoid-bias, shared
  experts and node-limited routing equals tests/reference/independent.py (and gpt-moe
  tests/reference/independent_gpt.py), written from the formulas with their own backward
  (float64, rel 1e-9), b included;
- the flags: which combinations run, which are refused (validation.routing_problems).

    python -m pytest tests/core/test_routing.py
"""

from __future__ import annotations

import numpy as np
import pytest

from minipar.core import autograd as ag
from minipar.core import nn, routing
from minipar.run.train import train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.validation import problems
from tests.conftest import assert_equivalent
from tests.reference import independent, independent_gpt

SMALL = {"model": "moe", "layers": 2, "d_in": 8, "d_model": 16, "classes": 5, "batch": 16,
         "experts": 8, "expert_d_ff": 12, "steps": 4}


def test_sigmoid_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    z = ag.Tensor(rng.normal(size=(5, 3)) * 3, requires_grad=True)
    w = rng.normal(size=(5, 3))
    (routing.sigmoid(z) * w).sum().backward()
    eps, numeric = 1e-6, np.zeros_like(z.data)
    for i in np.ndindex(z.shape):
        up, down = z.data.copy(), z.data.copy()
        up[i] += eps
        down[i] -= eps
        numeric[i] = ((routing.sigmoid(ag.Tensor(up)).data * w).sum()
                      - (routing.sigmoid(ag.Tensor(down)).data * w).sum()) / (2 * eps)
    assert np.allclose(z.grad, numeric, rtol=1e-7, atol=1e-9)
    with np.errstate(over="raise"):
        far = routing.sigmoid(ag.Tensor(np.array([-800.0, 0.0, 800.0]))).data
    assert far.tolist() == [0.0, 0.5, 1.0]


def test_choice_adds_the_bias_and_breaks_ties_to_the_lower_id():
    scores = np.array([[0.5, 0.5, 0.2, 0.9]])
    assert routing.choose(scores, 2).tolist() == [[3, 0]]
    assert routing.choose(scores + np.array([0.0, 0.5, 0.0, 0.0]), 2).tolist() == [[1, 3]]
    s = ag.Tensor(scores, requires_grad=True)
    chosen, token_of, expert_of, gates = routing.route(s, 2, bias=np.array([0, 0, 0.4, 0]))
    assert chosen.tolist() == [[3, 2]]                        # 0.2 + 0.4 beats 0.5
    assert np.allclose(gates.data, [0.9 / 1.1, 0.2 / 1.1])   # gates from s alone, not s + b


def test_node_limited_choice_keeps_each_token_in_its_best_groups():
    rng = np.random.default_rng(1)
    selection = rng.random((200, 12))
    groups, top, k = 4, 2, 3
    chosen = routing.choose(selection, k, groups, top)
    per = 12 // groups
    for row, picks in zip(selection, chosen):   # a loop over tokens: the test, not the code
        affinity = [sorted(row[g * per:(g + 1) * per])[-2:] for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -sum(affinity[g]))[:top]
        inside = [e for g in best for e in range(g * per, (g + 1) * per)]
        assert set(picks // per) <= set(best)
        assert list(picks) == sorted(inside, key=lambda e: -row[e])[:k]
    reached = routing.groups_reached(np.repeat(np.arange(200), k), chosen.ravel(), 200, 12,
                                     groups)
    assert reached.sum(axis=1).max() <= top
    unlimited = routing.choose(selection, k)
    assert np.bincount(unlimited.ravel() // per, minlength=groups).size == groups
    assert (routing.groups_reached(np.repeat(np.arange(200), k), unlimited.ravel(), 200,
                                   12, groups).sum(axis=1) > top).any()  # the limit binds


def test_the_bias_step_and_its_effect_on_a_skewed_router():
    b = routing.bias_step(np.zeros(4), np.array([10, 2, 2, 2]), 0.01)
    assert b.tolist() == [-0.01, 0.01, 0.01, 0.01]
    assert routing.bias_step(b, np.array([4, 4, 4, 4]), 0.01).tolist() == b.tolist()
    rng = np.random.default_rng(2)
    scores = 1 / (1 + np.exp(-(rng.normal(size=(512, 8)) + np.linspace(-1, 1, 8))))
    bias = np.zeros(8)
    imbalance = []
    for _ in range(200):
        load = np.bincount(routing.choose(scores + bias, 2).ravel(), minlength=8)
        imbalance.append(load.max() / load.mean())
        bias = routing.bias_step(bias, load, 1e-3 * 5)
    assert imbalance[0] > 2.0 and max(imbalance[-20:]) < 1.2


def test_balances_are_found_in_model_order_and_reset_after_an_update():
    cfg = TrainConfig(**SMALL, router="sigmoid-bias").resolved(1)
    model = nn.build_reference(cfg.model_config(), nn.init_params(cfg.model_config(), 0))
    states = routing.balances([model])
    assert [s.name for s in states] == ["blocks.0.router.bias_balance",
                                        "blocks.1.router.bias_balance"]
    states[0].load[:] = [8, 0, 0, 0, 0, 0, 0, 0]
    routing.update_biases([model], None, 0.5)
    assert states[0].value.tolist() == [-0.5] + [0.5] * 7 and not states[0].load.any()
    with routing.not_counting():
        states[1].count(np.array([1, 1, 2]))
    assert not states[1].load.any()
    # a block built from a full dict holding its b (generate --resume) starts from it
    full = {**nn.init_params(cfg.model_config(), 0),
            "blocks.1.router.bias_balance": np.arange(8) * 0.25}
    again = nn.build_reference(cfg.model_config(), full)
    assert routing.balances([again])[1].value.tolist() == (np.arange(8) * 0.25).tolist()
    assert not routing.balances([again])[0].value.any()


@pytest.mark.parametrize("fields", [
    dict(router="sigmoid-bias", bias_rate=0.02, shared_experts=2, top_k=2),
    dict(router="sigmoid-bias", bias_rate=0.02, route_groups=4, route_top_groups=2, top_k=3,
         microbatches=2, optimizer="adam", lr=0.01),
    dict(route_groups=2, route_top_groups=1, shared_experts=1, capacity_factor=1.0),
])
def test_the_reference_equals_the_independent_implementation(fields):
    cfg = TrainConfig(**{**SMALL, **fields}).resolved(1)
    mine = independent.train(cfg)
    ref = train_reference(cfg)
    assert_equivalent({"losses": mine.losses, "final": mine.final}, ref, label=str(fields))
    if cfg.router == "sigmoid-bias":  # b moved, by whole steps of the rate
        b = ref.final["blocks.0.router.bias_balance"]
        assert np.abs(b).max() > 0
        assert np.allclose(b / cfg.bias_rate, np.round(b / cfg.bias_rate))


def test_the_transformer_equals_the_independent_implementation():
    """gpt-moe with sigmoid-bias, a shared expert and node-limited routing against
    tests/reference/independent_gpt.py (which routes with independent.moe_ffn)."""
    cfg = TrainConfig(model="gpt-moe", layers=2, d_model=16, heads=2, seq_len=6, vocab=12,
                      batch=4, experts=4, expert_d_ff=8, top_k=2, steps=3, microbatches=2,
                      router="sigmoid-bias", bias_rate=0.01, shared_experts=1,
                      route_groups=2, route_top_groups=1).resolved(1)
    mine = independent_gpt.train(cfg)
    ref = train_reference(cfg)
    assert_equivalent({"losses": mine.losses, "final": mine.final}, ref, label="gpt-moe")
    assert max(np.abs(ref.final[f"blocks.{i}.router.bias_balance"]).max()
               for i in range(2)) > 0


@pytest.mark.parametrize("fields,runs", [
    (dict(router="sigmoid-bias"), True),                       # aux off by default
    (dict(router="sigmoid-bias", aux_coef=0.0, bias_rate=0.0), True),
    (dict(router="sigmoid-bias", aux_coef=0.01), False),       # the bias replaces the loss
    (dict(aux_coef=0.05, route_groups=4, route_top_groups=4), True),
    (dict(bias_rate=0.001), False),                            # softmax has no b
    (dict(router="sigmoid-bias", bias_rate=-1.0), False),
    (dict(route_groups=3), False),                             # 3 does not divide 8
    (dict(route_groups=4, route_top_groups=5), False),
    (dict(route_groups=4, route_top_groups=1, top_k=3), False),  # 2 experts in one group
    (dict(router="sigmoid-bias", pp=2, schedule="dualpipe", microbatches=4, layers=4),
     False),
    (dict(shared_experts=-1), False),
    (dict(model="mlp", router="sigmoid-bias"), False),
])
def test_which_combinations_run(fields, runs):
    cfg = TrainConfig(**{**SMALL, **fields}).resolved(fields.get("pp", 1))
    found = problems(cfg, fields.get("pp", 1))
    assert (found == []) == runs, found
    assert len(found) <= 1, found
    if cfg.router == "sigmoid-bias" and runs:
        assert cfg.aux_coef == 0.0 and cfg.bias_rate is not None
