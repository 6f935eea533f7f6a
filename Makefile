# Trellis: `make demo` and `make test` each set up everything on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean bytecode

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# pip does not byte-compile an editable install, and where PYTHONDONTWRITEBYTECODE is set (it is on these
# machines) Python never caches it either: every process compiled Trellis's modules again (0.45 s under a
# profile, 0.2-0.3 s of a Cora run's wall time) in each `trellis` command, rank and test subprocess.
# compileall writes the caches (only for changed sources).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q trellis

demo: bytecode
	$(BIN)/trellis demo

test: lint bytecode
	$(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check trellis tests benchmarks examples
	$(BIN)/mypy trellis

bench: bytecode
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,bench]'
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info
