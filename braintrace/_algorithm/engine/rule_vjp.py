"""Relations differentiated by their registered ``xy_to_dw`` rule.

JAX differentiates an ETP primitive through its forward implementation. A user who registers
their own ``xy_to_dw`` for a primitive (a surrogate, a straight-through estimator, a local
learning rule) makes that rule the primitive's weight gradient, so wherever a learner's one-step
or in-window gradient passes through such an equation, its trainable operands must receive
``xy_to_dw(x, ∂L/∂y, weights)`` and not JAX's derivative of the forward pass. The executor binds
those equations through :func:`bind_by_registered_rule`, a ``custom_vjp`` whose backward pass
calls the rule; every other operand keeps JAX's own derivative.

The library's primitives with the library's rules keep the plain binding: there ``xy_to_dw`` is
the exact derivative of the forward pass, which JAX computes as well.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from braintrace import register_primitive
>>> p = register_primitive('doc_twice_rule_mm', lambda x, w: x @ w)
>>> p.register_xy_to_dw(lambda x, hd, weights: {'weight': 2 * jnp.outer(x, hd)})
>>> eqn = jax.make_jaxpr(lambda x, w: p.bind(x, w))(jnp.ones(2), jnp.ones((2, 3))).eqns[0]
>>> grad = jax.grad(lambda w: bind_by_registered_rule(eqn, [jnp.ones(2), w])[0].sum())
>>> grad(jnp.ones((2, 3)))  # the registered rule, not x ⊗ 1
Array([[2., 2., 2.],
       [2., 2., 2.]], dtype=float32)
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from braintrace._compatible_imports import JaxprEqn
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._typing import Array

__all__ = ["bind_by_registered_rule"]


def bind_by_registered_rule(eqn: JaxprEqn, operands: Sequence[Array]) -> list[Array]:
    """The outputs of ``eqn`` at ``operands``, differentiated by the primitive's ``xy_to_dw``.

    Reverse mode gives each trainable operand ``xy_to_dw(x, ∂L/∂y, weights)``, plus, for a
    primitive with several outputs, JAX's derivative through the outputs other than ``y``.
    Every other operand gets JAX's derivative of the forward pass.

    Raises
    ------
    ValueError
        (when differentiated) If the rule returns other keys than the trainable operands or
        a gradient of another shape than its operand.
    """
    primitive, params = eqn.primitive, eqn.params
    trainable = reg.get_trainable_invars(primitive, params)
    x_index = reg.get_x_invar_index(primitive)
    y_index = reg.get_y_outvar_index(primitive)
    record = reg.get_etp_rules(primitive)
    rule = None if record is None else record.xy_to_dw
    if rule is None:
        raise internal_error(f"a relation of the ETP primitive {primitive.name!r} bound by a rule it lacks (xy_to_dw)")
    trained = set(trainable.values())

    def forward(*values: Array) -> list[Array]:
        out = primitive.bind(*values, **params)
        return list(out) if primitive.multiple_results else [out]

    @jax.custom_vjp
    def bound(*values: Array) -> list[Array]:
        return forward(*values)

    def fwd(*values: Array) -> tuple[list[Array], tuple[Array, ...]]:
        return forward(*values), values

    def bwd(values: tuple[Array, ...], cotangents: list[Array]) -> tuple[Array | None, ...]:
        grads: list[Array | None] = [None] * len(values)
        others = [i for i, v in enumerate(values) if i not in trained and _differentiable(v)]
        if others:
            grads = _jax_pullback(forward, values, others, cotangents, grads)
        if len(cotangents) > 1:
            rest = [jnp.zeros_like(c) if i == y_index else c for i, c in enumerate(cotangents)]
            grads = _jax_pullback(forward, values, sorted(trained), rest, grads)
        weights = {key: values[i] for key, i in trainable.items()}
        x = None if x_index is None else values[x_index]
        by_rule = rule(x, cotangents[y_index], weights, **params)
        for key, i in trainable.items():
            g = _checked(by_rule, key, values[i], primitive.name)
            before = grads[i]
            grads[i] = g if before is None else before + g
        return tuple(grads)

    bound.defvjp(fwd, bwd)
    return bound(*operands)


def _differentiable(value: Array) -> bool:
    return jnp.issubdtype(jnp.result_type(value), jnp.inexact)


def _jax_pullback(
    forward: Callable[..., list[Array]], values: tuple[Array, ...], wrt: list[int], cotangents: list[Array],
    grads: list[Array | None],
) -> list[Array | None]:
    """``grads`` plus JAX's VJP of ``forward`` with respect to the operands ``wrt``."""

    def partial(*chosen: Array) -> list[Array]:
        full = list(values)
        for i, v in zip(wrt, chosen):
            full[i] = v
        return forward(*full)

    _, vjp = jax.vjp(partial, *[values[i] for i in wrt])
    out = list(grads)
    for i, g in zip(wrt, vjp(list(cotangents))):
        before = out[i]
        out[i] = g if before is None else before + g
    return out


def _checked(by_rule: object, key: str, operand: Array, name: str) -> Array:
    if not isinstance(by_rule, dict) or key not in by_rule:
        got = sorted(by_rule) if isinstance(by_rule, dict) else type(by_rule).__name__
        raise ValueError(
            f"The xy_to_dw rule registered for {name} must return a dict with a gradient for every "
            f"trainable operand ({key!r} among them); it returned {got}."
        )
    g = jnp.asarray(by_rule[key])
    if g.shape != jnp.shape(operand):
        raise ValueError(
            f"The xy_to_dw rule registered for {name} returned a {key!r} gradient of shape "
            f"{g.shape} for an operand of shape {jnp.shape(operand)}; it must return the gradient "
            f"with respect to the operand, summed over any batch axis of x."
        )
    return g.astype(jnp.result_type(operand))
