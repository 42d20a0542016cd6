"""The README's examples are the output of their own commands.

A README block that shows commands (`mpiexec ...`, `python -m minipar ...`, `$ .venv/bin/python
...`; a line ending in `\\` continues on the next) followed by output is run here, from a
scratch folder (paths under /tmp/ and the repository's own files rewritten to it), and the
first line of its output must match the block's first output line: the numbers in either
may differ (timings, the rank whose watchdog fires first) and `...` in the README stands
for any text, but every word must be there. A README that shows another run's output, or
output the code no longer prints, fails.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minipar.teaching.classroom import mpiexec, rank_environment
from tests.harness.mpi import ROOT

COMMAND = re.compile(r"^(\$ )?(mpiexec -n \d+ |\.venv/bin/)?python -m minipar ")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?")


def examples(text: str) -> list[tuple[list[str], str]]:
    """(commands, first output line) of every README block that shows both."""
    found = []
    for block in re.findall(r"^```\n(.*?)^```", text, flags=re.S | re.M):
        lines, commands = block.splitlines(), []
        while lines and COMMAND.match(lines[0]):
            command = lines.pop(0)
            while command.endswith("\\") and lines:
                command = command[:-1] + " " + lines.pop(0).strip()
            commands.append(command)
        if commands and lines:
            found.append((commands, lines[0]))
    return found


def pattern(line: str) -> re.Pattern:
    """A README output line as a pattern: numbers match any number, `...` any text, and it
    matches the start of the line printed."""
    parts = []
    for piece in re.split(r"(\.\.\.)", line.strip()):
        if piece == "...":
            parts.append(".*")
        else:
            parts.append(NUMBER.sub("\0", piece))
    escaped = "".join(p if p == ".*" else re.escape(p) for p in parts)
    return re.compile("^" + escaped.replace("\0", NUMBER.pattern))


EXAMPLES = examples((ROOT / "README.md").read_text())


def test_the_readme_has_examples_to_check():
    assert len(EXAMPLES) >= 4, EXAMPLES
    assert pattern("step    1  loss 5.5  gnorm 6.2").match("step    1  loss 4.25  gnorm 7")
    assert not pattern("step    1  loss 5.5").match("step    1  lost 5.5")
    assert pattern("waited 3 s (...); flight").match("waited 4 s (a rank is stuck); flight (x)")


@pytest.mark.parametrize("commands,first", EXAMPLES, ids=lambda x: str(x)[:40])
def test_a_readme_example_prints_what_the_readme_shows(commands, first, tmp_path):
    env = dict(rank_environment(), PATH=f"{Path(sys.executable).parent}{os.pathsep}"
                                        f"{os.environ.get('PATH', '')}")
    for command in commands:
        words = shlex.split(command.removeprefix("$ ").replace("/tmp/", f"{tmp_path}/"))
        words = [sys.executable if w in ("python", ".venv/bin/python") else
                 mpiexec() if w == "mpiexec" else
                 str(ROOT / w) if (ROOT / w).is_file() else w for w in words]
        job = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
    printed = [line for line in (job.stdout + job.stderr).splitlines() if line.strip()]
    printed = [line.replace(socket.gethostname(), "vm") for line in printed]
    assert printed and pattern(first).match(printed[0]), (
        f"README shows {first!r}\nthe command printed {printed[:3]}")
