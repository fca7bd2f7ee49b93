"""How a relation's trainable operand is computed from parameters.

An ETP operation may read its weight through ordinary operations on ``ParamState`` leaves:
``matmul(x, W * mask)``, ``matmul(x, jnp.abs(W))`` (Dale's law), ``matmul(x, 2 * W)``,
``matmul(x, W.T)``, ``matmul(x, jnp.concatenate([W_in, W_rec]))``. The learners keep their
eligibility traces with respect to the operand; an :class:`OperandChain` gives the operand's
value from the parameters and pulls a gradient with respect to the operand back to every
parameter leaf it reads.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from braintrace._compiler.operand_chain import operand_chain
>>> closed = jax.make_jaxpr(lambda w, u: jnp.concatenate([2 * w, u]))(jnp.ones(2), jnp.ones(1))
>>> w, u = closed.jaxpr.invars
>>> chain = operand_chain(closed, closed.jaxpr.outvars[0], {w: ('w',), u: ('u',)}, {('w',): [w], ('u',): [u]})
>>> chain.leaves
[(('w',), 0), (('u',), 0)]
>>> chain.value({('w',): jnp.ones(2), ('u',): jnp.zeros(1)})
Array([2., 2., 0.], dtype=float32)
>>> [g for _, _, g in chain.pullback({('w',): jnp.ones(2), ('u',): jnp.zeros(1)}, jnp.ones(3))]
[Array([2., 2.], dtype=float32), Array([1.], dtype=float32)]
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import jax
from jax.typing import ArrayLike

from braintrace._compatible_imports import ClosedJaxpr, Jaxpr, Var, closed_jaxpr_constvars, eval_jaxpr, is_var
from braintrace._compiler.jaxpr_graph import build_producer_map, new_jaxpr
from braintrace._compiler.module_info import Path
from braintrace._typing import PyTree

__all__ = ["OperandChain", "operand_chain"]


class OperandChain(NamedTuple):
    """The equations from parameter leaves (and constants) to a trainable operand.

    Attributes
    ----------
    jaxpr : Jaxpr
        Inputs: the parameter leaves, in :attr:`leaves` order; one output, the operand.
    consts : list
        The values of ``jaxpr``'s constvars.
    leaves : list of (path, leaf index)
        The ``ParamState`` leaves the operand reads.
    """

    jaxpr: Jaxpr
    consts: list[ArrayLike]
    leaves: list[tuple[Path, int]]

    def _leaf_values(self, weight_vals: Mapping[Path, PyTree]) -> list[jax.Array]:
        return [jax.tree.leaves(weight_vals[path])[index] for path, index in self.leaves]

    def _apply(self, *leaves: jax.Array) -> jax.Array:
        return eval_jaxpr(self.jaxpr, self.consts, *leaves)[0]

    def value(self, weight_vals: Mapping[Path, PyTree]) -> jax.Array:
        """The operand computed from the current parameter values."""
        return self._apply(*self._leaf_values(weight_vals))

    def pullback(self, weight_vals: Mapping[Path, PyTree], cotangent: jax.Array) -> list[tuple[Path, int, jax.Array]]:
        """``(path, leaf index, gradient)`` of every leaf for a gradient ``cotangent`` of the operand."""
        operand, vjp = jax.vjp(self._apply, *self._leaf_values(weight_vals))
        grads = vjp(cotangent.astype(operand.dtype))
        return [(path, index, g) for (path, index), g in zip(self.leaves, grads)]


def operand_chain(
    closed_jaxpr: ClosedJaxpr,
    operand: Var,
    invar_to_weight_path: dict[Var, Path],
    weight_path_to_invars: dict[Path, list[Var]],
) -> OperandChain | None:
    """The equations that compute ``operand`` from parameter leaves and constants.

    Returns ``None`` when ``operand`` also reads a value that is neither (a model input, a
    hidden or other state): the operand then changes from step to step, and a trace kept with
    respect to it cannot be pulled back to the parameters.
    """
    jaxpr = closed_jaxpr.jaxpr
    producers = build_producer_map(jaxpr)
    const_values = dict(zip(closed_jaxpr_constvars(closed_jaxpr), closed_jaxpr.consts, strict=True))
    leaves: list[Var] = []
    consts: list[Var] = []
    kept: set[int] = set()
    seen: set[Var] = set()
    stack = [operand]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in invar_to_weight_path:
            leaves.append(v)
        elif v in const_values:
            consts.append(v)
        elif v in producers:
            eqn = producers[v]
            kept.add(id(eqn))
            stack.extend(a for a in eqn.invars if is_var(a))
        else:
            return None
    eqns = [eqn for eqn in jaxpr.eqns if id(eqn) in kept]
    order = {v: i for i, v in enumerate(jaxpr.invars)}
    leaves.sort(key=lambda v: order.get(v, len(order)))
    paths = [invar_to_weight_path[v] for v in leaves]
    indices = [weight_path_to_invars.get(p, [v]).index(v) for p, v in zip(paths, leaves)]
    return OperandChain(
        jaxpr=new_jaxpr(consts, leaves, [operand], eqns, name="operand_chain"),
        consts=[const_values[v] for v in consts],
        leaves=list(zip(paths, indices)),
    )
