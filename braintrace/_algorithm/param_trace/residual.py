"""What the per-parameter engine's forward pass keeps for its backward pass (the ``BackwardResidual``).

Only what the configured terms read is kept. Single step, the one-step autodiff gradient
already holds the instantaneous term, so a trace contributes its history ``⟨g, D ε^{t-1}⟩``.
Where the trace was rolled plainly with that same ``D``, ``D ε^{t-1}`` is ``ε^t − x ⊗ df``:
reading the new trace leaves the entering one a single reader (its update, which then runs in
place instead of on a copy) and needs no transposed signal. Elsewhere the history is
``⟨Hᵀ g, ε^{t-1}⟩`` with the group's history Jacobian ``H`` (:func:`history_jacobians`). A
replaced learning signal swaps the same-step relation path (:func:`replaced_signal_residual`);
multi-step, the residual is the (filtered) trace entering the window.

It imports the one-step roll (for the substep product) and the engine's types.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._algorithm.param_trace.residual import history_jacobians
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
>>> D = jnp.full((4, 1, 1), 0.5)  # the one group's Jacobian, per position
>>> history_jacobians(learner.graph.hidden_groups, [D], {})[0] is D  # a plain group contracts with D itself
True
"""

from __future__ import annotations

from typing import Sequence

import jax

from braintrace._algorithm.engine.graph_executor import (
    CallJacobians,
    StepJacobians,
    WeightJacobians,
    detached_df_key,
    df_key,
    history_jacobian_key,
    is_step_jacobians,
    trace_key,
    widens,
)
from braintrace._algorithm.param_trace.roll import substep_product
from braintrace._algorithm.param_trace.types import (
    BackwardResidual,
    BackwardTrace,
    Carried,
    ParamTraceHost,
    PlainRoll,
    Tails,
    Terms,
    Traces,
    split_filtered,
)
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.snap_pattern import gather_signal
from braintrace._errors import internal_error
from braintrace._typing import TraceKey

__all__ = [
    "trace_for_backward", "history_trace", "replaced_signal_residual", "plain_rolls", "through_while",
    "history_jacobians", "with_previous_signal", "slot_signals",
]


def trace_for_backward(
    host: ParamTraceHost, old_etrace: Carried, new_etrace: Carried, jac: CallJacobians | None, single_step: bool,
) -> BackwardResidual:
    """The residual of a call (see the module docstring) from the traces entering and leaving it
    (``jac``: ``None`` where a stepper rolled a window's traces)."""
    filtered = bool(host._trace_filters)
    old_eps, old_filter = split_filtered(old_etrace, filtered)
    if not single_step:  # the trace term of the state entering the window
        return BackwardResidual(BackwardTrace(old_eps if old_filter is None else old_filter, None))
    if jac is None or not is_step_jacobians(jac):
        raise internal_error("a single step's residual needs the step's Jacobians, not transition points")
    new_eps, new_filter = split_filtered(new_etrace, filtered)
    if host._modulated:
        return BackwardResidual(BackwardTrace({}, None), learning_trace=new_eps if new_filter is None else new_filter)
    if not host.replaces_signal and old_filter is not None and new_filter is not None:
        # ē^t − x ⊗ df = κ ē^{t-1} + D ε^{t-1}: where the history is read off a new trace it is
        # read off the new filter, which holds both terms; the entering filter is then read by
        # its update alone (in place) and only the other keys keep the term κ ⟨g, ē^{t-1}⟩.
        history = history_trace(host, old_eps, new_filter, jac, reads_filter=True)
        return BackwardResidual(history, old_filter={k: v for k, v in old_filter.items() if k not in history.instant})
    history = history_trace(host, old_eps, new_eps, jac)
    if not host.replaces_signal:
        return BackwardResidual(history)
    return replaced_signal_residual(host, history, old_eps, new_eps, new_filter, jac)


def replaced_signal_residual(
    host: ParamTraceHost, history: BackwardTrace, old_eps: Traces, new_eps: Traces, new_filter: Traces | None,
    jac: StepJacobians,
) -> BackwardResidual:
    """Single step, replaced signal: the history, ``+ ⟨s, ē^t⟩`` and ``− ⟨g, ε^t⟩`` (the swap
    of the same-step relation path), with each plainly rolled trace read once.

    For a key rolled as ``ε^t = D ε^{t-1} + x ⊗ df``, ``−⟨g, ε^t⟩`` is
    ``−⟨Dᵀ g, ε^{t-1}⟩ − ⟨g, x ⊗ df⟩``. Where the history is read off ``ε^t`` (it is then
    ``⟨Dᵀ g, ε^{t-1}⟩``) the two cancel to ``−⟨g, x ⊗ df⟩``. Elsewhere (``swapped``) the
    history's signal ``q`` (``∂L/∂h^{t-1}`` of a group read past its update) meets
    ``ε^{t-1}`` as ``q − Dᵀ g`` in one contraction, and an unfiltered ``⟨s, ε^t⟩`` joins it
    as ``+ Dᵀ s`` and ``+ ⟨s, x ⊗ df⟩``; where the group has no history (``D ≡ 0``) and the
    signal is unfiltered, ``ε^t = x ⊗ df`` and the whole term is ``⟨s − g, x ⊗ df⟩``, which reads
    no trace (the key is left out of the learning trace). The other keys keep the three terms.
    """
    same_step = dict(history.instant)
    swapped, unread = {}, set()
    local_keys = host._local_relation_weights().keys
    for key, (index, group, instant) in plain_rolls(host, jac, history.through_while).items():
        if key not in same_step and index not in local_keys and group.descent is None:
            same_step[key] = instant
            if group.reads_its_past():
                swapped[key] = old_eps[key]
            elif new_filter is None:  # ε^t = x ⊗ df: the whole term is ⟨s − g, x ⊗ df⟩
                unread.add(key)
    # The learning trace is ē^t, or ε^t without a filter (then read off ε^{t-1} where swapped).
    learning = new_filter if new_filter is not None else {
        k: v for k, v in new_eps.items() if k not in swapped and k not in unread}
    rest = history._replace(traces={k: v for k, v in history.traces.items() if k not in same_step}, instant={})
    return BackwardResidual(rest, learning_trace=learning,
                            new_trace={k: v for k, v in new_eps.items() if k not in same_step},
                            same_step=same_step, swapped=swapped, roll_jacobians=list(jac[1]) if swapped else None,
                            swapped_learn=new_filter is None)


def history_trace(
    host: ParamTraceHost, old_etrace: Traces, new_etrace: Traces, jac: StepJacobians, reads_filter: bool = False,
) -> BackwardTrace:
    """Single step: what the history term reads, the new trace (less ``x ⊗ df``) of each key rolled
    plainly with its group's ``D``, the entering trace and the history Jacobians elsewhere.

    A key whose group has no history (``D ≡ 0``, :meth:`~braintrace.HiddenGroup.reads_its_past`)
    and whose weights are in the one-step VJP has no history term: it reads nothing, unless
    ``new_etrace`` is the new filter (``reads_filter``), whose history ``κ ē^{t-1}`` remains.
    """
    (_, dfs), Ds = jac
    history = history_jacobians(host.graph.hidden_groups, Ds, dfs)
    crossing = through_while(host.graph.hidden_param_op_relations, jac[0])
    read_past = host._groups_read_past_update()
    local_keys = host._local_relation_weights().keys
    traces, instant = dict(old_etrace), {}
    for key, (index, group, term) in plain_rolls(host, jac, crossing).items():
        if history[group.index] is not Ds[group.index] or group.index in read_past:
            continue
        if not (reads_filter or group.reads_its_past() or index in local_keys):
            del traces[key]
            continue
        traces[key] = new_etrace[key]
        instant[key] = term
    return BackwardTrace(traces, history, crossing, instant)


def plain_rolls(host: ParamTraceHost, jac: StepJacobians, crossing: Terms) -> dict[TraceKey, PlainRoll]:
    """Per trace key rolled plainly this step (``ε^t = D ε^{t-1} + x ⊗ df``, ``D`` its
    group's Jacobian): the relation's index, the group and the ``(x, df)`` of ``x ⊗ df``."""
    (xs, dfs), _ = jac
    relations = host.graph.hidden_param_op_relations if host._rolls_plainly() else []
    out = {}
    for index, rel in enumerate(relations):
        if rel.control_flow_context is not None:
            continue
        for group in rel.hidden_groups:
            key = trace_key(rel, group)
            if key not in crossing:
                x = None if rel.x_var is None else xs[id(rel.x_var)]
                out[key] = (index, group, (x, rel.output_layout(group, dfs[df_key(rel, group)])))
    return out


def through_while(relations: Sequence[HiddenParamOpRelation], h2w: WeightJacobians) -> Terms:
    """``(x, df through while)`` per trace key whose tail crosses a detached ``while_loop``.

    The perturbed step cuts reverse mode at such loops, so the one-step gradient lacks the
    same-step credit ``⟨g, x ⊗ df⟩`` of that part of the tail; the backward adds it.
    """
    xs, dfs = h2w
    found = {}
    for rel in relations:
        for group in rel.hidden_groups:
            key = detached_df_key(rel, group)
            if key in dfs:
                x = None if rel.x_var is None else xs[id(rel.x_var)]
                found[trace_key(rel, group)] = (x, dfs[key])
    return found


def history_jacobians(groups: Sequence[HiddenGroup], Ds: Sequence[jax.Array], dfs: Tails) -> list[jax.Array]:
    """Per group, the ``∂h^t/∂h^{t-1}`` the single-step history term contracts the signal with.

    ``D``; for a descended group the substep product ``D_L…D_1``; for a group whose members
    read each other's new values within the step, the partial Jacobian with those reads held
    fixed (the perturbation signal already carries those in-step paths).
    """
    out = []
    for group, D in zip(groups, Ds):
        if group.descent is not None:
            out.append(substep_product(D))
        else:
            out.append(dfs.get(history_jacobian_key(group), D))
    return out


def with_previous_signal(
    host: ParamTraceHost, residual: BackwardResidual, previous: list[jax.Array],
) -> BackwardResidual:
    """``residual`` with ``∂L/∂h^{t-1}`` (on the trace's slots) of every group read past its update."""
    read_past = host._groups_read_past_update()
    if not read_past:
        return residual
    previous = slot_signals(host.graph.hidden_groups, previous)
    history = residual.trace._replace(read_past_update={i: previous[i] for i in read_past})
    return residual._replace(trace=history)


def slot_signals(groups: Sequence[HiddenGroup], signals: Sequence[jax.Array]) -> list[jax.Array]:
    """Per group, the signal on the trace's slots: SnAp-widened groups gather each slot's
    ``∂L/∂h[nbr[p, k], a]``; the others keep theirs."""
    out = list(signals)
    for group in groups:
        if group.snap is not None and widens(group):
            out[group.index] = gather_signal(out[group.index], group.snap)
    return out
