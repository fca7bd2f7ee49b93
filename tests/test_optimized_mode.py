"""``python -O`` runs the suite with the same results: no ``assert`` guards behaviour.

``python -O`` strips ``assert`` statements. The library has none (an AST scan of ``braintrace/``
fails on any); input checks raise library errors and broken invariants raise
``RuntimeError`` via :func:`braintrace._errors.internal_error`. The suite's own helper modules
keep their asserts under ``-O`` because ``tests/conftest.py`` registers them for pytest's
rewriting. A representative slice of the suite runs under ``python -O`` in a subprocess and
must pass every test it collects; ``make test-optimized`` runs the whole suite that way.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import braintrace
from braintrace._errors import internal_error

ROOT = Path(__file__).resolve().parents[1]
#: Tests that call into the code paths that had asserts (the ETP operators with a bias, the VJP
#: executor, D_RTRL, OTTT's traces, the sequence drivers) plus this file's own checks.
SLICE = [
    "tests/test_optimized_mode.py::test_helper_asserts_still_run",
    "tests/test_optimized_mode.py::test_interpreter_flags",
    "tests/algorithm/test_check_finite.py::test_window_mode_reports_the_window_start",
    "tests/algorithm/test_check_finite.py::test_check_finite_argument_errors",
    "tests/test_checkpoint.py::test_refuses_another_hidden_size",
]


def asserts_in(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    return [f"{filename}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Assert)]


def test_the_library_has_no_assert_statements() -> None:
    found = []
    for path in sorted(Path(braintrace.__file__).parent.rglob("*.py")):
        found += asserts_in(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "assert statements vanish under python -O; raise an error instead:\n" + "\n".join(found)


def test_the_scan_finds_asserts() -> None:  # negative control of the scan above
    assert asserts_in("def f(x):\n    assert x > 0\n    return x\n", "f.py") == ["f.py:2"]


def test_internal_errors_say_it_is_a_bug() -> None:
    err = internal_error("a relation without an input")
    assert isinstance(err, RuntimeError)
    assert "braintrace internal error: a relation without an input" in str(err) and "bug" in str(err)


def test_helper_asserts_still_run() -> None:
    from tests.algorithm.bptt import max_rel_err  # a helper module, not a test module

    with pytest.raises(AssertionError):
        max_rel_err({"a": 1.0}, {"b": 1.0})


def test_interpreter_flags() -> None:
    """Under the subprocess below, proves that -O was in force (``BRAINTRACE_EXPECT_OPTIMIZE``)."""
    assert sys.flags.optimize == int(os.environ.get("BRAINTRACE_EXPECT_OPTIMIZE", sys.flags.optimize))


def pytest_under_O(*args: str) -> str:
    cmd = [sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args]
    env = {**os.environ, "BRAINTRACE_EXPECT_OPTIMIZE": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return done.stdout + done.stderr


def test_a_slice_of_the_suite_passes_under_python_O() -> None:
    out = pytest_under_O(*SLICE)  # each entry of SLICE names one test
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"=*\s*{len(SLICE)} passed in .*", summary), out[-5000:]
