# minipar: `make test` and `make demo` are all a fresh clone needs.
# Both create .venv and install into it on first use (no sudo, no system MPI).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The MPI launcher: PyPI's mpich in the venv, or a system one (make MPIEXEC=mpiexec).
MPIEXEC ?= $(VENV)/bin/mpiexec

# One BLAS thread per rank (8 ranks on 2 cores must not fight), MPI on this host only.
export OMP_NUM_THREADS := 1
export OPENBLAS_NUM_THREADS := 1
export MKL_NUM_THREADS := 1
export UCX_NET_DEVICES := lo
# A path becomes absolute (tests run from other folders); a bare name stays a PATH lookup.
export MINIPAR_MPIEXEC := $(if $(findstring /,$(MPIEXEC)),$(abspath $(MPIEXEC)),$(MPIEXEC))

RUFF_CONFIG := $(shell $(PYTHON) -c "import configparser as c; p = c.ConfigParser(); \
	p.read('setup.cfg'); print(' '.join(\"--config '%s = %s'\" % kv for kv in p['tool:ruff'].items()))")

.PHONY: install bytecode test test-fast lint hosts-test demo course lessons notebooks book test-book bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[mpich,test]'
	touch $@

install: $(VENV)/.installed

# Every module compiled to bytecode once, before a target starts ranks: an 8-rank job then has
# 8 ranks read minipar's .pyc files instead of each compiling all of minipar again. Imports
# alone never write the cache where PYTHONDONTWRITEBYTECODE is set (it is on some machines,
# this one included); compileall writes it anyway, and redoes only the files that changed.
bytecode: install
	@$(PY) -m compileall -q minipar tests lessons bench > /dev/null

lint: install
	$(PY) -m ruff check --output-format concise $(RUFF_CONFIG) minipar tests lessons bench book

# The whole suite; the 15 slowest tests are listed, then the total this machine took.
test: bytecode lint
	@start=$$(date +%s); $(PY) -m pytest --durations=15 && \
	  seconds=$$(( $$(date +%s) - start )) && echo $$seconds > bench/last_test_seconds && \
	  echo "make test: $$seconds s of pytest on $$(env -u OMP_NUM_THREADS nproc) cores"

# The edit-run loop (about a minute here): the one-process units (core, placement, planner,
# layering) and one 4-rank job that trains every strategy and mesh of four ranks (dp, cp,
# tp, pp with every schedule, ep, ZeRO) against one process. Run `make test` before a commit.
FAST := tests/core tests/placement tests/planner tests/test_layering.py \
	tests/parallel/test_every_mesh.py
test-fast: bytecode lint
	@start=$$(date +%s); $(PY) -m pytest $(FAST) -k "not 8]" && \
	  echo "make test-fast: $$(( $$(date +%s) - start )) s of pytest on $$(env -u OMP_NUM_THREADS nproc) cores"

# The several-hosts tests alone (also in `test`): two simulated hosts, each a network
# namespace on a bridge, and real jobs across them. Root only; skipped, with the reason, if not.
hosts-test: bytecode
	$(PY) -m pytest -q -rs tests/comm/test_hosts.py

# The guided tour: every strategy on 8 ranks, one line each, checked against one process;
# its figures go to build/tour.
demo: bytecode
	$(MPIEXEC) -n 8 $(PY) -m minipar tour --plot build/tour

# The course as a class runs it (tests/course.py): every lesson script on the rank count of
# its docstring's run line, at full size, its figures in build/figures/; then every notebook
# executed headless at full size (MINIPAR_QUICK=0), kept with its outputs in build/notebooks/
# (the book is built from them). A table at the end: ranks, seconds, checks passed of each;
# a failure names the lesson and the check, and fails the target.
course: bytecode
	$(PY) -m tests.course

# The two halves of the course alone.
lessons: bytecode
	$(PY) -m tests.course --lessons

notebooks: bytecode
	$(PY) -m tests.course --notebooks

# The course as a static book in build/book/ (mkdocs-material, book/build.py), from the
# executed notebooks `make course` keeps in build/notebooks/: a notebook whose own checks
# failed is refused, and the book with it. In English, and in Chinese in build/book/zh/
# (the notebooks of lessons/zh/ with the English run's outputs). Builds and reads with
# no network.
book:
	@ls build/notebooks/*.ipynb > /dev/null 2>&1 || \
	  { echo "make book: no executed notebooks in build/notebooks/: run make course first"; exit 2; }
	@$(MAKE) --no-print-directory $(VENV)/.book
	$(PY) book/build.py

$(VENV)/.book: $(VENV)/.installed setup.cfg
	$(PY) -m pip install --quiet -e '.[book]'
	touch $@

# Every page of build/book/ (English, and Chinese in build/book/zh/) in a headless Chromium
# at 1280 x 900 (Debian's, installed when missing, with Debian's CJK font; Playwright
# downloads no browser): console errors, images, internal links, widths, search in both
# languages, the language switch both ways.
test-book: $(VENV)/.book
	@test -x /usr/bin/chromium && fc-list :lang=zh | grep -q . || { apt-get update -qq && \
	  apt-get install -y -qq chromium fonts-noto-cjk > /dev/null; }
	$(PY) book/browse.py

# Speed figures, each a ratio measured side by side (writes bench/results.json).
bench: bytecode
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) build *.egg-info
	find minipar tests lessons bench -name __pycache__ -type d -prune -exec rm -rf {} +
