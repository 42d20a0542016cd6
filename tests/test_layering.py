"""Imports go one way, the folders are the layers, and every file the code names exists.

minipar's folders are its layers, bottom first (`LAYERS`; docs/design.md, "Layering"):
placements (pure data), the one-process core, communication, the strategies, the run's
settings, checkpoints, the strategies composed, bugs, the run itself, the planner, the teaching
tools and the
exercises; `__init__` and `__main__` stand on top. A module's layer is the folder it sits
in, so a new file gets its layer from where it is put. This file reads every module of
minipar/ with `ast` (no import runs, no tool beyond the standard library) and fails on

- a module outside every layer's folder (a file dropped at the top, a new folder);
- an import cycle, counting every import: at the top, inside a function, under
  `TYPE_CHECKING`; a cycle is printed as the chain of modules that closes it;
- an import that goes up a layer (a module may import its own folder and the ones beneath);
- a module-level import that the module neither uses nor lists in `__all__` (a
  re-export shim: callers must import a name from the module that defines it);
- a mention of a `*.py` or `*.md` file, in code, docs, lessons or notebooks, that the
  repository does not hold (a file moved or renamed leaves no stale mention), of a
  design or style file from outside the repository, or of an absolute path outside it.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minipar"

# The folders, bottom first. A module may import from its own folder and every one below.
LAYERS: list[str] = [
    "placement",    # replicated / sharded / partial per mesh axis: pure data, no autograd
    "core",         # one process, no MPI: autograd, layers, models, optimizers, data
    "comm",         # MPI: the ledgered group, Megatron's mappings, the mesh, rings, watchdog
    "parallel",     # one file per strategy; the pipeline in parallel/pipeline/
    "settings",     # the run's flags and the checks made before step 1
    "checkpoint",   # sharded checkpoints, their files and folders
    "compose",      # parallelize: every strategy of the mesh applied to the model; clip
    "bugs",         # lesson 8's bugs, one flag away
    "run",          # the training loop, --check and --dump, reshard, generate
    "planner",      # `python -m minipar plan`: memory, time, presets, search, tables
    "teaching",     # the tour, the classroom, ledger tables, figures
    "exercises",    # `python -m minipar exercise`
]
# minipar/__main__.py stands above every folder; minipar/__init__.py (one BLAS thread per
# rank, before NumPy loads) sits on top too but any module may `import minipar`
TOP = {"", "__main__"}


def module_name(path: Path) -> str:
    """minipar/parallel/zero.py -> "parallel.zero"; minipar/__init__.py -> ""."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(name: str) -> int | None:
    """The layer of a module: the index of its top folder; the top modules above all."""
    if name in TOP:
        return len(LAYERS)
    folder = name.split(".")[0]
    if folder in LAYERS and "." in name or name in LAYERS:
        return LAYERS.index(folder)
    return None


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, known: set[str]) -> set[str]:
    """The minipar modules `path` imports anywhere in its text (ast.walk visits function
    bodies and `if TYPE_CHECKING:` blocks too). `from minipar.core import nn` names the
    module core.nn; `from minipar.core.nn import Module` names core.nn."""
    here = module_name(path)
    package = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from .zero import y
                base = ["minipar", *package[:len(package) - (node.level - 1)]]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name != "minipar" and not name.startswith("minipar."):
                continue
            inner = name.removeprefix("minipar").removeprefix(".")
            # the longest known module the name starts with: minipar.core.nn.Module -> core.nn
            while inner and inner not in known:
                inner = inner.rpartition(".")[0]
            if inner in known and inner != here:
                found.add(inner)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(path, set(found)) for name, path in found.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None: depth-first search with the path on a stack."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start, [])
            if cycle:
                return cycle
    return None


def misplaced(found: dict[str, Path]) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}: not in a layer's folder "
            f"({', '.join(LAYERS)})" for name, path in sorted(found.items())
            if layer_of(name) is None and path.name != "__init__.py" or
            path.name == "__init__.py" and name and name.split(".")[0] not in LAYERS]


def folder(name: str) -> str:
    layer = layer_of(name)
    return "top" if layer == len(LAYERS) else LAYERS[layer]


def upward(edges: dict[str, set[str]]) -> list[str]:
    return [f"{name or '__init__'} ({folder(name)}) imports {other} ({folder(other)})"
            for name, others in sorted(edges.items()) for other in sorted(others)
            if layer_of(name) is not None and layer_of(other) is not None
            and layer_of(other) > layer_of(name) and other != ""]  # `import minipar`: below all


def unused_imports(path: Path) -> list[str]:
    """Module-level imported names the module never uses and does not list in __all__."""
    tree = ast.parse(path.read_text(), filename=str(path))
    exported: set[str] = set()
    bound: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                bound[alias.asname or alias.name] = node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = node.lineno
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return [f"{path.relative_to(PACKAGE.parent)}:{line}: {name} imported, never used"
            for name, line in sorted(bound.items(), key=lambda kv: kv[1])
            if name not in used and name not in exported]


# ------------------------------------------------------------------ the finder itself
def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def fake_package(tmp_path: Path, files: dict[str, str]) -> None:
    global PACKAGE
    PACKAGE = tmp_path / "minipar"
    for name, text in files.items():
        (PACKAGE / name).parent.mkdir(parents=True, exist_ok=True)
        (PACKAGE / name).write_text(text)


def test_imports_are_read_everywhere_in_a_file(tmp_path):
    """Function-local and TYPE_CHECKING imports count; a name from a module is the module."""
    package = PACKAGE
    try:
        fake_package(tmp_path, {
            "parallel/zero.py": "from typing import TYPE_CHECKING\n"
                                "from minipar.core.nn import Module\n"
                                "if TYPE_CHECKING:\n"
                                "    from minipar.settings.config import TrainConfig\n"
                                "def f():\n    from minipar.checkpoint import save_load\n"
                                "    from . import data_parallel\n"})
        known = {"core.nn", "settings.config", "checkpoint.save_load",
                 "parallel.data_parallel", "parallel.zero"}
        assert imported(PACKAGE / "parallel/zero.py", known) == {
            "core.nn", "settings.config", "checkpoint.save_load", "parallel.data_parallel"}
    finally:
        globals()["PACKAGE"] = package


def test_a_file_in_the_wrong_folder_fails(tmp_path):
    """The layer comes from the folder: a core file importing MPI's layer is caught, and so
    is a file dropped at the top or in a folder that is no layer."""
    package = PACKAGE
    try:
        fake_package(tmp_path, {
            "__init__.py": "", "comm/__init__.py": "", "core/__init__.py": "",
            "comm/collectives.py": "X = 1\n",
            "core/sneaky.py": "from minipar.comm.collectives import X\nprint(X)\n",
            "helpers.py": "", "misc/thing.py": ""})
        assert upward(graph()) == ["core.sneaky (core) imports comm.collectives (comm)"]
        assert [line.split(":")[0] for line in misplaced(modules())] == [
            "minipar/helpers.py", "minipar/misc/thing.py"]
    finally:
        globals()["PACKAGE"] = package


def test_an_unused_import_fails(tmp_path):
    """A shim's re-export is caught; the same name in __all__ (the facade) is allowed."""
    (tmp_path / "shim.py").write_text("from minipar.core.nn import Module, Parameter\n"
                                      "def f() -> None:\n    return Module\n")
    (tmp_path / "face.py").write_text("from minipar.core.nn import Module\n"
                                      "__all__ = ['Module']\n")
    package = PACKAGE
    try:
        globals()["PACKAGE"] = tmp_path / "x"
        assert [line.split(": ")[-1] for line in unused_imports(tmp_path / "shim.py")] == [
            "Parameter imported, never used"]
        assert unused_imports(tmp_path / "face.py") == []
    finally:
        globals()["PACKAGE"] = package


# ---------------------------------------------------------------------- the package
def test_every_module_is_in_a_layer():
    assert misplaced(modules()) == [], "\n".join(misplaced(modules()))


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_go_down_the_layers():
    found = upward(graph())
    assert found == [], "\n".join(found)


def test_no_module_imports_what_it_does_not_use():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in unused_imports(path)]
    assert found == [], "\n".join(found)


# ------------------------------------------------------------ files that are not here
OUTSIDE = re.compile(r"(?<![\w.])/(?:work|home|Users|mnt|srv|root)/\S*")
MARKDOWN = re.compile(r"[\w./-]*\w\.md\b")
PYTHON = re.compile(r"(?<![\w/.-])(\w[\w./-]*\.py)\b")
NOT_HERE = ("DESIGN" + ".md", "STYLE" + ".md")  # spelled apart, so this file passes
# *.py names that are no file of ours on purpose: placeholders in a usage line or a message,
# a file a test writes itself
NOT_FILES = {"SCRIPT.py", "X.py", "m.py"}
# the tests of a stale-name check name stale files on purpose: this file, tests/test_names.py
EXAMPLES = {"test_layering.py", "test_names.py"}


def repository_text() -> dict[Path, str]:
    paths = [*ROOT.glob("minipar/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("lessons/*"),
             *ROOT.glob("bench/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md",
             ROOT / "Makefile", ROOT / "setup.cfg"]
    return {path: path.read_text() for path in paths
            if path.is_file() and path.suffix in (".py", ".ipynb", ".md", ".cfg", "")}


def repository_files() -> set[str]:
    """Every file of the checkout, as a path relative to the root."""
    skipped = {".git", ".venv", "build", "__pycache__"}   # pruned, not walked and filtered
    files = set()
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if name not in skipped]
        files |= {str((Path(folder) / name).relative_to(ROOT)) for name in names}
    return files


def stale_python_mentions(text: str, files: set[str]) -> list[str]:
    """The `*.py` names in `text` that are no file here: `train.py` must be some file's
    name, `run/train.py` the end of some file's path."""
    tails = {f: ("/" + f) for f in files}
    return [name for name in PYTHON.findall(text) if Path(name).name not in NOT_FILES
            and not any(f == name.lstrip("./") or t.endswith("/" + name.lstrip("./"))
                        for f, t in tails.items())]


def test_a_stale_file_mention_fails():
    files = {"minipar/run/train.py", "tests/harness/mpi.py"}
    text = "see run/train.py, train.py, tests/harness/mpi.py; not minipar/train.py, nn.py"
    assert stale_python_mentions(text, files) == ["minipar/train.py", "nn.py"]


def test_every_python_file_named_is_here():
    files = repository_files()
    found = [f"{path.relative_to(ROOT)}: {name}"
             for path, text in repository_text().items() if path.name not in EXAMPLES
             for name in stale_python_mentions(text, files)]
    assert found == [], "\n".join(found)


def test_no_reference_to_a_file_outside_the_repository():
    found = []
    for path, text in repository_text().items():
        where = path.relative_to(ROOT)
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{where}:{number}: {name}" for name in NOT_HERE if name in line]
            found += [f"{where}:{number}: {m}" for m in OUTSIDE.findall(line)]
            for name in MARKDOWN.findall(line):
                candidates = [ROOT / name, ROOT / "docs" / name, path.parent / name]
                if not any(candidate.is_file() for candidate in candidates):
                    found.append(f"{where}:{number}: {name} is not in the repository")
    assert found == [], "\n".join(found)


# ------------------------------------------------------------ one home per name
@functools.cache   # each module parsed once, however many imports name it
def defined_names(module: str) -> frozenset[str] | None:
    """The names `module` (minipar.x.y) defines itself: its top-level functions, classes
    and assignments (inside `if`/`try` too), the names its `__all__` offers as its public
    face (minipar.placement's), and, for a package, its submodules. None when the module
    is no file of minipar's."""
    path = ROOT / Path(*module.split("."))
    init = path / "__init__.py"
    source = init if init.exists() else path.with_suffix(".py")
    if not source.exists():
        return None
    names = {child.stem for child in path.glob("*.py")} | {
        child.name for child in path.iterdir() if child.is_dir()} if init.exists() else set()
    body = list(ast.parse(source.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if "__all__" in names and isinstance(node.value, (ast.List, ast.Tuple)):
                names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *[s for h in getattr(node, "handlers", []) for s in h.body]]
    return frozenset(names)


def borrowed_imports(name: str, source: str) -> list[str]:
    """`from minipar.x import y` lines of `source` where minipar.x does not define y."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minipar"):
            defined = defined_names(node.module)
            found += [f"{name}:{node.lineno}: {node.module} does not define {alias.name}"
                      for alias in node.names if defined is not None
                      and alias.name not in defined]
    return found


def test_a_borrowed_import_fails():
    assert borrowed_imports("x.py", "from minipar.teaching.plots import series_style\n")
    assert not borrowed_imports("x.py", "from minipar.teaching.load_plots import series_style\n")
    assert not borrowed_imports("x.py", "from minipar.teaching import plots\n")


def test_every_import_names_the_module_that_defines_the_name():
    """Lessons, notebooks, tests and benchmarks included: a reader who opens the module an
    import names finds the name defined there, not imported from a third file."""
    found = []
    for path in [*PACKAGE.rglob("*.py"), *ROOT.glob("lessons/*.py"), *ROOT.glob("tests/**/*.py"),
                 *ROOT.glob("bench/*.py")]:
        found += borrowed_imports(str(path.relative_to(ROOT)), path.read_text())
    for path in ROOT.glob("lessons/*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.startswith("%"))
        found += borrowed_imports(str(path.relative_to(ROOT)), code)
    assert found == [], "\n".join(found)
