# Developer entry points: `make test` runs the whole suite on SQLite and PostgreSQL.
PYTHON ?= python3.11
VENV := .venv
REQUIREMENTS := $(wildcard requirements*.txt)

.PHONY: venv lint test run bench chaos explore docs

venv: $(VENV)/.installed

# The stamp makes pip re-run only when a requirements file changes.
# python3 is accepted in place of $(PYTHON) only if it is 3.11 (the pinned
# requirements were resolved for 3.11).
$(VENV)/.installed: $(REQUIREMENTS)
	@if [ ! -x $(VENV)/bin/python ]; then \
	  py="$(PYTHON)"; \
	  if ! command -v "$$py" >/dev/null 2>&1; then \
	    py=python3; \
	    "$$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
	      || { echo "error: need Python 3.11: no $(PYTHON), python3 is not 3.11" >&2; exit 1; }; \
	  fi; \
	  echo "creating $(VENV) with $$py"; \
	  "$$py" -m venv $(VENV); \
	fi
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

# Installs the OS packages it needs (bin/ensure-packages), then starts its own
# redis-server and PostgreSQL cluster; see tests/suite.py.
# The lint gates run first; `make lint` runs them alone.
test:
	bin/ensure-packages test
	$(MAKE) venv
	$(MAKE) lint
	$(VENV)/bin/python -m tests.suite $(PYTEST_ARGS)

# ruff and mypy, as configured in pyproject.toml. mypy's Django plugin loads
# project.settings, which needs DJANGO_DEBUG=1 (or a SECRET_KEY) to load.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	DJANGO_DEBUG=1 $(VENV)/bin/mypy

# The fault-injection soak alone, on PostgreSQL: make chaos DURATION=600
DURATION ?= 600
chaos:
	bin/ensure-packages test
	$(MAKE) venv
	SCHEDULER_SUITE_DATABASES=postgresql CHAOS_DURATION=$(DURATION) $(VENV)/bin/python -m tests.suite tests/chaos -s

# Every failpoint x action in a small real cluster, on PostgreSQL (about 30 minutes);
# the matrix goes to bench/results/explore.json. make explore EXPLORE_ARGS="--database sqlite"
# runs it on SQLite; --points and --actions pick scenarios, --fast the subset make test runs.
EXPLORE_ARGS ?=
explore:
	bin/ensure-packages test
	$(MAKE) venv
	$(VENV)/bin/python -m bench.explore $(EXPLORE_ARGS)

# The manual, from docs/ into site/ (strict: a broken link or a page left out of the nav fails).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Benchmarks (each starts its own PostgreSQL and Redis); results in bench/results/.
bench: venv
	$(VENV)/bin/python -m bench.failover
	$(VENV)/bin/python -m bench.shards
	$(VENV)/bin/python -m bench.scale
	$(VENV)/bin/python -m bench.burst
	$(VENV)/bin/python -m bench.tick_backlog
	$(VENV)/bin/python -m bench.worker_overhead
	$(VENV)/bin/python -m bench.admin_scale

# Local demo: admin on http://127.0.0.1:8000/admin/, one worker, two beat replicas.
# honcho runs the Procfile, where bin/respawn restarts a process that dies;
# bin/ensure-redis stops the redis-server it started when honcho exits. exec:
# a SIGTERM make forwards must reach ensure-redis, not an intermediate shell.
run: export DJANGO_DEBUG ?= 1
run:
	bin/ensure-packages run
	$(MAKE) venv
	$(VENV)/bin/python manage.py migrate --noinput
	$(VENV)/bin/python manage.py demo
	PYTHON=$(VENV)/bin/python exec bin/ensure-redis $(VENV)/bin/honcho start -f Procfile
