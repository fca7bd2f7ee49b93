"""Check a hand-written ``xy_to_dw`` rule against JAX's own VJP of the implementation.

A tool for authors of custom ETP primitives: the pullback rule must agree with
``jax.vjp`` of the primitive's impl with respect to the raw trainable operands.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._op.op_rule_oracle import assert_xy_to_dw_matches_vjp
>>> def impl(x, w, **params):
...     return x @ w
>>> def rule(x, hd, weights, **params):
...     return {'weight': jnp.outer(x, hd)}
>>> assert_xy_to_dw_matches_vjp(rule=rule, impl=impl, x=jnp.ones(2), hidden_dim=jnp.ones(3),
...                             weights={'weight': jnp.ones((2, 3))})
"""

from __future__ import annotations

from typing import Callable, Iterable

import jax
import numpy as np

from braintrace._typing import Array, Params

__all__ = ["xy_to_dw_and_vjp", "assert_xy_to_dw_matches_vjp"]


def xy_to_dw_and_vjp(
    *,
    rule: Callable[..., dict[str, Array]],
    impl: Callable[..., Array],
    x: Array | None,
    hidden_dim: Array,
    weights: dict[str, Array],
    params: Params | None = None,
) -> tuple[dict[str, Array], dict[str, Array]]:
    """Evaluate ``rule`` and the reference VJP of ``impl`` at the same point.

    ``impl`` is called as ``impl(x, *weights.values(), **params)`` (``x`` left out when
    ``None``), so ``weights`` must list the trainable operands in invar order.

    Returns
    -------
    (rule_dw, vjp_dw)
        Both dicts keyed like ``weights``.
    """
    params = dict(params or {})
    keys = list(weights)

    def forward(ws: dict[str, Array]) -> Array:
        operands = ([] if x is None else [x]) + [ws[k] for k in keys]
        return impl(*operands, **params)

    _, vjp = jax.vjp(forward, dict(weights))
    vjp_dw: dict[str, Array] = vjp(hidden_dim)[0]
    rule_dw = rule(x, hidden_dim, dict(weights), **params)
    return rule_dw, vjp_dw


def assert_xy_to_dw_matches_vjp(
    *,
    rule: Callable[..., dict[str, Array]],
    impl: Callable[..., Array],
    x: Array | None,
    hidden_dim: Array,
    weights: dict[str, Array],
    params: Params | None = None,
    atol: float = 1e-5,
    keys: Iterable[str] | None = None,
) -> None:
    """Assert that ``rule`` equals the VJP of ``impl`` (on ``keys``, or on exactly all keys).

    Raises
    ------
    AssertionError
        On a key-set mismatch (when ``keys`` is ``None``), a shape mismatch, or values that
        differ by more than ``atol``.
    """
    rule_dw, vjp_dw = xy_to_dw_and_vjp(
        rule=rule, impl=impl, x=x, hidden_dim=hidden_dim, weights=weights, params=params
    )
    if keys is None:
        if set(rule_dw) != set(vjp_dw):
            raise AssertionError(
                f"xy_to_dw keys {sorted(rule_dw)} differ from the trainable keys {sorted(vjp_dw)}."
            )
        keys = vjp_dw
    for k in keys:
        got, want = np.asarray(rule_dw[k]), np.asarray(vjp_dw[k])
        if got.shape != want.shape:
            raise AssertionError(f"xy_to_dw[{k!r}] has shape {got.shape}, the VJP {want.shape}.")
        np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=f"xy_to_dw[{k!r}]")


