"""Checks of the layers' constructor arguments: sizes and time constants, refused at construction.

A bad size or time constant raises a ``ValueError`` naming the layer, the argument, the value and
what to give instead, when the layer is built, rather than a bare ``AssertionError``, a NumPy
warning or a network that blows up steps later (a negative time constant makes the decay
``exp(-dt / tau)`` larger than one). The layers that keep a ``brainstate.nn`` constructor check
its arguments with :func:`check_constructor_arguments` before it runs.

Examples
--------
>>> from braintrace.nn._arguments import check_time_constant, positive_int, size_tuple
>>> size_tuple("Linear", "in_size", 3), size_tuple("Linear", "in_size", [2, 3])
((3,), (2, 3))
>>> size_tuple("Linear", "in_size", 2.5)
Traceback (most recent call last):
    ...
ValueError: Linear: in_size must be a positive int or a tuple of them, got 2.5.
>>> positive_int("GroupedLinear", "num_groups", 0)
Traceback (most recent call last):
    ...
ValueError: GroupedLinear: num_groups must be a positive int, got 0.
>>> import brainunit as u, jax.numpy as jnp
>>> check_time_constant("LIF", "tau", 10.0 * u.ms)
>>> check_time_constant("LIF", "tau", -1.0)
Traceback (most recent call last):
    ...
ValueError: LIF: tau must be positive (a time constant), got -1.0; e.g. tau=10. * brainunit.ms
>>> check_time_constant("Expon", "tau", jnp.array([5.0, 0.0]) * u.ms)
Traceback (most recent call last):
    ...
ValueError: Expon: tau must be positive (a time constant), got 0.0 ms at index (1,) of an array of shape (2,); ...
"""

from __future__ import annotations

import inspect
import operator
from typing import Callable, Mapping, SupportsIndex

import brainstate
import brainunit as u
import numpy as np

from braintrace._compatible_imports import Tracer

__all__ = ["ArgumentCheck", "positive_int", "size_tuple", "check_time_constant", "check_constructor_arguments"]

#: A check of one argument: ``check(layer, arg, value)`` raises if the value is refused.
ArgumentCheck = Callable[[str, str, object], object]


def _as_positive_int(value: object) -> int | None:
    """``value`` as an ``int`` if it is a positive integer (not a bool), else ``None``.

    ``operator.index`` accepts exactly the integers: Python and NumPy integers and 0-d integer
    arrays, not floats (even ``2.0``) or strings.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, SupportsIndex):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number > 0 else None


def positive_int(layer: str, arg: str, value: object) -> int:
    """``value`` as an ``int``, refused unless it is a positive integer.

    Parameters
    ----------
    layer, arg : str
        The layer's and the argument's names, for the message.
    value : object
        A Python or NumPy integer; a bool is refused.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        If ``value`` is not a positive integer.
    """
    number = _as_positive_int(value)
    if number is None:
        raise ValueError(f"{layer}: {arg} must be a positive int, got {value!r}.")
    return number


def size_tuple(layer: str, arg: str, value: object) -> tuple[int, ...]:
    """``value`` as a tuple of ints, refused unless it is a positive int or a non-empty sequence of them.

    Parameters
    ----------
    layer, arg : str
        The layer's and the argument's names, for the message.
    value : object
        A positive Python or NumPy integer, or a non-empty tuple or list of them.

    Returns
    -------
    tuple of int
        ``(value,)`` for an integer, ``tuple(value)`` for a sequence.

    Raises
    ------
    ValueError
        If ``value`` is neither.
    """
    entries = list(value) if isinstance(value, (tuple, list)) else [value]
    sizes = [_as_positive_int(entry) for entry in entries]
    if not sizes or any(size is None for size in sizes):
        raise ValueError(f"{layer}: {arg} must be a positive int or a tuple of them, got {value!r}.")
    return tuple(size for size in sizes if size is not None)


def _describe_entry(value: object, entries: np.ndarray, refused: np.ndarray) -> str:
    """The first refused entry of ``value``, with its unit and, in an array, its index."""
    index = tuple(int(i) for i in np.argwhere(refused)[0])
    unit = u.get_unit(value)
    text = repr(entries[index].item()) + ("" if unit.is_unitless else f" {unit}")
    return f"{text} at index {index} of an array of shape {entries.shape}" if index else text


def check_time_constant(layer: str, arg: str, value: object) -> None:
    """Refuse a time constant unless every entry of its value is positive.

    Parameters
    ----------
    layer, arg : str
        The layer's and the argument's names, for the message.
    value : number, array, Quantity, ParamState, initialiser or tracer
        The time constant; a ``ParamState`` is checked through its value. An initialiser (any
        callable) and a JAX tracer have no value yet and are not checked.

    Raises
    ------
    ValueError
        If an entry is zero, negative or NaN, or the value is not numeric.
    """
    if isinstance(value, brainstate.ParamState):
        value = value.value
    mantissa = u.get_mantissa(value)
    if callable(value) or isinstance(mantissa, Tracer):
        return
    fix = f"e.g. {arg}=10. * brainunit.ms"
    entries = np.asarray(mantissa)
    if entries.dtype.kind not in "iuf":
        raise ValueError(
            f"{layer}: {arg} must be a positive number, array or brainunit quantity (a time "
            f"constant), got {value!r}; {fix}"
        )
    refused = ~(entries > 0)
    if refused.any():
        shown = _describe_entry(value, entries, refused)
        raise ValueError(f"{layer}: {arg} must be positive (a time constant), got {shown}; {fix}")


def check_constructor_arguments(
    layer: str,
    constructor: Callable[..., object],
    args: tuple[object, ...],
    kwargs: Mapping[str, object],
    checks: Mapping[str, ArgumentCheck],
) -> None:
    """Run ``checks`` on the arguments ``constructor`` is about to receive.

    Parameters
    ----------
    layer : str
        The layer's name, for the messages.
    constructor : callable
        The parent's bound ``__init__`` (``super().__init__``); the arguments are matched to its
        parameter names as Python would, so positional and keyword arguments are both checked.
    args, kwargs
        The constructor's arguments.
    checks : mapping of str to callable
        ``{argument name: check(layer, arg, value)}``; arguments not given are not checked
        (the defaults are valid).

    Raises
    ------
    ValueError
        From a check. Arguments that do not match the signature are not checked: the
        constructor then raises Python's usual ``TypeError``.

    Examples
    --------
    >>> import brainstate
    >>> checks = {"in_size": size_tuple, "out_size": size_tuple}
    >>> layer = brainstate.nn.Linear(3, 4)
    >>> check_constructor_arguments("Linear", layer.__init__, (3,), {"out_size": 0}, checks)
    Traceback (most recent call last):
        ...
    ValueError: Linear: out_size must be a positive int or a tuple of them, got 0.
    """
    try:
        given = inspect.signature(constructor).bind(*args, **kwargs).arguments
    except TypeError:
        return
    for arg, check in checks.items():
        if arg in given:
            check(layer, arg, given[arg])
