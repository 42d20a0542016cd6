"""The Chinese notebooks (lessons/zh/) are current translations of the English ones.

tests/translations.py holds the rule: the same cells, code identical, each Chinese
markdown cell recording the sha256 digest of the English text it translates. These tests
fail naming the notebook and the cell when an English cell changed after its
translation, when the code differs, when the cells do not line up, or when an English
notebook has no Chinese twin; the last tests feed the rule pairs made wrong on purpose,
so it is seen to fail. One process, no MPI: the notebooks are read, not run.
"""

from __future__ import annotations

import copy
import re

import pytest

from tests.course import ZH_NOTEBOOKS
from tests.translations import CHINESE, ENGLISH, digest, load, pair_problems, source, status

PAIRS = sorted(ENGLISH.glob("*.ipynb"))
# a script a cell opens by a bare name, relative to the kernel's folder (not classroom.lesson's)
SCRIPT_LOOKUP = re.compile(r'(?:Path|run_path)\("([\w.-]+\.py)"\)')


def test_every_english_notebook_has_a_chinese_twin_in_step():
    assert status() == [], "\n" + "\n".join(status()) + (
        "\n(python -m tests.translations --status; translate, then --stamp NAME CELL...)")


def test_the_digest_is_the_first_12_hex_digits_of_the_sha256_of_the_cell_text():
    # sha256("") = e3b0c44298fc1c149afbf4c8996fb924...
    assert digest("") == "e3b0c44298fc"
    assert digest("数据并行") != digest("数据并行 ")
    assert source({"source": ["a\n", "b"]}) == source({"source": "a\nb"}) == "a\nb"


@pytest.mark.parametrize("path", PAIRS, ids=lambda path: path.stem)
def test_a_chinese_notebook_is_stored_without_outputs_and_runs_from_its_folder(path):
    """Its code cells as handed out (no outputs), and each lesson script a code cell looks
    up by a bare name (`Path("09_planning.py")`, found from the notebook's folder) is in
    lessons/zh/ too: the same file, linked, so a kernel started there finds it."""
    chinese = CHINESE / path.name
    if not chinese.exists():
        pytest.skip(f"{chinese.name}: no twin (the test above names it)")
    notebook = load(chinese)
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, (
                f"lessons/zh/{path.name} cell {index}: strip the outputs")
            for name in SCRIPT_LOOKUP.findall(source(cell)):
                if (ENGLISH / name).exists():
                    linked = CHINESE / name
                    assert linked.exists() and linked.resolve() == (ENGLISH / name).resolve(), (
                        f"lessons/zh/{path.name} cell {index} runs {name}: lessons/zh/{name} "
                        f"must link to ../{name}")


def test_make_course_runs_the_first_weeks_chinese_notebooks():
    assert [path.stem[:2] for path in ZH_NOTEBOOKS] == ["00", "01", "02", "03", "04", "05"]
    assert all(path.parent == CHINESE and path.exists() for path in ZH_NOTEBOOKS)


# ----------------------------------------------------- the rule, seen to fail
def a_pair() -> tuple[dict, dict]:
    """A small English notebook and its current translation."""
    english = {"cells": [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Data parallelism\n", "Each"]},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "print(1)"},
        {"cell_type": "markdown", "metadata": {}, "source": "The gradient sync."}]}
    chinese = copy.deepcopy(english)
    for cell, text in zip(chinese["cells"][::2], ["# 数据并行\n每张卡", "梯度同步。"]):
        cell["source"] = text
    for en, zh in zip(english["cells"][::2], chinese["cells"][::2]):
        zh["metadata"] = {"minipar": {"translates": digest(source(en))}}
    return english, chinese


def test_a_current_pair_passes():
    assert pair_problems(*a_pair(), "zh/99.ipynb") == []


def test_an_english_cell_changed_after_its_translation_is_named_stale():
    english, chinese = a_pair()
    english["cells"][2]["source"] = "The gradient sync (AllReduce)."
    found = pair_problems(english, chinese, "zh/99.ipynb")
    assert len(found) == 1 and found[0].startswith("zh/99.ipynb cell 2: stale"), found


def test_code_that_differs_is_named():
    english, chinese = a_pair()
    chinese["cells"][1]["source"] = "print(2)"
    found = pair_problems(english, chinese, "zh/99.ipynb")
    assert len(found) == 1 and "cell 1: the code differs" in found[0], found


def test_cells_that_do_not_line_up_are_named():
    english, chinese = a_pair()
    chinese["cells"].pop()
    assert pair_problems(english, chinese, "zh/99.ipynb") == [
        "zh/99.ipynb: 2 cells, the English notebook has 3"]
    english, chinese = a_pair()
    chinese["cells"][2]["cell_type"] = "code"
    found = pair_problems(english, chinese, "zh/99.ipynb")
    assert found and "cell 2: a code cell, the English one is markdown" in found[0], found


def test_an_unstamped_or_untranslated_cell_is_named():
    english, chinese = a_pair()
    chinese["cells"][0]["metadata"] = {}
    assert "cell 0: records no translates digest" in pair_problems(
        english, chinese, "zh/99.ipynb")[0]
    english, chinese = a_pair()
    chinese["cells"][2]["source"] = "The gradient sync."   # stamped, left in English
    assert "cell 2: stamped but holds no Chinese" in pair_problems(
        english, chinese, "zh/99.ipynb")[0]


def test_a_missing_twin_and_a_stale_cell_fail_the_status_of_a_folder(tmp_path):
    """The whole check on a folder of its own: lessons/ with one notebook translated and
    then changed, and one never translated."""
    from tests.translations import save

    (tmp_path / "zh").mkdir()
    english, chinese = a_pair()
    save(copy.deepcopy(chinese), tmp_path / "zh" / "01_dp.ipynb")
    english["cells"][0]["source"] = "# Data parallelism, again"
    save(english, tmp_path / "01_dp.ipynb")
    save(a_pair()[0], tmp_path / "02_tp.ipynb")
    found = status(tmp_path)
    folder = tmp_path.name
    assert found[0].startswith(f"{folder}/zh/01_dp.ipynb cell 0: stale"), found
    assert found[1] == f"{folder}/zh/02_tp.ipynb: missing (the Chinese twin of 02_tp.ipynb)"
    assert len(found) == 2, found


# ----------------------------------------------------- the glossary
GLOSSARY = ENGLISH.parent / "docs" / "glossary.md"


def glossary_rows() -> list[list[str]]:
    """The glossary's table rows (Chinese, English, minipar, lesson), headers left out."""
    rows = [line.strip("|").split(" | ") for line in GLOSSARY.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| 中文")]
    assert rows and all(len(row) == 4 for row in rows), [r for r in rows if len(r) != 4]
    return [[cell.strip() for cell in row] for row in rows]


def test_every_glossary_name_is_in_minipars_code_and_every_lesson_exists():
    """A name in the minipar column is a file of the repository or a word some file of
    minipar/ holds (a flag without its dashes, a class, a function); a lesson column names
    lessons that exist."""
    code = "\n".join(path.read_text() for path in (ENGLISH.parent / "minipar").rglob("*.py"))
    missing = []
    for chinese, _, names, lessons in glossary_rows():
        for name in re.findall(r"`([^`]+)`", names):
            if "/" in name and " " not in name:
                found = (ENGLISH.parent / name).exists()
            else:
                word = re.sub(r"^python -m minipar ", "", name).split(" ")[0].lstrip("-")
                found = all(part.replace("-", "_") in code or part in code
                            for part in word.split("."))
            if not found:
                missing.append(f"{chinese}: {name}")
        for number in re.findall(r"\b\d\d\b", lessons):
            if not list(ENGLISH.glob(f"{number}_*.py")):
                missing.append(f"{chinese}: lesson {number}")
    assert missing == []


def test_the_glossary_holds_the_sources_terms():
    terms = " ".join(row[0] for row in glossary_rows())
    for term in ("数据并行", "张量并行", "模型内并行", "专家并行", "流水线并行", "梯度同步",
                 "AllReduce", "AllGather", "AllToAll", "显存", "层内", "层间", "batch",
                 "pipeline bubble", "stage", "激活值", "router", "负载不均衡", "吞吐率"):
        assert term in terms, term
