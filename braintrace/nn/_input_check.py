"""Checks of a layer's step input against the layer's hidden state, made at the layer's call.

A mismatch raises a ``ValueError`` naming the layer, the expected and the received shapes and
the fix, instead of the broadcasting or concatenation error JAX would raise mid-trace.
"""

from __future__ import annotations

from typing import Any

import brainunit as u
import jax.numpy as jnp

__all__ = ["check_step_input", "check_broadcast_input"]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(jnp.shape(u.get_mantissa(x)))


def check_step_input(layer: str, x: Any, expected: tuple[int, ...], state: str, state_shape: tuple[int, ...]) -> None:
    """``x`` must have exactly the shape ``expected`` (its features, with ``state``'s leading axes).

    Raises
    ------
    ValueError
        If the shapes differ.
    """
    shape = _shape(x)
    if shape != tuple(expected):
        raise ValueError(
            f"{layer}: the input has shape {shape}, expected {tuple(expected)} (the input features, with "
            f"the leading (batch) axes of the hidden state {state}, shape {tuple(state_shape)}). Pass inputs "
            f"of shape {tuple(expected)}, or call init_state(batch_size=...) / compile with the batch size "
            f"of these inputs."
        )


def check_broadcast_input(layer: str, x: Any, state: str, state_shape: tuple[int, ...]) -> None:
    """``x`` must broadcast onto the hidden state ``state`` without changing its shape.

    Raises
    ------
    ValueError
        If it does not.
    """
    shape = _shape(x)
    target = tuple(state_shape)
    try:
        fits = tuple(jnp.broadcast_shapes(shape, target)) == target
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{layer}: the input has shape {shape}, which does not broadcast onto the hidden state {state} "
            f"of shape {target}. Pass inputs of shape {target} (or one that broadcasts to it, such as a "
            f"scalar), or call init_state(batch_size=...) / compile with the batch size of these inputs."
        )
