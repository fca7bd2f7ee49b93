"""nn tests compile models whose excluded weights raise compiler UserWarnings; `quiet` collects them."""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import pytest


@pytest.fixture
def quiet() -> Iterator[list[Any]]:
    """Collect the compiler's ``UserWarning``s instead of failing on them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        yield caught
