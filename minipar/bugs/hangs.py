"""Bugs that hang a job, one flag away: what each looks like to the flight recorder.

What this file teaches: the four classic ways a distributed program deadlocks,
each re-created on purpose so that `--timeout` ends it and the flight recorder
(flight.py, flight_report.py) names the rank that disagrees. MPI matches the
calls of one communicator by their order, so every rank must make the same
calls on each communicator in the same order -- the same loops, the same
branches:

    hang-extra-allreduce   one rank does one collective more (a norm for its log line)
    hang-pp-both-recv      two pipeline stages both receive first
    hang-wrong-group       tp's Allreduce issued on the dp group by one rank
    hang-count-mismatch    one rank's Alltoallv buffer shorter than the counts it announced

    mpiexec -n 4 python -m minipar train --dp 4 --inject-bug hang-extra-allreduce --timeout 3

As in bugs/detours.py, the correct code is never touched: each `detour` returns the
(module, name, replacement) swaps, each broken line marked `# BUG:`; bugs/catalog.py applies
them under `--inject-bug NAME`. `names` are what the verdict must say (the tests and
lesson 15 check them). Pure to import: the detours load mpi4py.MPI when applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from minipar.comm.collectives import Group
    from minipar.comm.mesh import Mesh
    from minipar.core.autograd import Tensor
    from minipar.settings.config import TrainConfig

Swap = tuple[object, str, object]  # (module, attribute, what stands in for it)


@dataclass(frozen=True)
class Hang:
    """One injectable hang: what breaks, what the verdict says, where it applies (the
    fields catalog.Bug has, so `catalog.problems`, `catalog.injected` and `catalog.command` take
    either), and `names`: words the verdict of a 4-rank run of `flags` must contain."""

    name: str
    strategy: str
    broken: str
    why: str
    requires: str
    fits: Callable[[TrainConfig], bool]
    detour: Callable[[], list[Swap]]
    flags: dict
    names: tuple[str, ...] = ()
    mpi_may_fail: bool = False   # the wait may instead end in an MPI error (see its `why`)


# ------------------------------------------------------------ one call more
def extra_allreduce() -> list[Swap]:
    """dp rank 0 alone sums the squared gradient norm over dp, for its log line."""
    from mpi4py import MPI  # here, as every detour's import (module docstring)

    from minipar.parallel import dp_updater  # here: loads mpi4py.MPI

    class LoggingRankZero(dp_updater.DataParallel):
        def step(self) -> None:
            super().step()
            if self.mesh.coords["dp"] == 0:  # BUG: a collective inside a rank-0-only branch
                norm = np.array([sum(float(np.vdot(p.grad, p.grad)) for p in self.params
                                     if p.grad is not None)])
                self.mesh.dp.Allreduce(MPI.IN_PLACE, norm)  # BUG: the others never come

    return [(dp_updater, "DataParallel", LoggingRankZero)]


# ------------------------------------------------------- both stages receive
def both_receive_first() -> list[Swap]:
    """The first stage waits for its first gradient before sending its first activation."""
    from minipar.parallel.pipeline import executor as pipeline  # here: loads mpi4py.MPI

    class ReceiveFirst(pipeline.StageWorker):
        def send_act(self, ins: pipeline.Instruction) -> None:
            if self.stage == 0 and ins.microbatch == 0:
                early = np.empty(self.shape, dtype=self.dtype)
                # BUG: Recv before Send; the next stage is itself in Recv, for this activation
                self.group.Recv(early, source=self.peer(ins), tag=pipeline.GRAD_TAG)
            super().send_act(ins)

    return [(pipeline, "StageWorker", ReceiveFirst)]


# ----------------------------------------------------------- the wrong group
def wrong_group() -> list[Swap]:
    """The last rank builds its row-parallel linears with the dp group instead of tp's (a
    constructor handed the wrong group): their Allreduce, at its usual line, goes to dp."""
    from minipar.compose import parallelize

    correct = parallelize.make_ffn_block

    def make_ffn_block(cfg: TrainConfig, model_cfg: object, mesh: Mesh, *args: object,
                       **kwargs: object) -> object:
        block = correct(cfg, model_cfg, mesh, *args, **kwargs)
        if mesh.rank == mesh.shape.world - 1 and hasattr(block, "fc2"):
            block.fc2.tp = mesh.dp  # BUG: tp's partial sums handed the dp group
        return block

    return [(parallelize, "make_ffn_block", make_ffn_block)]


# --------------------------------------------------------- a shorter buffer
def short_buffer() -> list[Swap]:
    """The last ep rank's dispatch leaves out the rows for ep rank 0 (count 0 sent), though
    the counts it announced (the Alltoall before) promise them."""
    from minipar.comm import collectives
    from minipar.core import autograd as ag
    from minipar.parallel import expert_parallel as ep  # here: loads mpi4py.MPI

    def dispatch(u: Tensor, token_rows: np.ndarray, send: np.ndarray, recv: np.ndarray,
                 ep_group: Group) -> Tensor:
        rows = ag.take_rows(u, token_rows)
        counts = send.sum(axis=1)
        if ep_group.rank == ep_group.size - 1:
            counts = counts.copy()
            counts[0] = 0  # BUG: ep rank 0's rows cut from the buffer; it waits for them
        return collectives.alltoallv(rows, ep_group, counts, recv.sum(axis=1))

    return [(ep, "dispatch", dispatch)]


def _dp_only(cfg: TrainConfig) -> bool:
    return cfg.dp > 1 and cfg.tp == cfg.pp == cfg.cp == 1 and cfg.zero == 0 \
        and cfg.grad_sync == "bucketed" and cfg.model in ("mlp", "gpt")


_LIST = [
    Hang("hang-extra-allreduce", "dp",
         "dp rank 0 alone Allreduces the gradient norm over dp after the sync (a log line)",
         "MPI pairs rank 0's extra Allreduce with the others' next one over dp (the step's "
         "loss, the same size): from there rank 0 is a call ahead, waits in the loss "
         "Allreduce the others already left, and they wait over world for rank 0",
         "--dp 2 or more with --zero 0 --grad-sync bucketed and no other axis",
         _dp_only, extra_allreduce, {"dp": 4},
         ("MPI paired different calls as Allreduce over dp", "rank 0 made it at bugs/hangs.py:",
          "ranks 1-3 made it at run/agreement.py:")),
    Hang("hang-pp-both-recv", "pp",
         "the first stage receives its first gradient before sending its first activation",
         "stage 0 waits for a gradient that stage 1 can compute only from the activation "
         "stage 0 has not sent; stage 1 waits for that activation: both in Recv",
         "--pp 2 or more and --microbatches 2 or more, --schedule gpipe or 1f1b",
         lambda cfg: cfg.pp > 1 and cfg.microbatches > 1 and cfg.schedule in
         ("gpipe", "1f1b"), both_receive_first, {"pp": 2, "microbatches": 2},
         ("ranks 0,1", "Recv from pp rank 1", "ranks 2,3", "Recv from pp rank 0",
          "never sent that message", "a cycle: ", "bugs/hangs.py:",
          "parallel/pipeline/executor.py:")),
    Hang("hang-wrong-group", "tp",
         "the last rank's row-parallel linears built with the dp group instead of tp's",
         "its tp partner waits in the tp Allreduce it never enters; it waits in an Allreduce "
         "over dp its dp partner reaches only in the gradient sync",
         "--tp 2 and --dp 2 or more on --model mlp without --sp, and a gradient sync that "
         "is no blocking Allreduce (--zero 1 or 2, or --grad-sync overlapped): MPI would "
         "pair it with the wrong call's Allreduce and fail on the sizes instead of hanging",
         lambda cfg: cfg.tp > 1 and cfg.dp > 1 and cfg.model == "mlp" and not cfg.sp
         and cfg.pp == 1 and (cfg.zero in (1, 2) or cfg.grad_sync == "overlapped"),
         wrong_group, {"tp": 2, "dp": 2, "zero": 1},
         ("rank 3", "Allreduce over dp", "tensor_parallel.py:")),
    Hang("hang-count-mismatch", "ep",
         "the last ep rank's dispatch Alltoallv sends ep rank 0 none of the rows it "
         "announced",
         "ep rank 0 expects rows the sender never put in its buffer (MPICH posts no send "
         "for a count of 0): it waits in the dispatch, and the sender's next message to it "
         "may land in that wait. If that message is longer than the rows it waits for, MPI "
         "fails on the size (the rank's error ends the job); if not, the exchanges after it "
         "no longer match and a rank waits for good (the watchdog ends it). Which one "
         "depends on how the tokens were routed; the verdict names the mismatch either way",
         "--model moe with --ep 2 or more", lambda cfg: cfg.model == "moe" and cfg.ep > 1,
         short_buffer, {"model": "moe", "ep": 2},
         ("counts differ in Alltoallv over ep", "sends 0 elements to rank", "bugs/hangs.py:"),
         mpi_may_fail=True),
]
HANGS: dict[str, Hang] = {hang.name: hang for hang in _LIST}
