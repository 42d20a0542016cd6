"""The reference model: a residual MLP, and the same model with Mixture-of-Experts blocks.

What this file teaches: the exact single-process math every parallel strategy
must reproduce (docs/design.md, "The reference model"):

    h0 = x @ We + be
    h_l = h_{l-1} + FFN_l(LN_l(h_{l-1}))            pre-LayerNorm residual blocks
    dense FFN(u) = GELU(u @ W1 + b1) @ W2 + b2
    MoE   FFN(u) = sum_{e in topk(softmax(u @ Wr))} g_e * Expert_e(u)
    loss = mean_b CE(h_L @ Wh + bh, y) + sum_l aux_l

(the router may also be DeepSeek-V3's, sigmoid scores chosen by score + a balancing bias,
node-limited, with shared experts beside the routed ones: routing.py)

Weights are stored (in, out) and applied as `x @ W + b`. Every strategy starts
from `init_params`, the *full* model drawn from one seeded generator in
canonical-name order, and keeps its own slice (wasteful at scale, exact here).

The model is written as a list of pieces (`Embed`, blocks, `Head`) so a
pipeline stage can hold any contiguous run of them, and so a parallel block
(tensor- or expert-parallel) can stand in for a reference block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minipar.core import autograd as ag
from minipar.core import fused_layers, routing
from minipar.core import precision as _mp
from minipar.core.autograd import Tensor


class Parameter(Tensor):
    """A trainable tensor with its canonical name (what `--dump` and checkpoints use).

    `full_index` says which part of the full canonical array this rank holds
    (`None` = all of it), and `sync` names the mesh axis over which its gradient
    must be summed after backward (`"dp"` for replicated weights, `"edp"` for
    expert weights replicated over the expert-data-parallel group, `None` for none).
    """

    __slots__ = ("full_index", "sync")

    def __init__(self, data: np.ndarray, name: str, full_index: tuple | None = None,
                 sync: str | None = "dp") -> None:
        super().__init__(np.array(data, copy=True), requires_grad=True, name=name)
        self.full_index = full_index
        self.sync = sync

    def accumulate(self, g: np.ndarray, fresh: bool = False) -> None:
        """Add `g` to the gradient. Under --mixed (core/precision.py) the gradient is the
        *main gradient*: kept in the master dtype, each 16-bit contribution (one per use
        and microbatch) added into it exactly as it came."""
        if _mp.LOW is None or not self.requires_grad:
            return super().accumulate(g, fresh)
        if self.grad is None:
            wide = _mp.widen(np.asarray(g), _mp.MASTER)
            self.grad = wide if wide is not g else wide.copy()
        else:
            self.grad += _mp.widen(np.asarray(g), _mp.MASTER)


class Module:
    """Anything that owns parameters; `parameters()` lists them in a fixed order."""

    def parameters(self) -> list[Parameter]:
        found: list[Parameter] = []
        for value in vars(self).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, Parameter):
                    found.append(item)
                elif isinstance(item, Module):
                    found.extend(item.parameters())
        return found

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None


# ------------------------------------------------------------------ config
@dataclass(frozen=True)
class ModelConfig:
    """The model's sizes (the `--model ... --expert-d-ff` flags)."""

    model: str = "mlp"
    layers: int = 8
    d_in: int = 32
    d_model: int = 64
    d_ff: int = 256
    classes: int = 10
    experts: int = 8
    top_k: int = 2
    expert_d_ff: int = 128
    capacity_factor: float | None = None
    aux_coef: float = 0.01
    vocab: int = 64                   # the transformer (gpt.py): V tokens,
    seq_len: int = 32                 # T positions per sequence,
    heads: int = 4                    # H attention heads (H divides d)
    shared_experts: int = 0           # routing.py: S always-on experts beside the routed
    router: str = "softmax"           # softmax, or sigmoid-bias (b steers the choice)
    route_groups: int = 1             # node-limited routing: G groups of E/G experts,
    route_top_groups: int | None = None  # of which each token keeps M (None: all G)

    @property
    def is_gpt(self) -> bool:
        """A transformer over token sequences (gpt.py), not an MLP over feature rows."""
        return self.model in GPT_MODELS

    @property
    def is_moe(self) -> bool:
        """Its FFNs are routed experts (`moe`, `gpt-moe`)."""
        return self.model in ("moe", "gpt-moe")


GPT_MODELS = ("gpt", "gpt-moe")


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's canonical name and full shape, in canonical order."""
    d = cfg.d_model
    if cfg.is_gpt:  # docs/design.md, "The transformer": embeddings, attention + FFN
        shapes: dict[str, tuple[int, ...]] = {"tok_embed.weight": (cfg.vocab, d),
                                              "pos_embed.weight": (cfg.seq_len, d)}
    else:
        shapes = {"embed.weight": (cfg.d_in, d), "embed.bias": (d,)}
    for i in range(cfg.layers):
        p = f"blocks.{i}"
        if cfg.is_gpt:
            shapes.update({f"{p}.ln1.weight": (d,), f"{p}.ln1.bias": (d,)})
            for part in ("q", "k", "v", "proj"):
                shapes.update({f"{p}.attn.{part}.weight": (d, d), f"{p}.attn.{part}.bias": (d,)})
        ln = f"{p}.ln2" if cfg.is_gpt else f"{p}.ln"
        shapes.update({f"{ln}.weight": (d,), f"{ln}.bias": (d,)})
        if cfg.is_moe:
            shapes[f"{p}.router.weight"] = (d, cfg.experts)
            for e in range(cfg.experts):
                q = f"{p}.experts.{e}"
                shapes.update({f"{q}.fc1.weight": (d, cfg.expert_d_ff),
                               f"{q}.fc1.bias": (cfg.expert_d_ff,),
                               f"{q}.fc2.weight": (cfg.expert_d_ff, d), f"{q}.fc2.bias": (d,)})
            for s in range(cfg.shared_experts):  # after the routed ones (none by default)
                q = f"{p}.shared_experts.{s}"
                shapes.update({f"{q}.fc1.weight": (d, cfg.expert_d_ff),
                               f"{q}.fc1.bias": (cfg.expert_d_ff,),
                               f"{q}.fc2.weight": (cfg.expert_d_ff, d), f"{q}.fc2.bias": (d,)})
        else:
            shapes.update({f"{p}.fc1.weight": (d, cfg.d_ff), f"{p}.fc1.bias": (cfg.d_ff,),
                           f"{p}.fc2.weight": (cfg.d_ff, d), f"{p}.fc2.bias": (d,)})
    outputs = cfg.vocab if cfg.is_gpt else cfg.classes
    if cfg.is_gpt:
        shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    shapes["head.weight"] = (d, outputs)
    shapes["head.bias"] = (outputs,)
    return shapes


LAYER_NORMS = ("ln", "ln1", "ln2", "ln_f")
RESIDUAL_OUTPUTS = ("fc2.weight", "attn.proj.weight")  # drawn smaller: N(0, 0.02/sqrt(2L))


def init_params(cfg: ModelConfig, seed: int, dtype: np.dtype | str = np.float64
                ) -> dict[str, np.ndarray]:
    """The full model, drawn from one seeded generator in canonical-name order.

    Weights ~ N(0, 0.02); the weights that write into the residual stream (fc2, dense and
    expert, and the transformer's attn.proj) ~ N(0, 0.02/sqrt(2L)), so it does not grow
    with depth; embeddings N(0, 0.02); biases 0; LayerNorm gamma 1, beta 0.
    Every rank of every mesh calls this and keeps its slice: all meshes start equal.
    """
    rng = np.random.default_rng(seed)
    small = 0.02 / np.sqrt(2 * cfg.layers)
    params = {}
    for name, shape in canonical_shapes(cfg).items():
        parts = name.split(".")
        if parts[-2] in LAYER_NORMS and parts[-1] == "weight":
            value = np.ones(shape)
        elif name.endswith("bias"):
            value = np.zeros(shape)
        else:
            value = rng.normal(0.0, small if name.endswith(RESIDUAL_OUTPUTS) else 0.02, shape)
        params[name] = value.astype(dtype)
    return params


# ------------------------------------------------------------- the pieces
class Linear(Module):
    """y = x @ W + b with W stored (in, out)."""

    def __init__(self, full: dict[str, np.ndarray], name: str, sync: str | None = "dp") -> None:
        self.weight = Parameter(full[f"{name}.weight"], f"{name}.weight", sync=sync)
        self.bias = Parameter(full[f"{name}.bias"], f"{name}.bias", sync=sync)

    def __call__(self, x: Tensor) -> Tensor:
        return fused_layers.linear(x, self.weight, self.bias)


class LayerNorm(Module):
    """Normalize each row over its features, then scale by gamma and shift by beta."""

    def __init__(self, full: dict[str, np.ndarray], name: str) -> None:
        self.weight = Parameter(full[f"{name}.weight"], f"{name}.weight")
        self.bias = Parameter(full[f"{name}.bias"], f"{name}.bias")

    def __call__(self, x: Tensor) -> Tensor:
        return fused_layers.layer_norm(x, self.weight, self.bias)


class Embed(Linear):
    """The input projection x (B, d_in) -> h0 (B, d): the first piece of the model."""

    def __init__(self, full: dict[str, np.ndarray]) -> None:
        super().__init__(full, "embed")


class Head(Linear):
    """The output projection h (B, d) -> logits (B, C): the last piece of the model."""

    def __init__(self, full: dict[str, np.ndarray]) -> None:
        super().__init__(full, "head")


class DenseBlock(Module):
    """h + fc2(GELU(fc1(LN(h)))): a pre-LayerNorm residual MLP block.

    h is (B, d) rows, or (B, T, d) positions: the transformer's FFN half is this block
    with its LayerNorm named `ln2` (gpt.py)."""

    def __init__(self, full: dict[str, np.ndarray], index: int, ln: str = "ln") -> None:
        self.ln = LayerNorm(full, f"blocks.{index}.{ln}")
        self.fc1 = Linear(full, f"blocks.{index}.fc1")
        self.fc2 = Linear(full, f"blocks.{index}.fc2")

    def __call__(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        """Returns the new residual stream and the block's aux loss (none for dense).
        One tape node (fused.residual_mlp) computing, with u = ln(h) (B, d),

            h + fc2(gelu(fc1(u)))        (B, d) @ (d, f) -> (B, f) @ (f, d) -> (B, d)"""
        return fused_layers.residual_mlp(h, self.ln.weight, self.ln.bias, self.fc1.weight,
                                  self.fc1.bias, self.fc2.weight, self.fc2.bias), None


# --------------------------------------------------------------------- MoE
def route(probs: np.ndarray, top_k: int) -> np.ndarray:
    """Top-k experts per token, ties to the lower expert id: (B, E) -> (B, k) ids.
    A stable sort of -p keeps equal probabilities in expert-id order."""
    return np.argsort(-probs, axis=1, kind="stable")[:, :top_k]


def top_k_gates(probs: Tensor, top_k: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Tensor]:
    """The router's choice for each of B token rows of `probs` (B, E): the top-k experts
    `chosen` (B, k), then per assignment (token order, then slot; B k of them) its token
    `token_of`, its expert `expert_of`, and its gate g_be = p_be / sum_{e' in T_b} p_be'.
    The softmax router of routing.route, without bias or groups."""
    return routing.route(probs, top_k)


def capacity(capacity_factor: float | None, top_k: int, tokens: int, experts: int) -> int | None:
    """How many assignments one expert may take from a (micro)batch: ceil(c k B / E)."""
    if capacity_factor is None:
        return None
    return int(np.ceil(capacity_factor * top_k * tokens / experts))


def keep_within_capacity(expert_of: np.ndarray, experts: int, limit: int | None,
                         already: np.ndarray | None = None) -> np.ndarray:
    """Which assignments survive capacity, in order: `expert_of` lists each assignment's
    expert in global token order (token, then slot). An assignment is kept if fewer than
    `limit` earlier assignments went to its expert; `already` counts earlier ones seen
    elsewhere (on data-parallel ranks holding earlier tokens). Vectorized: the position of
    each assignment within its expert comes from a stable sort, not a loop over tokens."""
    if limit is None:
        return np.ones(expert_of.shape, dtype=bool)
    order = np.argsort(expert_of, kind="stable")
    counts = np.bincount(expert_of, minlength=experts)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    position = np.empty_like(order)
    position[order] = np.arange(order.size) - starts[expert_of[order]]
    if already is not None:
        position = position + already[expert_of]
    return position < limit


def aux_loss(probs: Tensor, chosen: np.ndarray, experts: int, coef: float,
             tokens: int | None = None) -> Tensor:
    """Switch/GShard load balancing: coef * E * sum_e f_e P_e.

    f_e is the fraction of (token, slot) assignments that chose e (counted before any
    capacity drop), P_e the mean router probability of e. `f` is a count, so no gradient
    flows through it; the gradient reaches the router through P.
    """
    tokens = probs.shape[0] if tokens is None else tokens
    f = (np.bincount(chosen.ravel(), minlength=experts) / (tokens * chosen.shape[1])
         ).astype(probs.dtype)
    p_mean = probs.sum(axis=0) * (1.0 / tokens)
    return (p_mean * (coef * experts * f)).sum()


def as_tokens(u: Tensor) -> Tensor:
    """(B, T, d) positions -> (B*T, d) tokens, in global token order (row, then position);
    (B, d) rows are tokens already."""
    return u if u.ndim == 2 else ag.reshape(u, (-1, u.shape[-1]), tokens=True)


class MoEBlock(Module):
    """h + sum_e g_e Expert_e(LN(h)) (+ the shared experts): the dense FFN replaced by
    top-k routed experts.

    `ffn` is the routed FFN alone, u (N, d) tokens -> (out (N, d), aux); the block adds
    the LayerNorm and the residual. h is (B, d) rows or (B, T, d) positions, each
    position one token (the transformer's MoE FFN, with its LayerNorm named `ln2`).
    Vectorized by expert: for each expert, the (token, slot) assignments routed to it
    are gathered with one index array, run through the expert, weighted by their gates
    and scatter-added back (`index_add`): no Python loop over tokens.
    The router is routing.py's: softmax (default) or sigmoid-bias, whose b lives in
    `balance` (a routing.BiasBalance, not a parameter), optionally node-limited.
    """

    def __init__(self, full: dict[str, np.ndarray], index: int, cfg: ModelConfig,
                 ln: str = "ln") -> None:
        p = f"blocks.{index}"
        self.cfg = cfg
        self.ln = LayerNorm(full, f"{p}.{ln}")
        self.router = Parameter(full[f"{p}.router.weight"], f"{p}.router.weight")
        self.experts = [ExpertFFN(full, f"{p}.experts.{e}") for e in range(cfg.experts)]
        self.shared = [ExpertFFN(full, f"{p}.shared_experts.{s}")
                       for s in range(cfg.shared_experts)]
        self.balance = routing.balance_for(p, cfg.router, cfg.experts, full)

    def __call__(self, h: Tensor) -> tuple[Tensor, Tensor]:
        out, aux = self.ffn(as_tokens(self.ln(h)))             # (N, d), N = B or B*T
        return h + (out if h.ndim == 2 else ag.reshape(out, h.shape, like=h)), aux

    def ffn(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """The routed FFN on N tokens u (N, d): (sum_e g_e Expert_e(u) + shared, aux)."""
        cfg = self.cfg
        probs = routing.scores(u, self.router, cfg.router)    # (N, d) @ (d, E) -> (N, E)
        bias = None if self.balance is None else self.balance.value
        chosen, tokens, expert_of, gates = routing.route(     # (N, k), 3 x (N k,)
            probs, cfg.top_k, bias, cfg.route_groups, cfg.route_top_groups)
        if self.balance is not None:
            self.balance.count(expert_of)                     # this step's load of b
        limit = capacity(cfg.capacity_factor, cfg.top_k, u.shape[0], cfg.experts)
        kept = keep_within_capacity(expert_of, cfg.experts, limit)
        out = Tensor(np.zeros_like(u.data))
        for e, expert in enumerate(self.experts):              # a loop over experts, not tokens
            # An expert no token chose still runs, on zero rows: its gradient is then a
            # zero array (not missing), so optimizers and gradient syncs see every weight.
            mine = np.flatnonzero((expert_of == e) & kept)
            y = expert(ag.take_rows(u, tokens[mine]))          # (n_e, d) -> (n_e, d)
            weighted = y * ag.reshape(ag.take_rows(gates, mine), (-1, 1))
            out = ag.index_add(out, tokens[mine], weighted)
        for expert in self.shared:                             # every token, no gate
            out = out + expert(u)                              # (N, d)
        return out, aux_loss(probs, chosen, cfg.experts, cfg.aux_coef)


class ExpertFFN(Module):
    """One expert: a dense FFN with its own weights, GELU(u W1 + b1) W2 + b2."""

    def __init__(self, full: dict[str, np.ndarray], name: str, sync: str | None = "dp") -> None:
        self.fc1 = Linear(full, f"{name}.fc1", sync=sync)
        self.fc2 = Linear(full, f"{name}.fc2", sync=sync)

    def __call__(self, u: Tensor) -> Tensor:
        return self.fc2(fused_layers.gelu(self.fc1(u)))


# -------------------------------------------------------------- the model
class Model(Module):
    """A run of pieces: optionally the embedding, some blocks, optionally the head.

    The whole reference model is one `Model` with every piece; a pipeline stage
    is a `Model` with a contiguous run of them. `forward` returns the output
    (h, or logits if this piece ends with the head) and the summed aux loss.
    """

    def __init__(self, embed: Module | None, blocks: list[Module], head: Module | None,
                 enter: Callable[[Tensor], Tensor] | None = None,
                 leave: Callable[[Tensor], Tensor] | None = None) -> None:
        self.embed = embed
        self.blocks = blocks
        self.head = head
        # Optional re-layout of the residual stream after the embedding and before the
        # head (sequence parallelism keeps it split by rows in between).
        self.enter = enter
        self.leave = leave

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        h = x
        if self.embed is not None:
            h = self.embed(x)
            h = self.enter(h) if self.enter is not None else h
        aux_total: Tensor | None = None
        for block in self.blocks:
            h, aux = block(h)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        if self.head is None:
            return h, aux_total
        h = self.leave(h) if self.leave is not None else h
        return self.head(h), aux_total


def build_reference(cfg: ModelConfig, full: dict[str, np.ndarray]) -> Model:
    """The single-process model holding every parameter."""
    blocks: list[Module] = [MoEBlock(full, i, cfg) if cfg.model == "moe" else DenseBlock(full, i)
                            for i in range(cfg.layers)]
    return Model(Embed(full), blocks, Head(full))


def loss_fn(model: Model, x: np.ndarray | Tensor, y: np.ndarray, weight: float = 1.0
            ) -> Tensor:
    """mean_b CE(logits_b, y_b) + sum_l aux_l on one (micro)batch; for the transformer
    the mean runs over all B*T positions (logits (B, T, V), y (B, T)). `x` may come as a
    Tensor already (carrying its placement: rows sharded over dp). `weight` multiplies
    the CE term (documents.loss_weight: padded positions count 0, the mean is over the
    valid positions of the global batch)."""
    logits, aux = model.forward(ag.as_tensor(x))
    loss = output_loss(model.head, logits, y)
    loss = loss if weight == 1.0 else loss * weight
    return loss if aux is None else loss + aux


def output_loss(head: Module, logits: Tensor, y: np.ndarray) -> Tensor:
    """Mean CE of the head's output: fused.cross_entropy of full logits, or the head's own
    `loss` when it holds only some of them (vocab_parallel.VocabParallelHead)."""
    if hasattr(head, "loss"):
        return head.loss(logits, y)
    return fused_layers.cross_entropy(logits, y)
