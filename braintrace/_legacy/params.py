"""The deprecated v0.1 parameter classes: a weight bundled with the operator that uses it.

``ETraceParam`` / ``ElemWiseParam`` are ``ParamState``s whose ``execute`` calls an ETP
operator (the compiler registers a relation); ``NonTempParam`` is a ``ParamState`` used
through plain JAX (no relation); ``FakeETraceParam`` / ``FakeElemWiseParam`` are not states
at all (invisible to the compiler and never trained).

Migration: a ``brainstate.ParamState`` plus an ETP function (``braintrace.matmul``,
``braintrace.element_wise``) replaces the first two; a ``ParamState`` with ordinary JAX ops
replaces ``NonTempParam``; a plain value replaces the fakes.
"""

from __future__ import annotations

import enum
from typing import Callable

import brainstate

from braintrace._legacy.ops import ElemWiseOp, ETraceOp, Hook, Operand, Weights, identity

__all__ = [
    "ETraceGrad",
    "ETraceParam",
    "ElemWiseParam",
    "NonTempParam",
    "FakeETraceParam",
    "FakeElemWiseParam",
]


class ETraceGrad(enum.Enum):
    """The v0.1 gradient mode of an ``ETraceParam`` (recorded; it has no effect)."""

    full = "full"
    approx = "approx"
    adaptive = "adaptive"


#: A plain-JAX operator ``op(x, weights) -> y``.
RawOp = Callable[[Operand, Weights], Operand]


def _grad_mode(grad: ETraceGrad | str | None) -> ETraceGrad:
    if grad is None:
        return ETraceGrad.adaptive
    if isinstance(grad, ETraceGrad):
        return grad
    if isinstance(grad, str) and grad in ETraceGrad.__members__:
        return ETraceGrad(grad)
    raise ValueError(
        f"ETraceParam: grad must be None or one of {list(ETraceGrad.__members__)}, got {grad!r}."
    )


def _raw_op(op: ETraceOp | RawOp, cls: str) -> tuple[RawOp, ETraceOp | None]:
    """An operator's plain-JAX form: ``(callable, the ETraceOp or None)``."""
    if isinstance(op, ETraceOp):
        return op.raw_xw_to_y, op
    if callable(op):
        return op, None
    raise TypeError(f"{cls}: op must be an ETraceOp or a callable (x, w) -> y, got {type(op).__name__}.")


class ETraceParam(brainstate.ParamState):
    """Deprecated: a weight whose ``execute(x)`` runs its ETP operator, ``op(x, value)``.

    Parameters
    ----------
    weight : pytree of arrays
    op : ETraceOp
    grad : {'full', 'approx', 'adaptive'} or None
        Recorded as :attr:`gradient` (``None`` → ``'adaptive'``); it has no effect.
    name : str, optional

    Raises
    ------
    TypeError
        If ``op`` is not an ``ETraceOp``.
    ValueError
        If ``grad`` is not a known mode.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import ETraceParam, MatMulOp
    >>> p = ETraceParam({'weight': jnp.ones((2, 3))}, MatMulOp())
    >>> p.execute(jnp.ones(2))
    Array([2., 2., 2.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(
        self, weight: Weights, op: ETraceOp, grad: ETraceGrad | str | None = None, name: str | None = None,
    ) -> None:
        if not isinstance(op, ETraceOp):
            raise TypeError(
                f"{type(self).__name__}: op must be an ETraceOp (e.g. MatMulOp()), got "
                f"{type(op).__name__}."
            )
        gradient = _grad_mode(grad)
        super().__init__(weight, name=name)
        self.op = op
        self.gradient = gradient
        self.is_etrace = True

    def execute(self, x: Operand) -> Operand:
        """``op(x, value)`` through the ETP operator."""
        return self.op(x, self.value)


class ElemWiseParam(ETraceParam):
    """Deprecated: a weight used element-wise, ``execute() = op(value)``.

    Parameters
    ----------
    weight : array
    op : ElemWiseOp or callable
        A plain callable is wrapped in ``ElemWiseOp``.
    name : str, optional

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import ElemWiseParam
    >>> ElemWiseParam(jnp.array([-1.0, 2.0]), jnp.abs).execute()
    Array([1., 2.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(self, weight: Operand, op: ElemWiseOp | Hook = identity, name: str | None = None) -> None:
        if not isinstance(op, ElemWiseOp):
            if not callable(op):
                raise TypeError(
                    f"ElemWiseParam: op must be an ElemWiseOp or a callable, got {type(op).__name__}."
                )
            op = ElemWiseOp(op)
        super().__init__(weight, op, grad="full", name=name)

    def execute(self) -> Operand:  # type: ignore[override]
        """``op(value)`` through :func:`braintrace.element_wise`."""
        return self.op.xw_to_y(None, self.value)


class NonTempParam(brainstate.ParamState):
    """Deprecated: a weight used through plain JAX, ``execute(x) = op(x, value)``.

    Parameters
    ----------
    value : pytree of arrays
    op : ETraceOp or callable
        An ``ETraceOp`` is used through its plain-JAX ``raw_xw_to_y`` (kept as ``_op``).
    name : str, optional

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import MatMulOp, NonTempParam
    >>> NonTempParam({'weight': jnp.ones((2, 1))}, MatMulOp()).execute(jnp.ones(2))
    Array([2.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(self, value: Weights, op: ETraceOp | RawOp, name: str | None = None, **_kwargs: object) -> None:
        raw, etrace_op = _raw_op(op, "NonTempParam")
        super().__init__(value, name=name)
        self.op = raw
        if etrace_op is not None:
            self._op = etrace_op

    def execute(self, x: Operand) -> Operand:
        """``op(x, value)`` in plain JAX."""
        return self.op(x, self.value)


class FakeETraceParam:
    """Deprecated: a plain value with an operator, ``execute(x) = op(x, value)`` (not a state).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import FakeETraceParam, MatMulOp
    >>> FakeETraceParam({'weight': jnp.ones((2, 1))}, MatMulOp()).execute(jnp.ones(2))
    Array([2.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(self, value: Weights, op: ETraceOp | RawOp) -> None:
        self.op, etrace_op = _raw_op(op, "FakeETraceParam")
        if etrace_op is not None:
            self._op = etrace_op
        self.value = value

    def execute(self, x: Operand) -> Operand:
        """``op(x, value)`` in plain JAX."""
        return self.op(x, self.value)


class FakeElemWiseParam:
    """Deprecated: a plain value used element-wise, ``execute() = op(value)`` (not a state).

    Parameters
    ----------
    weight : array
    op : ElemWiseOp or callable
        An ``ElemWiseOp`` is used through its plain-JAX ``raw_xw_to_y``.
    name : str, optional

    Raises
    ------
    TypeError
        If ``op`` is an ``ETraceOp`` other than ``ElemWiseOp``, or not callable.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import FakeElemWiseParam
    >>> FakeElemWiseParam(jnp.array([-1.0, 2.0]), jnp.abs).execute()
    Array([1., 2.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(self, weight: Operand, op: ElemWiseOp | Hook = identity, name: str | None = None) -> None:
        if isinstance(op, ETraceOp) and not isinstance(op, ElemWiseOp):
            raise TypeError(
                f"FakeElemWiseParam: an ETraceOp must be an ElemWiseOp, got {type(op).__name__}."
            )
        if not callable(op):
            raise TypeError(f"FakeElemWiseParam: op must be callable, got {type(op).__name__}.")
        self.op = op
        self.value = weight
        self.name = name

    def execute(self) -> Operand:
        """``op(value)`` in plain JAX."""
        if isinstance(self.op, ElemWiseOp):
            return self.op.raw_xw_to_y(None, self.value)
        return self.op(self.value)
