# Set-up and checks. Every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test typecheck venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 -q --durations=20
	$(MAKE) typecheck

typecheck: $(STAMP)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
