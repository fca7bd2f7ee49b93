"""Pytest set-up shared by the whole suite.

The helper modules under ``tests/`` (reference gradients, model builders, case tables) check
their results with ``assert``. Registering them for pytest's assertion rewriting keeps those
checks under ``python -O`` too, which strips every other ``assert``; ``make test-optimized``
runs the suite that way (``tests/test_optimized_mode.py``).
"""

import pkgutil

import pytest

import tests

pytest.register_assert_rewrite(*(f"tests.{m.name}" for m in pkgutil.iter_modules(tests.__path__)))
