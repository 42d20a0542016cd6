"""Every bad setting is refused before any communication: one line, exit 2, every rank.

The table below is run twice. All of it in ONE mpiexec job of 4 ranks
(`tests/harness/rank_faults.py settings`: each rank calls the command line in-process
for every case and records its exit code and output), which checks each rank
separately; and a few cases through `mpiexec ... python -m minipar train`
itself, which checks what a user sees: the launcher's exit code and stderr.

A case must: exit 2 on every rank; print exactly one line, on rank 0's stderr,
starting `minipar: error:` and naming the flag; print no traceback; take
seconds.

    python -m pytest tests/run/test_config_errors.py
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from minipar.checkpoint import shard_files
from tests.harness.mpi import launch, minipar

WORLD = 4
SMALL = ["--layers", "2", "--d-model", "16", "--batch", "16", "--steps", "1"]
# (flags after SMALL, the flag the error line must name). Paths in braces come from the
# `folders` fixture: a good checkpoint saved at step 2 with Adam, and damaged copies.
CASES = [
    (["--dp", "3"], "--dp"),                                         # mesh does not fill world
    (["--tp", "3"], "--tp"),                                         # tp does not divide world
    (["--tp", "4", "--d-ff", "30"], "--tp"),                         # tp does not divide d_ff
    (["--pp", "4", "--layers", "6"], "--pp"),                        # pp does not divide layers
    (["--microbatches", "3"], "--microbatches"),                     # 16/4 = 4 rows per rank
    (["--batch", "18"], "--batch"),                                  # batch does not split by dp
    (["--model", "moe", "--ep", "3"], "--ep"),                       # ep does not divide dp
    (["--model", "moe", "--experts", "6", "--ep", "4"], "--ep"),     # ep does not divide E
    (["--model", "moe", "--experts", "2", "--top-k", "3"], "--top-k"),
    (["--dp", "2", "--pp", "2", "--schedule", "interleaved", "--virtual", "3",
      "--microbatches", "2"], "--virtual"),                          # 2 layers, 6 stages
    (["--virtual", "2"], "--virtual"),                               # needs interleaved
    (["--schedule", "zigzag"], "--schedule"),
    (["--layers", "-2"], "--layers"),
    (["--batch", "0"], "--batch"),
    (["--dp", "0"], "--dp"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "-0.1"], "--lr"),
    (["--aux-coef=-inf"], "--aux-coef"),
    (["--model", "moe", "--capacity-factor", "0"], "--capacity-factor"),
    # DeepSeek-V3 routing (minipar/core/routing.py)
    (["--model", "moe", "--route-groups", "4", "--route-top-groups", "5"],
     "--route-top-groups"),                                          # M > G
    (["--model", "moe", "--experts", "6", "--route-groups", "4"], "--route-groups"),
    (["--model", "moe", "--top-k", "4", "--route-groups", "4", "--route-top-groups", "1"],
     "--top-k"),                                                     # 4 > the 2 experts of M
    (["--model", "moe", "--router", "sigmoid-bias", "--aux-coef", "0.01"], "--aux-coef"),
    (["--model", "moe", "--router", "sigmoid-bias", "--bias-rate=-0.001"], "--bias-rate"),
    (["--model", "moe", "--bias-rate", "0.01"], "--bias-rate"),      # softmax has no b
    (["--shared-experts", "1"], "--shared-experts"),                 # a dense model
    (["--steps", "two"], "--steps"),
    (["--zero", "4"], "--zero"),
    (["--dtype", "float16"], "--dtype"),
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--resume", "{missing}", "--steps", "4"], "--resume"),
    (["--resume", "{unfinished}", "--steps", "4"], "--resume"),      # shards, no manifest
    (["--resume", "{truncated}", "--steps", "4"], "--resume"),
    (["--resume", "{tampered}", "--steps", "4"], "--resume"),
    (["--resume", "{garbled}", "--steps", "4"], "--resume"),         # manifest not JSON
    (["--resume", "{good}", "--steps", "4", "--optimizer", "adam", "--d-model", "32"],
     "--d-model"),
    (["--resume", "{good}", "--steps", "4", "--optimizer", "sgd"], "--optimizer"),
    (["--resume", "{good}", "--steps", "2", "--optimizer", "adam"], "--steps"),  # no step left
    (["--save", "{a_file}"], "--save"),
    (["--model", "moe", "--tp", "2", "--sp"], "--sp"),              # SP splits dense rows
    # resuming on another data stream or model: the flag that differs is named
    (["--resume", "{good}", "--steps", "4", "--optimizer", "adam", "--seed", "5"], "--seed"),
    (["--resume", "{good}", "--steps", "4", "--optimizer", "adam", "--batch", "32"], "--batch"),
    # a hand-edited manifest: caught by its own checksum, or (re-sealed) by its structure
    (["--resume", "{t_edited}", "--steps", "4", "--optimizer", "adam"], "--resume"),
    (["--resume", "{losses_edited}", "--steps", "4", "--optimizer", "adam"], "--resume"),
    (["--resume", "{files_a_list}", "--steps", "4", "--optimizer", "adam"], "--resume"),
    (["--resume", "{shape_edited}", "--steps", "4", "--optimizer", "adam"], "--resume"),
    # outputs that cannot be written, found before the first step (not after the last)
    (["--save", "{locked}"], "--save"),                              # another live job's
    (["--save", "{a_file}/sub"], "--save"),
    (["--save", ""], "--save"),
    (["--resume", ""], "--resume"),
    (["--dump", ""], "--dump"),
    (["--dump", "{a_file}"], "--dump"),
    (["--dump", "{a_file}/sub"], "--dump"),
    (["--keep", "0"], "--keep"),
    (["--timeout", "-1"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    # sizes this machine cannot hold, numbers whose products are not counts
    (["--d-model", "1000000000"], "--d-model"),
    (["--layers", "1000000000"], "--layers"),
    (["--model", "moe", "--experts", "4", "--capacity-factor", "1e308"], "--capacity-factor"),
    (["--model", "gpt", "--heads", "3"], "--heads"),                 # 3 does not divide d = 16
    (["--model", "gpt", "--heads", "0"], "--heads"),
    (["--model", "gpt", "--seq-len", "1"], "--seq-len"),             # nothing to predict
    (["--model", "gpt", "--vocab", "1"], "--vocab"),
    (["--model", "gpt", "--data", "{missing}"], "--data"),
    (["--model", "gpt", "--data", "{empty}"], "--data"),
    (["--model", "gpt", "--data", "{short}"], "--data"),             # fewer than T+1 bytes
    (["--model", "gpt", "--data", "{good}"], "--data"),              # a folder
    (["--model", "gpt", "--data", "{text}", "--vocab", "64"], "--vocab"),  # bytes: V = 256
    (["--model", "gpt", "--d-in", "8"], "--d-in"),                   # reads token ids
    (["--model", "gpt", "--classes", "5"], "--classes"),
    (["--model", "gpt", "--tp", "4", "--heads", "2"], "--heads"),    # whole heads per rank
    (["--model", "gpt", "--ep", "2"], "--ep"),                       # no experts
    (["--model", "moe", "--tp", "2", "--expert-d-ff", "9"], "--tp"),  # splits each expert
    (["--heads", "2"], "--heads"),                                   # the MLP has no heads
    (["--data", "{text}"], "--data"),
    (["--model", "gpt", "--tp", "4", "--vocab", "30"], "--vocab"),  # vocab-parallel rows
    (["--model", "gpt", "--tp", "4", "--sp", "--seq-len", "6"], "--seq-len"),  # T/tp positions
    (["--model", "gpt", "--vocab-parallel"], "--vocab-parallel"),   # nothing to split over
    (["--vocab-parallel"], "--vocab-parallel"),                     # the MLP has no vocabulary
    (["--recompute", "selective"], "--recompute"),                  # the MLP has no attention
    (["--recompute", "half"], "--recompute"),
    (["--model", "gpt", "--cp", "4", "--cp-mode", "ring", "--seq-len", "6"], "--seq-len"),
    (["--model", "gpt", "--cp", "2", "--seq-len", "6"], "--seq-len"),  # zigzag: 2 cp chunks
    (["--model", "gpt", "--cp", "4", "--cp-mode", "ulysses", "--heads", "2"], "--cp"),
    (["--model", "gpt", "--cp", "2", "--tp", "2", "--sp", "--cp-mode", "ring",  # T/cp = 3
      "--seq-len", "6"], "--sp"),                                    # is not split over tp 2
    (["--model", "gpt", "--cp", "3"], "--cp"),                       # does not fill 4 ranks
    (["--model", "gpt", "--cp", "0"], "--cp"),
    (["--model", "gpt", "--cp-mode", "star"], "--cp-mode"),
    (["--cp", "2"], "--cp"),                                         # the MLP has no sequence
    (["--model", "moe", "--cp-mode", "ring"], "--cp-mode"),
    (["--model", "gpt", "--cp", "2", "--tp", "2", "--cp-mode", "ulysses",  # 2 heads / tp 2:
      "--heads", "2"], "--cp"),                                      # 1 head for cp 2
    # the V schedules (zb-v, dualpipev): a pipeline, two chunks per rank, M >= 2 pp
    (["--schedule", "zb-v"], "--pp"),                                # a V needs a pipeline
    (["--dp", "2", "--pp", "2", "--schedule", "zb-v"], "--layers"),  # 2 layers, 4 chunks
    (["--dp", "2", "--pp", "2", "--layers", "4", "--schedule", "dualpipev",
      "--microbatches", "2"], "--microbatches"),                     # needs M >= 2 pp
    # DualPipe: an even pipeline, an even M >= 2 pp, its two copies summed outside ZeRO
    (["--schedule", "dualpipe"], "even --pp"),                      # pp 1 here, 3 elsewhere
    (["--dp", "2", "--pp", "2", "--layers", "4", "--schedule", "dualpipe",
      "--microbatches", "2"], "--microbatches"),                     # needs M >= 2 pp
    (["--dp", "2", "--pp", "2", "--layers", "4", "--schedule", "dualpipe",
      "--microbatches", "4", "--zero", "1"], "--zero 0"),
    # DiLoCo (parallel/diloco.py): what it cannot run
    (["--outer", "diloco", "--inner-steps", "1", "--zero", "1"], "--zero"),
    (["--model", "moe", "--outer", "diloco", "--inner-steps", "1", "--ep", "2"], "--ep"),
    (["--outer", "diloco", "--inner-steps", "2"], "--inner-steps"),  # 1 step: not a multiple
    (["--outer", "diloco", "--inner-steps", "1", "--fragments", "3"], "--fragments"),  # L = 2
    (["--outer", "diloco", "--inner-steps", "1", "--fragments", "2"], "--fragments"),  # H = 1
    (["--outer", "diloco"], "--inner-steps"),                        # H has no default
    (["--inner-steps", "2"], "--inner-steps"),                       # without --outer
    (["--outer", "diloco", "--inner-steps", "1", "--outer-momentum", "1"], "--outer-momentum"),
    (["--outer", "diloco", "--inner-steps", "1", "--optimizer", "adam", "--resume", "{good}",
      "--steps", "4"], "--resume"),                                  # plain DP's checkpoint
    # gradient clipping (clip.py) and ragged documents (documents.py)
    (["--clip-grad-norm", "0"], "--clip-grad-norm"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm"),
    (["--clip-grad-norm", "nan"], "--clip-grad-norm"),
    (["--clip-grad-norm", "inf"], "--clip-grad-norm"),
    (["--model", "gpt", "--documents"], "--documents"),             # no --data to read
    (["--model", "gpt", "--data", "{one_byte_documents}", "--documents"], "--documents"),
    (["--documents"], "--documents"),                                # the MLP reads rows
    # mixed precision (core/precision.py, parallel/mixed.py)
    (["--mixed", "fp8"], "--mixed"),                                 # not a 16-bit format
    (["--mixed", "fp16", "--loss-scale", "0"], "--loss-scale"),
    (["--mixed", "fp16", "--loss-scale", "1000"], "--loss-scale"),   # not a power of two
    (["--mixed", "fp16", "--loss-scale-window", "0"], "--loss-scale-window"),
    (["--grad-reduce-dtype", "low"], "--grad-reduce-dtype"),         # without --mixed
    (["--mixed", "bf16", "--loss-scale", "1024"], "--loss-scale"),   # bf16 has no scaling
    (["--mixed", "bf16", "--dp", "2", "--inject-bug", "dp-sum-not-mean"], "--inject-bug"),
    # masters saved in float64, this run's in float32
    (["--mixed", "bf16", "--dtype", "float32", "--optimizer", "adam", "--resume", "{good}",
      "--steps", "4"],
     "--dtype"),
    (["--mixed", "bf16", "--optimizer", "adam", "--resume", "{good}", "--steps", "4"],
     "--mixed"),                                                     # saved in full
]
# Through the real launcher, at several world sizes: (ranks, case index).
END_TO_END = [(4, 0), (2, 11), (1, 15), (2, 27), (2, 42), (2, 50), (2, 52), (2, 58),
              (2, len(CASES) - 13),   # --clip-grad-norm nan
              (2, len(CASES) - 8),    # --mixed fp8
              (2, len(CASES) - 2)]    # --resume with masters of another --dtype


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A good checkpoint (dp=2, Adam, step 2) and damaged copies of it."""
    root = tmp_path_factory.mktemp("bad_checkpoints")
    good = root / "good"
    job = minipar(2, ["train", *SMALL, "--steps", "2", "--dp", "2", "--optimizer", "adam",
                      "--save", str(good)], 60)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    paths = {"good": good, "missing": root / "missing", "new": root / "new",
             "a_file": root / "a_file", "empty": root / "empty.txt",
             "short": root / "short.txt", "text": root / "text.txt"}
    paths["a_file"].write_text("not a folder")
    paths["empty"].write_text("")
    paths["short"].write_text("ten bytes!")                   # T + 1 = 33 are needed
    paths["text"].write_text("a text long enough for windows of 33 bytes. " * 4)
    paths["one_byte_documents"] = root / "one_byte_documents.txt"   # none of 2 bytes
    paths["one_byte_documents"].write_text("a\n\nb\n \n\nc\n")
    for name in ("unfinished", "truncated", "tampered", "garbled"):
        paths[name] = root / name
        shutil.copytree(good, paths[name])
    step = shard_files.resolve(good).name          # the step folder `latest` names
    (paths["unfinished"] / "latest").unlink()     # as if the save died before the switch
    shard = paths["truncated"] / step / shard_files.shard_name(0, 2)
    shard.write_bytes(shard.read_bytes()[:-1])
    shard = paths["tampered"] / step / shard_files.shard_name(0, 2)
    data = bytearray(shard.read_bytes())
    data[-200] ^= 0xFF
    shard.write_bytes(bytes(data))
    (paths["garbled"] / step / "manifest.json").write_text('{"format": "minipar-checkp')
    edits = {"t_edited": ("optimizer_t", 9, False), "losses_edited": ("losses", [0.0, 0.0], False),
             "files_a_list": ("files", None, True), "shape_edited": ("shapes", None, True)}
    for name, (key, value, reseal) in edits.items():
        paths[name] = root / name
        shutil.copytree(good, paths[name])
        path = paths[name] / step / "manifest.json"
        manifest = json.loads(path.read_text())
        if key == "files":
            manifest["files"] = sorted(manifest["files"])
        elif key == "shapes":
            manifest["shapes"]["head.weight"] = [16, 11]
        else:
            manifest[key] = value
        path.write_text(json.dumps(shard_files.seal(manifest) if reseal else manifest))
    paths["locked"] = root / "locked"      # held by this (live) pytest process
    paths["locked"].mkdir()
    (paths["locked"] / ".lock").write_text(json.dumps(
        {"token": "t", "pid": os.getpid(), "host": socket.gethostname(), "since": "now"}))
    return paths


def case_flags(index: int, folders: dict[str, Path]) -> list[str]:
    flags, _ = CASES[index]
    return [*SMALL, *(f.format(**{k: str(v) for k, v in folders.items()}) for f in flags)]


@pytest.fixture(scope="module")
def in_one_job(folders, tmp_path_factory):
    """Every case on every rank of one 4-rank job: {rank: [result per case]}."""
    out = tmp_path_factory.mktemp("settings")
    spec = out / "cases.json"
    spec.write_text(json.dumps([case_flags(i, folders) for i in range(len(CASES))]))
    job = launch(WORLD, ["-m", "tests.harness.rank_faults", "settings", str(spec), str(out)], 120)
    assert job.returncode == 0 and not job.timed_out, job.explain()
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)}


def assert_one_error_line(stderr: str, named: str, context: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, context
    assert lines[0].startswith("minipar: error:"), context
    assert named in lines[0], context                           # the line names the flag


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[" ".join(flags) for flags, _ in CASES])
def test_every_rank_refuses(in_one_job, index):
    _, named = CASES[index]
    results = [in_one_job[rank][index] for rank in range(WORLD)]
    context = json.dumps(results, indent=1)
    assert [r["code"] for r in results] == [2] * WORLD, context
    assert_one_error_line(results[0]["stderr"], named, context)
    assert all(r["stderr"] == "" for r in results[1:]), context   # only rank 0 speaks
    assert all(r["stdout"] == "" for r in results), context       # nothing ran
    assert all("Traceback" not in r["stderr"] for r in results), context
    assert max(r["seconds"] for r in results) < 5, context


@pytest.mark.parametrize("ranks,index", END_TO_END,
                         ids=[f"{n} ranks: {' '.join(CASES[i][0])}" for n, i in END_TO_END])
def test_the_launcher_reports_it(folders, ranks, index):
    start = time.monotonic()
    job = minipar(ranks, ["train", *case_flags(index, folders)], 60)
    assert not job.timed_out and time.monotonic() - start < 30, job.explain()
    assert job.returncode == 2, job.explain()
    assert_one_error_line(job.stderr, CASES[index][1], job.explain())
    assert "Traceback" not in job.stdout + job.stderr and job.stdout == "", job.explain()


def test_the_table_is_large_enough():
    assert len(CASES) >= 15 and len({named for _, named in CASES}) >= 15
