"""minipar's single-process transformer against an independent implementation of docs/design.md.

`train_reference` on `--model gpt` / `gpt-moe` (attention.py + gpt.py + nn.py + optim.py)
is compared with `tests/reference/independent_gpt.py`: plain NumPy, attention head by head,
gradients by hand. Losses and final parameters must agree to relative 1e-9 after 3
steps, dense and MoE (top-1/top-2, with and without capacity drops), SGD and Adam, one
or two microbatches, and on byte windows of a text file. Then the data and the task:
the copy task is deterministic and learnable only by looking back.

    python -m pytest tests/core/test_gpt_reference.py
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from minipar.core import nn
from minipar.core.data import make_sequences, make_text_windows, repeated_positions
from minipar.run.train import train_reference
from minipar.settings.config import TrainConfig
from tests.conftest import assert_equivalent
from tests.harness.mpi import ROOT
from tests.reference import independent_gpt

SMALL = {"model": "gpt", "layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "vocab": 16,
         "batch": 8, "steps": 3, "d_ff": 24}
MOE = {"model": "gpt-moe", "experts": 4, "expert_d_ff": 12, "aux_coef": 0.1}
LR = {"sgd": 0.1, "adam": 0.01}


def config(**fields: object) -> TrainConfig:
    return TrainConfig(**{**SMALL, **fields}).resolved(1)


def compare(cfg: TrainConfig) -> independent_gpt.Run:
    mine = independent_gpt.train(cfg)
    assert_equivalent({"losses": mine.losses, "final": mine.final}, train_reference(cfg),
                      label=str(cfg))
    return mine


@pytest.mark.parametrize("model", ["gpt", "gpt-moe"])
def test_init_rule(model):
    """The independent draw of docs/design.md's init is nn.init_params, names, order and bits."""
    cfg = config(**(MOE if model == "gpt-moe" else {}), layers=3)
    mine = independent_gpt.init_params(cfg, 5)
    theirs = nn.init_params(cfg.model_config(), 5)
    assert list(mine) == list(theirs) == list(nn.canonical_shapes(cfg.model_config()))
    for name, value in theirs.items():
        assert np.array_equal(mine[name], value), name


@pytest.mark.parametrize("optimizer,microbatches", list(itertools.product(LR, (1, 2))))
def test_gpt_matches_independent(optimizer, microbatches):
    compare(config(optimizer=optimizer, lr=LR[optimizer], microbatches=microbatches))


@pytest.mark.parametrize("top_k,capacity,optimizer,microbatches", list(itertools.product(
    (1, 2), (None, 0.75), LR, (1, 2))))
def test_gpt_moe_matches_independent(top_k, capacity, optimizer, microbatches):
    run = compare(config(**MOE, top_k=top_k, capacity_factor=capacity, optimizer=optimizer,
                         lr=LR[optimizer], microbatches=microbatches))
    if capacity is None:
        assert sum(run.dropped) == 0
    else:                                  # capacity 0.75 < 1 must drop assignments
        assert sum(run.dropped) > 0, "no assignment was dropped: capacity is not exercised"


def test_text_file_matches_independent():
    compare(config(data=str(ROOT / "README.md"), vocab=None, optimizer="adam", lr=0.01))


# ------------------------------------------------------------------ data
def test_copy_task_repeats_its_first_half():
    x, y = make_sequences(3, 7, batch=5, seq_len=9, vocab=11)
    again = make_sequences(3, 7, batch=5, seq_len=9, vocab=11)
    assert np.array_equal(x, again[0]) and np.array_equal(y, again[1])   # (seed, step) only
    assert x.shape == y.shape == (5, 9) and x.dtype == np.int64
    assert np.array_equal(y[:, :-1], x[:, 1:])                          # y is the next token
    sequence = np.concatenate([x, y[:, -1:]], axis=1)                   # (B, T+1), half 5
    assert np.array_equal(sequence[:, 5:], sequence[:, :5])
    assert repeated_positions(9).tolist() == [False] * 4 + [True] * 5
    assert not np.array_equal(x, make_sequences(3, 8, 5, 9, 11)[0])


def test_text_windows_are_bytes_of_the_file():
    path = ROOT / "README.md"
    corpus = path.read_bytes()
    x, y = make_text_windows(str(path), 0, 2, batch=4, seq_len=12)
    assert x.shape == y.shape == (4, 12)
    for row_x, row_y in zip(x, y):
        window = bytes(np.concatenate([row_x, row_y[-1:]]).astype(np.uint8).tolist())
        assert window in corpus and np.array_equal(row_y[:-1], row_x[1:])
    assert np.array_equal(x, make_text_windows(str(path), 0, 2, 4, 12)[0])


def test_attention_learns_to_look_back():
    """Trained a little on the copy task, the positions whose next token repeats an earlier
    one fall far below log V; the first half (unpredictable) stays near log V."""
    cfg = TrainConfig(model="gpt", layers=2, d_model=32, heads=2, seq_len=16, vocab=8,
                      batch=16, steps=250, optimizer="adam", lr=0.005).resolved(1)
    model = train_reference_model(cfg)
    x, y = make_sequences(cfg.seed, 10_000, 64, cfg.seq_len, cfg.vocab)
    logits, _ = model.forward(nn.Tensor(x))
    z = logits.data - logits.data.max(axis=-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]     # (B, T)
    repeated = repeated_positions(cfg.seq_len)
    assert nll[:, repeated].mean() < 0.3 * np.log(cfg.vocab), nll.mean(axis=0)
    assert nll[:, ~repeated].mean() > 0.8 * np.log(cfg.vocab), nll.mean(axis=0)


def train_reference_model(cfg: TrainConfig) -> nn.Model:
    from minipar.run.reference import build_reference

    final = train_reference(cfg).final
    return build_reference(cfg, final)


@pytest.mark.parametrize("model", ["gpt", "gpt-moe"])
def test_float32_stays_float32_on_every_node(model):
    """Every value on the tape of a float32 transformer is float32 (a float64 constant
    anywhere would silently double the work), and it trains like float64."""
    from minipar.core import autograd as ag
    from minipar.run.reference import build_reference, step_batch

    fields = {**(MOE if model == "gpt-moe" else {}), "optimizer": "adam", "lr": 0.01}
    cfg = config(dtype="float32", **fields)
    net = build_reference(cfg, nn.init_params(cfg.model_config(), 0, "float32"))
    loss = nn.loss_fn(net, *step_batch(cfg, 0))
    floats = {node.data.dtype for node in ag._topological_order([loss])
              if node.data.dtype.kind == "f"}
    assert floats == {np.dtype("float32")}, floats
    single, double = train_reference(cfg), train_reference(config(**fields))
    np.testing.assert_allclose(single.losses, double.losses, rtol=1e-5)
