"""float64 asked for before the import, but turned off by brainstate: ``import braintrace`` says so, once.

``import brainstate`` resets ``jax_enable_x64`` from its own precision setting (32 bits by
default), so a run configured for float64 would silently compute in float32. Each case imports
braintrace in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _import(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    return subprocess.run([sys.executable, "-W", "always::UserWarning", "-c", code], cwd=REPO,
                          env={**environ, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how", ["environment", "config"])
def test_a_float64_request_dropped_by_brainstate_is_named_once(how: str) -> None:
    if how == "environment":
        run = _import("import braintrace, jax; print(jax.config.jax_enable_x64)", JAX_ENABLE_X64="1")
    else:
        run = _import("import jax; jax.config.update('jax_enable_x64', True)\n"
                      "import braintrace; print(jax.config.jax_enable_x64)")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"
    assert run.stderr.count("float64 was asked for") == 1
    assert "brainstate.environ.set(precision=64)" in run.stderr


def test_float64_set_through_brainstate_or_not_asked_for_is_quiet() -> None:
    run = _import("import brainstate; brainstate.environ.set(precision=64)\n"
                  "import braintrace, jax; print(jax.config.jax_enable_x64)", JAX_ENABLE_X64="1")
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]
    assert "float64 was asked for" not in run.stderr
    run = _import("import braintrace")
    assert run.returncode == 0 and "float64 was asked for" not in run.stderr, run.stderr[-2000:]
