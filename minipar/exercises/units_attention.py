"""The unit checks of the transformer's exercises: attention by heads, ring attention.

Each runs on every rank of the world, taken as one tp group (attention-heads) or one
cp group (ring-attention), compares against gpt.Attention / attention.attention on
the full arrays in one process (float64, relative 1e-9) and returns None or one
sentence: which tensor, which rank, by how much, which collective's count differs.
Tiny arrays drawn on every rank from one seed, as the library draws its weights.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Group, Ledger
from minipar.core import attention, gpt
from minipar.core.autograd import Tensor
from minipar.parallel import context_parallel as cpar
from minipar.parallel.sequence_parallel import SequenceParallelAttention
from minipar.parallel.tensor_parallel import TensorParallelAttention, shard
from minipar.run.results import TOLERANCE, relative_difference

CLOSE = TOLERANCE["float64"]  # the equivalence suite's own tolerance


def differs(what: str, rank: int, got: np.ndarray, want: np.ndarray) -> str | None:
    """A sentence if `got` is not `want` (its shape, or relative CLOSE), else None."""
    if np.shape(got) != np.shape(want):
        return f"{what} on rank {rank} has shape {np.shape(got)}, not {np.shape(want)}"
    rel = relative_difference(got, want, floor=1e-12)
    if not rel <= CLOSE:
        return f"{what} on rank {rank} differs from one process by {rel:.2e} relative"
    return None


# ---------------------------------------------------------- attention by heads
def attention_weights(d: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One block's LN1 and attention weights under their canonical names."""
    full = {"blocks.0.ln1.weight": 1 + 0.1 * rng.normal(size=d),
            "blocks.0.ln1.bias": 0.1 * rng.normal(size=d)}
    for part in ("q", "k", "v", "proj"):
        full[f"blocks.0.attn.{part}.weight"] = rng.normal(size=(d, d)) / np.sqrt(d)
        full[f"blocks.0.attn.{part}.bias"] = 0.1 * rng.normal(size=d)
    return full


def first(world: MPI.Comm, problem: str | None) -> str | None:
    """Every rank's verdict -> the first that is not None, on every rank: ranks leave a
    check together, never one of them while the others go on to a collective."""
    return next((p for p in world.allgather(problem) if p is not None), None)


def calls(ledger: Ledger) -> dict[str, int]:
    """op -> calls recorded since the last reset."""
    made: dict[str, int] = {}
    for (op, _), entry in sorted(ledger.entries.items()):
        name = op.removesuffix("_block")     # Reduce_scatter_block is a Reduce_scatter
        made[name] = made.get(name, 0) + entry.calls
    return made


# one direction of the split attention: the calls over tp (SP: Allgather and Reduce_scatter)
EXPECTED_CALLS = {False: ({"Allreduce": 1}, "g after proj, f before q, k and v"),
                  True: ({"Allgather": 1, "Reduce_scatter": 1},
                         "an Allgather of positions before q, k and v and a Reduce_scatter "
                         "after proj")}


def check_heads(world: MPI.Comm) -> str | None:
    """TensorParallelAttention on the world as one tp group against gpt.Attention, without
    and with sequence parallelism: the local heads, the output, every gradient of my
    shards, and the calls over tp in each direction."""
    tp, rng = Group(world, "tp", Ledger()), np.random.default_rng(5)
    B, T, H, dh = 2, 2 * tp.size, 2 * tp.size, 3          # two heads, two positions per rank
    d = H * dh
    full = attention_weights(d, rng)
    h_full, g = rng.normal(size=(B, T, d)), rng.normal(size=(B, T, d))
    reference = gpt.Attention(full, 0, H)
    h_ref = Tensor(h_full.copy(), requires_grad=True)
    y_ref = reference(h_ref)
    y_ref.backward(g.copy())
    for sp in (False, True):
        problem = first(world, heads_on(tp, full, H, sp, h_full, g, reference, h_ref, y_ref))
        if problem:
            return problem
    return None


def heads_on(tp: Group, full: dict[str, np.ndarray], H: int, sp: bool, h_full: np.ndarray,
             g: np.ndarray, reference: gpt.Attention, h_ref: Tensor, y_ref: Tensor
             ) -> str | None:
    """One run of the split attention (sp: h holds my T/tp positions) against one process."""
    me, d = tp.rank, h_full.shape[-1]
    mode = "with sequence parallelism" if sp else "without sequence parallelism"
    split = (SequenceParallelAttention if sp else TensorParallelAttention)(full, 0, H, tp)
    if split.heads != H // tp.size:
        return (f"TensorParallelAttention.heads on rank {me} is {split.heads}: with H = {H} "
                f"heads over tp = {tp.size} ranks each holds H/tp = {H // tp.size}")
    at = shard(h_full.shape[1], tp.size, me) if sp else slice(None)   # my positions (SP)
    tp.ledger.reset()
    h = Tensor(h_full[:, at].copy(), requires_grad=True)
    try:
        y = split(h)
    except ValueError as error:
        return (f"{mode}, the forward pass raised on rank {me}: {error}. Under sequence "
                "parallelism h holds my T/tp positions: q, k, v enter through an Allgather "
                "of positions (axis 1) and proj (your RowParallelLinear, wrapped) leaves "
                "through a Reduce_scatter back to them")
    forward = calls(tp.ledger)
    problem = differs(f"{mode}, the attention's output h + proj(o)", me, y.data,
                      y_ref.data[:, at])
    if (problem := first(tp.comm, problem)):   # all ranks go on to the backward, or none
        return problem
    tp.ledger.reset()
    y.backward(g[:, at].copy())
    backward = calls(tp.ledger)
    cols = shard(d, tp.size, me)                          # my heads' columns of q, k, v
    checks = [("the input gradient dL/dh (each rank's q, k and v give only its heads' "
               "share of it: the one f in front of them sums the shares)", h.grad,
               h_ref.grad[:, at])]
    for part in ("q", "k", "v"):
        mine, ref = getattr(split, part), getattr(reference, part)
        checks += [(f"the gradient of {part}.weight[:, my heads] (d, d/tp)", mine.weight.grad,
                    ref.weight.grad[:, cols]),
                   (f"the gradient of {part}.bias[my heads] (d/tp,)", mine.bias.grad,
                    ref.bias.grad[cols])]
    checks.append(("the gradient of proj.weight[my heads, :] (d/tp, d)",
                   split.proj.weight.grad, reference.proj.weight.grad[cols]))
    for what, got, want in checks:
        if got is None:
            return f"{mode}, {what} on rank {me} was never computed: is it on the tape?"
        if (problem := differs(f"{mode}, {what}", me, got, want)):
            return problem
    want, which = EXPECTED_CALLS[sp]
    for direction, made in (("forward", forward), ("backward", backward)):
        if made != want:
            return (f"{mode}, the {direction} pass made {made or 'no'} call(s) over tp on "
                    f"rank {me}; split by heads it makes {want}: {which} (in backward the "
                    "one f sums the q, k and v shares of the input gradient at once)")
    return None


# -------------------------------------------------------------- ring attention
def check_merge(rng: np.random.Generator) -> str | None:
    """_merge against the softmax over all keys, on one rank: two blocks of keys, the
    first hidden from some query rows (their L stays -inf until the second block)."""
    B, H, Tq, dh = 2, 2, 4, 3
    Q, K, V = rng.normal(size=(3, B, H, 2 * Tq, dh))
    Q = Q[:, :, :Tq]
    keep = attention.allowed(np.arange(Tq, 2 * Tq), np.arange(2 * Tq))    # causal (Tq, 2Tq)
    keep[:2, :Tq] = False                   # rows 0, 1 see no key of the first block
    scale = 1.0 / np.sqrt(dh)
    S = np.where(keep, Q @ np.swapaxes(K, -1, -2) * scale, -np.inf)
    P = np.exp(S - S.max(axis=-1, keepdims=True))
    want = (P / P.sum(axis=-1, keepdims=True)) @ V
    Out, L = np.zeros((B, H, Tq, dh)), np.full((B, H, Tq), -np.inf)
    for block, name in ((slice(0, Tq), "first"), (slice(Tq, 2 * Tq), "second")):
        o, lse = cpar._block_forward(Q, K[:, :, block], V[:, :, block], keep[:, block], scale)
        cpar._merge(Out, L, o, lse)
        if not np.all(np.isfinite(Out)):
            return (f"_merge: after the {name} block of keys Out holds NaN or inf: a query "
                    "row that has seen no key yet has L = -inf and lse = -inf, so L' = "
                    "logaddexp(L, lse) = -inf too; take L' as 0 there before exp(L - L')")
    rel = relative_difference(Out, want)
    if not rel <= CLOSE:
        return (f"_merge: two blocks of keys merged give an output that differs from the "
                f"softmax over all keys by {rel:.2e} relative: Out' = Out exp(L - L') + "
                "o exp(lse - L') with L' = logaddexp(L, lse), both written in place "
                "(Out[...] = ..., L[...] = ...: the caller holds views of its arrays)")
    lse_all = np.log(np.exp(S - S.max(axis=-1, keepdims=True)).sum(axis=-1)) + S.max(axis=-1)
    if not relative_difference(L, lse_all) <= CLOSE:
        return "_merge: L must become logaddexp(L, lse), the log-sum-exp of all keys so far"
    return None


def check_pass_along(cp: Group) -> str | None:
    """One ring step: rank r must receive rank r-1's block, in one Sendrecv."""
    me, size = cp.rank, cp.size
    cp.ledger.reset()
    got = cpar.pass_along(cp, np.full((1, 2, 3, 2), float(me)))
    calls = cp.ledger.total("Sendrecv", field="calls")
    if np.shape(got) != (1, 2, 3, 2):
        return f"pass_along on rank {me} returned shape {np.shape(got)}, not (1, 2, 3, 2)"
    if not np.all(got == (me - 1) % size):
        return (f"pass_along on rank {me} received {np.unique(got)}, the block of rank(s) "
                f"{np.unique(got).astype(int).tolist()}: it must be the block of rank "
                f"{(me - 1) % size} (send to r+1, receive from r-1)")
    if calls != 1:
        return f"pass_along on rank {me} made {calls} Sendrecv call(s); one ring step is 1"
    return None


def visible_pairs(seq_len: int, cp: int, rank: int, mode: str) -> int:
    """Score entries (query, key) per batch row and head that rank `rank` computes when
    every block the causal mask hides entirely is skipped, from chunk numbers alone:
    chunk c holds positions c s .. (c+1) s - 1, and my chunk c sees chunk c' iff c' <= c."""
    per_rank = 2 if mode == "zigzag" else 1
    size = seq_len // (cp * per_rank)
    mine = [rank, 2 * cp - 1 - rank] if mode == "zigzag" else [rank]
    return sum(c + 1 for c in mine) * size * size   # chunks 0..c of every rank's


def check_ring_attention(world: MPI.Comm) -> str | None:
    """_merge, pass_along, then ring and zigzag attention on the world as one cp group
    against attention.attention on the whole sequence: output, dQ, dK, dV of my
    positions, and the score entries computed (the causal skip)."""
    cp, rng = Group(world, "cp", Ledger()), np.random.default_rng(9)
    if (problem := first(world, check_merge(rng) or check_pass_along(cp))):
        return problem
    B, H, dh, T = 2, 2, 3, 4 * cp.size
    q_full, k_full, v_full, g_full = rng.normal(size=(4, B, T, H * dh))
    bias = rng.normal(size=H * dh)
    tensors = [Tensor(a.copy(), requires_grad=True) for a in (q_full, k_full, v_full, bias)]
    attention.attention(*tensors[:3], H, key_bias=tensors[3]).backward(g_full.copy())
    for mode in ("ring", "zigzag"):
        problem = first(world, ring_on(cp, mode, (q_full, k_full, v_full, bias, g_full),
                                       tensors, H))
        if problem:
            return problem
    return None


def ring_on(cp: Group, mode: str, arrays: tuple[np.ndarray, ...], reference: list[Tensor],
            H: int) -> str | None:
    """One mode of the ring on my positions against one process (`reference`: q, k, v and
    the key bias of the whole sequence, their gradients computed)."""
    q_full, k_full, v_full, bias, g_full = arrays
    me, T = cp.rank, q_full.shape[1]
    cp_attention = cpar.ContextParallelAttention(cp, mode, T)
    at = cp_attention.positions                                   # my global positions
    q, k, v = (Tensor(a[:, at].copy(), requires_grad=True) for a in (q_full, k_full, v_full))
    out = cp_attention(q, k, v, H, Tensor(bias.copy(), requires_grad=True))
    want = attention.attention(*(Tensor(a) for a in (q_full, k_full, v_full)), H,
                               key_bias=Tensor(bias)).data[:, at]
    where = f"{mode} attention (cp = {cp.size}, my positions {at.tolist()})"
    problem = differs(f"{where}: the output (B, T/cp, H dh)", me, out.data, want)
    if (problem := first(cp.comm, problem)):   # all ranks go on to the backward, or none
        return problem
    out.backward(g_full[:, at].copy())
    for name, got, ref in (("dQ", q.grad, reference[0].grad), ("dK", k.grad, reference[1].grad),
                           ("dV", v.grad, reference[2].grad)):
        if (problem := differs(f"{where}: {name} of my positions", me, got, ref[:, at])):
            return problem
    entries = q.shape[0] * H * visible_pairs(T, cp.size, me, mode)
    if cp_attention.last_scores != entries:
        return (f"{where}: rank {me} computed {cp_attention.last_scores} score entries, the causal "
                f"skip leaves {entries}: a block of keys whose positions all come after "
                "every query of the run must be skipped (keep.any() is False)")
    return None


UNITS = {"heads": check_heads, "ring-attention": check_ring_attention}
