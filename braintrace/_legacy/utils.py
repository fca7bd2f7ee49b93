"""Deprecated v0.1 helpers kept for compatibility: ``stop_param_gradients`` and ``general_y2w``."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._legacy.ops import Operand, Weights

__all__ = ["stop_param_gradients", "general_y2w"]


@contextlib.contextmanager
def stop_param_gradients(stop_or_not: bool = True) -> Iterator[None]:
    """A context manager that does nothing; kept so v0.1 code keeps running.

    In v0.1 it switched off parameter gradients inside the block. ETP operators decide what
    learns now; to keep a weight out of training, use it with plain JAX ops or pass it
    through ``jax.lax.stop_gradient``.

    Examples
    --------
    >>> from braintrace._legacy import stop_param_gradients
    >>> with stop_param_gradients():
    ...     pass
    """
    yield


def general_y2w(xw2y: Callable[[Operand, Weights], Operand], x: Operand, y: Operand, w: Weights) -> Weights:
    """Pull ``y`` back to the weights of ``xw2y`` with the input replaced by ones.

    Returns the VJP of ``w -> xw2y(ones_like(x), w)`` at ``w`` with cotangent ``y``
    (mantissas).

    Raises
    ------
    ValueError
        If ``y`` does not have the output's shape.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import general_y2w
    >>> general_y2w(lambda x, w: x @ w, jnp.zeros(2), jnp.array([1.0, 2.0]), jnp.zeros((2, 2)))
    Array([[1., 2.],
           [1., 2.]], dtype=float32)
    """
    ones = jnp.ones_like(u.get_mantissa(x))
    out, pullback = jax.vjp(lambda weights: u.get_mantissa(xw2y(ones, weights)), w)
    cotangent = u.get_mantissa(y)
    if jnp.shape(cotangent) != jnp.shape(out):
        raise ValueError(
            f"general_y2w: y has shape {jnp.shape(cotangent)}, but xw2y returns shape "
            f"{jnp.shape(out)}."
        )
    return pullback(cotangent)[0]
