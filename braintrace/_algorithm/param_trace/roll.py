"""One step of the per-parameter trace: ``ε ← D ε + x ⊗ df`` for every relation and hidden group.

Each relation is rolled by the learner's ``_step_relation``, which applies its rule record
(:mod:`~braintrace._algorithm.param_trace.relation_rule`). A relation inside a descended scan folds
its trace over the scan's ``L`` substeps, ``ε ← D_τ ε + x_τ ⊗ df_τ``, and a filtered trace
(``trace_filter='kappa'``) advances its filter ``ē ← κ ē + ε`` after the roll (and, where the
gradient reads the entering trace, is written after it: :func:`eps_after_filters`).

It imports the engine's types (:mod:`~braintrace._algorithm.param_trace.types`) and the trace
storage helpers.

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
from braintrace._algorithm.carriers.trace_storage import math_dtype
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._typing import Path, PyTree, Trace

__all__ = ["fold_substeps", "step_all", "filtered_step", "eps_after_filters", "trace_stepper", "substep_product"]


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
