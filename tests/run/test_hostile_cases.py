"""The failure cases of a hostile pass, each a clean refusal or handled.

A clean refusal is one line from rank 0 (`minipar: error: ...`), exit 2, before the
first step; most cases here are one process (`python -m minipar` without a launcher,
or a pure function in this process), the MPI ones grouped into few launches.

    python -m pytest tests/run/test_hostile_cases.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minipar.checkpoint import save_load, shard_files
from minipar.checkpoint import step_folders as folders
from tests.harness.mpi import ROOT, rank_env

SMALL = ["--layers", "2", "--d-model", "16", "--d-in", "8", "--batch", "16",
         "--optimizer", "adam"]


def cli(*args: str, timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m minipar ARGS` as one process (no launcher)."""
    return subprocess.run([sys.executable, "-m", "minipar", *args], cwd=cwd,
                          env=rank_env(timeout), capture_output=True, text=True,
                          timeout=timeout)


def config(*flags: str, world: int = 1) -> object:
    """The resolved TrainConfig of `train FLAGS` (no MPI: for the pure checks)."""
    from minipar.settings.flags import config_from_args, make_parser

    return config_from_args(make_parser().parse_args(list(flags))).resolved(world)


def refusals(*flags: str, world: int = 1) -> list[str]:
    """`train.problems` of `train FLAGS`: what every rank finds before the first step."""
    from minipar.run.train import problems

    return problems(config(*flags, world=world), world)


def refused(job: subprocess.CompletedProcess, *words: str) -> str:
    """Assert `job` is a clean refusal naming `words`; returns its line."""
    lines = [line for line in job.stderr.splitlines() if line.strip()]
    assert job.returncode == 2 and len(lines) == 1, (job.returncode, job.stdout, job.stderr)
    assert lines[0].startswith("minipar: error: "), lines
    assert "Traceback" not in job.stderr and "step    1" not in job.stdout, job.stdout
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------- 1. checkpoints belong to one run
def test_a_folder_of_checkpoints_belongs_to_one_run(tmp_path):
    """Another run, another model, an older resume or reshard into it: refused, and the
    folder keeps every step; the run itself continues and prunes only its own steps."""
    from minipar.checkpoint.owner import ownership_problems

    ck = tmp_path / "ck"
    assert cli("train", *SMALL, "--steps", "2", "--save", str(ck)).returncode == 0
    run = shard_files.read_manifest(ck)["run"]
    refused(cli("train", *SMALL, "--steps", "2", "--save", str(ck)), "another run", run)
    (line,) = refusals(*SMALL, "--layers", "3", "--steps", "2", "--save", str(ck))
    assert "another model" in line, line
    job = cli("train", *SMALL, "--steps", "4", "--resume", str(ck), "--save", str(ck))
    assert job.returncode == 0, job.stderr                    # the same run, continued
    assert shard_files.read_manifest(ck)["run"] == run
    (line,) = refusals(*SMALL, "--steps", "3", "--resume", str(ck / "step-000002"),
                       "--save", str(ck))
    assert "newer" in line and "step-000004" in line, line
    older = shard_files.read_manifest(ck / "step-000002")   # reshard's check of its DST
    (line,) = ownership_problems(ck, older["run"], older["model"], older["step"], "DST")
    assert line.startswith("DST") and "newer" in line, line
    assert folders.latest(ck).name == "step-000004"
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000002", "step-000004"]
    assert shard_files.verify(ck) == []


def fake_save(root: Path, step: int, token: str, run: str | None) -> Path:
    staging = folders.staging_folder(root, step, token)
    staging.mkdir(parents=True)
    (staging / "manifest.json").write_text(json.dumps({"step": step, "run": run}))
    return staging


def test_keep_prunes_only_the_writing_runs_steps_and_latest_never_moves_back(tmp_path):
    token = folders.acquire(tmp_path)
    try:
        for step, run in ((1, "other"), (2, None), (3, "mine"), (4, "mine"), (5, "mine")):
            folders.publish(tmp_path, fake_save(tmp_path, step, token, run), step, token,
                            keep=1)
            time.sleep(0.01)
        assert sorted(p.name for p in folders.step_folders(tmp_path)) == [
            "step-000001", "step-000002", "step-000005"]        # the others' steps kept
        with pytest.raises(folders.FolderError, match="newer than step 4"):
            folders.publish(tmp_path, fake_save(tmp_path, 4, token, "mine"), 4, token, keep=1)
        assert folders.latest(tmp_path).name == "step-000005"
    finally:
        folders.release(tmp_path)


# ------------------------------------------------- 2. --data compared by its bytes
GPT = ["--model", "gpt", "--layers", "1", "--d-model", "8", "--heads", "2", "--seq-len", "8",
       "--batch", "4", "--optimizer", "adam"]


def test_resume_compares_the_data_by_its_bytes_not_its_spelling(tmp_path, monkeypatch):
    text = tmp_path / "text.txt"
    text.write_text("the same text, read byte by byte, window after window. " * 8)
    ck = tmp_path / "ck"
    assert cli("train", *GPT, "--data", str(text), "--steps", "1", "--save", str(ck),
               ).returncode == 0
    assert shard_files.read_manifest(ck)["data_sha256"]
    monkeypatch.chdir(tmp_path)                    # the same file, spelled relatively
    assert refusals(*GPT, "--data", "text.txt", "--steps", "2", "--resume", str(ck)) == []
    text.write_text("another text entirely, of the same kind and about as long.. " * 8)
    (line,) = refusals(*GPT, "--data", "text.txt", "--steps", "2", "--resume", str(ck))
    assert line.startswith("--resume") and "--data text.txt: its bytes differ" in line, line


# ------------------------------------------------- 3. paths found unusable before step 1
@pytest.fixture
def bad_paths(tmp_path):
    """A dangling link, a loop of links, a name too long, a file (not a folder)."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "a_file").write_text("x")
    return {"dangling": tmp_path / "dangling", "loop": tmp_path / "loop",
            "long": tmp_path / ("n" * 300), "under a dangling link": tmp_path / "dangling" / "x",
            "a_file": tmp_path / "a_file"}


WHY = {"dangling": "dangling", "loop": "loop of symbolic links", "long": "300 bytes long",
       "under a dangling link": "dangling"}


@pytest.mark.parametrize("case", sorted(WHY))
def test_unusable_paths_are_named_for_folders_and_files(bad_paths, case):
    from minipar.settings.preflight import file_problems, folder_problems

    for problems in (folder_problems(bad_paths[case]), file_problems(bad_paths[case])):
        assert len(problems) == 1 and WHY[case] in problems[0], problems


def test_every_path_flag_refuses_links_to_nowhere_and_loops(bad_paths, one_checkpoint):
    refused(cli("train", *SMALL, "--steps", "2", "--dump", str(bad_paths["dangling"])),
            "--dump", "dangling")
    (line,) = refusals(*SMALL, "--steps", "2", "--resume", str(bad_paths["loop"]))
    assert line.startswith("--resume") and "loop" in line, line
    (line,) = refusals(*SMALL, "--steps", "2", "--save", str(bad_paths["long"]))
    assert line.startswith("--save") and "300 bytes" in line, line
    refused(cli("reshard", str(one_checkpoint), str(bad_paths["long"])), "DST", "300 bytes")


def test_plan_json_is_checked_before_the_search(bad_paths, tmp_path, capsys):
    from minipar.planner.plan import plan_command

    args = ["--preset", "llama3-8b", "--cluster", "h100", "--global-batch", "64", "--gpus",
            "8", "--json"]
    for target, why in ((tmp_path, "is a folder"), (tmp_path / "no" / "x.json", "no folder"),
                        (bad_paths["dangling"], "dangling")):
        assert plan_command([*args, str(target)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        assert captured.err.startswith("minipar: error: --json") and why in captured.err
    if Path("/dev/full").exists():   # a device that is full when the result is written
        assert plan_command([*args, "/dev/full"]) == 1
        assert "No space left on device" in capsys.readouterr().err


def test_data_is_checked_by_its_size_before_reading_and_large_files_are_mapped(tmp_path):
    import numpy as np

    from minipar.core import data

    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as handle:           # sparse: no disk used
        handle.truncate(data.DATA_LIMIT + 1)
    problem = data.corpus_problem(str(huge), 8)
    assert problem and "GiB is more than the 16 GiB" in problem, problem
    large = tmp_path / "large.txt"
    with open(large, "wb") as handle:
        handle.truncate(data.MEMMAP_FROM)
    assert isinstance(data.read_corpus(str(large)), np.memmap)
    x, y = data.make_text_windows(str(large), 0, 0, 4, 8)
    assert x.shape == (4, 8) and not x.any()


# ------------------------------------------------- 5. plan in seconds for any GPU count
def test_plan_enumerates_only_meshes_that_can_run_whatever_the_gpu_count(capsys):
    from minipar.__main__ import main
    from minipar.planner.plan import resolve_model
    from minipar.planner.plan_flags import make_parser
    from minipar.planner.search import meshes
    from minipar.planner.workloads import transformer

    args = make_parser().parse_args(["--preset", "deepseek-v3", "--global-batch", "15360"])
    w = transformer(resolve_model(args)[0], 15360, None)
    for gpus in (735134400, 10**9, 2**61 - 1):   # highly composite, a power of ten, prime
        for dp, tp, pp, cp, _ in meshes(w, gpus, {}):
            assert dp * tp * pp * cp == gpus and w.batch % dp == 0 and pp <= w.layers
    assert len(meshes(w, 2048, {})) < 3000
    assert main(["plan", "--preset", "llama3-8b", "--cluster", "h100", "--global-batch",
                 "1024", "--gpus", "735134400"]) == 0
    assert "0 plans fit" in capsys.readouterr().out


def test_a_search_past_its_budget_is_bounded_and_says_so(monkeypatch):
    from minipar.planner import search
    from minipar.planner.memory_cost import Plan
    from minipar.planner.plan import resolve_hardware, resolve_model
    from minipar.planner.plan_flags import make_parser
    from minipar.planner.workloads import transformer

    args = make_parser().parse_args(["--preset", "llama3-8b", "--cluster", "h100",
                                     "--global-batch", "1024", "--gpus", "64"])
    w = transformer(resolve_model(args)[0], 1024, None)
    hw = resolve_hardware(args)[0]
    monkeypatch.setattr(search, "BUDGET", 400)
    found = search.search(w, hw, 64, Plan(1, sp=True), (0, 1), ("selective",))
    assert len(found.feasible) + len(found.too_big) <= 400
    assert "the search was bounded" in found.bounded and "fix a degree" in found.bounded
    assert found.feasible and sum(found.rejected.values()) > 0


# ------------------------------------------------- 4. crafted shards behind a resealed manifest
def craft(step_folder: Path, how: str) -> None:
    """Rewrite the one shard of `step_folder` the way `how` says, then fix its size and
    checksum in the manifest and reseal it: only the contents' own checks stand in the way."""
    import hashlib
    import io
    import zipfile

    import numpy as np

    shard = step_folder / shard_files.shard_name(0, 1)
    with np.load(shard) as opened:
        arrays = {key: opened[key] for key in opened.files}
    meta = json.loads(arrays["meta"].item())
    if how == "deep meta":
        arrays["meta"] = np.array("[" * 100_000 + "]" * 100_000)
    elif how == "NaN data":
        arrays["0.data"] = np.full_like(arrays["0.data"], np.nan)
    elif how == "a missing piece":
        meta["pieces"] = meta["pieces"][:-1]
        arrays["meta"] = np.array(json.dumps(meta))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    if how == "a huge npy header":   # "0.data" claims 2**44 float64: 128 TiB
        header = {"descr": "<f8", "fortran_order": False, "shape": (2**44,)}
        member = io.BytesIO()
        np.lib.format.write_array_header_1_0(member, header)
        rebuilt = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as old, zipfile.ZipFile(rebuilt, "w") as new:
            for info in old.infolist():
                new.writestr(info.filename, member.getvalue() + b"\0" * 64
                             if info.filename == "0.data.npy" else old.read(info))
        data = rebuilt.getvalue()
    shard.write_bytes(data)
    manifest = json.loads((step_folder / "manifest.json").read_text())
    manifest["files"][shard.name].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (step_folder / "manifest.json").write_text(json.dumps(shard_files.seal(manifest)))


CRAFTED = {"deep meta": "nested too deep", "a huge npy header": "the manifest says",
           "NaN data": "NaN or infinite", "a missing piece": "no shard holds all of"}


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    ck = tmp_path_factory.mktemp("crafted") / "ck"
    job = cli("train", *SMALL, "--steps", "1", "--save", str(ck))
    assert job.returncode == 0, job.stderr
    return ck


@pytest.mark.parametrize("how", sorted(CRAFTED))
def test_a_crafted_shard_is_one_line(one_checkpoint, tmp_path, how):
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(one_checkpoint, copy)
    craft(folders.latest(copy), how)
    errors = shard_files.verify(copy)
    assert len(errors) == 1 and CRAFTED[how] in errors[0] and "\n" not in errors[0], errors
    if how == "NaN data":   # through the command line: exit 2, before the first step
        refused(cli("train", *SMALL, "--steps", "2", "--resume", str(copy)), "--resume",
                CRAFTED[how])


# ------------------------------------------------- 6. lessons get the command line's refusals
LESSON_REFUSALS = {"10_transformer.py --quick": "--batch 16 is not divisible by --dp 3",
                   "02_tensor_parallel.py": "lesson 2 splits W's 512 columns",
                   "12_context_parallel.py --quick": "--cp-mode ulysses",
                   "01_data_parallel.py": "lesson 1 splits a batch of 1024",
                   "03_expert_parallel.py --plot {a_file}": "--plot",
                   "07_zero.py --plot {dangling}": "dangling"}


def test_lessons_on_a_rank_count_they_cannot_use_refuse_in_one_line(tmp_path):
    from tests.harness.mpi import launch

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    cases = [case.format(a_file=tmp_path / "a_file", dangling=tmp_path / "dangling")
             for case in LESSON_REFUSALS]
    job = launch(3, ["-m", "tests.harness.rank_lessons", str(tmp_path / "out"), *cases], 90)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(3)]
    for i, expected in enumerate(LESSON_REFUSALS.values()):
        for rank, records in enumerate(ranks):
            record = records[i]
            assert record["code"] == 2, record
            lines = [line for line in record["stderr"].splitlines() if line.strip()]
            if rank:
                assert lines == [] and "MISMATCH" not in record["stdout"], record
            else:
                assert len(lines) == 1 and lines[0].startswith("minipar: error: "), record
                assert expected in lines[0], (expected, lines)


# ------------------------------------------------- 9. a rank leaving alone with SystemExit(0)
def test_a_rank_leaving_alone_with_exit_0_ends_the_job_at_once():
    from tests.harness.mpi import launch

    start = time.monotonic()
    job = launch(2, ["-m", "tests.harness.rank_faults", "fault", "exit0:1:2", "train", "--dp", "2",
                     "--steps", "5", "--timeout", "0", *SMALL], 60)
    assert not job.timed_out and time.monotonic() - start < 30, job.explain()
    assert job.returncode != 0 and "done:" not in job.stdout, job.explain()
    assert "rank 1 left on its own (SystemExit(0))" in job.stderr, job.explain()


# ------------------------------------------------- 7. reshard derives what the new mesh needs
def test_reshard_derives_the_flags_a_target_mesh_needs(tmp_path):
    import numpy as np

    from minipar.checkpoint.shard_files import config_for, for_mesh
    from minipar.run.train import problems
    from tests.harness.mpi import minipar

    gpt = ["--model", "gpt", "--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len",
           "8", "--vocab", "16", "--batch", "8", "--optimizer", "adam"]
    on_tp2 = {"config": config(*gpt, "--tp", "2", world=2).as_json(), "step": 1}
    assert on_tp2["config"]["vocab_parallel"] is True
    to_tp1 = config_for(on_tp2, tp=1).resolved(1)              # tp 2 -> 1: no vocab split
    assert problems(to_tp1, 1) == [] and to_tp1.vocab_parallel is False
    a, d = tmp_path / "a", tmp_path / "d"
    assert cli("train", *gpt, "--steps", "1", "--save", str(a)).returncode == 0
    interleaved = for_mesh(config_for(shard_files.read_manifest(a), pp=2, virtual=2).resolved(2))
    assert problems(interleaved, 2) == [] and interleaved.microbatches == 2   # M % pp = 0
    job = minipar(2, ["reshard", str(a), str(d), "--pp", "2", "--virtual", "2"], 60)
    assert job.returncode == 0, job.explain()
    assert shard_files.read_manifest(d)["config"]["microbatches"] == 2
    assert shard_files.verify(d) == []
    saved = save_load.load(a)
    for name, value in save_load.load(d).params.items():
        assert np.array_equal(value, saved.params[name]), name


# ------------------------------------------------- 8. exercises: the student's folder alone
def test_exercise_start_never_overwrites_and_wants_a_folder(tmp_path):
    from minipar.exercises.command import main

    (tmp_path / "a_file").write_text("x")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "EXERCISE.txt").write_text("my own notes")
    for target in (tmp_path / "a_file", Path("/dev/null"), mine):
        assert main(["start", "dp-naive", str(target)]) == 2
    assert (mine / "EXERCISE.txt").read_text() == "my own notes"
    assert not (mine / "minipar").exists()


def test_exercise_check_fails_a_folder_missing_a_file_naming_it(tmp_path):
    from minipar.exercises import regions
    from minipar.exercises.command import check

    empty = tmp_path / "empty"
    (empty / "minipar").mkdir(parents=True)
    (empty / "minipar" / "__init__.py").write_text("")
    code, report = check(["dp-naive"], empty)     # before any job: the exercise's own file
    assert code == 1 and "lacks minipar/exercises/grade.py" in report, report
    regions.start(["dp-naive"], tmp_path / "student")
    (tmp_path / "student" / "minipar" / "run" / "train.py").unlink()
    code, report = check(["dp-naive"], tmp_path / "student")   # the job's imports name it
    assert code == 1 and "FAILED" in report and "lacks minipar/run/train.py" in report, report


def test_exercise_check_bounds_the_output_names_sys_exit_and_a_timeout(tmp_path, monkeypatch):
    from minipar.exercises import regions
    from minipar.exercises.command import check

    stubbed = regions.start(["dp-naive", "dp-bucketed"], tmp_path)
    path = stubbed[0]
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if "raise NotImplementedError(\"exercise dp-naive" in line or \
                "raise NotImplementedError('exercise dp-naive" in line:
            lines[i] = line[:len(line) - len(line.lstrip())] + (
                "import sys; [print('noise', j) for j in range(5000)]; sys.exit(0)")
        elif "NotImplementedError" in line and "dp-bucketed" in line:
            lines[i] = line[:len(line) - len(line.lstrip())] + "while True: pass"
    path.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("MINIPAR_EXERCISE_DEADLINE", "3")
    code, report = check(["dp-naive", "dp-bucketed"], tmp_path)
    assert code == 1 and len(report.splitlines()) < 40, report
    assert "called sys.exit(0) at parallel/data_parallel.py" in report, report
    assert "more lines the code printed are left out" in report, report
    assert "timeout: after 3 s rank" in report and "at step 1 of" in report, report
    assert "in bucketed_allreduce" in report, report


# ------------------------------------------------- 10. a refusal on one rank reaches them all
def test_a_refusal_or_other_settings_on_one_rank_end_every_rank_with_its_line(tmp_path,
                                                                             one_checkpoint):
    """Ranks given different flags (an MPMD launch; ranks seeing different files, a --data
    path on one host only, end alike): the ranks agree before their first collective,
    rank 0 says which rank refused and why, every rank exits 2 (they waited forever)."""
    from tests.harness.mpi import launch

    base = ["--dp", "2", "--steps", "100000", "--timeout", "0", *SMALL]
    gen = ["generate", "--prompt-ids", "1,2", "--dp", "2", "--batch", "2"]
    resharded = ["reshard", str(one_checkpoint), str(tmp_path / "resharded")]
    cases = {"rank 1 refused: --layers must be at least 1":
             [["train", *base], ["train", *base, "--layers", "0"]],
             "rank 1 was launched with other settings than rank 0":
             [["train", *base], ["train", *base, "--seed", "3"]],
             "rank 1 refused: --new-tokens must be at least 1":
             [[*gen, "--new-tokens", "2"], [*gen, "--new-tokens", "0"]],
             "rank 1 refused: unrecognized arguments: --bogus":   # reshard's parse
             [[*resharded], [*resharded, "--bogus"]],
             "rank 1 refused: --plot /proc/":   # the tour (2 ranks: refused before the size)
             [["tour"], ["tour", "--plot", "/proc/minipar-tour"]]}
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(list(cases.values())))
    start = time.monotonic()
    job = launch(2, ["-m", "tests.harness.rank_commands", str(tmp_path / "out"), str(spec)], 60)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    assert time.monotonic() - start < 30, job.explain()
    assert not (tmp_path / "resharded").exists()
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    for i, expected in enumerate(cases):
        assert [ranks[r][i]["code"] for r in range(2)] == [2, 2], (expected, ranks)
        assert ranks[1][i]["stderr"] == "", ranks[1][i]
        lines = ranks[0][i]["stderr"].splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"minipar: error: {expected}"), lines


# ------------------------------------------------- 11. a flag that would do nothing is refused
def test_flags_a_command_would_ignore_are_refused_or_not_offered(tmp_path):
    from minipar.checkpoint.save_load import mismatches
    from minipar.run.generate import config_from_args, make_parser
    from minipar.settings.config import ConfigError

    (line,) = refusals(*SMALL, "--loss-scale", "1024")                # no --mixed: no S
    assert line.startswith("--loss-scale applies to --mixed fp16 only"), line
    saved = {"step": 2, "config": {**config("--mixed", "fp16", *SMALL).as_json()},
             "loss_scaler": {"scale": 32768.0, "skipped": 1, "clean": 0}}
    (line,) = mismatches(saved, config("--mixed", "fp16", "--loss-scale", "1024", *SMALL,
                                       "--steps", "3"))
    assert "--loss-scale 1024 would be ignored" in line and "S 32768 now" in line, line
    (line,) = mismatches(saved, config(*SMALL, "--steps", "3"))       # --mixed left out
    assert line == "saved with --mixed fp16, this run has no --mixed (they must match)", line
    saved["config"]["mixed"] = None
    assert mismatches(saved, config(*SMALL, "--mixed", "bf16", "--steps", "3")) == [
        "saved without --mixed, this run has --mixed bf16 (they must match)"]
    usage = make_parser().format_help()                                # generate's flags
    for flag in ("--save", "--trace", "--optimizer", "--steps", "--lr", "--mixed",
                 "--loss-scale", "--inject-bug", "--microbatches"):
        assert f"{flag} " not in usage and f"{flag}\n" not in usage, flag
    with pytest.raises(ConfigError, match="unrecognized arguments: --steps 3"):
        make_parser().parse_args(["--prompt-ids", "1", "--steps", "3"])
    _, errors = config_from_args(make_parser().parse_args(
        ["--prompt-ids", "1", "--data", str(tmp_path / "none.txt")]), 1)
    assert errors == [f"--data {tmp_path / 'none.txt'}: no such file"], errors
    ck = tmp_path / "gpt"
    assert cli("train", "--model", "gpt", "--layers", "1", "--d-model", "8", "--heads", "2",
               "--seq-len", "8", "--vocab", "16", "--batch", "2", "--steps", "1",
               "--save", str(ck)).returncode == 0
    for flags, words in ((["--layers", "2"], "saved with --layers 1, this run has --layers 2"),
                         (["--layers", "1", "--heads", "4"], "--heads 4"),
                         (["--sp"], "--sp is training's")):
        args = make_parser().parse_args(["--resume", str(ck), "--prompt-ids", "1", *flags])
        _, errors = config_from_args(args, 1)
        assert len(errors) == 1 and words in errors[0], (flags, errors)
    args = make_parser().parse_args(["--resume", str(ck), "--prompt-ids", "1", "--layers", "1",
                                     "--new-tokens", "2"])             # agrees: runs
    gcfg, errors = config_from_args(args, 1)
    assert errors == [] and gcfg.train.layers == 1 and gcfg.train.heads == 2


# ------------------------------------------------- 12. a launcher that is not there
def test_exercise_check_with_a_launcher_that_runs_nothing_is_one_line(tmp_path, monkeypatch):
    from minipar.exercises import regions

    regions.start(["dp-naive"], tmp_path / "student")
    not_a_program = tmp_path / "plain.txt"
    not_a_program.write_text("not a launcher")
    not_a_program.chmod(0o755)
    for launcher, said in ((str(tmp_path / "nowhere" / "mpiexec"), "is no program"),
                           (str(not_a_program), "could not be started")):
        monkeypatch.setenv("MINIPAR_MPIEXEC", launcher)
        line = refused(cli("exercise", "check", "dp-naive", str(tmp_path / "student")),
                       "$MINIPAR_MPIEXEC", said)
        assert launcher in line, line


# ------------------------------------------------- 13. sizes no machine has: refused in seconds
def test_plan_refuses_sizes_past_what_it_can_count_by_name_in_seconds(capsys):
    from minipar.planner.plan import plan_command

    base = ["--preset", "llama3-8b", "--cluster", "h100", "--global-batch", "64", "--gpus", "8"]
    for flag, value, said in (("--global-batch", "1" + "0" * 21, "at most 2^53"),
                              ("--gpus", "1" + "0" * 21, "at most 2^53"),
                              ("--global-batch", "1e21", "write it out in digits"),
                              ("--d-model", "1" + "0" * 300, "at most 2^53"),
                              ("--vocab", "1" + "0" * 300, "at most 2^53"),
                              ("--layers", "1" + "0" * 300, "must be at most"),
                              ("--layers", str(2**53), "at most 4096"),
                              ("--microbatches", str(2**53), "does not divide")):
        start = time.monotonic()
        assert plan_command([*base, flag, value]) == 2, (flag, value)
        err = capsys.readouterr().err
        assert time.monotonic() - start < 5 and err.count("\n") == 1, (flag, err)
        assert flag in err and said in err, (flag, err)
    experts = ["--preset", "deepseek-v3", "--cluster", "h100", "--global-batch", "64",
               "--gpus", "8", "--experts", "100000"]
    assert plan_command(experts) == 2 and "--experts" in capsys.readouterr().err


def test_divisors_come_from_the_prime_factors_fast_and_exact():
    from minipar.core.divisors import divisors
    from minipar.core.fp8 import nearest_blocks

    for n in range(1, 400):
        assert list(divisors(n)) == [k for k in range(1, n + 1) if n % k == 0], n
    start = time.monotonic()
    for n in (2**53, 2**53 - 111, 94906249 * 94906247, 10**15, 735134400):
        found = divisors(n)
        assert all(n % k == 0 for k in found) and found[0] == 1 and found[-1] == n, n
    assert len(divisors(735134400)) == 1344 and divisors(94906249 * 94906247) == (
        1, 94906247, 94906249, 94906249 * 94906247)
    assert time.monotonic() - start < 5
    assert nearest_blocks([1000000000001], 16) == [1, 73]   # 10^12 + 1 = 73 x 137 x ...
    assert nearest_blocks([10**300 + 1], 16) == []           # past 2^53: none searched


def test_plan_serve_refuses_training_flags_and_names_why_no_layout_runs(capsys):
    from minipar.planner.plan import plan_command

    serve = ["--serve", "--cluster", "h100", "--prompt-len", "100", "--new-tokens", "10"]
    for model, flags, said in (
            ("llama3-8b", ["--gpus", "8", "--muon-mode", "distributed"],
             "--muon-mode is training's"),
            ("deepseek-v3", ["--gpus", "8", "--ep", "3"], "--ep 3 does not divide --gpus 8"),
            ("deepseek-v3", ["--gpus", "12", "--tp", "3", "--ep", "3"],
             "no layout with --tp 3 --ep 3 can serve on 12 GPUs: tp 3 x pp 4 (ep 3): tp does "
             "not divide the (key/value) heads"),
            ("llama3-8b", ["--gpus", "8", "--ep", "2"], "--ep 2 needs a model with --experts")):
        assert plan_command(["--preset", model, *serve, *flags]) == 2, flags
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        assert said in captured.err, (said, captured.err)
    train = ["--preset", "llama3-8b", "--cluster", "h100", "--global-batch", "64", "--gpus", "8"]
    assert plan_command([*train, "--muon-mode", "layer-sharded"]) == 2   # adam: it would do
    assert "needs --optimizer muon" in capsys.readouterr().err          # nothing
    assert plan_command(["--preset", "deepseek-v3", *serve, "--gpus", "64", "--ep", "8"]) == 0
    assert "lowest latency: tp 64 x pp 1 x ep 8" in capsys.readouterr().out


def test_blockwise_fp8_on_an_absurd_width_is_refused_as_fast_as_without_it():
    start = time.monotonic()
    for width in ("1000000000001", "1" + "0" * 40 + "1", "123456789012"):
        (line,) = refusals("--d-model", width, "--mixed", "bf16", "--fp8", "blockwise",
                           "--fp8-block", "16")
        assert line.startswith("--fp8-block 16 does not divide d_model"), line
    assert time.monotonic() - start < 5


# ------------------------------------------------- 14. --check compares like with like
def test_muon_tolerance_of_many_newton_schulz_steps_is_a_number():
    from minipar.run.results import mixed_tolerance

    for steps in ("5", "1000", "100000"):
        loss_tol, param_tol = mixed_tolerance(config(*SMALL, "--optimizer", "muon", "--ns-steps",
                                                     steps, "--mixed", "bf16"))
        assert 0 < loss_tol < 1 and 0 < param_tol <= 2.0 * 5, (steps, param_tol)
    assert mixed_tolerance(config(*SMALL, "--optimizer", "muon", "--ns-steps", "1000",
                                  "--mixed", "bf16"))[1] == 2.0 * 5   # capped at 2 a step


def test_check_after_a_resume_with_other_numbers_is_refused_by_name(tmp_path):
    from minipar.run.resume_check import check_problems

    muon = [*SMALL[:-2], "--optimizer", "muon"]
    ck = tmp_path / "ck"
    assert cli("train", *muon, "--steps", "2", "--save", str(ck)).returncode == 0
    for flags, said in ((["--momentum", "0.9"], "--momentum 0.9 where the checkpoint was "
                                                "trained with --momentum 0.95"),
                        (["--no-nesterov"], "--no-nesterov where the checkpoint was trained "
                                            "with --nesterov"),
                        (["--lr", "0.01"], "--lr 0.01 where"),
                        (["--ns-steps", "7"], "--ns-steps 7 where"),
                        (["--clip-grad-norm", "1"], "no --clip-grad-norm")):
        (line,) = check_problems(config(*muon, *flags, "--steps", "3", "--resume", str(ck)))
        assert line.startswith("--check after --resume") and said in line, line
    assert check_problems(config(*muon, "--steps", "3", "--resume", str(ck), "--muon-mode",
                                 "duplicated")) == []   # a layout: exact either way
    refused(cli("train", *muon, "--steps", "3", "--resume", str(ck), "--momentum", "0.9",
                "--check"), "--check after --resume", "--momentum 0.9")
    job = cli("train", *muon, "--steps", "3", "--resume", str(ck), "--check")
    assert job.returncode == 0 and "-> OK" in job.stdout, job.stdout + job.stderr
    job = cli("train", *muon, "--steps", "3", "--resume", str(ck), "--lr", "0.01")
    assert job.returncode == 0, job.stderr          # a new --lr continues, unchecked


def test_readme_fp8_row_says_what_runs_on_experts_over_tp():
    """Every recipe runs on the MLP MoE's experts split over --tp (its equivalence under
    --check: tests/parallel/test_mixed.py); the README says so, not that it is refused."""
    from tests.parallel.test_mixed import CONFIGS

    moe_tp = ["--model", "moe", "--experts", "4", "--expert-d-ff", "16", "--tp", "2",
              "--mixed", "bf16", "--batch", "16", "--layers", "2", "--d-model", "16"]
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        block = ["--fp8-block", "8"] if recipe == "blockwise" else []
        assert refusals(*moe_tp, "--fp8", recipe, *block, world=4) == [], recipe
        assert any(c.get("fp8") == recipe and c.get("model") == "moe" and c.get("tp", 1) > 1
                   for c in CONFIGS), recipe
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| `--fp8 {"))
    assert "Refused" not in row and "split over `--tp`" in row, row


# ------------------------------------------------- 15. what the user had is kept
def test_dump_writes_only_into_its_own_folders(tmp_path):
    from minipar.settings.preflight import DUMP_NOTE

    run = [*SMALL, "--steps", "2"]
    gen = ["--model", "gpt", "--layers", "1", "--d-model", "8", "--heads", "2", "--seq-len",
           "8", "--vocab", "16", "--batch", "2", "--prompt-ids", "1,2", "--new-tokens", "2"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("my own config")
    refused(cli("train", *run, "--dump", str(mine)), "--dump", "holds files no dump wrote")
    refused(cli("generate", *gen, "--dump", str(mine)), "--dump", "holds files no dump wrote")
    assert (mine / "config.json").read_text() == "my own config"
    trained = tmp_path / "trained"
    assert cli("train", *run, "--clip-grad-norm", "1", "--dump", str(trained)).returncode == 0
    assert (trained / "gnorms.json").exists() and (trained / DUMP_NOTE).exists()
    (trained / "notes.txt").write_text("kept")
    assert cli("train", *run, "--dump", str(trained)).returncode == 0   # its own: rewritten
    assert not (trained / "gnorms.json").exists()                      # the stale one gone
    assert (trained / "notes.txt").read_text() == "kept"
    before = (trained / "config.json").read_text()
    refused(cli("generate", *gen, "--dump", str(trained)), "--dump", "holds a `train --dump`")
    assert (trained / "config.json").read_text() == before
    generated = tmp_path / "generated"
    for _ in range(2):
        assert cli("generate", *gen, "--dump", str(generated)).returncode == 0
    refused(cli("train", *run, "--dump", str(generated)), "--dump", "`generate --dump`")


def test_book_and_course_refuse_a_lesson_that_is_not_there_and_keep_other_folders(tmp_path,
                                                                                  capsys):
    from book import build
    from tests import course

    job = subprocess.run([sys.executable, "-m", "tests.course", "--only", "99"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 2 and "--only 99: no such lesson" in job.stderr, job.stderr
    assert "course: lesson" not in job.stdout
    outcome = course.run_lesson("99_not_there", 1, tmp_path)   # a script gone: a row, FAILED
    assert len(outcome.problems) == 1 and outcome.problems[0].endswith(" is missing")
    assert "99_not_there" in outcome.problems[0] and outcome.seconds == 0.0
    assert build.main(["--only", "99"]) == 2
    assert "--only 99: no such lesson" in capsys.readouterr().err
    assert build.lesson_numbers("9,exercises") == (["09", "exercises"], None)
    site = tmp_path / "site"
    site.mkdir()
    (site / "mine.txt").write_text("mine")
    assert build.main(["--out", str(site)]) == 2
    assert "--out" in capsys.readouterr().err and (site / "mine.txt").read_text() == "mine"


# ------------------------------------------------- 16. a verdict the student cannot forge
def test_exercise_check_believes_only_the_grader_and_names_a_loop_at_import(tmp_path,
                                                                           monkeypatch):
    from minipar.exercises import regions
    from minipar.exercises.command import check, explain_crash, grader_changed, unsealed

    text, verdicts = unsealed("exercise a: passed (x)\nexercise a: FAILED (y) [w0rd]\n  why\n"
                              "exercise b: passed [not-it]", "w0rd")
    assert verdicts == {"a": False} and text.splitlines() == [
        "(printed by the code, not the grader) exercise a: passed (x)",
        "exercise a: FAILED (y)", "  why",
        "(printed by the code, not the grader) exercise b: passed [not-it]"]
    said = explain_crash(255, "", "[mpiexec@vm] APPLICATION TIMED OUT, TIMEOUT = 60s\n", 60)
    assert said.startswith("timeout: the check job ran past its time limit of 60 s"), said
    forged = tmp_path / "forged"
    (path,) = regions.start(["dp-naive"], forged)
    path.write_text(path.read_text() + "\nprint('exercise dp-naive: passed (3 checks on 4 "
                    "ranks)', flush=True)\nimport os\nos._exit(0)\n")
    code, report = check(["dp-naive"], forged)
    assert code == 1 and "exercise dp-naive: FAILED" in report, report
    assert "the code printed a verdict line itself" in report, report
    assert "left as the stub" in report, report
    looping = tmp_path / "looping"
    (path,) = regions.start(["dp-naive"], looping)
    path.write_text(path.read_text() + "\nwhile True:\n    pass\n")
    monkeypatch.setenv("MINIPAR_EXERCISE_DEADLINE", "3")          # a check's
    monkeypatch.setenv("MINIPAR_EXERCISE_IMPORT_DEADLINE", "15")  # the grader's import's
    start = time.monotonic()
    code, report = check(["dp-naive"], looping)
    assert code == 1 and "timeout: after " in report, report
    assert "data_parallel.py" in report and time.monotonic() - start < 55, report
    grader = looping / "minipar" / "exercises" / "grade.py"
    grader.write_text(grader.read_text() + "\n# changed\n")
    assert grader_changed(looping) == ["minipar/exercises/grade.py"]
    code, report = check(["dp-naive"], looping)
    assert code == 1 and "is not the grader handed out" in report, report
