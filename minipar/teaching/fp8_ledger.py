"""The ledger's formulas for FP8: how many amax Allreduces, of how many float32 numbers,
a rank makes in a step, and what ZeRO-3's 8-bit gather carries (docs/design.md, "FP8").

What this file teaches. core/fp8.py quantizes; parallel/fp8_scales.py agrees the scales
over the mesh; this file counts what that agreement puts on the wire, from the run's
config and the blocks a rank holds (planner/memory_cost.py's rank shape), so that
`--check` and the tests can hold the measured ledger against it line by line
(teaching/ledger_tables.py adds these lines to every strategy's own).
"""

from __future__ import annotations

from collections.abc import Iterable


def linears(cfg: object, block: object) -> tuple[int, int, int]:
    """A block's 8-bit linears on one rank: (all, input-cut, output-cut) -- under tp the
    row-parallel ones (fc2, proj) have their input features cut, the column-parallel ones
    (fc1, q, k, v) their outputs. An MoE FFN: 2 per routed and shared expert (E / ep of
    them), cut like the dense FFN's when the MLP MoE splits them over tp (fc1 by
    columns, fc2 by rows: parallel/moe/expert_tp.py), whole otherwise (gpt-moe over tp)."""
    attention = 4 if cfg.model in ("gpt", "gpt-moe") else 0   # q, k, v, proj
    experts = block.experts // cfg.ep + cfg.shared_experts
    ffn = 2 * experts if block.moe else 2
    cut = cfg.tp > 1
    pairs = (experts if split_experts(cfg) else 0) if block.moe else 1   # (fc1, fc2)s cut
    return attention + ffn, (attention // 4 + pairs) * cut, (3 * attention // 4 + pairs) * cut


def split_experts(cfg: object) -> bool:
    """Does the run split every expert over tp (the MLP MoE with --tp; gpt-moe keeps
    them whole on every tp rank)?"""
    return cfg.model == "moe" and cfg.tp > 1


def routed_rows(cfg: object, blocks: Iterable[object]) -> dict[tuple[str, str], int]:
    """(group, op) -> float32 amaxes a step adds per row an expert rank *receives*: the
    rows the router sent it are known only after the dispatch (`ledger_tables`' routed
    lines: calls fixed, elements a multiple of a row's). Rowwise with the experts split
    over tp: each routed expert's fc2 input row and fc1 output-gradient row span the tp
    shards, one amax each over tp (the forward's twice under --recompute full)."""
    if getattr(cfg, "fp8", None) != "rowwise" or not split_experts(cfg):
        return {}
    uses = 3 if getattr(cfg, "recompute", "none") == "full" else 2
    return {("tp", "Allreduce"): uses} if any(b.moe for b in blocks) else {}


def expected_ledger(cfg: object, blocks: Iterable[object]) -> dict[tuple[str, str],
                                                                    tuple[int, int]]:
    """(group, op) -> (calls, elements) of the amax Allreduces one rank makes in a step,
    each element a float32 (docs/design.md, "FP8"), for the `blocks` it holds
    (planner/memory_cost.py's rank shape):

    - the weights, once a step (`Recipe.begin_step`): one Allreduce over tp of every
      tensorwise weight's amax (all are cut), or of each row-parallel weight's d
      output-column amaxes (rowwise); none blockwise;
    - each microbatch, each linear: tensorwise, the amax of X (forward) and of dY
      (backward) over its replicas (dp; an expert's: edp, the ranks holding the same
      experts), and over tp where its features are cut; rowwise, the N row
      amaxes over tp where they are cut (N the rank's rows of the microbatch; a
      routed expert split over tp: the rows it received, `routed_rows`, not counted
      here); under --recompute full each X amax twice (the forward again in the
      backward).

    The MLP MoE's experts split over tp are cut as the dense FFN is (fc1 by columns,
    fc2 by rows, `linears`): their weights' amaxes join the one tp call of the step,
    and their X (fc2) and dY (fc1) amaxes are agreed over tp, then (tensorwise) over
    edp like any expert's."""
    if getattr(cfg, "fp8", None) is None:
        return {}
    blocks = list(blocks)
    out: dict[tuple[str, str], tuple[int, int]] = {}

    def add(key: tuple[str, str], calls: int, elements: int) -> None:
        if calls:
            old = out.get(key, (0, 0))
            out[key] = (old[0] + calls, old[1] + elements)

    if cfg.zero == 3:   # the weights' amaxes from the slices: one call a flat vector
        dense, experts = zero3_groups(cfg, blocks)
        add(("dp", "Allreduce"), 1 if dense and cfg.dp > 1 else 0, dense)
        add(("edp", "Allreduce"), 1 if experts and cfg.dp // cfg.ep > 1 else 0, experts)
    if cfg.fp8 == "blockwise":
        return out
    counts = [linears(cfg, b) for b in blocks]
    every, x_cut, dy_cut = (sum(c[i] for c in counts) for i in range(3))
    m = block_feeds(cfg)
    rows = cfg.batch // (cfg.microbatches * cfg.dp) * (   # the positions this rank holds
        cfg.seq_len // cfg.cp if cfg.model in ("gpt", "gpt-moe") else 1)

    # --recompute full runs each block's forward again in the backward: its X amaxes
    # are agreed again (the same numbers, so the same scales); selective recomputes
    # only the attention core, which has no 8-bit matmul
    uses = 3 if getattr(cfg, "recompute", "none") == "full" else 2   # X (twice), dY
    if cfg.tp > 1:
        weights = x_cut + dy_cut if cfg.fp8 == "tensorwise" else x_cut * cfg.d_model
        add(("tp", "Allreduce"), 1 if weights else 0, weights)
        per_row = 1 if cfg.fp8 == "tensorwise" else rows
        cut = (uses - 1) * x_cut + dy_cut
        # rowwise: a routed expert's rows are those it received (`routed_rows`), not mine
        routed = uses * sum(b.experts // cfg.ep for b in blocks if b.moe) \
            if routed_rows(cfg, blocks) else 0
        add(("tp", "Allreduce"), m * cut, m * (cut - routed) * per_row)
    if cfg.fp8 == "tensorwise":   # X and dY of each linear, over its replicas
        experts = sum(2 * (b.experts // cfg.ep) for b in blocks if b.moe)  # edp's
        for group, n, size in (("dp", every - experts, cfg.dp * cfg.cp),   # dp x cp
                               ("edp", experts, cfg.dp // cfg.ep * cfg.cp)):
            add((group, "Allreduce"), uses * m * n if size > 1 else 0, uses * m * n)
    return out


def block_feeds(cfg: object) -> int:
    """Microbatches each block a rank holds runs in a step: M, or M / 2 under DualPipe,
    whose rank holds two copies of the model each fed from one end (parallel/pipeline
    schedules.py's TWO_WAY; its `blocks` list both copies' blocks)."""
    two_way = getattr(cfg, "schedule", None) == "dualpipe" and getattr(cfg, "pp", 1) > 1
    return cfg.microbatches // 2 if two_way else cfg.microbatches


def zero3_groups(cfg: object, blocks: Iterable[object]) -> tuple[int, int]:
    """(dense, expert) scaling groups of the 8-bit weights of `blocks`: what ZeRO-3's
    Allreduce(MAX) of the sliced weights' amaxes carries over dp and over edp, counted
    on this rank's tp shards (q, k, v, fc1 by columns, proj, fc2 by rows; the MLP MoE's
    experts split over tp, gpt-moe's whole)."""
    d, f, fe, t = cfg.d_model, cfg.d_ff, cfg.expert_d_ff, cfg.tp
    fe //= t if cfg.model == "moe" else 1   # the MLP MoE splits each expert over tp

    def groups(rows: int, cols: int) -> int:
        if cfg.fp8 == "tensorwise":
            return 1
        if cfg.fp8 == "rowwise":
            return cols
        return -(-rows // cfg.fp8_block) * -(-cols // cfg.fp8_block)

    dense = experts = 0
    for block in blocks:
        if cfg.model in ("gpt", "gpt-moe"):
            dense += 3 * groups(d, d // t) + groups(d // t, d)
        pair = groups(d, fe) + groups(fe, d)   # gpt-moe's experts whole over tp
        if block.moe:
            experts += block.experts // cfg.ep * pair
            dense += cfg.shared_experts * pair
        else:
            dense += groups(d, f // t) + groups(f // t, d)
    return dense, experts


def covered_elements(cfg: object, blocks: Iterable[object]) -> tuple[int, int]:
    """(dense, expert) elements of the 8-bit weights of `blocks`: what --fp8-allgather
    moves as one byte each (the rest of a ZeRO-3 piece moves as two), on this rank's tp
    shards (the MLP MoE's experts split over tp, gpt-moe's whole)."""
    d, t = cfg.d_model, cfg.tp
    pair = 2 * d * cfg.expert_d_ff // (t if cfg.model == "moe" else 1)   # split over tp
    dense = experts = 0
    for block in blocks:
        dense += 4 * d * d // t if cfg.model in ("gpt", "gpt-moe") else 0
        if block.moe:
            experts += block.experts // cfg.ep * pair
            dense += cfg.shared_experts * pair
        else:
            dense += 2 * d * cfg.d_ff // t
    return dense, experts
