"""The marked regions of the source, and the stubs cut from them.

A region is the lines between `# exercise: NAME` and `# end exercise`, both at the
indentation of the code they hold. Its stub keeps the two markers and puts, in
place of the code, the instructions as a comment and one `raise
NotImplementedError(...)` carrying them, so a student sees the task both where
they write and in the traceback. Markers are plain comments: the library runs
unchanged with them in. `compare` reads a student's regions back and tells which one
is still the stub and which one is the reference answer itself, by their syntax trees
(so neither spacing nor comments hide a copy). The answer's tree is kept as a digest in
the started folder's record: `check` run inside that folder imports the student's own
package, whose regions are no reference, and a digest tells nothing of the answer.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

from minipar.exercises import BY_NAME, get

PACKAGE = Path(__file__).resolve().parent.parent   # the minipar package folder
RECORD = "exercise.json"   # in a started folder: which exercises it holds
START = re.compile(r"^(\s*)# exercise: ([\w-]+)\s*$")
END = re.compile(r"^(\s*)# end exercise\s*$")


@dataclass(frozen=True)
class Region:
    """Lines [first, last) of `path` (relative to the package) hold the code of `name`."""

    name: str
    path: str
    first: int
    last: int
    indent: str


def find_regions(package: Path = PACKAGE) -> list[Region]:
    """Every marked region of the package's .py files, in file and line order. Raises
    ValueError on a marker that does not close, nests, names no exercise, or whose end
    sits at another indentation than its start."""
    regions: list[Region] = []
    for path in sorted(package.rglob("*.py")):
        relative = str(path.relative_to(package))
        open_at: tuple[int, str, str] | None = None
        for number, line in enumerate(path.read_text().splitlines()):
            where = f"{relative}:{number + 1}"
            if (start := START.match(line)) is not None:
                if open_at is not None:
                    raise ValueError(f"{where}: an exercise region opens inside another")
                if start.group(2) not in BY_NAME:
                    raise ValueError(f"{where}: no exercise called {start.group(2)!r}")
                open_at = (number, start.group(1), start.group(2))
            elif (end := END.match(line)) is not None:
                if open_at is None:
                    raise ValueError(f"{where}: '# end exercise' without its start")
                if end.group(1) != open_at[1]:
                    raise ValueError(f"{where}: '# end exercise' indented unlike its start")
                regions.append(Region(open_at[2], relative, open_at[0] + 1, number, open_at[1]))
                open_at = None
        if open_at is not None:
            raise ValueError(f"{relative}:{open_at[0] + 1}: exercise {open_at[2]!r} never ends")
    return regions


def regions_of(name: str, package: Path = PACKAGE) -> list[Region]:
    """The regions of one exercise; a ValueError if it has none (its markers were lost)."""
    get(name)
    found = [region for region in find_regions(package) if region.name == name]
    if not found:
        raise ValueError(f"exercise {name!r} has no marked region in {package}")
    return found


def stub_lines(region: Region) -> list[str]:
    """What replaces the region's code: the instructions, then the raise."""
    text = f"exercise {region.name}: {get(region.name).instructions}"
    width = max(40, 96 - len(region.indent))
    comment = [f"{region.indent}# {line}" for line in textwrap.wrap(text, width - 2)]
    return [*comment, f"{region.indent}raise NotImplementedError({text!r})"]


def normalized(lines: list[str]) -> str:
    """The code of a region's lines as its syntax tree (`ast.dump`, dedented first), so
    that two regions compare equal whatever their spacing, comments, line breaks or
    quotes; their lines, stripped and without blank or comment lines, if they do not
    parse on their own."""
    code = textwrap.dedent("\n".join(lines))
    try:
        return ast.dump(ast.parse(code))
    except SyntaxError:
        return "\n".join(line.strip() for line in code.splitlines()
                         if line.strip() and not line.strip().startswith("#"))


def digest(code: str) -> str:
    """A short digest of a region's normalized code: enough to recognize a copy of the
    answer, nothing to read it from."""
    return hashlib.blake2b(code.encode(), digest_size=16).hexdigest()


def region_lines(region: Region, package: Path = PACKAGE) -> list[str]:
    """The lines a region holds in `package` (without its two markers)."""
    return (package / region.path).read_text().splitlines()[region.first:region.last]


def compare(name: str, folder: Path, package: Path = PACKAGE) -> list[tuple[Region, str]]:
    """(the student's region, what it is) for each region of exercise `name` in
    folder/minipar: "stub" if it is still the stub `start` wrote, "copied" if it is the
    reference answer (the package's own code), as `normalized` sees them, else "written".
    The student's regions pair with the package's in order; a copy whose markers were
    moved, removed or broken pairs with nothing: the list is empty."""
    try:
        theirs = regions_of(name, folder / "minipar")
    except (ValueError, OSError, UnicodeDecodeError):
        return []
    recorded = answers_of(folder).get(name)
    if recorded is None:   # a copy made by hand: the package's own regions are the answer
        ours = regions_of(name, package)
        if [r.path for r in theirs] != [r.path for r in ours]:
            return []
        recorded = [(r.path, digest(normalized(region_lines(r, package)))) for r in ours]
    if [r.path for r in theirs] != [path for path, _ in recorded]:
        return []
    found = []
    for mine, (_, answer) in zip(theirs, recorded):
        code = normalized(region_lines(mine, folder / "minipar"))
        if code == normalized(stub_lines(mine)):
            found.append((mine, "stub"))
        elif digest(code) == answer:
            found.append((mine, "copied"))
        else:
            found.append((mine, "written"))
    return found


def answers_of(folder: Path) -> dict[str, list[tuple[str, str]]]:
    """name -> [(path, digest of the answer's code)] as `start` recorded them ({} for a
    folder without a record, or an older one)."""
    try:
        answers = json.loads((folder / RECORD).read_text()).get("answers", {})
        return {str(k): [(str(p), str(d)) for p, d in v] for k, v in answers.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def solution(name: str, package: Path = PACKAGE) -> str:
    """The reference solution: the project's own code of every region, with where it is."""
    parts = []
    for region in regions_of(name, package):
        lines = region_lines(region, package)
        parts.append(f"# minipar/{region.path}, lines {region.first + 1}-{region.last}\n"
                     + textwrap.dedent("\n".join(lines)))
    return "\n\n".join(parts)


def start(names: list[str], folder: Path, package: Path = PACKAGE) -> list[Path]:
    """Copy the package into folder/minipar with the regions of `names` stubbed; write
    folder/EXERCISE.txt (the task, where, how to check it and how to ask for a hint, but
    not the hint) and folder/exercise.json (the names and a digest of each answer,
    which `started_for` reads back so that check grades only these). Returns the files
    that hold a stub."""
    from minipar.settings.preflight import folder_problems  # a file, /dev/null, a dangling link...

    unusable = folder_problems(folder)
    if unusable:
        raise ValueError(f"start {unusable[0]}")
    target = folder / "minipar"
    if target.exists():
        raise ValueError(f"{target} exists already: start an exercise in a new folder")
    if (folder / "EXERCISE.txt").exists():   # never overwrite a file we did not write
        raise ValueError(f"{folder / 'EXERCISE.txt'} exists already (not written by "
                         "exercise start): start an exercise in a new folder")
    if (folder / RECORD).exists():
        raise ValueError(f"{folder / RECORD} exists already: start an exercise in a new "
                         "folder")
    regions = [region for name in names for region in regions_of(name, package)]
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    by_file: dict[str, list[Region]] = {}
    for region in regions:
        by_file.setdefault(region.path, []).append(region)
    for path, in_file in by_file.items():
        lines = (package / path).read_text().splitlines()
        for region in sorted(in_file, key=lambda r: r.first, reverse=True):  # from the end
            lines[region.first:region.last] = stub_lines(region)
        (target / path).write_text("\n".join(lines) + "\n")
    sheet = []
    for name in names:
        exercise = get(name)
        where = ", ".join(sorted({f"minipar/{r.path}" for r in regions if r.name == name}))
        steps = len(exercise.hint_steps())
        sheet.append(f"# {exercise.title} (`{name}`)\n\n{exercise.instructions}\n\n"
                     f"Where: {where}\n\nCheck: `python -m minipar exercise check {name} .`\n\n"
                     f"Stuck? `python -m minipar exercise hint {name}` gives a first hint; "
                     f"`--step 2` ... `--step {steps}` say more, one step at a time.\n")
    (folder / "EXERCISE.txt").write_text("\n".join(sheet))
    answers = {name: [(r.path, digest(normalized(region_lines(r, package))))
                      for r in regions_of(name, package)] for name in names}
    (folder / RECORD).write_text(json.dumps({"exercises": list(names), "answers": answers})
                                 + "\n")
    return [target / path for path in by_file]


def started_for(folder: Path) -> list[str] | None:
    """The exercises `start` wrote into folder/exercise.json, or None for a folder without
    that record (a copy of the package made by hand): check grades a started folder only
    for the exercises it was started for, since the others are not stubbed there."""
    record = folder / RECORD
    if not record.is_file():
        return None
    try:
        names = json.loads(record.read_text())["exercises"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{record} is not the record exercise start writes: "
                         "start an exercise in a new folder") from None
    return [str(name) for name in names]
