"""``pp_prop``'s weight gradients: the learning signal pulled back through each primitive at the filtered input.

Per relation and hidden group the estimate is ``xy_to_dw(ε_x, Σ_a (ε_f / c)[..., a] g[..., a])``
with ``c = max(1 − α_f^k, 1e-8)`` (:func:`correction`) undoing the bias of the zero-initialised
filters after ``k`` steps. Single step, the exact one-step gradient already holds the same-step
term ``xy_to_dw(x̃_t, Σ_a df_t[..., a] g[..., a])``, which is subtracted (not for the weights
left out of the one-step VJP, whose gradient is the whole estimate); a group whose previous
value the step reads past its update takes ``⟨∂L/∂h^{t-1}, x̄^{t-1} ⊗ df̄^{t-1}⟩`` from the
entering traces instead. Multi-step, the estimate at the trace entering the window is added.
Modulated (``learning_signal='modulatory'``), the estimate met by the modulator is the relation
weights' whole gradient.

It imports the one-step roll's types (:mod:`~braintrace._algorithm.io_trace.roll`).

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.io_trace.solve import correction
>>> correction(jnp.asarray(1), jnp.float32, 0.5), correction(jnp.asarray(0), jnp.float32, 0.5)  # k = 1, k = 0
(Array(0.5, dtype=float32), Array(1.e-08, dtype=float32))
"""

from __future__ import annotations

from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from braintrace._algorithm.engine.graph_executor import DfKey, detached_df_key, df_key
from braintrace._algorithm.io_trace.roll import IOTrace, IOTraceHost
from braintrace._algorithm.engine.learning_signal import SignalPair
from braintrace._algorithm.engine.modulator import without_etp_gradients
from braintrace._algorithm.engine.operand_credit import CreditHost
from braintrace._algorithm.carriers.trace_storage import math_dtype
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import sum_states
from braintrace._typing import Path, PyTree, Trace

__all__ = ["IOInstant", "IOResidual", "IOSolveHost", "correction", "solve_weight_gradients", "solve_modulated",
           "history_from_entering", "pull_back"]

#: Single step, the same-step factors ``(x̃_t, df_t)`` per input key and df key.
IOInstant = tuple[dict[int, jax.Array], dict[DfKey, jax.Array]]
#: What the backward pass receives: the trace the estimate is read off, the same-step factors
#: (``None``: multi-step), the entering trace (``None``: multi-step), and per group read past
#: its update, ``∂L/∂h^{t-1}``.
IOResidual = tuple[IOTrace, IOInstant | None, IOTrace | None, dict[int, jax.Array]]


class IOSolveHost(IOTraceHost, CreditHost, Protocol):
    """The learner (:class:`~braintrace.IODimVjpAlgorithm`) as the gradient reads it."""

    @property
    def fast_solve(self) -> bool:
        """Whether ``xy_to_dw`` is called once per relation (else once per hidden state)."""


def correction(steps: jax.Array, dtype: DTypeLike, decay_f: float) -> jax.Array:
    """``max(1 − α_f^k, 1e-8)`` for a trace that absorbed ``k = steps`` steps (no gradient)."""
    # An integer power: exact repeated products, so 1 − α^1 rounds like the (1 − α) gain.
    c = 1 - jax.lax.pow(jnp.asarray(decay_f, dtype), steps)
    return jax.lax.stop_gradient(jnp.maximum(c, jnp.asarray(1e-8, dtype)))


def solve_weight_gradients(
    host: IOSolveHost, residual: IOResidual, signals: Sequence[jax.Array | SignalPair],
    weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
) -> dict[Path, PyTree]:
    """The call's gradients: the autodiff ones plus each relation's estimate (see the module docstring)."""
    etrace, instant, entering, read_past = residual
    if host._modulated:  # the estimate meets the modulator and is the relation weights' whole gradient
        modulators = [p.learning if isinstance(p, SignalPair) else p for p in signals]
        return solve_modulated(host, etrace, modulators, weight_vals, dl_to_etws_at_t)
    grads = dict(dl_to_etws_at_t)
    for path, g in dl_to_nonetws_at_t.items():
        grads[path] = g if grads.get(path) is None else jax.tree.map(jnp.add, grads[path], g)
    local_keys = host._local_relation_weights().keys
    for index, rel in enumerate(host.graph.hidden_param_op_relations):
        weights = host._relation_operands(rel, weight_vals)
        x_trace = None if rel.x_var is None else etrace["xs"][id(rel.x_var)]
        for group in rel.hidden_groups:
            key = df_key(rel, group)
            # The estimate meets the learning signal; the same-step term removed is autodiff's.
            pair = signals[group.index]
            autodiff, signal = pair if isinstance(pair, SignalPair) else (pair, pair)
            if group.index in read_past:
                if entering is None:
                    raise internal_error("a multi-step residual of pp_prop reads a group past its update")
                per_key = history_from_entering(host, rel, group, entering, read_past[group.index], weights)
                for k, dw in per_key.items():
                    grads = host._add_operand_gradient(grads, rel, k, dw, weight_vals)
                continue
            eps_f = etrace["dfs"][key]
            c = correction(etrace["steps"], jnp.result_type(eps_f, signal), host.decay_f)
            per_key = pull_back(host.fast_solve, rel, group, x_trace, (eps_f / c) * signal, weights)
            # The same-step term is subtracted where the one-step VJP holds it too: not the
            # part of df that crosses a while_loop, which the perturbed step detaches.
            covered = local_keys.get(index, frozenset())
            if instant is not None and set(per_key) - covered:
                x_t = None if rel.x_var is None else instant[0][id(rel.x_var)]
                df = instant[1][key]
                if detached_df_key(rel, group) in instant[1]:
                    df = df - instant[1][detached_df_key(rel, group)]
                same = pull_back(host.fast_solve, rel, group, x_t, df * autodiff, weights)
                per_key = {k: v if k in covered else v - same[k] for k, v in per_key.items()}
            for k, dw in per_key.items():
                grads = host._add_operand_gradient(grads, rel, k, dw, weight_vals)
    return grads


def solve_modulated(
    host: IOSolveHost, etrace: IOTrace, modulators: Sequence[jax.Array], weight_vals: dict[Path, PyTree],
    grads: dict[Path, PyTree],
) -> dict[Path, PyTree]:
    """``⟨expand(m), x̄ ⊗ ε_f / c⟩`` per relation, the ETP parameters' autodiff terms dropped."""
    grads = without_etp_gradients(grads, host._relation_parameter_paths())
    for rel in host.graph.hidden_param_op_relations:
        weights = host._relation_operands(rel, weight_vals)
        x_trace = None if rel.x_var is None else etrace["xs"][id(rel.x_var)]
        for group in rel.hidden_groups:
            eps_f = etrace["dfs"][df_key(rel, group)]
            m = modulators[group.index]
            c = correction(etrace["steps"], jnp.result_type(eps_f, m), host.decay_f)
            for k, dw in pull_back(host.fast_solve, rel, group, x_trace, (eps_f / c) * m, weights).items():
                grads = host._add_operand_gradient(grads, rel, k, dw, weight_vals)
    return grads


def history_from_entering(
    host: IOSolveHost, rel: HiddenParamOpRelation, group: HiddenGroup, entering: IOTrace, previous: jax.Array,
    weights: Trace,
) -> Trace:
    """``⟨∂L/∂h^{t-1}, x̄^{t-1} ⊗ df̄^{t-1}⟩``, bias-corrected, from the traces entering the step."""
    x_trace = None if rel.x_var is None else entering["xs"][id(rel.x_var)]
    eps_f = entering["dfs"][df_key(rel, group)]
    c = correction(entering["steps"], jnp.result_type(eps_f, previous), host.decay_f)
    return pull_back(host.fast_solve, rel, group, x_trace, (eps_f / c) * previous, weights)


def pull_back(
    fast_solve: bool, rel: HiddenParamOpRelation, group: HiddenGroup, x: jax.Array | None, delta: jax.Array,
    weights: Trace,
) -> Trace:
    """``xy_to_dw(x, Σ_a delta[..., a])``: the VJP of the primitive at input ``x``.

    ``delta`` is laid out over the group's positions, ``(*varshape, S)``. ``xy_to_dw`` is
    linear in its cotangent, so with ``fast_solve`` the hidden states are summed first (one
    call); otherwise one call per state, summed.
    """
    delta = rel.output_layout(group, delta)
    if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(math_dtype(x, delta))  # a stored input trace meets delta in its precision
    rule = reg.required_rules(rel.primitive).xy_to_dw
    if fast_solve:
        return rule(x, sum_states(delta), weights, **rel.eqn_params)
    parts = [rule(x, delta[..., a], weights, **rel.eqn_params) for a in range(delta.shape[-1])]
    return {k: sum((p[k] for p in parts[1:]), parts[0][k]) for k in parts[0]}
