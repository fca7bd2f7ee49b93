"""One step of ``pp_prop``'s factored traces: the input trace ``ε_x`` and the output trace ``ε_f`` of every relation.

Per distinct input ``x`` (as the primitive's ``pp_x_repr`` represents it, ``x̃``) and per
(relation, hidden group) output:

* ``ε_x ← α_x ε_x + x̃``;
* ``ε_f ← α_f (R ε_f) + (1 − α_f) df``, with ``R`` what the f side's recursion reads (the
  executor substitutes it for ``D``), mixed over the group's states per position;

and the count ``k`` of steps the traces absorbed since the last reset advances by one (it
drives the bias correction ``1 − α_f^k``, :mod:`~braintrace._algorithm.io_trace.solve`), each by
the per-relation functions of :mod:`~braintrace._algorithm.io_trace.relation_rule` over the
learner's storage (one input trace per input variable, one counter). This module also names the
carried state (:class:`IOTrace`) and the learner as its functions read it (:class:`IOTraceHost`);
it imports the graph executor's keys.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.io_trace.roll import x_tilde
>>> x_tilde({7: jnp.ones(2)}, {7: (None, {})})  # an input without a pp_x_repr is filtered as it is
{7: Array([1., 1.], dtype=float32)}
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence, TypedDict

import jax

from braintrace._algorithm.engine.graph_executor import DfKey, df_key
from braintrace._algorithm.io_trace.relation_rule import XRepr, advance, represent_input, roll_input, roll_output
from braintrace._compiler import ETraceGraph

__all__ = ["IOTrace", "IOStepper", "IOTraceHost", "x_tilde", "step", "stepper"]


class IOTrace(TypedDict):
    """The traced state of the rule."""

    #: Per ``id(x_var)``, the input trace ``ε_x`` (shaped like ``x̃``).
    xs: dict[int, jax.Array]
    #: Per ``(id(y_var), 'hidden_group_i')``, the output trace ``ε_f`` ``(*varshape, S)``.
    dfs: dict[tuple[int, str], jax.Array]
    #: The steps absorbed since the last reset (an int32 scalar).
    steps: jax.Array


#: ``stepper(trace, (xs, dfs, Ds)) -> (trace, None)``: one step of the traces in a scan.
IOStepper = Callable[
    [IOTrace, tuple[dict[int, jax.Array], dict[DfKey, jax.Array], Sequence[jax.Array]]], tuple[IOTrace, None]]


class IOTraceHost(Protocol):
    """The learner (:class:`~braintrace.IODimVjpAlgorithm`) as the step reads it."""

    @property
    def graph(self) -> ETraceGraph:
        """The compiled graph of the model step."""

    @property
    def decay_x(self) -> float:
        """``α_x``, the decay of the input traces."""

    @property
    def decay_f(self) -> float:
        """``α_f``, the decay of the output traces."""

    @property
    def _x_reprs(self) -> Mapping[int, XRepr]:
        """Per ``id(x_var)``, how the input trace represents the input."""


def x_tilde(xs: Mapping[int, jax.Array], reprs: Mapping[int, XRepr]) -> dict[int, jax.Array]:
    """The inputs as the x traces filter them (``pp_x_repr`` where registered)."""
    return {key: represent_input(x, reprs[key]) for key, x in xs.items()}


def step(
    host: IOTraceHost, etrace: IOTrace, xs: dict[int, jax.Array], dfs: dict[DfKey, jax.Array],
    Ds: Sequence[jax.Array],
) -> IOTrace:
    """The traces after one step of inputs ``xs``, tails ``dfs`` and per-group ``R`` ``Ds``.

    Raises
    ------
    ValueError
        If the step's inputs are not the traced ones (the learner was compiled for another model).
    """
    alpha_x, alpha = host.decay_x, host.decay_f
    if set(xs) != set(etrace["xs"]):
        raise ValueError(
            f"pp_prop: the step's inputs {sorted(xs)} do not match the traced inputs "
            f"{sorted(etrace['xs'])}; recompile the learner."
        )
    filtered = x_tilde(xs, host._x_reprs)
    new_xs = {k: roll_input(v, filtered[k], alpha_x) for k, v in etrace["xs"].items()}
    new_dfs: dict[tuple[int, str], jax.Array] = {}
    for rel in host.graph.hidden_param_op_relations:
        for group in rel.hidden_groups:
            key = df_key(rel, group)
            # Ds holds the f side's R (the executor substitutes it for D).
            new_dfs[key] = roll_output(etrace["dfs"][key], Ds[group.index], dfs[key], alpha)
    return {"xs": new_xs, "dfs": new_dfs, "steps": advance(etrace["steps"])}


def stepper(host: IOTraceHost) -> IOStepper:
    """``stepper(trace, (xs, dfs, Ds))``: :func:`step` in a scan."""

    def one_step(
        carry: IOTrace, jac: tuple[dict[int, jax.Array], dict[DfKey, jax.Array], Sequence[jax.Array]],
    ) -> tuple[IOTrace, None]:
        xs, dfs, Ds = jac
        return step(host, carry, xs, dfs, Ds), None

    return one_step
