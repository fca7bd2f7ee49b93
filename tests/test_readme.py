"""The README's example runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs() -> None:
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    losses = namespace["result"].losses
    assert losses.shape == (2000,)
    assert float(losses[-100:].mean()) < 0.2 * float(losses[:100].mean())


@pytest.mark.slow
def test_readme_example_command_learns_above_chance() -> None:
    (command,) = re.findall(r"`\.venv/bin/python (examples/\S+\.py [^`]*)`", README.read_text())
    script, *args = command.split()
    done = subprocess.run([sys.executable, script, *args, "--plot", ""], cwd=README.parent,
                          capture_output=True, text=True, timeout=600, check=True)
    (accuracy,) = re.findall(r"held-out accuracy ([0-9.]+)", done.stdout)
    assert float(accuracy) > 0.75, done.stdout  # chance is 0.5
