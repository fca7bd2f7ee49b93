"""Exception types raised by braintrace.

The operand errors inherit from two builtin exceptions each, so that code catching what JAX
itself would raise for the same mistake (a ``TypeError`` from ``dot_general`` for mismatched
contraction sizes, an ``AttributeError`` for a list operand) keeps working, while the message
names the argument, shows the value and says what to do.
"""

from __future__ import annotations

__all__ = ["OperandShapeError", "OperandTypeError"]


class OperandShapeError(ValueError, TypeError):
    """An operand of an ETP operator has a shape that does not fit the others."""


class OperandTypeError(TypeError, AttributeError):
    """An operand of an ETP operator is not an array (or a ``brainunit.Quantity``)."""
