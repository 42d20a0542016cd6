"""Lesson 3: expert parallelism. 64 experts on 8 ranks, 8 each; tokens travel by Alltoall.

The source text's example (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021):
an MoE layer with 64 experts on 8 GPUs keeps 8 experts per GPU instead of copying the
model; a router sends each token to its top-k experts, wherever they live. Here one MoE
block runs on 8 ranks (dp=8: 32 tokens each; ep=8: rank j holds experts 8j..8j+7):

  1. the source's example by hand, on raw NumPy and raw mpi4py calls: each rank's
     router picks the top-k of 64 experts for its 32 tokens, comm.Alltoallv sends
     the token rows to the ranks that own those experts (the dispatch), each rank
     runs its 8 experts, and a second comm.Alltoallv brings the rows back (the
     combine); the 8x8 matrix of who sent how many rows to whom, and the output
     against the same layer in one process;
  2. the source's AllToAll picture: 4 GPUs with chunks [A1,A2,A3,A4] (ranks 0-3 on a
     communicator of their own), comm.Alltoall, and what each GPU holds afterwards;
  3. minipar's expert-parallel block (minipar/parallel/expert_parallel.py) on the same
     layer: its output equal to part 1's, its dispatch the same matrix, the expert load
     as a text histogram, outputs, aux loss and every gradient against one process,
     and the ledger's Alltoallv volume beside k x tokens x d per direction.
  Beyond the source:
  4. capacity: each expert takes at most ceil(c k B / E) assignments, the rest dropped;
  5. the aux loss at work: a short training run of the block with and without it,
     the imbalance and the dropped share step by step;
  6. DeepSeek-V3's balance without a loss (minipar/core/routing.py): a bias b on each
     expert's score moved against its load after every step: the load per expert
     over 200 steps with the aux loss, with the bias, with neither;
  7. DeepSeek-V3's node-limited routing on two simulated hosts of 4 ranks: the bytes
     that cross between the hosts with and without it; beside the planner's
     `deepseek-v3` preset.

The router here is untrained: random weights, and tokens that share one direction
(as real tokens share common features), so most of them pick the same few experts.
That is why parts 3-4 show an imbalance near 10 and half the assignments dropped:
an untrained router, not a property of expert parallelism. Training fixes it only
if something asks for balance: the aux loss of part 5.

Run it: `mpiexec -n 8 python lessons/03_expert_parallel.py` (add `--plot DIR` for the
expert-load figures, 03_expert_load*.png, 03_bias_balance.png, 03_node_limited.png;
`--quick`: part 6 takes 40 steps instead of 200)
(a whole training run: `mpiexec -n 8 python -m minipar train --model moe --dp 8 --ep 8
--experts 64 --check`).
"""

import argparse
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Ledger
from minipar.comm.job import run_collectively, verdict, wait_for_rank0
from minipar.comm.mesh import Mesh, MeshShape
from minipar.core import autograd as ag
from minipar.core import fused_layers, nn, routing
from minipar.core.byte_units import KiB, format_bytes
from minipar.parallel.expert_parallel import ExpertParallelBlock
from minipar.parallel.moe.load_stats import expected_alltoallv_elements
from minipar.run.results import relative_difference
from minipar.settings.preflight import lesson_arguments

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
EXPERTS, TOP_K, D_MODEL, TOKENS, CAPACITY = 64, 2, 16, 256, 1.0
AUX_COEFS, STEPS, LR = (0.0, 0.01, 0.1), 40, 0.5  # part 5: one run per coefficient
# part 6: 16 experts (a cheaper block), SGD with a gentler lr over many more steps;
# one run per router: (label, router, aux coef, bias rate)
BALANCERS = (("neither", "softmax", 0.0, None), ("aux loss 0.1", "softmax", 0.1, None),
             ("bias b, rate 1e-3", "sigmoid-bias", 0.0, 1e-3))
BIAS_EXPERTS, BIAS_STEPS, QUICK_STEPS, BIAS_LR = 16, 200, 40, 0.1
# part 7: top-8 of 64 (DeepSeek-V3: 8 of 256), the 8 ranks on two hosts of 4
# (`mpiexec -hosts a:4,b:4`): experts 0-31 on host a, 32-63 on host b; a group a host
HOST_TOP_K, HOSTS = 8, 2


def say(*lines: str) -> None:
    """Print from rank 0 only."""
    if rank == 0:
        print(*lines, sep="\n", flush=True)


def config(capacity: float | None, aux_coef: float = 0.01) -> nn.ModelConfig:
    return nn.ModelConfig(model="moe", layers=1, d_in=8, d_model=D_MODEL, experts=EXPERTS,
                          top_k=TOP_K, expert_d_ff=2 * D_MODEL, capacity_factor=capacity,
                          aux_coef=aux_coef)


def inputs() -> tuple[np.ndarray, np.ndarray]:
    """The residual stream h (B, d) entering the block, the same on every rank, and a
    fixed random R (B, d) so that loss = mean_b (out_b . R_b) + aux has a gradient.
    A shared direction in h makes tokens like the same experts, as real tokens do."""
    rng = np.random.default_rng(3)
    h = rng.normal(size=(TOKENS, D_MODEL)) + 0.7 * rng.normal(size=D_MODEL)
    return h, rng.normal(size=(TOKENS, D_MODEL))


def run_block(cfg: nn.ModelConfig, mesh: Mesh, full: dict, h: np.ndarray, r: np.ndarray
              ) -> list | None:
    """Forward and backward of the EP block on this rank's rows; gather to rank 0."""
    b = TOKENS // mesh.dp.size
    rows = slice(mesh.coords["dp"] * b, (mesh.coords["dp"] + 1) * b)
    block = ExpertParallelBlock(full, 0, cfg, mesh)
    x = ag.Tensor(h[rows], requires_grad=True)
    mesh.ledger.reset()
    out, aux = block(x)
    loss = (out * r[rows]).sum() * (1.0 / b) + aux   # this rank's local mean, as in training
    loss.backward()
    mesh.ledger.enabled = False  # what follows is for printing, not part of the model
    grads = {p.name: p.grad for p in block.parameters()}
    mine = (out.data, aux.item(), x.grad, grads, block.last_stats,
            mesh.ledger.total("Alltoallv", "ep"))
    gathered = mesh.world.gather(mine)  # every rank's results -> rank 0
    mesh.ledger.enabled = True
    return gathered


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return relative_difference(a, b)


def compare(cfg: nn.ModelConfig, full: dict, h: np.ndarray, r: np.ndarray,
            gathered: list) -> None:
    """The single-process MoEBlock on all B tokens against what the 8 ranks computed.
    Each rank's gradients are of its local mean loss: summed over the ranks holding a
    weight and divided by dp, as the data-parallel step does."""
    reference = nn.MoEBlock(full, 0, cfg)
    x = ag.Tensor(h, requires_grad=True)
    out, aux = reference(x)
    ((out * r).sum() * (1.0 / TOKENS) + aux).backward()
    outs, auxes, x_grads, grads = list(zip(*gathered))[:4]
    summed: dict[str, np.ndarray] = {}
    for rank_grads in grads:
        for name, g in rank_grads.items():
            summed[name] = summed.get(name, 0.0) + g / size
    worst = max(rel(summed[p.name], p.grad) for p in reference.parameters())
    diffs = {"outputs": rel(np.concatenate(outs), out.data),
             "aux": max(abs(a - aux.item()) for a in auxes) / aux.item(),
             "grads": worst, "x_grad": rel(np.concatenate(x_grads) / size, x.grad)}
    say(f"  outputs   (B, d)            max rel diff {diffs['outputs']:.2e}",
        f"  aux loss  {aux.item():.6f}         max rel diff {diffs['aux']:.2e}",
        f"  gradients ({len(summed)} tensors)   max rel diff {worst:.2e}",
        f"  input grad (B, d)           max rel diff {diffs['x_grad']:.2e}",
        f"  -> {verdict(max(diffs.values()) <= 1e-9)} (tolerance 1e-9)")


def show_dispatch(stats: list[dict], note: str = "") -> None:
    """The dispatch Alltoallv as a matrix: row i = what rank i sends to each rank."""
    say("tokens sent from rank (row) to rank (column), each row = one token copy of d floats:",
        "            " + "".join(f"{j:>6}" for j in range(size)) + " |  sent")
    for i, s in enumerate(stats):
        say(f"  from rank {i}:" + "".join(f"{n:>6}" for n in s["sent"])
            + f" | {sum(s['sent']):>5}")
    say("  received:   " + "".join(f"{sum(s['received']):>6}" for s in stats) + note)


def show_load(s: dict) -> None:
    """How many assignments each expert got, grouped by the rank that holds it."""
    routed = np.array(s["routed"])
    per = EXPERTS // size
    say("", f"expert load: assignments per expert (mean {routed.mean():.0f}, "
        f"max {routed.max()}, imbalance max/mean {s['imbalance']:.2f})")
    for j in range(size):
        counts = routed[j * per:(j + 1) * per]
        say(f"  rank {j} experts {j * per:>2}-{(j + 1) * per - 1:>2}: "
            + " ".join(f"{c:>3}" for c in counts) + f"  | {counts.sum():>4} "
            + "#" * int(round(counts.sum() / 4)))
    say(f"  histogram: how many experts received n assignments (mean {routed.mean():.0f})")
    edges = [0, 1, 5, 9, 17, 33, 65, routed.max() + 1]
    for low, high in zip(edges[:-1], edges[1:]):
        experts = int(((routed >= low) & (routed < high)).sum())
        label = f"{low}" if high == low + 1 else f"{low}-{high - 1}"
        say(f"    n = {label:>7}: {experts:>3} " + "*" * experts)


# ------------------------------------------------- 1-2. the source's example, by hand
def router(h: np.ndarray, full: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The router on raw NumPy, for token rows h (n, d): u = LayerNorm(h), the softmax
    over the 64 experts of u W_r, each token's top-k experts (n, k) (ties to the lower
    id) and their gates (n, k), renormalized over the top-k. As nn.MoEBlock computes."""
    p = "blocks.0"
    u = (h - h.mean(1, keepdims=True)) / np.sqrt(h.var(1, keepdims=True) + 1e-5)
    u = u * full[f"{p}.ln.weight"] + full[f"{p}.ln.bias"]
    logits = u @ full[f"{p}.router.weight"]                     # (n, E)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :TOP_K]   # (n, k): the top-k
    gates = np.take_along_axis(probs, chosen, 1)
    return u, chosen, gates / gates.sum(1, keepdims=True)


def moe_by_hand(h: np.ndarray, full: dict) -> np.ndarray:
    """The whole MoE layer in one process, every expert here:
    h + sum over each token's top-k experts e of gate x Expert_e(LN(h))."""
    u, chosen, gates = router(h, full)
    out = h.copy()
    for e in range(EXPERTS):
        token, slot = np.nonzero(chosen == e)
        out[token] += gates[token, slot, None] * expert(u[token], full, e)
    return out


def expert(x: np.ndarray, full: dict, e: int) -> np.ndarray:
    """Expert e: GELU(x W1 + b1) W2 + b2, GELU in its tanh form."""
    w = f"blocks.0.experts.{e}"
    z = x @ full[f"{w}.fc1.weight"] + full[f"{w}.fc1.bias"]
    a = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    return a @ full[f"{w}.fc2.weight"] + full[f"{w}.fc2.bias"]


def by_hand(full: dict, h: np.ndarray) -> tuple[np.ndarray, list]:
    """Part 1: the MoE layer on 8 ranks, every step written out. Rank r holds tokens
    32r..32r+31 and experts 8r..8r+7. Returns this rank's output rows and, on rank 0,
    every rank's send counts (the dispatch matrix)."""
    per, b = EXPERTS // size, TOKENS // size
    mine = h[rank * b:(rank + 1) * b]                       # this rank's 32 token rows
    u, chosen, gates = router(mine, full)                   # (32, d), (32, k) ids, (32, k)
    # dispatch: one row per (token, slot), sorted by the rank that owns its expert
    token_of = np.repeat(np.arange(b), TOP_K)               # (32 k,)
    expert_of = chosen.ravel()
    order = np.argsort(expert_of // per, kind="stable")
    rows = np.ascontiguousarray(u[token_of[order]])         # (32 k, d), grouped by rank
    ids = np.ascontiguousarray(expert_of[order])
    send = np.bincount(expert_of[order] // per, minlength=size)     # rows for each rank
    recv = np.empty(size, dtype=np.int64)
    comm.Alltoall(send, recv)                               # the counts first
    got_rows = np.empty((recv.sum(), D_MODEL))
    got_ids = np.empty(recv.sum(), dtype=np.int64)
    comm.Alltoallv([rows, send * D_MODEL], [got_rows, recv * D_MODEL])   # dispatch
    comm.Alltoallv([ids, send], [got_ids, recv])            # which expert each row is for
    # the experts: this rank's 8, each on the rows sent to it, from every rank
    done = np.empty_like(got_rows)
    for e in range(rank * per, (rank + 1) * per):
        here = got_ids == e
        done[here] = expert(got_rows[here], full, e)
    back = np.empty_like(rows)
    comm.Alltoallv([done, recv * D_MODEL], [back, send * D_MODEL])       # combine
    # each row comes back where it left from: weight by its gate, add to its token
    out = mine.copy()
    np.add.at(out, token_of[order], gates.ravel()[order, None] * back)
    return out, comm.gather(send.tolist())


def the_hand_example(full: dict, h: np.ndarray) -> tuple[np.ndarray | None, list | None]:
    """Part 1 printed: the dispatch matrix, then the 8 ranks' output against one process."""
    out, sends = by_hand(full, h)
    outs = comm.gather(out)
    if rank != 0:
        return None, None
    say(f"=== 1. the source's example by hand: {EXPERTS} experts on {size} ranks, "
        f"{EXPERTS // size} each, top-{TOP_K}",
        f"  rank r holds tokens {TOKENS // size}r..{TOKENS // size}r+{TOKENS // size - 1} and "
        f"experts {EXPERTS // size}r..{EXPERTS // size}r+{EXPERTS // size - 1}; "
        "router, dispatch Alltoallv, experts, combine Alltoallv:")
    show_dispatch([{"sent": s, "received": [row[j] for row in sends]}
                   for j, s in enumerate(sends)],
                  f"   (each rank: {TOKENS // size} tokens x k={TOP_K} = "
                  f"{TOP_K * TOKENS // size} rows)")
    together = np.concatenate(outs)
    alone = moe_by_hand(h, full)                            # one process, every expert
    diff = rel(together, alone)
    say(f"  one process, the same layer on all {TOKENS} tokens and {EXPERTS} experts:",
        f"  outputs (B, d) max rel diff {diff:.2e} -> {verdict(diff <= 1e-9)} (tolerance 1e-9)")
    return together, sends


def the_picture() -> None:
    """Part 2: the source's Alltoall of 4 GPUs, each holding [A1, A2, A3, A4]: ranks 0-3
    as one communicator (4-7 do the same on theirs). Chunk j of rank i is the number
    10 (i + 1) + (j + 1): its tens say where it started, its units which chunk it is."""
    four = comm.Split(rank // 4, rank)                      # ranks 0-3, and 4-7
    i = four.Get_rank()
    chunks = np.array([10 * (i + 1) + j + 1 for j in range(4)], dtype=np.int64)
    got = np.empty(4, dtype=np.int64)
    four.Alltoall(chunks, got)                              # chunk j of every rank -> rank j
    before, after = four.gather(chunks.tolist()), four.gather(got.tolist())
    four.Free()
    if rank != 0:
        return
    def name(n: int) -> str:
        return f"A{n % 10}_from_GPU{n // 10}"
    say("", "=== 2. the source's AllToAll picture: 4 GPUs (ranks 0-3, one communicator), "
        "each with [A1,A2,A3,A4]",
        "  chunk Aj of GPU i sent as the number 10 i + j; four.Alltoall(chunks, got):")
    for g in range(4):
        say(f"  GPU{g + 1} before {before[g]}  after {after[g]}  = "
            f"[{', '.join(name(n) for n in after[g])}]")
    ok = all(after[g] == [10 * (s + 1) + g + 1 for s in range(4)] for g in range(4))
    say(f"  GPU j ends with chunk Aj of every GPU, one from each -> {verdict(ok)}",
        "  (the source writes the result [A1_from_GPU1, A2_from_GPU2, ...]: one chunk from "
        "each GPU, as printed)",
        "  (the dispatch of part 1 is this with a different number of rows per pair: "
        "Alltoallv)")


def explain_aux(aux: float, coef: float) -> None:
    """What the printed aux loss is, and why it is near its balanced value here."""
    say("", "=== 5. Beyond the source: the aux loss (Switch, Fedus et al. 2021)",
        f"the aux loss: coef E sum_e f_e P_e = {aux:.6f}, coef = {coef}",
        "  f_e: the share of assignments that chose expert e (a count: no gradient),",
        "  P_e: the mean router probability of e (the gradient flows through it).",
        "  Both sum to 1; with every expert alike (f = P = 1/E) it equals coef, and it grows",
        "  as the popular experts are also the probable ones. Its gradient lowers P_e in",
        "  proportion to f_e: the crowded experts lose probability, tokens move elsewhere.",
        f"  Here aux / coef = {aux / coef:.3f}: the untrained router's probabilities are",
        f"  still nearly uniform (each near 1/{EXPERTS}) even though its top-{TOP_K} picks are",
        "  not, so the loss is small while its gradient already points toward balance.")


def balance_run(coef: float, h: np.ndarray, r: np.ndarray) -> list[dict]:
    """STEPS of SGD on the block in one process, loss = mean(out . R) + aux, with aux
    coefficient `coef`: per step the imbalance (max/mean routed), the share dropped at
    capacity 1.0, and aux / coef. The router is the same on every rank, so one process
    shows what the 8 ranks would do (part 3 checked that they compute the same)."""
    cfg = config(CAPACITY, coef)
    block = nn.MoEBlock(nn.init_params(cfg, seed=0), 0, cfg)
    limit = nn.capacity(CAPACITY, TOP_K, TOKENS, EXPERTS)
    history = []
    for step in range(STEPS + 1):
        probs = fused_layers.softmax(block.ln(ag.Tensor(h)) @ block.router).data   # before the step
        counts = np.bincount(nn.route(probs, TOP_K).ravel(), minlength=EXPERTS)
        block.zero_grad()
        out, aux = block(ag.Tensor(h))
        history.append({"step": step, "imbalance": float(counts.max() / counts.mean()),
                        "dropped": float((counts - np.minimum(counts, limit)).sum()
                                         / (TOP_K * TOKENS)),
                        "aux": aux.item() / coef if coef else float("nan")})
        ((out * r).sum() * (1.0 / TOKENS) + aux).backward()
        for p in block.parameters():
            p.data -= LR * p.grad
    return history


def the_balance(h: np.ndarray, r: np.ndarray) -> dict[float, list[dict]]:
    """Part 5: one training run per aux coefficient, on ranks 0, 1, 2; the other ranks
    wait without spinning (Ibarrier + sleep) so the runs get the cores."""
    mine = balance_run(AUX_COEFS[rank], h, r) if rank < len(AUX_COEFS) else None
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)
    runs = comm.gather(mine)  # small lists of dicts -> rank 0
    if rank != 0:
        return {}
    histories = dict(zip(AUX_COEFS, runs))
    say("", f"the aux loss at work: {STEPS} SGD steps (lr {LR}) of this block on "
        f"loss = mean(out . R) + aux, capacity {CAPACITY}",
        "  step  " + "".join(f"{f'aux coef {c}':>26}" for c in AUX_COEFS),
        "        " + "".join(f"{'imbalance  dropped':>26}" for _ in AUX_COEFS))
    for step in (0, 5, 10, 20, STEPS):
        say(f"  {step:4d}  " + "".join(
            f"{run[step]['imbalance']:>17.2f} {run[step]['dropped']:>8.0%}"
            for run in histories.values()))
    last = {c: run[-1] for c, run in histories.items()}
    say(f"  after {STEPS} steps: without aux imbalance {last[0.0]['imbalance']:.2f}, "
        f"dropped {last[0.0]['dropped']:.0%}; with coef {AUX_COEFS[-1]} "
        f"{last[AUX_COEFS[-1]]['imbalance']:.2f}, {last[AUX_COEFS[-1]]['dropped']:.0%}.",
        "  The task loss alone moves the router too (the imbalance falls without aux);",
        "  the aux loss pushes it further, faster: more experts get work, fewer tokens drop.",
        f"  (the default coef 0.01 is gentle; 0.1 shows the effect within {STEPS} steps)")
    return histories


# --------------------------------------------------------- 6-7. DeepSeek-V3
def bias_run(router: str, coef: float, rate: float | None, steps: int,
             h: np.ndarray, r: np.ndarray) -> list[list[int]]:
    """`steps` SGD steps of a 16-expert block in one process on loss = mean(out . R) + aux;
    the load per expert (assignments of the 256 tokens) measured before each step. With
    sigmoid-bias, b moves after every step (routing.update_biases) and no aux loss."""
    cfg = nn.ModelConfig(model="moe", layers=1, d_in=8, d_model=D_MODEL,
                         experts=BIAS_EXPERTS, top_k=TOP_K, expert_d_ff=2 * D_MODEL,
                         aux_coef=coef, router=router)
    block = nn.MoEBlock(nn.init_params(cfg, seed=0), 0, cfg)
    loads = []
    for _ in range(steps + 1):
        block.zero_grad()
        out, aux = block(ag.Tensor(h))
        with ag.no_grad():  # the routing this step's forward made, counted
            scores = routing.scores(block.ln(ag.Tensor(h)), block.router, router).data
        bias = 0.0 if block.balance is None else block.balance.value
        loads.append(np.bincount(routing.choose(scores + bias, TOP_K).ravel(),
                                 minlength=BIAS_EXPERTS).tolist())
        ((out * r).sum() * (1.0 / TOKENS) + aux).backward()
        for p in block.parameters():
            p.data -= BIAS_LR * p.grad
        if block.balance is not None:  # b += rate sign(mean load - load), after the step
            routing.update_biases(block, None, rate)
    return loads


def the_bias(h: np.ndarray, r: np.ndarray, steps: int) -> dict[str, np.ndarray]:
    """Part 6: one run per balancer on ranks 0, 1, 2 (the others wait, not spinning)."""
    mine = bias_run(*BALANCERS[rank][1:], steps, h, r) if rank < len(BALANCERS) else None
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)
    runs = comm.gather(mine)  # loads per step, per expert -> rank 0
    if rank != 0:
        return {}
    loads = {label: np.array(run) for (label, *_), run in zip(BALANCERS, runs)}
    imbalance = {label: load.max(axis=1) / load.mean(axis=1) for label, load in loads.items()}
    say("", "=== 6. Beyond the source: DeepSeek-V3's balance without a loss",
        f"  {steps} SGD steps (lr {BIAS_LR}) of a {BIAS_EXPERTS}-expert top-{TOP_K} block, "
        f"{TOKENS} tokens, no capacity; loss = mean(out . R) (+ aux)",
        "  the load per expert measured at every step; imbalance = max / mean load",
        "  step  " + "".join(f"{label:>20}" for label in loads))
    for step in sorted({0, 10, 20, 50, 100, 150, steps} & set(range(steps + 1))):
        say(f"  {step:4d}  " + "".join(f"{imbalance[label][step]:>20.2f}" for label in loads))
    tail = max(1, steps // 4)  # the last quarter of the run
    means = {label: float(v[-tail:].mean()) for label, v in imbalance.items()}
    say(f"  mean imbalance over the last {tail} steps: " + ", ".join(
        f"{label} {value:.2f}" for label, value in means.items()),
        "  The task loss alone pulls tokens towards a few experts (the imbalance grows);",
        "  the aux loss slows that by changing the router's gradient; the bias never",
        "  touches the gradient, it shifts only the choice (top-k of s + b), and holds",
        "  the load near even.",
        f"  -> {verdict(means['bias b, rate 1e-3'] < min(means['neither'], means['aux loss 0.1']))}"
        " (the bias balances best)")
    return loads


def bias_figure(loads: dict[str, np.ndarray], folder: Path) -> None:
    """Rank 0: imbalance step by step per balancer, and the final load per expert."""
    from matplotlib.figure import Figure

    from minipar.teaching.load_plots import series_style
    from minipar.teaching.plots import save

    figure = Figure(figsize=(11, 3.8), layout="constrained")
    left, right = figure.subplots(1, 2)
    width = 0.8 / len(loads)
    for i, (label, load) in enumerate(loads.items()):
        left.plot(load.max(axis=1) / load.mean(axis=1), label=label, markersize=5,
                  markevery=max(1, len(load) // 10), **series_style(i))
        right.bar(np.arange(BIAS_EXPERTS) + (i - 1) * width, load[-1], width, color=f"C{i}",
                  label=label)
    left.axhline(1.0, color="black", ls=":", lw=1, label="perfect balance")
    left.set(xlabel="training step", ylabel="imbalance: max / mean load", ylim=(0, None))
    right.axhline(TOP_K * TOKENS / BIAS_EXPERTS, color="black", ls=":", lw=1,
                  label="even share")
    right.set(xlabel="expert", ylabel="assignments at the last step",
              ylim=(0, 1.4 * max(load[-1].max() for load in loads.values())))
    left.set_title("the router's imbalance, measured at every step", fontsize=10)
    right.set_title("load per expert at the last step", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
    figure.suptitle(f"{BIAS_EXPERTS} experts, top-{TOP_K}, {TOKENS} tokens: the aux loss, "
                    "DeepSeek-V3's bias, or neither", fontsize=11)
    say("figure: " + str(save(figure, folder / "03_bias_balance.png")))


def node_limited(h: np.ndarray, r: np.ndarray) -> dict[int, dict] | None:
    """Part 7: the block on 8 ranks (dp=8, ep=8), top-8 of 64, experts grouped by host;
    each token's M best hosts, M = 2 (no limit) and 1. Measured from the dispatch: per
    rank the tokens (each once per host) and rows sent to the other host."""
    mesh = Mesh(MeshShape(dp=8, ep=8), comm, Ledger())
    found = {}
    for top in (HOSTS, 1):
        cfg = nn.ModelConfig(model="moe", layers=1, d_in=8, d_model=D_MODEL, experts=EXPERTS,
                             top_k=HOST_TOP_K, expert_d_ff=2 * D_MODEL,
                             route_groups=HOSTS, route_top_groups=top)
        gathered = run_block(cfg, mesh, nn.init_params(cfg, seed=0), h, r)
        if rank == 0:
            stats = [g[4] for g in gathered]
            host_of = [i * HOSTS // size for i in range(size)]
            found[top] = {
                "tokens": sum(s["tokens_to_group"][1 - host_of[i]] for i, s in enumerate(stats)),
                "rows": sum(s["rows_to_group"][1 - host_of[i]] for i, s in enumerate(stats)),
                "most": max(s["most_groups"] for s in stats),
                "mean": sum(sum(s["tokens_to_group"]) for s in stats) / TOKENS}
    mesh.free()
    if rank != 0:
        return None
    from minipar.planner.presets import MODELS

    v3 = MODELS["deepseek-v3"]
    say("", "=== 7. Beyond the source: DeepSeek-V3's node-limited routing",
        f"  {EXPERTS} experts on {size} ranks, top-{HOST_TOP_K}, the ranks on two simulated "
        f"hosts (mpiexec -hosts a:4,b:4):", f"  experts 0-{EXPERTS // 2 - 1} on a, "
        f"{EXPERTS // 2}-{EXPERTS - 1} on b;",
        "  a routing group is a host:",
        "  each token keeps its M hosts of largest top-2 score sum, then its top-8 there",
        f"  {'M':>3} {'hosts a token reaches':>22} {'tokens to the other host':>25} "
        f"{'rows to the other host':>23}")
    for top, f in found.items():
        reach = f"max {f['most']}, mean {f['mean']:.2f}"
        tokens, rows = (format_bytes(f[key] * D_MODEL * 8) for key in ("tokens", "rows"))
        say(f"  {top:>3} {reach:>22} {f['tokens']:>8} = {tokens:>9} {f['rows']:>10} = {rows:>9}")
    limited, free = found[1], found[HOSTS]
    say(f"  the ledger's check: with M = 1 no token reaches more than 1 host -> "
        f"{verdict(limited['most'] <= 1)}",
        "  cross-host bytes with each token sent once per host (DeepSeek-V3 forwards it",
        f"  inside the node over NVLink): {format_bytes(free['tokens'] * D_MODEL * 8)} -> "
        f"{format_bytes(limited['tokens'] * D_MODEL * 8)} "
        f"({limited['tokens'] / free['tokens']:.0%})",
        "  the rows minipar's Alltoallv moves, one per (token, expert), barely change: a",
        "  token's 8 experts simply sit on one host now; the saving is in sending it once.",
        "  at full size, the planner's `deepseek-v3` preset (minipar/planner/presets.py): "
        f"{v3.experts} routed",
        f"  experts + {v3.shared_experts} shared of {v3.expert_d_ff}, {v3.top_k} per token, "
        "routed to at most 4 nodes of 8 GPUs:",
        "  python -m minipar plan --preset deepseek-v3 --cluster h800 --global-batch 15360 \\",
        "      --dp 128 --pp 16 --tp 1 --cp 1 --ep 64 --zero 1     (its PP 16 x EP 64 x ZeRO-1 DP)")
    return found


def node_figure(found: dict[int, dict], folder: Path) -> None:
    """Rank 0: bytes crossing the two hosts, with and without node-limited routing."""
    from matplotlib.figure import Figure

    from minipar.teaching.plots import save

    figure = Figure(figsize=(7, 3.6), layout="constrained")
    ax = figure.subplots()
    labels = [f"M = {top}" + (" (no limit)" if top == HOSTS else " (node-limited)")
              for top in found]
    x = np.arange(len(found))
    ax.bar(x - 0.2, [f["tokens"] * D_MODEL * 8 / KiB for f in found.values()], 0.4,
           label="each token once per host (DeepSeek-V3)")
    ax.bar(x + 0.2, [f["rows"] * D_MODEL * 8 / KiB for f in found.values()], 0.4,
           label="one row per (token, expert) (minipar's Alltoallv)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("KiB sent to the other host, all ranks\n(wire bytes of the dispatch)")
    ax.set_ylim(0, 1.3 * max(f["rows"] * D_MODEL * 8 / KiB for f in found.values()))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(f"{EXPERTS} experts on 2 hosts x 4 ranks, top-{HOST_TOP_K}, {TOKENS} "
                 "tokens: the dispatch's cross-host bytes", fontsize=10)
    say("figure: " + str(save(figure, folder / "03_node_limited.png")))


def plot_load(stats: dict, capacity: float | None, folder: Path) -> None:
    """Rank 0: the load of the block per expert and per rank, as a figure."""
    from minipar.teaching.load_plots import expert_load_figure
    from minipar.teaching.plots import save

    name = "no capacity" if capacity is None else f"capacity factor {capacity}"
    path = save(expert_load_figure(stats, f"{EXPERTS} experts on {size} ranks, top-{TOP_K}, "
                                          f"{TOKENS} tokens: {name}"),
                folder / f"03_expert_load{'' if capacity is None else '_capacity'}.png")
    say(f"figure: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write figures here (PNG)")
    parser.add_argument("--quick", action="store_true",
                        help=f"part 6: {QUICK_STEPS} steps instead of {BIAS_STEPS}")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    if size != 8:
        say("run with 8 ranks: mpiexec -n 8 python lessons/03_expert_parallel.py")
        sys.exit(2)
    mesh = Mesh(MeshShape(dp=8, ep=8), comm, Ledger())
    h, r = inputs()
    say(f"{EXPERTS} experts on {size} ranks, {EXPERTS // size} each; {TOKENS} tokens, "
        f"{TOKENS // size} per rank; top-{TOP_K} routing; d={D_MODEL}", "")
    hand, sends = the_hand_example(nn.init_params(config(None), seed=0), h)   # part 1
    wait_for_rank0(comm)  # the others asleep while rank 0 computes the one-process layer
    the_picture()                                                      # part 2
    for capacity in (None, CAPACITY):
        wait_for_rank0(comm)  # the others asleep while rank 0 reports (reruns, a figure)
        cfg = config(capacity)
        full = nn.init_params(cfg, seed=0)
        gathered = run_block(cfg, mesh, full, h, r)
        if rank != 0:
            continue
        stats = [g[4] for g in gathered]
        if capacity is None:
            library = rel(np.concatenate([g[0] for g in gathered]), hand)
            same = [s["sent"] for s in stats] == sends
            say("", "=== 3. the same layer with minipar's expert parallelism "
                "(ExpertParallelBlock, minipar/parallel/expert_parallel.py)",
                f"  its output against part 1's by hand: max rel diff {library:.2e} -> "
                f"{verdict(library <= 1e-9)}",
                f"  its dispatch sent the same rows to the same ranks as part 1: "
                f"{verdict(same, 'yes', 'NO')}")
            show_load(stats[0])
            say("", f"(an untrained router on tokens sharing one direction: imbalance "
                f"{stats[0]['imbalance']:.1f}; perfect balance would be 1.0 -- part 5 trains it)")
        else:
            s = stats[0]
            say("", f"=== 4. Beyond the source: capacity factor {capacity}: each expert takes "
                f"at most ceil({capacity} x {TOP_K} x {TOKENS} / {EXPERTS}) = {s['limit']} "
                "assignments,",
                "  in global token order",
                f"  dropped by capacity: {s['dropped']} of {TOP_K * TOKENS} assignments "
                f"(a dropped token slot adds 0: the residual carries the token)",
                "  dropped on each rank (at the source, never sent; later ranks hold later "
                "tokens, which find their experts full):\n    "
                + " ".join(str(g[4]["dropped_here"]) for g in gathered),
                *textwrap.wrap("over the limit: " + ", ".join(
                    f"e{e} {n}->{s['limit']}" for e, n in enumerate(s["routed"]) if n > s["limit"]),
                    width=116, initial_indent="  ", subsequent_indent="    "))
            show_dispatch(stats)
        kept = sum(sum(g[4]["sent"]) for g in gathered)
        moved = sum(g[5] for g in gathered)
        say("", f"ledger: Alltoallv elements (all ranks, forward+backward): {moved} = "
            f"4 x kept {kept} x d {D_MODEL}"
            + (f"\n  (= 4 x k x tokens x d: {TOP_K} x {TOKENS} x {D_MODEL} per direction)"
               if capacity is None else ""),
            f"  formula agrees: {moved == expected_alltoallv_elements(kept, D_MODEL)}", "",
            f"one process, same block{' with capacity' if capacity else ''}:")
        compare(cfg, full, h, r, gathered)
        if capacity is None:
            aux = (gathered[0][1], cfg.aux_coef)
        say("")
        if args.plot:
            plot_load(stats[0], capacity, args.plot)
    wait_for_rank0(comm)
    mesh.free()
    if rank == 0:
        explain_aux(*aux)
    histories = the_balance(h, r)
    if args.plot and rank == 0:
        from minipar.teaching.load_plots import balance_figure
        from minipar.teaching.plots import save

        say("figure: " + str(save(balance_figure(histories, CAPACITY, f"{EXPERTS} experts, "
                                                 f"top-{TOP_K}, {TOKENS} tokens: training the "
                                                 f"router with and without the aux loss"),
                                  args.plot / "03_aux_balance.png")))
    wait_for_rank0(comm)
    loads = the_bias(h, r, QUICK_STEPS if args.quick else BIAS_STEPS)
    found = node_limited(h, r)
    if args.plot and rank == 0:
        bias_figure(loads, args.plot)
        node_figure(found, args.plot)


if __name__ == "__main__":
    run_collectively(main)
