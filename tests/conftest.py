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


def pytest_configure(config: pytest.Config) -> None:
    """On an accelerator, float32 matrix products at full precision for the whole run.

    An accelerator's default multiplies float32 in bfloat16 passes (about three digits on a TPU),
    and the suite's float32 comparisons are of rules, not of the hardware's rounding. On CPU the
    default already is full precision.
    """
    import jax

    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")
