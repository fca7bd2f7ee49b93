"""Saying so when float64 was asked for but importing brainstate turned it off.

``import brainstate`` sets JAX's ``jax_enable_x64`` from ``brainstate.environ`` (32 bits by
default), so a user who set ``jax_enable_x64`` (or ``JAX_ENABLE_X64=1``) before importing would
silently compute in float32. ``braintrace`` reads the request before brainstate loads and warns
once, at its import, naming the switch brainstate honours.

Examples
--------
>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter('always')
...     warn_if_float64_dropped(asked=False)
>>> caught
[]
"""

from __future__ import annotations

import os
import warnings

import jax

__all__ = ["float64_asked", "warn_if_float64_dropped"]


def float64_asked() -> bool:
    """Whether ``jax_enable_x64`` is on, or the ``JAX_ENABLE_X64`` environment variable asks for it."""
    flag = os.environ.get("JAX_ENABLE_X64", "").strip().lower() in ("1", "true", "yes", "on")
    return flag or bool(getattr(jax.config, "jax_enable_x64"))


def warn_if_float64_dropped(asked: bool) -> None:
    """Warn if float64 was ``asked`` for before brainstate loaded and is off now."""
    if asked and not getattr(jax.config, "jax_enable_x64"):
        warnings.warn(
            "braintrace: float64 was asked for (jax_enable_x64 or JAX_ENABLE_X64 before the import), but "
            "importing brainstate turned it off, so arrays are float32. Call "
            "brainstate.environ.set(precision=64) after importing brainstate to compute in float64.",
            UserWarning, stacklevel=3,
        )
