"""Exception types raised by braintrace.

The operand errors inherit from two builtin exceptions each, so that code catching what JAX
itself would raise for the same mistake (a ``TypeError`` from ``dot_general`` for mismatched
contraction sizes, an ``AttributeError`` for a list operand) keeps working, while the message
names the argument, shows the value and says what to do.
"""

from __future__ import annotations

__all__ = [
    "OperandShapeError",
    "OperandTypeError",
    "ModelTypeError",
    "NotSupportedError",
    "CompilationError",
]


class OperandShapeError(ValueError, TypeError):
    """An operand of an ETP operator has a shape that does not fit the others."""


class OperandTypeError(TypeError, AttributeError):
    """An operand of an ETP operator is not an array (or a ``brainunit.Quantity``)."""


class NotSupportedError(Exception):
    """The model uses a feature the eligibility-trace compiler does not support.

    Raised, for example, when a ``ParamState`` is written inside the model step, or when the
    hidden states of one recurrently coupled group have different shapes.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> class WritesWeight(brainstate.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = brainstate.ParamState(jnp.ones(2))
    ...         self.h = brainstate.HiddenState(jnp.zeros(2))
    ...     def update(self, x):
    ...         self.w.value = 0.9 * self.w.value  # weights may not change inside a step
    ...         self.h.value = braintrace.element_wise(self.w.value) * x
    ...         return self.h.value
    >>> braintrace.compile_etrace_graph(WritesWeight(), jnp.ones(2))
    Traceback (most recent call last):
        ...
    braintrace.NotSupportedError: ...
    """


class CompilationError(Exception):
    """A model cannot be turned into an online learner (e.g. no weight reaches a hidden state).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> plain = brainstate.nn.Linear(3, 2)  # no ETP operator, no hidden state
    >>> braintrace.compile(plain, braintrace.D_RTRL, jnp.ones(3))
    Traceback (most recent call last):
        ...
    braintrace.CompilationError: No trainable weights are routed through ETP ops to a hidden state, ...
    """


for _cls in (NotSupportedError, CompilationError):
    _cls.__module__ = "braintrace"


class ModelTypeError(TypeError, AssertionError):
    """The object given as a model is not a ``brainstate.nn.Module``."""
