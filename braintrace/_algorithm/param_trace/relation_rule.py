"""D-RTRL's rule for one relation: its trace ``ε = ∂h/∂θ``, rolled and solved by the operation's rules.

The per-relation maths of every per-parameter trace learner (D_RTRL, EProp, SnAp, OSTL, OSTTP),
as a :class:`~braintrace.TraceRule` record (:func:`d_rtrl_rule`) and the functions it is made of:

* the roll ``ε ← D ε + x ⊗ df``: :func:`roll_relation`, by the primitive's closed-form kernels
  (:class:`~braintrace._op.FastPathRules`, in the parameters' precision whatever the trace's
  storage dtype) or else its own rules, ``dt_to_t`` for ``D ε`` (:func:`general_recurrent`)
  and ``instant_drtrl`` (or ``xy_to_dw``) for ``x ⊗ df`` (:func:`general_instant`);
* the history ``⟨Dᵀ g, ε^{t-1}⟩`` a single step adds to its exact one-step gradient:
  :func:`transpose_signal`, then :func:`contract`, by the kernels' ``solve`` or the primitive's
  ``solve_drtrl`` (or ``dt_to_t``) rule.

The learners roll every trace through the record (``learner.relation_rule``); their windows,
filters and swapped signals contract with the same :func:`contract`. Run on its own by
``braintrace.compile(model, braintrace.d_rtrl_rule(), x0)``, the record gives D_RTRL's
single-step gradients in the regime :func:`d_rtrl_rule` states
(``tests/algorithm/test_d_rtrl_rule.py``).

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> cell = braintrace.nn.ValinaRNNCell(3, 4)
>>> learner = braintrace.compile(cell, braintrace.d_rtrl_rule(), jnp.ones(3))
>>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
>>> grads[('W', 'weight')]['weight'].shape
(7, 4)
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from braintrace._algorithm.carriers.trace_storage import computed_once, math_dtype, store, upcast
from braintrace._algorithm.engine.rule_contract import (
    RelationInfo,
    RelationStep,
    TraceRule,
    abstract_var,
    info_primitive,
    step_info,
)
from braintrace._algorithm.param_trace.types import RelationInput
from braintrace._compatible_imports import Primitive
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import SPELLED_OUT_STATES, mix_states
from braintrace._typing import Trace

__all__ = [
    "d_rtrl_rule", "init_rule_kwargs", "fast_path_of", "roll_relation", "general_recurrent", "general_instant", "contract",
    "transpose_signal",
]


def init_rule_kwargs(rule: Callable[..., object], **available: object) -> dict[str, object]:
    """The optional context (``group=``, ``eqn_params=``) an init rule declares it accepts."""
    try:
        params = inspect.signature(rule).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(available)
    return {k: v for k, v in available.items() if k in params}


def fast_path_of(etp: Primitive, params: Mapping[str, object], enabled: bool) -> reg.FastPathRules | None:
    """The closed-form kernels that roll and solve an equation of ``etp`` with ``params``, or
    ``None`` where they are switched off (``fast_solve=False``), absent or not applicable (a
    transform hook such as ``weight_fn``)."""
    fp = reg.get_fast_path_rules(etp)
    if enabled and fp is not None and fp.applicable(dict(params)):
        return fp
    return None


def roll_relation(
    etp: Primitive, params: Mapping[str, object], old: Trace, diag: jax.Array, x: RelationInput, df: jax.Array, weights: Trace,
    fp: reg.FastPathRules | None, has_history: bool = True,
) -> Trace:
    """``D ε + x ⊗ df`` of a relation's trace ``old``, by the kernels ``fp`` (``None``: the
    operation's rules); ``diag`` and ``df`` are laid out over ``y``'s positions.

    ``has_history=False`` (``D`` is identically zero, :attr:`~braintrace.RelationInfo.has_history`):
    ``x ⊗ df`` alone, without reading ``old`` (XLA does not fold ``0 · ε``, and would read the
    trace every step); the values are those of the full roll wherever the trace is finite. Not on a
    TPU: XLA keeps a trace the time loop carries in on-chip memory, updated in place, while its
    update reads it, and moved a trace that was only written to off the chip every step (a
    vanilla-256 D_RTRL training step on a v5e: 1.6 ms with the read, 2.6 ms without). The
    drivers' loops carry no such trace at all (:mod:`~braintrace._algorithm.carriers.instant_traces`).
    """
    num_state = diag.shape[-1]  # the trace's trailing width (HiddenGroup.trace_state_width)
    skip_history = not has_history and jax.default_backend() != "tpu"
    if fp is not None:
        # Upcast on read, one roll in the math dtype, one rounding on write (trace_storage).
        inst = fp.instant(x, df, bool(params.get("has_bias", False)))

        def fast_recurrent() -> Trace:
            math = math_dtype(*[w.dtype for w in weights.values()], df.dtype)
            out: Trace = fp.recurrent(computed_once(diag, old), upcast(old, math), num_state)
            return out

        if skip_history:
            return store(_instant_alone(inst, fast_recurrent, old), old)
        new = fast_recurrent()
        return store({k: new[k] + inst[k] for k in old}, old)
    inst = general_instant(etp, params, x, df, weights)

    def recurrent() -> Trace:
        return general_recurrent(etp, params, diag, old, num_state)

    if skip_history:
        return {k: v.astype(old[k].dtype) for k, v in _instant_alone(inst, recurrent, old).items()}
    rolled = recurrent()
    return {k: (rolled[k] + inst[k]).astype(old[k].dtype) for k in old}


def _instant_alone(inst: Trace, recurrent: Callable[[], Trace], old: Trace) -> Trace:
    """``inst`` at the shape ``recurrent() + inst`` has (a step may broadcast a trace to a batch),
    without computing ``recurrent()``."""
    shapes = jax.eval_shape(recurrent)
    return {k: jnp.broadcast_to(inst[k], jnp.broadcast_shapes(shapes[k].shape, inst[k].shape)) for k in old}


def general_recurrent(etp: Primitive, params: Mapping[str, object], diag: jax.Array, old: Trace, num_state: int) -> Trace:
    """``new[..., a] = Σ_c dt_to_t(D[..., a, c], old[..., c])``.

    Up to ``SPELLED_OUT_STATES`` states the ``S²`` terms are written out (they fuse with the
    surrounding work); wider traces (SnAp's ``K·S``) map the rule over both axes instead,
    so compile time does not grow with ``S²``.

    One state, library rules: every library ``dt_to_t`` scales each trace entry by the
    Jacobian at the entry's own position, ``dt_to_t(d, ε) = ε ⊙ dt_to_t(d, 1)``
    (``tests/op/test_rule_oracles.py`` pins it per primitive), so the stored trace is
    multiplied as it is. Its only use is then element-wise and XLA rolls it in place; the
    slice ``ε[..., 0]`` that the rule would read costs a copy of the trace every step.
    """
    dt_to_t = reg.required_rules(etp).dt_to_t
    if num_state == 1 and reg.has_library_rules(etp):
        ones = {k: jnp.ones(v.shape[:-1], v.dtype) for k, v in old.items()}
        factor = dt_to_t(diag[..., 0, 0], ones, **params)
        return {k: old[k] * factor[k][..., None] for k in old}
    if num_state > SPELLED_OUT_STATES:
        def over_c(d: jax.Array, o: Trace) -> Trace:
            return dt_to_t(d, o, **params)

        def row(d_a: jax.Array) -> Trace:
            terms = jax.vmap(over_c, in_axes=(-1, -1), out_axes=-1)(d_a, old)
            return {k: v.sum(-1) for k, v in terms.items()}

        out: Trace = jax.vmap(row, in_axes=-2, out_axes=-1)(diag)
        return out
    rows = []
    for a in range(num_state):
        terms = [
            dt_to_t(diag[..., a, c], {k: v[..., c] for k, v in old.items()}, **params)
            for c in range(num_state)
        ]
        rows.append({k: sum(t[k] for t in terms) for k in old})
    return {k: jnp.stack([r[k] for r in rows], axis=-1) for k in old}


def general_instant(etp: Primitive, params: Mapping[str, object], x: RelationInput, df: jax.Array, weights: Trace) -> Trace:
    """``x ⊗ df`` per state through the operation's ``instant_drtrl`` (or ``xy_to_dw``) rule."""
    rule = reg.get_instant_drtrl_rule(etp) or reg.required_rules(etp).xy_to_dw

    def one_state(d: jax.Array) -> Trace:
        if reg.is_batched_primitive(etp):
            return jax.vmap(lambda xb, db: rule(xb, db, weights, **params))(x, d)
        return rule(x, d, weights, **params)

    out: Trace = jax.vmap(one_state, in_axes=-1, out_axes=-1)(df)
    return out


def transpose_signal(signal: jax.Array, diag: jax.Array) -> jax.Array:
    """``Dᵀ g`` per position: ``g'[..., c] = Σ_a g[..., a] D[..., a, c]``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._algorithm.param_trace.relation_rule import transpose_signal
    >>> D = jnp.array([[[1.0, 2.0], [3.0, 4.0]]])  # one position, two states
    >>> transpose_signal(jnp.array([[1.0, 0.0]]), D)  # Dᵀ g: the first row of D
    Array([[1., 2.]], dtype=float32)
    """
    return mix_states(jnp.swapaxes(diag, -1, -2), signal)


def contract(
    etp: Primitive, params: Mapping[str, object], signal: jax.Array, trace: Trace, weights: Trace, fp: reg.FastPathRules | None,
) -> Trace:
    """``⟨signal, trace⟩`` of one relation, by the kernels ``fp``'s ``solve`` or else the primitive's
    ``solve_drtrl`` (or ``dt_to_t``) rule per hidden state (summed over a batch axis)."""
    batched = reg.is_batched_primitive(etp)
    if fp is not None:
        return fp.solve(signal, trace, fold_batch=batched)
    solve_rule = reg.get_solve_drtrl_rule(etp)
    dt_to_t = reg.required_rules(etp).dt_to_t

    def solve(g: jax.Array, tr: Trace) -> Trace:
        parts = []
        for a in range(g.shape[-1]):
            sl = {k: v[..., a] for k, v in tr.items()}
            if solve_rule is not None:
                parts.append(solve_rule(g[..., a], sl, weights, **params))
            else:
                parts.append(dt_to_t(g[..., a], sl, **params))
        return {k: sum((p[k] for p in parts[1:]), parts[0][k]) for k in tr}

    if batched:
        return {k: v.sum(axis=0) for k, v in jax.vmap(solve)(signal, trace).items()}
    return solve(signal, trace)


def d_rtrl_rule(fast_solve: bool = True) -> TraceRule:
    """D-RTRL as a :class:`~braintrace.TraceRule`: the trace ``ε[..., θ, s] = ∂h_s/∂θ`` of one relation.

    ``init`` allocates the primitive's ``init_drtrl`` trace; ``roll`` is ``D ε + x ⊗ df``;
    ``solve`` adds the history ``⟨Dᵀ g, ε^{t-1}⟩`` to the exact one-step gradient. Where the
    relation has no history (:attr:`~braintrace.RelationInfo.has_history` is ``False``: ``D ≡ 0``)
    ``roll`` writes ``x ⊗ df`` without reading the trace and ``solve`` adds zeros. Every
    per-parameter trace learner (D_RTRL, EProp, SnAp, OSTL, OSTTP) rolls its traces through
    this record.

    Run by ``braintrace.compile(model, d_rtrl_rule(), x0)``, it gives D_RTRL's single-step
    gradients where no hidden group reads the new value of one of its own states (an LSTM's
    ``h`` reads the ``c`` of the same step) or is read past its update (an output that reads
    ``h^{t-1}``): D_RTRL then meets the signal with other Jacobians than the step's ``D``, which
    a rule's step does not hold. Like D_RTRL, it equals backpropagation through time where
    each group's hidden Jacobian is diagonal over positions.

    Parameters
    ----------
    fast_solve : bool
        Roll and solve through the primitive's closed-form kernels where it has them (same
        values, faster); ``False``: through its rules alone.

    Returns
    -------
    TraceRule
        The same record for the same ``fast_solve``.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.d_rtrl_rule(), jnp.ones(3))
    >>> [eps['weight'].shape for eps in learner.get_etrace_of(('W', 'weight')).values()]  # ∂h[o]/∂W[i, o]
    [(7, 4, 1)]
    >>> braintrace.d_rtrl_rule() is braintrace.d_rtrl_rule()
    True
    """
    if not isinstance(fast_solve, bool):
        raise TypeError(f"d_rtrl_rule: fast_solve must be a bool, got {fast_solve!r}.")
    return _d_rtrl_record(fast_solve)


@functools.cache
def _d_rtrl_record(fast_solve: bool) -> TraceRule:
    def init(info: RelationInfo) -> Trace:
        etp = info_primitive(info, "d_rtrl_rule")
        init_rule = reg.required_rules(etp).init_drtrl
        x = None if info.x is None else abstract_var(info.x)
        weights = {k: abstract_var(v) for k, v in info.weights.items()}
        extra = init_rule_kwargs(init_rule, eqn_params=info.params)
        value: Trace = init_rule(x, abstract_var(info.y), weights, info.num_state, **extra)
        return value

    def roll(eps: Trace, step: RelationStep) -> Trace:
        info = step_info(step, "d_rtrl_rule")
        etp, params = info_primitive(info, "d_rtrl_rule"), info.params
        fp = fast_path_of(etp, params, fast_solve)
        return roll_relation(etp, params, eps, step.diag, step.x, step.df, step.weights, fp, info.has_history)

    def solve(eps: Trace, signal: jax.Array, step: RelationStep) -> Trace:
        info = step_info(step, "d_rtrl_rule")
        if not info.has_history:  # D ≡ 0: nothing to add to the one-step gradient
            return {k: jnp.zeros(v.shape, v.dtype) for k, v in info.weights.items()}
        etp, params = info_primitive(info, "d_rtrl_rule"), info.params
        fp = fast_path_of(etp, params, fast_solve)
        return contract(etp, params, transpose_signal(signal, step.diag), eps, step.weights, fp)

    return TraceRule(init, roll, solve)


d_rtrl_rule.__module__ = "braintrace"
