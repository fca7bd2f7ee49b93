"""One step of ``pp_prop``'s factored traces: the input trace ``ε_x`` and the output trace ``ε_f`` of every relation.

Per distinct input ``x`` (as the primitive's ``pp_x_repr`` represents it, ``x̃``) and per
(relation, hidden group) output:

* ``ε_x ← α_x ε_x + x̃``;
* ``ε_f ← α_f (R ε_f) + (1 − α_f) df``, with ``R`` what the f side's recursion reads (the
  executor substitutes it for ``D``), mixed over the group's states per position;

and the count ``k`` of steps the traces absorbed since the last reset advances by one (it
drives the bias correction ``1 − α_f^k``, :mod:`~braintrace._algorithm.io_trace.solve`). This
module also names the carried state (:class:`IOTrace`) and the learner as its functions read it
(:class:`IOTraceHost`); it imports the graph executor's keys and the trace storage helpers.

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
import jax.numpy as jnp

from braintrace._algorithm.engine.graph_executor import DfKey, df_key
from braintrace._algorithm.carriers.trace_storage import math_dtype
from braintrace._compiler import ETraceGraph
from braintrace._op._rule_helpers import mix_states

__all__ = ["IOTrace", "XRepr", "IOStepper", "IOTraceHost", "x_tilde", "step", "stepper"]

# The step counter saturates here instead of wrapping around; α^k has long underflowed.
_MAX_STEPS = 2**30


class IOTrace(TypedDict):
    """The traced state of the rule."""

    #: Per ``id(x_var)``, the input trace ``ε_x`` (shaped like ``x̃``).
    xs: dict[int, jax.Array]
    #: Per ``(id(y_var), 'hidden_group_i')``, the output trace ``ε_f`` ``(*varshape, S)``.
    dfs: dict[tuple[int, str], jax.Array]
    #: The steps absorbed since the last reset (an int32 scalar).
    steps: jax.Array


#: An input's ``pp_x_repr`` rule (``None``: the input as it is) and the weight avals it reads.
XRepr = tuple[Callable[..., jax.Array] | None, Mapping[str, object]]
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
    out = {}
    for key, x in xs.items():
        rule, avals = reprs[key]
        out[key] = x if rule is None else rule(x, avals)
    return out


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
    # A stored trace is upcast to the step's precision, filtered, and rounded once on write,
    # by astype: these factors are vectors, and on them trace_storage.rounded's split (for
    # trace-sized updates) measured slower (leaky64 bf16/f32 1.46 against 1.05-1.08).
    new_xs = {k: (alpha_x * v.astype(math_dtype(v, filtered[k])) + filtered[k]).astype(v.dtype)
              for k, v in etrace["xs"].items()}
    new_dfs: dict[tuple[int, str], jax.Array] = {}
    for rel in host.graph.hidden_param_op_relations:
        for group in rel.hidden_groups:
            key = df_key(rel, group)
            old = etrace["dfs"][key]
            math = math_dtype(old, dfs[key])
            # (1 − α) rounded like the bias correction's 1 − α^1, so they cancel at step one.
            # Ds holds the f side's R (the executor substitutes it for D).
            gain = 1 - jnp.asarray(alpha, math)
            new = alpha * mix_states(Ds[group.index], old.astype(math)) + gain * dfs[key]
            new_dfs[key] = new.astype(old.dtype)
    steps = jnp.minimum(etrace["steps"] + 1, _MAX_STEPS).astype(etrace["steps"].dtype)
    return {"xs": new_xs, "dfs": new_dfs, "steps": steps}


def stepper(host: IOTraceHost) -> IOStepper:
    """``stepper(trace, (xs, dfs, Ds))``: :func:`step` in a scan."""

    def one_step(
        carry: IOTrace, jac: tuple[dict[int, jax.Array], dict[DfKey, jax.Array], Sequence[jax.Array]],
    ) -> tuple[IOTrace, None]:
        xs, dfs, Ds = jac
        return step(host, carry, xs, dfs, Ds), None

    return one_step
