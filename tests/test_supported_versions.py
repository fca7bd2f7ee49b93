"""The supported dependency range: declared once in pyproject.toml, pinned at its floor for CI.

``make test`` runs the whole suite on the newest releases the range admits; ``make test-oldest``
installs ``requirements-oldest.txt`` (the range's lower bounds) and runs a smoke subset. These
checks keep the two files in step and make sure a run happens inside the declared range.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

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


def test_jax_and_the_brain_packages_have_a_tested_ceiling() -> None:
    for name, spec in _declared().items():
        if name == "numpy":
            continue
        assert any(s.operator == "<" for s in spec), f"{name} {spec} has no upper bound"


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



@pytest.mark.parametrize("takes_zeros", [True, False])
def test_call_pullback_gives_the_same_cotangents_on_either_kind_of_jax(
    monkeypatch: pytest.MonkeyPatch, takes_zeros: bool,
) -> None:
    import jax
    import jax.numpy as jnp

    from braintrace import _compatible_imports as compat

    if takes_zeros and not compat._PULLBACK_TAKES_SYMBOLIC_ZEROS:
        pytest.skip("this JAX's pullbacks refuse symbolic zeros")
    monkeypatch.setattr(compat, "_PULLBACK_TAKES_SYMBOLIC_ZEROS", takes_zeros)
    x = jnp.arange(3.0)
    _, vjp_fn = jax.vjp(lambda a: (jnp.sin(a), {"h": 3.0 * a}), x)
    (got,) = compat.call_pullback(vjp_fn, (jnp.ones(3), {"h": compat.ad.Zero(jax.typeof(x))}))
    assert jnp.allclose(got, jnp.cos(x))
    (both,) = compat.call_pullback(vjp_fn, (jnp.ones(3), {"h": jnp.ones(3)}))
    assert jnp.allclose(both, jnp.cos(x) + 3.0)
