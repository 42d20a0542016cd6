"""Finite-difference checks of every autograd op, and of the tape's own rules.

Each op's backward is compared, in float64, with central differences
(f(x + eps) - f(x - eps)) / 2 eps of a random weighted sum of its output, so
every output element gets its own upstream gradient. Then the tape: gradient
accumulation, broadcasting, `no_grad`, determinism, several roots, deferred
weight gradients, and whole-model checks of the MLP and MoE losses.

    python -m pytest tests/core/test_autograd.py
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from minipar.core import attention, fused_layers, nn
from minipar.core import autograd as ag
from minipar.core.autograd import Tensor

RNG = np.random.default_rng(1234)


def normal(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def positive(*shape: int) -> np.ndarray:
    return RNG.uniform(0.5, 2.0, shape)


def gradcheck(fn, *inputs: np.ndarray, eps: float = 1e-6, rtol: float = 1e-6,
              atol: float = 1e-8) -> None:
    """Backward of `fn` (Tensors -> Tensor or list of Tensors) against central differences
    of sum(out * w) for fixed random w, for every element of every input."""
    tensors = [Tensor(np.array(a, dtype=np.float64), requires_grad=True) for a in inputs]
    outs = fn(*tensors)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    rng = np.random.default_rng(7)
    weights = [rng.standard_normal(o.shape) for o in outs]
    ag.backward_from(list(zip(outs, weights)))

    def value(arrays: list[np.ndarray]) -> float:
        with ag.no_grad():
            got = fn(*[Tensor(a) for a in arrays])
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        return sum(float(np.sum(o.data * w)) for o, w in zip(got, weights))

    base = [t.data.copy() for t in tensors]
    for i, t in enumerate(tensors):
        assert t.grad is not None and t.grad.shape == t.shape, f"input {i}: gradient shape"
        numeric = np.zeros(t.shape)
        for index in np.ndindex(t.shape):
            plus, minus = [a.copy() for a in base], [a.copy() for a in base]
            plus[i][index] += eps
            minus[i][index] -= eps
            numeric[index] = (value(plus) - value(minus)) / (2 * eps)
        np.testing.assert_allclose(t.grad, numeric, rtol=rtol, atol=atol,
                                   err_msg=f"input {i} of {fn}")


ROWS = np.array([2, 0, 2, 3, 2])        # repeated indices: their gradients must add up
LABELS = np.array([1, 0, 3, 3])
IDS = np.array([[2, 0, 2], [3, 2, 3]])   # token ids (B, T), repeated: gradients add up

# (op under test, id, fn, inputs)
CASES = [
    ("add", "matrix+row", lambda a, b: a + b, [normal(3, 4), normal(4)]),
    ("add", "row+matrix", lambda a, b: ag.add(a, b), [normal(4), normal(3, 4)]),
    ("add", "col+row", lambda a, b: a + b, [normal(3, 1), normal(1, 4)]),
    ("add", "scalar+3d", lambda a, b: a + b, [normal(), normal(2, 3, 4)]),
    ("sub", "matrix-col", lambda a, b: a - b, [normal(3, 4), normal(3, 1)]),
    ("sub", "row-3d", lambda a, b: ag.sub(a, b), [normal(4), normal(2, 3, 4)]),
    ("mul", "3d*col", lambda a, b: a * b, [normal(2, 3, 4), normal(3, 1)]),
    ("mul", "row*col", lambda a, b: ag.mul(a, b), [normal(1, 4), normal(5, 1)]),
    ("div", "matrix/row", lambda a, b: a / b, [normal(3, 4), positive(4)]),
    ("div", "row/matrix", lambda a, b: ag.div(a, b), [normal(4), positive(3, 4)]),
    ("exp", "", ag.exp, [normal(3, 4)]),
    ("log", "", ag.log, [positive(3, 4)]),
    ("tanh", "", ag.tanh, [normal(3, 4)]),
    ("sqrt", "", ag.sqrt, [positive(3, 4)]),
    ("gelu", "", fused_layers.gelu, [2 * normal(4, 5)]),
    # without --mixed the identity (its rounding under the policy: test_precision.py)
    ("round_low", "", lambda a: fused_layers.round_low(a) * a, [normal(3, 4)]),
    ("sum_", "all", lambda a: a.sum(), [normal(2, 3, 4)]),
    ("sum_", "axis0", lambda a: ag.sum_(a, 0), [normal(2, 3, 4)]),
    ("sum_", "axes02", lambda a: ag.sum_(a, (0, 2)), [normal(2, 3, 4)]),
    ("sum_", "last-keepdims", lambda a: ag.sum_(a, -1, keepdims=True), [normal(2, 3, 4)]),
    ("mean", "all", lambda a: a.mean(), [normal(2, 3, 4)]),
    ("mean", "axis1", lambda a: ag.mean(a, 1), [normal(2, 3, 4)]),
    ("mean", "axes-12-keepdims", lambda a: ag.mean(a, (-1, -2), keepdims=True),
     [normal(2, 3, 4)]),
    ("reshape", "", lambda a: ag.reshape(a, (4, 6)), [normal(2, 3, 4)]),
    ("reshape", "method", lambda a: a.reshape(6, -1), [normal(2, 3, 4)]),
    ("transpose", "2d", lambda a: a.T, [normal(3, 4)]),
    ("transpose", "axes", lambda a: ag.transpose(a, (1, 2, 0)), [normal(2, 3, 4)]),
    ("getitem", "slices", lambda a: a[1:3, ::2], [normal(4, 5)]),
    ("getitem", "negative-step", lambda a: a[::-2, 1], [normal(5, 3)]),
    ("getitem", "repeated-rows", lambda a: a[ROWS], [normal(4, 3)]),
    ("getitem", "pairs", lambda a: a[ROWS, np.array([0, 1, 0, 2, 0])], [normal(4, 3)]),
    ("take_rows", "", lambda a: ag.take_rows(a, ROWS), [normal(4, 3)]),
    ("index_add", "", lambda base, v: ag.index_add(base, ROWS, v), [normal(4, 3), normal(5, 3)]),
    ("concat", "axis0", lambda a, b: ag.concat([a, b]), [normal(2, 3), normal(4, 3)]),
    ("concat", "axis1", lambda a, b, c: ag.concat([a, b, c], axis=1),
     [normal(2, 3), normal(2, 1), normal(2, 2)]),
    ("split", "equal", lambda a: ag.split(a, 3), [normal(6, 2)]),
    ("split", "at-indices-axis1", lambda a: ag.split(a, [1, 4], axis=1), [normal(2, 5)]),
    ("matmul", "", lambda a, b: a @ b, [normal(3, 4), normal(4, 5)]),
    ("matmul", "3d@weight", lambda a, b: a @ b, [normal(2, 3, 4), normal(4, 5)]),
    ("matmul", "batched", lambda a, b: a @ b, [normal(2, 3, 4), normal(2, 4, 5)]),
    ("matmul", "broadcast-batch", lambda a, b: ag.matmul(a, b),
     [normal(2, 1, 3, 4), normal(3, 4, 2)]),
    ("linear", "bias", fused_layers.linear, [normal(3, 4), normal(4, 5), normal(5)]),
    ("linear", "sequence", fused_layers.linear, [normal(2, 3, 4), normal(4, 5), normal(5)]),
    ("linear", "no-bias", fused_layers.linear, [normal(3, 4), normal(4, 5)]),
    ("layer_norm", "2d", fused_layers.layer_norm, [normal(3, 6), positive(6), normal(6)]),
    ("layer_norm", "3d", fused_layers.layer_norm, [normal(2, 3, 5), positive(5), normal(5)]),
    ("residual_mlp", "2d", fused_layers.residual_mlp,
     [normal(3, 4), positive(4), normal(4), normal(4, 6), normal(6), normal(6, 4), normal(4)]),
    ("residual_mlp", "3d", fused_layers.residual_mlp,
     [normal(2, 3, 4), positive(4), normal(4), normal(4, 6), normal(6), normal(6, 4), normal(4)]),
    ("softmax", "last", fused_layers.softmax, [normal(3, 5)]),
    ("softmax", "axis0", lambda a: fused_layers.softmax(a, axis=0), [normal(3, 5)]),
    ("log_softmax", "", fused_layers.log_softmax, [normal(3, 5)]),
    ("log_softmax", "axis0", lambda a: fused_layers.log_softmax(a, axis=0), [normal(3, 5)]),
    ("cross_entropy", "mean", lambda z: fused_layers.cross_entropy(z, LABELS), [normal(4, 5)]),
    ("cross_entropy", "scale", lambda z: fused_layers.cross_entropy(z, LABELS, scale=0.37),
     [normal(4, 5)]),
    ("cross_entropy", "sequence", lambda z: fused_layers.cross_entropy(z, LABELS.reshape(2, 2)),
     [normal(2, 2, 5)]),
    ("embedding", "repeated-ids", lambda w: attention.embedding(w, IDS), [normal(4, 3)]),
    ("embedding", "positions", lambda w: attention.embedding(w, np.array([3, 1, 2])),
     [normal(5, 2)]),
    ("causal_mask", "through-softmax", lambda s: fused_layers.softmax(
        attention.causal_mask(s, np.arange(4), np.arange(4))), [normal(2, 4, 4)]),
    ("causal_mask", "later-queries", lambda s: fused_layers.softmax(
        attention.causal_mask(s, np.array([4, 5]), np.arange(2, 7))), [normal(2, 5)]),
    ("attention", "2-heads", lambda q, k, v: attention.attention(q, k, v, 2),
     [normal(2, 5, 6), normal(2, 5, 6), normal(2, 5, 6)]),
    ("attention", "positions", lambda q, k, v: attention.attention(
        q, k, v, 3, np.array([3, 4]), np.arange(5)),
     [normal(1, 2, 6), normal(1, 5, 6), normal(1, 5, 6)]),
    ("attention", "a-row-sees-nothing", lambda q, k, v: attention.attention(
        q, k, v, 1, np.array([0, 2]), np.array([1, 2])),
     [normal(2, 2, 3), normal(2, 2, 3), normal(2, 2, 3)]),
    ("attention", "key-bias", lambda q, k, v, b: attention.attention(q, k, v, 2, key_bias=b),
     [normal(2, 4, 6), normal(2, 4, 6), normal(2, 4, 6), normal(6)]),
    ("attention_lse", "", lambda q, k: attention.attention_lse(q, k, 2),
     [normal(2, 4, 6), normal(2, 4, 6)]),
    ("attention_lse", "key-bias", lambda q, k, b: attention.attention_lse(
        q, k, 2, key_bias=b), [normal(2, 4, 6), normal(2, 4, 6), normal(6)]),
    ("attention_lse", "positions", lambda q, k: attention.attention_lse(
        q, k, 1, np.array([2, 3]), np.arange(4)), [normal(1, 2, 3), normal(1, 4, 3)]),
    ("sugar", "neg-rsub-rdiv", lambda a: 2.0 - (-a) / 3.0 + 1.0 / (a * a + 1.0), [normal(3)]),
    ("sugar", "ndarray-left", lambda a: np.arange(3.0) * a + np.ones(3), [normal(3)]),
]


@pytest.mark.parametrize("op,label,fn,inputs", CASES,
                         ids=[f"{op}-{label}" if label else op for op, label, _, _ in CASES])
def test_op_gradient(op, label, fn, inputs):
    gradcheck(fn, *inputs)


def test_every_op_has_a_gradient_check():
    """A new op in autograd.py, core/fused_layers.py or attention.py must come with its
    finite-difference case above."""
    tape_machinery = {"no_grad", "defer_weight_grads", "backward_from", "as_tensor",
                      # plain NumPy helpers, no tape node
                      "allowed", "rows_summed_by_id", "weight_grad",
                      "split_heads", "merge_heads"}
    ops = {name for module in (ag, fused_layers, attention) for name, f in vars(module).items()
           if inspect.isfunction(f) and f.__module__ == module.__name__
           and not name.startswith("_")}
    missing = ops - tape_machinery - {op for op, *_ in CASES}
    assert not missing, f"ops without a finite-difference check: {sorted(missing)}"


# ------------------------------------------------------------ tape rules
def test_tensor_used_twice_accumulates():
    x = Tensor(normal(4), requires_grad=True)
    (x * x + x).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 1, rtol=1e-14)
    y = Tensor(normal(3), requires_grad=True)
    ag.concat([y, y]).sum().backward()            # the same tensor twice in one op
    np.testing.assert_array_equal(y.grad, np.full(3, 2.0))
    ag.mul(y, 3.0).sum().backward()               # a second graph adds to .grad
    np.testing.assert_array_equal(y.grad, np.full(3, 5.0))


def test_broadcasting_backward_sums_over_broadcast_axes():
    a = Tensor(normal(3, 1), requires_grad=True)
    b = Tensor(normal(4), requires_grad=True)
    c = Tensor(normal(), requires_grad=True)
    ((a + b) * c).backward(np.ones((3, 4)))
    assert a.grad.shape == (3, 1) and b.grad.shape == (4,) and c.grad.shape == ()
    np.testing.assert_allclose(a.grad, np.full((3, 1), 4 * c.data), rtol=1e-14)
    np.testing.assert_allclose(b.grad, np.full(4, 3 * c.data), rtol=1e-14)
    np.testing.assert_allclose(c.grad, (a.data + b.data).sum(), rtol=1e-14)


def test_no_grad_builds_no_tape():
    x, w = Tensor(normal(2, 3), requires_grad=True), Tensor(normal(3, 4), requires_grad=True)
    with ag.no_grad():
        y = fused_layers.gelu(fused_layers.linear(x, w)).sum()
    assert not y.requires_grad and y.parents == () and y._backward is None
    z = fused_layers.linear(x, w).sum()                     # the tape is back after the block
    assert z.requires_grad and z.parents
    assert not x.detach().requires_grad


def tiny_model(model: str = "mlp", **sizes: object) -> tuple[nn.Model, np.ndarray, np.ndarray]:
    """A small model with O(1) random weights and biases (so every path is exercised)."""
    cfg = nn.ModelConfig(model=model, layers=2, d_in=5, d_model=8, d_ff=12, classes=4,
                         experts=4, expert_d_ff=6, **sizes)
    rng = np.random.default_rng(3)
    full = {name: rng.normal(1.0 if name.endswith("ln.weight") else 0.0, 0.5, value.shape)
            for name, value in nn.init_params(cfg, 0).items()}
    x = rng.standard_normal((12, cfg.d_in))
    y = rng.integers(0, cfg.classes, 12)
    return nn.build_reference(cfg, full), x, y


@pytest.mark.parametrize("model", ["mlp", "moe"])
def test_backward_is_deterministic(model):
    net, x, y = tiny_model(model)
    runs = []
    for _ in range(2):
        net.zero_grad()
        nn.loss_fn(net, x, y).backward()
        runs.append([p.grad.copy() for p in net.parameters()])
    for first, second in zip(*runs):
        assert np.array_equal(first, second)


def test_backward_from_two_roots_equals_the_sum_of_each():
    x0, w0 = normal(3, 4), normal(4, 5)
    seed_vector, seed_scalar = normal(3), 0.7

    def graph() -> tuple[Tensor, Tensor, Tensor]:
        x = Tensor(x0, requires_grad=True)
        h = ag.tanh(x @ Tensor(w0))               # shared by both roots
        return x, h.sum(axis=1), (h * h).mean()

    x, r1, r2 = graph()
    ag.backward_from([(r1, seed_vector), (r2, seed_scalar)])
    xa, ra, _ = graph()
    ra.backward(seed_vector)
    xb, _, rb = graph()
    rb.backward(np.asarray(seed_scalar))
    np.testing.assert_allclose(x.grad, xa.grad + xb.grad, rtol=1e-13)


def test_deferred_weight_gradients():
    x0, w1, b1, w2, w3 = normal(4, 3), normal(3, 5), normal(5), normal(5, 6), normal(6, 2)

    def forward() -> tuple[Tensor, list[Tensor]]:
        x = Tensor(x0, requires_grad=True)
        ws = [Tensor(a, requires_grad=True) for a in (w1, b1, w2, w3)]
        hidden = fused_layers.gelu(fused_layers.linear(x, ws[0], ws[1]))
        out = fused_layers.linear(hidden, ws[2]) @ ws[3]
        return out, [x, *ws]

    out, now = forward()
    out.backward(np.ones(out.shape))
    out, later = forward()
    with ag.defer_weight_grads() as pending:
        out.backward(np.ones(out.shape))
    assert np.array_equal(later[0].grad, now[0].grad)       # input gradient: there already
    assert all(t.grad is None for t in later[1:])           # weight gradients: not yet
    assert len(pending) == 3                                # linear, linear, matmul
    for work in pending:
        work()
    for deferred, direct in zip(later, now):
        assert np.array_equal(deferred.grad, direct.grad)


# ------------------------------------------------- whole-model checks
PICKS = {
    "mlp": ["embed.weight", "blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.fc1.weight",
            "blocks.1.fc1.bias", "blocks.1.fc2.weight", "head.weight", "head.bias"],
    "moe": ["embed.weight", "blocks.0.ln.weight", "blocks.0.router.weight",
            "blocks.1.router.weight", "head.weight"]
           + [f"blocks.{i}.experts.{e}.fc{j}.weight" for i in (0, 1) for e in range(4)
              for j in (1, 2)],
}


@pytest.mark.parametrize("model,sizes", [
    ("mlp", {}),
    ("moe", {"top_k": 1, "aux_coef": 0.5}),
    ("moe", {"top_k": 2, "aux_coef": 0.5, "capacity_factor": 0.75}),
], ids=["mlp", "moe-top1", "moe-top2-capacity"])
def test_model_loss_gradient(model, sizes):
    """d loss / d (a few entries of several weights) against central differences."""
    net, x, y = tiny_model(model, **sizes)
    params = {p.name: p for p in net.parameters()}
    nn.loss_fn(net, x, y).backward()
    rng = np.random.default_rng(11)
    checked = 0
    for name in PICKS[model]:
        p = params[name]
        for _ in range(2):
            index = tuple(int(rng.integers(n)) for n in p.shape)
            keep = p.data[index]
            p.data[index] = keep + 1e-6
            up = nn.loss_fn(net, x, y).item()
            p.data[index] = keep - 1e-6
            down = nn.loss_fn(net, x, y).item()
            p.data[index] = keep
            numeric = (up - down) / 2e-6
            assert abs(p.grad[index] - numeric) <= 1e-6 * max(1.0, abs(numeric)), name
            checked += p.grad[index] != 0
    assert checked >= len(PICKS[model])          # most picks carry a real gradient


# ------------------------------------------------------------ attention
def test_attention_equals_the_per_head_formula():
    """The batched node against docs/design.md's formula written head by head, in plain NumPy:
    S_h = q_h k_h^T / sqrt(dh), -inf above the diagonal, o_h = softmax(S_h) v_h."""
    q, k, v = normal(2, 5, 6), normal(2, 5, 6), normal(2, 5, 6)
    heads, dh = 3, 2
    expected = []
    for h in range(heads):
        cols = slice(h * dh, (h + 1) * dh)
        s = q[..., cols] @ k[..., cols].transpose(0, 2, 1) / np.sqrt(dh)
        s = np.where(np.tril(np.ones((5, 5), dtype=bool)), s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        expected.append(p / p.sum(axis=-1, keepdims=True) @ v[..., cols])
    got = attention.attention(Tensor(q), Tensor(k), Tensor(v), heads).data
    np.testing.assert_allclose(got, np.concatenate(expected, axis=-1), rtol=1e-13, atol=1e-15)


def test_attention_lse_merges_two_blocks_of_keys():
    """Online softmax: attention over keys [0, 6) equals the lse-weighted merge of the
    attention over keys [0, 3) and over keys [3, 6), for queries at positions 4, 5 -- and
    a query that sees no key of a block (position 1 vs keys 3..5) gets 0 and -inf there."""
    q, k, v = (Tensor(normal(2, 3, 4)), Tensor(normal(2, 6, 4)), Tensor(normal(2, 6, 4)))
    q_pos = np.array([1, 4, 5])
    parts = []
    for keys in (slice(0, 3), slice(3, 6)):
        kb, vb = Tensor(k.data[:, keys]), Tensor(v.data[:, keys])
        pos = np.arange(6)[keys]
        parts.append((attention.attention(q, kb, vb, 2, q_pos, pos).data,
                      attention.attention_lse(q, kb, 2, q_pos, pos).data))
    (o_a, lse_a), (o_b, lse_b) = parts
    assert np.isneginf(lse_b[:, :, 0]).all() and np.all(o_b[:, 0] == 0.0)
    lse = np.logaddexp(lse_a, lse_b)                              # (B, H, Tq)

    def weight(part: np.ndarray) -> np.ndarray:                   # (B, H, Tq) -> (B, Tq, H*dh)
        return np.repeat(np.exp(part - lse).transpose(0, 2, 1), 2, axis=-1)
    merged = weight(lse_a) * o_a + weight(lse_b) * o_b
    whole = attention.attention(q, k, v, 2, q_pos, np.arange(6)).data
    np.testing.assert_allclose(merged, whole, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, attention.attention_lse(q, k, 2, q_pos, np.arange(6)).data,
                               rtol=1e-13)


@pytest.mark.parametrize("model,sizes", [
    ("gpt", {}),
    ("gpt-moe", {"top_k": 2, "aux_coef": 0.5, "capacity_factor": 0.75}),
], ids=["gpt", "gpt-moe-top2-capacity"])
def test_transformer_loss_gradient(model, sizes):
    """The transformer's loss: d loss / d (entries of every kind of weight) against central
    differences, with O(1) random weights so attention is far from uniform."""
    from minipar.core import gpt

    cfg = nn.ModelConfig(model=model, layers=2, d_model=8, d_ff=12, vocab=7, seq_len=5,
                         heads=2, experts=4, expert_d_ff=6, **sizes)
    rng = np.random.default_rng(5)
    full = {name: rng.normal(1.0 if name.split(".")[-2] in nn.LAYER_NORMS
                             and name.endswith("weight") else 0.0, 0.5, value.shape)
            for name, value in nn.init_params(cfg, 0).items()}
    net = gpt.build_reference(cfg, full)
    x, y = rng.integers(0, cfg.vocab, (3, cfg.seq_len)), rng.integers(0, cfg.vocab, (3, 5))
    params = {p.name: p for p in net.parameters()}
    nn.loss_fn(net, x, y).backward()
    picks = [name for name in params if ".experts." not in name or ".experts.1." in name]
    for name in picks:
        p = params[name]
        index = tuple(int(rng.integers(n)) for n in p.shape)
        keep = p.data[index]
        p.data[index] = keep + 1e-6
        up = nn.loss_fn(net, x, y).item()
        p.data[index] = keep - 1e-6
        down = nn.loss_fn(net, x, y).item()
        p.data[index] = keep
        numeric = (up - down) / 2e-6
        assert abs(p.grad[index] - numeric) <= 1e-6 * max(1.0, abs(numeric)), name
