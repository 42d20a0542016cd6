"""Imports go one way, and the code points only at files the repository holds.

docs/design.md ("Layering") draws minipar as layers: a core that knows no MPI,
communication, the strategies, the run's flags, checkpoints and bugs, the run
itself, then results and the commands on top. This file reads every module of
minipar/ with `ast` (no import runs, no tool beyond the standard library) and
fails on

- an import cycle, counting every import: at the top, inside a function, under
  `TYPE_CHECKING`; a cycle is printed as the chain of modules that closes it;
- an import that goes up a layer (`LAYERS` below: a module may import its own
  layer and the ones beneath);
- a mention of a design or style file that is not in the repository, an absolute
  path outside it, or any `*.md` file the repository does not have.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minipar"

# Bottom first. A module may import from its own layer and every layer below it.
LAYERS: list[set[str]] = [
    {"autograd", "fused", "attention", "nn", "gpt", "recompute", "optim", "data",  # core,
     "documents",
     "memory", "shards", "threads", "placement_types", "placement_rules",   # no MPI
     "placement_transformer", "placement", "routing", "timing", "byte_units", "refusal"},
    {"comm", "mesh", "ring", "log", "watchdog", "flight", "flight_report",  # communication
     "trace"},
    {"parallel", "parallel.pipeline_instructions", "parallel.pipeline_v",
     "parallel.pipeline_layout", "parallel.pipeline_simulator",    # strategies
     "parallel.pipeline_schedules", "parallel.data_parallel",
     "parallel.zero", "parallel.tensor_parallel", "parallel.vocab_parallel",
     "parallel.expert_parallel", "parallel.pipeline_parallel", "parallel.context_parallel",
     "kvcache"},
    {"config"},                                                             # the flags
    {"checkpoint_format", "checkpoint", "checkpoint_folder", "checkpoint_owner", "preflight",
     "bugs_detours", "bugs_hangs", "bugs", "assemble", "clip"},
    {"train"},                                                              # composition
    {"results", "reshard", "generate"},
    {"costmodel", "timemodel", "presets", "plan_workloads", "plan_search", "plan_report",
     "plan", "plots_load", "plots_flight", "plots", "report", "tour", "classroom", "exercises",
     "exercises.regions", "exercises.units", "exercises.units_attention", "exercises.grade",
     "exercises.command", "trace_report", "__main__", ""},                  # on top
]


def module_name(path: Path) -> str:
    """minipar/parallel/zero.py -> "parallel.zero"; minipar/__init__.py -> ""."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, known: set[str]) -> set[str]:
    """The minipar modules `path` imports anywhere in its text (ast.walk visits function
    bodies and `if TYPE_CHECKING:` blocks too). `from minipar import nn` names the module
    nn; `from minipar.nn import Tensor` names nn."""
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
            # the longest known module the name starts with: minipar.nn.Tensor -> nn
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


# ------------------------------------------------------------------ the finder itself
def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_are_read_everywhere_in_a_file(tmp_path):
    """Function-local and TYPE_CHECKING imports count; a name from a module is the module."""
    global PACKAGE
    package, PACKAGE = PACKAGE, tmp_path
    try:
        (tmp_path / "parallel").mkdir()
        source = tmp_path / "parallel" / "zero.py"
        source.write_text("from typing import TYPE_CHECKING\n"
                          "from minipar.nn import Tensor\n"
                          "if TYPE_CHECKING:\n    from minipar.config import TrainConfig\n"
                          "def f():\n    from minipar import checkpoint\n"
                          "    from . import data_parallel\n")
        known = {"nn", "config", "checkpoint", "parallel.data_parallel", "parallel.zero"}
        assert imported(source, known) == {"nn", "config", "checkpoint",
                                           "parallel.data_parallel"}
    finally:
        PACKAGE = package


# ---------------------------------------------------------------------- the package
def test_every_module_has_a_layer():
    placed = set().union(*LAYERS)
    assert sorted(set(modules()) - placed) == [], "add the new module to LAYERS"
    assert sorted(placed - set(modules())) == [], "a module in LAYERS no longer exists"


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_go_down_the_layers():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    upward = [f"{name or '__init__'} (layer {layer[name]}) imports {other} "
              f"(layer {layer[other]})"
              for name, others in sorted(graph().items()) for other in sorted(others)
              if layer[other] > layer[name]]
    assert upward == [], "\n".join(upward)


# ------------------------------------------------------------ files that are not here
OUTSIDE = re.compile(r"(?<![\w.])/(?:work|home|Users|mnt|srv|root)/\S*")
MARKDOWN = re.compile(r"[\w./-]*\w\.md\b")
NOT_HERE = ("DESIGN" + ".md", "STYLE" + ".md")  # spelled apart, so this file passes


def repository_text() -> dict[Path, str]:
    paths = [*ROOT.glob("minipar/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("lessons/*"),
             *ROOT.glob("bench/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md",
             ROOT / "Makefile", ROOT / "setup.cfg"]
    return {path: path.read_text() for path in paths
            if path.is_file() and path.suffix in (".py", ".ipynb", ".md", ".cfg", "")}


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
