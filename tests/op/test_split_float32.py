"""``braintrace._op.split_float32``: float32 outer-product sums from bfloat16 parts, exact to float32 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from braintrace._op.split_float32 import bfloat16_parts, outer_sums



def _bound(steps: int) -> float:
    """The error allowed a sum over ``steps``, relative to the sum of its terms' magnitudes:
    float32's rounding (``2⁻²⁴``) once per product of parts summed (six per step), which also
    covers the three smallest pairs of parts left out (each below ``2⁻²⁴`` of its term)."""
    return 6 * steps * 2.0**-24


def _wide(seed: int, shape: tuple[int, ...]) -> jax.Array:
    """Float32 values of both signs over some twelve orders of magnitude, with zeros."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    values = jax.random.normal(k1, shape) * jnp.exp(6 * jax.random.normal(k2, shape))
    return jnp.where(jax.random.uniform(k3, shape) < 0.1, 0.0, values)


def _relative_error(got: jax.Array, x: jax.Array, y: jax.Array) -> float:
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    want = np.einsum("k...i,k...o->...io", x64, y64)
    scale = np.einsum("k...i,k...o->...io", np.abs(x64), np.abs(y64))
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / np.where(scale > 0, scale, 1.0)))


def test_the_three_parts_sum_to_the_value_exactly() -> None:
    v = jnp.concatenate([_wide(0, (4096,)), jnp.array([0.0, -0.0, 1.0, -1 / 3, 3.4e38, -1.2e-30])])
    parts = bfloat16_parts(v)
    assert all(p.dtype == jnp.bfloat16 for p in parts)
    total = sum(np.asarray(p, np.float64) for p in parts)
    np.testing.assert_array_equal(total, np.asarray(v, np.float64))
    # Each part holds at most bfloat16's eight significant bits of what the parts before it left.
    assert float(jnp.max(jnp.abs(parts[1].astype(jnp.float32)) - jnp.abs(v) * 2.0**-7)) <= 0.0


@pytest.mark.parametrize("shapes", [((10, 4, 33), (10, 4, 17)), ((16, 2, 5), (16, 2, 130)), ((1, 3, 8), (1, 3, 8)),
                                    ((12, 7), (12, 9))],
                         ids=["group-of-10", "group-of-16", "one-step", "no-batch-axes"])
def test_the_sum_of_outer_products_is_float32_accurate(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    x, y = _wide(1, shapes[0]), _wide(2, shapes[1])
    got = outer_sums(x, y)
    assert got.shape == (*shapes[0][1:], shapes[1][-1]) and got.dtype == jnp.float32
    bound = _bound(shapes[0][0])
    assert _relative_error(got, x, y) <= bound
    assert _relative_error(jax.jit(outer_sums)(x, y), x, y) <= bound
    # Negative control: the same product of the values rounded to bfloat16 misses by far.
    rounded = jnp.einsum("k...i,k...o->...io", x.astype(jnp.bfloat16), y.astype(jnp.bfloat16),
                         preferred_element_type=jnp.float32)
    assert _relative_error(rounded, x, y) > 100 * bound


def test_its_derivatives_are_those_of_the_product() -> None:
    x, y, w = jax.random.normal(jax.random.PRNGKey(3), (6, 2, 5)), _wide(4, (6, 2, 3)), _wide(5, (2, 5, 3))

    def loss(sums: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(sums) * w)

    def product(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.einsum("kbi,kbo->bio", a, b, precision=jax.lax.Precision.HIGHEST)

    got = jax.grad(lambda a, b: loss(outer_sums(a, b)), argnums=(0, 1))(x, y)
    want = jax.grad(lambda a, b: loss(product(a, b)), argnums=(0, 1))(x, y)
    for g, v in zip(got, want):
        np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(v))))
    _, tangent = jax.jvp(outer_sums, (x, y), (jnp.ones_like(x), y))
    _, want_tangent = jax.jvp(product, (x, y), (jnp.ones_like(x), y))
    np.testing.assert_allclose(tangent, want_tangent, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want_tangent))))


def test_other_dtypes_take_the_product_as_it_is() -> None:
    x, y = _wide(6, (4, 3)).astype(jnp.bfloat16), _wide(7, (4, 2)).astype(jnp.bfloat16)
    want = jnp.einsum("k...i,k...o->...io", x, y, precision=jax.lax.Precision.HIGHEST)
    got = outer_sums(x, y)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
