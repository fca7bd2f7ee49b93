"""The API reference covers the public names, each with a runnable example, and builds cleanly.

``tests/test_docstring_examples.py`` runs the examples; this module checks that they exist and
that every public name is on an API page of ``docs/api/``. The Sphinx build (``make docs``,
warnings as errors) runs here too, marked slow.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import braintrace

DOCS = Path(__file__).resolve().parents[2] / "docs"
API_PAGES = sorted((DOCS / "api").glob("*.rst"))

#: Plain values in ``braintrace.__all__`` (a string and a tuple), without docstrings of their own;
#: the API reference describes them.
_NOT_DOCUMENTED_OBJECTS = {"__version__", "__version_info__"}


def _public_objects() -> list[tuple[str, object]]:
    names = [
        (f"braintrace.{name}", getattr(braintrace, name))
        for name in braintrace.__all__
        if name not in _NOT_DOCUMENTED_OBJECTS
    ]
    names += [(f"braintrace.nn.{name}", getattr(braintrace.nn, name)) for name in braintrace.nn.__all__]
    return names


PUBLIC = _public_objects()


@pytest.mark.parametrize(("qualname", "obj"), PUBLIC, ids=[q for q, _ in PUBLIC])
def test_public_name_has_an_example(qualname: str, obj: object) -> None:
    doc = obj.__doc__ or ""
    assert re.search(r"^\s*>>> ", doc, flags=re.MULTILINE), (
        f"{qualname} has no runnable example (an 'Examples' section with '>>>' lines) in its docstring"
    )


def _documented_names() -> set[str]:
    """Every ``braintrace.X`` / ``braintrace.nn.X`` an API page describes or autodocuments."""
    text = "\n".join(page.read_text() for page in API_PAGES)
    found: set[str] = set()
    module = "braintrace"
    for line in text.splitlines():
        current = re.match(r"\s*\.\. (currentmodule|module|automodule|py:module):: (\S+)", line)
        if current:
            module = current.group(2)
            if current.group(1) == "automodule":
                found.add(module)
            continue
        directive = re.match(r"\s*\.\. (?:auto\w+|py:\w+):: (\S+)", line)
        if directive:
            name = directive.group(1)
            found.add(name if name.startswith("braintrace.") else f"{module}.{name}")
    return found


def test_api_pages_exist() -> None:
    assert API_PAGES, f"no API pages under {DOCS / 'api'}"


@pytest.mark.parametrize(
    "qualname",
    [f"braintrace.{n}" for n in braintrace.__all__] + [f"braintrace.nn.{n}" for n in braintrace.nn.__all__],
)
def test_public_name_is_on_an_api_page(qualname: str) -> None:
    assert qualname in _documented_names(), f"{qualname} is not documented on any page of docs/api/"


@pytest.mark.slow
def test_sphinx_build_has_no_warnings(tmp_path: Path) -> None:
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_nb") is None:
        pytest.skip("sphinx and myst-nb are not installed (pip install -e '.[docs]')")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, f"sphinx build failed or warned:\n{result.stderr[-6000:]}"
    assert (tmp_path / "html" / "api" / "index.html").exists()


LEARNERS = ["ETraceVjpAlgorithm", "ParamDimVjpAlgorithm", "D_RTRL", "IODimVjpAlgorithm", "pp_prop", "EProp",
            "OSTLRecurrent", "OSTLFeedforward", "OTTT", "OTPE", "OSTTP"]


@pytest.mark.parametrize("name", LEARNERS)
def test_every_learner_documents_every_constructor_option(name: str) -> None:
    from braintrace._algorithm.engine.base import constructor_options

    cls = getattr(braintrace, name)
    undocumented = [o for o in constructor_options(cls) if f"{o} :" not in (cls.__doc__ or "")]
    assert not undocumented, f"{name}'s docstring does not list {undocumented}"
