# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test lint typecheck pytest chaos bench dev clean

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "aioq needs Python >= 3.11 (set PYTHON=python3.11 or newer)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Stamp files record what was installed, so each target reinstalls only when pyproject changes.
$(VENV)/.installed-base: pyproject.toml | $(PY)
	$(PIP) install --quiet -e .
	@touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PIP) install --quiet -e '.[dev]'
	@touch $@ $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(PY) examples/quickstart.py

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check aioq examples tests
	$(VENV)/bin/ruff format --check aioq examples tests

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy --strict aioq examples

pytest: $(VENV)/.installed-dev
	$(PY) -m pytest

test: lint typecheck pytest

# The reliability suite's long profile: longer runs, more faults (the quick one is in `make test`).
chaos: $(VENV)/.installed-dev
	AIOQ_CHAOS_PROFILE=long $(PY) -m pytest -m chaos tests/chaos --timeout 1800

# Benchmarks against the peers, in their own venv (pinned peers + aioq): writes
# benchmarks/RESULTS.md and charts (not part of `make test`). BENCH_ARGS="--quick --only drain".
BENCH_VENV := benchmarks/.venv
$(BENCH_VENV)/.installed: benchmarks/requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "aioq needs Python >= 3.11 (set PYTHON=python3.11 or newer)"; exit 1; }
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet -r benchmarks/requirements.txt -e .
	@touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/run.py $(BENCH_ARGS)

# An embedded throwaway PostgreSQL for development: prints its DSN, Ctrl-C removes it.
dev: $(VENV)/.installed-base
	$(VENV)/bin/aioq dev

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache dist build
