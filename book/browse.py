"""`make test-book`: every page of build/book/ opened in a real headless Chromium.

What this file checks, as a reader would meet it: build/book/ is served on 127.0.0.1
by a small HTTP server of this process, and Debian's Chromium (driven by Playwright,
which downloads no browser of its own here) opens every page. The book fails on:

- a console error or an uncaught exception in a page;
- a request that leaves 127.0.0.1 (a web font, a script from a CDN: the book must read
  with no network);
- an image that did not load (naturalWidth 0);
- an internal link that leads nowhere: a page that is not there, or an #anchor that
  is not on its page;
- a search for "Alltoall" whose results name no lesson page;
- at a laptop's 1280 x 900 (WINDOW): a page wider than the window, a table wider than
  its column (its last columns scrolled out of sight), a figure past the window's edge
  or drawn below READABLE (0.55) of its natural width, where its labels blur.

It writes screenshots at 1280 x 900 into build/book/screenshots/: the first page, the
tops of lessons 02 and 04, lesson 04 at its widest figure (and, in a book with Chinese
pages, the Chinese first page and a Chinese lesson). The closing line counts what was checked:
`book: N pages, N images, N links checked, search ok`; exit 1 on any failure.

    python book/browse.py [--book build/book] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
IDS = re.compile(r"""\bid=["']([^"']+)["']""")
# The window every page is checked in: a laptop's screen.
WINDOW = {"width": 1280, "height": 900}
# A figure must be drawn at least this fraction of its natural width. The notebooks'
# figures carry matplotlib's 10 pt labels at 100 dpi, 14 px tall at natural size; at
# 0.55 they are 8 px, the smallest a reader makes out without zooming (the widest
# figures, three 5:1 panels of lesson 04, show at 0.59 at 1280 px; a click on any figure
# opens it at full size).
READABLE = 0.55
# A word the Chinese search must find on a Chinese lesson page: "pipeline", which the
# Chinese lessons write as the source does (流水线并行); Material's search cuts Chinese
# text into words with jieba when it builds the index.
CHINESE_WORD = "流水线"
# What a page must not do at WINDOW's width: be wider than the window, hold a table that
# is wider than its column (it would scroll, its last columns out of sight), or draw a
# figure past the window's edge or below READABLE of its natural width. Code blocks and
# the source pages' numbered code may scroll: a line of code is not cut, only out of view.
LAYOUT = """readable => {
  const problems = [], width = document.documentElement.clientWidth;
  if (document.documentElement.scrollWidth > width + 1)
    problems.push(`the page is ${document.documentElement.scrollWidth} px wide `
                  + `in a ${width} px window`);
  for (const table of document.querySelectorAll("article table:not(.highlighttable)")) {
    const column = (table.closest(".md-typeset__scrollwrap") || table.parentElement).clientWidth;
    if (table.scrollWidth > column + 1)
      problems.push(`a table ${table.scrollWidth} px wide in a ${column} px column: `
                    + JSON.stringify(table.rows[0].innerText.slice(0, 60)));
  }
  for (const image of document.querySelectorAll("article img")) {
    const box = image.getBoundingClientRect(), name = image.getAttribute("src");
    if (box.right > width + 1) problems.push(`figure ${name} reaches past the window`);
    if (image.naturalWidth && box.width < readable * image.naturalWidth)
      problems.push(`figure ${name} drawn ${Math.round(box.width)} px wide, `
                    + `${(box.width / image.naturalWidth).toFixed(2)} `
                    + `of its ${image.naturalWidth} px`);
  }
  return problems;
}"""


class Quiet(SimpleHTTPRequestHandler):
    """The book's files, without a log line per request."""

    def log_message(self, format: str, *args: object) -> None:  # the base's names
        pass


class Server(ThreadingHTTPServer):
    """A page left before a file arrived (the search index, an image) closes its
    connection: that is the browser's right, not an error of the book."""

    def handle_error(self, request: object, client_address: tuple) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def serve(folder: Path) -> tuple[ThreadingHTTPServer, str]:
    """A file server for `folder` on 127.0.0.1 (a free port), in a daemon thread."""
    server = Server(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


@functools.cache
def anchors(path: Path) -> set[str]:
    """Every id on a built page: what a `#fragment` may point at."""
    return set(IDS.findall(path.read_text(errors="replace")))


def link_problem(book: Path, base: str, href: str) -> str | None:
    """Why an internal link leads nowhere, or None. `href` is absolute (the browser's)."""
    parts = urlsplit(href)
    if not href.startswith(base):
        return None   # not ours: left to the reader's network
    relative = unquote(parts.path)[len(urlsplit(base).path):]
    target = book / relative
    if relative == "" or target.is_dir():
        target = target / "index.html"
    if not target.is_file():
        return "no such page"
    if parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in anchors(
            target):
        return f"no #{parts.fragment} on {relative or 'index.html'}"
    return None


def check(book: Path, chromium: str, shots: Path) -> tuple[list[str], dict[str, int]]:
    """Open every page; returns (failures, counts)."""
    from playwright.sync_api import sync_playwright

    pages = sorted(p.relative_to(book).as_posix() for p in book.rglob("*.html")
                   if p.name != "404.html" and "screenshots" not in p.parts)
    failures: list[str] = []
    counts = {"pages": 0, "images": 0, "links": 0}
    server, base = serve(book)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport=WINDOW)
            context.set_default_timeout(90000)   # a page, on a machine busy with other work
            outside: list[str] = []

            def only_local(route: object) -> None:
                if route.request.url.startswith(base) or route.request.url.startswith("data:"):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            context.route("**/*", only_local)
            page = context.new_page()
            problems: list[str] = []
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"exception: {e}"))
            for name in pages:
                problems.clear()
                outside.clear()
                page.goto(base + name, wait_until="load")
                images = page.eval_on_selector_all(
                    "img", "els => els.map(e => [e.getAttribute('src'), e.naturalWidth])")
                links = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
                for src, width in images:
                    if not width:
                        problems.append(f"image not loaded: {src}")
                for href in dict.fromkeys(links):
                    why = link_problem(book, base, href)
                    if why:
                        problems.append(f"link {href[len(base):]}: {why}")
                problems += page.evaluate(LAYOUT, READABLE)
                problems += [f"request outside 127.0.0.1: {url}" for url in outside]
                failures += [f"{name}: {p}" for p in problems]
                counts["pages"] += 1
                counts["images"] += len(images)
                counts["links"] += len(set(links))
            failures += search(page, base)
            if "zh/index.html" in pages:
                failures += search(page, base, CHINESE_WORD, "zh/index.html", "zh/lessons/")
                found, counts["switches"] = switches(page, base, pages)
                failures += found
            shots.mkdir(parents=True, exist_ok=True)
            counts["screenshots"] = len(screenshots(page, base, pages, shots))
            browser.close()
    finally:
        server.shutdown()
    return failures, counts


def search(page: object, base: str, word: str = "Alltoall", home: str = "index.html",
           where: str = "lessons/") -> list[str]:
    """Type `word` in the search box of the page `home`; [] when a result is a page under
    `where`. The index is built in a worker after the page loads (seconds on a busy
    machine): the word is typed again, up to three times, until results show."""
    page.goto(base + home, wait_until="networkidle")
    found: list[str] = []
    for _ in range(3):
        # the header's box (a wide window); filled whole, then a key: Material reads the
        # box on a key event, and Chinese typed character by character sends none
        page.fill("input.md-search__input", word)
        page.press("input.md-search__input", "End")
        try:
            page.wait_for_selector(".md-search-result__item", timeout=20000)
        except Exception:
            continue
        found = page.eval_on_selector_all(".md-search-result__item a",
                                          "els => els.map(e => e.href)")
        break
    if not found:
        return [f"search for {word!r} on {home}: no result at all"]
    if not any(href.startswith(base + where) for href in found):
        return [f"search for {word!r} on {home}: no page of {where} among {len(found)} "
                "results"]
    return []


def switches(page: object, base: str, pages: list[str]) -> tuple[list[str], int]:
    """Every Chinese lesson page's language switch leads to its English twin, and the
    twin's leads back: (failures, pairs checked)."""
    failures, pairs = [], 0
    for chinese in (p for p in pages if p.startswith("zh/lessons/")):
        english = chinese[len("zh/"):]
        for here, lang, there in ((chinese, "en", english), (english, "zh", chinese)):
            page.goto(base + here, wait_until="load")
            link = page.query_selector(f"a.md-select__link[hreflang={lang}]")
            href = link.evaluate("a => a.href") if link is not None else None
            if href != base + there:
                failures.append(f"{here}: the switch to {lang} leads to "
                                f"{(href or 'nothing')[len(base):] if href else 'nothing'}, "
                                f"not {there}")
        pairs += 1
    return failures, pairs


def cjk_font() -> str | None:
    """Why Chinese would draw as boxes here (no CJK font for fontconfig), or None."""
    try:
        listed = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True,
                                text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"fc-list failed ({error})"
    return None if listed.strip() else ("no font with Chinese glyphs (apt-get install "
                                        "fonts-noto-cjk)")


def screenshots(page: object, base: str, pages: list[str], shots: Path) -> list[str]:
    """At WINDOW's size: the first page; lessons 02 and 04 at their top; lesson 04 at its
    widest figure; the Chinese first page and lesson 04 (or the first Chinese lesson).
    Returns the files written."""
    written = []

    def shoot(name: str, file: str, widest: bool = False) -> None:
        page.goto(base + name, wait_until="load")
        if widest and page.query_selector("article img") is not None:
            # one jump down (no scrolling up: that shows Material's "back to top" button),
            # then a pause for the header's title to finish changing
            page.evaluate("""() => { const widest = [...document.querySelectorAll('article img')]
                .sort((a, b) => b.naturalWidth - a.naturalWidth)[0];
                window.scrollTo(0, widest.getBoundingClientRect().top + window.scrollY - 200); }""")
            page.wait_for_timeout(1000)
        page.screenshot(path=str(shots / file))
        written.append(file)

    shoot("index.html", "first-page.png")
    for number in ("02", "04"):
        lesson = next((p for p in pages if p.startswith(f"lessons/{number}_")), None)
        if lesson is not None:
            shoot(lesson, f"lesson-{number}.png")
    lesson = next((p for p in pages if p.startswith("lessons/04_")), None)
    if lesson is not None:
        shoot(lesson, "lesson-04-figure.png", widest=True)
    chinese = [p for p in pages if p.startswith("zh/lessons/")]
    if "zh/index.html" in pages:
        shoot("zh/index.html", "zh-first-page.png")
    if chinese:
        lesson = next((p for p in chinese if p.startswith("zh/lessons/04_")), chinese[0])
        shoot(lesson, "zh-lesson.png")
        shoot(lesson, "zh-lesson-figure.png", widest=True)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--book", type=Path, default=ROOT / "build/book")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args(argv)
    if not (args.book / "index.html").is_file():
        print(f"book: no {args.book}/index.html: run `make book` first", file=sys.stderr)
        return 2
    if not Path(args.chromium).is_file():
        print(f"book: no browser at {args.chromium} (apt-get install chromium)",
              file=sys.stderr)
        return 2
    chinese = (args.book / "zh/index.html").is_file()
    unreadable = cjk_font() if chinese else None
    if unreadable:
        print(f"book: the Chinese pages would show boxes: {unreadable}", file=sys.stderr)
        return 2
    failures, counts = check(args.book.resolve(), args.chromium,
                             args.book.resolve() / "screenshots")
    for failure in failures:
        print(f"FAIL {failure}")
    zh = sum(1 for p in args.book.rglob("*.html") if p.relative_to(args.book).parts[0] == "zh"
             and p.name != "404.html")
    summary = (f"{counts['pages']} pages ({zh} in Chinese), {counts['images']} images, "
               f"{counts['links']} links checked at {WINDOW['width']}x{WINDOW['height']}")
    if chinese:
        summary += f", {counts.get('switches', 0)} language switches both ways"
    if failures:
        print(f"book: {len(failures)} failure(s); {summary}")
        return 1
    searched = "search ok (Alltoall" + (f", {CHINESE_WORD}" if chinese else "") + ")"
    print(f"book: {summary}, {searched}; {counts['screenshots']} screenshots in "
          f"{args.book}/screenshots/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
