"""Every module, file and function the words name exists.

A reader follows a name: a docstring that says `schedules.replay`, an exercise prompt that
says "Write schedules.one_f_one_b_order", a page of the book that says
`minipar/parallel/pipeline/executor.py`. When code moves between files, the code is
checked by its imports and the words are not; this file checks the words. It reads the
prose of minipar/, lessons/, tests/, book/, docs/ and README.md -- the comments and string
literals of a .py file (docstrings, messages, prompts: read with `tokenize`), the whole of
a Markdown file, a notebook's markdown cells and the comments and strings of its code
cells -- and fails naming `file:line` of

- a dotted name that starts at the package, `minipar.parallel.zero.Zero1`: the longest
  prefix that is a module of minipar must be there, and the next name must be defined in
  it (a class's method after a class, too);
- a dotted name whose first word is a module's own name, `schedules.replay`: some module
  of that name must define the next name;
- a dotted name whose first word reads as a module that is not there -- a snake_case
  word with an underscore, that no module, package, variable, argument or attribute of
  the repository is called (`pipeline_schedules.replay` after `pipeline_schedules.py`
  became `pipeline/schedules.py`);
- a repository path, `minipar/.../x.py`, `lessons/...`, `docs/...`, `tests/...`,
  `bench/...`, `book/...`: it must be a file or a folder of the checkout.

Only the standard library, one process, under a second (`ast` and `tokenize`, nothing
imported). `tests/test_layering.py` checks bare `*.py` and `*.md` names.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minipar"
TOP = ("minipar", "lessons", "docs", "tests", "bench", "book")

DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
# a path names a file by its suffix, or a folder by its closing slash
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/(?:[\w.-]+/)*"
                  r"(?:[\w.-]+\.(?:py|md|ipynb|txt|json|png)\b|(?=[\s`'\"),;:]|$)))")
# files a run writes (a benchmark's results): named before they exist
WRITTEN = {"bench/results.json"}
# files that name stale things on purpose: the tests of a stale-name check
EXAMPLES = {"tests/test_layering.py", "tests/test_names.py"}
# what a path may carry that is not a file: a placeholder (lessons/<stem>.py, lessons/NN_*),
# a glob, a pytest node id's tail (tests/x.py::test_y is cut at the ::)
PLACEHOLDER = re.compile(r"[<>{}*$]|NN|\bX\b|\.\.\.")


# ------------------------------------------------------------------ the repository
@functools.cache
def modules() -> dict[str, Path]:
    """Every module of minipar by dotted name: minipar.parallel.zero -> its file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@functools.cache
def definitions(path: Path) -> dict[str, set[str]]:
    """What a module defines at its top level (functions, classes, assignments, imports,
    its submodules if a package), each mapped to the names inside it (a class's methods
    and attributes; empty for the rest)."""
    tree = ast.parse(path.read_text())
    names: dict[str, set[str]] = {}
    if path.name == "__init__.py":
        names |= {child.stem: set() for child in path.parent.glob("*.py")}
        names |= {child.name: set() for child in path.parent.iterdir() if child.is_dir()}
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.ClassDef):
            inner = set()
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    inner.add(item.name)
                elif isinstance(item, ast.Attribute):
                    inner.add(item.attr)
                elif isinstance(item, ast.Name):
                    inner.add(item.id)
            names.setdefault(node.name, set()).update(inner)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.setdefault(node.name, set())
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for item in ast.walk(target):
                    if isinstance(item, ast.Name):
                        names.setdefault(item.id, set())
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], set())
        elif isinstance(node, ast.If | ast.Try | ast.With):
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *[s for h in getattr(node, "handlers", []) for s in h.body]]
    return names


@functools.cache
def module_words() -> dict[str, list[Path]]:
    """A module's own name (`schedules`, `zero`, `pipeline`) -> the files of that name."""
    words: dict[str, list[Path]] = {}
    for dotted, path in modules().items():
        words.setdefault(dotted.rsplit(".", 1)[-1], []).append(path)
    return words


@functools.cache
def file_words(path: Path) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(names, variables, keys) of one file's code: every name it binds or reads --
    variables, arguments, attributes, functions, classes, imports, keywords --; of those,
    the ones it assigns, takes as an argument or keeps as an attribute (a variable `mesh`,
    not the module `mesh` it imports); and every string constant that is wholly a dotted
    name (a parameter's key, "tok_embed.weight")."""
    if path.suffix == ".ipynb":
        sources = notebook_code(path)
    elif path.suffix == ".py":
        sources = [path.read_text()]
    else:
        return frozenset(), frozenset(), frozenset()
    words: set[str] = set()
    variables: set[str] = set()
    keys: set[str] = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                words.add(node.id)
                if isinstance(node.ctx, ast.Store):
                    variables.add(node.id)
            elif isinstance(node, ast.arg):
                words.add(node.arg)
                variables.add(node.arg)
            elif isinstance(node, ast.Attribute):
                words.add(node.attr)
                variables.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                words.add(node.name)
            elif isinstance(node, ast.alias):
                words.update((node.asname or node.name).split("."))
            elif isinstance(node, ast.keyword) and node.arg:
                words.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and KEY.fullmatch(node.value):
                keys.add(node.value)
    return frozenset(words), frozenset(variables), frozenset(keys)


KEY = re.compile(r"[a-z_]\w*(?:\.\w+)+")


@functools.cache
def variables() -> frozenset[str]:
    """Every name the code assigns, takes as an argument or keeps as an attribute: a
    prose `mesh.dp` speaks of a variable when `mesh` is one somewhere."""
    return frozenset().union(*(file_words(p)[1] for p in code_files()))


@functools.cache
def code_words() -> frozenset[str]:
    """Every name the repository's code binds or reads (of minipar, tests, lessons, bench,
    book, the notebooks). A prose `x_y.z` whose `x_y` is one of these speaks of a
    variable or an attribute, not of a module."""
    return frozenset().union(*(file_words(p)[0] for p in code_files()))


@functools.cache
def parameter_keys() -> frozenset[str]:
    return frozenset().union(*(file_words(p)[2] for p in code_files()))


def code_files() -> list[Path]:
    """The code whose names count: every .py file and notebook but the examples."""
    return [p for p in python_files() + sorted(ROOT.glob("lessons/*.ipynb"))
            if p.relative_to(ROOT).as_posix() not in EXAMPLES]


def python_files() -> list[Path]:
    return [p for folder in TOP for p in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in p.parts]


def notebook_code(path: Path) -> list[str]:
    """A notebook's code cells, IPython's `%` and `!` lines left out."""
    cells = json.loads(path.read_text())["cells"]
    return ["\n".join(line for line in "".join(c["source"]).splitlines()
                      if not line.lstrip().startswith(("%", "!")))
            for c in cells if c["cell_type"] == "code"]


# ------------------------------------------------------------------ the prose
def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of Python source."""
    found = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type in (tokenize.COMMENT, tokenize.STRING) or token.type == getattr(
                    tokenize, "FSTRING_MIDDLE", -1):
                for k, line in enumerate(token.string.splitlines()):
                    found.append((token.start[0] + k, line))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return found


def prose(path: Path) -> list[tuple[str, str]]:
    """("file:line", text) of every line of prose of one file."""
    where = path.relative_to(ROOT).as_posix()
    if path.suffix == ".py":
        return [(f"{where}:{n}", text) for n, text in python_prose(path.read_text())]
    if path.suffix == ".ipynb":
        found = []
        for number, cell in enumerate(json.loads(path.read_text())["cells"], start=1):
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                lines = list(enumerate(source.splitlines(), start=1))
            else:
                code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                 for line in source.splitlines())
                lines = python_prose(code + "\n")
            found += [(f"{where}:cell {number}:{n}", text) for n, text in lines]
        return found
    return [(f"{where}:{n}", text)
            for n, text in enumerate(path.read_text().splitlines(), start=1)]


def prose_files() -> list[Path]:
    files = python_files() + [ROOT / "README.md"]
    for folder in TOP:
        files += [p for suffix in ("*.md", "*.ipynb") for p in (ROOT / folder).rglob(suffix)]
    return sorted(set(files))


# ------------------------------------------------------------------ the rules
def dotted_problem(name: str) -> str | None:
    """Why a dotted name of the prose names nothing, or None (it is there, or it is no
    name of ours: `np.zeros`, `self.grad`, `mesh.dp`, the parameter `tok_embed.weight`)."""
    parts = name.split(".")
    if name in parameter_keys() or any(len(p) == 1 or p.startswith("__") for p in parts):
        return None   # a parameter's key, a placeholder (`minipar.x.y`), a dunder
    if parts[0] == "minipar":
        known = modules()
        cut = max(k for k in range(1, len(parts) + 1) if ".".join(parts[:k]) in known)
        module, rest = ".".join(parts[:cut]), parts[cut:]
        if not rest:
            return None
        names = definitions(known[module])
        if rest[0] not in names:
            what = "package" if known[module].name == "__init__.py" else "module"
            return f"the {what} {module} has no {rest[0]}"
        if len(rest) > 1 and names[rest[0]] and rest[1] not in names[rest[0]]:
            return f"{module}.{rest[0]} has no {rest[1]}"
        return None
    first, second = parts[0], parts[1]
    if first in module_words():
        homes = module_words()[first]
        if any(second in definitions(path) for path in homes) or first in variables():
            return None   # there, or a variable of the file called like a module
        where = ", ".join(str(p.relative_to(ROOT)) for p in homes)
        return f"no {second} in {where}"
    if "_" in first.strip("_") and first.islower() and first not in code_words():
        return f"no module {first} in the repository"
    return None


def path_problem(name: str) -> str | None:
    """Why a repository path of the prose is no file or folder here, or None. The book
    (book/build.py) mirrors lessons/ as pages: `lessons/<stem>.md` is the page of
    lessons/<stem>.ipynb, `lessons/figures/` its figures."""
    if PLACEHOLDER.search(name) or name in WRITTEN or (ROOT / name).exists():
        return None
    if name.startswith("lessons/") and (name.endswith("/figures/") or name.endswith(".md") and (
            (ROOT / name).with_suffix(".ipynb").exists() or (ROOT / name).with_suffix(
                ".py").exists())):
        return None
    return "no such file or folder" if not name.endswith("/") else "no such folder"


def stale_names(lines: list[tuple[str, str]]) -> list[str]:
    """`where: name: why` for every name of `lines` that names nothing here."""
    found = []
    for where, text in lines:
        for match in PATH.finditer(text):
            why = path_problem(match.group(1))
            if why:
                found.append(f"{where}: {match.group(1)}: {why}")
        for match in DOTTED.finditer(text):
            name = match.group(1)
            if FILE_SUFFIX.search(name):
                continue   # a file name (tests/test_layering.py checks those)
            why = dotted_problem(name)
            if why:
                found.append(f"{where}: {name}: {why}")
    return found


FILE_SUFFIX = re.compile(r"\.(py|md|ipynb|html|png|svg|json|txt|yml|cfg|toml|sh|npz|npy|pt)\b")


# ------------------------------------------------------------------ the tests
def test_a_stale_name_is_found_and_a_live_one_is_not():
    lines = [("x.py:1", "see `pipeline_schedules.replay` and minipar.parallel.pipeline."
                        "schedules.replay"),
             ("x.py:2", "Write schedules.one_f_one_b_order; v_schedules.no_such_function"),
             ("x.py:3", "minipar.parallel.zero.Zero1, minipar.parallel.nowhere.replay, x.y"),
             ("x.py:4", "minipar/parallel/pipeline/schedules.py, minipar/parallel/nowhere.py"),
             ("x.py:5", "lessons/<stem>.py, tests/parallel/test_bubble.py::test_x, cfg.tp")]
    found = stale_names(lines)
    assert [line.split(": ")[1] for line in found] == [
        "pipeline_schedules.replay", "v_schedules.no_such_function",
        "minipar.parallel.nowhere.replay", "minipar/parallel/nowhere.py"], found


def test_every_name_the_words_give_is_there():
    found = []
    for path in prose_files():
        if path.relative_to(ROOT).as_posix() in EXAMPLES:
            continue
        found += stale_names(prose(path))
    assert found == [], f"{len(found)} name(s) that are not there:\n" + "\n".join(found)
