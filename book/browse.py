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
- a search for "Alltoall" whose results name no lesson page.

It writes screenshots into build/book/screenshots/: the first page, lesson 03's top
and lesson 03's first figure. The closing line counts what was checked:
`book: N pages, N images, N links checked, search ok`; exit 1 on any failure.

    python book/browse.py [--book build/book] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import functools
import re
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
            context = browser.new_context(viewport={"width": 1440, "height": 900})
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
                problems += [f"request outside 127.0.0.1: {url}" for url in outside]
                failures += [f"{name}: {p}" for p in problems]
                counts["pages"] += 1
                counts["images"] += len(images)
                counts["links"] += len(set(links))
            failures += search(page, base)
            shots.mkdir(parents=True, exist_ok=True)
            screenshots(page, base, pages, shots)
            browser.close()
    finally:
        server.shutdown()
    return failures, counts


def search(page: object, base: str, word: str = "Alltoall") -> list[str]:
    """Type `word` in the search box of the first page; [] when a lesson page is found.
    The index is built in a worker after the page loads (seconds on a busy machine): the
    word is typed again, up to three times, until results show."""
    page.goto(base + "index.html", wait_until="networkidle")
    found: list[str] = []
    for _ in range(3):
        page.fill("input.md-search__input", "")    # the header's box (a wide window)
        page.type("input.md-search__input", word, delay=50)
        try:
            page.wait_for_selector(".md-search-result__item", timeout=20000)
        except Exception:
            continue
        found = page.eval_on_selector_all(".md-search-result__item a",
                                          "els => els.map(e => e.href)")
        break
    if not found:
        return [f"search for {word!r}: no result at all"]
    if not any("/lessons/" in href for href in found):
        return [f"search for {word!r}: no lesson page among {len(found)} results"]
    return []


def screenshots(page: object, base: str, pages: list[str], shots: Path) -> None:
    """The first page, lesson 03's top, and lesson 03 at its first figure."""
    page.goto(base + "index.html", wait_until="load")
    page.screenshot(path=str(shots / "first-page.png"))
    lesson = next((p for p in pages if p.startswith("lessons/03_")), None)
    if lesson is None:
        return
    page.goto(base + lesson, wait_until="load")
    page.screenshot(path=str(shots / "lesson-03.png"))
    if page.query_selector("article img") is not None:
        # one jump down (no scrolling up: that shows Material's "back to top" button),
        # then a pause for the header's title to finish changing
        page.evaluate("window.scrollTo(0, document.querySelector('article img')"
                      ".getBoundingClientRect().top + window.scrollY - 260)")
        page.wait_for_timeout(1000)
        page.screenshot(path=str(shots / "lesson-03-figure.png"))


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
    failures, counts = check(args.book.resolve(), args.chromium,
                             args.book.resolve() / "screenshots")
    for failure in failures:
        print(f"FAIL {failure}")
    summary = (f"{counts['pages']} pages, {counts['images']} images, {counts['links']} "
               f"links checked")
    if failures:
        print(f"book: {len(failures)} failure(s); {summary}")
        return 1
    print(f"book: {summary}, search ok; screenshots in {args.book}/screenshots/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
