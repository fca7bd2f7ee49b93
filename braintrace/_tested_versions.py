"""The releases of braintrace's dependencies its tests ran on, and the warning for newer ones.

``pyproject.toml`` declares lower bounds (the oldest releases ``make test-oldest`` runs on) and
no upper bound unless an incompatibility is known (docs/compatibility.md, "Supported versions"),
so a newer JAX or brain* release installs beside braintrace. Importing braintrace then checks
the installed releases against :data:`TESTED_RELEASES` and gives one ``UserWarning`` per package
newer than the newest tested release, naming the tested range: the combination may well work,
but nobody has run the suite on it.

Examples
--------
>>> from braintrace._tested_versions import untested_releases
>>> untested_releases({'jax': '0.10.2', 'brainunit': '0.5.2'}.get)
[]
>>> untested_releases({'jax': '0.99.0'}.get)
[('jax', '0.99.0', ('0.8.0', '0.10.2'))]
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from typing import Callable

__all__ = ["TESTED_RELEASES", "untested_releases", "warn_untested_releases"]

#: Per package, ``(oldest, newest)`` release the suite ran on: ``make test-oldest`` on the oldest
#: (``requirements-oldest.txt``), ``make test`` on the newest installable on Python 3.11, and
#: brainunit 0.6.0 (which needs Python 3.12) on Python 3.12.
TESTED_RELEASES: dict[str, tuple[str, str]] = {
    "jax": ("0.8.0", "0.10.2"),
    "jaxlib": ("0.8.0", "0.10.2"),
    "brainstate": ("0.5.2", "0.5.4"),
    "brainunit": ("0.5.2", "0.6.0"),
    "brainevent": ("0.2.0", "0.2.1"),
    "braintools": ("0.3.0", "0.3.0"),
}

#: ``version_of(package) -> installed version``, or ``None`` when it is not installed.
VersionLookup = Callable[[str], "str | None"]


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of ``version`` without trailing zeros: ``'0.10.2.post1'`` -> ``(0, 10, 2)``."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    numbers = [int(part) for part in match.group(0).split(".")] if match else []
    while numbers and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def untested_releases(version_of: VersionLookup = _installed_version) -> list[tuple[str, str, tuple[str, str]]]:
    """``(package, installed version, tested range)`` of every installed package newer than tested.

    A post-release or local build of the newest tested release (``0.10.2.post1``) counts as
    tested; a pre-release of a later one (``0.11.0rc1``) does not.
    """
    found = []
    for package, (oldest, newest) in TESTED_RELEASES.items():
        installed = version_of(package)
        if installed is not None and _release(installed) > _release(newest):
            found.append((package, installed, (oldest, newest)))
    return found


def warn_untested_releases(version_of: VersionLookup = _installed_version) -> None:
    """One ``UserWarning`` per installed package newer than the newest release braintrace was tested on.

    Examples
    --------
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter('always')
    ...     warn_untested_releases({'brainstate': '0.7.1'}.get)
    >>> print(caught[0].message)
    brainstate 0.7.1 is installed, newer than the releases braintrace was tested with (brainstate 0.5.2 to 0.5.4). It may work; if something fails, install brainstate<=0.5.4 (pip install "brainstate<=0.5.4") and report the failure with both versions.
    """
    for package, installed, (oldest, newest) in untested_releases(version_of):
        warnings.warn(
            f"{package} {installed} is installed, newer than the releases braintrace was tested with "
            f"({package} {oldest} to {newest}). It may work; if something fails, install {package}<={newest} "
            f"(pip install \"{package}<={newest}\") and report the failure with both versions.",
            UserWarning,
            stacklevel=2,
        )
