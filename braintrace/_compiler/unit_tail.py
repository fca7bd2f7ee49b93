"""Whether a relation's output enters the hidden states it drives unscaled (``df ≡ 1``).

A relation ``y = op(x, W)`` reaches each group it drives through its tail ``y -> h``. Where
every tail adds ``y`` as it is (``h = λ h + y``, ``v = λ (v - s) + y``), ``df = ∂h/∂y`` is one
at every value, so ``x ⊗ df ⊙ g`` is ``x ⊗ g``: a rule whose trace leaves ``df`` out (OTTT's
presynaptic trace) then holds the exact same-step term of the gradient.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._compiler.unit_tail import enters_unscaled
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self, squash):
...         super().__init__()
...         self.squash = squash
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.9 * self.h.value + self.squash(braintrace.matmul(x, self.w.value))
...         return self.h.value
>>> [enters_unscaled(braintrace.compile_etrace_graph(Leaky(f), jnp.ones(3)).hidden_param_op_relations[0])
...  for f in (lambda y: y, jnp.tanh)]
[True, False]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from braintrace._compatible_imports import Jaxpr, Var, eval_jaxpr
from braintrace._compiler.hid_param_op import HiddenParamOpRelation, tail_constvars
from braintrace._op._rule_helpers import dtype_of, shape_of

__all__ = ["enters_unscaled"]


def enters_unscaled(rel: HiddenParamOpRelation) -> bool:
    """Whether ``rel``'s output enters every state it drives with derivative exactly one.

    Read off the JAX derivative of each tail: its tangent output must be the tangent of ``y``
    itself, untouched (an ``add`` whose other operand does not depend on ``y`` passes the tangent
    through). A scaled, squashed, converted or repeated ``y`` gives some other tangent, and so
    does a tail JAX cannot see through (a nested ``jit``): the answer errs toward ``False``.
    """
    spec = _spec(rel.y_var)
    tails = rel.y_to_hidden_group_jaxprs
    return bool(tails) and all(_passes_tangent(tail, spec) for tail in tails)


def _passes_tangent(tail: Jaxpr, y: jax.ShapeDtypeStruct) -> bool:
    if not jnp.issubdtype(y.dtype, jnp.inexact):
        return False
    consts = [_spec(v) for v in tail_constvars(tail)]

    def tangent(consts: list[jax.Array], y: jax.Array, dy: jax.Array) -> list[jax.Array]:
        return jax.jvp(lambda y: eval_jaxpr(tail, consts, y), (y,), (dy,))[1]

    jaxpr = jax.make_jaxpr(tangent)(consts, y, y).jaxpr
    dy = jaxpr.invars[-1]
    return bool(jaxpr.outvars) and all(v is dy for v in jaxpr.outvars)


def _spec(var: Var) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape_of(var), dtype_of(var))
