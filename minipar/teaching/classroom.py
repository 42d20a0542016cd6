"""Driving real MPI ranks from a notebook.

What this file teaches: a notebook kernel is one process, so it cannot be a
rank of an MPI job. It can do two things instead, and the notebooks in
lessons/ use both:

1. launch `mpiexec -n N python ...` in a subprocess (in its own session, with a
   timeout after which the whole job is killed) and read back what rank 0
   wrote: `lesson("04_pipeline_parallel.py", 4, "--quick")` prints a lesson's
   output, `train(4, [dict(pp=4, microbatches=8), ...])` trains each config on
   one mesh and returns the losses, the one-process losses, the ledger, each
   rank's memory and the pipeline timeline / expert load (`Run`);
2. start N ipyparallel engines that are the ranks of one MPI job
   (`engines(4)`) and type code into them with `%%px` cells: every rank runs the
   cell, and its variables stay there to be inspected.

The rank side of `train` is this module run under mpiexec:

    mpiexec -n 4 python -m minipar.teaching.classroom configs.json results.json [--no-reference]
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minipar.core.memory import ModelStates
from minipar.run.train import problems, train_reference
from minipar.run.train import train as train_mesh
from minipar.settings.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]  # the checkout: minipar/teaching/ -> root


def mpiexec() -> str:
    """The launcher: $MINIPAR_MPIEXEC, else the one beside this Python (PyPI's mpich),
    else `mpiexec` on the PATH (a system MPI)."""
    beside = Path(sys.executable).parent / "mpiexec"
    return os.environ.get("MINIPAR_MPIEXEC") or (str(beside) if beside.exists() else "mpiexec")


def rank_environment() -> dict[str, str]:
    """One BLAS thread per rank (ranks must not fight over few cores), MPI on this host."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               UCX_NET_DEVICES=env.get("UCX_NET_DEVICES", "lo"), PYTHONFAULTHANDLER="1")
    return env


def mpirun(n: int, *args: str, timeout: float = 180, echo: bool = True) -> str:
    """Run `mpiexec -n n python <args>` from the repository root; print and return its
    output. Raises RuntimeError (with the output) if it fails or outlives `timeout`
    seconds, after killing every process of the job: a stuck rank never hangs a cell."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=rank_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        out, _ = proc.communicate()
        raise RuntimeError(f"timed out after {timeout:.0f} s: {shlex.join(cmd)}\n{out}") from None
    if echo:
        print(out, end="", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {shlex.join(cmd)}\n{out[-3000:]}")
    return out


def lesson(script: str, n: int, *flags: str, timeout: float = 180) -> str:
    """Run lessons/<script> on n ranks, as a student would from the shell."""
    return mpirun(n, str(Path("lessons") / script), *flags, timeout=timeout)


@dataclass
class Run:
    """One training run on a mesh, as rank 0 saw it, beside its one-process run."""

    cfg: TrainConfig
    losses: list[float]
    reference: list[float] | None          # the same steps in one process (if asked)
    ledger: list[dict]                     # last step, every rank (RunResult.ledger)
    memory: list[ModelStates]              # bytes of model states, one per world rank
    extras: dict = field(default_factory=dict)  # "timeline", "expert_load",
    #                                             "attention_scores" of rank 0


def train(n: int, configs: list[dict], timeout: float = 240, reference: bool = True
          ) -> list[Run]:
    """Train each config (TrainConfig fields) on n ranks, all in one mpiexec job; with
    `reference` rank 0 also reruns each in one process (`Run.reference`, else None)."""
    with tempfile.TemporaryDirectory() as folder:
        spec, out = Path(folder) / "configs.json", Path(folder) / "results.json"
        spec.write_text(json.dumps(configs))
        mpirun(n, "-m", "minipar.teaching.classroom", str(spec), str(out),
               *([] if reference else ["--no-reference"]), timeout=timeout, echo=False)
        results = json.loads(out.read_text())
    return [Run(TrainConfig(**r["cfg"]), r["losses"], r["reference"], r["ledger"],
                [ModelStates(**m) for m in r["memory"]], r["extras"]) for r in results]


def engines(n: int = 4) -> tuple[object, object]:
    """Start n ipyparallel engines as the ranks of one MPI job and make `%%px` cells run
    on them. Returns (cluster, client); `stop(cluster, client)` ends them."""
    import ipyparallel as ipp  # here: only a notebook starting engines needs ipyparallel

    os.environ.update({k: v for k, v in rank_environment().items()
                       if k.endswith("_THREADS") or k == "UCX_NET_DEVICES"})
    launcher = Path(mpiexec())  # ipyparallel calls `mpiexec` from the PATH
    if launcher.parent != Path():
        os.environ["PATH"] = f"{launcher.parent}{os.pathsep}{os.environ['PATH']}"
    # The controller finishes an engine's registration at its next heartbeat: at the
    # default period (3 s) every start waits up to 3 s for it. Beat every 0.25 s and
    # allow 120 missed beats, so the controller still drops an engine only after 30 s of
    # silence (the default 3 s x 10). An engine gives up on a silent controller after 50
    # checks of period + 0.5 s: 37 s (was 175 s), still far beyond a loaded machine's stall.
    cluster = ipp.Cluster(engines="mpi", n=n, controller_ip="127.0.0.1",
                          log_level=logging.ERROR,
                          controller_args=["--HeartMonitor.period=250",
                                           "--HeartMonitor.max_heartmonitor_misses=120"])
    cluster.start_cluster_sync()
    client = cluster.connect_client_sync()
    client.wait_for_engines(n, timeout=120, interactive=False)
    client.activate()  # %%px cells now run on every engine
    return cluster, client


def stop(cluster: object, client: object, timeout: float = 15) -> None:
    """End the engines (each leaves its MPI job), wait for mpiexec to exit, then stop
    the controller."""
    client.shutdown(hub=False, block=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
            launcher.poll() is None for launcher in cluster.engines.values()):
        time.sleep(0.1)
    cluster.stop_cluster_sync()


def by_rank(client: object, name: str) -> list:
    """Variable `name` of every engine, in MPI rank order (engine ids follow the order the
    engines came up in, not their ranks; each engine must have set `rank`)."""
    view = client[:]
    ranks, values = view.pull("rank", block=True), view.pull(name, block=True)
    return [value for _, value in sorted(zip(ranks, values), key=lambda pair: pair[0])]


def answered(exercise: str, measured: str, **answers: object) -> bool:
    """Whether an exercise's answers are written, for the notebooks' check cells.

    A notebook hands its exercises out unsolved: each answer line reads `name = None  #
    your formula`, and the cell's check runs only once every answer is written:

        zero2 = None                             # your formula
        if classroom.answered("exercise 1", f"rank 0 held {measured:.3f}", zero2=zero2):
            assert abs(zero2 - measured) < 1e-9, "not yet: ..."
            print("check passed")

    While an answer is None this prints one line instead -- the exercise, the names still
    to write, and `measured` (what the check holds them against: what the ranks measured,
    or a paper's number) -- and returns
    False: the cell does not raise, so a class (and `make course`) runs the notebook from
    top to bottom unsolved. Once all are written it prints nothing and returns True, and
    the cell's own asserts judge the answer (`make course` runs each exercise cell once
    more with its solution written in, tests/teaching/notebook_answers.py)."""
    missing = [name for name, value in answers.items() if value is None]
    if missing:
        names = ", ".join(f"`{name}`" for name in missing)
        lines = "line" if len(missing) == 1 else "lines"
        print(f'{exercise}: not written yet -- write {names} in the {lines} marked "# your ...",'
              f" then rerun this cell ({measured})")
    return not missing


# ----------------------------------------------------------- the rank side
def run_configs(configs: list[dict], out: Path, reference: bool = True) -> None:
    """Train each config on MPI.COMM_WORLD; rank 0 writes every run's results to `out`
    (with `reference`, beside each the losses of the same run in one process)."""
    from mpi4py import MPI  # here: the notebook side of this file runs without MPI

    from minipar.comm.job import wait_for_rank0

    world = MPI.COMM_WORLD
    results = []
    for fields in configs:
        cfg = TrainConfig(**fields).resolved(world.Get_size())
        errors = problems(cfg, world.Get_size())
        if errors:  # every rank finds the same problems: all stop together
            raise SystemExit(f"minipar.teaching.classroom: {fields}: {errors[0]}")
        result = train_mesh(cfg, world)
        # each rank's bytes of params, grads and optimizer state -> rank 0 (small objects)
        memory = world.gather(asdict(result.extras["memory"]), root=0)
        if world.Get_rank() == 0:
            extras = {k: result.extras.get(k) for k in ("timeline", "expert_load",
                                                         "attention_scores")}
            results.append(dict(cfg=cfg.as_json(), losses=result.losses, memory=memory,
                                reference=train_reference(cfg).losses if reference else None,
                                ledger=result.ledger,
                                extras=extras))
        wait_for_rank0(world)  # the others asleep while rank 0 reruns the config alone
    if world.Get_rank() == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    from minipar.comm.job import abort_on_exception  # loads mpi4py.MPI: only in a rank process

    # one failing rank stops them all, never a hang; a bad config exits every rank alike
    abort_on_exception(lambda: run_configs(json.loads(Path(sys.argv[1]).read_text()),
                                           Path(sys.argv[2]), "--no-reference" not in sys.argv))
