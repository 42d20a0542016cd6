"""Lines a lesson prints, kept to the width of a terminal, a notebook cell and the book's page.

`make course` (tests/course.py) fails a lesson that prints a line wider than WIDTH
characters. A sentence that would run past it is wrapped at its spaces by `fit`: each
continuation line indented two spaces more than the line it continues, so a wrapped
`why: ...` or `  step 9.5 s = ...` still reads as one item. Tables are laid out narrow
by the lesson itself (a column that would not fit goes on a line of its own): `fit`
never breaks a line that has no space to break at before the width. `print` is the
builtin with `fit` applied, for a lesson whose prose is printed in many places.
"""

from __future__ import annotations

import builtins
import textwrap

WIDTH = 120   # characters: what tests/course.py allows a line of a lesson's output


def fit(text: str, width: int = WIDTH) -> str:
    """`text` with every line wider than `width` wrapped at its spaces.

    A line keeps its own indent; its continuation lines get that indent plus two spaces.
    Lines that fit are returned as they were, blank lines and all.
    """
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip(" "))]
        out.extend(textwrap.wrap(line, width, initial_indent="", subsequent_indent=indent + "  ",
                                 break_long_words=False, break_on_hyphens=False,
                                 drop_whitespace=True) or [line])
    return "\n".join(out)


def print(*values: object, sep: str = " ", end: str = "\n", file: object = None,
          flush: bool = False) -> None:   # the builtin, with `fit` applied
    """The builtin `print`, each line of what it prints wider than WIDTH wrapped by `fit`.

    A lesson that imports it (`from minipar.teaching.lines import print`) keeps its print
    calls as they are and its prose within the page; a table it prints must still be
    narrow by itself (a wrapped row of a table reads as two rows)."""
    builtins.print(fit(sep.join(str(v) for v in values)), end=end, file=file, flush=flush)
