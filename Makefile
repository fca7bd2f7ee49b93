# Set-up and checks. Every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The suite on the CPU compiles XLA's kernels without LLVM's optimisations: its programs are small
# and compiled once each, so compiling is most of a test's time (make test 28 -> 23.5 min on two
# cores). The level changes how a kernel's sums round in the last bits, not what the comparisons
# find; no test times a kernel. A level set in XLA_FLAGS wins; make test-device leaves them as
# they are.
CPU_SUITE := XLA_FLAGS="--xla_backend_optimization_level=0 $$XLA_FLAGS"

.PHONY: test test-oldest test-jax test-newest test-exhaustive test-long test-optimized test-device device-wheels fuzz typecheck demo bench docs clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml requirements.txt
	$(PY) -m pip install --quiet -e ".[test]"
	# brainpy.state, for the parity tests of braintrace.nn's neurons: installed when installable.
	$(PY) -m pip install --quiet -e ".[test,brainpy]" || echo "brainpy extra not installable: its tests skip"
	touch $@

$(VENV)/.demo: $(VENV)/.base pyproject.toml requirements.txt
	$(PY) -m pip install --quiet -e ".[demo]"
	touch $@

$(VENV)/.docs: $(VENV)/.base pyproject.toml requirements.txt
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $@

# Every test the project ships, the whole grids and the long streams included (CI runs this).
test: $(VENV)/.test
	$(CPU_SUITE) $(PY) -m pytest -n 2 -q --durations=20
	$(MAKE) typecheck

# Only the rest of the test grids beyond their representative cases (`make test` runs them too).
test-exhaustive: $(VENV)/.test
	$(CPU_SUITE) $(PY) -m pytest -n 2 -q -m exhaustive

# The model fuzzer's long profile: fresh random models for FUZZ_SECONDS of wall time (one process).
# Each case has FUZZ_CASE_SECONDS (default 180 s) of wall time; one that overruns it is a hang, and the
# watchdog prints "FUZZ CASE HANG", the phase, the FuzzCase(...) to paste into
# tests/fuzz/test_regressions.py and every thread's stack, then exits with status 124.
FUZZ_SECONDS ?= 600
fuzz: $(VENV)/.test
	FUZZ_SECONDS=$(FUZZ_SECONDS) $(PY) -m pytest -q -s -p no:cacheprovider tests/fuzz/test_fuzz.py -k for_the_given_time

# Only the streams of 10^6 steps through etrace_train (`make test` runs them too).
test-long: $(VENV)/.test
	$(CPU_SUITE) $(PY) -m pytest -q -m long

# The suite of make test under python -O, which strips assert statements: the same results.
test-optimized: $(VENV)/.test
	$(CPU_SUITE) $(PY) -O -m pytest -n 2 -q -m "not exhaustive and not long"

# The oldest releases of the supported range (requirements-oldest.txt, the lower bounds in
# pyproject.toml: JAX 0.8.0) in their own environment, exactly those releases, and a smoke subset
# of the suite on them: ops, the compiler's JAX adapter, every learner family, the drivers,
# checkpoints and nn. `make test` covers the newest; `make test-jax JAX=0.9.0` one JAX in between.
OLDEST := .venv-oldest
OLDEST_PY := $(OLDEST)/bin/python
SMOKE_TESTS := tests/test_supported_versions.py tests/test_jax_compat.py tests/test_tested_versions.py \
	tests/op/test_primitive.py tests/op/test_dense.py tests/op/test_sparse.py \
	tests/compiler/test_jaxpr_graph.py tests/compiler/test_relations.py \
	tests/algorithm/test_config.py tests/algorithm/test_api_0_2_5.py tests/algorithm/test_dni.py \
	tests/algorithm/test_reset.py tests/algorithm/test_etrace_train.py tests/algorithm/test_instant_traces.py \
	tests/test_checkpoint.py tests/nn/test_online_learning.py tests/nn/test_exports.py

$(OLDEST)/.base:
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	touch $@

$(OLDEST)/.test: $(OLDEST)/.base pyproject.toml requirements-oldest.txt
	$(OLDEST_PY) -m pip install --quiet -c requirements-oldest.txt -e . pytest pytest-xdist hypothesis
	touch $@

# BRAINTRACE_OLDEST_PINS: tests/test_supported_versions.py checks that the installed releases are
# exactly requirements-oldest.txt's.
test-oldest: $(OLDEST)/.test
	BRAINTRACE_OLDEST_PINS=1 $(CPU_SUITE) $(OLDEST_PY) -m pytest -n 2 -q -p no:cacheprovider \
		-m "not slow and not exhaustive and not long" $(SMOKE_TESTS)

# The smoke subset on one JAX release (jax and jaxlib), the other dependencies at their oldest:
# `make test-jax JAX=0.9.0`. CI runs the two ends (make test, make test-oldest), not this.
JAX ?= 0.9.0
JAX_VENV = .venv-jax-$(JAX)
test-jax:
	$(PYTHON) -m venv $(JAX_VENV)
	$(JAX_VENV)/bin/python -m pip install --quiet --upgrade pip
	grep -v '^jax' requirements-oldest.txt > $(JAX_VENV)/constraints.txt
	$(JAX_VENV)/bin/python -m pip install --quiet -c $(JAX_VENV)/constraints.txt -e . "jax==$(JAX)" "jaxlib==$(JAX)" \
		pytest pytest-xdist hypothesis
	$(CPU_SUITE) $(JAX_VENV)/bin/python -m pytest -n 2 -q -p no:cacheprovider -m "not slow and not exhaustive and not long" \
		$(SMOKE_TESTS)

# The smoke subset on the newest releases pip finds for Python 3.12 (JAX >= 0.11, brainstate 0.6,
# brainunit 0.6, brainevent 0.3 and braintools 0.4 need it), in .venv-newest. Those releases are
# newer than the tested range (the whole suite has not run on them), so the two checks that the
# installed releases lie inside it are left out. CI does not run it (docs/compatibility.md).
# A Python 3.12 interpreter (with pyenv: make test-newest NEWEST_PYTHON=$(pyenv prefix 3.12.1)/bin/python).
NEWEST_PYTHON ?= python3.12
NEWEST := .venv-newest
test-newest:
	$(NEWEST_PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST)/bin/python -m pip install --quiet --upgrade -e . pytest pytest-xdist hypothesis
	$(CPU_SUITE) $(NEWEST)/bin/python -m pytest -n 2 -q -p no:cacheprovider -m "not slow and not exhaustive and not long" \
		--deselect tests/test_supported_versions.py::test_the_installed_releases_are_no_newer_than_tested \
		--deselect tests/test_tested_versions.py::test_importing_braintrace_checks_the_installed_releases \
		$(SMOKE_TESTS)

# The wheels an accelerator machine without a package index lacks: every runtime dependency but
# JAX and what the machine's JAX brings (jaxlib, numpy, scipy, ml_dtypes, opt_einsum), at the
# releases installed in .venv (those `make test` ran on), for each Python of DEVICE_PYTHONS on
# x86-64 Linux (a TPU machine's 3.11, a GPU machine's 3.12). scripts/on_device.sh installs there
# those the machine does not have (benchmarks/README.md).
DEVICE_WHEELS := .device-wheels
DEVICE_PYTHONS ?= 3.11 3.12
DEVICE_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014,--platform $(p)_x86_64)
device-wheels: $(VENV)/.test
	rm -rf $(DEVICE_WHEELS)
	mkdir -p $(DEVICE_WHEELS)
	$(PY) -m pip freeze --exclude-editable > $(DEVICE_WHEELS)/tested-releases.txt
	$(foreach v,$(DEVICE_PYTHONS),$(PY) -m pip download --quiet --dest $(DEVICE_WHEELS) --only-binary=:all: \
		--python-version $(v) --implementation cp $(DEVICE_PLATFORMS) --platform any \
		-c $(DEVICE_WHEELS)/tested-releases.txt -r requirements.txt optax msgpack &&) true
	rm -f $(DEVICE_WHEELS)/tested-releases.txt $(DEVICE_WHEELS)/jax-* $(DEVICE_WHEELS)/jaxlib-* \
		$(DEVICE_WHEELS)/numpy-* $(DEVICE_WHEELS)/scipy-* $(DEVICE_WHEELS)/ml_dtypes-* $(DEVICE_WHEELS)/opt_einsum-*
	du -sh $(DEVICE_WHEELS)

# The part of the suite that says whether the library works on an accelerator, in one process (one
# program at a time holds a TPU): every learner against BPTT at the highest matmul precision, the
# drivers, checkpoints, the audit and the float32 product of bfloat16 parts. Runs on whatever
# platform JAX finds, the CPU included, with .venv's Python where there is one; on an accelerator
# machine with JAX only, as `scripts/on_device.sh make test-device` (benchmarks/README.md).
DEVICE_TESTS := tests/device tests/algorithm/test_memoryless_groups.py tests/algorithm/test_instant_traces.py tests/algorithm/test_sequence_drivers.py tests/algorithm/test_etrace_train.py \
	tests/test_checkpoint.py tests/test_audit.py tests/op/test_split_float32.py
test-device:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pytest -q -p no:cacheprovider --durations=15 -m "not exhaustive and not long" $(DEVICE_TESTS)

typecheck: $(VENV)/.test
	$(PY) -m mypy

demo: $(VENV)/.demo
	$(PY) examples/online_learning_demo.py

bench: $(VENV)/.test
	$(PY) -m pip install --quiet -e ".[bench]" || echo "numba not installable: sparse products run on brainevent's pure-JAX kernels"
	$(PY) -m benchmarks
	$(PY) -m benchmarks.half_precision
	$(PY) -m benchmarks.scale_out

docs: $(VENV)/.docs
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) $(OLDEST) $(NEWEST) .venv-jax-* .pytest_cache .mypy_cache
