# Two entry points on a fresh machine: `make run` and `make test`.
# Both create .venv at the repository root and install into it on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs into the one .venv: RUNTIME is what serving needs (the package and its
# dependencies: no torch, no test tools), STAMP adds the dev extras (make test, lint,
# bench). A dev install contains the runtime one, so it marks both.
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed
# torch is pinned here, where the install happens: 2.13.0 is a CPU wheel on
# local disk; any looser requirement downloads a multi-gigabyte CUDA build.
TORCH := torch==2.13.0
# The inner loop: everything but the slow tests, the ones that start processes
# (servers, workers, Prometheus) and the PostgreSQL half of the database tests.
FAST := not slow and not process and not postgres

.PHONY: run test test-fast lint bench clean

$(RUNTIME): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e .
	touch $(RUNTIME)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH) -e '.[dev]'
	touch $(STAMP) $(RUNTIME)

run: $(RUNTIME)
	$(BIN)/welltempered serve --demo

# Test processes for the in-process part of the suite (the tests that start servers,
# workers and Prometheus run afterwards, one at a time: they time real processes). 2
# halves the in-process part on a 2-core machine; each process opens its own
# PostgreSQL connections, so more need max_connections to match.
TEST_WORKERS ?= 2

# The whole suite: the CI command (.ci/run).
test: lint
	@tools/ensure-promtool || echo "make test: promtool/prometheus unavailable; their tests skip here (and fail in CI)"
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not process"
	$(BIN)/python -m pytest -m process

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto -m "$(FAST)"

# ruff, and the import contracts of pyproject.toml ([tool.importlinter]).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python bench/temperature.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .import_linter_cache
