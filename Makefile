# Trellis: `make demo` and `make test` each set up everything on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trellis demo

test: lint
	$(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check trellis tests benchmarks examples
	$(BIN)/mypy trellis

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,bench]'
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info
