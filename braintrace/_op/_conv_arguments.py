"""Argument checks of ``braintrace.conv``: ranks, per-axis strides and dilations, padding,
layouts, group counts, hooks and bias, each with a message that names the argument.

Examples
--------
>>> from braintrace._op._conv_arguments import per_axis
>>> per_axis(2, "strides", 3, "braintrace.conv")
(2, 2, 2)
"""

from __future__ import annotations

from typing import Sequence, TypeGuard

import jax
import numpy as np
from jax import lax

from braintrace._errors import OperandShapeError
from braintrace._typing import Array, WeightFn


__all__ = [
    "check_bias",
    "check_hook_shape",
    "check_ranks",
    "group_count",
    "is_int",
    "layout_argument",
    "padding_argument",
    "per_axis",
]


def check_ranks(x: Array, kernel: Array, op: str) -> int:
    if kernel.ndim < 3:
        raise ValueError(
            f"{op}: kernel must have rank 3 or more (out, in and at least one spatial axis), "
            f"got shape {tuple(kernel.shape)}."
        )
    if x.ndim != kernel.ndim:
        hint = " Add a leading batch axis, e.g. x[None]." if x.ndim == kernel.ndim - 1 else ""
        raise ValueError(
            f"{op}: x must have the rank of kernel (batch, channel and {kernel.ndim - 2} spatial "
            f"axes), got x shape {tuple(x.shape)} and kernel shape {tuple(kernel.shape)}.{hint}"
        )
    return kernel.ndim - 2


def is_int(value: object) -> TypeGuard[int | np.integer]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def per_axis(
    value: object, arg: str, n_spatial: int, op: str, optional: bool = False
) -> tuple[int, ...] | None:
    """One positive int per spatial axis; a single value is repeated over every axis."""
    if value is None and optional:
        return None
    if is_int(value):
        value = (value,)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{op}: {arg} must be an int or a sequence of {n_spatial} ints, got "
            f"{type(value).__name__}: {value!r}."
        )
    if not all(is_int(v) and v >= 1 for v in value):
        raise ValueError(f"{op}: {arg} must hold positive ints, got {value!r}.")
    if len(value) == 1:
        value = tuple(value) * n_spatial
    if len(value) != n_spatial:
        raise ValueError(
            f"{op}: {arg} must have one entry per spatial axis ({n_spatial} for this kernel) or "
            f"a single entry for all of them, got {tuple(value)!r}."
        )
    return tuple(int(v) for v in value)


def padding_argument(value: object, n_spatial: int, op: str) -> str | tuple[tuple[int, int], ...]:
    """A padding name unchanged, or pairs as a (hashable) tuple of tuples."""
    if isinstance(value, str):
        if value.upper() not in ("SAME", "SAME_LOWER", "VALID"):
            raise ValueError(
                f"{op}: padding must be 'SAME', 'SAME_LOWER', 'VALID' or one (low, high) pair "
                f"per spatial axis, got {value!r}."
            )
        return value
    pairs = tuple(tuple(p) if isinstance(p, Sequence) else p for p in value) if isinstance(
        value, Sequence
    ) else None
    if pairs is None or len(pairs) != n_spatial or not all(
        isinstance(p, tuple) and len(p) == 2 and all(is_int(v) for v in p) for p in pairs
    ):
        raise ValueError(
            f"{op}: padding must be 'SAME', 'SAME_LOWER', 'VALID' or {n_spatial} (low, high) "
            f"int pairs (one per spatial axis), got {value!r}."
        )
    return tuple((int(lo), int(hi)) for lo, hi in pairs)


def group_count(value: object, arg: str, op: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{op}: {arg} must be a positive int, got {value!r}.")
    return int(value)


def layout_argument(
    value: object, x_shape: tuple[int, ...], k_shape: tuple[int, ...], op: str
) -> lax.ConvGeneralDilatedDimensionNumbers:
    """Validate ``dimension_numbers``; lists become tuples (static params must hash)."""
    if value is None:
        return None
    if isinstance(value, lax.ConvDimensionNumbers):
        value = lax.ConvDimensionNumbers(*(tuple(int(a) for a in spec) for spec in value))
        if any(sorted(spec) != list(range(len(x_shape))) for spec in value):
            raise ValueError(
                f"{op}: each spec of dimension_numbers must be a permutation of the "
                f"{len(x_shape)} axes of x, got {value!r}."
            )
    elif isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        value = tuple(value)
    else:
        raise TypeError(
            f"{op}: dimension_numbers must be None, a (lhs, rhs, out) triple of strings such as "
            f"('NHWC', 'HWIO', 'NHWC'), or a jax.lax.ConvDimensionNumbers, got {value!r}."
        )
    try:
        dn = lax.conv_dimension_numbers(x_shape, k_shape, value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{op}: invalid dimension_numbers {value!r}: {err}") from err
    if dn.lhs_spec[0] != 0 or dn.out_spec[0] != 0:
        raise ValueError(
            f"{op}: the batch axis must lead the input and the output (etp_conv is a batched "
            f"primitive), got dimension_numbers {value!r}; transpose x and the result instead."
        )
    return value


def check_hook_shape(hook: WeightFn | None, value: Array, arg: str, op: str) -> None:
    if hook is None:
        return
    out = jax.eval_shape(hook, jax.ShapeDtypeStruct(value.shape, value.dtype))
    if getattr(out, "shape", None) != tuple(value.shape):
        raise ValueError(
            f"{op}: {arg} must preserve the parameter's shape {tuple(value.shape)}, but it "
            f"returns {getattr(out, 'shape', type(out).__name__)}."
        )


def check_bias(bias: Array, y_shape: tuple[int, ...], channel: int, op: str) -> None:
    """The bias must broadcast onto one sample of the output without changing its shape."""
    if bias.ndim == 1:
        ok = bias.shape[0] in (1, y_shape[channel])
    else:
        padded = (1,) * (len(y_shape) - bias.ndim) + tuple(bias.shape)
        ok = bias.ndim <= len(y_shape) and padded[0] == 1 and all(
            b in (1, n) for b, n in zip(padded[1:], y_shape[1:])
        )
    if not ok:
        raise OperandShapeError(
            f"{op}: bias of shape {tuple(bias.shape)} does not fit the output of shape "
            f"{y_shape}; pass ({y_shape[channel]},) for one bias per output channel (axis "
            f"{channel}), or a shape that broadcasts onto one sample {y_shape[1:]}."
        )
