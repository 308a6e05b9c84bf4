# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test lint typecheck pytest django6 docs schema chaos bench bench-soak dev clean pgbouncer chromium sql-golden

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
	@touch $@ $(VENV)/.installed-base $(VENV)/.installed-docs

$(VENV)/.installed-docs: pyproject.toml | $(PY)
	$(PIP) install --quiet -e '.[docs]'
	@touch $@ $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(PY) examples/quickstart.py

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check aioq examples tests docs/hooks.py
	$(VENV)/bin/ruff format --check aioq examples tests docs/hooks.py

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy --strict aioq examples docs/hooks.py

# The suite on PYTEST_WORKERS processes (pytest-xdist), each with its own embedded PostgreSQL
# and a fresh database per test: most tests wait on the server and on worker processes rather
# than compute, so two processes share a 2-core machine well. PYTEST_WORKERS=0 runs it in one.
PYTEST_WORKERS ?= 2
pytest: $(VENV)/.installed-dev pgbouncer chromium
	$(PY) -m pytest -n $(PYTEST_WORKERS)

test: lint typecheck pytest django6

# Django 6 (django.tasks) needs Python >= 3.12; the main venv's Python 3.11 gets Django 5.2 and
# the django-tasks backport. Where a Python >= 3.12 exists (on PATH, or under pyenv), the Django
# tests run a second time in a venv of their own on Django 6, with psycopg2 as Django's driver
# (the main venv's Django uses psycopg 3), but for the 2 000-job load test, whose connection
# handling is the same code on both. Without one, they ran on Django 5.2 only, and say so.
PYTHON_DJANGO6 ?= $(shell for p in python3.12 python3.13 python3.14 $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { echo $$p; break; }; done)
DJANGO6_VENV := .venv-django6
$(DJANGO6_VENV)/.installed: pyproject.toml
	$(PYTHON_DJANGO6) -m venv $(DJANGO6_VENV)
	$(DJANGO6_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DJANGO6_VENV)/bin/python -m pip install --quiet -e '.[testing]' 'django>=6' \
		psycopg2-binary pytest-timeout
	@touch $@

django6:
	@if [ -z "$(PYTHON_DJANGO6)" ]; then \
		echo "django6: no Python >= 3.12 on this machine: the Django tests ran on Django 5.2 only"; \
	else \
		$(MAKE) --no-print-directory $(DJANGO6_VENV)/.installed && \
		$(DJANGO6_VENV)/bin/python -m pytest tests/test_django.py -k "not two_thousand"; \
	fi

# The documentation site (docs/*.md, MkDocs) into site/; strict, as in `make test` (which runs
# this build in tests/test_docs.py). `$(VENV)/bin/mkdocs serve` previews it while you write.
docs: $(VENV)/.installed-docs
	$(VENV)/bin/mkdocs build --strict

# The schema as it is (schema.sql) against its history (aioq/sql/migrations/): a fresh database
# through the migrations and one from schema.sql must have the same catalog; on a difference it
# prints a diff of the two (docs/architecture.md, "Tables"). Also part of `make test`.
schema: $(VENV)/.installed-dev
	$(PY) -m pytest tests/test_migrations.py -n 0 -q

# Every statement as it is sent, one file each under tests/sql/ (tests/test_sql.py compares them
# with the code): run after changing a statement or a fragment, and commit what it wrote.
sql-golden: $(VENV)/.installed-dev
	$(PY) tests/golden.py

# The reliability suite's long profile: longer runs, more faults (the quick one is in `make test`).
chaos: $(VENV)/.installed-dev pgbouncer
	AIOQ_CHAOS_PROFILE=long $(PY) -m pytest -m chaos tests/chaos --timeout 1800

# Benchmarks against the peers, in their own venv (pinned peers + aioq), on a throwaway stock
# PostgreSQL (fsync on): writes benchmarks/RESULTS.md, results.json and charts (planned: about
# 23 min on a quiet 2-core machine; not part of `make test`). run.py builds two more venvs on
# first use: Oban's (benchmarks/.venv-oban, from a Python >= 3.12 it finds, or skipped with the
# reason) and Celery's (benchmarks/.venv-celery; it runs where Redis answers, else skipped).
# BENCH_ARGS="--quick --only drain --out /tmp/b/RESULTS.md".
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

# The soak (not part of `make bench`): the capacity of one `aioq worker --concurrency 50`
# measured first, then SOAK_MINUTES (default 60) at 70 % of it with a realistic mix, deferred by
# a process of its own, on a throwaway stock PostgreSQL; a sample every 10 s; charts into
# benchmarks/charts/, samples and verdicts (each series flat over the last 40 minutes, or the
# last two thirds of a shorter run) into benchmarks/soak-out/. `make bench-soak SOAK_MINUTES=10`
# for a developer's run; SOAK_ARGS="--autovacuum off" for a server without autovacuum.
SOAK_MINUTES ?= 60
SOAK_ARGS ?=
bench-soak: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/soak.py run --minutes $(SOAK_MINUTES) --sample 10 \
		--charts benchmarks/charts --out benchmarks/soak-out $(SOAK_ARGS)

# PgBouncer for the transaction-mode chaos scenario: installed with apt-get when missing and we
# are root. Never fails the build: without it that one scenario skips and says why.
PGBOUNCER_LOG := /tmp/aioq-pgbouncer-install.log
pgbouncer:
	@if command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "pgbouncer: not installed and not root; its chaos scenario will skip"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "pgbouncer: not installed and no apt-get; its chaos scenario will skip"; \
	elif { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends pgbouncer || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -q --no-install-recommends pgbouncer; }; } >$(PGBOUNCER_LOG) 2>&1; then \
		echo "pgbouncer: installed with apt-get"; \
	else \
		echo "pgbouncer: apt-get install failed ($$(tail -n 1 $(PGBOUNCER_LOG))); its chaos scenario will skip"; \
	fi

# Chromium for the dashboard's browser tests (Playwright drives the system's browser; it never
# downloads one): installed with apt-get when missing and we are root. Never fails the build:
# without it the browser tests skip and say why.
CHROMIUM_LOG := /tmp/aioq-chromium-install.log
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "chromium: not installed and not root; the browser tests will skip"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "chromium: not installed and no apt-get; the browser tests will skip"; \
	elif { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		  apt-get install -y -q --no-install-recommends chromium; }; } >$(CHROMIUM_LOG) 2>&1; then \
		echo "chromium: installed with apt-get"; \
	else \
		echo "chromium: apt-get install failed ($$(tail -n 1 $(CHROMIUM_LOG))); the browser tests will skip"; \
	fi

# An embedded throwaway PostgreSQL for development: prints its DSN, Ctrl-C removes it.
dev: $(VENV)/.installed-base
	$(VENV)/bin/aioq dev

clean:
	rm -rf $(VENV) $(DJANGO6_VENV) .mypy_cache .ruff_cache .pytest_cache dist build site
