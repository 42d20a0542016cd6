"""mkdocs hook: every formula of a page becomes MathML at build time.

pymdownx.arithmatex (generic mode) marks `$...$` and `$$...$$` outside code as
`<span class="arithmatex">\\(...\\)</span>` and `<div class="arithmatex">\\[...\\]</div>`;
this hook replaces each with the MathML latex2mathml writes, which the browser draws
with no script and no font from elsewhere. A formula latex2mathml cannot read stays as
its LaTeX source in a <code>, and the build says which.
"""

from __future__ import annotations

import html
import re
import sys

from latex2mathml.converter import convert

MARKED = re.compile(r'<(span|div) class="arithmatex">\s*\\([(\[])(.*?)\\[)\]]\s*</\1>', re.S)


def mathml(match: re.Match) -> str:
    """One marked formula as MathML (block for `$$`, inline for `$`)."""
    latex = html.unescape(match.group(3)).strip()
    block = match.group(2) == "["
    try:
        return convert(latex, display="block" if block else "inline")
    except Exception as error:  # latex2mathml raises its own types, and some of Python's
        print(f"book: formula left as LaTeX ({type(error).__name__}): {latex[:80]}",
              file=sys.stderr)
        return f"<code>{html.escape(latex)}</code>"


DELIMITED = re.compile(r"\\[(\[](.*?)\\[)\]]")


def plain_titles(items: list) -> None:
    """A heading's formula in the table of contents as its bare LaTeX, `Y = XW`."""
    for item in items:
        item.title = DELIMITED.sub(lambda m: html.unescape(m.group(1)), item.title)
        plain_titles(item.children)


def on_page_content(html_text: str, page: object, config: object, files: object) -> str:
    """mkdocs calls this with each page's HTML after Markdown."""
    plain_titles(page.toc.items)
    return MARKED.sub(mathml, html_text)
