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
export MINIPAR_MPIEXEC := $(abspath $(MPIEXEC))

RUFF_CONFIG := $(shell $(PYTHON) -c "import configparser as c; p = c.ConfigParser(); \
	p.read('setup.cfg'); print(' '.join(\"--config '%s = %s'\" % kv for kv in p['tool:ruff'].items()))")

.PHONY: install test lint demo bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[mpich,test]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check --output-format concise $(RUFF_CONFIG) minipar tests lessons

test: install lint
	@start=$$(date +%s); $(PY) -m pytest && \
	  echo $$(( $$(date +%s) - start )) > bench/last_test_seconds

# The guided tour: every strategy on 8 ranks, one line each, checked against one process.
demo: install
	$(MPIEXEC) -n 8 $(PY) -m minipar tour

# Speed figures, each a ratio measured side by side (writes bench/results.json).
bench: install
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) build *.egg-info
