"""Operand handling shared by the user-facing ETP operators.

Each operator checks its operands at the public call (before anything is bound), strips
``brainunit`` units so that primitives and rules only ever see unitless mantissas, and
re-attaches the product unit to the result.

Examples
--------
>>> import brainunit as u, jax.numpy as jnp
>>> from braintrace._op._operands import split_units, with_unit
>>> mantissa, unit = split_units(jnp.ones(2) * u.mV, 'x', 'doc_op')
>>> with_unit(mantissa, unit)
Quantity([1. 1.], "mV")
"""

from __future__ import annotations

import brainunit as u
import jax
import numpy as np

from braintrace._errors import OperandShapeError, OperandTypeError

__all__ = [
    "split_units",
    "with_unit",
    "bias_mantissa",
    "check_hook",
    "check_rank",
    "check_bias_shape",
]

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, u.Quantity)


def split_units(value: object, arg: str, op: str) -> tuple[jax.Array, u.Unit]:
    """Check that ``value`` is an array or a quantity and split it into mantissa and unit.

    Raises
    ------
    OperandTypeError
        If ``value`` is not an array, naming ``arg`` of ``op`` and the common cause (a
        ``brainstate.State`` passed instead of its ``.value``).
    """
    if not isinstance(value, _ARRAY_TYPES):
        hint = ""
        if hasattr(value, "value") and isinstance(getattr(value, "value"), _ARRAY_TYPES):
            hint = f" It looks like a state object: pass `{arg}.value` instead."
        raise OperandTypeError(
            f"{op}: {arg} must be a JAX/NumPy array or a brainunit Quantity, got "
            f"{type(value).__name__}.{hint}"
        )
    mantissa, unit = u.split_mantissa_unit(value)
    return mantissa, unit


def with_unit(mantissa: jax.Array, unit: u.Unit) -> jax.Array | u.Quantity:
    """Attach ``unit`` to ``mantissa``; a plain array when the unit is dimensionless."""
    return u.maybe_decimal(mantissa * unit)


def bias_mantissa(bias: object, unit: u.Unit, op: str) -> jax.Array:
    """The mantissa of ``bias`` expressed in ``unit`` (the unit of ``x·W``).

    Raises
    ------
    brainunit.UnitMismatchError
        If the bias unit is incompatible with ``unit``.
    """
    split_units(bias, "bias", op)
    return u.Quantity(bias).to_decimal(unit)


def check_hook(hook: object, arg: str, op: str, value: jax.Array | None = None) -> None:
    """Raise unless ``hook`` is ``None`` or a callable that preserves the shape of ``value``.

    With ``value`` (the parameter's mantissa) the hook is evaluated abstractly
    (``jax.eval_shape``, nothing is computed or bound) and must return an array of the same
    shape: every trace rule indexes the transformed parameter like the stored one.

    Raises
    ------
    TypeError
        If ``hook`` is neither ``None`` nor callable.
    ValueError
        If ``hook(value)`` does not have the shape of ``value``.
    """
    if hook is None:
        return
    if not callable(hook):
        raise TypeError(
            f"{op}: {arg} must be a callable mapping the stored parameter to the value the "
            f"operator uses (or None), got {type(hook).__name__}: {hook!r}."
        )
    if value is None:
        return
    out = jax.eval_shape(hook, jax.ShapeDtypeStruct(np.shape(value), value.dtype))
    if getattr(out, "shape", None) != tuple(np.shape(value)):
        raise ValueError(
            f"{op}: {arg} must preserve the shape {tuple(np.shape(value))} of the parameter it "
            f"transforms, but it returns {getattr(out, 'shape', type(out).__name__)}. Apply "
            f"shape-changing transforms (slicing, reshaping) outside the operator."
        )


def check_rank(value: jax.Array, arg: str, op: str, allowed: tuple[int, ...], hint: str = "") -> None:
    """Raise ``ValueError`` unless ``value.ndim`` is one of ``allowed``."""
    if value.ndim not in allowed:
        ranks = " or ".join(str(r) for r in allowed)
        raise ValueError(
            f"{op}: {arg} must have rank {ranks}, got shape {tuple(value.shape)} "
            f"(rank {value.ndim}).{(' ' + hint) if hint else ''}"
        )


def check_bias_shape(bias: jax.Array, out_shape: tuple[int, ...], op: str) -> None:
    """Raise unless ``bias`` broadcasts onto an output of shape ``out_shape`` unchanged."""
    try:
        ok = np.broadcast_shapes(tuple(bias.shape), out_shape) == out_shape
    except ValueError:
        ok = False
    if not ok:
        raise OperandShapeError(
            f"{op}: bias of shape {tuple(bias.shape)} does not broadcast to the output shape "
            f"{out_shape}; pass a bias of shape {out_shape[-1:]}."
        )
