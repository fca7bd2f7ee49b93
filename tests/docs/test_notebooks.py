"""Every tutorial notebook under ``docs/`` runs, and its saved outputs are a complete, in-order run.

A notebook whose code no longer runs fails here; so does one saved without outputs or with
cells run out of order (re-run ``docs/run_notebooks.py`` after editing a notebook).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
sys.path.insert(0, str(DOCS))

import run_notebooks  # noqa: E402

NOTEBOOKS = run_notebooks.notebooks()
IDS = [str(p.relative_to(DOCS)) for p in NOTEBOOKS]
#: The tutorials that take longest to run (15 s to a minute each on two cores): their execution is
#: marked exhaustive (make test runs it; make test-exhaustive runs only the marked tests).
LONG_RUNNING = {"choosing_a_learner.ipynb", "learning_rules.ipynb", "rnn_online_learning.ipynb",
                "limitations.ipynb", "customizing_primitive_transforms.ipynb", "batching.ipynb",
                "control_flow.ipynb", "hidden_states.ipynb", "graph_visualization.ipynb",
                "compiler_internals.ipynb", "custom_algorithms.ipynb", "trainer.ipynb"}
EXECUTED = [pytest.param(p, marks=pytest.mark.exhaustive) if p.name in LONG_RUNNING else p for p in NOTEBOOKS]


def _code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]


def test_there_are_tutorials() -> None:
    assert len(NOTEBOOKS) >= 10, IDS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_saved_outputs_are_one_clean_run(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    cells = _code_cells(nb)
    assert cells, f"{path.name} has no code"
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: saved execution counts {counts} are not one top-to-bottom run; "
        "re-run docs/run_notebooks.py")
    errors = [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} was saved with an error: {errors[0].ename}: {errors[0].evalue}"


def _output_kinds(nb: nbformat.NotebookNode) -> list[set[str]]:
    """Per code cell, the kinds of output it shows (streams by name, rich outputs by MIME type)."""
    kinds = []
    for cell in _code_cells(nb):
        found = set()
        for out in cell.outputs:
            if out.output_type == "stream":
                found.add(f"stream:{out.name}")
            elif out.output_type in ("display_data", "execute_result"):
                found.update(f"{out.output_type}:{mime}" for mime in out.data)
            else:
                found.add(out.output_type)
        kinds.append(found)
    return kinds


@pytest.mark.slow
@pytest.mark.parametrize("path", EXECUTED, ids=IDS)
def test_notebook_executes_and_shows_what_was_saved(path: Path) -> None:
    saved = nbformat.read(path, as_version=4)
    nb = run_notebooks.execute(path)
    errors = [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert not errors
    # A cell that now prints to stderr (a new warning), stops printing or loses its figure means
    # the saved outputs are stale.
    fresh, stored = _output_kinds(nb), _output_kinds(saved)
    changed = [i for i, (a, b) in enumerate(zip(fresh, stored)) if a != b]
    assert not changed, (
        f"{path.name}: code cells {changed} now show {[fresh[i] for i in changed]}, saved "
        f"{[stored[i] for i in changed]}; re-run docs/run_notebooks.py")
