# Two commands set everything up on a fresh machine:
#   make serve   -> creates .venv, installs, serves the built-in tiny model on 127.0.0.1:8000
#   make test    -> creates .venv, installs, runs the whole test suite once, in three passes:
#                   the unit tests on $(JOBS) pytest-xdist workers (one module per worker at a
#                   time), then serially the tests that bring their own load or faults (marker
#                   `loaded`), then the Ray and e2e modules beside two CPU-burning processes (the
#                   busy machine CI is)
#   make test-loaded -> only the Ray and e2e modules beside the two CPU hogs
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_ARGS ?=
# NOTE: the unit pass's workers; CI has 2 cores. `loaded` tests never share the machine with
# them: their bounds compare against the idle machine (a bystander's latency, scale-up times).
JOBS ?= 2

.PHONY: install serve test test-loaded test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' 'torch==2.13.0'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/swaserve serve $(SERVE_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not ray and not loaded' -n $(JOBS) --dist loadfile --durations=15
	$(BIN)/python -m pytest -q -m 'loaded' --durations=15
	$(BIN)/python -m pytest -q -m 'ray and not loaded' --cpu-hogs 2 --durations=15

test-loaded: $(STAMP)
	$(BIN)/python -m pytest -q -m 'ray and not loaded' --cpu-hogs 2 --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow and not ray' -n $(JOBS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
