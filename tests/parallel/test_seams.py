"""The seams (docs/design.md, "Seams"): a strategy file carries its idea; the precision
and the optimizer reach it through one door each, and its code names neither by kind.

MPI-free: the six strategy files are parsed (ast), and every name, attribute, imported
name and string of their code (docstrings and comments aside: they may explain) is
read against a list of words. `code_words` is the one walk; test_muon.py's
`test_strategies_name_no_optimizer` reads the same words for the optimizers.
"""

from __future__ import annotations

import ast
import re

from tests.harness.mpi import ROOT

STRATEGIES = ("parallel/data_parallel.py", "parallel/zero.py", "parallel/tensor_parallel.py",
              "parallel/expert_parallel.py", "parallel/context_parallel.py",
              "parallel/pipeline/executor.py")

# the precisions by kind: the --mixed formats, the 8-bit ones, the loss scale, the
# policy's concrete class (a strategy is handed a policy, it never builds a MixedStep)
PRECISION = re.compile(r"\b(mixed|mixedstep|bf16|fp16|bfloat16|float16|fp8|float8|e4m3|"
                       r"e5m2|loss scale|unscale and vote|reduce low)\b", re.IGNORECASE)


def code_words(source: str) -> list[str]:
    """Every word the code of `source` names: each name, attribute, imported name and
    string constant, docstrings excepted, with `_` read as a space (`loss_scale` ->
    `loss scale`), so a word list can match whole words."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, ast.alias):
            words.append(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            words.append(node.value)
    return [w.replace("_", " ") for w in words]


def named(path: str, kind: re.Pattern) -> list[str]:
    """The words of the strategy file `path` (under minipar/) that `kind` matches."""
    return [w for w in code_words((ROOT / "minipar" / path).read_text()) if kind.search(w)]


def test_the_walk_reads_code_and_skips_docstrings():
    source = ('"""bf16 here is prose."""\n'
              "def f(x):\n    '''fp16: prose too.'''\n    # mixed: a comment\n"
              "    return x.loss_scale, mixed, 'fp8'\n")
    assert [w for w in code_words(source) if PRECISION.search(w)] == [
        "loss scale", "mixed", "fp8"]


def test_strategies_name_no_precision():
    """A strategy is handed a precision policy (parallel/mixed.py: FullPrecision or
    MixedStep) and calls `reduction`/`reduced`, `compute_copy`, `refresh`, `skips` on
    it: no name, attribute, import or string of its code says mixed, bf16, fp16, fp8 or
    the loss scale (docstrings and comments may)."""
    for path in STRATEGIES:
        assert (ROOT / "minipar" / path).is_file(), path
        found = named(path, PRECISION)
        assert not found, f"{path}: names a precision: {found}"
