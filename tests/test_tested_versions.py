"""Importing braintrace warns once per dependency newer than the releases it was tested with."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from braintrace import _tested_versions as tested

NEWEST = {package: newest for package, (_, newest) in tested.TESTED_RELEASES.items()}


def _warnings_for(installed: dict[str, str]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tested.warn_untested_releases(installed.get)
    assert all(w.category is UserWarning for w in caught)
    return [str(w.message) for w in caught]


def test_the_tested_releases_do_not_warn() -> None:
    assert _warnings_for(NEWEST) == []
    assert _warnings_for({p: oldest for p, (oldest, _) in tested.TESTED_RELEASES.items()}) == []
    assert _warnings_for({}) == []  # a package that is not installed (jaxlib from a source build) is skipped


@pytest.mark.parametrize("package", sorted(tested.TESTED_RELEASES))
def test_a_newer_release_gets_one_warning_naming_it_and_the_tested_range(package: str) -> None:
    oldest, newest = tested.TESTED_RELEASES[package]
    (message,) = _warnings_for({**NEWEST, package: "9.0.0"})
    assert message.startswith(f"{package} 9.0.0 is installed, newer than the releases braintrace was tested with "
                              f"({package} {oldest} to {newest}).")
    assert f'pip install "{package}<={newest}"' in message


@pytest.mark.parametrize(("installed", "warns"), [
    ("0.10.2", False), ("0.10.2.post1", False), ("0.10.2+cuda12", False), ("0.10.2.0", False),
    ("0.10.1", False), ("0.10.3", True), ("0.11.0rc1", True), ("0.11", True), ("1.0", True),
])
def test_only_a_later_release_counts_as_newer(installed: str, warns: bool) -> None:
    assert bool(_warnings_for({**NEWEST, "jax": installed})) is warns


def test_every_newer_package_is_named_once() -> None:
    messages = _warnings_for({**NEWEST, "jax": "0.12.0", "jaxlib": "0.12.0", "brainstate": "0.6.0"})
    assert [m.split(" ", 1)[0] for m in messages] == ["jax", "jaxlib", "brainstate"]


def test_importing_braintrace_checks_the_installed_releases() -> None:
    """The import-time check, in a fresh interpreter whose version lookup reports a newer brainstate."""
    script = (
        "import importlib.metadata, warnings\n"
        "real = importlib.metadata.version\n"
        "importlib.metadata.version = lambda name: '0.9.0' if name == 'brainstate' else real(name)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import braintrace\n"
        "print([str(w.message).split(' is installed')[0] for w in caught if w.category is UserWarning"
        " and 'newer than the releases braintrace was tested with' in str(w.message)])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "['brainstate 0.9.0']"
