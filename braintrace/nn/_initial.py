"""Initial values of the layers' states, strongly typed.

``braintools.init.param`` gives weakly typed arrays for Python-number initialisers
(``Constant(0.0 * u.mV)``). A state that starts weakly typed and is written strongly typed by the
first step changes its abstract type, so a jitted training step compiles twice. Every layer
creates and resets its states through :func:`initial_state` instead.

Examples
--------
>>> import braintools, brainunit as u
>>> v = initial_state(braintools.init.Constant(0.0 * u.mV), (3,), batch_size=2)
>>> v.shape, u.get_mantissa(v).weak_type
((2, 3), False)
"""

from __future__ import annotations

from typing import Any

import braintools
import brainunit as u
import jax

__all__ = ["initial_state"]


def initial_state(init: Any, shape: Any, batch_size: int | None = None) -> Any:
    """``braintools.init.param(init, shape, batch_size)`` with every leaf strongly typed."""
    value = braintools.init.param(init, shape, batch_size)
    return jax.tree.map(_strong, value, is_leaf=lambda x: isinstance(x, u.Quantity))


def _strong(leaf: Any) -> Any:
    if isinstance(leaf, u.Quantity):
        return u.Quantity(_strong(leaf.mantissa), unit=leaf.unit)
    if isinstance(leaf, jax.Array) and leaf.weak_type:
        return jax.lax.convert_element_type(leaf, leaf.dtype)
    return leaf
