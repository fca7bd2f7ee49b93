"""Table rows of the operator contract tests, one module per primitive family.

Every module here defines ``CASES: list[OpCase]``; :data:`ALL_CASES` collects them.
"""

from __future__ import annotations

import importlib
import pkgutil

from tests.op.opcase import OpCase

ALL_CASES: list[OpCase] = []
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    ALL_CASES.extend(importlib.import_module(f"{__name__}.{_info.name}").CASES)
