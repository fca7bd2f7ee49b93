"""The one place that reaches into JAX's interpreter modules.

Everything else in braintrace imports JAX's internals from here, so that a JAX upgrade that
moves them touches a single file.

The jaxpr helpers read a jaxpr's inputs without relying on it storing which of them are
constants: newer JAX builds symbol-only jaxprs whose constant inputs sit at the front of one
input list. The split is derived from the number of trailing (non-constant) inputs the caller
knows, so the same code reads both layouts.

The supported JAX releases (``pyproject.toml``; docs/compatibility.md, "Supported versions")
differ in one place braintrace relies on: only JAX 0.10.2 lets a ``jax.vjp`` pullback take
symbolic zeros, so :func:`call_pullback` makes them arrays on the earlier releases.

Examples
--------
>>> import jax
>>> from braintrace._compatible_imports import jaxpr_all_invars, split_jaxpr_invars
>>> jaxpr = jax.make_jaxpr(lambda a, b: a * b)(1.0, 2.0).jaxpr
>>> consts, hidden = split_jaxpr_invars(jaxpr, 1)
>>> len(jaxpr_all_invars(jaxpr)), len(consts), hidden == [jaxpr.invars[-1]]
(2, 1, True)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.core import ShapedArray
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend import source_info_util
from jax.extend.core import Jaxpr, Var
from jax.interpreters import ad, batching, mlir

__all__ = [
    "CustomVJPPrimal",
    "ShapedArray",
    "SymbolicZero",
    "ad",
    "batching",
    "mlir",
    "call_pullback",
    "jaxpr_all_invars",
    "jaxpr_constvars",
    "split_jaxpr_invars",
    "source_line",
]


# JAX 0.10.2 lets a ``jax.vjp`` pullback take symbolic zeros (``ad.Zero``) and skip their work;
# 0.10.0 and 0.10.1 reject them as a pytree mismatch.
_PULLBACK_TAKES_SYMBOLIC_ZEROS = jax.__version_info__ >= (0, 10, 2)


def call_pullback(vjp_fn: Callable[[Any], Any], cotangents: Any) -> Any:
    """``vjp_fn(cotangents)`` for a ``jax.vjp`` pullback, where ``cotangents`` may hold ``ad.Zero``.

    The symbolic zeros pass through where JAX takes them and become arrays of zeros where it
    does not, so the result is the same on every supported JAX.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> _, vjp_fn = jax.vjp(lambda a: (2.0 * a, a), jnp.ones(2))
    >>> call_pullback(vjp_fn, (jnp.ones(2), ad.Zero(jax.typeof(jnp.ones(2)))))
    (Array([2., 2.], dtype=float32),)
    """
    if not _PULLBACK_TAKES_SYMBOLIC_ZEROS:
        cotangents = jax.tree.map(lambda c: ad.instantiate_zeros(c) if isinstance(c, ad.Zero) else c,
                                  cotangents, is_leaf=lambda c: isinstance(c, ad.Zero))
    return vjp_fn(cotangents)


def jaxpr_constvars(jaxpr: Jaxpr) -> list[Var]:
    """The inputs ``jaxpr`` stores as constants (none where JAX keeps no such split).

    Examples
    --------
    >>> import jax
    >>> jaxpr_constvars(jax.make_jaxpr(lambda a: a + 1.0)(1.0).jaxpr)
    []
    """
    return list(getattr(jaxpr, "constvars", ()))


def jaxpr_all_invars(jaxpr: Jaxpr) -> list[Var]:
    """Every input of ``jaxpr``, constants first: the order ``eval_jaxpr`` binds values in.

    Examples
    --------
    >>> import jax
    >>> jaxpr = jax.make_jaxpr(lambda a, b: a - b)(1.0, 2.0).jaxpr
    >>> jaxpr_all_invars(jaxpr) == list(jaxpr.invars)
    True
    """
    return [*jaxpr_constvars(jaxpr), *jaxpr.invars]


def split_jaxpr_invars(jaxpr: Jaxpr, n_invars: int) -> tuple[list[Var], list[Var]]:
    """``(constant inputs, the last n_invars inputs)`` of ``jaxpr``.

    Raises
    ------
    ValueError
        If ``n_invars`` is not an ``int`` between 0 and the number of inputs.

    Examples
    --------
    >>> import jax
    >>> jaxpr = jax.make_jaxpr(lambda a, b, c: a * b + c)(1.0, 2.0, 3.0).jaxpr
    >>> [len(part) for part in split_jaxpr_invars(jaxpr, 2)]
    [1, 2]
    >>> split_jaxpr_invars(jaxpr, 4)
    Traceback (most recent call last):
        ...
    ValueError: split_jaxpr_invars: n_invars=4 is out of range for a jaxpr with 3 inputs; ...
    """
    every = jaxpr_all_invars(jaxpr)
    if not isinstance(n_invars, int) or isinstance(n_invars, bool) or not 0 <= n_invars <= len(every):
        raise ValueError(
            f"split_jaxpr_invars: n_invars={n_invars!r} is out of range for a jaxpr with "
            f"{len(every)} inputs; pass the number of non-constant inputs, an int in [0, {len(every)}]."
        )
    cut = len(every) - n_invars
    return every[:cut], every[cut:]


def source_line(source_info: Any) -> str | None:
    """``file:line (function)`` of the user code that created an equation, or ``None``."""
    if source_info is None:
        return None
    try:
        summary = source_info_util.summarize(source_info)
    except (AttributeError, IndexError, TypeError):  # no user frame recorded
        return None
    return summary if isinstance(summary, str) and summary else None
