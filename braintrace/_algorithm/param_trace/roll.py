"""One step of the per-parameter trace: ``ε ← D ε + x ⊗ df`` for every relation and hidden group.

A relation with closed-form kernels (:class:`~braintrace._op.FastPathRules`) is rolled by them,
in the parameters' precision whatever the trace's storage dtype; any other is rolled through
its operation's own rules, ``dt_to_t`` for the recurrent term ``D ε`` and ``instant_drtrl`` (or
``xy_to_dw``) for the instantaneous term ``x ⊗ df``. A relation inside a descended scan folds
its trace over the scan's ``L`` substeps, ``ε ← D_τ ε + x_τ ⊗ df_τ``, and a filtered trace
(``trace_filter='kappa'``) advances its filter ``ē ← κ ē + ε`` after the roll (and, where the
gradient reads the entering trace, is written after it: :func:`eps_after_filters`).

It imports the engine's types (:mod:`~braintrace._algorithm.param_trace.types`), the trace
storage helpers and the rule registry.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.param_trace.roll import substep_product
>>> Ds = jnp.stack([jnp.full((2, 1, 1), 0.5), jnp.full((2, 1, 1), 0.25)])  # L = 2 substeps
>>> substep_product(Ds)[:, 0, 0]  # D_1 D_0 at each of 2 positions
Array([0.125, 0.125], dtype=float32)
"""

from __future__ import annotations

from functools import partial
from typing import Sequence, cast

import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import _or_zero_bits, _zero_after, _zero_after_written
from braintrace._algorithm.engine.graph_executor import df_key, trace_key
from braintrace._algorithm.param_trace.types import (
    Carried,
    FilteredTraces,
    Inputs,
    ParamTraceHost,
    RelationInput,
    StepRelation,
    Tails,
    Traces,
    TraceStepper,
)
from braintrace._algorithm.carriers.trace_storage import computed_once, math_dtype, store, upcast
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import SPELLED_OUT_STATES
from braintrace._typing import Path, PyTree, Trace

__all__ = [
    "step_relation", "general_recurrent", "general_instant", "fold_substeps", "step_all", "filtered_step",
    "eps_after_filters", "trace_stepper", "substep_product",
]


def step_relation(
    rel: HiddenParamOpRelation, group: HiddenGroup, old: Trace, diag: jax.Array, x: RelationInput, df: jax.Array,
    weights: Trace, fp: reg.FastPathRules | None,
) -> Trace:
    """``D ε + x ⊗ df`` of ``rel``'s trace ``old`` for ``group``, by the kernels ``fp`` (``None``:
    the operation's rules); ``diag`` and ``df`` are laid out over the group's positions."""
    diag, df = rel.output_layout(group, diag), rel.output_layout(group, df)
    num_state = diag.shape[-1]  # the trace's trailing width (HiddenGroup.trace_state_width)
    if fp is not None:
        # Upcast on read, one roll in the math dtype, one rounding on write (trace_storage).
        math = math_dtype(*[w.dtype for w in weights.values()], df.dtype)
        new = fp.recurrent(computed_once(diag, old), upcast(old, math), num_state)
        inst = fp.instant(x, df, bool(rel.eqn_params.get("has_bias", False)))
        return store({k: new[k] + inst[k] for k in old}, old)
    recurrent = general_recurrent(rel, diag, old, num_state)
    inst = general_instant(rel, x, df, weights)
    return {k: (recurrent[k] + inst[k]).astype(old[k].dtype) for k in old}


def general_recurrent(rel: HiddenParamOpRelation, diag: jax.Array, old: Trace, num_state: int) -> Trace:
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
    dt_to_t = reg.required_rules(rel.primitive).dt_to_t
    if num_state == 1 and reg.has_library_rules(rel.primitive):
        ones = {k: jnp.ones(v.shape[:-1], v.dtype) for k, v in old.items()}
        factor = dt_to_t(diag[..., 0, 0], ones, **rel.eqn_params)
        return {k: old[k] * factor[k][..., None] for k in old}
    if num_state > SPELLED_OUT_STATES:
        def over_c(d: jax.Array, o: Trace) -> Trace:
            return dt_to_t(d, o, **rel.eqn_params)

        def row(d_a: jax.Array) -> Trace:
            terms = jax.vmap(over_c, in_axes=(-1, -1), out_axes=-1)(d_a, old)
            return {k: v.sum(-1) for k, v in terms.items()}

        out: Trace = jax.vmap(row, in_axes=-2, out_axes=-1)(diag)
        return out
    rows = []
    for a in range(num_state):
        terms = [
            dt_to_t(diag[..., a, c], {k: v[..., c] for k, v in old.items()}, **rel.eqn_params)
            for c in range(num_state)
        ]
        rows.append({k: sum(t[k] for t in terms) for k in old})
    return {k: jnp.stack([r[k] for r in rows], axis=-1) for k in old}


def general_instant(rel: HiddenParamOpRelation, x: RelationInput, df: jax.Array, weights: Trace) -> Trace:
    """``x ⊗ df`` per state through the operation's ``instant_drtrl`` (or ``xy_to_dw``) rule."""
    rule = reg.get_instant_drtrl_rule(rel.primitive) or reg.required_rules(rel.primitive).xy_to_dw

    def one_state(d: jax.Array) -> Trace:
        if reg.is_batched_primitive(rel.primitive):
            return jax.vmap(lambda xb, db: rule(xb, db, weights, **rel.eqn_params))(x, d)
        return rule(x, d, weights, **rel.eqn_params)

    out: Trace = jax.vmap(one_state, in_axes=-1, out_axes=-1)(df)
    return out


def fold_substeps(
    step: StepRelation, rel: HiddenParamOpRelation, group: HiddenGroup, old: Trace, diag_seq: jax.Array,
    x_seq: RelationInput, df_seq: jax.Array, weights: Trace,
) -> Trace:
    """One step of a relation inside a descended scan: the trace folded over its ``L`` substeps.

    ``ε ← D_τ ε + x_τ ⊗ df_τ`` for ``τ = 1..L`` by ``step``, with the stacked per-substep values.
    """

    def substep(eps: Trace, values: tuple[jax.Array, RelationInput, jax.Array]) -> tuple[Trace, None]:
        diag, x, df = values
        return step(rel, group, eps, diag, x, df, weights), None

    new, _ = jax.lax.scan(substep, old, (diag_seq, x_seq, df_seq))
    return new


def step_all(
    host: ParamTraceHost, etrace: Traces, xs: Inputs, dfs: Tails, Ds: Sequence[jax.Array],
    weight_vals: dict[Path, PyTree],
) -> Traces:
    """One step of every trace, each by the learner's ``_step_relation`` (folded over the substeps
    of a descended scan)."""
    new = dict(etrace)
    for rel in host.graph.hidden_param_op_relations:
        weights = host._relation_operands(rel, weight_vals)
        x = None if rel.x_var is None else xs[id(rel.x_var)]
        step: StepRelation = (
            host._step_relation if rel.control_flow_context is None else partial(fold_substeps, host._step_relation))
        for group in rel.hidden_groups:
            key = trace_key(rel, group)
            new[key] = step(rel, group, etrace[key], Ds[group.index], x, dfs[df_key(rel, group)], weights)
    return new


def filtered_step(
    host: ParamTraceHost, etrace: FilteredTraces, xs: Inputs, dfs: Tails, Ds: Sequence[jax.Array],
    weight_vals: dict[Path, PyTree],
) -> FilteredTraces:
    """One step of the traces and their filters, ``ē ← κ ē + ε`` (each state channel apart)."""
    eps = host._step_all(etrace["eps"], xs, dfs, Ds, weight_vals)
    kappa = host.kappa

    def filtered(f: jax.Array, e: jax.Array) -> jax.Array:
        math = math_dtype(f, e, jnp.float32)  # a bfloat16 filter is advanced in float32
        return (kappa * f.astype(math) + e.astype(math)).astype(f.dtype)

    filt = {k: jax.tree.map(filtered, etrace["filt"][k], eps[k]) for k in etrace["filt"]}
    return {"eps": eps, "filt": filt}


def eps_after_filters(
    carried: FilteredTraces, entering_reads: frozenset[int], grads: dict[Path, PyTree],
) -> FilteredTraces | None:
    """Single step: the new traces and filters, each trace whose entering value the gradient reads
    written after its filter (``None``: the gradient reads none).

    ``entering_reads`` indexes the leaves of ``carried``. Both updates read the entering trace
    (``ē^t = κ ē^{t-1} + D ε^{t-1} + x ⊗ df``). Where the gradient reads ``ε^{t-1}`` too (a
    group read past its update), XLA orders the two updates only after the gradient and copies
    ``ε^{t-1}`` every step so that the filter's update can read it whenever it runs. Or-ing the
    new ``ε`` with a zero computed from the written filters has the filter read ``ε^{t-1}``
    first, and ``ε`` is updated in place. Values unchanged, bit for bit.
    """
    leaves = jax.tree_util.tree_flatten_with_path(carried)[0]  # the order entering_reads indexes
    read = {path[1].key for i, (path, _) in enumerate(leaves) if i in entering_reads and path[0].key == "eps"}
    if not read:
        return None
    zero = _zero_after_written({k: carried["filt"][k] for k in read}, _zero_after(grads))
    eps = {k: jax.tree.map(lambda v: _or_zero_bits(v, zero), tr) if k in read else tr
           for k, tr in carried["eps"].items()}
    return {"eps": eps, "filt": carried["filt"]}


def trace_stepper(host: ParamTraceHost, weight_vals: dict[Path, PyTree]) -> TraceStepper:
    """``stepper(carried, (xs, dfs, Ds))``: one step of the learner's traces (and filters) in a scan."""
    filtered = bool(host._trace_filters)

    def stepper(carry: Carried, jac: tuple[Inputs, Tails, Sequence[jax.Array]]) -> tuple[Carried, None]:
        xs, dfs, Ds = jac
        if filtered:
            return filtered_step(host, cast(FilteredTraces, carry), xs, dfs, Ds, weight_vals), None
        return host._step_all(cast(Traces, carry), xs, dfs, Ds, weight_vals), None

    return stepper


def substep_product(Ds: jax.Array) -> jax.Array:
    """``D_{L-1}…D_0`` of stacked per-position Jacobians ``(L, ..., S, S)``: ``(..., S, S)``."""
    if Ds.shape[-1] == 1:
        return jnp.prod(Ds, axis=0)

    def fold(acc: jax.Array, D: jax.Array) -> tuple[jax.Array, None]:
        return D @ acc, None

    eye = jnp.broadcast_to(jnp.eye(Ds.shape[-1], dtype=Ds.dtype), Ds.shape[1:])
    return jax.lax.scan(fold, eye, Ds)[0]
