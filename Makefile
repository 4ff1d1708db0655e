# `make demo` and `make test` set everything up themselves in ./.venv (CPU torch from the local wheel).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: a looser spec would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/questkv demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 --durations=15

test-fast: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 -m "not slow"

clean:
	rm -rf $(VENV)
