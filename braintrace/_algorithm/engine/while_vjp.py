"""``while_loop`` equations differentiated in reverse mode, by recomputing their iterations.

JAX differentiates a ``while_loop`` in forward mode only: its trip count depends on the data,
so reverse mode has no record of the iterations to walk back. A learner differentiates whole
steps in reverse mode (a multi-step window through every one of its steps, a single step with
respect to its inputs), so the executors bind the equations of a step through
:func:`bind_reversibly`: a ``while`` equation becomes :func:`bind_reversible_while`, a
``custom_vjp`` function whose forward pass also counts the iterations ``n`` and whose backward
pass walks them back. For ``k = n-1, …, 0`` it recomputes the carry entering iteration ``k``
from the loop's input (``k`` body evaluations) and pulls the cotangent back through that one
iteration with ``jax.vjp``. A ``cond`` or ``scan`` holding a loop in a body is bound with its
bodies rewritten the same way, as is a loop nested in a loop's body.

That is the chain rule through the very iterations the forward pass took, so it is exact; it
costs ``n(n+1)/2`` body evaluations and keeps no per-iteration memory. The cotangents of the
body's constant operands are summed over the iterations. The condition's operands get none (the
condition only picks the trip count, a piecewise-constant function of them), nor do integer
and boolean operands. The compiler refuses a loop that reads a trainable weight before any
learner runs (a weight inside the loop has no eligibility trace), so what crosses a loop here is
the cotangent of hidden states, inputs and values computed from weights outside the loop.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> halve = lambda z: jax.lax.while_loop(lambda c: jnp.max(jnp.abs(c)) > 0.4, lambda c: 0.5 * c, z)
>>> eqn = jax.make_jaxpr(halve)(jnp.ones(2)).jaxpr.eqns[0]
>>> jax.grad(lambda z: bind_reversibly(eqn, [z])[0].sum())(jnp.array([1.0, 0.1]))  # halved twice
Array([0.25, 0.25], dtype=float32)
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.jaxpr_eval import eval_jaxpr
from braintrace._compatible_imports import (
    ClosedJaxpr,
    JaxprEqn,
    bind_equation,
    map_closed_subjaxprs,
    subjaxprs,
    while_params,
)
from braintrace._compatible_imports import eval_jaxpr as eval_closed
from braintrace._compiler.jaxpr_graph import contains_eqn
from braintrace._typing import Array

__all__ = ["bind_reversibly", "bind_reversible_while", "reversible_jaxpr"]


def _is_while(eqn: JaxprEqn) -> bool:
    return bool(eqn.primitive.name == "while")


def bind_reversibly(eqn: JaxprEqn, operands: Sequence[Array]) -> list[Array]:
    """The outputs of ``eqn`` at ``operands``, reverse-differentiable through every ``while`` in it.

    A ``while`` equation is bound by :func:`bind_reversible_while`; a ``cond`` or ``scan`` whose
    bodies hold one, with those bodies rewritten by :func:`reversible_jaxpr`; any other equation
    as JAX binds it.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> def f(p, z):  # a loop inside a branch
    ...     halve = lambda z: jax.lax.while_loop(lambda c: c > 0.4, lambda c: 0.5 * c, z)
    ...     return jax.lax.cond(p, halve, lambda z: z, z)
    >>> eqn = jax.make_jaxpr(f)(True, 1.0).jaxpr.eqns[-1]
    >>> jax.grad(lambda z: bind_reversibly(eqn, [1, z])[0])(1.0)  # halved twice
    Array(0.25, dtype=float32, weak_type=True)
    """
    if _is_while(eqn):
        return bind_reversible_while(eqn, operands)
    if eqn.primitive.name in ("cond", "scan") and any(contains_eqn(body, _is_while) for body in subjaxprs(eqn)):
        return bind_equation(map_closed_subjaxprs(eqn, reversible_jaxpr), operands)
    return bind_equation(eqn, operands)


def reversible_jaxpr(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` traced anew with every equation bound by :func:`bind_reversibly` (itself when it
    holds no ``while``).

    Examples
    --------
    >>> import jax
    >>> closed = jax.make_jaxpr(lambda z: jax.lax.while_loop(lambda c: c > 0.4, lambda c: 0.5 * c, z))(1.0)
    >>> [eqn.primitive.name for eqn in reversible_jaxpr(closed).jaxpr.eqns]
    ['custom_vjp_call']
    """
    if not contains_eqn(closed.jaxpr, _is_while):
        return closed
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *args: eval_jaxpr(closed.jaxpr, closed.consts, args, bind_reversibly))(*avals)


def bind_reversible_while(eqn: JaxprEqn, operands: Sequence[Array]) -> list[Array]:
    """The outputs of the ``while`` equation ``eqn`` at ``operands``, reverse-differentiable.

    The value is the loop's own (the equation bound as it is); reverse mode recomputes the
    iterations (see the module docstring). Forward mode cannot differentiate the result (a
    ``custom_vjp`` function): take forward-mode derivatives of the equation itself.

    Parameters
    ----------
    eqn : JaxprEqn
        A ``while`` equation.
    operands : sequence
        Its operands: the condition's constants, the body's constants, then the initial carry.

    Returns
    -------
    list
        The final carry.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> def settle(h, target):  # six relaxation steps h <- (h + target) / 2, counted in the carry
    ...     return jax.lax.while_loop(lambda c: c[1] < 6, lambda c: (0.5 * c[0] + 0.5 * target, c[1] + 1), (h, 0))[0]
    >>> eqn = jax.make_jaxpr(settle)(1.0, 2.0).jaxpr.eqns[0]
    >>> grad = jax.grad(lambda h, t: bind_reversible_while(eqn, [t, h, 0])[0], argnums=(0, 1))
    >>> [round(float(g), 6) for g in grad(1.0, 2.0)]  # 0.5**6 and 1 - 0.5**6
    [0.015625, 0.984375]
    """
    loop = while_params(eqn)
    n_cond, n_body = loop.cond_nconsts, loop.body_nconsts
    reversible_body = reversible_jaxpr(loop.body)

    def cond(cond_consts: list[Array], carry: list[Array]) -> Array:
        return eval_closed(loop.cond.jaxpr, loop.cond.consts, *cond_consts, *carry)[0]

    def body(body_consts: list[Array], carry: list[Array]) -> list[Array]:
        return list(eval_closed(reversible_body.jaxpr, reversible_body.consts, *body_consts, *carry))

    @jax.custom_vjp
    def reversible(cond_consts: list[Array], body_consts: list[Array], init: list[Array]) -> list[Array]:
        return bind_equation(eqn, [*cond_consts, *body_consts, *init])

    def fwd(cond_consts: list[Array], body_consts: list[Array], init: list[Array]) -> tuple[list[Array], _Residuals]:
        final, trips = jax.lax.while_loop(
            lambda state: cond(cond_consts, state[0]),
            lambda state: (body(body_consts, state[0]), state[1] + 1),
            (init, jnp.zeros((), jnp.int32)),
        )
        return final, (body_consts, init, trips)

    def bwd(residuals: _Residuals, cotangents: list[Array]) -> tuple[None, list[Array | None], list[Array | None]]:
        body_consts, init, trips = residuals
        d_consts, d_init = _walk_back(body, body_consts, init, trips, cotangents)
        return None, d_consts, d_init

    reversible.defvjp(fwd, bwd)
    values = list(operands)
    return reversible(values[:n_cond], values[n_cond:n_cond + n_body], values[n_cond + n_body:])


#: What the forward pass of a reversible loop keeps: ``(body constants, initial carry, trip count)``.
_Residuals = tuple[list[Array], list[Array], Array]
#: ``body(body_consts, carry) -> carry``: one iteration of a loop.
_LoopBody = Callable[[list[Array], list[Array]], list[Array]]


def _walk_back(
    body: _LoopBody, body_consts: list[Array], init: list[Array], trips: jax.Array, cotangents: list[Array]
) -> tuple[list[Array | None], list[Array | None]]:
    """The cotangents of the body's constants and of the initial carry, from those of the final carry.

    Iteration ``k`` (from the last, ``trips - 1``, down to ``0``) is recomputed from ``init`` and
    pulled back with ``jax.vjp``; only the floating-point operands are differentiated.
    """
    carried = [i for i, v in enumerate(init) if _differentiable(v)]
    constant = [i for i, v in enumerate(body_consts) if _differentiable(v)]

    def one_iteration(carry: list[Array], consts_part: list[Array], carry_part: list[Array]) -> list[Array]:
        consts, full = list(body_consts), list(carry)
        for i, v in zip(constant, consts_part):
            consts[i] = v
        for i, v in zip(carried, carry_part):
            full[i] = v
        out = body(consts, full)
        return [out[i] for i in carried]

    def back_one(j: Array, state: tuple[list[Array], list[Array]]) -> tuple[list[Array], list[Array]]:
        d_carry, d_consts = state
        k = trips - 1 - j
        carry = jax.lax.fori_loop(0, k, lambda _, c: body(body_consts, c), list(init))
        _, pullback = jax.vjp(
            lambda cs, hs: one_iteration(carry, cs, hs), [body_consts[i] for i in constant], [carry[i] for i in carried]
        )
        dc, dh = pullback(d_carry)
        return dh, [a + b for a, b in zip(d_consts, dc)]

    start = ([jnp.asarray(cotangents[i], jnp.result_type(init[i])) for i in carried],
             [jnp.zeros_like(body_consts[i]) for i in constant])
    d_carried, d_constant = jax.lax.fori_loop(0, trips, back_one, start)
    d_init: list[Array | None] = [None] * len(init)
    d_consts: list[Array | None] = [None] * len(body_consts)
    for i, g in zip(carried, d_carried):
        d_init[i] = g
    for i, g in zip(constant, d_constant):
        d_consts[i] = g
    return d_consts, d_init


def _differentiable(value: Array) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(value), jnp.inexact))
