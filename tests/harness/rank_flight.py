"""Rank side of tests/comm/test_flight.py's clean runs: train, then dump the flight recorder.

    mpiexec -n 4 python -m tests.harness.rank_flight configs.json OUTDIR

For each config (TrainConfig fields) every rank trains it and writes its flight records
to OUTDIR/<i>/flight/rank<r>.json, and rank 0 the run's dump (ledger.json: every rank's
ledger of the last step). Before the first config, rank 0 sends itself SIGUSR1 while it
trains: its recorder must write OUTDIR/signalled/rank0.json from its own thread, the
run going on (the live-job dump of flight.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from mpi4py import MPI

from minipar.comm import flight
from minipar.comm.job import abort_on_exception
from minipar.run.results import dump
from minipar.run.train import train
from minipar.settings.config import TrainConfig


def main() -> None:
    world = MPI.COMM_WORLD
    configs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    flight.arm(str(out / "signalled"), world)
    for i, fields in enumerate(configs):
        cfg = TrainConfig(**fields).resolved(world.Get_size())
        signalled = i == 0 and world.Get_rank() == 0

        def on_step(step: int, loss: float, signalled: bool = signalled) -> None:
            if signalled and step == 0:
                os.kill(os.getpid(), signal.SIGUSR1)   # a live job asked for its records
        flight.reset()   # this run's records only
        result = train(cfg, world, on_step=on_step)
        flight.write(out / str(i) / "flight", "end of run")
        if world.Get_rank() == 0:
            dump(out / str(i), cfg, result)
    if world.Get_rank() == 0:   # the signal thread writes within moments
        deadline = time.monotonic() + 10
        while not (out / "signalled" / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    flight.disarm()


if __name__ == "__main__":
    abort_on_exception(main)
