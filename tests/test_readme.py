"""The README's example runs."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs() -> None:
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    losses = namespace["result"].losses
    assert losses.shape == (2000,)
    assert float(losses[-100:].mean()) < 0.2 * float(losses[:100].mean())
