"""Evaluating a jaxpr equation by equation, each bound by a chosen function.

The executors run a compiled step this way so that some equations can be bound other than as
JAX binds them: a relation with user-registered rules through its ``xy_to_dw``, a ``while``
loop through a reverse-differentiable wrapper, a loop's inputs detached.

Examples
--------
>>> import jax
>>> jaxpr = jax.make_jaxpr(lambda a, b: a * b + a)(1.0, 2.0).jaxpr
>>> eval_jaxpr(jaxpr, [], [3.0, 4.0])
[Array(15., dtype=float32, weak_type=True)]
"""

from __future__ import annotations

from typing import Callable, Sequence

from braintrace._compatible_imports import Atom, DropVar, Jaxpr, JaxprEqn, Literal, Var, bind_equation, jaxpr_all_invars
from braintrace._errors import internal_error
from braintrace._typing import Array

__all__ = ["EqnBinder", "bind_eqn", "eval_jaxpr"]

#: ``bind(eqn, operands) -> outputs``: how :func:`eval_jaxpr` evaluates one equation.
EqnBinder = Callable[[JaxprEqn, list[Array]], list[Array]]


def bind_eqn(eqn: JaxprEqn, operands: list[Array]) -> list[Array]:
    """The outputs of ``eqn`` at ``operands``, as JAX itself would evaluate it.

    Examples
    --------
    >>> import jax
    >>> eqn = jax.make_jaxpr(lambda a: -a)(1.0).jaxpr.eqns[0]
    >>> bind_eqn(eqn, [2.0])
    [Array(-2., dtype=float32, weak_type=True)]
    """
    return bind_equation(eqn, operands)


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Array], args: Sequence[Array], bind: EqnBinder = bind_eqn) -> list[Array]:
    """JAX's ``eval_jaxpr`` with every top-level equation evaluated by ``bind``.

    ``[*consts, *args]`` are bound to every input of ``jaxpr`` in order, constants first.

    Examples
    --------
    >>> import jax
    >>> jaxpr = jax.make_jaxpr(lambda a: a + 1.0)(1.0).jaxpr
    >>> eval_jaxpr(jaxpr, [], [2.0], bind=lambda eqn, operands: [operands[0] * 10])  # every eqn rebound
    [20.0]
    """
    every = jaxpr_all_invars(jaxpr)
    if len(consts) + len(args) != len(every):
        raise internal_error(f"{len(consts)} constants and {len(args)} arguments for a jaxpr of {len(every)} inputs")
    env: dict[Var, Array] = dict(zip(every, [*consts, *args]))

    def read(a: Atom) -> Array:
        return a.val if isinstance(a, Literal) else env[a]

    for eqn in jaxpr.eqns:
        with eqn.ctx.manager:
            outs = bind(eqn, [read(a) for a in eqn.invars])
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, DropVar))
    return [read(v) for v in jaxpr.outvars]
