"""The course as a static book: `make book` writes build/book/ from the executed notebooks
(build/notebooks/, made by `make course`), `make test-book` opens every page in a headless
Chromium. build.py writes the pages and refuses a notebook whose own checks failed;
browse.py is the browser's check; mkdocs.yml and hooks.py are the site's settings."""
