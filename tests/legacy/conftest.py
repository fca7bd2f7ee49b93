"""Legacy tests reset the one-time deprecation registry; `quiet` collects compiler warnings."""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import pytest

from braintrace._legacy import _deprecation


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """Every deprecated name warns again on its next access (and afterwards)."""
    _deprecation.reset_warned()
    yield
    _deprecation.reset_warned()


@pytest.fixture
def quiet() -> Iterator[list[Any]]:
    """Collect the compiler's ``UserWarning``s instead of failing on them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        yield caught
