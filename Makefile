# Two entry points on a fresh machine: `make run` and `make test`.
# Both create .venv at the repository root and install into it on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned here, where the install happens: 2.13.0 is a CPU wheel on
# local disk; any looser requirement downloads a multi-gigabyte CUDA build.
TORCH := torch==2.13.0

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH) -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/welltempered serve --demo

test: $(STAMP)
	@tools/ensure-promtool || echo "make test: promtool/prometheus unavailable; their tests skip here (and fail in CI)"
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/temperature.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
