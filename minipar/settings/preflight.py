"""Checks that need arithmetic or the file system, made before the first step.

What this file teaches: a run that will fail should fail *now*, not after an
hour of training (or after allocating 238 GiB on every rank). Three kinds of
check, each a pure function of the flags and of facts every rank sees alike
(the machine's total memory, the folders on disk), so every rank reaches the
same verdict without talking:

- memory: the bytes a rank will hold (the full model drawn at init, its own
  parameters, gradients and optimizer state, the activations kept for
  backward), times the ranks on this machine, against its physical memory;
- overflow: numbers that are finite but make a count no machine can hold
  (`--capacity-factor 1e308`);
- output folders: `--save`, `--dump`, `--plot` must name a folder this process can
  create files in, and not a file, and not "" (checked by `folder_problems`);
  `--trace` also not one holding another run's trace (`trace_problems`), `--flight`
  not the --trace folder nor one holding a trace (`flight_problems`); every path
  given (those and `--resume`) must not be a dangling link, a loop of links or a name
  longer than the file system takes (`path_problems`).

    python -m minipar train --d-model 1000000000     # refused: one line, the estimate
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minipar.settings.config import TrainConfig

GiB = 2 ** 30
NAME_MAX, PATH_MAX = 255, 4096   # Linux's limits on one name and on a whole path
EXACT = 2 ** 53          # floats count exactly up to here; a capacity beyond it is nonsense


def parameter_count(cfg: TrainConfig) -> int:
    """Elements of the full model (`nn.canonical_shapes`, in closed form: no loop over
    layers or experts, so --layers 10**9 costs nothing to count)."""
    d, L = cfg.d_model, cfg.layers
    gpt = cfg.model in ("gpt", "gpt-moe")
    if gpt:  # token and position tables; ln_f and the head over the vocabulary
        vocab = cfg.vocab or 0
        embed, head = (vocab + cfg.seq_len) * d, 2 * d + d * vocab + vocab
    else:
        embed, head = cfg.d_in * d + d, d * cfg.classes + cfg.classes
    if cfg.model in ("moe", "gpt-moe"):
        f = cfg.expert_d_ff
        block = 2 * d + d * cfg.experts + cfg.experts * (2 * d * f + f + d)
    else:
        f = cfg.d_ff
        block = 2 * d + 2 * d * f + f + d
    attention = 2 * d + 4 * (d * d + d) if gpt else 0   # ln1, q, k, v, proj
    return embed + L * (attention + block) + head


def activation_count(cfg: TrainConfig) -> int:
    """Elements a rank keeps for backward, at most: its rows of the batch (all its
    microbatches, as a pipeline may hold them) times what each block saves per row.
    The transformer's rows are its positions (T/cp of each sequence with context
    parallelism), each also keeping its attention probabilities (H T, an upper bound
    for the ring's blocks) and q, k, v, o (4 d), and its logits (V)."""
    gpt = cfg.model in ("gpt", "gpt-moe")
    rows = cfg.batch // max(1, cfg.dp) * (cfg.seq_len // max(1, cfg.cp) if gpt else 1)
    d = cfg.d_model
    if cfg.model in ("moe", "gpt-moe"):   # k expert copies of each row: fc1, GELU, fc2
        per_row = 4 * d + cfg.experts + cfg.top_k * (2 * cfg.expert_d_ff + d)
    else:                    # LayerNorm, fc1, GELU, fc2, residual
        per_row = 4 * d + 2 * cfg.d_ff
    if gpt:
        per_row += 2 * d + 4 * d + cfg.heads * cfg.seq_len
        return rows * (cfg.layers * per_row + 2 * (cfg.vocab or 0))
    return rows * (cfg.layers * per_row + cfg.d_in + cfg.classes)


def rank_bytes(cfg: TrainConfig) -> int:
    """An upper estimate of one rank's memory: the full model drawn at init, and as much
    again for its own parameters, their gradients, Adam's m and v (SGD: none), and the
    activations. Sharding (tp, pp, ep, ZeRO) only makes the real figure smaller."""
    itemsize = 4 if cfg.dtype == "float32" else 8
    slots = 2 if cfg.optimizer == "adam" else 0
    return itemsize * (parameter_count(cfg) * (3 + slots) + activation_count(cfg))


def machine_bytes() -> int:
    """This machine's physical memory (the same number on every rank)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 2 ** 62   # unknown: no refusal


def memory_problems(cfg: TrainConfig, world_size: int, total: int | None = None) -> list[str]:
    """One line when every rank of this machine together would need more than it has."""
    total = machine_bytes() if total is None else total
    per_rank = rank_bytes(cfg)
    if per_rank * world_size <= total:
        return []
    return [f"--d-model {cfg.d_model} --d-ff {cfg.d_ff} --layers {cfg.layers} --batch "
            f"{cfg.batch}: this run needs about {per_rank / GiB:.3g} GiB per rank "
            f"({parameter_count(cfg):.3g} parameters, {world_size} rank(s): "
            f"{per_rank * world_size / GiB:.3g} GiB) and this machine has "
            f"{total / GiB:.3g} GiB: make the model or the batch smaller"]


def overflow_problems(cfg: TrainConfig) -> list[str]:
    """Finite numbers whose products are not counts any more."""
    out = []
    if cfg.model in ("moe", "gpt-moe") and cfg.capacity_factor is not None:
        tokens = cfg.batch * (cfg.seq_len if cfg.model == "gpt-moe" else 1)
        slots = cfg.capacity_factor * cfg.top_k * tokens / cfg.experts
        if not math.isfinite(slots) or slots > EXACT:
            out.append(f"--capacity-factor {cfg.capacity_factor:g} makes an expert capacity of "
                       f"{slots:g} tokens (not a count); any factor from --experts / --top-k "
                       f"= {cfg.experts / cfg.top_k:g} up already keeps every token")
    return out


def path_problems(path: str | Path) -> list[str]:
    """What about the name `path` itself makes it unusable, whatever it is for: a name
    longer than the file system takes (one part, or the whole path), a symbolic link
    that points nowhere (dangling) or back at itself (a loop), here or in a parent.
    Pure reads of the file system (`lstat`, `readlink`): every rank agrees alone."""
    text = os.fspath(path)
    if len(os.fsencode(text)) >= PATH_MAX:
        return [f"{text[:40]}...: the path is {len(os.fsencode(text))} bytes long, more "
                f"than the {PATH_MAX - 1} a path may have"]
    for part in Path(text).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            return [f"{text[:40]}...: the name {part[:20]}... is {len(os.fsencode(part))} "
                    f"bytes long, more than the {NAME_MAX} a file name may have"]
    try:
        os.stat(text)
        return []
    except OSError as error:
        if error.errno == errno.ELOOP:
            return [f"{text}: a loop of symbolic links (one points back at itself)"]
        if error.errno == errno.ENAMETOOLONG:
            return [f"{text[:40]}...: the name is too long for this file system"]
        if error.errno != errno.ENOENT:
            return []   # ENOTDIR, EACCES, ...: the caller's own checks name them
    here = Path(text)
    for link in (here, *here.parents):   # the nearest part that is a link to nowhere
        if os.path.islink(link) and not os.path.exists(link):
            return [f"{text}: {link} is a symbolic link to {os.readlink(link)}, which does "
                    "not exist (dangling)"]
    return []


def folder_problems(folder: str | Path) -> list[str]:
    """Why files cannot be written into `folder`: an empty name, an unusable name
    (`path_problems`: too long, a dangling link, a loop), a file in the way (the folder
    itself or a parent), a parent where this process cannot create files."""
    if isinstance(folder, str) and folder.strip() == "":   # (Path("") would mean ".")
        return ["needs a folder name (got an empty one)"]
    unusable = path_problems(folder)
    if unusable:
        return unusable
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return [f"{folder}: exists and is not a folder"]
    parent = folder
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return [f"{folder}: {parent} is a file, not a folder"]
    try:   # really try: os.access says yes to root on a read-only mount
        handle, probe = tempfile.mkstemp(prefix=".minipar-probe-", dir=parent)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        return [f"{folder}: {parent} is not writable ({error.strerror})"]
    return []


def file_problems(path: str | Path) -> list[str]:
    """Why a file cannot be written at `path` (e.g. `plan --json PATH`), found before the
    work that fills it: an unusable name (`path_problems`), a folder in its place, a
    missing parent, a parent this process cannot create files in."""
    if isinstance(path, str) and path.strip() == "":
        return ["needs a file name (got an empty one)"]
    unusable = path_problems(path)
    if unusable:
        return unusable
    path = Path(path)
    if path.is_dir():
        return [f"{path}: is a folder, not a file"]
    if not path.parent.is_dir():
        return [f"{path}: no folder {path.parent} to write it in"]
    if path.exists() and not os.access(path, os.W_OK):
        return [f"{path}: exists and is not writable"]
    try:   # really try, as folder_problems does
        handle, probe = tempfile.mkstemp(prefix=".minipar-probe-", dir=path.parent)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        return [f"{path}: {path.parent} is not writable ({error.strerror})"]
    return []


def trace_problems(folder: str) -> list[str]:
    """Why `--trace folder` cannot be written (trace.py), before the first step: a file in
    the way, a folder this process cannot create files in, or one holding another run's
    trace (its files would be mixed with this run's, and the merged one replaced)."""
    from minipar.comm.trace import trace_files

    found = [f"--trace {message}" for message in folder_problems(folder)]
    if not found and Path(folder).is_dir():
        held = trace_files(Path(folder))
        if held:
            what = "the flight recorder's dumps of a job" if all(
                _is_dump(Path(folder) / name) for name in held) else "the trace of another run"
            found.append(f"--trace {folder}: holds {what} ({held[0]}): give an empty or "
                         "new folder")
    return found


def flight_problems(folder: str | None, trace: str | None) -> list[str]:
    """Why `--flight folder` cannot take the flight recorder's dumps (flight.py): an
    unusable folder, the `--trace` folder itself (both write rank{r}.json: each would
    overwrite the other's), or a folder holding a trace. A folder holding an earlier
    job's dumps is not refused: the new ones go beside it (`flight.fresh_folder`)."""
    if folder is None:
        return []
    found = [f"--flight {message}" for message in folder_problems(folder)]
    if not found and trace is not None and \
            os.path.abspath(folder) == os.path.abspath(trace):
        found.append(f"--flight {folder} is also the --trace folder: both write "
                     "rank{r}.json there, each over the other's; give two folders")
    if not found and Path(folder).is_dir():
        from minipar.comm.trace import trace_files

        traced = [name for name in trace_files(Path(folder)) if not _is_dump(
            Path(folder) / name)]
        if traced:
            found.append(f"--flight {folder}: holds the trace of a run ({traced[0]}), "
                         "which a dump would overwrite: give another folder")
    return found


def _is_dump(path: Path) -> bool:
    """A flight dump by its first bytes (flight.py writes {"format": "minipar-flight
    1", ...}); a trace file starts {"traceEvents": ...}. Reading a whole trace to tell
    them apart could take seconds."""
    try:
        with open(path, "rb") as handle:
            return handle.read(40).startswith(b'{"format": "minipar-flight')
    except OSError:
        return False


def output_problems(flags: dict[str, str | None]) -> list[str]:
    """`folder_problems` of every output flag given (`{"--dump": path, ...}`)."""
    return [f"{flag} {message}" for flag, path in flags.items() if path is not None
            for message in folder_problems(path)]


# ------------------------------------------------------------ --dump DIR: whose files
# What each command's `--dump DIR` writes (docs/design.md, "The train command",
# "Inference"), and the note beside them that says a dump wrote them: a folder holding
# anything else is the user's, and a dump never overwrites it.
DUMP_FILES = {"train": ("init.npz", "final.npz", "data.npz", "losses.json", "gnorms.json",
                        "config.json", "ledger.json", "ledger_steps.json",
                        "fragment_sizes.json"),
              "generate": ("params.npz", "config.json", "tokens.json", "logits.npz")}
DUMP_NOTE = ".minipar-dump.json"


def dump_owner(folder: Path) -> tuple[str | None, list[str]]:
    """(the command whose `--dump` wrote `folder`, the files it wrote), from its note;
    (None, []) without a readable note."""
    import json

    try:
        note = json.loads((folder / DUMP_NOTE).read_text())
        return str(note["command"]), [str(name) for name in note["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None, []


def dump_problems(folder: str | None, command: str) -> list[str]:
    """Why `command --dump folder` would overwrite what it must not (after
    `folder_problems`): a folder is written into when it is new or empty, or holds an
    earlier dump of the same command (its note says so, and names its files: those are
    replaced, nothing else is touched). Refused: a folder with files no dump wrote among
    the names this dump writes, or with no note at all and anything in it, or another
    command's dump (`generate`'s config.json is not `train`'s)."""
    if folder is None:
        return []
    problems = output_problems({"--dump": folder})
    path = Path(folder)
    if problems or not path.is_dir():
        return problems
    present = sorted(entry.name for entry in path.iterdir())
    if not present:
        return []
    owner, written = dump_owner(path)
    shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3
                                      else "")
    if owner is None:
        return [f"--dump {folder}: holds files no dump wrote ({shown}): --dump writes into "
                "a new or empty folder, or one an earlier --dump of the same command wrote; "
                "give another folder"]
    if owner != command:
        return [f"--dump {folder}: holds a `{owner} --dump` ({', '.join(written[:3])}...): "
                f"`{command} --dump` would overwrite its config.json; give another folder"]
    theirs = [name for name in DUMP_FILES[command] if name in present and name not in written]
    if theirs:
        return [f"--dump {folder}: {theirs[0]} there is not the earlier dump's (its note "
                f"lists {', '.join(written)}): it would be overwritten; give another folder"]
    return []


def sign_dump(folder: Path, command: str, written: list[str]) -> None:
    """After `command --dump` wrote `written` into `folder`: remove the files of the earlier
    dump this one did not write again (a gnorms.json of a run with --clip-grad-norm), and
    write the note that says which files the dump wrote."""
    import json

    _, before = dump_owner(folder)
    for name in before:
        if name not in written and name in DUMP_FILES.get(command, ()):
            (folder / name).unlink(missing_ok=True)
    (folder / DUMP_NOTE).write_text(json.dumps({"command": command, "files": written}) + "\n")


def lesson_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """A lesson's `parser.parse_args()`, with its `--plot DIR` checked at once (a file, a
    read-only folder, a dangling link: `folder_problems`), not after the lesson
    ran: a ConfigError, which `run_collectively` turns into one line from rank 0."""
    from minipar.settings.config import ConfigError  # the layer below; imported here, when used

    args = parser.parse_args()
    if getattr(args, "plot", None) is not None:
        problems = folder_problems(args.plot)
        if problems:
            raise ConfigError(f"--plot {problems[0]}")
    return args
