"""Every ``Examples`` section in the package runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import warnings

import brainstate
import pytest

import braintrace

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(braintrace.__path__, prefix="braintrace.")
)


@pytest.mark.parametrize("name", MODULES)
def test_examples_in(name: str) -> None:
    module = importlib.import_module(name)
    # Examples draw random weights: start each module from one seed, whatever ran before it in this worker.
    brainstate.random.seed(0)
    with warnings.catch_warnings():
        # Examples show results; compiler diagnostics about excluded weights are not their subject.
        warnings.simplefilter("ignore", UserWarning)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
