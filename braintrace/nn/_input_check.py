"""Checks of a layer's step input against the layer's hidden state, made at the layer's call.

A shape mismatch raises a ``ValueError`` naming the layer, the expected and the received shapes
and the fix, instead of the broadcasting or concatenation error JAX would raise mid-trace. A
unit mismatch raises :class:`InputUnitError` (a ``ValueError`` and a brainunit
``UnitMismatchError``) naming the layer, the expected and the received units and the fix,
instead of brainunit's error from the middle of the update.
"""

from __future__ import annotations

import brainunit as u
import jax.numpy as jnp
import numpy as np

from braintrace._compatible_imports import Tracer
from braintrace._typing import Value

__all__ = ["InputUnitError", "check_step_input", "check_broadcast_input", "check_input_unit"]


class InputUnitError(u.UnitMismatchError, ValueError):
    """A layer's step input is in a unit the layer cannot take.

    Also a ``ValueError`` (like the shape checks here) and a brainunit ``UnitMismatchError``
    (what the update itself would raise), so code catching either keeps working.
    """


def _shape(x: Value) -> tuple[int, ...]:
    return tuple(jnp.shape(u.get_mantissa(x)))


def check_step_input(layer: str, x: Value, expected: tuple[int, ...], state: str, state_shape: tuple[int, ...]) -> None:
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


def check_broadcast_input(layer: str, x: Value, state: str, state_shape: tuple[int, ...]) -> None:
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


def _is_concrete_zero(x: Value) -> bool:
    mantissa = u.get_mantissa(x)
    if isinstance(mantissa, Tracer):
        return False
    try:
        return bool(np.all(np.asarray(mantissa) == 0))
    except (TypeError, ValueError):
        return False


def _describe(unit: u.Unit) -> str:
    return "a plain number or array (no unit)" if unit.is_unitless else f"a quantity in {unit}"


def _unit_expr(unit: u.Unit) -> str:
    """How to write ``unit`` in code: ``brainunit.mA`` where brainunit names it, else its repr."""
    name = str(unit)
    return f"brainunit.{name}" if getattr(u, name, None) == unit else repr(unit)


def _unit_fix(got: u.Unit, expected: u.Unit) -> str:
    if expected.is_unitless:
        return f"Pass its plain value, e.g. x.to_decimal({_unit_expr(got)}), or build the layer with units."
    if got.is_unitless:
        return f"Multiply the input by its unit, e.g. x * {_unit_expr(expected)}."
    return (
        f"Pass an input in {expected} (or another unit of that dimension), e.g. value * "
        f"{_unit_expr(expected)}."
    )


def check_input_unit(layer: str, x: Value, expected: u.Unit, enters: str) -> Value:
    """``x`` must be in a unit of ``expected``'s dimension; return it, ready for the update.

    A plain zero known at the call (not a tracer) fits every unit, as in brainunit's own
    arithmetic (``1 mV + 0``): it is returned as a zero in ``expected``.

    Parameters
    ----------
    layer : str
        The layer's name, for the message.
    x : array, Quantity or number
        The step input.
    expected : brainunit.Unit
        The unit the update needs (its dimension is compared, so ``nA`` fits ``mA``).
    enters : str
        How the input enters the update, for the message (e.g. ``"it is added to g (in mS)"``).

    Raises
    ------
    InputUnitError
        If the dimensions differ.
    """
    got = u.get_unit(x)
    if got.dim == expected.dim:
        return x
    if got.is_unitless and _is_concrete_zero(x):
        return u.Quantity(u.get_mantissa(x), unit=expected)
    raise InputUnitError(
        f"{layer}: expected {_describe(expected)} as input, since {enters}; got {_describe(got)}. "
        f"{_unit_fix(got, expected)}"
    )
