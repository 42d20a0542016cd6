"""MoE routing, DeepSeek-V3 style: sigmoid scores, a balancing bias, node-limited choice.

What this file teaches: two ways a router can pick each token's k experts, and what the
second one changes about balance and communication (DeepSeek-V3, Liu et al. 2024,
"Auxiliary-Loss-Free Load Balancing", Wang et al. 2024).

    softmax       p = softmax(u Wr); top-k of p; gates p_e / sum of the chosen p.
                  Balance comes from a loss (the Switch/GShard aux loss, nn.aux_loss):
                  its gradient pulls the router towards even load, and pulls the
                  model's loss with it.
    sigmoid-bias  s = sigmoid(u Wr) per expert; top-k of s + b; gates s_e / sum of the
                  chosen s. b (E,) is NOT a parameter and gets no gradient: it only
                  steers the *choice* (never the gates), and after every step
                      b_e += rate * sign(mean load - load_e)
                  an overloaded expert becomes a little less attractive, an idle one a
                  little more. The load is counted over the whole global batch of the
                  step: one Allreduce of the per-expert counts over dp x cp, so every
                  replica of b stays bitwise equal (integers summed, then the same
                  float update everywhere).

Node-limited routing (`--route-groups G --route-top-groups M`): the E experts sit in G
equal groups (with ep, a group is naturally one ep rank's experts: a node). Each token
first keeps the M groups with the largest sum of their two best selection scores (p for
softmax, s + b for sigmoid-bias), then takes its top-k inside them. A token then
reaches at most M groups, so however the dispatch moves its rows, at most M groups
receive it: the AllToAll crosses fewer links.

Shared experts (`--shared-experts S`) are not routed at all: S dense FFNs every token
goes through, their output added to the routed one (nn.MoEBlock, expert_parallel.py).

Everything here is array math on one rank's tokens, used by the reference block
(nn.MoEBlock) and the expert-parallel block alike; the only collective is the load's
Allreduce in `update_biases`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from minipar import placement
from minipar.core import fused_layers
from minipar.core.autograd import Tensor

ROUTERS = ("softmax", "sigmoid-bias")
DEFAULT_BIAS_RATE = 1e-3
DEFAULT_AUX_COEF = {"softmax": 0.01, "sigmoid-bias": 0.0}  # the bias replaces the aux loss


# ------------------------------------------------------------------ scores
def sigmoid(a: Tensor) -> Tensor:
    """1 / (1 + exp(-z)) elementwise, one node; its derivative is s (1 - s). Written with
    exp of -|z| so that neither branch overflows."""
    z = a.data
    e = np.exp(-np.abs(z))
    out = np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(z.dtype)

    def backward(g: np.ndarray) -> None:
        a.accumulate(g * out * (1.0 - out), fresh=True)
    result = Tensor.from_op(out, (a,), backward)
    return placement.follow(result, placement.nonlinear("sigmoid", a), a.name) \
        if placement.ON else result


def scores(u: Tensor, router: Tensor, kind: str) -> Tensor:
    """The router's scores of N tokens u (N, d) for E experts, (N, E): softmax(u Wr) for
    `softmax`, sigmoid(u Wr) (each expert on its own, no competition) for `sigmoid-bias`."""
    logits = u @ router                                     # (N, d) @ (d, E) -> (N, E)
    # --mixed: the probabilities in the master dtype (core/precision.py)
    return fused_layers.softmax(logits, master=True) if kind == "softmax" else sigmoid(logits)


# ------------------------------------------------------------------ choice
def allowed_groups(selection: np.ndarray, groups: int, top_groups: int) -> np.ndarray:
    """Node-limited routing's mask (N, E): True for the experts of each token's M best
    groups. A group's affinity is the sum of its two best selection scores (its one
    score when a group holds one expert); ties go to the lower group id."""
    n, experts = selection.shape
    per = experts // groups
    grouped = np.sort(selection.reshape(n, groups, per), axis=2)       # ascending per group
    affinity = grouped[:, :, -min(2, per):].sum(axis=2)                # (N, G)
    best = np.argsort(-affinity, axis=1, kind="stable")[:, :top_groups]  # (N, M)
    keep = np.zeros((n, groups), dtype=bool)
    np.put_along_axis(keep, best, True, axis=1)
    return np.repeat(keep, per, axis=1)                                # (N, E)


def choose(selection: np.ndarray, top_k: int, groups: int = 1,
           top_groups: int | None = None) -> np.ndarray:
    """Each token's k experts (N, k), best first, ties to the lower expert id (a stable
    sort of -selection). With groups, only experts of the token's M best groups compete
    (the others are set to -inf first; settings/validation.py makes sure k <= M E/G)."""
    if groups > 1 and top_groups is not None and top_groups < groups:
        selection = np.where(allowed_groups(selection, groups, top_groups), selection, -np.inf)
    return np.argsort(-selection, axis=1, kind="stable")[:, :top_k]


def route(scores_: Tensor, top_k: int, bias: np.ndarray | None = None, groups: int = 1,
          top_groups: int | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Tensor]:
    """The router's choice for N tokens from their scores (N, E): `chosen` (N, k), then per
    assignment (token order, then slot; N k of them) its token `token_of`, its expert
    `expert_of`, and its gate: the chosen score over the sum of the token's chosen
    scores. `bias` (E,) is added for the choice only (sigmoid-bias): the gates, and so
    the gradient, never see it."""
    selection = scores_.data if bias is None else scores_.data + bias
    chosen = choose(selection, top_k, groups, top_groups)              # (N, k)
    if _COUNTING[-1] and _RECORDED[-1] is not None:   # --check: this run's decisions
        _RECORDED[-1].append(chosen.astype(np.int16))
    if _COUNTING[-1] and _REPLAYED[-1] is not None:   # --check's reference: another run's
        chosen = _REPLAYED[-1].take(chosen, selection)
    token_of = np.repeat(np.arange(scores_.shape[0]), top_k)           # (N k,)
    expert_of = chosen.ravel()                                         # (N k,)
    picked = scores_[token_of, expert_of].reshape(-1, top_k)           # (N, k)
    gates = (picked / picked.sum(axis=1, keepdims=True)).reshape(-1)   # (N k,)
    return chosen, token_of, expert_of, gates


def groups_reached(token_of: np.ndarray, expert_of: np.ndarray, tokens: int, experts: int,
                   groups: int) -> np.ndarray:
    """(tokens, G) True where a token sends at least one row to group g: the routing
    ledger's unit (a token crosses to a group once, however many of its k experts sit
    there, if the rows are deduplicated per group as DeepSeek-V3 does per node)."""
    reached = np.zeros((tokens, groups), dtype=bool)
    reached[token_of, expert_of // (experts // groups)] = True
    return reached


# ------------------------------------------------- the same decisions (--check)
class Replay:
    """Another run's choices, handed to the one-process reference call after call
    (results.check: numbers compared under the same discrete decisions).

    `choices[i]` is the (N, k) array the i-th counted `route` call of the reference is
    to use (None: its own). Each call's own choice is compared with the one it takes:
    `flips[i]` = (tokens whose choice differs, the largest gap of selection scores
    between its own k chosen and the ones it took: how close the tie was)."""

    def __init__(self, choices: list[np.ndarray | None]) -> None:
        self.choices = choices
        self.calls = 0
        self.flips: dict[int, tuple[int, float]] = {}

    def take(self, own: np.ndarray, selection: np.ndarray) -> np.ndarray:
        """The choice call number `self.calls` takes, recording how it differs."""
        i, self.calls = self.calls, self.calls + 1
        given = self.choices[i] if i < len(self.choices) else None
        if given is None:
            return own
        if given.shape != own.shape:
            raise ValueError(f"routing call {i}: {given.shape} handed over for {own.shape}")
        given = given.astype(own.dtype)
        differ = np.flatnonzero((np.sort(own, axis=1) != np.sort(given, axis=1)).any(axis=1))
        if differ.size:
            rows = selection[differ]
            mine = np.take_along_axis(rows, own[differ], axis=1).sum(axis=1)
            theirs = np.take_along_axis(rows, given[differ], axis=1).sum(axis=1)
            self.flips[i] = (int(differ.size), float(np.max(mine - theirs)))
        return given


_RECORDED: list[list[np.ndarray] | None] = [None]
_REPLAYED: list[Replay | None] = [None]


@contextmanager
def recording(on: bool = True) -> Iterator[list[np.ndarray]]:
    """Inside the block (when `on`), every counted `route` call appends its (N, k) choice
    (int16) to the list yielded: a mesh run's decisions, for `--check` to hand to the
    one-process reference (`replaying`). A recomputed forward (`not_counting`) adds none."""
    found: list[np.ndarray] = []
    _RECORDED.append(found if on else None)
    try:
        yield found
    finally:
        _RECORDED.pop()


@contextmanager
def replaying(replay: Replay | None) -> Iterator[None]:
    """Inside the block, every counted `route` call takes its choice from `replay`
    (None: its own)."""
    _REPLAYED.append(replay)
    try:
        yield
    finally:
        _REPLAYED.pop()


# ------------------------------------------------------------ the bias b
_COUNTING = [True]


@contextmanager
def not_counting() -> Iterator[None]:
    """Routing inside this block does not add to the step's load (recompute.py: the
    forward run again in the backward routes the same tokens a second time)."""
    _COUNTING.append(False)
    try:
        yield
    finally:
        _COUNTING.pop()


class BiasBalance:
    """b of one MoE block (sigmoid-bias), and the load its tokens gave since the last update.

    `value` (E,) float64 is replicated on every rank holding the block; `load` (E,) counts
    this rank's (token, slot) assignments per expert over the step's microbatches."""

    def __init__(self, prefix: str, experts: int) -> None:
        self.name = f"{prefix}.router.bias_balance"
        self.value = np.zeros(experts)
        self.load = np.zeros(experts, dtype=np.int64)

    def count(self, expert_of: np.ndarray) -> None:
        """Add one microbatch's assignments (each a chosen expert id) to the load."""
        if _COUNTING[-1]:
            self.load += np.bincount(expert_of, minlength=self.load.size)


def balance_for(prefix: str, router: str, experts: int, full: dict[str, np.ndarray]
                ) -> BiasBalance | None:
    """The BiasBalance of the block `prefix` under `router` (None for softmax), starting
    from the b that `full` holds under its name when it holds one (a checkpoint's, as
    `generate --resume` hands it over), else from 0."""
    if router != "sigmoid-bias":
        return None
    state = BiasBalance(prefix, experts)
    if state.name in full:
        state.value = np.array(full[state.name], dtype=np.float64)
    return state


def bias_step(value: np.ndarray, load: np.ndarray, rate: float) -> np.ndarray:
    """b + rate * sign(mean load - load): the auxiliary-loss-free update of one block."""
    return value + rate * np.sign(load.mean() - load)


def balances(modules: object) -> list[BiasBalance]:
    """Every BiasBalance inside `modules` (a model, a list of chunks...), in model order:
    the walk of nn.Module.parameters (a Module's attributes, lists and tuples)."""
    found: list[BiasBalance] = []
    stack = [modules]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, BiasBalance):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif callable(getattr(item, "parameters", None)) and not isinstance(item, Tensor):
            stack.extend(reversed(list(vars(item).values())))  # a Module: its attributes
    return found


def global_load(states: list[BiasBalance], group: object | None) -> np.ndarray:
    """(blocks, E): every block's load over the global batch. One Allreduce of all of this
    rank's blocks' counts at once over `group` (a comm.Group, dp x cp: the ranks holding
    other tokens of the same blocks; tp ranks hold the same tokens, so they are not
    summed over). This core module never imports MPI: the group brings its own."""
    local = np.stack([s.load for s in states])
    if group is None or group.size == 1:
        return local
    total = np.empty_like(local)
    # (blocks, E) counts of my tokens -> the sums over every token of the step (SUM)
    group.Allreduce(local, total)
    return total


def update_biases(modules: object, group: object | None, rate: float) -> None:
    """After a step: every block's b moves against its global load, and the loads restart.
    Every rank of `group` holds the same blocks, so all call the Allreduce together."""
    states = balances(modules)
    if not states:
        return
    for state, load in zip(states, global_load(states, group)):
        state.value = bias_step(state.value, load, rate)
        state.load[:] = 0


def bias_values(modules: object) -> dict[str, np.ndarray]:
    """`{"blocks.{i}.router.bias_balance": b}` of the blocks in `modules` (what `--dump`'s
    final.npz and checkpoints hold beside the parameters)."""
    return {s.name: s.value.copy() for s in balances(modules)}


def set_bias_values(modules: object, values: dict[str, np.ndarray]) -> None:
    """Put saved b's back (a resumed run): each block takes its own by name."""
    for state in balances(modules):
        if state.name in values:
            state.value = np.array(values[state.name], dtype=np.float64)
