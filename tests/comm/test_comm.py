"""The autograd collectives and the ledger (minipar/comm/collectives.py).

Conjugate pairs, checked THROUGH the collective on 1, 2, 3, 4 and 8 ranks: every
rank holds its own input x_r and weights c_r, the loss is a sum over ranks of
sum(c_r * tanh(collective(x_r))), and the gradient each rank gets from backward
must equal the change of that summed loss when the entries of x are moved on one
rank, one rank after the other (all entries along a random direction v: central
finite differences against v . grad). Which ranks a move touches and how the loss
is summed is each pair's contract:

- a *replicated* input (copy_to, scatter_to) is one tensor held by every rank of
  the group, so it is perturbed on all of them at once;
- a *replicated* loss (after reduce_from, gather_from: every rank computes the
  same value with the same weights) counts once, not once per rank.

Each op's ledger records must be the collectives its docstring names, forward and
backward, with the sizes of docs/design.md ("Communication"); a group of one sends nothing.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.harness.rank_tests import RANK_COUNTS, agree, suite_report

COMM_PY = Path(__file__).resolve().parents[2] / "minipar" / "comm" / "collectives.py"
FIRST_LINE = re.compile(r"^Forward: (?P<forward>.+?)\. Backward: (?P<backward>.+?)\.$")
# the words a docstring may use for a direction -> the ledger op it sends (None: nothing)
DIRECTION_OPS = {"identity": None, "split": None, "Allreduce": "Allreduce",
                 "Allgather": "Allgather", "Reduce_scatter": "Reduce_scatter",
                 "Alltoallv": "Alltoallv"}
PAIRS = ("copy_to", "reduce_from", "sum_replicated", "scatter_to", "gather_from",
         "reduce_scatter", "all_gather", "alltoallv")


def direction_op(text: str) -> str | None:
    """The ledger op a docstring's 'Forward: ...' or 'Backward: ...' phrase names."""
    named = [op for word, op in DIRECTION_OPS.items() if re.search(rf"\b{word}\b", text)]
    assert len(named) == 1, f"{text!r} should name exactly one of {list(DIRECTION_OPS)}"
    return named[0]


# ------------------------------------------------------------ tests without MPI
def autograd_collectives() -> dict[str, str]:
    """Every function of comm/collectives.py that builds a tape node (calls Tensor.from_op), and
    its docstring, read from the source (the pytest process never imports mpi4py.MPI)."""
    tree = ast.parse(COMM_PY.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and "Tensor.from_op" in ast.unparse(node):
            found[node.name] = ast.get_docstring(node) or ""
    return found


def test_every_autograd_collective_docstring_states_both_directions():
    found = autograd_collectives()
    assert set(found) == set(PAIRS), "a new autograd collective needs a case in this file"
    for name, doc in found.items():
        first = doc.splitlines()[0] if doc else ""
        match = FIRST_LINE.match(first)
        assert match, f"{name}: first docstring line {first!r} is not 'Forward: X. Backward: Y.'"
        direction_op(match["forward"]), direction_op(match["backward"])


def test_docstring_check_rejects_a_one_sided_line():
    assert FIRST_LINE.match("Forward: identity.") is None
    with pytest.raises(AssertionError):
        direction_op("sum, then keep my rows")


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_conjugate_pairs_forward_and_backward_through_the_collective(n):
    suite_report(n).assert_passed("tests.comm.test_comm:check_conjugate_pairs")


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_ledger_records_every_group_method(n):
    suite_report(n).assert_passed("tests.comm.test_comm:check_ledger_records")


# ------------------------------------------------------ rank side: the pairs
@dataclass
class Case:
    """One conjugate pair under test on a group of `size` ranks, seen from rank `me`."""

    name: str
    call: object               # (Tensor, Group) -> Tensor
    shape: tuple[int, ...]     # this rank's input
    replicated_input: bool
    loss_once: bool
    expected: object           # (every rank's input, my group rank) -> my output
    sums: bool                 # forward adds numbers (compare with a tolerance)


def a2a_counts(i: int, j: int) -> int:
    """Rows group rank i sends to group rank j in the alltoallv case (zeros included)."""
    return (i + 2 * j + 1) % 3


def cases(size: int, me: int) -> list[Case]:
    from minipar.comm import collectives as c

    send = np.array([a2a_counts(me, j) for j in range(size)])
    recv = np.array([a2a_counts(i, me) for i in range(size)])

    def routed(xs: list[np.ndarray], r: int) -> np.ndarray:
        starts = [sum(a2a_counts(i, j) for j in range(r)) for i in range(size)]
        return np.concatenate([xs[i][starts[i]:starts[i] + a2a_counts(i, r)]
                               for i in range(size)])

    return [
        Case("copy_to", c.copy_to, (3, 4), True, False, lambda xs, r: xs[r], False),
        Case("reduce_from", c.reduce_from, (3, 4), False, True, lambda xs, r: sum(xs), True),
        Case("sum_replicated", c.sum_replicated, (3, 4), False, False,
             lambda xs, r: sum(xs), True),
        Case("scatter_to", c.scatter_to, (3, 2 * size), True, False,
             lambda xs, r: np.split(xs[r], size, axis=-1)[r], False),
        Case("gather_from", c.gather_from, (3, 2), False, True,
             lambda xs, r: np.concatenate(xs, axis=-1), False),
        Case("reduce_scatter", c.reduce_scatter, (2 * size, 3), False, False,
             lambda xs, r: np.split(sum(xs), size)[r], True),
        Case("all_gather", c.all_gather, (2, 3), False, False,
             lambda xs, r: np.concatenate(xs), False),
        Case("alltoallv", lambda x, g: c.alltoallv(x, g, send, recv), (int(send.sum()), 2),
             False, False, routed, False),
    ]


def make_input(case: Case, index: int, world_rank: int, members: list[int]) -> np.ndarray:
    """Distinct data per rank; a replicated input is the same on every rank of the group."""
    seed = (index, 0, members[0]) if case.replicated_input else (index, 1, world_rank)
    return np.random.default_rng(seed).standard_normal(case.shape)


def weights(case: Case, shape: tuple[int, ...], world_rank: int, group_leader: int) -> np.ndarray:
    """c_r of the loss: the same on every rank of the group for a loss counted once."""
    owner = group_leader if case.loss_once else world_rank
    return np.random.default_rng((77, owner)).uniform(0.5, 1.5, shape)


def local_loss(case: Case, group: object, x: np.ndarray, c: np.ndarray) -> float:
    from minipar.core.autograd import Tensor

    y = case.call(Tensor(x), group).data
    return float(np.sum(c * np.tanh(y)))


def check_case(case: Case, index: int, group: object, helper: object, referee: object,
               ledger: object) -> list[str]:
    """Forward value, ledger records, and gradient by finite differences of one pair.
    `helper` is the same communicator as `group` with a ledger of its own (for the
    test's own traffic), `referee` the whole world."""
    from minipar.core import autograd as ag

    me_world = referee.rank
    members = helper.allgather(me_world)  # world ranks of my group, in group order
    x = make_input(case, index, me_world, members)
    problems = []
    everyone = helper.allgather(x)  # every input of the group, to compute the expected output
    wanted = case.expected(everyone, group.rank)

    ledger.reset()
    xt = ag.Tensor(x, requires_grad=True)
    y = case.call(xt, group)
    forward_ledger = dict(ledger.entries)
    if not (np.allclose(y.data, wanted, rtol=1e-13, atol=1e-13) if case.sums
            else np.array_equal(y.data, wanted)):
        problems.append(f"{case.name}: forward differs from the gathered inputs")
    c = weights(case, y.shape, me_world, members[0])
    ledger.reset()
    (ag.Tensor(c) * ag.tanh(y)).sum().backward()
    backward_ledger = dict(ledger.entries)
    problems += check_ledger_of_pair(case, group, x, y.data, forward_ledger, backward_ledger)
    problems += check_gradient(case, index, group, helper, x, c, xt.grad)
    return problems


def check_ledger_of_pair(case: Case, group: object, x: np.ndarray, y: np.ndarray,
                         forward: dict, backward: dict) -> list[str]:
    """The ops the docstring names, with docs/design.md's sizes (Allreduce and Allgather count
    the result, Reduce_scatter and Alltoallv what goes in); nothing on a group of one."""
    from minipar.comm import collectives as comm

    match = FIRST_LINE.match(getattr(comm, case.name).__doc__.splitlines()[0])
    problems = []
    for label, text, given, result, entries in (
            ("forward", match["forward"], x, y, forward),
            ("backward", match["backward"], y, x, backward)):
        op = direction_op(text) if group.size > 1 else None
        size = result.size if op in ("Allreduce", "Allgather") else given.size
        want = {} if op is None else {(op, group.name): (1, size, 8 * size)}
        got = {key: (e.calls, e.elements, e.bytes) for key, e in entries.items()}
        if got != want:
            problems.append(f"{case.name} {label} on a group of {group.size}: "
                            f"ledger {got}, expected {want}")
    return problems


def check_gradient(case: Case, index: int, group: object, helper: object, x: np.ndarray,
                   c: np.ndarray, grad: np.ndarray | None) -> list[str]:
    """For each rank q of the group: move every entry of q's input along a random
    direction v (a replicated input moves on all ranks at once, so one q is enough) and
    compare the change of the loss summed over the group, by central differences, with
    v . grad. Other groups' losses do not change, so this is the global loss's change."""
    eps, problems = 1e-6, []
    weight = 1.0 if (not case.loss_once or group.rank == 0) else 0.0
    for q in [0] if case.replicated_input else range(group.size):
        mine = group.rank == q or case.replicated_input
        v = np.random.default_rng((index, q)).standard_normal(x.shape)
        losses = []
        for sign in (1.0, -1.0):
            moved = x + sign * eps * v if mine else x
            local = local_loss(case, group, moved, c)
            losses.append(sum(helper.allgather(weight * local)))  # the group's loss
        numeric = (losses[0] - losses[1]) / (2 * eps)
        if mine:
            analytic = float(np.sum(v * grad)) if grad is not None else 0.0
            if abs(numeric - analytic) > 1e-6 * (1 + abs(analytic)):
                problems.append(f"{case.name} on a group of {group.size}: moving group rank "
                                f"{q}'s input along v changes the loss at {numeric:.9f}, "
                                f"backward says v . grad = {analytic:.9f}")
    return problems


def check_conjugate_pairs(comm):
    """Every pair on the whole world, on groups of the even and odd ranks (uneven sizes
    when the world is odd), and on a group of one."""
    from mpi4py import MPI

    from minipar.comm.collectives import Group, Ledger

    referee = Group(comm, "referee", Ledger())
    splits = [("world", comm), ("self", MPI.COMM_SELF)]
    if comm.Get_size() > 2:
        splits.append(("parity", comm.Split(comm.Get_rank() % 2, key=comm.Get_rank())))
    problems = []
    for name, raw in splits:
        ledger = Ledger()
        group, helper = Group(raw, name, ledger), Group(raw, name, Ledger())
        for index, case in enumerate(cases(group.size, group.rank)):
            problems += check_case(case, index, group, helper, referee, ledger)
        if group.size == 1 and ledger.entries:
            problems.append(f"a group of one recorded {ledger.records(referee.rank)}")
        if name == "parity":
            raw.Free()
    agree(referee, problems)


# ----------------------------------------------------- rank side: the ledger
def ledger_cases(group: object) -> list[tuple[str, object, tuple[str, int, int]]]:
    """(label, action, expected (op, elements, itemsize)) for every method of Group.
    Sizes follow docs/design.md: Allreduce the buffer, Allgather the gathered result,
    Reduce_scatter the input before scattering, Alltoall(v) what this rank sends (its
    own chunk included), Send/Recv and Sendrecv the message sent; pickled objects and
    Barrier count calls only."""
    from mpi4py import MPI

    n, me = group.size, group.rank
    right, left = (me + 1) % n, (me - 1) % n
    f32, i32 = np.float32, np.int32
    counts = np.arange(1, n + 1)  # uneven: rank j gets j+1 elements
    displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
    a2a_send = np.array([(me + j) % 3 for j in range(n)])
    a2a_recv = np.array([(i + me) % 3 for i in range(n)])

    def both(kind: str) -> None:  # Irecv + Send, or Isend + Recv, to the ring neighbours
        message, box = np.full(7, me, f32), np.empty(7, f32)
        if kind == "Irecv+Send":
            request = group.Irecv(box, source=left, tag=1)
            group.Send(message, dest=right, tag=1)
        else:
            request = group.Isend(message, dest=right, tag=2)
            group.Recv(box, source=left, tag=2)
        request.Wait()

    return [
        ("Allreduce in place", lambda: group.Allreduce(MPI.IN_PLACE, np.ones(5)),
         ("Allreduce", 5, 8)),
        ("Allreduce", lambda: group.Allreduce(np.ones(3, f32), np.empty(3, f32)),
         ("Allreduce", 3, 4)),
        ("Iallreduce", lambda: group.Iallreduce(MPI.IN_PLACE, np.ones(6)).Wait(),
         ("Iallreduce", 6, 8)),
        ("Allgather", lambda: group.Allgather(np.ones(2), np.empty((n, 2))),
         ("Allgather", 2 * n, 8)),
        ("Allgatherv", lambda: group.Allgatherv(
            np.ones(me + 1), [np.empty(counts.sum() + 4), counts, displs, MPI.DOUBLE]),
         ("Allgatherv", int(counts.sum()), 8)),
        ("Reduce_scatter", lambda: group.Reduce_scatter(
            np.ones(counts.sum()), np.empty(me + 1), recvcounts=counts),
         ("Reduce_scatter", int(counts.sum()), 8)),
        ("Reduce_scatter in place", lambda: group.Reduce_scatter(
            MPI.IN_PLACE, np.ones(counts.sum()), recvcounts=counts),
         ("Reduce_scatter", int(counts.sum()), 8)),
        ("Reduce_scatter_block", lambda: group.Reduce_scatter_block(
            np.ones(3 * n, f32), np.empty(3, f32)), ("Reduce_scatter", 3 * n, 4)),
        ("Alltoall", lambda: group.Alltoall(np.ones((n, 3), i32), np.empty((n, 3), i32)),
         ("Alltoall", 3 * n, 4)),
        ("Alltoall in place", lambda: group.Alltoall(MPI.IN_PLACE, np.ones((n, 2), i32)),
         ("Alltoall", 2 * n, 4)),
        ("Alltoallv", lambda: group.Alltoallv(
            [np.ones(a2a_send.sum() + 3), a2a_send, np.cumsum(a2a_send) - a2a_send,
             MPI.DOUBLE],
            [np.empty(a2a_recv.sum()), (a2a_recv, np.cumsum(a2a_recv) - a2a_recv),
             MPI.DOUBLE]), ("Alltoallv", int(a2a_send.sum()), 8)),
        ("Exscan", lambda: group.Exscan(np.ones(4), np.zeros(4)), ("Exscan", 4, 8)),
        ("Bcast", lambda: group.Bcast(np.ones(6, i32), root=0), ("Bcast", 6, 4)),
        ("Sendrecv", lambda: group.Sendrecv(np.ones(5), right, np.empty(5), left),
         ("Sendrecv", 5, 8)),
        ("bcast", lambda: group.bcast({"step": 3}), ("bcast", 0, 0)),
        ("allgather", lambda: group.allgather(me), ("allgather", 0, 0)),
        ("gather", lambda: group.gather(me), ("gather", 0, 0)),
        ("Barrier", group.Barrier, ("Barrier", 0, 0)),
    ] + [(kind, lambda kind=kind: both(kind), None) for kind in ("Irecv+Send", "Isend+Recv")]


def check_ledger_records(comm):
    """Each Group method, alone on a fresh ledger, leaves exactly one record of the
    expected (op, group, calls, elements, bytes); the totals and the records() format."""
    from minipar.comm.collectives import Group, Ledger

    ledger = Ledger()
    group = Group(comm, "tp", ledger)
    problems = []
    for label, action, (op, elements, itemsize) in [
            c if c[2] else (c[0], c[1], (None, 7, 4)) for c in ledger_cases(group)]:
        ledger.reset()
        action()
        got = {key: (e.calls, e.elements, e.bytes) for key, e in ledger.entries.items()}
        want = ({(op, "tp"): (1, elements, elements * itemsize)} if op else
                {(half, "tp"): (1, elements, elements * itemsize)
                 for half in label.split("+")})
        if got != want:
            problems.append(f"{label}: recorded {got}, expected {want}")
    ledger.reset()
    for _ in range(3):  # calls and sizes accumulate per (op, group)
        group.Allreduce(np.ones(5), np.empty(5))
    disabled = Ledger()
    disabled.enabled = False
    Group(comm, "dp", disabled).Allreduce(np.ones(5), np.empty(5))
    records = ledger.records(group.rank) + disabled.records(group.rank)
    want = [{"rank": group.rank, "op": "Allreduce", "group": "tp", "calls": 3,
             "elements": 15, "bytes": 120}]
    if records != want:
        problems.append(f"records() gave {records}, expected {want}")
    if ledger.total("Allreduce", "tp", "bytes") != 120 or ledger.total(group="dp") != 0:
        problems.append("Ledger.total does not sum the matching entries")
    agree(Group(comm, "referee", Ledger()), problems)
