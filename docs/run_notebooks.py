"""Execute the tutorial notebooks in place, top to bottom, and save their outputs.

Run after editing a notebook, so that the saved outputs are the ones its code produces::

    .venv/bin/python docs/run_notebooks.py                     # every notebook under docs/
    .venv/bin/python docs/run_notebooks.py docs/quickstart/concepts.ipynb

``tests/docs/test_notebooks.py`` executes every notebook again in ``make test`` and fails on
any error or on a notebook whose saved outputs are missing or out of order.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

DOCS = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 300


def notebooks() -> list[Path]:
    """Every tutorial notebook under ``docs/``, in a stable order."""
    return sorted(p for p in DOCS.rglob("*.ipynb") if "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts)


def execute(path: Path) -> nbformat.NotebookNode:
    """Run ``path`` in a fresh kernel, with its own folder as working directory."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def main(argv: list[str]) -> None:
    paths = [Path(a).resolve() for a in argv] or notebooks()
    for path in paths:
        start = time.perf_counter()
        nb = execute(path)
        nbformat.write(nb, path)
        print(f"{path.relative_to(DOCS)}: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
