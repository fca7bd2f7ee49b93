"""Compiler tests record diagnostics; their warnings are asserted explicitly where they matter."""

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
