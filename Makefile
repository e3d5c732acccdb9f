# The README's commands. Each creates .venv on first use and reinstalls when
# pyproject.toml changes; nothing here needs anything but python3.11 and root.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# torch is installed first and exactly: 2.13.0 is the CPU wheel on disk; any
# looser request makes pip download a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: run test lint typecheck pytest bench services clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.run-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[train]'
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.run-installed

run: $(VENV)/.run-installed
	$(BIN)/gpubot shell

services:
	PYTEST_WORKERS=$(PYTEST_WORKERS) bash scripts/ensure_services.sh

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.dev-installed
	$(BIN)/mypy

# The suite over PYTEST_WORKERS processes (pytest-xdist): many tests wait on sshd, on
# subprocesses and on PostgreSQL, so two processes pay even on a 2-core machine. loadgroup
# keeps the tests of each thing this machine has once (the isolated host accounts, the run
# account) in one worker: tests/conftest.py groups them. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2

pytest: $(VENV)/.dev-installed services
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadgroup

test: lint typecheck pytest

bench: $(VENV)/.dev-installed services
	$(BIN)/python -m bench --out bench-results.json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
