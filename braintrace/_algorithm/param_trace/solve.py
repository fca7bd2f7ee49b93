"""The per-parameter engine's weight gradients: the learning signal contracted with the traces of the backward residual.

What a call adds to the exact one-step (single-step) or in-window (multi-step) gradient:

* single step, symmetric signal: the history ``⟨Dᵀ g, ε^{t-1}⟩`` (read as ``⟨g, ε^t⟩ − ⟨g, x ⊗ df⟩``
  where the residual kept the new trace), plus ``κ ⟨g, ē^{t-1}⟩`` with the filter;
* single step, replaced signal ``s``: ``⟨s, ē^t⟩ − ⟨g, ε^t⟩ + ⟨Dᵀ g, ε^{t-1}⟩``;
* single step, modulated: ``⟨s, ē^t⟩`` is the relation weights' whole gradient;
* multi-step: ``⟨s, ē⟩`` at the state entering the window.

Every contraction ``⟨signal, trace⟩`` is the rule record's
(:func:`~braintrace._algorithm.param_trace.relation_rule.contract`). Each instantaneous term is
recomputed by the rule that rolled the trace, so the two cancel exactly.

It imports the rule record's functions and the engine's types.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._algorithm.param_trace.solve import solve_instant
>>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 2))
>>> (rel,) = braintrace.find_hidden_param_op_relations_from_module(cell, jnp.ones(3))
>>> g, x, df = jnp.ones((2, 1)), jnp.ones(5), jnp.full((2, 1), 2.0)
>>> float(solve_instant(rel, g, x, df, {'weight': jnp.ones((5, 2))}, None)['weight'][0, 0])  # x ⊗ (g df)
2.0
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.graph_executor import trace_key
from braintrace._algorithm.engine.learning_signal import SignalPair
from braintrace._algorithm.engine.modulator import without_etp_gradients
from braintrace._algorithm.param_trace.relation_rule import contract, general_instant, transpose_signal
from braintrace._algorithm.param_trace.types import (
    BackwardResidual,
    BackwardTrace,
    ParamTraceHost,
    RelationInput,
    Signal,
    Terms,
)
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._typing import Path, PyTree, Trace

__all__ = [
    "solve_weight_gradients", "solve_traces", "solve_same_step", "solve_history_from_new", "solve_instant",
    "swapped_signals", "history_signal",
]


def solve_weight_gradients(
    host: ParamTraceHost, residual: BackwardResidual, signals: Sequence[Signal], weight_vals: dict[Path, PyTree],
    grads: dict[Path, PyTree], single_step: bool,
) -> dict[Path, PyTree]:
    """``grads`` (the exact one-step or in-window gradient) plus the trace terms of the call
    (see the module docstring); ``signals`` are per group, pairs where a signal replaces ``g``."""
    g = [p.autodiff if isinstance(p, SignalPair) else p for p in signals]
    s = [p.learning if isinstance(p, SignalPair) else p for p in signals]
    if host._modulated:  # ⟨s, ē^t⟩ is the relation weights' whole gradient
        plain = without_etp_gradients(grads, host._relation_parameter_paths())
        if residual.learning_trace is None:
            raise internal_error("the single-step residual of a modulated rule has no learning trace")
        return solve_traces(host, BackwardTrace(residual.learning_trace, None), s, weight_vals, plain)
    if not single_step:  # multi-step: ⟨s, (filtered) entering trace⟩
        return solve_traces(host, residual.trace, s, weight_vals, grads)
    grads = solve_traces(host, residual.trace, g, weight_vals, grads)  # ⟨Dᵀ g, ε^{t-1}⟩
    if residual.old_filter:  # + κ ⟨g, ē^{t-1}⟩
        kappa_g = [host.kappa * x for x in g]
        grads = solve_traces(host, BackwardTrace(residual.old_filter, None), kappa_g, weight_vals, grads)
    if residual.learning_trace is not None and residual.new_trace is not None:
        # Swap the same-step relation path: + ⟨s, ē^t⟩ − ⟨g, ε^t⟩, which is − ⟨g, x ⊗ df⟩ for
        # the keys whose history above was read off ε^t (BackwardResidual.same_step).
        minus_g = [-x for x in g]
        grads = solve_traces(host, BackwardTrace(residual.learning_trace, None), s, weight_vals, grads)
        grads = solve_traces(host, BackwardTrace(residual.new_trace, None), minus_g, weight_vals, grads)
        # Keys left out of the learning trace (no history, or rolled in the backward pass): ⟨s − g, x ⊗ df⟩.
        swapped = residual.swapped
        unread = {k for k in residual.same_step if k not in swapped and k not in residual.learning_trace}
        simple = {k: v for k, v in residual.same_step.items() if k not in swapped and k not in unread}
        grads = solve_same_step(host, simple, minus_g, weight_vals, grads)
        if unread:
            s_minus_g = [si - gi for si, gi in zip(s, g)]
            grads = solve_same_step(host, {k: residual.same_step[k] for k in unread}, s_minus_g, weight_vals, grads)
        if swapped and residual.roll_jacobians is not None:
            learned = s if residual.swapped_learn else None
            entering = swapped_signals(host.graph.hidden_groups, residual.trace, residual.roll_jacobians, g, learned)
            grads = solve_traces(host, BackwardTrace(swapped, None), entering, weight_vals, grads)
            instant = minus_g if learned is None else [si - gi for si, gi in zip(learned, g)]
            grads = solve_same_step(host, {k: residual.same_step[k] for k in swapped}, instant, weight_vals, grads)
    return grads


def swapped_signals(
    groups: Sequence[HiddenGroup], history: BackwardTrace, roll_jacobians: Sequence[jax.Array],
    g: Sequence[jax.Array], learned: Sequence[jax.Array] | None,
) -> list[jax.Array]:
    """Per group, what meets ``ε^{t-1}`` of :attr:`BackwardResidual.swapped`: the history's
    signal ``q`` minus ``Dᵀ g`` (``D`` the Jacobian that rolled the trace), plus ``Dᵀ s``
    for a ``learned`` signal ``s``."""
    out = []
    for group in groups:
        i = group.index
        rolled = g[i] if learned is None else g[i] - learned[i]
        out.append(history_signal(history, i, g[i]) - transpose_signal(rolled, roll_jacobians[i]))
    return out


def history_signal(history: BackwardTrace, index: int, g: jax.Array) -> jax.Array:
    """What the history term of group ``index`` meets ``ε^{t-1}`` with: ``∂L/∂h^{t-1}`` for a
    group read past its update, else ``Hᵀ g`` (``H`` its history Jacobian; ``g`` where there is
    none)."""
    if index in history.read_past_update:
        return history.read_past_update[index]
    if history.history_jacobians is not None:
        return transpose_signal(g, history.history_jacobians[index])
    return g


def solve_traces(
    host: ParamTraceHost, backward: BackwardTrace, dl_to_hidden_groups: Sequence[jax.Array],
    weight_vals: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
) -> dict[Path, PyTree]:
    """``dl_to_etws_at_t`` plus the contraction of the signals with ``backward``'s traces."""
    etrace, Ds, through_while, instant, read_past = backward
    grads = dict(dl_to_etws_at_t)
    local_keys = host._local_relation_weights().keys
    for index, rel in enumerate(host.graph.hidden_param_op_relations):
        fp = host._fast_path(rel)
        weights = host._relation_operands(rel, weight_vals)
        for group in rel.hidden_groups:
            key = trace_key(rel, group)
            if key not in etrace:  # a term that reads some keys only (the entering filter)
                continue
            signal = dl_to_hidden_groups[group.index]
            if key in instant:
                per_key = solve_history_from_new(
                    rel, rel.output_layout(group, signal), etrace[key], *instant[key], weights, fp,
                    local_keys.get(index, frozenset()))
            elif group.index in read_past:
                previous = rel.output_layout(group, read_past[group.index])
                per_key = contract(rel.primitive, rel.eqn_params, previous, etrace[key], weights, fp)
            else:
                if Ds is not None:
                    signal = transpose_signal(signal, Ds[group.index])
                per_key = contract(rel.primitive, rel.eqn_params, rel.output_layout(group, signal), etrace[key], weights, fp)
            if key in through_while:
                x, df = through_while[key]
                zero = {k: jnp.zeros_like(v) for k, v in etrace[key].items()}
                no_history = jnp.zeros((*df.shape, df.shape[-1]), df.dtype)
                inst = host._step_relation(rel, group, zero, no_history, x, df, weights)
                current = rel.output_layout(group, dl_to_hidden_groups[group.index])
                extra = contract(rel.primitive, rel.eqn_params, current, inst, weights, fp)
                per_key = {k: per_key[k] + extra[k] for k in per_key}
            for k, g in per_key.items():
                grads = host._add_operand_gradient(grads, rel, k, g, weight_vals)
    return grads


def solve_history_from_new(
    rel: HiddenParamOpRelation, signal: jax.Array, new: Trace, x: RelationInput, df: jax.Array, weights: Trace,
    fp: reg.FastPathRules | None, covered: frozenset[str] = frozenset(),
) -> Trace:
    """``⟨g, D ε^{t-1}⟩ = ⟨g, ε^t⟩ − ⟨g, x ⊗ df⟩`` for a plainly rolled trace.

    For the ``covered`` keys (weights left out of the one-step VJP) the whole ``⟨g, ε^t⟩``
    is the gradient. On CPU a barrier keeps XLA from recomputing ``ε^t`` from ``ε^{t-1}``
    inside the contraction, which would give the entering trace a second reader and cost a
    copy of it; on a TPU XLA fuses the two better without it (GRU-256 D_RTRL on a v5e: 2.05×
    BPTT's step instead of 2.26×). The instantaneous term is recomputed by the rule that
    rolled the trace (the fast path's kernel, or the primitive's ``instant_drtrl`` /
    ``xy_to_dw``), so the two cancel exactly.
    """
    if jax.default_backend() == "cpu":
        new = jax.lax.optimization_barrier(new)
    total = contract(rel.primitive, rel.eqn_params, signal, new, weights, fp)
    if not set(total) - covered:
        return total
    current = solve_instant(rel, signal, x, df, weights, fp)
    return {k: v if k in covered else v - current[k] for k, v in total.items()}


def solve_instant(
    rel: HiddenParamOpRelation, signal: jax.Array, x: RelationInput, df: jax.Array, weights: Trace,
    fp: reg.FastPathRules | None,
) -> Trace:
    """``⟨signal, x ⊗ df⟩``, the instantaneous term built by the rule that rolls the trace
    (the fast path ``fp``'s kernel, or the primitive's ``instant_drtrl`` / ``xy_to_dw``)."""
    has_bias = bool(rel.eqn_params.get("has_bias", False))
    if fp is not None and fp.solve_instant is not None:
        return fp.solve_instant(signal, x, df, has_bias, fold_batch=reg.is_batched_primitive(rel.primitive))
    inst = fp.instant(x, df, has_bias) if fp is not None else general_instant(rel.primitive, rel.eqn_params, x, df, weights)
    return contract(rel.primitive, rel.eqn_params, signal, inst, weights, fp)


def solve_same_step(
    host: ParamTraceHost, same_step: Terms, dl_to_hidden_groups: Sequence[jax.Array],
    weight_vals: dict[Path, PyTree], grads: dict[Path, PyTree],
) -> dict[Path, PyTree]:
    """``grads`` plus ``⟨signal, x ⊗ df⟩`` of every key in ``same_step``, except for the weights
    left out of the one-step VJP, whose gradient holds no same-step term."""
    local_keys = host._local_relation_weights().keys
    for index, rel in enumerate(host.graph.hidden_param_op_relations):
        fp = host._fast_path(rel)
        weights = host._relation_operands(rel, weight_vals)
        covered = local_keys.get(index, frozenset())
        for group in rel.hidden_groups:
            key = trace_key(rel, group)
            if key not in same_step or not set(host.etrace_bwg[key].value) - covered:
                continue
            signal = rel.output_layout(group, dl_to_hidden_groups[group.index])
            term = solve_instant(rel, signal, *same_step[key], weights, fp)
            for k, v in term.items():
                if k not in covered:
                    grads = host._add_operand_gradient(grads, rel, k, v, weight_vals)
    return grads
