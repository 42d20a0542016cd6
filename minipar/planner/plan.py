"""Planning a job at real scale: which (dp, tp, pp, cp, ep, ZeRO, M, recompute) to run.

What this file teaches: the source text's comparison of DP, TP, EP and PP ends in
rules of thumb -- TP inside a node (it "usually stops at 8-16 GPUs"), PP across
nodes (mind the bubble), EP for MoE (AllToAll is "very heavy"), DP for the rest.
Here they are checked, not believed: every mesh that fills the GPUs is priced by
the cost model (planner/memory_cost.py: ZeRO's memory, Megatron's activations; planner/time_cost.py:
the ledger of every collective, the bubble formula, an alpha-beta network) and the plans
are ranked by step time; the ones that do not fit are counted by reason. The
levers: the mesh (tp, cp, pp, dp, and ep over the tp x cp x dp ranks of a stage: TP
for attention, EP for experts), the ZeRO stage, the microbatches, the recomputation
(none, selective, full) and the pipeline schedule (1F1B, interleaved). Models and
clusters come from presets.py (each with its source) or from flags; every size is
stated or derived, and printed.

    python -m minipar plan --preset llama3-405b --cluster h100 --gpus 8192 \\
        --global-batch 2048                          # rank every plan
    python -m minipar plan --preset llama3-405b --cluster h100 --global-batch 2048 \\
        --dp 64 --tp 8 --pp 16                       # price the one Llama 3 ran
    python -m minipar plan --preset llama3-70b --cluster h100 --global-batch 1024 \
        --dp 128 --tp 8 --pp 1 --optimizer muon --muon-mode distributed  # Muon's price
    python -m minipar plan --serve --preset llama3-70b --cluster h100 --gpus 8 \\
        --prompt-len 4000 --new-tokens 96 --batch 1  # serving: tp x pp layouts per token
    python -m minipar plan --preset llama3-70b --cluster h100 --global-batch 1024 \\
        --dp 16 --tp 8 --pp 4 --sites 2 --slow-link-gbps 100  # DP vs DiLoCo over 2 sites

`--serve` prices decoding instead of training (planner/serving.py): every tp x pp (x ep)
layout of the GPUs, per token: each GPU's reads of weights and KV cache at HBM speed,
tp's Allreduces, the pipeline's per-token latency, the cache's memory.

`--sites S` splits a named plan's dp replicas over S sites joined by one slow link
(planner/diloco_cost.py): DP's gradient Allreduce every step against DiLoCo's parameter
Allreduce every H steps (and its streaming fragments), in seconds on the link per step.

The same arithmetic predicts minipar's own 8-rank runs exactly
(`minipar_workload`, tests/planner/test_plan.py), which is what licenses it at 2048 GPUs.

The planner in five files, one idea each: planner/workloads.py (a model's sizes as the
cost model's Workload: the formulas), planner/search.py (price a plan, search them
all), planner/plan_table.py (the table and the explanations), planner/plan_flags.py (the
command line: every flag, and the refusal of absurd sizes as it is parsed), and this one,
the command: the flags checked together (a mesh that does not divide the GPUs, a flag of
serving in a training plan), and the run. Callers import each name from the file that
defines it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from minipar.planner.diloco_cost import (
    DEFAULT_INNER_STEPS,
    DEFAULT_LINK_GBPS,
    site_prices,
    site_records,
    sites_report,
)
from minipar.planner.memory_cost import Plan
from minipar.planner.muon_cost import MODES as MUON_MODES
from minipar.planner.plan_flags import CLUSTER_FLAGS, MODEL_FLAGS, make_parser
from minipar.planner.plan_table import (
    named_report,
    plan_record,
    report,
)
from minipar.planner.presets import CLUSTERS, MODELS, Cluster, ModelShape
from minipar.planner.search import (
    MESH,
    RECOMPUTE,
    divisors,
    hardware,
    mesh_problem,
    search,
)
from minipar.planner.serving import layouts, serve_problem, serve_record, serve_report
from minipar.planner.time_cost import Hardware
from minipar.planner.workloads import transformer
from minipar.settings.config import ConfigError
from minipar.settings.preflight import file_problems


def resolve_model(args: argparse.Namespace) -> tuple[ModelShape | None, list[str]]:
    """The model: the preset's sizes, overridden by every model flag given."""
    given = {name: getattr(args, name) for name in (*MODEL_FLAGS, "style")
             if getattr(args, name) is not None}
    if args.tied_head is not None:
        given["tied"] = args.tied_head
    if args.preset:
        m = replace(MODELS[args.preset], **given)
    else:
        missing = [f"--{n.replace('_', '-')}" for n in ("layers", "d_model", "heads", "d_ff",
                                                        "vocab", "seq_len", "ffn_matrices",
                                                        "style") if n not in given]
        if missing:
            return None, [f"{', '.join(missing)} required (or name a --preset: "
                          f"{', '.join(sorted(MODELS))})"]
        m = ModelShape("a transformer", **given)
    return m, model_problems(m)


def model_problems(m: ModelShape) -> list[str]:
    """Every reason the sizes describe no model (each names its flag)."""
    out = []
    if m.ffn_matrices not in (2, 3):
        out.append(f"--ffn-matrices must be 2 (GELU MLP) or 3 (SwiGLU) (got {m.ffn_matrices})")
    if not m.head_dim and m.d_model % m.heads:
        out.append(f"--heads {m.heads} does not divide --d-model {m.d_model} (or give "
                   "--head-dim)")
    if m.kv_heads and m.heads % m.kv_heads:
        out.append(f"--kv-heads {m.kv_heads} does not divide --heads {m.heads}")
    if m.experts:
        if not 1 <= m.top_k <= m.experts:
            out.append(f"--top-k must be between 1 and --experts {m.experts} (got {m.top_k})")
        if not m.expert_d_ff:
            out.append("--experts needs an --expert-d-ff")
        if m.dense_layers >= m.layers:
            out.append(f"--dense-layers {m.dense_layers} leaves no MoE layer of {m.layers}")
    elif m.top_k or m.expert_d_ff or m.shared_experts or m.dense_layers:
        out.append("--top-k / --expert-d-ff / --shared-experts / --dense-layers need --experts")
    return out


def resolve_hardware(args: argparse.Namespace) -> tuple[Hardware | None, list[str]]:
    """The hardware: the cluster preset's numbers, overridden by every hardware flag."""
    given = {n: getattr(args, n) for n in CLUSTER_FLAGS if getattr(args, n) is not None}
    if args.cluster:
        c = replace(CLUSTERS[args.cluster], **given)
    else:
        missing = [f"--{n.replace('_', '-')}" for n in ("gpu_memory", "flops", "intra_bw",
                                                        "inter_bw") if n not in given]
        if missing:
            return None, [f"{', '.join(missing)} required (or name a --cluster: "
                          f"{', '.join(sorted(CLUSTERS))})"]
        c = Cluster("a cluster", **given)
    out = []
    if args.efficiency > 1:
        out.append(f"--efficiency is a fraction of peak: at most 1 (got {args.efficiency})")
    headroom = 0.1 * c.gpu_memory if args.memory_headroom is None else args.memory_headroom
    if headroom >= c.gpu_memory:
        out.append(f"--memory-headroom {headroom:g} leaves nothing of --gpu-memory "
                   f"{c.gpu_memory:g}")
    return hardware(c, args.efficiency, headroom), out


def serve_problems(args: argparse.Namespace, hw: Hardware) -> list[str]:
    """Every reason the --serve flags describe no serving job (and the training flags
    it has no use for)."""
    training = [f"--{name.replace('_', '-')}" for name in ("global_batch", "dp", "cp",
                                                           "microbatches", "zero", "recompute",
                                                           "schedule", "virtual", "muon_mode")
                if getattr(args, name) is not None] + ["--no-sp"] * args.no_sp + [
                    "--fp8"] * args.fp8 + ["--optimizer"] * (args.optimizer != "adam") + [
                    "--sites"] * (args.sites is not None)
    if training:
        return [f"{training[0]} is training's: --serve prices tp x pp (x ep) layouts of "
                "--gpus decoding --batch rows (drop it)"]
    missing = [flag for flag, value in (("--prompt-len", args.prompt_len),
                                        ("--new-tokens", args.new_tokens)) if value is None]
    if missing:
        return [f"{missing[0]} required with --serve (the decode step is priced at the "
                "context prompt + new tokens)"]
    if not hw.hbm_bw:
        return ["--hbm-bw required with --serve (or name a --cluster): a decode step reads "
                "its weights and cache at the GPU's memory speed"]
    if args.gpus is None and None in (args.tp, args.pp):
        return ["--gpus required (or name --tp and --pp)"]
    if args.gpus is None:
        args.gpus = args.tp * args.pp
    for axis in ("tp", "pp", "ep"):
        if getattr(args, axis) and args.gpus % getattr(args, axis):
            return [f"--{axis} {getattr(args, axis)} does not divide --gpus {args.gpus}"]
    if args.tp and args.pp and args.tp * args.pp != args.gpus:
        return [f"--tp x --pp = {args.tp * args.pp} is not --gpus {args.gpus}"]
    return []


def run_problems(args: argparse.Namespace, m: ModelShape, hw: Hardware) -> list[str]:
    """Every reason the run flags describe no job."""
    out = []
    if args.global_batch is None:
        return ["--global-batch required (sequences per step; or price serving: --serve)"]
    if args.fp8 and not hw.fp8_flops:
        return [f"--fp8: the {args.cluster or 'cluster'}'s GPU has no FP8 matmul rate (give "
                "--fp8-flops, or a cluster with one: h100, h800)"]
    if args.muon_mode is not None and args.muon_mode not in MUON_MODES:
        return [f"--muon-mode must be one of {', '.join(MUON_MODES)} (got {args.muon_mode!r})"]
    if args.optimizer == "muon" and (m.experts or m.attention):
        return ["--optimizer muon is priced for dense multi-head models only (no --experts, "
                "no --attention-params)"]
    if args.muon_mode is not None and args.optimizer != "muon":
        return [f"--muon-mode {args.muon_mode} needs --optimizer muon"]
    if args.prompt_len or args.new_tokens or args.batch:
        return ["--prompt-len, --new-tokens and --batch price serving: add --serve"]
    named = [args.dp, args.tp, args.pp]
    if args.gpus is None and None in named:
        out.append("--gpus required (or name the whole mesh: --dp --tp --pp, and --cp)")
    elif args.gpus is None:
        args.gpus = math.prod(named) * (args.cp or 1)
    elif None not in named and math.prod(named) * (args.cp or 1) != args.gpus:
        out.append(f"--dp x --tp x --pp x --cp = {math.prod(named) * (args.cp or 1)} is not "
                   f"--gpus {args.gpus}")
    for axis in MESH:
        if getattr(args, axis) and args.gpus and args.gpus % getattr(args, axis):
            out.append(f"--{axis} {getattr(args, axis)} does not divide --gpus {args.gpus}")
    if args.ep and args.ep > 1 and not m.experts:
        out.append(f"--ep {args.ep} needs a model with --experts")
    schedules = args.schedule or ["1f1b", "interleaved"]
    if args.virtual and "interleaved" not in schedules:
        out.append(f"--virtual {args.virtual[0]} needs --schedule interleaved")
    if args.virtual and min(args.virtual) < 2:
        out.append("--virtual must be at least 2 (1 is --schedule 1f1b)")
    if args.microbatches and args.global_batch % args.microbatches:
        out.append(f"--microbatches {args.microbatches} does not divide --global-batch "
                   f"{args.global_batch}")
    elif args.microbatches and args.dp and args.global_batch % (args.dp * args.microbatches):
        out.append(f"--dp {args.dp} x --microbatches {args.microbatches} does not divide "
                   f"--global-batch {args.global_batch}")
    return out


SITE_FLAGS = ("slow_link_gbps", "inner_steps", "fragments")


def sites_problems(args: argparse.Namespace, m: ModelShape) -> list[str]:
    """Every reason the --sites flags describe no DP-against-DiLoCo comparison; fills in
    the default H and P."""
    if args.sites is None:
        given = [f"--{n.replace('_', '-')}" for n in SITE_FLAGS if getattr(args, n) is not None]
        return [f"{given[0]} prices DiLoCo across sites: add --sites (2 or more)"] if given \
            else []
    if None in (args.dp, args.tp, args.pp):
        return ["--sites prices one named plan: give --dp, --tp and --pp"]
    if args.dp % args.sites:
        return [f"--sites {args.sites} does not divide --dp {args.dp} (each site holds dp/S "
                "replicas)"]
    if m.experts:
        return ["--sites prices dense models only (no --experts: experts borrow the dp axis "
                "that DiLoCo's workers are)"]
    if args.optimizer != "adam":
        return ["--sites prices DiLoCo with Adam as its inner optimizer (no --optimizer muon)"]
    if args.zero and set(args.zero) != {0}:
        return [f"--sites compares DP with DiLoCo, whose every worker keeps its whole "
                f"optimizer state: --zero 0 only (got --zero {max(args.zero)})"]
    args.inner_steps = args.inner_steps or list(DEFAULT_INNER_STEPS)
    if args.fragments is None:
        fit = [p for p in (4, 2) if m.layers % p == 0
               and all(h % p == 0 for h in args.inner_steps)]
        args.fragments = [1] + fit[:1]
    for p in args.fragments:
        if m.layers % p:
            return [f"--fragments {p} does not divide the {m.layers} layers (a fragment is "
                    "L/P consecutive blocks)"]
        for h in args.inner_steps:
            if h % p:
                return [f"--fragments {p} does not divide --inner-steps {h} (fragment p talks "
                        "p H/P steps after fragment 0)"]
    return []


def named_layout_problem(m: ModelShape, gpus: int, fixed: dict[str, int]) -> str | None:
    """Why no layout of `gpus` with the degrees `fixed` names (tp, pp, ep) can serve `m`
    (None if one can): the reason of the first such layout, or that there is none."""
    named = " ".join(f"--{k} {v}" for k, v in fixed.items())
    reasons = []
    for tp in divisors(gpus):
        for ep in (divisors(tp) if m.experts else [1]):
            layout = {"tp": tp, "pp": gpus // tp, "ep": ep}
            if all(layout[k] == v for k, v in fixed.items()):
                reason = serve_problem(m, tp, gpus // tp, ep)
                if reason is None:
                    return None
                reasons.append(f"tp {tp} x pp {gpus // tp} (ep {ep}): {reason}")
    if not reasons:
        return (f"no tp x pp layout of --gpus {gpus} has {named} (ep must divide tp: the "
                "ranks that share the experts)")
    return f"no layout with {named} can serve on {gpus} GPUs: {reasons[0]}"


def serve_command(args: argparse.Namespace, m: ModelShape, hw: Hardware) -> int:
    """`plan --serve`: the layouts' table (or, with --json, their records)."""
    fixed = {k: getattr(args, k) for k in ("tp", "pp", "ep") if getattr(args, k)}
    batch = args.batch or 1
    problem = named_layout_problem(m, args.gpus, fixed) if fixed else None
    if problem:
        print(f"minipar: error: {problem}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        fit, _, _ = layouts(m, hw, args.gpus, batch, args.prompt_len + args.new_tokens)
        records = [serve_record(p) for p in fit
                   if all(getattr(p, k) == v for k, v in fixed.items())]
        text = json.dumps({"model": m.name, "gpus": args.gpus, "layouts": records})
        if args.json == "-":
            print(text, flush=True)
            return 0
        try:
            Path(args.json).write_text(text + "\n")
        except OSError as error:
            print(f"minipar: error: --json {args.json}: cannot write it ({error.strerror})",
                  file=sys.stderr, flush=True)
            return 1
    print(serve_report(m, hw, args.gpus, batch, args.prompt_len, args.new_tokens, fixed,
                       args.top), flush=True)
    return 0


def gbps(args: argparse.Namespace) -> float:
    """The slow link's Gb/s: the flag's, or the default."""
    return DEFAULT_LINK_GBPS if args.slow_link_gbps is None else args.slow_link_gbps


def plan_command(argv: list[str]) -> int:
    """`python -m minipar plan ...`: print the ranking; a bad flag is one line, exit 2."""
    errors: list[str] = []
    try:
        args = make_parser().parse_args(argv)
        m, errors = resolve_model(args)
        if not errors:
            hw, errors = resolve_hardware(args)
        if not errors and args.serve:
            errors = serve_problems(args, hw) or sites_problems(args, m)
            if not errors and args.ep and args.ep > 1 and not m.experts:
                errors = [f"--ep {args.ep} needs a model with --experts"]
        elif not errors:
            errors = run_problems(args, m, hw) or sites_problems(args, m)
        if not errors and args.json and args.json != "-":   # before the search, not after
            errors = [f"--json {message}" for message in file_problems(args.json)]
        if not errors:
            w = transformer(m, args.global_batch or 1, args.params)
    except (ConfigError, ValueError) as error:
        errors = [str(error)]
    if errors:
        print(f"minipar: error: {errors[0]}", file=sys.stderr, flush=True)
        return 2
    if args.serve:
        return serve_command(args, m, hw)
    template = Plan(1, sp=not args.no_sp, fp8=args.fp8, optimizer=args.optimizer,
                    muon_mode=args.muon_mode or "layer-sharded")
    schedules = tuple((s, v) for s in dict.fromkeys(args.schedule or ["1f1b", "interleaved"])
                      for v in (sorted(set(args.virtual or [2, 4])) if s == "interleaved"
                                else [1]))
    fixed = {k: getattr(args, k) for k in (*MESH, "microbatches") if getattr(args, k)}
    named = all(k in fixed for k in ("dp", "tp", "pp"))
    if named:
        fixed.setdefault("cp", 1)
        fixed.setdefault("ep", 1)
        plan = replace(template, **{k: v for k, v in fixed.items() if k in MESH},
                       microbatches=fixed.get("microbatches", 1),
                       sp=template.sp and fixed["tp"] > 1)
        problem = mesh_problem(w, plan) if "microbatches" in fixed else mesh_problem(
            w, replace(plan, microbatches=plan.pp * (w.batch % (plan.dp * plan.pp) == 0)
                       or 1))
        if problem:
            print(f"minipar: error: the plan you named cannot run: {problem}",
                  file=sys.stderr, flush=True)
            return 2
    stages = (0,) if args.sites else tuple(sorted(set(args.zero or (0, 1, 2, 3))))
    found = search(w, hw, args.gpus, template, stages,
                   tuple(dict.fromkeys(args.recompute or RECOMPUTE)), fixed, schedules)
    prices = []
    if args.sites and found.feasible:   # ZeRO 0 only (sites_problems): DiLoCo's workers
        prices = site_prices(w, hw, found.feasible, args.sites, gbps(args),
                             [(h, p) for h in dict.fromkeys(args.inner_steps)
                              for p in dict.fromkeys(args.fragments)])
    if args.json:
        records = [plan_record(e, w, hw) for e in found.feasible]
        text = json.dumps({"model": w.name, "gpus": args.gpus, "plans": records,
                           "bounded": found.bounded}
                          | ({"sites": site_records(prices)} if args.sites else {}))
        if args.json == "-":
            print(text, flush=True)
            return 0
        try:
            Path(args.json).write_text(text + "\n")
        except OSError as error:   # a device that filled up during the search
            print(f"minipar: error: --json {args.json}: cannot write it ({error.strerror})",
                  file=sys.stderr, flush=True)
            return 1
    if named and (found.feasible or found.too_big):
        print(named_report(found, w, m, hw, args.gpus), flush=True)
        if args.sites:
            print(sites_report(w, hw, args.sites, gbps(args), prices)
                  if prices else "--sites: the plan does not fit at ZeRO 0, so no step to "
                  "price over the sites (fewer --microbatches' activations, more --pp or "
                  "--tp)", flush=True)
    else:
        print(report(found, w, m, hw, args.gpus, template, args.top), flush=True)
    return 0
