PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-all lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# `make demo` needs only the package; tests also need the dev tools, Flower (with Ray) and the optional extras.
# study/ is the HaFedHo paper's study, a plugin installed beside the library (its presets, report settings, ...).
$(VENV)/.base: pyproject.toml study/pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e . -e study
	touch $@

$(VENV)/.dev: pyproject.toml study/pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,flower,ray,track,datasets]' -e study
	touch $@ $(VENV)/.base

demo: $(VENV)/.base
	$(BIN)/hafedho demo --out runs/demo

lint: $(VENV)/.dev
	$(BIN)/ruff check src study tests benchmarks
	$(BIN)/ruff format --check src study tests benchmarks

test: lint
	$(BIN)/python -m pytest -q

test-all: lint
	$(BIN)/python -m pytest -q -m ''

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/bench_engines.py

clean:
	rm -rf $(VENV) runs .pytest_cache
