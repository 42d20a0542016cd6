"""The process grid (minipar/comm/mesh.py): the pure table, the command that prints it, and
the communicators `Mesh` builds from it under MPI.

The expected groups are written out here from the layout rule alone (tp fastest,
then cp, then dp, then pp; ep groups are runs of ep consecutive dp ranks, edp groups
the dp ranks with the same position inside their run; dp_cp and edp_cp the same over
every cp coordinate), never from `group_key`.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from minipar.comm.mesh import AXES, MeshShape
from tests.harness.mpi import ROOT
from tests.harness.rank_tests import RANK_COUNTS, agree, suite_report


def factorizations(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp = world."""
    return [(dp, tp, world // (dp * tp)) for dp in range(1, world + 1) if world % dp == 0
            for tp in range(1, world // dp + 1) if (world // dp) % tp == 0]


def meshes(world: int) -> list[MeshShape]:
    """Every factorization, with every ep dividing dp."""
    return [MeshShape(dp, tp, pp, ep) for dp, tp, pp in factorizations(world)
            for ep in range(1, dp + 1) if dp % ep == 0]


def cp_meshes(world: int) -> list[MeshShape]:
    """Meshes with context parallelism: every cp > 1 with dp, tp, pp of world / cp."""
    return [MeshShape(dp, tp, pp, ep, cp) for cp in range(2, world + 1) if world % cp == 0
            for dp, tp, pp in factorizations(world // cp) for ep in (1, 2) if dp % ep == 0]


def expected_groups(shape: MeshShape) -> dict[str, list[list[int]]]:
    """The groups of every axis, from the layout rule rank = t + tp (c + cp (d + dp p))."""
    dp, tp, pp, ep, cp = shape.dp, shape.tp, shape.pp, shape.ep, shape.cp

    def at(d: int, t: int, p: int, c: int = 0) -> int:
        return t + tp * (c + cp * (d + dp * p))

    runs = [range(b * ep, (b + 1) * ep) for b in range(dp // ep)]
    same_slot = [range(e, dp, ep) for e in range(ep)]
    everywhere = [(t, p, c) for t in range(tp) for p in range(pp) for c in range(cp)]
    groups = {
        "tp": [[at(d, t, p, c) for t in range(tp)] for d in range(dp) for p in range(pp)
               for c in range(cp)],
        "dp": [[at(d, t, p, c) for d in range(dp)] for t, p, c in everywhere],
        "pp": [[at(d, t, p, c) for p in range(pp)] for d in range(dp) for t in range(tp)
               for c in range(cp)],
        "cp": [[at(d, t, p, c) for c in range(cp)] for d in range(dp) for t in range(tp)
               for p in range(pp)],
        "ep": [[at(d, t, p, c) for d in run] for run in runs for t, p, c in everywhere],
        "edp": [[at(d, t, p, c) for d in slot] for slot in same_slot for t, p, c in everywhere],
        "dp_cp": [[at(d, t, p, c) for d in range(dp) for c in range(cp)]
                  for t in range(tp) for p in range(pp)],
        "edp_cp": [[at(d, t, p, c) for d in slot for c in range(cp)] for slot in same_slot
                   for t in range(tp) for p in range(pp)],
    }
    return {axis: sorted(g) for axis, g in groups.items()}


# ------------------------------------------------------------ tests without MPI
def test_factorizations_are_all_there():
    assert len(factorizations(8)) == 10 and len(factorizations(4)) == 6
    assert len(meshes(8)) == 20  # dp=1: 4 meshes x 1 ep; dp=2: 3 x 2; dp=4: 2 x 3; dp=8: 1 x 4


@pytest.mark.parametrize("shape", meshes(8) + meshes(4) + cp_meshes(8) + cp_meshes(4), ids=str)
def test_mesh_table(shape):
    world = shape.world
    assert shape.problems(world) == []
    sizes = {"dp": shape.dp, "tp": shape.tp, "pp": shape.pp, "ep": shape.ep,
             "edp": shape.dp // shape.ep, "cp": shape.cp, "dp_cp": shape.dp * shape.cp,
             "edp_cp": shape.dp // shape.ep * shape.cp}
    wanted = expected_groups(shape)
    for axis in AXES:
        groups = shape.groups(axis)
        # a partition of the world into groups of the axis's size
        assert sorted(r for g in groups for r in g) == list(range(world)), axis
        assert all(len(g) == sizes[axis] for g in groups), axis
        assert groups == wanted[axis], axis
    for group in shape.groups("tp"):  # tensor-parallel neighbours are consecutive ranks
        assert group == list(range(group[0], group[0] + shape.tp))
    for rank in range(world):
        c = shape.coords(rank)
        assert shape.rank(c["dp"], c["tp"], c["pp"], c["cp"]) == rank
        assert (c["ep"], c["edp"]) == (c["dp"] % shape.ep, c["dp"] // shape.ep)
        for axis in AXES:  # my coordinate on an axis is my place in that axis's group
            mine = next(g for g in wanted[axis] if rank in g)
            assert mine.index(rank) == c[axis], (rank, axis)


def test_megatron_example_dp2_tp2_pp2():
    shape = MeshShape(dp=2, tp=2, pp=2)
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_order_with_cp_dp2_cp2_tp2():
    """tp fastest, then cp, then dp: a cp group is tp apart, a dp group tp x cp apart."""
    shape = MeshShape(dp=2, tp=2, cp=2)
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def mesh_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minipar", "mesh", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_mesh_command_prints_the_table():
    shape = MeshShape(dp=2, tp=2, pp=2)
    done = mesh_cli("--dp", "2", "--tp", "2", "--pp", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "mesh dp=2 tp=2 pp=2: 8 ranks, tp fastest"
    assert lines[1].split() == ["rank", "dp_rank", "tp_rank", "pp_rank",
                                "dp", "group", "tp", "group", "pp", "group"]
    rows = [line.split() for line in lines[2:]]
    assert [int(row[0]) for row in rows] == list(range(8))
    for row in rows:
        rank, coords, members = int(row[0]), row[1:4], row[4:7]
        c = shape.coords(rank)
        assert [int(v) for v in coords] == [c["dp"], c["tp"], c["pp"]]
        for axis, cell in zip(("dp", "tp", "pp"), members):
            group = next(g for g in expected_groups(shape)[axis] if rank in g)
            assert cell == ",".join(map(str, group))


def test_mesh_command_shows_cp_and_the_gradient_groups():
    done = mesh_cli("--dp", "2", "--cp", "2", "--pp", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("mesh dp=2 tp=1 pp=2 cp=2: 8 ranks, tp fastest, then cp; gradients "
                        "sum over the dp_cp group (dp x cp)")
    assert lines[1].split()[-4:] == ["cp", "group", "dp_cp", "group"]
    rows = {int(r.split()[0]): r.split() for r in lines[2:]}
    # rank 5 = dp 0, cp 1 of pp stage 1: cp group {4,5}; its weights' gradients sum
    # over the dp x cp ranks of stage 1, {4,5,6,7}, where it is index dp cp + cp = 1
    assert rows[5][1:6] == ["0", "0", "1", "1", "1"] and rows[5][-2:] == ["4,5", "4,5,6,7"]
    shape = MeshShape(dp=2, pp=2, cp=2)
    for rank, row in rows.items():
        assert row[-1] == ",".join(map(str, next(g for g in shape.groups("dp_cp")
                                                  if rank in g)))


def test_mesh_command_shows_the_experts_gradient_group_with_cp():
    done = mesh_cli("--dp", "4", "--cp", "2", "--ep", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith("over the dp_cp group (dp x cp), experts' over edp_cp")
    rows = {int(r.split()[0]): r.split() for r in lines[2:]}
    assert rows[2][-2:] == ["0,1,2,3,4,5,6,7", "2,3,6,7"]


def test_mesh_command_shows_ep_and_edp_for_moe():
    done = mesh_cli("--dp", "4", "--ep", "2", "--pp", "2")
    assert done.returncode == 0, done.stderr
    rows = {int(r.split()[0]): r.split() for r in done.stdout.splitlines()[2:]}
    assert rows[6][-2:] == ["6,7", "4,6"]  # rank 6: ep group {6,7}, edp group {4,6}


def test_a_large_mesh_prints_fast_with_long_groups_shortened():
    start = time.monotonic()
    done = mesh_cli("--dp", "1000", "--tp", "2", "--ep", "4")
    assert done.returncode == 0 and time.monotonic() - start < 20, done.stderr
    rows = {int(r.split()[0]): r.split() for r in done.stdout.splitlines()[2:]}
    assert len(rows) == 2000
    # rank 7 = tp 1, dp 3 (ep 3, edp 0): its dp group is every odd rank, written by its
    # first two and last; its edp group every 4th dp rank from dp 3
    assert rows[7][1:6] == ["3", "1", "0", "3", "0"]
    assert rows[7][6:] == ["1,3,...,1999", "6,7", "7", "1,3,5,7", "7,15,...,1999"]


@pytest.mark.parametrize("args, words", [
    (["--dp", "3", "--ep", "2"], "--ep 2 must divide --dp 3"),
    (["--dp", "2", "--world", "8"], "does not fill the 8 ranks"),
    (["--tp", "0"], "--tp must be at least 1"),
    (["--dp", "5000"], "more rows than a table can show"),
    (["--dp", "1000000000000"], "more rows than a table can show"),
])
def test_a_mesh_that_does_not_fit_is_refused_in_one_line(args, words):
    done = mesh_cli(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and words in done.stderr, done.stderr


# -------------------------------------------------------------- under MPI
@pytest.mark.parametrize("n", RANK_COUNTS)
def test_mesh_communicators_agree_with_the_table(n):
    suite_report(n).assert_passed("tests.comm.test_mesh:check_mesh_communicators")


def check_mesh_communicators(comm):
    """For every mesh of this world size, each rank's communicator on every axis holds
    exactly the world ranks of its group in the pure table, in coordinate order."""
    from minipar.comm.collectives import Group, Ledger
    from minipar.comm.mesh import Mesh

    world = Group(comm, "world", Ledger())
    problems = []
    for shape in meshes(world.size) + cp_meshes(world.size):
        mesh = Mesh(shape, comm, Ledger())
        for axis in AXES:
            group = getattr(mesh, axis)
            members = group.allgather(world.rank)  # world ranks of my group, group order
            table = next(g for g in shape.groups(axis) if world.rank in g)
            if members != table or group.rank != mesh.coords[axis]:
                problems.append(f"{shape} {axis}: communicator has {members} (me at "
                                f"{group.rank}), table says {table} (me at "
                                f"{mesh.coords[axis]})")
        mesh.free()
    agree(world, problems)
