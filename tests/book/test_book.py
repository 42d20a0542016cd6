"""The book's rule (book/build.py): a page never shows a run that did not pass.

No browser and no mkdocs here: the rule and the pages are plain Python; `make test-book`
opens the built site in Chromium.
"""

from __future__ import annotations

import ast
import base64
import json
import re

import pytest

from book import build
from tests.harness.mpi import ROOT

# a 1x1 PNG: the figure a cell displayed
PIXEL = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360f8cfc0f01f0005000201a5e7a4"
    "0e0000000049454e44ae426082")).decode()


def executed(stem: str, figure: bool = True) -> dict:
    """lessons/<stem>.ipynb as if it had run and passed: every code cell executed, the
    first one printing a line, each drawing cell displaying a figure."""
    notebook = json.loads((ROOT / f"lessons/{stem}.ipynb").read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    for number, cell in enumerate(code, start=1):
        cell["execution_count"] = number
        cell["outputs"] = []
    code[0]["outputs"] = [{"output_type": "stream", "name": "stdout",
                           "text": "lesson checks: 7 passed, 0 failed\n"}]
    drawing = [cell for cell in code
               if "display(" in "".join(cell["source"]) and "plots." in "".join(cell["source"])]
    for cell in drawing if figure else []:
        cell["outputs"] = [{"output_type": "display_data", "metadata": {},
                            "data": {"image/png": PIXEL, "text/plain": "<Figure>"}}]
    return notebook


def stored(stem: str) -> dict:
    return json.loads((ROOT / f"lessons/{stem}.ipynb").read_text())


def test_a_notebook_that_passed_is_accepted():
    assert build.failures(executed("03_expert_parallel"), stored("03_expert_parallel")) == []


def broken(kind: str) -> dict:
    notebook = executed("03_expert_parallel")
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    if kind == "raised":
        code[1]["outputs"].append({"output_type": "error", "ename": "RuntimeError",
                                   "evalue": "exit 1: mpiexec -n 8 ...", "traceback": []})
    elif kind == "never ran":
        code[-1]["execution_count"] = None
    elif kind == "check(s) failed":
        code[1]["outputs"].append({"output_type": "stream", "name": "stdout",
                                   "text": "...\n2 check(s) failed\n"})
    elif kind == "lesson checks":
        code[0]["outputs"][0]["text"] = "lesson checks: 6 passed, 1 failed\n"
    elif kind == "no figure":
        next(cell for cell in code if "plots." in "".join(cell["source"]))["outputs"] = []
    elif kind == "older code":
        code[1]["source"] = "print('an older copy of the lesson')"
    return notebook


@pytest.mark.parametrize("kind, words", [
    ("raised", "raised RuntimeError: exit 1"),
    ("never ran", "never ran"),
    ("check(s) failed", "printed '2 check(s) failed'"),
    ("lesson checks", "printed 'lesson checks: 6 passed, 1 failed'"),
    ("older code", "differs from lessons/"),
    ("no figure", "drew no figure"),
])
def test_a_notebook_whose_checks_failed_is_refused(kind, words):
    reasons = build.failures(broken(kind), stored("03_expert_parallel"))
    assert len(reasons) == 1 and words in reasons[0], reasons


def test_the_build_stops_before_any_page_and_names_the_cell(tmp_path, capsys):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    (notebooks / "03_expert_parallel.ipynb").write_text(json.dumps(broken("check(s) failed")))
    code = build.main(["--notebooks", str(notebooks), "--out", str(tmp_path / "site"),
                       "--work", str(tmp_path / "work"), "--only", "03"])
    err = capsys.readouterr().err
    assert code == 1
    assert "03_expert_parallel.ipynb: cell" in err and "2 check(s) failed" in err, err
    assert not (tmp_path / "site").exists() and not (tmp_path / "work").exists()


def test_no_executed_notebooks_is_one_line_and_exit_2(tmp_path, capsys):
    assert build.main(["--notebooks", str(tmp_path), "--out", str(tmp_path / "site")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make course" in err, err


def test_a_lesson_page_shows_its_figure_its_command_and_its_strategies_lines(tmp_path):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    (notebooks / "03_expert_parallel.ipynb").write_text(json.dumps(executed(
        "03_expert_parallel")))
    nav = build.write_pages(notebooks, tmp_path / "docs", only=["03"]).en
    md = ".md"   # (pages are Markdown files of the build, not of this repository)
    page = (tmp_path / "docs" / "lessons" / ("03_expert_parallel" + md)).read_text()
    figures = sorted((tmp_path / "docs/lessons/figures").glob("03_expert_parallel-*.png"))
    assert len(figures) == 2   # one per drawing cell of the notebook (a PNG each, above)
    assert all(f"(../lessons/figures/{figure.name})" in page for figure in figures)
    assert "python -m tests.course --notebooks --only 03" in page
    assert "lessons/03_expert_parallel.py --plot" in page
    source = "minipar/parallel/expert_parallel.py"
    line = next(node.lineno for node in ast.parse((ROOT / source).read_text()).body
                if isinstance(node, ast.ClassDef) and node.name == "ExpertParallelBlock")
    shown = source.replace("_", "\\_")   # Markdown's text of the name
    assert f"[{shown}:{line}](../src/{source}{md}#__codelineno-0-{line})" in page
    assert (tmp_path / "docs" / "src" / (source + md)).exists()
    titles = [next(iter(item)) for item in nav]
    assert titles[:2] == ["Start here", "Words used throughout"], titles
    assert titles[-1] == "The strategies in code", titles


def test_a_lesson_page_opens_on_the_lesson_and_folds_how_it_was_made(tmp_path):
    """The notebook's title and first paragraph come first; the command, the script and
    the links into the code come last, in one folded box."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    (notebooks / "03_expert_parallel.ipynb").write_text(json.dumps(executed(
        "03_expert_parallel")))
    build.write_pages(notebooks, tmp_path / "docs", only=["03"])
    page = (tmp_path / "docs" / "lessons" / ("03_expert_parallel" + ".md")).read_text()
    first = next(c for c in stored("03_expert_parallel")["cells"]
                 if c["cell_type"] == "markdown")
    assert page.startswith("".join(first["source"])), page[:300]
    box = page.index('??? info "How this page was made')
    assert box > page.rindex("In ["), "the box is not after the last cell"
    for words in ("python -m tests.course --notebooks --only 03", "mpiexec -n 8",
                  "**What this page calls**", "The strategies of this lesson"):
        assert page.rindex(words) > box, words


def test_the_first_page_is_the_course_for_a_student(tmp_path):
    """Lessons in the course's order, each with the rank count make course runs it on
    (tests/course.py's COURSE); none of the README's first lines for a developer."""
    from tests.course import COURSE

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    (notebooks / "03_expert_parallel.ipynb").write_text(json.dumps(executed(
        "03_expert_parallel")))
    build.write_pages(notebooks, tmp_path / "docs", only=["03"])
    md = ".md"   # (pages are Markdown files of the build, not of this repository)
    page = (tmp_path / "docs" / ("index" + md)).read_text()
    ranks = dict(COURSE)["03_expert_parallel"]
    title = build.Lesson("03_expert_parallel", None, ROOT / "lessons/03_expert_parallel.ipynb"
                         ).title()
    assert not title.startswith("Lesson") and len(title) > 10, title
    assert f"[03 · {title}](lessons/03_expert_parallel{md}) <small>({ranks} ranks)</small>" \
        in page, page
    assert "mpiexec -n 4 .venv/bin/python lessons/00_collectives.py" in page
    for developer in ("make test", "make demo", "source .venv/bin/activate", "|---|"):
        assert developer not in page, developer
    every = build.landing_page((build.BOOK / ("start" + md)).read_text(), build.lessons())
    order = [every.index(f"(lessons/{lesson}{md})") for lesson, _ in COURSE
             if (ROOT / f"lessons/{lesson}.ipynb").exists()]
    assert order == sorted(order) and len(order) == len(COURSE)


def test_a_title_names_the_ranks_its_run_line_starts():
    """A lesson whose title says "on N ranks" runs on N ranks in make course."""
    from tests.course import COURSE

    wrong = []
    for lesson in build.lessons():
        said = re.findall(r"\bon (\d+) ranks\b", lesson.title())
        runs = dict(COURSE).get(lesson.stem)
        wrong += [f"{lesson.stem}: the title says {n}, make course runs {runs}"
                  for n in said if int(n) != runs]
    assert wrong == [], wrong


def test_the_reading_index_becomes_the_second_half_of_the_contents():
    _, entries, _ = build.reading_index(build.Sources())
    titles = [entry.title for entry in entries]
    assert titles[:3] == ["data parallelism", "ZeRO 1 / 2 / 3",
                          "tensor parallelism (and sequence parallelism)"], titles
    for entry in entries:
        assert entry.symbols or entry.files, entry.title
        for name, path, line in entry.symbols:
            text = (ROOT / path).read_text().splitlines()[line - 1]
            assert name in text, (entry.title, name, path, line)



def test_the_browser_check_finds_a_link_that_leads_nowhere(tmp_path):
    """book/browse.py's judge of a link, on two pages of a made-up site."""
    from book import browse

    (tmp_path / "lessons").mkdir()
    (tmp_path / "index.html").write_text('<h2 id="start">start</h2>')
    (tmp_path / "lessons" / "03.html").write_text('<span id="__codelineno-0-7"></span>')
    base = "http://127.0.0.1:8000/"
    assert browse.link_problem(tmp_path, base, base + "lessons/03.html#__codelineno-0-7") is None
    assert browse.link_problem(tmp_path, base, base + "#start") is None
    assert browse.link_problem(tmp_path, base, "https://example.org/x.html") is None  # not ours
    assert browse.link_problem(tmp_path, base, base + "lessons/04.html") == "no such page"
    assert browse.link_problem(tmp_path, base, base + "lessons/03.html#__codelineno-0-8") == (
        "no #__codelineno-0-8 on lessons/03.html")


def test_a_chinese_page_has_the_english_runs_outputs_and_links_its_twin(tmp_path):
    """lessons/zh/<stem>.ipynb's words, the executed English notebook's outputs cell by
    cell, a switch to its English twin and back, the code pages of the English book."""
    stem = next(p.stem for p in sorted((ROOT / "lessons/zh").glob("[0-9][0-9]_*.ipynb"))
                if (ROOT / f"lessons/{p.stem}.ipynb").exists())
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    (notebooks / f"{stem}.ipynb").write_text(json.dumps(executed(stem)))
    navs = build.write_pages(notebooks, tmp_path / "en", only=[stem[:2]],
                             chinese=tmp_path / "zh")
    md = ".md"
    page = (tmp_path / "zh" / "lessons" / (stem + md)).read_text()
    english = (tmp_path / "en" / "lessons" / (stem + md)).read_text()
    chinese = json.loads((ROOT / f"lessons/zh/{stem}.ipynb").read_text())
    title = "".join(next(c for c in chinese["cells"] if c["cell_type"] == "markdown")["source"])
    assert page.startswith(f"---\nalternate_en: ../../lessons/{stem}.html\n---\n\n"
                           + title.partition("\n")[0]), page[:200]
    assert english.startswith(f"---\nalternate_zh: ../zh/lessons/{stem}.html\n---\n"), english[:80]
    assert "lesson checks: 7 passed, 0 failed" in page   # the English run's output
    figures = sorted((tmp_path / "zh/lessons/figures").glob(f"{stem}-*.png"))
    assert figures and all(f"(../lessons/figures/{f.name})" in page for f in figures)
    assert "](../../src/minipar/" in page and "](../src/" not in page   # the shared pages
    assert "这一页是怎样生成的" in page
    assert [next(iter(item)) for item in navs.zh][:2] == ["从这里开始", "课程"], navs.zh
    index = (tmp_path / "zh" / ("index" + md)).read_text()
    assert f"](lessons/{stem}{md})" in index and "](../lessons/00" not in index, index
    # (a lesson left out of this book is not listed at all)


def test_a_chinese_notebook_whose_code_is_not_the_english_runs_is_refused():
    stem = next(p.stem for p in sorted((ROOT / "lessons/zh").glob("[0-9][0-9]_*.ipynb")))
    chinese = json.loads((ROOT / f"lessons/zh/{stem}.ipynb").read_text())
    merged, reasons = build.with_english_outputs(chinese, executed(stem))
    assert reasons == []
    ran = [c for c in merged["cells"] if c["cell_type"] == "code"]
    assert ran[0]["outputs"][0]["text"] == "lesson checks: 7 passed, 0 failed\n"
    stale = executed(stem)
    next(c for c in stale["cells"] if c["cell_type"] == "code")["source"] = "print(1)"
    _, reasons = build.with_english_outputs(chinese, stale)
    assert reasons == ["code cell 1 differs from the English one (its outputs would be "
                       "another code's)"], reasons


def test_a_chinese_page_links_the_code_pages_of_the_english_book():
    md = ".md"   # (pages are Markdown files of the build, not of this repository)
    text = (f"[a](../src/minipar/x.py{md}#__codelineno-0-7) [b](../code/index{md}) "
            f"[c](../lessons/figures/f.png) [d](../../design{md}) [e](glossary{md})")
    assert build.to_shared(text) == (
        "[a](../../src/minipar/x.py.html#__codelineno-0-7) [b](../../code/index.html) "
        f"[c](../lessons/figures/f.png) [d](../../../design.html) [e](glossary{md})")
