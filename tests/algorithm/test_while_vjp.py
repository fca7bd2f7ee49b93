"""``bind_reversibly``: reverse-mode derivatives of ``while`` loops by recomputing their iterations.

Each loop's reverse-mode Jacobian (``jax.jacrev`` of the rebound equation) must equal its
forward-mode Jacobian (``jax.jacfwd`` of the loop itself, which JAX differentiates), with
data-dependent trip counts (none, one, several), integer and boolean carries, constants of the
condition and of the body, under ``jit`` and ``vmap``, and for loops nested in a ``cond``, a
``scan`` or another loop's body. The negative control: JAX's own reverse mode refuses the loop.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from braintrace._algorithm.engine.while_vjp import bind_reversibly, reversible_jaxpr

Fn = Callable[..., Any]


def _rebound(fn: Fn, *example: Any) -> Fn:
    """``fn`` with every top-level equation of its jaxpr bound by :func:`bind_reversibly`."""
    closed = jax.make_jaxpr(fn)(*example)

    def rebound(*args: Any) -> Any:
        env = dict(zip(closed.jaxpr.constvars, closed.consts)) | dict(zip(closed.jaxpr.invars, args))

        def read(a: Any) -> Any:
            return a.val if isinstance(a, jax.extend.core.Literal) else env[a]

        for eqn in closed.jaxpr.eqns:
            env.update(zip(eqn.outvars, bind_reversibly(eqn, [read(a) for a in eqn.invars])))
        outs = [read(v) for v in closed.jaxpr.outvars]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return rebound


def _assert_reverse_equals_forward(fn: Fn, *args: Any, argnums: tuple[int, ...] = (0,)) -> None:
    rebound = _rebound(fn, *args)
    np.testing.assert_allclose(rebound(*args), fn(*args), rtol=1e-6)
    reverse = jax.jacrev(rebound, argnums=argnums)(*args)
    forward = jax.jacfwd(fn, argnums=argnums)(*args)
    for r, f in zip(reverse, forward):
        np.testing.assert_allclose(r, f, rtol=1e-5, atol=1e-7)


def halve(z: Any, limit: Any) -> Any:
    """``z`` halved while its largest magnitude exceeds ``limit`` (a constant of the condition)."""
    return jax.lax.while_loop(lambda c: jnp.max(jnp.abs(c)) > limit, lambda c: 0.5 * c, z)


def settle(h: Any, target: Any, n: int = 5) -> Any:
    """``n`` steps ``h = (tanh(h) + tanh(target)) / 2``, counted in an integer carry; ``target`` is a
    constant of the body."""
    return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (0.5 * jnp.tanh(c[0]) + 0.5 * jnp.tanh(target), c[1] + 1),
                              (h, 0))[0]


@pytest.mark.parametrize("scale", [0.1, 0.6, 5.0], ids=["no-trip", "one-trip", "four-trips"])
def test_a_data_dependent_trip_count(scale: float) -> None:
    z = scale * jnp.array([1.0, -0.5, 0.25])
    _assert_reverse_equals_forward(halve, z, 0.4, argnums=(0, 1))
    # The condition's constant gets no cotangent: it only picks the trip count.
    assert float(jax.grad(lambda lim: _rebound(halve, z, 0.4)(z, lim).sum())(0.4)) == 0.0


def test_body_constants_are_credited_over_every_iteration() -> None:
    _assert_reverse_equals_forward(settle, jnp.array([0.3, -1.0]), jnp.array([0.7, 0.2]), argnums=(0, 1))


def test_several_float_carries_an_integer_and_a_boolean() -> None:
    def fn(a: Any, b: Any) -> Any:
        def body(c: Any) -> Any:
            x, y, i, flip = c
            return jnp.where(flip, y, x) * 0.9 + jnp.sin(y), x * y, i + 1, ~flip

        x, y, i, _ = jax.lax.while_loop(lambda c: (c[2] < 4) & (jnp.sum(c[0]) < 10.0), body, (a, b, 0, True))
        return x + 2.0 * y + i

    _assert_reverse_equals_forward(fn, jnp.array([0.5, 0.2]), jnp.array([0.1, -0.3]), argnums=(0, 1))


def test_under_jit_and_vmap() -> None:
    zs = jnp.array([[0.1, 0.2], [1.0, -0.3], [3.0, 0.5]])  # 0, 2 and 3 halvings
    rebound = _rebound(halve, zs[0], 0.4)
    reverse = jax.jit(jax.vmap(jax.jacrev(rebound), in_axes=(0, None)))(zs, 0.4)
    forward = jax.vmap(jax.jacfwd(halve), in_axes=(0, None))(zs, 0.4)
    np.testing.assert_allclose(reverse, forward, rtol=1e-6)


def test_loops_nested_in_a_cond_a_scan_and_a_loop() -> None:
    def in_cond(z: Any) -> Any:
        return jax.lax.cond(z[0] > 0, lambda z: halve(z, 0.4), lambda z: -z, z)

    def in_scan(z: Any) -> Any:
        return jax.lax.scan(lambda c, k: (halve(c * k, 0.4) + c, None), z, jnp.array([1.0, 3.0]))[0]

    def in_loop(z: Any) -> Any:
        return jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (settle(c[0], c[0], 3), c[1] + 1), (z, 0))[0]

    z = jnp.array([1.5, -0.7])
    for fn in (in_cond, in_scan, in_loop):
        _assert_reverse_equals_forward(fn, z)


def test_a_jaxpr_without_a_loop_is_kept() -> None:
    closed = jax.make_jaxpr(lambda z: jax.lax.cond(z > 0, jnp.sin, jnp.cos, z))(1.0)
    assert reversible_jaxpr(closed) is closed


def test_jax_alone_cannot_reverse_the_loop() -> None:
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work for lax.while_loop"):
        jax.grad(lambda z: halve(z, 0.4).sum())(jnp.ones(2))
