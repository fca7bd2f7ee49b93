"""Traces without history, written once when a driver's loop ends (single step, the drivers).

A hidden group whose step reads its own past only through weights (``D ≡ 0``: a vanilla cell
``h = tanh([x, h] W + b)``; :meth:`~braintrace.HiddenGroup.reads_its_past` is false) has traces
that hold no history: each is its step's instantaneous term alone, ``ε^t = x^t ⊗ df^t``, and the
one-step VJP gives its weights' gradient without reading it. Outside the drivers every call
still writes such a trace, since a call's traces are what the learner shows after it. When the
learners' own drivers (``etrace_grad``, ``etrace_train``, ``etrace_evolve``, the Trainer's
steps) own the time loop, only the last call's trace is seen: each call keeps its ``(x, df)``
(the sizes of the relation's input and output, not of the trace) in states the learner keeps out
of its state tree, and the loop's end writes the trace from the last call's pair, by the same roll the
call would have made from a zero trace. One trace-sized write per loop instead of one per step;
the values are those of the call's own roll wherever it is finite (on a TPU the call's roll
reads the entering trace, ``0 · ε``, so a non-finite entering trace gave a non-finite one).

It applies to the traces of batched ``matmul`` relations with a fast path (the roll reads ``x``
and ``df`` only) of single-step learners that roll plainly and take the library's gradient, not
a modulated one (which reads the new trace), outside a mesh and without ``check_finite`` (whose
checks read every step's trace), where the group has no history, is not read past its update,
and its relation's weights are in the one-step VJP
(:meth:`InstantTraceMixin._find_instant_relations`). A filtered trace's filter
``ē^t = κ ē^{t-1} + ε^t`` is still written every step (the gradient reads it), from the new
``ε^t`` the step computes. Random feedback's term of such a key, ``⟨s, ε^t⟩ − ⟨g, x ⊗ df⟩``, is
``⟨s − g, x ⊗ df⟩`` and reads no trace
(:func:`~braintrace._algorithm.param_trace.residual.replaced_signal_residual`). Inside the
driver's ``step_fn`` such a trace reads the value it had when the loop started.

On the development CPU (batch 32, T = 100) a vanilla-256 training step went from 1.83× to 0.70×
BPTT's time with D_RTRL, from 4.03× to 1.25× with EProp's random feedback and from 4.7× to 3.0×
with its filter (``benchmarks/README.md``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, NamedTuple, Protocol, cast

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.carriers.carrier_store import CarrierStore
from braintrace._algorithm.engine.graph_executor import CallJacobians, df_key, trace_key
from braintrace._algorithm.engine.sharding import ShardingPlan
from braintrace._algorithm.param_trace.residual import through_while
from braintrace._algorithm.param_trace.types import (
    Carried,
    FilteredTraces,
    Inputs,
    ParamTraceHost,
    Tails,
    Traces,
    split_filtered,
    step_jacobians,
)
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import shape_of
from braintrace._typing import Path, PyTree, Trace, TraceKey

__all__ = ["InstantTraceMixin", "InstantFactors", "factors_of"]


class InstantFactors(NamedTuple):
    """What a call keeps of a trace without history in a driver's loop: its ``x ⊗ df``'s factors."""

    #: The relation's input, ``(batch, in)``.
    x: jax.Array
    #: The relation's ``df`` as the roll takes it, ``(batch, out, states)``.
    df: jax.Array


#: A relation whose trace the drivers write once: the relation and its hidden group.
InstantRelation = tuple[HiddenParamOpRelation, HiddenGroup]


class _Unlisted:
    """States a learner keeps out of its state tree: ``brainstate.graph`` does not look inside a
    plain object, so they are in no checkpoint, ``learner.states()`` or sharding plan; the
    transforms still carry them where a call writes them."""

    def __init__(self, store: CarrierStore[TraceKey, brainstate.ShortTermState]) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.store)})"


class _InstantHost(ParamTraceHost, Protocol):
    """The learner (``ParamDimVjpAlgorithm``) as this module reads it."""

    _instant_relations: dict[TraceKey, InstantRelation]
    _instant_factors: _Unlisted
    _deferring_instant: bool
    _deferred_instant: set[TraceKey]

    @property
    def vjp_method(self) -> str:
        """``'single-step'`` or ``'multi-step'``."""

    @property
    def sharding_plan(self) -> ShardingPlan | None:
        """Where the states live on a device mesh (``None``: not sharded)."""

    @property
    def param_states(self) -> Mapping[Path, brainstate.ParamState]:
        """The model's parameters."""

    def _stored(self, key: TraceKey, view: Trace) -> Trace:
        """The trace of ``key`` as the learner stores it."""

    def _view(self, key: TraceKey, stored: Trace) -> Trace:
        """The trace of ``key`` as the rules read it."""

    def _defined_in_library(self, *methods: str) -> bool:
        """Whether the learner's ``methods`` are the library's."""


class InstantTraceMixin:
    """The traces ``ParamDimVjpAlgorithm``'s drivers write once (see the module docstring)."""

    #: Per trace key the drivers may write once: its relation and group
    #: (:meth:`_find_instant_relations`, set with the traces).
    _instant_relations: dict[TraceKey, InstantRelation] = {}
    #: The last call's factors of each of those keys, in states out of the learner's state tree.
    _instant_factors: _Unlisted = _Unlisted(CarrierStore())
    #: Whether the learner's calls now keep those traces as their factors (inside a driver's loop).
    _deferring_instant: bool = False
    #: The keys a call kept as factors since the driver's loop began.
    _deferred_instant: set[TraceKey] = set()

    def _find_instant_relations(self: _InstantHost) -> dict[TraceKey, InstantRelation]:
        """The keys whose traces hold no history and no gradient reads (see the module docstring)."""
        hooks = ("_trace_for_backward", "_solve_weight_gradients", "_assign_etrace_data", "_get_etrace_data")
        if not (self.vjp_method == "single-step" and not self._modulated
                and self._rolls_plainly() and self._defined_in_library(*hooks)):
            return {}
        read_past = self._groups_read_past_update()
        local = self._local_relation_weights().keys
        found: dict[TraceKey, InstantRelation] = {}
        for index, rel in enumerate(self.graph.hidden_param_op_relations):
            if (self._fast_path(rel) is None or not reg.is_batched_primitive(rel.primitive) or index in local
                    or rel.control_flow_context is not None or rel.x_var is None or len(shape_of(rel.x_var)) != 2):
                continue
            for group in rel.hidden_groups:
                if not (group.reads_its_past() or group.reads_new_members() or group.index in read_past):
                    found[trace_key(rel, group)] = (rel, group)
        return found

    def _allocate_instant_factors(self, shapes: Mapping[TraceKey, InstantFactors]) -> None:
        """Zero factor states at ``shapes`` (arrays or ``ShapeDtypeStruct``), out of the state tree."""
        zeros = {key: InstantFactors(*(jnp.zeros(a.shape, a.dtype) for a in f)) for key, f in shapes.items()}
        self._instant_factors = _Unlisted(CarrierStore.of_zeros(zeros, brainstate.ShortTermState))

    # --- the driver's side ----------------------------------------------------------------

    @contextlib.contextmanager
    def _seq_deferring_instant(self: _InstantHost, checked: bool) -> Iterator[None]:
        """Within this block (a driver's loop), calls keep traces without history as their
        factors; when it ends, each such trace is written once from the last call's."""
        if checked or self._deferring_instant or self.sharding_plan is not None or not self._instant_factors.store:
            yield
            return
        self._deferring_instant, self._deferred_instant = True, set()
        try:
            yield
        finally:
            self._deferring_instant = False
        weight_vals = {p: st.value for p, st in self.param_states.items()}
        for key in self._deferred_instant:
            rel, group = self._instant_relations[key]
            x, df = self._instant_factors.store[key].value
            old = self._view(key, jax.tree.map(jnp.zeros_like, self.etrace_bwg[key].value))
            diag = jnp.zeros((*df.shape, df.shape[-1]), df.dtype)  # the group's D ≡ 0
            new = self._step_relation(rel, group, old, diag, x, df, self._relation_operands(rel, weight_vals))
            self.etrace_bwg[key].value = self._stored(key, new)

    # --- the learner's side ---------------------------------------------------------------

    def _defer_instant_traces(
        self: _InstantHost, entering: Carried, new: Carried, jac: CallJacobians, residual: object = None,
    ) -> Carried:
        """Inside a driver's loop: ``new`` with each trace without history replaced by its factors.

        A key is kept as factors where they have the shapes and dtypes of its factor states
        (the learner's compiled ones) and its tail does not cross a detached ``while_loop``; the
        choice depends on the call's shapes only, so the call's primal and forward functions
        make the same. ``residual`` (the forward function's) must read neither trace.
        """
        if not self._deferring_instant:
            return new
        (xs, dfs), _ = step_jacobians(jac[0], jac[1], type(self).__name__)
        crossing = through_while(self.graph.hidden_param_op_relations, (xs, dfs))
        held = {id(leaf) for leaf in jax.tree.leaves(residual)}
        filtered = bool(self._trace_filters)
        (traces, filters), (before, _) = split_filtered(new, filtered), split_filtered(entering, filtered)
        out: dict[TraceKey, Trace | InstantFactors] = dict(traces)
        for key, kept in factors_of(self._instant_relations, xs, dfs).items():
            like = self._instant_factors.store[key].value
            if key in crossing or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(kept, like)):
                continue
            # A trace leaf that is a factor itself (a bias trace is df) is read as the factor.
            factors = {id(a) for a in kept}
            if any(id(leaf) in held and id(leaf) not in factors
                   for leaf in jax.tree.leaves((before[key], traces[key]))):
                raise internal_error(f"the gradient reads trace {key}, which the drivers write once")
            out[key] = kept
            self._deferred_instant.add(key)
        deferred = cast(Traces, out)
        return deferred if filters is None else FilteredTraces(eps=deferred, filt=filters)

    def _assign_instant(
        self: _InstantHost, traces: Mapping[TraceKey, Trace | InstantFactors],
    ) -> dict[TraceKey, Trace]:
        """Write the factors among ``traces`` into their states; the traces that remain."""
        rest: dict[TraceKey, Trace] = {}
        for key, value in traces.items():
            if isinstance(value, InstantFactors):
                self._instant_factors.store[key].value = value
            else:
                rest[key] = value
        return rest

    def _reset_instant(self, batch_size: int | None) -> None:
        """Zero the factor states, at ``batch_size`` (each leads with the batch axis)."""
        self._instant_factors.store.reset(batch_size, lambda key: True)


def factors_of(relations: Mapping[TraceKey, InstantRelation], xs: Inputs, dfs: Tails) -> dict[TraceKey, InstantFactors]:
    """The factors ``(x, df)`` of each key of ``relations`` among one step's inputs ``xs`` and tails ``dfs``."""
    return {key: InstantFactors(xs[id(rel.x_var)], dfs[df_key(rel, group)]) for key, (rel, group) in relations.items()}
