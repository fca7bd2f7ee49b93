"""The supported dependency range: declared once in pyproject.toml, pinned at its floor for CI.

``make test`` runs the whole suite on the newest releases Python 3.11 offers; ``make test-oldest``
installs ``requirements-oldest.txt`` (the range's lower bounds) and runs a smoke subset. These
checks keep those files, the tested releases braintrace warns beyond, the docs and the README in
step, and make sure a run happens inside the declared range.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from braintrace._tested_versions import TESTED_RELEASES, untested_releases

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _declared() -> dict[str, SpecifierSet]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}


def _oldest_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements-oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        (spec,) = Requirement(line).specifier
        assert spec.operator == "==", f"requirements-oldest.txt pins exact versions; got {line!r}"
        pins[Requirement(line).name] = Version(spec.version)
    return pins


def _docs_section() -> str:
    text = (ROOT / "docs" / "compatibility.md").read_text()
    return text.split("## Supported versions", 1)[1].split("\n## ", 1)[0]


def _lower_bound(spec: SpecifierSet) -> Version:
    (low,) = [Version(s.version) for s in spec if s.operator == ">="]
    return low


def test_every_dependency_has_a_floor_and_the_pins_are_those_floors() -> None:
    declared, pins = _declared(), _oldest_pins()
    assert sorted(pins) == sorted(declared)
    for name, spec in declared.items():
        assert pins[name] in spec, (name, pins[name], spec)
        # The floor a pin tests is the one declared: ">=0.10" is tested by 0.10.0.
        assert pins[name] == _lower_bound(spec), (name, pins[name], spec)


def test_an_upper_bound_only_where_the_docs_give_its_reason() -> None:
    """No ceiling unless docs/compatibility.md, "Supported versions", names it with the reason."""
    section = _docs_section()
    for name, spec in _declared().items():
        for ceiling in (s for s in spec if s.operator in ("<", "<=", "!=", "~=", "==")):
            assert f"{name}{ceiling}" in section, (
                f"{name} {spec}: the bound {ceiling} is not documented in docs/compatibility.md")


def test_the_tested_releases_start_at_the_declared_floors() -> None:
    pins = _oldest_pins()
    for name, (oldest, newest) in TESTED_RELEASES.items():
        assert Version(oldest) == pins[name] == _lower_bound(_declared()[name]), name
        assert Version(newest) >= Version(oldest), name


def test_the_docs_table_and_the_readme_state_the_tested_ranges() -> None:
    section = _docs_section()
    readme = (ROOT / "README.md").read_text()
    rows = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| "))}
    for name, (oldest, newest) in TESTED_RELEASES.items():
        (row,) = [cells for names, cells in rows.items() if name in names.split(", ")]
        assert row[:2] == [oldest, newest], (name, row)
    flat = " ".join(readme.split())
    assert f"JAX and jaxlib {TESTED_RELEASES['jax'][0]} to {TESTED_RELEASES['jax'][1]}" in flat
    for name in ("brainstate", "brainunit", "brainevent", "braintools"):
        assert f"{name} {TESTED_RELEASES[name][0]} to {TESTED_RELEASES[name][1]}" in flat, name
    for extra in ("tpu", "cuda12", "cuda13", "cpu"):
        assert f'".[{extra}]"' in flat, extra


def test_the_platform_extras_bring_jax_in_the_declared_range() -> None:
    """``braintrace[tpu]`` (cuda12, cuda13, cpu) is JAX's build for the platform, in the same range."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for platform in ("cpu", "tpu", "cuda12", "cuda13"):
        (requirement,) = [Requirement(r) for r in extras[platform]]
        assert requirement.name == "jax" and requirement.extras == {platform}, requirement
        assert requirement.specifier == _declared()["jax"], (platform, requirement.specifier)


def test_requirements_txt_repeats_the_declared_range() -> None:
    listed = [line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert {Requirement(r).name: Requirement(r).specifier for r in listed} == _declared()


@pytest.mark.parametrize("name", sorted(_declared()))
def test_the_installed_release_is_inside_the_declared_range(name: str) -> None:
    installed = Version(importlib.metadata.version(name))
    assert installed in _declared()[name], (
        f"{name} {installed} is outside the supported range {_declared()[name]} of pyproject.toml")


def test_the_installed_releases_are_no_newer_than_tested() -> None:
    assert untested_releases() == []


@pytest.mark.skipif(not os.environ.get("BRAINTRACE_OLDEST_PINS"), reason="only in make test-oldest's environment")
def test_make_test_oldest_runs_exactly_the_pins() -> None:
    for name, pin in _oldest_pins().items():
        assert Version(importlib.metadata.version(name)) == pin, name
