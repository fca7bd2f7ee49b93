"""The per-parameter traces after a call: one step, or a multi-step window rolled in closed form where possible.

Over a window of ``T`` steps the D-RTRL roll ``ε_s = D_s ε_{s-1} + x_s ⊗ df_s`` is linear, its
Jacobians act on each output position alone, and the instantaneous term is linear in ``df``. The
window's end is therefore the entering trace under the product ``M = D_{T-1}…D_0`` of the
Jacobians plus each step's term carried by the Jacobians after it, ``P_s = D_{T-1}…D_{s+1}``
(:func:`suffix_products`): ``M ε + Σ_s x_s ⊗ (P_s df_s)``, one write of each trace per window
instead of one per step. A fast path's ``chunk`` kernel computes it where there is one, the
operation's own rules elsewhere (:func:`general_chunk`); a relation inside control flow, a
learner whose subclass rolls its traces its own way, and a filtered trace (whose filter needs
every step's trace) are rolled step by step.

It imports the one-step roll (:mod:`~braintrace._algorithm.param_trace.roll`) and the engine's
types.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.param_trace.window import suffix_products
>>> P, M = suffix_products(jnp.array([0.5, 0.25, 2.0]).reshape(3, 1, 1))  # D_0, D_1, D_2 of one state
>>> P[:, 0, 0], M[0, 0]  # P_0 = D_2 D_1, P_1 = D_2, P_2 = 1; M = D_2 D_1 D_0
(Array([0.5, 2. , 1. ], dtype=float32), Array(0.25, dtype=float32))
"""

from __future__ import annotations

from typing import Sequence, cast

import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.graph_executor import df_key, trace_key
from braintrace._algorithm.param_trace.relation_rule import general_instant, general_recurrent
from braintrace._algorithm.param_trace.roll import filtered_step, trace_stepper
from braintrace._algorithm.param_trace.types import (
    Carried,
    FilteredTraces,
    Inputs,
    ParamTraceHost,
    RelationInput,
    Tails,
    Traces,
)
from braintrace._algorithm.carriers.trace_storage import math_dtype, store, upcast
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import mix_states
from braintrace._typing import Path, PyTree, Trace

__all__ = ["CHUNK_TERM_BYTES", "roll_traces", "roll_window", "chunk_split", "chunk_roll", "general_chunk",
           "suffix_products"]

#: The most bytes of per-step terms a window rolled in closed form off the fast path sums at once
#: (:func:`general_chunk`): a group of steps whose terms fit, one group after another.
CHUNK_TERM_BYTES = 64 << 20


def roll_traces(
    host: ParamTraceHost, carried: Carried, xs: Inputs, dfs: Tails, Ds: Sequence[jax.Array],
    weight_vals: dict[Path, PyTree], multi_step: bool,
) -> Carried:
    """The learner's traces (and filters) after a call: one step, or a window of stacked Jacobians."""
    if host._trace_filters:
        if multi_step:
            rolled: Carried = jax.lax.scan(trace_stepper(host, weight_vals), carried, (xs, dfs, Ds))[0]
            return rolled
        return filtered_step(host, cast(FilteredTraces, carried), xs, dfs, Ds, weight_vals)
    if not multi_step:
        return host._step_all(cast(Traces, carried), xs, dfs, Ds, weight_vals)
    return roll_window(host, cast(Traces, carried), xs, dfs, Ds, weight_vals)


def roll_window(
    host: ParamTraceHost, etrace: Traces, xs: Inputs, dfs: Tails, Ds: Sequence[jax.Array],
    weight_vals: dict[Path, PyTree],
) -> Traces:
    """Roll the trace over a window of stacked Jacobians (closed form where possible)."""
    chunkable, rest = chunk_split(host)
    new = dict(etrace)
    if host.chunked_trace and chunkable:
        new.update(chunk_roll(host, etrace, xs, dfs, Ds, chunkable, weight_vals))
    else:
        rest = rest + chunkable

    if rest:
        keys = [trace_key(r, g) for r in rest for g in r.hidden_groups]

        def body(carry: Traces, jac: tuple[Inputs, Tails, Sequence[jax.Array]]) -> tuple[Traces, None]:
            (x_t, df_t, D_t) = jac
            stepped = host._step_all({**etrace, **carry}, x_t, df_t, D_t, weight_vals)
            return {k: stepped[k] for k in keys}, None

        rolled, _ = jax.lax.scan(body, {k: etrace[k] for k in keys}, (xs, dfs, Ds))
        new.update(rolled)
    return new


def chunk_split(host: ParamTraceHost) -> tuple[list[HiddenParamOpRelation], list[HiddenParamOpRelation]]:
    """The relations a window rolls in closed form, and the rest (rolled step by step).

    Closed form: a fast path's ``chunk`` kernel, or else the library's own rules of the
    operation (:func:`general_chunk`); never inside control flow, nor where a subclass
    rolls the traces its own way.
    """
    chunkable: list[HiddenParamOpRelation] = []
    rest: list[HiddenParamOpRelation] = []
    plain = host._rolls_plainly()
    for rel in host.graph.hidden_param_op_relations:
        fp = host._fast_path(rel)
        ok = rel.control_flow_context is None and (
            (fp is not None and fp.chunk is not None) or (plain and reg.has_library_rules(rel.primitive)))
        (chunkable if ok else rest).append(rel)
    return chunkable, rest


def chunk_roll(
    host: ParamTraceHost, etrace: Traces, xs: Inputs, dfs: Tails, Ds: Sequence[jax.Array],
    relations: list[HiddenParamOpRelation], weight_vals: dict[Path, PyTree],
) -> Traces:
    """The traces of ``relations`` at the end of the window, each in closed form.

    A group without history (``D ≡ 0``, :meth:`~braintrace.HiddenGroup.reads_its_past`) has
    ``M = 0`` and ``P_s = 0`` but for the last step: its trace is the last step's roll alone.
    """
    suffix: dict[int, tuple[jax.Array, jax.Array]] = {}
    out = {}
    for rel in relations:
        fp = host._fast_path(rel)
        x_seq = None if rel.x_var is None else xs[id(rel.x_var)]
        for group in rel.hidden_groups:
            if not group.reads_its_past():
                key = trace_key(rel, group)
                out[key] = host._step_relation(
                    rel, group, etrace[key], Ds[group.index][-1], None if x_seq is None else x_seq[-1],
                    dfs[df_key(rel, group)][-1], host._relation_operands(rel, weight_vals))
                continue
            if group.index not in suffix:
                suffix[group.index] = suffix_products(Ds[group.index])
            p_seq, m_full = suffix[group.index]
            key = trace_key(rel, group)
            old = etrace[key]
            df_seq = rel.output_layout(group, dfs[df_key(rel, group)], lead=1)
            p_seq, m_full = rel.output_layout(group, p_seq, lead=1), rel.output_layout(group, m_full)
            if fp is None or fp.chunk is None:
                weights = host._relation_operands(rel, weight_vals)
                out[key] = general_chunk(rel, old, x_seq, df_seq, p_seq, m_full, weights)
                continue
            new = fp.chunk(x_seq, df_seq, p_seq, m_full, upcast(old, df_seq.dtype), df_seq.shape[-1])
            out[key] = store(new, old)
    return out


def general_chunk(
    rel: HiddenParamOpRelation, old: Trace, x_seq: RelationInput, df_seq: jax.Array, p_seq: jax.Array,
    m_full: jax.Array, weights: Trace,
) -> Trace:
    """A window in closed form through the operation's own rules: ``M ε + Σ_s instant(x_s, P_s df_s)``.

    The D-RTRL roll ``ε_s = D_s ε_{s-1} + instant(x_s, df_s)`` is linear, its Jacobians act
    on each output position alone and ``instant`` is linear in ``df`` (what the library's
    rules satisfy, ``tests/op/test_rule_oracles.py``), so the window's end is the entering
    trace under the product ``M`` of the Jacobians plus each step's term carried by the
    Jacobians after it (``P_s``): one write of the trace per window instead of one per
    step. The per-step terms are summed in groups of at most
    :data:`CHUNK_TERM_BYTES` so the window's length does not set the memory.
    """
    num_state = df_seq.shape[-1]
    # A trace stored in a lower precision (``trace_dtype``) is rolled in the math dtype.
    work = upcast(old, math_dtype(*[w.dtype for w in weights.values()], df_seq.dtype))
    recurrent = general_recurrent(rel.primitive, rel.eqn_params, m_full, work, num_state)
    carried = mix_states(p_seq, df_seq)
    x_axis = None if x_seq is None else 0

    def terms(x_part: RelationInput, df_part: jax.Array) -> Trace:
        per_step = jax.vmap(lambda x, d: general_instant(rel.primitive, rel.eqn_params, x, d, weights), in_axes=(x_axis, 0))
        return {k: v.sum(axis=0) for k, v in per_step(x_part, df_part).items()}

    steps = df_seq.shape[0]
    trace_bytes = sum(v.size * v.dtype.itemsize for v in work.values())
    group = max(1, min(steps, CHUNK_TERM_BYTES // max(trace_bytes, 1)))
    while steps % group:
        group -= 1
    if group == steps:
        summed = terms(x_seq, carried)
    else:
        def fold(acc: Trace, part: tuple[RelationInput, jax.Array]) -> tuple[Trace, None]:
            more = terms(*part)
            return {k: acc[k] + more[k] for k in acc}, None

        def split(a: jax.Array) -> jax.Array:
            return a.reshape(steps // group, group, *a.shape[1:])

        zero = {k: jnp.zeros_like(v) for k, v in recurrent.items()}
        summed, _ = jax.lax.scan(fold, zero, (None if x_seq is None else split(x_seq), split(carried)))
    return store({k: recurrent[k] + summed[k] for k in old}, old)


def suffix_products(Ds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``P_s = D_{T-1}…D_{s+1}`` (``P_{T-1} = I``) and ``M = D_{T-1}…D_0`` for stacked ``D``.

    ``Ds`` is ``(T, ..., S, S)``; an associative scan keeps the temporal order and needs no
    division (exact for zero decays).
    """
    num_state = Ds.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(num_state, dtype=Ds.dtype), Ds.shape[1:])
    # shifted[s] = D_{s+1} (identity past the end); suffix products of it give P_s.
    shifted = jnp.concatenate([Ds[1:], eye[None]], axis=0)
    if num_state == 1:
        prods = jax.lax.cumprod(shifted, axis=0, reverse=True)
    else:
        prods = jax.lax.associative_scan(lambda a, b: a @ b, shifted, reverse=True)
    full = prods[0] @ Ds[0] if num_state > 1 else prods[0] * Ds[0]
    return prods, full
