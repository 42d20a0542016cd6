"""DiLoCo priced (`plan --sites S ...`): the seconds a step spends on the slow link between sites.

What this file teaches. A job too big for one building runs on S sites, dp/S of its dp
replicas in each (each replica its own tp x pp x cp mesh, inside one site). Inside a
site the links are the cluster's (NVLink in a node, 400 Gb/s InfiniBand per GPU
between nodes); between the sites one slow link (`--slow-link-gbps`, 100 Gb/s each way by
default) carries everything a site sends the others. What crosses it, per step:

  DP            every step the gradients' Allreduce over all dp replicas. Done the
                cheap way -- each site sums its own replicas first (a Reduce_scatter
                inside the site), the S site sums meet over the link, the result goes
                back out inside the site (an Allgather) -- each site's link still carries
                a ring over the S sites of the whole model: 2 (S-1)/S x params x bytes
                (memory.wire_elements with N = S; for two sites exactly the model, once
                each way).
  DiLoCo        (docs/design.md "DiLoCo") the same Allreduce, of the parameters, once
                every H inner steps: on average 1/H of DP's bytes a step, but the step
                that talks still carries the whole model.
  streaming     (`--fragments P`) fragment p (blocks [p L/P, (p+1) L/P); the embedding,
                the final norm and the head join fragment 0) talks after inner steps
                p H/P + H, p H/P + 2H, ...: the same 1/H on average, and the worst step
                carries one fragment, about 1/P of the model.

The time on the link is its bytes over its bandwidth (the link, shared by every GPU of
the site, is the bottleneck: each GPU's own NIC sends only its 1/(dp/S) shard of its
stage). The rest of a step -- compute, the pipeline, tp, the bubble -- is the planner's
price of the named plan (planner/search.py), and the in-site part of the Allreduce is
its ledger's dp entries priced over the dp/S replicas of one site (planner/time_cost.py).
DiLoCo keeps two more copies of each GPU's parameters (the outer theta and the outer
momentum, fp32: 8 bytes a parameter), never sharded (a worker holds its whole optimizer
state: `--zero` is refused with `--outer diloco`).
Tested by `python -m pytest tests/planner/test_diloco.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minipar.core.memory import wire_elements
from minipar.planner.memory_cost import Workload
from minipar.planner.search import GB, Estimate, representative_stages, shape_of, usable
from minipar.planner.time_cost import Hardware, axis_seconds, traffic

DEFAULT_LINK_GBPS = 100.0        # the slow link between sites, Gb/s each way
DEFAULT_INNER_STEPS = (4, 16, 64)
OUTER_STATE_BYTES = 8            # per parameter: the outer theta and momentum, fp32


def link_bandwidth(gbps: float) -> float:
    """Bytes per second of a link of `gbps` gigabits per second (1e9 bits, 8 to a byte)."""
    return gbps * 1e9 / 8


def fragment_params(w: Workload, fragments: int) -> list[int]:
    """Parameters of each streaming fragment: fragment p holds blocks [p L/P, (p+1) L/P),
    fragment 0 also every parameter outside the blocks (embedding, final norm, head:
    `w.params` minus the blocks'). They add up to `w.params`; fragments = 1 is the whole
    model. Raises ValueError if P does not divide the layers."""
    if fragments < 1 or w.layers % fragments:
        raise ValueError(f"--fragments {fragments} does not divide the {w.layers} layers")
    per_block = [sum(s for s, _ in b.arrays) + b.experts * sum(b.expert) for b in w.blocks]
    size = w.layers // fragments
    out = [sum(per_block[p * size:(p + 1) * size]) for p in range(fragments)]
    out[0] += w.params - sum(per_block)
    return out


def crossing_bytes(numbers: float, sites: int, itemsize: int) -> float:
    """Bytes each site's link carries each way for one Allreduce of `numbers` over
    replicas spread on `sites` sites, each site summing its own first: a ring over the
    S site sums, 2 (S-1)/S of them (two sites: the numbers, once each way)."""
    return wire_elements("Allreduce", numbers, sites) * itemsize


def link_schedule(sizes: list[int], inner_steps: int, steps: int, sites: int,
                  itemsize: int) -> list[float]:
    """Bytes on each site's link at steps 1..`steps`: fragment p (its `sizes[p]`
    numbers) crosses after steps p H/P + H, p H/P + 2H, ... (H = inner_steps, P =
    len(sizes), P dividing H). DP's gradient Allreduce is H = 1 with one fragment."""
    if inner_steps % len(sizes):
        raise ValueError(f"--fragments {len(sizes)} does not divide --inner-steps "
                         f"{inner_steps}")
    out = [0.0] * steps
    for p, numbers in enumerate(sizes):
        first = p * inner_steps // len(sizes) + inner_steps
        for step in range(first, steps + 1, inner_steps):
            out[step - 1] += crossing_bytes(numbers, sites, itemsize)
    return out


@dataclass(frozen=True)
class SitePrice:
    """One strategy's step over S sites, seconds and bytes on each site's slow link each
    way: the average step (steady state: per H steps every fragment once) and the worst
    (the step that carries the largest fragment); `in_site` the in-site part of the
    Allreduce on the average step (`in_site_worst` on the worst), `rest` everything else
    of the step (compute, pipeline, tp, the bubble) of the `variant` it runs (M,
    recomputation, schedule), `extra_memory` bytes per GPU the strategy adds to it."""

    label: str
    inner_steps: int
    fragments: int
    average_bytes: float
    worst_bytes: float
    link_average: float
    link_worst: float
    in_site: float
    in_site_worst: float
    rest: float
    variant: Estimate
    extra_memory: float = 0.0

    @property
    def step_average(self) -> float:
        return self.rest + self.in_site + self.link_average

    @property
    def step_worst(self) -> float:
        return self.rest + self.in_site_worst + self.link_worst


def in_site_seconds(w: Workload, hw: Hardware, e: Estimate, sites: int) -> float:
    """The in-site part of one gradient (or parameter) Allreduce of the plan: its
    ledger's dp entries after the pipeline, priced over the dp/S replicas (x cp) of one
    site (a Reduce_scatter and an Allgather inside it move the wire bytes of an Allreduce
    over those ranks), on the busiest of the representative stages."""
    site = replace(e.plan, dp=e.plan.dp // sites)
    shapes = [shape_of(w, e.plan.tp, e.plan.pp, e.plan.ep, e.plan.virtual, s)
              for s in representative_stages(w, e.plan)]
    return max(axis_seconds(traffic(w, e.plan, shape), "step", site, hw).get("dp", 0.0)
               for shape in shapes)


def gpu_params(w: Workload, e: Estimate) -> int:
    """Parameters the busiest GPU holds (its stage's arrays, tp-split ones cut)."""
    return max(sum(shape_of(w, e.plan.tp, e.plan.pp, e.plan.ep, e.plan.virtual, s).dp_arrays)
               for s in representative_stages(w, e.plan))


def diloco_variant(w: Workload, hw: Hardware, variants: list[Estimate]) -> Estimate:
    """The fastest variant (M, recomputation, schedule) of the named mesh that still fits
    once DiLoCo's outer state is added (its `OUTER_STATE_BYTES` a parameter of the GPU's
    share); the fastest of all if none does (the table then says it does not fit)."""
    extra = OUTER_STATE_BYTES * gpu_params(w, variants[0])
    return next((e for e in variants if e.memory + extra <= usable(hw)), variants[0])


def site_prices(w: Workload, hw: Hardware, variants: list[Estimate], sites: int, gbps: float,
                settings: list[tuple[int, int]]) -> list[SitePrice]:
    """DP, then DiLoCo at each (inner steps H, fragments P) of `settings`, for the priced
    variants of one named mesh (fastest first, ZeRO 0: each replica holds the whole
    model), its dp replicas over `sites` sites joined by a link of `gbps` Gb/s each way.
    DP runs the fastest variant, DiLoCo the fastest that fits with its outer state
    (`diloco_variant`). The numbers cross in the width of DP's gradients
    (`w.grad_bytes`), so on the link DiLoCo's saving is H and nothing else."""
    bandwidth = link_bandwidth(gbps)
    whole = crossing_bytes(w.params, sites, w.grad_bytes)

    def rest(e: Estimate) -> float:
        return e.timing.total - e.timing.step_comm.get("dp", 0.0)

    dp = variants[0]
    inside = in_site_seconds(w, hw, dp, sites)
    out = [SitePrice("DP", 1, 1, whole, whole, whole / bandwidth, whole / bandwidth, inside,
                     inside, rest(dp), dp)]
    own = diloco_variant(w, hw, variants)
    extra, inside = OUTER_STATE_BYTES * gpu_params(w, own), in_site_seconds(w, hw, own, sites)
    for h, p in settings:
        sizes = fragment_params(w, p)
        if h % p:
            raise ValueError(f"--fragments {p} does not divide --inner-steps {h}")
        worst = crossing_bytes(max(sizes), sites, w.grad_bytes)
        label = f"DiLoCo H={h}" + (f" P={p}" if p > 1 else "")
        out.append(SitePrice(label, h, p, whole / h, worst, whole / h / bandwidth,
                             worst / bandwidth, inside / h, inside * max(sizes) / w.params,
                             rest(own), own, extra))
    return out


def site_records(prices: list[SitePrice]) -> list[dict]:
    """The table's rows for `--json`: GB and seconds."""
    return [{"strategy": p.label, "inner_steps": p.inner_steps, "fragments": p.fragments,
             "link_gb_average": p.average_bytes / GB, "link_gb_worst": p.worst_bytes / GB,
             "link_s_average": p.link_average, "link_s_worst": p.link_worst,
             "in_site_s_average": p.in_site, "in_site_s_worst": p.in_site_worst,
             "rest_s": p.rest, "step_s_average": p.step_average,
             "step_s_worst": p.step_worst, "extra_memory_gb": p.extra_memory / GB}
            for p in prices]


def sites_report(w: Workload, hw: Hardware, sites: int, gbps: float,
                 prices: list[SitePrice]) -> str:
    """The table of `plan --sites`: what each strategy puts on the slow link per step,
    its seconds there (average and worst step), and the step it makes."""
    dp = prices[0].variant
    whole = crossing_bytes(w.params, sites, w.grad_bytes)
    lines = [
        f"over {sites} sites: {dp.plan.dp // sites} of the {dp.plan.dp} dp replicas in each "
        f"(ZeRO 0); one link of {gbps:g} Gb/s ({link_bandwidth(gbps) / GB:g} GB/s) each way "
        f"joins them, inside a site the cluster's links (between nodes {hw.inter_bw / GB:g} "
        f"GB/s = {hw.inter_bw * 8 / 1e9:g} Gb/s per GPU)",
        f"  one Allreduce of the {w.params / 1e9:.1f} B parameters ({w.grad_bytes} bytes each),"
        f" each site's replicas summed inside it first, puts 2 (S-1)/S of them on each site's "
        f"link each way: {whole / GB:.1f} GB",
        "  DP sends it every step (the gradients); DiLoCo every H steps (the parameters), "
        "streaming its P fragments in turn (the largest: fragment 0, with the embedding and "
        "the head); rest: the step's compute, pipeline, tp and bubble",
        f"{'strategy':>17} | {'link GB/step':>12} {'link s/step':>11} {'worst step':>10} | "
        f"{'in-site s':>9} {'rest s':>7} | {'step s':>8} {'worst step s':>12}"]
    for x in prices:
        lines.append(f"{x.label:>17} | {x.average_bytes / GB:12.2f} {x.link_average:11.3f} "
                     f"{x.link_worst:10.3f} | {x.in_site:9.3f} {x.rest:7.3f} | "
                     f"{x.step_average:8.3f} {x.step_worst:12.3f}")
    if len(prices) > 1:
        own = prices[-1]
        memory = own.variant.memory + own.extra_memory
        fits = "fits" if memory <= usable(hw) else "does NOT fit"
        p = own.variant.plan
        lines.append(f"  DiLoCo keeps the outer theta and momentum in fp32 ({OUTER_STATE_BYTES} "
                     f"bytes a parameter): +{own.extra_memory / GB:.2f} GB per GPU; it runs "
                     f"M={p.microbatches}, recompute {p.recompute} ({p.schedule}"
                     f"{f' {p.virtual}' if p.virtual > 1 else ''}): "
                     f"{own.variant.memory / GB:.2f} + {own.extra_memory / GB:.2f} = "
                     f"{memory / GB:.2f} GB of the {usable(hw) / GB:g} usable ({fits})")
    lines.append("  (average: per H steps each fragment's Allreduce once; worst: the step "
                 "that carries the largest; nothing overlaps the step)")
    return "\n".join(lines)
