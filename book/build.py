"""`make book`: the course as a static site in build/book/, from the executed notebooks.

What this file teaches: a book whose every figure comes from a run made at build time
can still lie, if it shows a run that failed. So the pages are written only from
notebooks that passed, by one rule (`failures`), and the build stops on the first
notebook that breaks it, naming the notebook, the cell and why:

- a cell raised (an `error` output: a lesson's `mpiexec` job that exited non-zero, a
  notebook's own `assert` on what the ranks measured, a timeout);
- a code cell never ran (the run stopped before it: nbclient writes a failing notebook
  up to the failing cell);
- a drawing cell (`display(plots.x(...))`, as make course counts them) drew nothing;
- an output says `N check(s) failed` or `lesson checks: N passed, M failed` with M > 0
  (what a lesson script prints when any of its checks failed: minipar/comm/job.py);
- the notebook is missing from build/notebooks/, or its code differs from lessons/ (it
  ran an older copy of the lesson); the book is make course's full-size run.

The pages, in the table of contents' order: the first page, written for a student
(book/start.md: what the course teaches, its lessons in order with the rank count each
runs on, how to run lesson 00, how to read a page); the README's "Words used
throughout"; one page per lesson, 00 to the last (a lesson with no notebook shows its
script's docstring and its command); the exercises; docs/design.md; docs/glossary.md (every
term in Chinese and English, its name in the code, its lesson); then the strategies
in the order of the reading index of minipar/parallel/__init__.py, every named class and
function linked to its line in a source page of the book. A lesson page opens on the
lesson's own text and ends, folded, on how it was made: the command that produced its
outputs, its script's run line (the rank count of tests/course.py's COURSE, the one
table of contents), the strategies and the minipar calls it uses linked to their lines.

The book in Chinese, build/book/zh/ (a second mkdocs build, the theme's interface in
Chinese, its search cutting Chinese into words with jieba): a page for every notebook that
has a Chinese twin in lessons/zh/, its markdown cells in Chinese and each code cell's
outputs those of the same cell of the English run (the code of the two is the same,
tests/teaching/test_translations.py; a Chinese notebook whose code is not is refused
here); its own first page (book/start.zh.md), the exercises, the glossary. Its pages
link to the code pages of the English book (shared, not copied), and each page and its
twin to each other: the language switch of book/overrides/ goes to the twin.

    python book/build.py                  # build/notebooks -> build/book
    python book/build.py --notebooks DIR --out DIR

Exit 2 with one line when the executed notebooks are not there (run `make course`);
exit 1 with the reasons when a notebook is refused or mkdocs fails.
"""

from __future__ import annotations

import argparse
import ast
import base64
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHINESE = ROOT / "lessons" / "zh"   # the notebooks' Chinese twins (tests/translations.py)
# what a lesson script prints when a check failed (minipar/comm/job.py)
FAILED_CHECKS = re.compile(r"\b[1-9]\d* check\(s\) failed"
                           r"|^lesson checks: \d+ passed, [1-9]\d* failed", flags=re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
FOLD_LINES = 40   # a text output longer than this is shown folded (still searchable)
# make course's notebook half for one lesson (tests/course.py: full size, the executed
# notebook kept in build/notebooks/); a notebook of no lesson runs with all of them
NOTEBOOK_COMMAND = ".venv/bin/python -m tests.course --notebooks --only {number}"
ALL_NOTEBOOKS_COMMAND = "make notebooks"


class RefusedError(Exception):
    """A notebook the book will not show: its own checks failed, or it is not there."""


# ----------------------------------------------------------------- the failure rule
def failures(notebook: dict, source: dict | None = None) -> list[str]:
    """Why an executed notebook (nbformat's dict) must not become a page: one line per
    reason, [] when it passed. `source`, the notebook as stored in lessons/, adds a
    reason when the executed copy ran other code."""
    reasons = []
    for number, cell in enumerate(notebook.get("cells", []), start=1):
        if cell.get("cell_type") != "code":
            continue
        text = cell_text(cell)
        if text.strip() and cell.get("execution_count") is None:
            reasons.append(f"cell {number} never ran (the run stopped before it)")
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                reasons.append(f"cell {number} raised {output.get('ename')}: "
                               f"{ANSI.sub('', str(output.get('evalue', '')))[:200]}")
            found = FAILED_CHECKS.search(output_text(output))
            if found:
                reasons.append(f"cell {number} printed {found.group(0)!r}")
        if "display(" in text and "plots." in text and cell.get("execution_count") and not any(
                "image/png" in output.get("data", {}) for output in cell.get("outputs", [])):
            reasons.append(f"cell {number} drew no figure (it displays one of plots.*)")
    if source is not None:
        ran = [cell_text(c) for c in notebook.get("cells", []) if c.get("cell_type") == "code"]
        kept = [cell_text(c) for c in source.get("cells", []) if c.get("cell_type") == "code"]
        if ran != kept:
            reasons.append("its code differs from lessons/ (it ran an older copy: run "
                           "make course again)")
    return reasons


def cell_text(cell: dict) -> str:
    """A cell's text (nbformat keeps it as one string or as a list of lines)."""
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def output_text(output: dict) -> str:
    """The text an output shows: a stream's, or a display's text/plain."""
    text = output.get("text")
    if text is None:
        text = output.get("data", {}).get("text/plain", "")
    return "".join(text) if isinstance(text, list) else str(text)


# ----------------------------------------------------------------- source and symbols
@dataclass
class Sources:
    """The repository files the pages link to; each becomes a page `src/<path>.md`."""

    used: set[str] = field(default_factory=set)
    _defs: dict[str, dict[str, int]] = field(default_factory=dict)

    def resolve(self, name: str, bases: tuple[str, ...] = ("minipar/parallel/", "minipar/",
                                                           "")) -> str | None:
        """The repository path of a file the reading index names relative to
        minipar/parallel/ (`zero.py`), to minipar/ (`run/generate.py`) or to the root."""
        for base in bases:
            if (ROOT / (base + name)).is_file():
                return base + name
        return None

    def defs(self, path: str) -> dict[str, int]:
        """Line of every class, function, method and module constant of a .py file."""
        if path not in self._defs:
            lines: dict[str, int] = {}
            tree = ast.parse((ROOT / path).read_text())
            for node in tree.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    lines.setdefault(node.name, node.lineno)
                    for inner in getattr(node, "body", []):
                        if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                            lines.setdefault(inner.name, inner.lineno)
                elif isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            lines.setdefault(target.id, node.lineno)
            self._defs[path] = lines
        return self._defs[path]

    def link(self, path: str, line: int | None, here: str) -> str:
        """Relative link from page `here` to `path` (at `line`) in the book."""
        self.used.add(path)
        target = relative(here, f"src/{path}.md")
        return target + (f"#__codelineno-0-{line}" if line else "")


def plain(path: str) -> str:
    """A file name as Markdown text: `__init__.py` is no bold `init`."""
    return path.replace("_", "\\_")


def relative(here: str, target: str) -> str:
    """A link from page `here` to `target`, both relative to the docs folder."""
    depth = here.count("/")
    return "../" * depth + target


@dataclass
class Entry:
    """One strategy of the reading index: its name, text, symbols and lessons."""

    title: str
    text: str
    symbols: list[tuple[str, str, int]]     # (name, path, line)
    files: list[str]
    lessons: list[str]
    tests: list[str]

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.title.lower()).strip("-")


def reading_index(sources: Sources) -> tuple[str, list[Entry], str]:
    """minipar/parallel/__init__.py's docstring as (introduction, entries, closing)."""
    doc = ast.get_docstring(ast.parse((ROOT / "minipar/parallel/__init__.py").read_text()))
    lines = doc.splitlines()
    entries, intro, closing = [], [], []
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line and not line.startswith(" ") and nxt.startswith("    "):
            body = []
            i += 1
            while i < len(lines) and lines[i].startswith("    "):
                body.append(lines[i].strip())
                i += 1
            entries.append(parse_entry(line.strip(), " ".join(body), sources))
            continue
        (closing if entries else intro).append(line)
        i += 1
    return "\n".join(intro).strip(), entries, "\n".join(closing).strip()


PY_FILE = re.compile(r"(?<![\w/])((?:[\w.]+/)*\w+\.py)\b")


def parse_entry(title: str, text: str, sources: Sources) -> Entry:
    """One strategy's words: each file it names, and after each file the names it
    defines (`zero.py: Zero1, Zero2, Zero3`); then its lessons and its tests."""
    code, _, rest = text.partition("Lesson")
    lessons = re.findall(r"\b(\d\d_\w+)", rest.split("Tests:")[0])
    tests = PY_FILE.findall(rest.partition("Tests:")[2])
    symbols, files = [], []
    mentions = list(PY_FILE.finditer(code))
    for k, mention in enumerate(mentions):
        path = sources.resolve(mention.group(1))
        if path is None:
            continue
        files.append(path)
        end = mentions[k + 1].start() if k + 1 < len(mentions) else len(code)
        defs = sources.defs(path)
        for word in dict.fromkeys(re.findall(r"\b[A-Za-z_]\w+\b", code[mention.end():end])):
            if word in defs:
                symbols.append((word, path, defs[word]))
    return Entry(title, text, symbols, files, lessons, tests)


def readme_rows() -> list[tuple[str, list[str], str]]:
    """README's "Where each strategy lives": (strategy, code files, lesson column)."""
    section = readme_section("## Where each strategy lives")
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] not in ("strategy", "---") and "`" in cells[1]:
            files = re.findall(r"`([\w/.]+\.(?:py|md))`", cells[1])
            rows.append((cells[0], files, cells[2]))
    return rows


def readme_section(heading: str) -> str:
    """The README's text under `heading`, up to the next heading of its level or above
    (a `#` line inside a fenced block is not a heading)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    level = len(heading.split()[0])
    start = lines.index(heading) + 1
    inside, taken = False, []
    for line in lines[start:]:
        if line.lstrip().startswith("```"):
            inside = not inside
        marks = len(line) - len(line.lstrip("#"))
        if not inside and 1 <= marks <= level and line[marks:marks + 1] == " ":
            break
        taken.append(line)
    return "\n".join(taken)


# ----------------------------------------------------------------- pages
@dataclass
class Lesson:
    """One lesson of lessons/: its script, its notebook (either may be missing)."""

    stem: str               # 03_expert_parallel
    script: Path | None
    notebook: Path | None   # lessons/<stem>.ipynb

    @property
    def number(self) -> str:
        return self.stem[:2]

    @property
    def page(self) -> str:
        return f"lessons/{self.stem}.md"

    def ranks(self) -> int | None:
        """The rank count make course runs the script on (tests/course.py's COURSE, the
        course's one table of contents); None: one process, or no script."""
        if self.script is None:
            return None
        ranks = dict(course_table()).get(self.stem)
        return ranks if ranks and ranks > 1 else None

    @property
    def chinese(self) -> Path | None:
        """lessons/zh/<stem>.ipynb, the notebook's Chinese twin, if there is one."""
        path = CHINESE / f"{self.stem}.ipynb"
        return path if path.exists() else None

    def title(self, lang: str = "en") -> str:
        """The lesson's title, as its notebook's first heading gives it (the Chinese
        notebook's for lang "zh", when there is one), less the "Lesson N —" / "第 N 课 —"
        in front; else its script's docstring's first line."""
        notebook = self.chinese if lang == "zh" and self.chinese else self.notebook
        if notebook is not None:
            for cell in json.loads(notebook.read_text())["cells"]:
                text = cell_text(cell).lstrip()
                if cell.get("cell_type") == "markdown" and text.startswith("# "):
                    heading = text[2:].partition("\n")[0].strip()
                    return re.sub(r"^(Lesson \d+|第\s*\d+\s*课)\s*[—:：-]+\s*", "", heading)
        if self.script is not None:
            doc = ast.get_docstring(ast.parse(self.script.read_text())) or self.stem
            return doc.partition("\n")[0].strip().rstrip(".")
        return self.stem[3:].replace("_", " ")

    def run_line(self) -> str:
        """The command make course runs the script with, from the repository root."""
        ranks = self.ranks()
        launch = f".venv/bin/mpiexec -n {ranks} " if ranks else ""
        return f"{launch}.venv/bin/python lessons/{self.stem}.py --plot build/figures"


def course_table() -> tuple[tuple[str, int], ...]:
    """(lesson, ranks) of tests/course.py, in the course's order."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.course import COURSE
    return COURSE


def lessons() -> list[Lesson]:
    """Every numbered lesson of lessons/, in order (a script, a notebook, or both)."""
    stems = sorted({p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py")}
                   | {p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.ipynb")})
    return [Lesson(stem, path if (path := ROOT / f"lessons/{stem}.py").exists() else None,
                   path if (path := ROOT / f"lessons/{stem}.ipynb").exists() else None)
            for stem in stems]


def fence(text: str, info: str = "") -> str:
    """`text` in a fenced block whose fence no line of it can close."""
    longest = max([len(run) for run in re.findall(r"`+", text)] + [2])
    ticks = "`" * (longest + 1)
    return f"{ticks}{info}\n{text.rstrip()}\n{ticks}\n"


def indent(text: str) -> str:
    """`text` inside an admonition or a folded block (four spaces, blank lines too)."""
    return textwrap.indent(text, "    ", lambda line: True)


def when_executed(notebook: dict) -> str:
    """When the notebook's first cell ran (nbclient's timing metadata), or ""."""
    stamps = [cell.get("metadata", {}).get("execution", {}).get("iopub.execute_input")
              for cell in notebook.get("cells", [])]
    stamps = [s for s in stamps if s]
    if not stamps:
        return ""
    first = dt.datetime.fromisoformat(min(stamps).replace("Z", "+00:00"))
    return first.strftime("%Y-%m-%d %H:%M UTC")


def calls_of(code_cells: list[str], sources: Sources) -> list[tuple[str, str, int]]:
    """The minipar classes and functions a notebook's code calls: (module.name, path, line),
    found from its `from minipar.x import y` / `import minipar.x as y` lines."""
    modules: dict[str, str] = {}     # local name -> module path
    names: dict[str, str] = {}       # local name -> path of the module defining it
    found: dict[str, tuple[str, int]] = {}
    trees = []
    for code in code_cells:
        lines = [line for line in code.splitlines() if not line.lstrip().startswith(("%", "!"))]
        try:
            trees.append(ast.parse("\n".join(lines)))
        except SyntaxError:
            continue
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minipar"):
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}".replace(".", "/")
                    module = sources.resolve(dotted + ".py", ("",)) or sources.resolve(
                        dotted + "/__init__.py", ("",))
                    if module:
                        modules[alias.asname or alias.name] = module
                    else:
                        parent = sources.resolve(node.module.replace(".", "/") + ".py", ("",))
                        if parent:
                            names[alias.asname or alias.name] = parent
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in modules:
                path = modules[node.value.id]
                line = sources.defs(path).get(node.attr)
                if line:
                    found[f"{node.value.id}.{node.attr}"] = (path, line)
            elif isinstance(node, ast.Name) and node.id in names:
                path = names[node.id]
                line = sources.defs(path).get(node.id)
                if line:
                    found[node.id] = (path, line)
    return sorted((name, path, line) for name, (path, line) in found.items())


# The words the book itself writes on a page, in each of its languages (the lessons'
# own words come from their notebooks: lessons/ and lessons/zh/).
WORDS: dict[str, dict[str, str]] = {
    "en": {
        "strategies": "**The strategies of this lesson, in the code** (the reading index of "
                      "[minipar/parallel]({index})):\n",
        "table": "| strategy | class or function | source |\n|---|---|---|",
        "the file": "(the file)",
        "also": "**Also read** (README, \"Where each strategy lives\"): ",
        "calls": "**What this page calls**: ",
        "figure alt": "Lesson {number}, figure {k}",
        "figure": "*Figure {k}: drawn by In [{cell}] above (click it for the full size).*",
        "folded": "Output: {lines} lines (click to open)",
        "made": "How this page was made: the command, the script, the code it uses",
        "ran": "Every output and figure on this page is from the notebook `{notebook}`, "
               "executed at full size{when} by `make course`; every cell ran and none of "
               "its checks failed. The command that produced them:",
        "when": " on {when}",
        "script": "The lesson's script runs {on} (make course's run line, from the "
                  "repository root; [its source]({link})):",
        "ranks": "on {ranks} ranks", "one process": "in one process",
        "listed ranks": "{ranks} ranks", "listed one": "one process",
        "not built": "(not in this build of the book)",
        "no notebook": "This lesson has no notebook: it is a script, run by `make course` "
                       "(and `make lessons`) at full size {on}:\n",
        "below": "Its text is below; its output is what that command prints.\n",
        "exercises": "# Exercises\n",
        "exercises intro": "Each exercise stubs a marked region of minipar's own code "
                           "(`# exercise: NAME`); the equivalence checks grade a student's "
                           "version against one process.\n",
        "region": "The region to rewrite: ",
        "hint": "Hint, step {k}",
        "english": "",
    },
    "zh": {
        "strategies": "**这一课的策略在代码中的位置**（[minipar/parallel]({index}) "
                      "的阅读索引）：\n",
        "table": "| 策略 | 类或函数 | 源代码 |\n|---|---|---|",
        "the file": "（整个文件）",
        "also": "**另请阅读**（README 的 \"Where each strategy lives\"）：",
        "calls": "**这一页调用的 minipar 函数**：",
        "figure alt": "第 {number} 课，图 {k}",
        "figure": "*图 {k}：由上面的 In [{cell}] 画出（点击可看原尺寸）。*",
        "folded": "输出：{lines} 行（点击展开）",
        "made": "这一页是怎样生成的：命令、脚本、用到的代码",
        "ran": "这一页的说明文字来自中文 notebook `{zh}`；代码与英文 notebook `{notebook}` "
               "逐字相同，每一个输出和图都来自 `make course` 对英文 notebook 的完整规模运行"
               "{when}：每个单元格都运行了，没有一项检查失败。生成它们的命令：",
        "when": "（{when}）",
        "script": "这一课的脚本{on}运行（make course 的运行命令，在仓库根目录下执行；"
                  "[脚本源代码]({link})）：",
        "ranks": "在 {ranks} 个 rank 上", "one process": "在单个进程中",
        "listed ranks": "{ranks} 个 rank", "listed one": "单进程",
        "not built": "（本次构建的书中没有这些课）",
        "no notebook": "这一课没有 notebook：它是一个脚本，由 `make course`（以及 "
                       "`make lessons`）以完整规模{on}运行：\n",
        "below": "下面是它的说明文字；它的输出就是上面这条命令打印的内容。\n",
        "exercises": "# 练习\n",
        "exercises intro": "每个练习把 minipar 自身代码中标记出的一段（`# exercise: NAME`）"
                           "换成空白的桩；等价性检查把学生写的版本与单进程比对来评分。"
                           "每个练习的说明和提示与 `python -m minipar exercise` 打印的一样，"
                           "是英文的；术语的中文见术语表。\n",
        "region": "要重写的那一段：",
        "hint": "提示，第 {k} 步",
        "english": "（英文）",
    },
}


def strategy_table(here: str, entries: list[Entry], rows: list[tuple[str, list[str], str]],
                   calls: list[tuple[str, str, int]], sources: Sources,
                   lang: str = "en") -> str:
    """A lesson page's links into the code: the reading index's strategies of the lesson
    at their lines, the README's files for it, and the minipar names its cells call."""
    words = WORDS[lang]
    out = []
    if entries:
        out.append(words["strategies"].format(index=relative(here, "code/index.md")))
        out.append(words["table"])
        for entry in entries:
            strategy = f"[{entry.title}]({relative(here, f'code/{entry.slug}.md')})"
            # an entry that names no class or function: its files, from their first line
            for name, path, line in entry.symbols or [
                    (words["the file"], p, 1) for p in entry.files]:
                shown = f"`{name}`" if name.isidentifier() else name
                out.append(f"| {strategy} | {shown} | "
                           f"[{plain(path)}:{line}]({sources.link(path, line, here)}) |")
                strategy = ""
        out.append("")
    if rows:
        out.append(words["also"] + "; ".join(
            f"{name}: " + ", ".join(f"[{plain(p)}]({sources.link(p, 1, here)})" for p in files)
            for name, files, _ in rows) + "\n")
    if calls:
        out.append(words["calls"] + ", ".join(
            f"[`{name}`]({sources.link(path, line, here)}) ({plain(Path(path).name)}:{line})"
            for name, path, line in calls) + "\n")
    return "\n".join(out)


def lesson_rows(lesson: Lesson, rows: list[tuple[str, list[str], str]]
                ) -> list[tuple[str, list[str], str]]:
    """The README's rows whose lesson column names this lesson (`05, 06, 13`)."""
    if not lesson.number.isdigit():
        return []
    number = int(lesson.number)
    return [row for row in rows if number in {int(n) for n in re.findall(r"\b\d\d?\b", row[2])}
            and all((ROOT / path).is_file() for path in row[1])]


def notebook_page(lesson: Lesson, notebook: dict, sources: Sources, entries: list[Entry],
                  rows: list, docs: Path, here: str | None = None, lang: str = "en") -> str:
    """One lesson's page (at `here`, else lessons/<stem>.md): its cells in order, each
    figure a PNG in lessons/figures/, how it was made folded at its end."""
    words = WORDS[lang]
    here = here or lesson.page
    figures = docs / "lessons" / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    code = [cell_text(c) for c in notebook["cells"] if c.get("cell_type") == "code"]
    made = how_made(lesson, notebook, sources, strategy_table(
        here, [e for e in entries if lesson.stem in e.lessons], lesson_rows(lesson, rows),
        calls_of(code, sources), sources, lang), lang)
    parts, figure_count, placed = [], 0, False
    for number, cell in enumerate(notebook["cells"], start=1):
        text = cell_text(cell)
        if cell.get("cell_type") == "markdown":
            parts.append(text)
            placed = placed or text.lstrip().startswith("# ")
            continue
        if cell.get("cell_type") != "code" or not text.strip():
            continue
        parts.append(fence(text, f'python title="In [{cell.get("execution_count")}]"'))
        pending: list[str] = []
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            image = next((kind for kind in ("image/png", "image/svg+xml") if kind in data), None)
            if image is None:
                pending.append(ANSI.sub("", output_text(output)))
                continue
            parts.append(text_block(pending, lang))
            pending = []
            figure_count += 1
            suffix = "png" if image == "image/png" else "svg"
            name = f"{lesson.stem}-{number:02d}-{figure_count}.{suffix}"
            payload = data[image]
            payload = "".join(payload) if isinstance(payload, list) else payload
            blob = base64.b64decode(payload) if suffix == "png" else payload.encode()
            (figures / name).write_bytes(blob)
            link = relative(here, f"lessons/figures/{name}")
            # the picture links to itself: a click opens it at full size
            alt = words["figure alt"].format(number=lesson.number, k=figure_count)
            parts.append(f"[![{alt}]({link})]({link}){{ .figure }}\n\n" + words["figure"].format(
                k=figure_count, cell=cell.get("execution_count")) + "\n")
        parts.append(text_block(pending, lang))
    if not placed:
        parts.insert(0, f"# Lesson {lesson.number}: {lesson.title()}\n")
    parts.append(made)
    return "\n".join(part for part in parts if part)


def text_block(texts: list[str], lang: str = "en") -> str:
    """Consecutive text outputs as one block, folded when long."""
    text = "".join(texts).rstrip()
    if not text:
        return ""
    lines = text.count("\n") + 1
    if lines <= FOLD_LINES:
        return fence(text, "text")
    title = WORDS[lang]["folded"].format(lines=lines)
    return f'??? example "{title}"\n\n' + indent(fence(text, "text"))


def how_made(lesson: Lesson, notebook: dict | None, sources: Sources, links: str,
             lang: str = "en") -> str:
    """The folded box at a lesson page's end: what ran, how, when, that it passed
    (`provenance`), then `links`, the page's strategies and calls at their lines."""
    return (f'??? info "{WORDS[lang]["made"]}"\n\n'
            + indent(provenance(lesson, notebook, sources, lang) + "\n\n" + links) + "\n")


def provenance(lesson: Lesson, notebook: dict | None, sources: Sources,
               lang: str = "en") -> str:
    """What ran, how, when; that it passed; the script's command and its rank count."""
    words = WORDS[lang]
    lines = []
    if notebook is not None:
        when = when_executed(notebook)
        lines.append(words["ran"].format(
            notebook=f"lessons/{lesson.stem}.ipynb", zh=f"lessons/zh/{lesson.stem}.ipynb",
            when=words["when"].format(when=when) if when else ""))
        lines.append(fence(NOTEBOOK_COMMAND.format(number=lesson.number)
                           if lesson.number.isdigit() else ALL_NOTEBOOKS_COMMAND, "sh"))
    if lesson.script is not None:
        script = sources.link(f"lessons/{lesson.stem}.py", None, lesson.page)
        ranks = lesson.ranks()
        on = words["ranks"].format(ranks=ranks) if ranks else words["one process"]
        lines.append(words["script"].format(on=on, link=script))
        lines.append(fence(lesson.run_line(), "sh"))
    return "\n\n".join(lines)


def script_page(lesson: Lesson, sources: Sources, entries: list[Entry], rows: list,
                lang: str = "en") -> str:
    """A lesson with no notebook: its docstring, its command, its strategies."""
    words = WORDS[lang]
    here = lesson.page
    doc = ast.get_docstring(ast.parse(lesson.script.read_text())) or ""
    title, _, rest = doc.partition("\n")
    sources.link(f"lessons/{lesson.stem}.py", None, here)
    ranks = lesson.ranks()
    on = words["ranks"].format(ranks=ranks) if ranks else words["one process"]
    return "\n".join([
        f"# {title.strip()}\n",
        words["no notebook"].format(on=on),
        fence(lesson.run_line(), "sh"),
        words["below"],
        fence(rest.strip("\n"), "text"),
        how_made(lesson, None, sources, strategy_table(
            here, [e for e in entries if lesson.stem in e.lessons],
            lesson_rows(lesson, rows), [], sources, lang), lang),
    ])


def landing_page(template: str, course: list[Lesson], lang: str = "en",
                 links: dict[str, str] | None = None) -> str:
    """book/start.md (start.zh.md) with its `<!-- lessons NN-MM -->` marks replaced by
    the lessons of that range in the book: number, title, the rank count make course
    runs it on; LAST is the course's last lesson. `links`: a lesson's link when it is
    not its page beside this one (a Chinese book's link to an English page)."""
    words = WORDS[lang]
    links = links or {}
    template = template.replace("LAST", max(
        lesson.number for lesson in lessons() if lesson.number.isdigit()))

    def listed(match: re.Match) -> str:
        first, last = int(match.group(1)), int(match.group(2))
        items = []
        for lesson in course:
            if lesson.number.isdigit() and first <= int(lesson.number) <= last:
                ranks = lesson.ranks()
                on = words["listed ranks"].format(ranks=ranks) if ranks else words["listed one"]
                link = links.get(lesson.stem, lesson.page)
                items.append(f"- [{lesson.number} · {lesson.title(lang)}]({link}) "
                             f"<small>({on})</small>")
        return "\n".join(items) or words["not built"]
    return LESSON_RANGE.sub(listed, template)


LESSON_RANGE = re.compile(r"<!-- lessons (\d+)-(\d+) -->")


def exercises_page(sources: Sources, lang: str = "en") -> str:
    """Every exercise: its title, instructions, where its region is, its hints folded."""
    sys.path.insert(0, str(ROOT))
    from minipar.exercises import EXERCISES
    from minipar.exercises.regions import find_regions

    words = WORDS[lang]
    here = "exercises/index.md"
    regions = find_regions()
    out = [words["exercises"], words["exercises intro"],
           fence("python -m minipar exercise list\n"
                 "python -m minipar exercise start dp-naive ~/work && cd ~/work\n"
                 "python -m minipar exercise hint dp-naive            # then --step 2, ...\n"
                 "python -m minipar exercise check dp-naive .", "sh")]
    for exercise in EXERCISES:
        out.append(f"## {exercise.name}: {exercise.title}\n")
        out.append(exercise.instructions + "\n")
        where = [r for r in regions if r.name == exercise.name]
        if where:
            paths = [("minipar/" + r.path, r.first) for r in where]
            out.append(words["region"] + ", ".join(
                f"[{plain(path)}:{line}]({sources.link(path, line, here)})"
                for path, line in paths) + "\n")
        steps = exercise.hint_steps() if exercise.hint_file.exists() else []
        for k, step in enumerate(steps, start=1):
            out.append(f'??? tip "{words["hint"].format(k=k)}"\n\n' + indent(step.strip())
                       + "\n")
    return "\n".join(out)


# ----------------------------------------------------------------- the Chinese pages
def with_english_outputs(chinese: dict, english: dict) -> tuple[dict, list[str]]:
    """The Chinese notebook with the English run's outputs: each code cell's outputs and
    execution count from the same code cell of the executed English notebook. The code
    of the two is the same text cell by cell (tests/teaching/test_translations.py); a
    pair that is not is refused here too, with the cell: its outputs would be another
    code's. Returns (notebook, reasons); reasons [] when every code cell matched."""
    merged = json.loads(json.dumps(chinese))
    ours = [c for c in merged["cells"] if c.get("cell_type") == "code"]
    theirs = [c for c in english["cells"] if c.get("cell_type") == "code"]
    if len(ours) != len(theirs):
        return merged, [f"{len(ours)} code cells, the English run has {len(theirs)}"]
    reasons = []
    for k, (cell, ran) in enumerate(zip(ours, theirs), start=1):
        if cell_text(cell) != cell_text(ran):
            reasons.append(f"code cell {k} differs from the English one (its outputs "
                           "would be another code's)")
        cell["outputs"] = ran.get("outputs", [])
        cell["execution_count"] = ran.get("execution_count")
        cell.setdefault("metadata", {})["execution"] = ran.get("metadata", {}).get(
            "execution", {})
    return merged, reasons


SHARED = re.compile(r"\]\(((?:\.\./)*)((?:src|code)/[^)\s#]*?|design)\.md(#[^)\s]*)?\)")


def to_shared(text: str) -> str:
    """A Chinese page's links to the pages both languages share (the code, the source
    pages, the design), which only the English book holds: one folder up, as .html."""
    return SHARED.sub(lambda m: f"]({m.group(1)}../{m.group(2)}.html{m.group(3) or ''})", text)


def twin_link(page: str, to_chinese: bool) -> str:
    """The link from `page` (a docs path, lessons/03_expert_parallel.md) to its twin in the other
    language's book, relative to the page (the Chinese book is build/book/zh/)."""
    up = "../" * page.count("/")
    html = page[:-3] + ".html"
    return f"{up}zh/{html}" if to_chinese else f"{up}../{html}"


def front_matter(text: str, **fields: str) -> str:
    """`text` with `fields` in its YAML front matter (added to one it has, or new)."""
    lines = "".join(f"{key}: {value}\n" for key, value in fields.items())
    if text.startswith("---\n"):
        return "---\n" + lines + text[4:]
    return f"---\n{lines}---\n\n{text}"


def chinese_pages(course: list[Lesson], executed: dict[str, dict], docs: Path,
                  english: Path, sources: Sources, entries: list[Entry], rows: list) -> list:
    """The Chinese book's pages into `docs` (from lessons/zh/, each with the English
    run's outputs): its first page, a page per lesson that has a Chinese notebook, the
    exercises, the glossary; each page and its English twin (in `english`, the English
    docs) linked to each other for the language switch. Returns the Chinese nav.
    Raises RefusedError when a Chinese notebook's code is not the English run's."""
    merged, refused = {}, []
    for stem, notebook in executed.items():
        path = CHINESE / f"{stem}.ipynb"
        if path.exists():
            merged[stem], reasons = with_english_outputs(json.loads(path.read_text()),
                                                         notebook)
            refused += [f"{path}: {reason}" for reason in reasons]
    if refused:
        raise RefusedError("\n".join(refused))
    if docs.exists():
        shutil.rmtree(docs)
    (docs / "lessons").mkdir(parents=True)
    pages: dict[str, str] = {}    # docs path -> page text
    lesson_nav, outside = [], {}
    for lesson in course:
        if lesson.stem not in merged:
            outside[lesson.stem] = "../" + lesson.page[:-3] + ".html"
            continue
        pages[lesson.page] = notebook_page(lesson, merged[lesson.stem], sources, entries,
                                           rows, docs, lang="zh")
        lesson_nav.append({f"{lesson.number} {lesson.title('zh')}": lesson.page})
    pages["index.md"] = landing_page((BOOK / "start.zh.md").read_text(), course, "zh",
                                     {stem: f"{link}" for stem, link in outside.items()})
    for stem in outside:   # an English page, said so
        pages["index.md"] = pages["index.md"].replace(
            f"]({outside[stem]})", f"]({outside[stem]}){WORDS['zh']['english']}")
    pages["exercises/index.md"] = exercises_page(sources, "zh")
    exercise_nav = [{"练习": "exercises/index.md"}]
    if "exercises" in merged:
        fake = Lesson("exercises", None, ROOT / "lessons/exercises.ipynb")
        pages["exercises/notebook.md"] = notebook_page(
            fake, merged["exercises"], sources, [], [], docs, here="exercises/notebook.md",
            lang="zh")
        exercise_nav.append({"教师用（notebook）": "exercises/notebook.md"})
    pages["glossary.md"] = (ROOT / "docs/glossary.md").read_text()
    for page, text in pages.items():
        (docs / page).parent.mkdir(parents=True, exist_ok=True)
        twin = english / page
        if twin.exists():
            text = front_matter(text, alternate_en=twin_link(page, to_chinese=False))
            twin.write_text(front_matter(twin.read_text(),
                                         alternate_zh=twin_link(page, to_chinese=True)))
        (docs / page).write_text(to_shared(text))
    shutil.copy(BOOK / "book.css", docs / "book.css")
    return [{"从这里开始": "index.md"}, {"课程": lesson_nav}, {"练习": exercise_nav},
            {"术语表 Glossary": "glossary.md"}]


def strategy_page(entry: Entry, sources: Sources, lesson_pages: dict[str, str]) -> str:
    """One strategy of the reading index: its words, its classes and functions at their
    lines, its files, lessons and tests."""
    here = f"code/{entry.slug}.md"
    out = [f"# {entry.title[0].upper() + entry.title[1:]}\n", f"> {entry.text}\n"]
    if entry.symbols:
        out.append("| class or function | source |\n|---|---|")
        out += [f"| `{name}` | [{plain(path)}:{line}]({sources.link(path, line, here)}) |"
                for name, path, line in entry.symbols]
    out.append("")
    out.append("**Files**: " + ", ".join(f"[{plain(p)}]({sources.link(p, 1, here)})"
                                          for p in entry.files) + "\n")
    if entry.lessons:
        out.append("**Lessons**: " + ", ".join(
            f"[{stem}]({relative(here, lesson_pages[stem])})" if stem in lesson_pages
            else stem for stem in entry.lessons) + "\n")
    tests = [t for t in entry.tests if (ROOT / t).is_file()]
    if tests:
        out.append("**Tests**: " + ", ".join(f"[{plain(t)}]({sources.link(t, 1, here)})"
                                              for t in tests) + "\n")
    return "\n".join(out)


def code_index_page(intro: str, entries: list[Entry], closing: str) -> str:
    """The reading index itself: its words, then one row per strategy."""
    out = ["# The strategies in code\n", fence(intro, "text"), "| strategy | read |\n|---|---|"]
    for entry in entries:
        names = ", ".join(f"`{name}`" for name, _, _ in entry.symbols[:6])
        out.append(f"| [{entry.title}]({entry.slug}.md) | {names} |")
    out += ["", fence(closing, "text")]
    return "\n".join(out)


def source_page(path: str) -> str:
    """A repository file as a page, every line numbered and anchored
    (#__codelineno-0-N), left out of the search index."""
    text = (ROOT / path).read_text()
    lexer = "python" if path.endswith(".py") else "text"
    return ("---\nsearch:\n  exclude: true\n---\n\n"
            f"# {path}\n\n" + fence(text, f'{lexer} linenums="1"'))


def design_page() -> str:
    """docs/design.md, its links to repository files made plain text (the book has no
    copy of them), its images beside it."""
    text = (ROOT / "docs/design.md").read_text()
    return re.sub(r"\[([^\]]+)\]\((?!#|https?:|images/)([^)]+)\)", r"\1 (`\2`)", text)


# ----------------------------------------------------------------- the build
class Navs(NamedTuple):
    """The tables of contents of the two books: English, and Chinese (None: not built)."""

    en: list
    zh: list | None


def write_pages(notebooks: Path, docs: Path, only: list[str] | None = None,
                chinese: Path | None = None) -> Navs:
    """Every page into `docs` (and the Chinese book's into `chinese`, when given);
    returns the navs. Raises RefusedError (every reason of every notebook) before
    writing anything when a notebook did not pass. `only`: the lessons to keep (their
    numbers, or "exercises"), the others left out of the book."""
    course = [lesson for lesson in lessons() if not only or lesson.number in only]
    executed: dict[str, dict] = {}
    refused = []
    wanted = [lesson.stem for lesson in course if lesson.notebook] + (
        ["exercises"] if (ROOT / "lessons/exercises.ipynb").exists()
        and (not only or "exercises" in only) else [])
    for stem in wanted:
        path = notebooks / f"{stem}.ipynb"
        if not path.exists():
            refused.append(f"{path}: missing (make course executes every notebook)")
            continue
        notebook = json.loads(path.read_text())
        stored = json.loads((ROOT / f"lessons/{stem}.ipynb").read_text())
        refused += [f"{path}: {reason}" for reason in failures(notebook, stored)]
        executed[stem] = notebook
    if refused:
        raise RefusedError("\n".join(refused))

    if docs.exists():
        shutil.rmtree(docs)
    (docs / "lessons").mkdir(parents=True)
    sources = Sources()
    intro, entries, closing = reading_index(sources)
    rows = readme_rows()

    (docs / "index.md").write_text(landing_page((BOOK / "start.md").read_text(), course))
    (docs / "words.md").write_text("# Words used throughout\n\n"
                                   + readme_section("### Words used throughout").strip() + "\n")
    lesson_nav, lesson_pages = [], {}
    for lesson in course:
        if lesson.notebook:
            text = notebook_page(lesson, executed[lesson.stem], sources, entries, rows, docs)
        else:
            text = script_page(lesson, sources, entries, rows)
        (docs / lesson.page).write_text(text)
        lesson_pages[lesson.stem] = lesson.page
        lesson_nav.append({f"{lesson.number} {lesson.stem[3:].replace('_', ' ')}":
                           lesson.page})
    (docs / "exercises").mkdir()
    (docs / "exercises/index.md").write_text(exercises_page(sources))
    exercise_nav = [{"The exercises": "exercises/index.md"}]
    if "exercises" in executed:
        fake = Lesson("exercises", None, ROOT / "lessons/exercises.ipynb")
        text = notebook_page(fake, executed["exercises"], sources, [], [], docs,
                             here="exercises/notebook.md")
        (docs / "exercises/notebook.md").write_text(text)
        exercise_nav.append({"For teachers (notebook)": "exercises/notebook.md"})
    (docs / "design.md").write_text(design_page())
    (docs / "glossary.md").write_text((ROOT / "docs/glossary.md").read_text())  # 中文 / English
    shutil.copytree(ROOT / "docs/images", docs / "images")
    zh_nav = chinese_pages(course, executed, chinese, docs, sources, entries, rows) if (
        chinese is not None) else None
    (docs / "code").mkdir()
    (docs / "code/index.md").write_text(code_index_page(intro, entries, closing))
    for entry in entries:
        (docs / f"code/{entry.slug}.md").write_text(strategy_page(entry, sources, lesson_pages))
    for path in sorted(sources.used):
        page = docs / "src" / f"{path}.md"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(source_page(path))
    shutil.copy(BOOK / "book.css", docs / "book.css")
    return Navs([{"Start here": "index.md"}, {"Words used throughout": "words.md"},
                 {"Lessons": lesson_nav}, {"Exercises": exercise_nav},
                 {"Design": "design.md"}, {"Glossary 术语表": "glossary.md"},
                 {"The strategies in code": [{"Reading order": "code/index.md"}] + [
                     {entry.title: f"code/{entry.slug}.md"} for entry in entries]}], zh_nav)


def build(notebooks: Path, out: Path, work: Path, only: list[str] | None = None) -> int:
    """Write the pages into work/docs (the Chinese ones into work/docs-zh) and run mkdocs
    into `out` and `out`/zh; returns mkdocs' exit code (the first that failed)."""
    navs = write_pages(notebooks, work / "docs", only, chinese=work / "docs-zh")
    if out.exists():
        shutil.rmtree(out)
    for lang, nav, docs, site in (("en", navs.en, work / "docs", out),
                                  ("zh", navs.zh, work / "docs-zh", out / "zh")):
        config = work / f"mkdocs.{lang}.yml"
        config.write_text(mkdocs_config(lang, nav, docs, site))
        code = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                               "-f", str(config)], cwd=ROOT,
                              env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}).returncode
        if code != 0:
            return code
    return 0


# What the Chinese book changes in book/mkdocs.yml: its name, the theme's language (its
# interface, and search's segmenting: Material cuts Chinese into words with jieba), and
# links: its pages link to the code pages of the English book, outside its own folder,
# which mkdocs cannot see (make test-book follows every one of them).
CHINESE_CONFIG = {"site_name: minipar, the course": "site_name: minipar 课程",
                  "  language: en\n": "  language: zh\n",
                  "  unrecognized_links: warn": "  unrecognized_links: info"}


def mkdocs_config(lang: str, nav: list, docs: Path, site: Path) -> str:
    """book/mkdocs.yml for one language's book, with its pages, folders and the two
    languages of the switch."""
    import yaml  # here: mkdocs brings it (the book extra); the refusals above need none
    text = (BOOK / "mkdocs.yml").read_text().replace("BOOK/overrides", str(BOOK / "overrides"))
    if lang == "zh":
        for english, chinese in CHINESE_CONFIG.items():
            assert english in text, f"book/mkdocs.yml has no {english!r} any more"
            text = text.replace(english, chinese)
    home = {"en": ("index.html", "zh/index.html"), "zh": ("../index.html", "index.html")}[lang]
    return text + "\n" + yaml.safe_dump({
        "docs_dir": str(docs), "site_dir": str(site), "hooks": [str(BOOK / "hooks.py")],
        "nav": nav, "extra": {"generator": False, "alternate": [
            {"name": "English", "link": home[0], "lang": "en"},
            {"name": "中文", "link": home[1], "lang": "zh"}]}},
        sort_keys=False, allow_unicode=True)


BUILT_NOTE = ".minipar-book"   # in --out and --work: this build wrote the folder


def not_ours(folder: Path, flag: str) -> str | None:
    """Why `folder` may not be emptied by a build (None if it may): it is rewritten
    whole (and mkdocs cleans its site folder), so it must be new, empty, or one a build
    wrote (its note, or an earlier build's own files: the site's search index and
    book.css, the pages' mkdocs.yml)."""
    if not folder.exists():
        return None
    if not folder.is_dir():
        return f"{flag} {folder}: is a file, not a folder"
    entries = sorted(p.name for p in folder.iterdir())
    ours = (folder / BUILT_NOTE).exists() or (
        (folder / "search/search_index.json").exists() and (folder / "book.css").exists()) or (
        (folder / "mkdocs.yml").exists() and (folder / "docs/book.css").exists())
    if not entries or ours:
        return None
    return (f"{flag} {folder}: holds files no build wrote ({', '.join(entries[:3])}"
            f"{' ...' if len(entries) > 3 else ''}): the build replaces the whole folder; "
            "give a new or empty one")


def lesson_numbers(only: str) -> tuple[list[str], str | None]:
    """--only's lessons as two-digit numbers (9 is 09), and the first one that is no
    lesson's ("exercises" is one)."""
    known = {lesson.number for lesson in lessons()} | {"exercises"}
    wanted = [n.strip().zfill(2) if n.strip().isdigit() else n.strip()
              for n in only.split(",")]
    unknown = [n for n in wanted if n not in known]
    return wanted, (f"--only {unknown[0]}: no such lesson (the lessons: "
                    f"{', '.join(sorted(known))})" if unknown else None)


def main(argv: list[str] | None = None) -> int:
    """`make book`: 0 built, 1 refused or mkdocs failed, 2 no executed notebooks, or a bad
    flag (an --only that names no lesson, an --out or --work folder holding other files)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--notebooks", type=Path, default=ROOT / "build/notebooks",
                        help="the executed notebooks (make course writes them)")
    parser.add_argument("--out", type=Path, default=ROOT / "build/book", help="the site")
    parser.add_argument("--work", type=Path, default=ROOT / "build/book-src",
                        help="the pages written before mkdocs reads them")
    parser.add_argument("--only", metavar="NN,NN", help="a book of these lessons only "
                        "(numbers, or 'exercises'): while writing one lesson")
    args = parser.parse_args(argv)
    only, wrong = lesson_numbers(args.only) if args.only else (None, None)
    wrong = wrong or not_ours(args.out, "--out") or not_ours(args.work, "--work")
    if wrong:
        print(f"book: error: {wrong}", file=sys.stderr)
        return 2
    if not any(args.notebooks.glob("*.ipynb")):
        print(f"book: no executed notebooks in {args.notebooks}: run `make course` first",
              file=sys.stderr)
        return 2
    try:
        code = build(args.notebooks.resolve(), args.out.resolve(), args.work.resolve(), only)
    except RefusedError as refused:
        print("book: refused, a notebook's own checks failed (no page shows a run that did "
              f"not pass):\n{refused}", file=sys.stderr)
        return 1
    for folder in (args.out, args.work):   # the next build may replace them
        if folder.is_dir():
            (folder / BUILT_NOTE).write_text("written by book/build.py\n")
    if code != 0:
        print(f"book: mkdocs failed (exit {code})", file=sys.stderr)
        return 1
    pages = len(list(args.out.rglob("*.html")))
    print(f"book: {pages} pages in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
