"""The Chinese notebooks kept in step with the English ones they translate.

Every notebook in lessons/ has a twin of the same name in lessons/zh/: the same cells in
the same order, every code cell's text identical to the English one's (a teacher opens
either folder and runs the same lesson), every markdown cell in Chinese. Each Chinese
markdown cell records which English text it translates: the first 12 hex digits of the
sha256 of the English cell's source (UTF-8), in its metadata as
`{"minipar": {"translates": "<12 hex digits>"}}`. When the English cell changes, its
digest changes and the Chinese cell no longer matches it: the translation is stale, and
`problems` names the notebook and the cell (tests/teaching/test_translations.py fails on
it). The translator reads the English cell again, rewrites the Chinese one, and stamps it:

    python -m tests.translations --status                       # every stale or missing cell
    python -m tests.translations --stamp 07_zero 3 5             # cells 3 and 5 translated again
    python -m tests.translations --copy-code 07_zero             # the English code cells copied
    python -m tests.translations --new 18_diloco                 # a twin to translate: English
                                                                 # text, code copied, unstamped

Cell numbers count from 0 over all the notebook's cells, markdown and code alike (as
nbformat lists them). `--status` exits 1 when anything is out of step.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGLISH = ROOT / "lessons"
CHINESE = ENGLISH / "zh"
CJK = re.compile(r"[\u4e00-\u9fff]")   # a translated cell holds Chinese characters


def source(cell: dict) -> str:
    """A cell's text as one string (nbformat stores it as a string or a list of lines)."""
    text = cell.get("source", "")
    return text if isinstance(text, str) else "".join(text)


def digest(text: str) -> str:
    """The first 12 hex digits of the sha256 of `text` in UTF-8: what a translation of it
    records."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def translates(cell: dict) -> str | None:
    """The digest a Chinese markdown cell records (None: it records none)."""
    return cell.get("metadata", {}).get("minipar", {}).get("translates")


def twin(english: Path) -> Path:
    """lessons/<name>.ipynb -> lessons/zh/<name>.ipynb."""
    return english.parent / "zh" / english.name


def load(path: Path) -> dict:
    """A notebook as JSON."""
    return json.loads(path.read_text(encoding="utf-8"))


def save(notebook: dict, path: Path) -> None:
    """Write a notebook as nbformat writes it: sorted keys, one-space indent, UTF-8 kept as
    is, each cell's source a list of lines."""
    for cell in notebook["cells"]:
        cell["source"] = source(cell).splitlines(keepends=True)
    path.write_text(json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def pair_problems(english: dict, chinese: dict, name: str) -> list[str]:
    """Everything that keeps the Chinese notebook `chinese` from being a current
    translation of `english`, one line each naming `name` and the cell: the cell counts
    or a cell's type differ, a code cell's text differs, a markdown cell records no
    digest, a digest that is not the English cell's (the English changed after the
    translation: stale), or a "translation" with no Chinese in it. [] when in step."""
    en_cells, zh_cells = english["cells"], chinese["cells"]
    if len(en_cells) != len(zh_cells):
        return [f"{name}: {len(zh_cells)} cells, the English notebook has {len(en_cells)}"]
    found = []
    for index, (en, zh) in enumerate(zip(en_cells, zh_cells)):
        where = f"{name} cell {index}"
        if en["cell_type"] != zh["cell_type"]:
            found.append(f"{where}: a {zh['cell_type']} cell, the English one is "
                         f"{en['cell_type']}")
        elif en["cell_type"] == "code":
            if source(en) != source(zh):
                found.append(f"{where}: the code differs from the English notebook's "
                             f"(English begins {source(en)[:60]!r})")
        else:
            recorded, current = translates(zh), digest(source(en))
            if recorded is None:
                found.append(f"{where}: records no translates digest (untranslated?)")
            elif recorded != current:
                found.append(f"{where}: stale: translates {recorded}, the English cell is "
                             f"now {current} (begins {source(en)[:60]!r})")
            elif source(en).strip() and not CJK.search(source(zh)):
                found.append(f"{where}: stamped but holds no Chinese")
    return found


def status(english_dir: Path = ENGLISH) -> list[str]:
    """Every English notebook against its twin: a missing twin, and `pair_problems`;
    also a Chinese notebook that translates no English one."""
    found = []
    for path in sorted(english_dir.glob("*.ipynb")):
        other = twin(path)
        name = f"{english_dir.name}/zh/{path.name}"
        if not other.exists():
            found.append(f"{name}: missing (the Chinese twin of {path.name})")
            continue
        found += pair_problems(load(path), load(other), name)
    found += [f"{english_dir.name}/zh/{path.name}: no English notebook "
              f"{path.name} in {english_dir.name}/"
              for path in sorted((english_dir / "zh").glob("*.ipynb"))
              if not (english_dir / path.name).exists()]
    return found


def stamp(name: str, cells: list[int]) -> None:
    """Record, in each of the Chinese cells given, the digest of the English cell at the
    same place: say that these cells translate today's English text."""
    english, path = load(ENGLISH / f"{name}.ipynb"), CHINESE / f"{name}.ipynb"
    chinese = load(path)
    for index in cells:
        en, zh = english["cells"][index], chinese["cells"][index]
        if en["cell_type"] != "markdown" or zh["cell_type"] != "markdown":
            raise SystemExit(f"{path.name} cell {index}: not a markdown cell in both")
        zh.setdefault("metadata", {}).setdefault("minipar", {})["translates"] = digest(
            source(en))
    save(chinese, path)


def copy_code(name: str) -> None:
    """Copy every English code cell's text into the Chinese notebook (same cell counts)."""
    english, path = load(ENGLISH / f"{name}.ipynb"), CHINESE / f"{name}.ipynb"
    chinese = load(path)
    if len(english["cells"]) != len(chinese["cells"]):
        raise SystemExit(f"{path.name}: cell counts differ; start again from --new")
    for en, zh in zip(english["cells"], chinese["cells"]):
        if en["cell_type"] == "code":
            zh["source"] = copy.deepcopy(en["source"])
    save(chinese, path)


def new(name: str) -> None:
    """lessons/zh/<name>.ipynb from the English notebook, its markdown still English and
    unstamped (so `status` lists every cell to translate); refuses to overwrite."""
    path = CHINESE / f"{name}.ipynb"
    if path.exists():
        raise SystemExit(f"{path} exists")
    notebook = load(ENGLISH / f"{name}.ipynb")
    for cell in notebook["cells"]:
        cell.get("metadata", {}).pop("minipar", None)
    save(notebook, path)


def main(argv: list[str] | None = None) -> int:
    """The command line of the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--status", action="store_true", help="list what is out of step")
    group.add_argument("--stamp", nargs="+", metavar="NAME CELL",
                       help="a notebook's name and the cells just translated")
    group.add_argument("--copy-code", metavar="NAME", help="copy the English code cells")
    group.add_argument("--new", metavar="NAME", help="start the twin of a new notebook")
    args = parser.parse_args(argv)
    if args.stamp:
        stamp(args.stamp[0], [int(cell) for cell in args.stamp[1:]])
    elif args.copy_code:
        copy_code(args.copy_code)
    elif args.new:
        new(args.new)
    found = status()
    print("\n".join(found) if found else "translations: every Chinese notebook in step "
          f"({len(list(CHINESE.glob('*.ipynb')))} notebooks)")
    return 1 if found and args.status else 0


if __name__ == "__main__":
    sys.exit(main())
