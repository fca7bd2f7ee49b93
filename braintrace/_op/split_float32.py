"""Sums of float32 outer products over a short axis, in one bfloat16 pass of a TPU's matrix unit.

A TPU multiplies float32 matrices at ``Precision.HIGHEST`` as six bfloat16 products: each
operand split in three bfloat16 parts (``x = x₀ + x₁ + x₂``, eight of float32's 24 significant
bits each), and ``x₀y₀ + x₀y₁ + x₁y₀ + x₀y₂ + x₁y₁ + x₂y₀`` summed in float32. Each of the six
passes spends the matrix unit's depth (128 on a v5e) on the contracted axis; a sum over the
``K`` steps of a group (``K`` ≤ 20) fills ``K/128`` of it. :func:`outer_sums` lays the six pairs
of parts side by side along the contracted axis instead: the same exact bfloat16 products,
accumulated in float32, in one pass of depth ``6K``, which XLA also compiles as one plain
bfloat16 product (at ``HIGHEST`` the same sum over a GRU-256 trace compiled the driver's loop
3.5x slower than element-wise).

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._op.split_float32 import outer_sums
>>> x = jnp.array([[[1.0, 1 / 3]], [[2.0, 1e-3]]])          # (K=2, B=1, I=2)
>>> y = jnp.array([[[3.0]], [[0.5]]])                      # (K=2, B=1, O=1)
>>> outer_sums(x, y)                                        # Σ_k x_k ⊗ y_k: (B, I, O)
Array([[[4.    ],
        [1.0005]]], dtype=float32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from braintrace._typing import Array

__all__ = ["bfloat16_parts", "outer_sums"]

#: The pairs of parts whose products ``Precision.HIGHEST`` sums (the three it leaves out are
#: below float32's rounding of the result).
_PAIRS = ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0))
_TOP_16_BITS = 0xFFFF0000


def bfloat16_parts(v: Array) -> tuple[Array, Array, Array]:
    """``v`` (float32) as three bfloat16 arrays whose float32 sum is ``v`` exactly, for zeros and
    magnitudes from about ``1e-31`` (below, the bits under float32's smallest normal number,
    about ``1e-38``, are lost; a non-finite entry spoils the sums it enters).

    Each part is the top eight significant bits of what the parts before it left, cut off by a
    bit mask rather than by rounding, so no compiler may take the round trip through bfloat16 for
    an identity.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> parts = bfloat16_parts(jnp.array([1 / 3, -7.25e-20]))
    >>> [p.dtype.name for p in parts]
    ['bfloat16', 'bfloat16', 'bfloat16']
    >>> bool((sum(p.astype(jnp.float32) for p in parts) == jnp.array([1 / 3, -7.25e-20])).all())
    True
    """
    parts = []
    rest = v
    for _ in range(3):
        top = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(_TOP_16_BITS), jnp.float32)
        parts.append(top.astype(jnp.bfloat16))
        rest = rest - top
    return parts[0], parts[1], parts[2]


@jax.custom_jvp
def outer_sums(x: Array, y: Array) -> Array:
    """``Σ_k x_k ⊗ y_k``: ``x`` ``(K, ..., I)`` and ``y`` ``(K, ..., O)`` (the same batch axes
    ``...``) to ``(..., I, O)``, float32 to the accuracy of ``Precision.HIGHEST``, as one bfloat16
    product of depth ``6K`` (the module's docstring). Other dtypes take ``jnp.einsum`` at
    ``HIGHEST``. Differentiable: its derivatives are those products at ``HIGHEST``."""
    if x.dtype != jnp.float32 or y.dtype != jnp.float32:
        return _einsum(x, y)
    x_parts, y_parts = bfloat16_parts(x), bfloat16_parts(y)
    x_side = jnp.concatenate([x_parts[i] for i, _ in _PAIRS], axis=0)
    y_side = jnp.concatenate([y_parts[j] for _, j in _PAIRS], axis=0)
    return jnp.einsum("k...i,k...o->...io", x_side, y_side, preferred_element_type=jnp.float32)


def _einsum(x: Array, y: Array) -> Array:
    return jnp.einsum("k...i,k...o->...io", x, y, precision=jax.lax.Precision.HIGHEST)


@outer_sums.defjvp
def _outer_sums_jvp(primals: tuple[Array, Array], tangents: tuple[Array, Array]) -> tuple[Array, Array]:
    x, y = primals
    dx, dy = tangents
    return outer_sums(x, y), _einsum(dx, y) + _einsum(x, dy)
