"""The unit checks of the exercises: one layer or one collective against its definition.

Each takes the world communicator, runs on every rank, and returns None or one
sentence naming the function, the rank and the difference (grade.py gathers them).
Tiny arrays; every rank draws the same full arrays from one seed, as the library does.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minipar.comm.collectives import Group, Ledger, copy_to, reduce_from
from minipar.comm.ring import even_counts, ring_allgather, ring_allreduce, ring_reduce_scatter
from minipar.core.autograd import Tensor
from minipar.parallel.pipeline import instructions, schedules, simulator
from minipar.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, shard
from minipar.run.results import relative_difference

CLOSE = 1e-12  # one rank's arithmetic against NumPy's on the same numbers


def check_conjugate(world: MPI.Comm) -> str | None:
    """f and g on the world group: forward and backward against their definitions."""
    group = Group(world, "tp", Ledger())
    rng = np.random.default_rng(7)
    xs, gs = rng.normal(size=(2, group.size, 3, 5))  # every rank's x and output gradient
    me = group.rank
    x = Tensor(xs[0].copy(), requires_grad=True)
    y = copy_to(x, group)
    y.backward(gs[me].copy())
    for what, got, want in (("copy_to (f) forward", y.data, xs[0]),
                            ("copy_to (f) backward: x.grad", x.grad, gs.sum(axis=0))):
        if (rel := relative_difference(got, want)) > 1e-12:
            return f"{what} on rank {me} is off by {rel:.2e} relative: {hint_for(what)}"
    x = Tensor(xs[me].copy(), requires_grad=True)
    y = reduce_from(x, group)
    y.backward(gs[0].copy())
    for what, got, want in (("reduce_from (g) forward", y.data, xs.sum(axis=0)),
                            ("reduce_from (g) backward: x.grad", x.grad, gs[0])):
        if (rel := relative_difference(got, want)) > 1e-12:
            return f"{what} on rank {me} is off by {rel:.2e} relative: {hint_for(what)}"
    return None


def hint_for(what: str) -> str:
    """What each direction of f and g must be."""
    if "forward" in what and "copy_to" in what or "backward" in what and "reduce" in what:
        return "this direction is the identity"
    return "this direction is the Allreduce(SUM) over the group of every rank's array"


def check_ring(world: MPI.Comm) -> str | None:
    """The ring collectives against MPI's sums, on the world and on its first 3 ranks;
    what each rank sent against the formulas of ring.py."""
    for size in (world.Get_size(), 3):
        part = world.Split(0 if world.Get_rank() < size else MPI.UNDEFINED, world.Get_rank())
        if part == MPI.COMM_NULL:
            continue
        try:
            problem = ring_on(Group(part, "ring", Ledger()))
        finally:
            part.Free()
        if problem:
            return problem
    return None


def ring_on(group: Group) -> str | None:
    """One group's checks, elements of 1, 5 and 13 (chunks of unequal length)."""
    n_ranks, me = group.size, group.rank
    for n in (1, 5, 13):
        x = np.random.default_rng(100 + me).normal(size=n)
        everyone = np.array(group.comm.allgather(x))                 # (N, n)
        counts = even_counts(n, n_ranks)
        start = int(np.sum(counts[:me]))
        for what, run, want, sent in (
                ("ring_allreduce", ring_allreduce, everyone.sum(axis=0),
                 2 * n - counts[me] - counts[(me + 1) % n_ranks]),
                ("ring_reduce_scatter", ring_reduce_scatter,
                 everyone.sum(axis=0)[start:start + counts[me]], n - counts[me]),
                ("ring_allgather", ring_allgather, everyone, (n_ranks - 1) * n)):
            group.ledger.reset()
            got = run(group, x)
            where = f"{what} of {n} element(s) on {n_ranks} ranks"
            if np.shape(got) != np.shape(want):
                return f"{where}: rank {me} returned shape {np.shape(got)}, not {want.shape}"
            rel = relative_difference(got, want)
            if not rel <= 1e-12:
                worst = int(np.argmax(np.abs(np.asarray(got) - want)))
                return (f"{where}: rank {me} is off by {rel:.2e} relative, worst at flat "
                        f"element {worst} ({np.ravel(got)[worst]:.6g}, should be "
                        f"{np.ravel(want)[worst]:.6g})")
            entry = group.ledger.total("Sendrecv"), group.ledger.total("Sendrecv", field="calls")
            if entry != (sent, n_ranks - 1 if what != "ring_allreduce" else 2 * (n_ranks - 1)):
                calls = 2 * (n_ranks - 1) if what == "ring_allreduce" else n_ranks - 1
                return (f"{where}: rank {me} sent {entry[0]} elements in {entry[1]} Sendrecv "
                        f"calls; the ring sends {sent} in {calls}")
    return None


def check_schedule(world: MPI.Comm) -> str | None:
    """The 1F1B order of every stage for pp 1..4 and M 1..6, then played by the simulator."""
    for pp in range(1, 5):
        for microbatches in range(1, 7):
            for stage in range(pp):
                order = schedules.one_f_one_b_order(pp, microbatches, stage)
                where = f"one_f_one_b_order(pp={pp}, microbatches={microbatches}, stage={stage})"
                kinds = [ins.kind for ins in order]
                for kind in (instructions.FORWARD, instructions.BACKWARD):
                    seen = [ins.microbatch for ins in order if ins.kind == kind]
                    if seen != list(range(microbatches)):
                        return (f"{where}: its {kind}s are for microbatches {seen}, "
                                "not 0..M-1 in order")
                first_backward = kinds.index(instructions.BACKWARD)
                if first_backward != min(pp - stage, microbatches):
                    return (f"{where}: {first_backward} forward(s) before the first backward; "
                            f"1F1B warms up with pp - stage - 1 = {pp - stage - 1} and then "
                            "does one more forward")
                peak = simulator.in_flight_peak(kinds)
                if peak != min(pp - stage, microbatches):
                    return (f"{where}: {peak} microbatches alive at once; 1F1B keeps "
                            f"min(pp - stage, M) = {min(pp - stage, microbatches)}")
            bubble = schedules.simulate_schedule("1f1b", pp, microbatches).bubble
            want = schedules.bubble_formula("1f1b", pp, microbatches)
            if abs(bubble - want) > 1e-12:
                return (f"1F1B on pp={pp}, M={microbatches}: the simulated bubble is "
                        f"{bubble:.4f}, the formula (pp-1)/(M+pp-1) says {want:.4f}")
    return None


UNIT = {"conjugate": check_conjugate, "ring": check_ring, "schedule": check_schedule}


def differs(what: str, rank: int, got: np.ndarray, want: np.ndarray) -> str | None:
    """A sentence if `got` is not `want` (its shape, or relative CLOSE), else None."""
    if np.shape(got) != np.shape(want):
        return f"{what} on rank {rank} has shape {np.shape(got)}, not {np.shape(want)}"
    rel = relative_difference(got, want)
    if not rel <= CLOSE:
        return f"{what} on rank {rank} differs by {rel:.2e} relative"
    return None


def check_linears(world: MPI.Comm) -> str | None:
    """Column- then row-parallel linear on the world as one tp group: the outputs, the
    input gradient and the weight and bias gradients against x @ W + b in NumPy."""
    group = Group(world, "tp", Ledger())
    me, rng = group.rank, np.random.default_rng(11)
    B, d, f = 3, 4, 4 * group.size
    x_full, w1, b1 = rng.normal(size=(B, d)), rng.normal(size=(d, f)), rng.normal(size=f)
    w2, b2, g = rng.normal(size=(f, d)), rng.normal(size=d), rng.normal(size=(B, d))
    cols = shard(f, group.size, me)
    column = ColumnParallelLinear({"fc1.weight": w1, "fc1.bias": b1}, "fc1", group)
    row = RowParallelLinear({"fc2.weight": w2, "fc2.bias": b2}, "fc2", group)
    x = Tensor(x_full.copy(), requires_grad=True)
    h = column(x)
    if (problem := differs("ColumnParallelLinear's output (B, f/tp)", me, h.data,
                           (x_full @ w1 + b1)[:, cols])):
        return problem
    gh = rng.normal(size=(B, f))  # d loss / d h, the full (B, f) on every rank
    h_in = Tensor(h.data.copy(), requires_grad=True)
    y = row(h_in)
    if (problem := differs("RowParallelLinear's output (B, d)", me, y.data,
                           (x_full @ w1 + b1) @ w2 + b2)):
        return problem
    y.backward(g.copy())
    h.backward(gh[:, cols].copy())
    for what, got, want in (
            ("RowParallelLinear's input gradient (B, f/tp)", h_in.grad, g @ w2[cols].T),
            ("RowParallelLinear's weight gradient (f/tp, d)", row.weight.grad,
             (x_full @ w1 + b1)[:, cols].T @ g),
            ("RowParallelLinear's bias gradient (d,)", row.bias.grad, g.sum(axis=0)),
            ("ColumnParallelLinear's input gradient (B, d)", x.grad, gh @ w1.T),
            ("ColumnParallelLinear's weight gradient (d, f/tp)", column.weight.grad,
             x_full.T @ gh[:, cols]),
            ("ColumnParallelLinear's bias gradient (f/tp,)", column.bias.grad,
             gh[:, cols].sum(axis=0))):
        if (problem := differs(what, me, got, want)):
            return problem
    return None


def check_loss_scaler(world: MPI.Comm) -> str | None:
    """LossScaler.update on a fixed run of verdicts against the rule written out here,
    then low_precision.any_nonfinite on the world: an inf on one rank, a NaN on
    another, and none, each must give every rank the same answer."""
    from minipar.comm import low_precision
    from minipar.core.precision import LossScaler

    verdicts = [True, True, False, False, False, True, False, False, False, False, False]
    scaler, scale, clean, skipped = LossScaler(1024.0, window=2), 1024.0, 0, 0
    for step, found_inf in enumerate(verdicts, start=1):
        skip = scaler.update(found_inf)
        if found_inf:           # the rule: skip, halve, count again from zero
            scale, clean, skipped = scale / 2, 0, skipped + 1
        else:                   # take the step; `window` clean steps in a row double S
            clean += 1
            if clean == 2:
                scale, clean = scale * 2, 0
        got = (skip, scaler.scale, scaler.clean, scaler.skipped)
        if got != (found_inf, scale, clean, skipped):
            return (f"LossScaler.update at step {step} (found_inf={found_inf}, window 2, "
                    f"S from 1024): returned {skip}, left S {scaler.scale:g}, clean "
                    f"{scaler.clean}, skipped {scaler.skipped}; the rule says {found_inf}, "
                    f"{scale:g}, {clean}, {skipped}")
    group = Group(world, "world", Ledger())
    rank, last = world.Get_rank(), world.Get_size() - 1
    for where, holder, value in (("an inf on rank 1 alone", 1, np.inf),
                                 ("a NaN on the last rank alone", last, np.nan),
                                 ("no rank holding an inf or a NaN", None, 0.0)):
        grads = [np.ones(3), np.ones((2, 2))]
        if rank == holder:
            grads[1][0, 1] = value
        verdicts = world.allgather(bool(low_precision.any_nonfinite(group, grads)))
        want = holder is not None
        if verdicts != [want] * world.Get_size():
            return (f"any_nonfinite with {where}: the ranks said {verdicts}, every rank "
                    f"must say {want} (every rank skips the same steps)")
    return None


def check_muon(world: MPI.Comm) -> str | None:
    """muon_mesh.orthogonalize_sharded on the world as one tp group against Newton-Schulz
    on the whole matrix (core/muon.py): wide and tall, split by columns and by rows;
    then what it sent: 1 + steps Allreduces per matrix, of 1 and g x g numbers."""
    from minipar.core import muon
    from minipar.parallel.muon_mesh import orthogonalize_sharded

    ledger = Ledger()
    group = Group(world, "tp", ledger)
    me, n, steps = group.rank, group.size, 5
    rng = np.random.default_rng(17)
    cases = (((6, 4 * n), 1, 6), ((4 * n, 6), 0, 6), ((4 * n, 4 * n), 0, 4 * n),
             ((2 * n, 4 * n), 0, 4 * n), ((4 * n, 2 * n), 1, 4 * n))  # shape, split, g
    for shape, axis, _ in cases:
        u = rng.normal(size=shape)
        k = shape[axis] // n
        part = (slice(None), slice(me * k, (me + 1) * k)) if axis else \
            (slice(me * k, (me + 1) * k), slice(None))
        got = orthogonalize_sharded(u[part].copy(), shape, axis, group, steps)
        what = f"orthogonalize_sharded of a {shape} matrix split by {'columns' if axis else 'rows'}"
        if (problem := differs(what, me, got, muon.orthogonalize(u, steps)[part])):
            return problem
    entry = ledger.entries.get(("Allreduce", "tp"))
    calls, elements = (entry.calls, entry.elements) if entry else (0, 0)
    want = (len(cases) * (1 + steps), sum(1 + steps * g * g for _, _, g in cases))
    if (calls, elements) != want:
        return (f"orthogonalize_sharded on rank {me} made {calls} Allreduce call(s) of "
                f"{elements} elements for {len(cases)} matrices; one of the norm and one of "
                f"the Gram matrix per iteration make {want[0]} calls of {want[1]}")
    return None


UNITS = {"conjugate": check_conjugate, "ring": check_ring, "schedule": check_schedule,
         "linears": check_linears, "loss-scaler": check_loss_scaler, "muon": check_muon}
