# Set-up and checks. Every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test test-exhaustive typecheck demo bench docs clean

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

test: $(VENV)/.test
	$(PY) -m pytest -n 2 -q --durations=20 -m "not exhaustive"
	$(MAKE) typecheck

# The whole of the test grids whose representative cases run in `make test`.
test-exhaustive: $(VENV)/.test
	$(PY) -m pytest -n 2 -q -m exhaustive

typecheck: $(VENV)/.test
	$(PY) -m mypy

demo: $(VENV)/.demo
	$(PY) examples/online_learning_demo.py

bench: $(VENV)/.test
	$(PY) -m benchmarks

docs: $(VENV)/.docs
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
