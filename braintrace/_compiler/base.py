"""The shared jaxpr walker of the compiler passes and the opaque-control-flow policy check.

Each pass (hidden groups, hidden perturbation) walks the flat step jaxpr once with a
:class:`JaxprEvaluation` subclass: ``jit``, ``scan``, ``while`` and ``cond`` equations go
through :func:`check_unsupported_op` first, everything else straight to ``_eval_eqn``.

Examples
--------
>>> import jax
>>> from braintrace._compiler.base import find_matched_vars
>>> jaxpr = jax.make_jaxpr(lambda a, b, c: a + b + c)(1.0, 2.0, 3.0).jaxpr
>>> a, b, c = jaxpr.invars
>>> find_matched_vars(jaxpr.invars, {c: None, a: None}) == [a, c]
True
"""

from __future__ import annotations

from typing import Container, Iterable

from braintrace._compatible_imports import (
    CONTROL_FLOW_PRIMITIVES,
    Atom,
    Jaxpr,
    JaxprEqn,
    Var,
    is_jit,
    is_var,
    source_line,
)
from braintrace._compiler.control_flow_policy import DEFAULT_CONTROL_FLOW_POLICY, ControlFlowPolicy
from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
from braintrace._errors import NotSupportedError
from braintrace._typing import Path

__all__ = [
    "JaxprEvaluation",
    "check_unsupported_op",
    "find_matched_vars",
    "find_element_exist_in_the_set",
]



def find_matched_vars(invars: Iterable[Atom], candidates: Container[Var]) -> list[Var]:
    """The entries of ``invars`` that are ``Var``s found in ``candidates`` (order kept)."""
    return [v for v in invars if is_var(v) and v in candidates]


def find_element_exist_in_the_set(elements: Iterable[Atom], candidates: Container[Var]) -> Var | None:
    """The first entry of ``elements`` that is a ``Var`` in ``candidates``, or ``None``."""
    for v in elements:
        if is_var(v) and v in candidates:
            return v
    return None


class JaxprEvaluation:
    """Walks the equations of a step jaxpr, routing control flow through the policy check.

    Parameters
    ----------
    weight_invars, hidden_invars, hidden_outvars : collections
        Variables of the step's weights and hidden states.
    invar_to_hidden_path, outvar_to_hidden_path : dict
        Path lookups for messages.
    control_flow : ControlFlowPolicy
        The policy applied to control-flow equations left in the jaxpr.
    """

    def __init__(
        self,
        weight_invars: Iterable[Var],
        hidden_invars: Iterable[Var],
        hidden_outvars: Iterable[Var],
        invar_to_hidden_path: dict[Var, Path],
        outvar_to_hidden_path: dict[Var, Path],
        *,
        control_flow: ControlFlowPolicy = DEFAULT_CONTROL_FLOW_POLICY,
    ) -> None:
        self.weight_invars = dict.fromkeys(weight_invars)
        self.hidden_invars = dict.fromkeys(hidden_invars)
        self.hidden_outvars = dict.fromkeys(hidden_outvars)
        self.invar_to_hidden_path = invar_to_hidden_path
        self.outvar_to_hidden_path = outvar_to_hidden_path
        self.control_flow = control_flow
        self.descended_scan_eqn_ids: frozenset[int] = frozenset()

    def _eval_jaxpr(self, jaxpr: Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if is_jit(eqn):
                check_unsupported_op(self, eqn, "jit")
            elif name in CONTROL_FLOW_PRIMITIVES:
                check_unsupported_op(self, eqn, name)
            self._eval_eqn(eqn)

    def _eval_eqn(self, eqn: JaxprEqn) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _eval_eqn.")


def check_unsupported_op(self: JaxprEvaluation, eqn: JaxprEqn, op_name: str) -> None:
    """Apply the opaque-control-flow policy to one ``jit``/``scan``/``while``/``cond`` equation.

    Raises
    ------
    NotSupportedError
        When a weight is consumed by a ``while`` (naming its source line).
    NotImplementedError
        When a weight is consumed by another equation, or it computes a hidden state and the
        policy (or a ``jit``) does not allow it.
    ValueError
        For an invalid ``while_hidden`` policy value.
    """
    if op_name == "scan" and id(eqn) in self.descended_scan_eqn_ids:
        return
    policy = self.control_flow
    weight = find_element_exist_in_the_set(eqn.invars, self.weight_invars)
    if weight is not None:
        _reject_weight(eqn, op_name)
    hidden = find_element_exist_in_the_set(eqn.outvars, self.hidden_outvars)
    if hidden is None:
        return
    path = self.outvar_to_hidden_path.get(hidden)
    if op_name in CONTROL_FLOW_PRIMITIVES and policy.while_hidden == "opaque-fwd":
        emit(
            DiagnosticKind.CONTROL_FLOW_OPAQUE_FWD, DiagnosticLevel.INFO,
            f"Hidden state {path} is computed by a weight-free `{op_name}`; it is kept as an "
            f"opaque forward node and its Jacobians are taken in forward mode.",
            hidden_paths=(path,) if path is not None else (),
            context={"op_name": op_name, "evaluator": type(self).__name__, "hidden_path": path},
        )
        return
    raise NotImplementedError(
        f"Currently, we do not support the hidden states are computed within a {op_name} "
        f"function (hidden state {path}). Compute the hidden state outside the {op_name}, or "
        f"use ControlFlowPolicy(while_hidden='opaque-fwd')."
    )


def _reject_weight(eqn: JaxprEqn, op_name: str) -> None:
    if op_name == "while":
        line = source_line(eqn.source_info)
        message = (
            f"A trainable weight is used inside a while_loop{f' at {line}' if line else ''}. Online "
            f"learning cannot trace a weight through a loop of data-dependent length: apply the weight "
            f"outside the loop so that the loop consumes only its result, or write the loop with a "
            f"fixed trip count (lax.fori_loop with static bounds, or lax.scan), which the compiler "
            f"unrolls or descends."
        )
        emit(DiagnosticKind.WEIGHT_IN_WHILE, DiagnosticLevel.ERROR, message, also_warn=False)
        raise NotSupportedError(message)
    message = (
        f"Currently, we do not support the weight states are used within a {op_name} function. "
        f"Apply the weight outside the {op_name}, or let the compiler flatten it "
        f"(ControlFlowPolicy cond='convert', a scan within scan_unroll_limit)."
    )
    emit(DiagnosticKind.WEIGHT_IN_CONTROL_FLOW, DiagnosticLevel.ERROR, message, also_warn=False)
    raise NotImplementedError(message)
