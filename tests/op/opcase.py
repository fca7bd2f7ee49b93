"""The table row every ETP primitive contributes to the operator contract tests.

A family adds rows by defining ``CASES: list[OpCase]`` in a module of ``tests/op/cases/``;
``test_rule_oracles.py`` checks every row against first principles:

* the trace geometry ``trace_of(fn, x, weights, params)`` states, from the full Jacobian of
  ``fn`` (``jax.jacrev``), which entries of ``∂y/∂θ`` the D-RTRL trace keeps; every rule is
  then checked against it (``dt_to_t``, the instantaneous term, the solve);
* ``xy_to_dw`` against ``jax.vjp`` of the impl;
* jit / grad / jvp / vmap, init shapes and dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
TraceOf = Callable[[Callable[[Any, dict[str, Array]], Array], Any, dict[str, Array], dict[str, Any]], dict[str, Array]]


@dataclass(frozen=True)
class OpCase:
    """One primitive at one concrete point.

    Attributes
    ----------
    id : str
        Test id.
    prim : ETPPrimitive
        The primitive under test.
    impl : callable
        Its implementation, called as ``impl(x, *weights.values(), **params)``.
    x : array or None
        The input operand (``None`` for primitives without one).
    weights : dict
        Trainable operands in invar order.
    params : dict
        Static parameters of the equation.
    trace_of : callable or None
        Trace geometry: ``trace_of(fn, x, weights, params) -> {key: trace without S}`` where
        ``fn(x, weights) -> y``. ``None`` skips the geometry oracles.
    drtrl_shapes : dict
        Expected ``init_drtrl`` leaf shapes without the trailing ``S``.
    hooked : bool
        Whether a transform hook is active (the fast path must then be gated off).
    extra_operands : tuple
        Non-trainable operands bound after the trainable ones (rare).
    """

    id: str
    prim: Any
    impl: Callable[..., Array]
    x: Any
    weights: dict[str, Array]
    params: dict[str, Any]
    trace_of: TraceOf | None
    drtrl_shapes: dict[str, tuple[int, ...]]
    hooked: bool = False
    init_kwargs: dict[str, Any] = field(default_factory=dict)

    def operands(self, x: Any = None, weights: dict[str, Array] | None = None) -> list[Any]:
        x = self.x if x is None else x
        weights = self.weights if weights is None else weights
        # Pytree transformations rebuild dicts with sorted keys: keep the invar order explicit.
        return ([] if x is None else [x]) + [weights[k] for k in self.weights]

    def fn(self, x: Any, weights: dict[str, Array]) -> Array:
        """``y`` as a function of ``x`` and the trainable operands, through the impl."""
        return self.impl(*self.operands(x, weights), **self.params)

    def bind(self, x: Any, weights: dict[str, Array]) -> Array:
        return self.prim.bind(*self.operands(x, weights), **self.params)

    def y(self) -> Array:
        return self.fn(self.x, self.weights)


def rand(key: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
    """A deterministic normal sample (drawn with NumPy: no compilation per new shape)."""
    return jnp.asarray(np.random.default_rng(key).standard_normal(shape), dtype)


def jac(fn: Callable[[Any, dict[str, Array]], Array], x: Any, weights: dict[str, Array]) -> dict[str, Array]:
    """``{key: ∂y/∂key}`` with shape ``(*y, *key)``."""
    return jax.jacrev(lambda ws: fn(x, ws))(weights)


def jac_transformed(
    fn: Callable[[Any, dict[str, Array]], Array],
    x: Any,
    weights: dict[str, Array],
    params: dict[str, Any],
    hooks: tuple[tuple[str, str], ...] = (("weight", "weight_fn"), ("bias", "bias_fn")),
) -> dict[str, Array]:
    """``{key: ∂y/∂V_key}`` with ``V_key = hook(key)``: the Jacobian in the transformed space.

    The D-RTRL trace of a hooked operand lives in the space of the transformed value. The
    Jacobian with respect to it follows by the chain rule, ``∂y/∂V = ∂y/∂W · (∂V/∂W)⁻¹``,
    which needs a hook that is invertible at the point (``tanh``, ``w**2`` away from zero,
    :func:`mix_all`). Operands without a hook keep ``∂y/∂W``.
    """
    j = dict(jac(fn, x, weights))
    for key, name in hooks:
        hook = params.get(name)
        if hook is None or key not in weights:
            continue
        w = weights[key]
        jf = np.asarray(jax.jacrev(hook)(w), np.float64).reshape(w.size, w.size)
        jw = np.asarray(j[key], np.float64).reshape(-1, w.size)
        j[key] = jnp.asarray((jw @ np.linalg.inv(jf)).reshape(j[key].shape), dtype=j[key].dtype)
    return j


def mix_all(w: Array) -> Array:
    """An invertible linear hook that couples every entry with its neighbour in storage order.

    It mixes entries across output columns (and rows, groups, non-zeros), so a trace kept per
    raw entry would be wrong under it; the circulant ``1 + z/2`` has no zero eigenvalue.
    """
    flat = w.reshape(-1)
    return (flat + 0.5 * jnp.roll(flat, 1)).reshape(w.shape)


def close(a: Any, b: Any, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=rtol)


def scale_y(fn: Callable[[Any, dict[str, Array]], Array], hd: Array) -> Callable[[Any, dict[str, Array]], Array]:
    """``(x, ws) -> hd * fn(x, ws)``: a hidden state whose Jacobian on ``y`` is ``diag(hd)``."""
    return lambda x, ws: hd * fn(x, ws)
