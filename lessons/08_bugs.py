"""Lesson 8: bugs of the kinds real parallel trainers shipped, and the checks that catch them.

    mpiexec -n 4 python lessons/08_bugs.py                         # 16 bugs, 12 steps; 3 in 16 bits
    mpiexec -n 8 python lessons/08_bugs.py                         # the same, dp doubled
    mpiexec -n 4 python lessons/08_bugs.py --bug dp-sum-not-mean --plot figures
    mpiexec -n 4 python lessons/08_bugs.py --quick                 # 3 steps, a tiny model

Four ranks fit every bug (each needs at most two of dp, tp, pp, cp at 2); on 8 the
data-parallel axis fills the rest. Each bug (minipar/bugs/catalog.py, `python -m
minipar bugs`) is injected into an otherwise correct run with `--inject-bug`,
and the lesson shows, for each:

1. its loss curve beside the correct one. Most are indistinguishable to the
   eye: a wrong parallel run still trains, often just as fast;
2. what finds it:
     losses      the step losses against one process (relative 1e-9);
     parameters  the final parameters against one process, and after ONE step
                 (where the damage starts, before it spreads through the model),
                 with the ranks that hold each tensor;
     replicas    copies of the same parameter piece on different ranks must be
                 bitwise equal (`agreement.gather_full_params`), which names the rank;
     ledger      what each axis moved in the last step, against the correct run
                 (whose ledger lessons 6 and 7 proved equal to the formulas);
     memory      the bytes of parameters each rank holds, against the correct run;
     placements  one step with `--check-placements` (minipar/placement/__init__.py): every
                 op checks whether its tensors are replicated, sharded or partial
                 sums over each mesh axis, and a placement error stops the run at
                 the line where it is made -- before any loss is compared. A bug
                 about values (a factor, a count, a stale buffer) it cannot see:
                 the lesson says why, for each;
3. the sentence that explains it, and where it (or its closest relative) shipped:
   the public issue or pull request of a real project (DeepSpeed, Megatron-LM,
   PyTorch, nanotron, Hugging Face transformers ...), or "plausible" where no
   shipped case was found.

Three of the bugs are about numbers every trainer reduces to ONE scalar, where a
wrong count still gives a plausible number (minipar/compose/clip.py, minipar/core/documents.py):

    clip-local-norm             each pipeline stage clips by the norm of its own
                                gradients (the Allreduce of the squares left out):
                                every stage a different coefficient, all too mild;
    clip-replicated-counted-tp  the norm counts a piece replicated over tp (the
                                embedding, LayerNorms, biases, the head) on every tp
                                rank: too large, every step clips too hard;
    loss-mean-per-microbatch    with ragged documents (`--documents`), each
                                microbatch's loss is the mean over its own valid
                                tokens instead of the global batch's: a short
                                microbatch's tokens weigh more than one process weighs
                                them.

None splits replicas (every rank of a group computes the same wrong scalar), none
moves other bytes, none misplaces a tensor: only the comparison with one process
finds them, from the first clipped (or ragged) step on.

Then the three bugs of training in 16 bits (`--mixed`, lesson 14), judged as 16-bit runs
are: the derived tolerance against one process in the same precision (not 1e-9), the
replica check after every step (every copy, and the loss scale S, bitwise alike), and
the bytes of the last step's ledger:

    mp-found-inf-per-rank   fp16's overflow vote left out: a pipeline stage skips and
                            halves S alone; the replica check stops the run there;
    mp-no-master-weights    the update lands on the 16-bit copy: small updates vanish,
                            the tolerance is exceeded many times over;
    mp-tp-partials-in-bf16  tp's shares summed in 16 bits: one rounding more, inside the
                            tolerance; the ledger shows the 2-byte words.

The code behind it: minipar/bugs/catalog.py (the registry), minipar/bugs/detours.py (the
detours), minipar/run/train.py (the hook).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from dataclasses import replace
from itertools import count
from pathlib import Path

import numpy as np
from mpi4py import MPI

from minipar.bugs.catalog import BUGS, MIXED_BUGS, Bug
from minipar.comm.job import run_collectively, verdict, wait_for_rank0
from minipar.core import nn
from minipar.placement import PlacementError
from minipar.run.agreement import ReplicaError
from minipar.run.reference import RunResult
from minipar.run.results import mixed_tolerance, moved_difference, relative_difference
from minipar.run.train import problems, train, train_reference
from minipar.settings.config import TrainConfig
from minipar.settings.preflight import lesson_arguments
from minipar.teaching.lines import fit

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
TOLERANCE = 1e-9
MLP = dict(layers=4, d_in=16, d_model=32, batch=32)
MOE = dict(MLP, experts=4, top_k=2, expert_d_ff=32)
QUICK = dict(layers=4, d_in=8, d_model=16, batch=16)
QUICK_MOE = dict(QUICK, experts=4, top_k=2, expert_d_ff=16)
GPT = dict(layers=4, d_model=32, batch=16, seq_len=16, vocab=32)   # the transformer's bugs
MIXED = dict(layers=2, d_model=16, batch=16, microbatches=2)   # the 16-bit bugs (both sizes)
QUICK_GPT = dict(layers=2, d_model=16, batch=8, seq_len=8, vocab=16)
CHECKS = ("losses", "parameters", "replicas", "ledger", "memory", "placements")
ROUTED = ("Alltoallv",)  # MoE: how many rows go where depends on the router's choices


def say(*lines: str) -> None:
    """Print from rank 0 only, a line wider than the page wrapped (teaching/lines.py)."""
    if rank == 0:
        print(fit("\n".join(lines)), flush=True)


PARTS = count(1)   # the lesson's parts, numbered as they print: a bug each, then the table


def part(title: str) -> str:
    """The next part's header, `=== N. title`, after a blank line."""
    return f"\n=== {next(PARTS)}. {title}"


def config(bug: Bug, steps: int, quick: bool) -> TrainConfig:
    """The bug's own flags on a small model; dp fills the world."""
    model = bug.flags.get("model", "mlp")
    sizes = {"moe": (QUICK_MOE, MOE), "gpt": (QUICK_GPT, GPT)}.get(model, (QUICK, MLP))[
        0 if quick else 1]
    # the bug's flags over the sizes, the lesson's step count over both
    return TrainConfig(**{**sizes, **bug.flags, "steps": steps}).resolved(size)


# ------------------------------------------------------ comparing two runs
def relative(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: the measure of --check and the test suite."""
    return relative_difference(a, b)


def differing(final: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
    """Tensor name -> relative difference, for those above the tolerance, worst first."""
    found = {name: relative(final[name], value) for name, value in ref.items()}
    return dict(sorted(((n, r) for n, r in found.items() if r > TOLERANCE),
                       key=lambda item: -item[1]))


def compact(names: list[str], cfg: TrainConfig) -> str:
    """Tensor names shortened: blocks with the same damaged tensors are listed together,
    experts folded into `experts.*`, a block with every tensor damaged says `all`."""
    loose, per_block = [], defaultdict(set)
    for name in names:
        parts = name.split(".")
        if parts[0] != "blocks":
            loose.append(name)
            continue
        per_block[int(parts[1])].add(re.sub(r"experts\.\d+\.", "experts.*.",
                                            ".".join(parts[2:])))
    every = {re.sub(r"experts\.\d+\.", "experts.*.", ".".join(n.split(".")[2:]))
             for n in nn.canonical_shapes(cfg.model_config()) if n.startswith("blocks.0.")}
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for block, rests in sorted(per_block.items()):
        groups[("all",) if rests == every else tuple(sorted(rests))].append(block)
    text = [f"blocks {','.join(map(str, blocks))}: {' '.join(rests)}"
            for rests, blocks in groups.items()]
    return "; ".join(([" ".join(loose)] if loose else []) + text)


def holders(name: str, cfg: TrainConfig) -> list[int]:
    """The world ranks holding a piece (or a copy) of tensor `name` on this mesh."""
    shape = cfg.mesh_shape()
    stage = {"embed": 0, "head": cfg.pp - 1}.get(name.split(".")[0])
    if stage is None:
        stage = int(name.split(".")[1]) // (cfg.layers // cfg.pp)
    expert = re.search(r"experts\.(\d+)\.", name)
    owner = int(expert.group(1)) // (cfg.experts // cfg.ep) if expert else None
    return [r for r in range(shape.world) if shape.coords(r)["pp"] == stage
            and (owner is None or shape.coords(r)["ep"] == owner)]


def ledger_changes(clean: list[dict], buggy: list[dict]) -> list[str]:
    """(group, op) whose calls or elements differ from the correct run, with the ranks."""
    def table(records: list[dict]) -> dict:
        return {(r["group"], r["op"], r["rank"]): (r["calls"], r["elements"]) for r in records}
    before, after = table(clean), table(buggy)
    changed: dict[tuple, list] = defaultdict(list)
    for group, op, where in sorted(set(before) | set(after)):
        was, now = before.get((group, op, where), (0, 0)), after.get((group, op, where), (0, 0))
        if op in ROUTED:  # the sizes follow the router, which training moves: calls only
            was, now = (was[0], "*"), (now[0], "*")
        if was != now:
            changed[(group, op, was, now)].append(where)
    return [f"{group} {op}: {was[0]} calls of {was[1]} elements -> {now[0]} calls of {now[1]} "
            f"on {ranks_text(ranks)}" for (group, op, was, now), ranks in changed.items()]


def disagreements(result: RunResult) -> dict[str, tuple[list[int], float]]:
    """Tensor -> (ranks whose copy differs from the first copy, largest difference)."""
    found: dict[str, tuple[list[int], float]] = {}
    for line in result.extras["replica_disagreements"]:
        name, where, by = re.match(r"(\S+): rank (\d+) differs .* by (\S+)", line).groups()
        ranks, worst = found.get(name, ([], 0.0))
        found[name] = (ranks + [int(where)], max(worst, float(by)))
    return found


# ---------------------------------------------------------------- one bug
def run_bug(bug: Bug, steps: int, quick: bool) -> dict | None:
    """The correct run, the run with the bug and one step with the bug, on every rank;
    what the checks find, on rank 0 (None elsewhere)."""
    wait_for_rank0(comm)  # the others asleep while rank 0 checked the last bug alone
    cfg = config(bug, steps, quick)
    errors = problems(replace(cfg, inject_bug=bug.name), size)
    if errors:  # the same verdict on every rank: all skip together
        say(part(f"{bug.name}: skipped on {size} ranks: {errors[0]}"))
        return {"skipped": errors[0]} if rank == 0 else None
    clean = train(cfg, comm)
    buggy = train(replace(cfg, inject_bug=bug.name), comm)
    first = train(replace(cfg, steps=1, inject_bug=bug.name), comm)
    stopped = placement_line(replace(cfg, steps=1, inject_bug=bug.name))
    # (parameter bytes of the correct run, of the run with the bug) of every rank -> rank 0
    held = comm.gather((clean.extras["memory"].params, buggy.extras["memory"].params))
    if rank != 0:
        return None
    return {**findings(cfg, clean, buggy, first, held, stopped), "unseen": bug.unseen}


def placement_line(cfg: TrainConfig) -> str | None:
    """Run `cfg` with placement checking on: the line that stopped it, or None. (Every
    rank raises together: without a pipeline all ranks run the same ops, and the
    gradient check is agreed over every rank.)"""
    try:
        train(replace(cfg, check_placements=True), comm)
    except PlacementError as error:
        return str(error)
    return None


def findings(cfg: TrainConfig, clean: RunResult, buggy: RunResult, first: RunResult,
             held: list[tuple[float, float]], stopped: str | None = None) -> dict:
    """Every check of the run with the bug (and of the correct run), as plain numbers."""
    ref = train_reference(cfg)
    ref_first = train_reference(replace(cfg, steps=1))
    steps = [abs(a - b) / abs(b) for a, b in zip(buggy.losses, ref.losses)]
    found = {
        "reference": ref.losses, "correct": clean.losses, "buggy": buggy.losses,
        "loss_rel": max(steps),
        "loss_from": next((i + 1 for i, r in enumerate(steps) if r > TOLERANCE), None),
        "final": differing(buggy.final, ref.final), "tensors": len(ref.final),
        "first_step": differing(first.final, ref_first.final),
        "replicas": disagreements(buggy),
        "ledger": ledger_changes(clean.ledger, buggy.ledger),
        "memory": [(r, int(a), int(b)) for r, (a, b) in enumerate(held) if a != b],
        "correct_loss_rel": max(abs(a - b) / abs(b) for a, b in zip(clean.losses, ref.losses)),
        "correct_param_rel": max(relative(clean.final[n], v) for n, v in ref.final.items()),
        "correct_replicas": clean.extras["replica_disagreements"],
        "placement": stopped,
    }
    hits = (found["loss_rel"] > TOLERANCE, found["final"], found["replicas"],
            found["ledger"], found["memory"], stopped)
    found["caught_by"] = [check for check, hit in zip(CHECKS, hits) if hit]
    return found


def ranks_text(ranks: list[int]) -> str:
    return "rank" + ("s " if len(ranks) > 1 else " ") + ",".join(map(str, ranks))


def show(index: int, bug: Bug, cfg: TrainConfig, found: dict) -> None:
    """The loss curves side by side, each check's verdict, and the explanation."""
    mesh = f"dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}" + (f" ep={cfg.ep}" if cfg.ep > 1 else "") \
        + (f" cp={cfg.cp}" if cfg.cp > 1 else "")
    extra = "".join(f", {k}={v}" for k, v in bug.flags.items()
                    if k not in ("dp", "tp", "pp", "ep", "cp"))
    say(part(f"{bug.name} [{bug.strategy}] on {mesh}{extra} (bug {index} of {len(BUGS)})"),
        f"broken: {bug.broken}",
        f"{'step':>5}  {'one process':>14}  {'correct mesh':>14}  {'with the bug':>14}  "
        "bug vs one process (relative)")
    for step, (a, b, c) in enumerate(zip(found["reference"], found["correct"],
                                         found["buggy"])):
        say(f"{step + 1:>5}  {a:>14.9f}  {b:>14.9f}  {c:>14.9f}  {abs(c - a) / abs(a):.1e}")
    ok = (max(found["correct_loss_rel"], found["correct_param_rel"]) <= TOLERANCE
          and not found["correct_replicas"])
    say(f"the correct run on this mesh: losses rel {found['correct_loss_rel']:.1e}, "
        f"parameters rel {found['correct_param_rel']:.1e}, "
        f"{len(found['correct_replicas'])} replica disagreements -> "
        f"{verdict(ok)}", "checks on the run with the bug:")
    for check, lines in check_lines(cfg, found).items():
        mark = "CAUGHT" if check in found["caught_by"] else "-"
        say(f"  {check:<11} {lines[0]}  [{mark}]", *[f"  {'':<11} {line}" for line in lines[1:]])
    caught = ", ".join(found["caught_by"]) or verdict(False, bad="NOTHING: this bug would ship")
    say(f"caught by: {caught}", f"why: {bug.why}", f"seen: {bug.seen}")


def check_lines(cfg: TrainConfig, found: dict) -> dict[str, list[str]]:
    """One or more lines per check, saying what it saw."""
    final, first = found["final"], found["first_step"]
    out = {"losses": [f"max relative difference {found['loss_rel']:.1e}" + (
        f", from step {found['loss_from']} on" if found["loss_from"] else "")]}
    if not final:
        out["parameters"] = [f"all {found['tensors']} tensors equal one process's"]
    else:
        worst = next(iter(first or final))
        out["parameters"] = [
            f"after {cfg.steps} steps {len(final)} of {found['tensors']} tensors differ, "
            f"worst {next(iter(final))} (rel {next(iter(final.values())):.1e})",
            f"after 1 step: {compact(list(first), cfg) or 'none'}",
            f"  (worst {worst} rel {(first or final)[worst]:.1e}, held by "
            f"{ranks_text(holders(worst, cfg))})"]
    replicas = found["replicas"]
    out["replicas"] = [f"{len(replicas)} tensors have copies that differ"] + [
        f"{name}: {ranks_text(r)} differ from the first copy by up to {by:.2g}"
        for name, (r, by) in list(replicas.items())[:3]] if replicas else [
        "every copy of every piece agrees"]
    out["ledger"] = found["ledger"] or ["the same calls and sizes as the correct run"]
    moved: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r, a, b in found["memory"]:
        moved[(a, b)].append(r)
    out["memory"] = [f"{ranks_text(r)}: {a} -> {b} bytes of parameters"
                     for (a, b), r in moved.items()] or ["the same parameter bytes on every rank"]
    out["placements"] = [f"stopped in step 1: {found['placement']}"] if found["placement"] \
        else [f"no violation: {found.get('unseen') or 'none found'}"]
    return out


# ------------------------------------------------------------ the 16-bit bugs
def bytes_by_call(records: list[dict]) -> dict[tuple[str, str], int]:
    """(group, op) -> bytes of rank 0's last-step ledger."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    for r in records:
        if r["rank"] == 0:
            out[(r["group"], r["op"])] += r["bytes"]
    return out


def run_mixed_bug(bug: Bug) -> dict | None:
    """The correct run and the run with the bug, in 16 bits; what the three checks of a
    16-bit run find, on rank 0 (None elsewhere)."""
    wait_for_rank0(comm)
    cfg = TrainConfig(**{**MIXED, **bug.flags}).resolved(size)
    clean = train(cfg, comm)
    try:
        buggy, stopped = train(replace(cfg, inject_bug=bug.name), comm), None
    except ReplicaError as error:   # raised on every rank at the same step
        buggy, stopped = None, str(error)
    if rank != 0:
        return None
    ref = train_reference(cfg)
    loss_tol, param_tol = mixed_tolerance(cfg)

    def measured(run: RunResult) -> dict:
        moved, where = moved_difference(run.final, ref.final, ref.init)
        return {"loss_rel": relative_difference(run.losses, ref.losses), "moved": moved,
                "where": where, "S": run.extras["loss_scale"],
                "skipped": run.extras["skipped"]}
    found = {"correct": measured(clean), "loss_tol": loss_tol, "param_tol": param_tol,
             "one_process_S": (ref.extras["loss_scale"], ref.extras["skipped"]),
             "replicas": stopped, "buggy": None if buggy is None else measured(buggy),
             "ledger": [] if buggy is None else [
                 f"{group} {op}: {a} -> {b} bytes" for (group, op), a in
                 sorted(bytes_by_call(clean.ledger).items())
                 for b in [bytes_by_call(buggy.ledger).get((group, op), 0)] if a != b]}
    b = found["buggy"]
    found["caught_by"] = [check for check, hit in (
        ("losses", b is not None and b["loss_rel"] > loss_tol),
        ("parameters", b is not None and b["moved"] > param_tol),
        ("replicas", stopped is not None), ("ledger", bool(found["ledger"]))) if hit]
    return found


def show_mixed(index: int, bug: Bug, found: dict) -> None:
    cfg = TrainConfig(**{**MIXED, **bug.flags}).resolved(size)
    c, b = found["correct"], found["buggy"]
    say(part(f"{bug.name} [{bug.strategy}] on dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}, "
             f"{cfg.mixed} over {cfg.dtype} masters, {cfg.steps} steps (16-bit bug {index} of "
             f"{len(MIXED_BUGS)})"), f"broken: {bug.broken}",
        f"the derived tolerance: losses {found['loss_tol']:.2g} relative, parameters "
        f"{found['param_tol']:.2g} of their movement (run/results.py, mixed_tolerance)")
    ok = c["loss_rel"] <= found["loss_tol"] and c["moved"] <= found["param_tol"] \
        and (c["S"], c["skipped"]) == tuple(found["one_process_S"])
    say(f"the correct run: losses {c['loss_rel']:.1e}, parameters {c['moved']:.1e} "
        f"({c['where']}), S {c['S']:g} with {c['skipped']} skipped -> {verdict(ok)}")
    if b is None:
        say(f"  replicas    stopped: {found['replicas']}  [CAUGHT]")
    else:
        for check, value, tol in (("losses", b["loss_rel"], found["loss_tol"]),
                                  ("parameters", b["moved"], found["param_tol"])):
            mark = "CAUGHT" if check in found["caught_by"] else "-"
            say(f"  {check:<11} {value:.1e} (tolerance {tol:.2g})  [{mark}]")
        say("  replicas    every copy, and S, bitwise alike after every step  [-]")
        mark = "CAUGHT" if found["ledger"] else "-"
        say(f"  ledger      {'; '.join(found['ledger']) or 'the same bytes'}  [{mark}]")
    caught = ", ".join(found["caught_by"]) or verdict(False, bad="NOTHING: this bug would ship")
    say(f"caught by: {caught}", f"why: {bug.why}", f"seen: {bug.seen}")


# ------------------------------------------------------------ the lesson
def summary(results: dict[str, dict]) -> None:
    wide = max([24, *map(len, results)])  # the longest bug name sets the first column
    say(part("every bug, and what caught it"),
        f"{'bug':<{wide}} {'loss rel':>9} {'param rel':>9}  {'placements':<22}  caught by")
    for name, found in results.items():
        if "skipped" in found:
            say(f"{name:<{wide}} {'skipped':>9}")
            continue
        worst = next(iter(found["final"].values()), 0.0)
        where = re.search(r"\[at (.*)\]", found["placement"] or "")
        stop = (where.group(1).split("/")[-1] if where else "grad sync") \
            if found["placement"] else "unseen"
        say(f"{name:<{wide}} {found['loss_rel']:>9.1e} {worst:>9.1e}  {stop:<22}  "
            f"{', '.join(found['caught_by']) or 'NOTHING'}")
    unseen = [n for n, f in results.items() if "skipped" not in f
              and not {"losses", "parameters"} & set(f["caught_by"])]
    say("every run with a bug still trained: its loss curve alone proves nothing. One process",
        "is the referee; the replica check says which ranks went astray; the ledger and the",
        "bytes held catch what the numbers cannot: " + (", ".join(unseen) or "none here") + ".",
        "Placement checking stops the placement errors at their line, in step 1, before any",
        "number is compared; the rest are about values, which no placement can show.")


def plot(folder: Path, results: dict[str, dict]) -> None:
    """Every bug's loss curve over its one-process curve, and their relative difference."""
    from minipar.teaching import plots

    shown = {name: found for name, found in results.items() if "skipped" not in found}
    figure = plots.loss_figure({n: f["buggy"] for n, f in shown.items()},
                               {n: f["reference"] for n, f in shown.items()},
                               title="lesson 8: runs with a bug over their correct runs")
    say(f"\nwrote {plots.save(figure, folder / '08_bugs_losses.png')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bug", choices=list(BUGS), action="append",
                        help="only this bug (repeatable); default: all")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="3 steps on a tiny model")
    parser.add_argument("--plot", metavar="DIR", type=Path, help="write the loss curves")
    parser.add_argument("--json", metavar="PATH", type=Path, help="write the findings")
    args = lesson_arguments(parser)   # --plot checked now, not at the end
    steps = 3 if args.quick else args.steps
    say(f"lesson 8 on {size} ranks: each bug injected into a correct run, {steps} steps")
    results: dict[str, dict] = {}
    for index, name in enumerate(args.bug or BUGS, start=1):
        found = run_bug(BUGS[name], steps, args.quick)
        if rank == 0:
            results[name] = found
            if "skipped" not in found:
                show(index, BUGS[name], config(BUGS[name], steps, args.quick), found)
    summary(results)
    mixed: dict[str, dict] = {}
    if not args.bug:   # the 16-bit bugs, after lesson 8's own (all of them, or none)
        for index, name in enumerate(MIXED_BUGS, start=1):
            found = run_mixed_bug(MIXED_BUGS[name])
            if rank == 0:
                mixed[name] = found
                show_mixed(index, MIXED_BUGS[name], found)
    if args.plot and rank == 0:
        plot(args.plot, results)
    if args.json and rank == 0:
        args.json.write_text(json.dumps({**results, **mixed}, indent=1))


if __name__ == "__main__":
    run_collectively(main)
