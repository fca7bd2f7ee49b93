"""Rolling traces in the backward pass, where their gradient is read, call by call or in groups (TPU, drivers).

A single-step D-RTRL call rolls each trace in its forward pass, ``ε^t = D ε^{t-1} + x ⊗ df``,
and its backward pass reads a trace again for the history term ``⟨Dᵀ g, ε^{t-1}⟩``: three
passes over the trace per step, as the signal ``g`` exists only in the backward pass. When the
learners' own drivers (``etrace_grad``, ``etrace_train``) take the step's gradient, they can
receive the rolled trace from the backward pass instead: the driver hands the call a *sink*
(zeros shaped like the stored traces), the forward pass leaves those traces as they entered,
and the backward pass rolls them and contracts the history in one pass
(:func:`braintrace._op.fused_roll.roll_and_contract`, a Pallas kernel) and returns the rolled
traces as the sink's cotangent, which the driver writes into the trace states. Same maths, the
sums in another order (float32 rounding); two passes over the trace instead of three. A filtered
trace (EProp's ``kappa_filter_decay``, ``ē^t = κ ē^{t-1} + ε^t``, whose gradient reads ``ē^t``)
has its filter rolled by the same pass, the history ``κ ⟨g, ē^{t-1}⟩ + ⟨Dᵀ g, ε^{t-1}⟩``
contracted from both entering arrays (:func:`braintrace._op.fused_roll.roll_filter_and_contract`):
one read and one write of each per step instead of five passes.

A step's history term is linear in the trace it entered with, so the drivers need not roll
every step. Where the loop's length ``n`` (an ``etrace_train`` span's) has a divisor ``K`` from
2 to :data:`MAX_CALLS_PER_ROLL`, the driver runs its calls in groups of the largest such ``K``
and hands each call a sink of :class:`~braintrace._algorithm.drive.host.StepFactors`: the
backward pass returns the call's ``(x, d, df, q)`` (``q`` the signal the entering trace meets)
and no history term, and after the group the learner rolls the trace and adds the group's
history terms in closed form (the rule record's ``roll_and_solve_steps``,
:meth:`BackwardRollMixin._seq_roll_calls`): one read and one write of the trace per ``K`` calls.
Where every operand of the trace is left out of the one-step VJP, the call also returns the
signal ``g`` of its own term ``Σ_b x ⊗ (g df)``, which the group's product of own terms sums
with the others' (GRU-256's D_RTRL step on a v5e: 1.24x to 1.13x BPTT's time).
This applies to every such trace whatever its size; a filtered trace has its filter rolled in
the same pass (``roll_filter_and_solve_steps``, the call's factors carrying the filter's signal
``r`` too). On a TPU v5e it took a LIF-1024 D_RTRL step from 28× to 5.8× BPTT's time, its
EProp(κ = 0.9) step from 53× to 11×, its EProp with random feedback from 38× to 6.5×, and
GRU-256's D_RTRL from 1.99× to 1.67–1.77× (``benchmarks/README.md``, the tenth and eleventh
runs), then to 1.26× with the roll of a trace kept on chip as one bfloat16 product of float32
parts (:mod:`braintrace._op.split_float32`, the fourteenth); groups of 20 calls instead of 10
took LIF-1024's D_RTRL to 4.3× (:data:`MAX_CALLS_PER_ROLL`). Inside ``step_fn`` the grouped
traces read their value at the group's start. On the development CPU, where a trace keeps its
state axis, grouping the same traces took the step's time unchanged (LIF-1024 D_RTRL 4.21× BPTT
call by call, 4.18× grouped), so it applies where traces are stored without it (a TPU).

It applies on a TPU, where traces of one-state groups are stored without their state axis
(``ParamDimVjpAlgorithm._stored``), to the traces of batched ``matmul`` relations that roll
plainly (single-step D_RTRL, EProp with or without a filter, OSTL, and without a filter EProp
with random feedback and OSTTP, whose signals replace ``∂L/∂h``), outside a mesh, where the
group reads its past. Float32 traces roll in the backward pass call by call (from
:data:`ROLL_MIN_BYTES`) or over groups; a trace stored in 16 bits (``trace_dtype``) only over
groups, rolled in the factors' float32 and rounded to its storage once per group instead of
once per call (``test_a_16_bit_trace_is_rolled_over_its_group_in_float32_and_rounded_once``).
A group reads its past unless its trace has no history, ``ε^t = x ⊗ df``: no gradient reads
such a trace, and the drivers write it once per loop
(:mod:`~braintrace._algorithm.carriers.instant_traces`). Every other call, and every call of a
learner outside its drivers (``learner(x)`` under a user's own ``grad``), rolls its traces in
the forward pass as before. Inside the driver's ``step_fn``, the deferred traces read their
entering value until the step's gradient is taken.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterator, Mapping, NamedTuple, Protocol, Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.carriers.trace_storage import store, upcast
from braintrace._algorithm.drive.host import Grads, RolledTrace, RollSink, StepFactors
from braintrace._algorithm.drive.grad_run import zeros_like
from braintrace._algorithm.engine.graph_executor import CallJacobians, is_step_jacobians, trace_key
from braintrace._algorithm.engine.learning_signal import SignalPair
from braintrace._algorithm.param_trace.relation_rule import transpose_signal
from braintrace._algorithm.param_trace.residual import plain_rolls
from braintrace._algorithm.param_trace.solve import history_signal, solve_instant
from braintrace._algorithm.param_trace.types import (
    BackwardResidual,
    Carried,
    FilteredTraces,
    ParamTraceHost,
    Signal,
    Traces,
    split_filtered,
)
from braintrace._algorithm.engine.sharding import ShardingPlan
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import dtype_of, shape_of
from braintrace._typing import Path, PyTree, Trace, TraceKey

__all__ = ["BackwardRollMixin", "ROLL_MIN_BYTES", "MAX_CALLS_PER_ROLL"]

#: The smallest weight trace (bytes) rolled in the backward pass. On a TPU v5e (batch 32,
#: T = 100) the one-pass kernel took a LIF-1024 D_RTRL step (130 MiB of trace) from 62.8 to
#: 45.5 ms, but made the GRU-256 (two traces, 17 MiB together) and LIF-256 (8.5 MiB) steps 3 and
#: 9 % slower than XLA's fusion, which keeps traces that small in on-chip memory.
ROLL_MIN_BYTES = 64 << 20

#: The most calls of a driver's loop whose traces are rolled at once (the loop's groups are the
#: largest divisor of its length up to this). Each call keeps ``(batch, in + 3 out)`` numbers per
#: trace (``out`` more with a filter, and more with its own term's signal) until its group's
#: roll. Twenty calls' split product (:mod:`braintrace._op.split_float32`, depth ``6K``) still
#: fills one pass of a v5e's 128-deep matrix unit; at T = 100 groups of 20 instead of 10 took
#: the D_RTRL step from 1.17x to 1.10x BPTT's time on GRU-256, from 1.18x to 1.13x on LIF-256
#: and from 5.8x to 4.3x on LIF-1024 (compiling in 2.2 s instead of 1.7); groups of 25 were no
#: faster and compiled 1.5x slower (``benchmarks/README.md``).
MAX_CALLS_PER_ROLL = 20

#: The storage dtypes of the traces the backward pass may roll: float32, and the 16-bit floats of
#: ``trace_dtype``, whose traces only a driver's groups roll (in the factors' float32, rounded to
#: their storage once per group); the one-pass kernel of a large trace rolls float32 only.
_ROLLED_STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Rolled(NamedTuple):
    """One trace's part of the backward residual."""

    #: The entering trace, in its stored form (``None``: the driver rolls it over a group of
    #: calls, and the backward pass returns the call's :class:`StepFactors`).
    old: Trace | None
    #: The entering filter of a filtered trace (stored form; ``None``: no filter).
    old_filter: Trace | None
    #: The group's Jacobian ``D`` that rolls the trace.
    diag: jax.Array
    #: The relation's input.
    x: jax.Array
    #: The relation's ``df`` (output layout).
    df: jax.Array


#: A trace the backward pass may roll: its relation's index, the relation, the group.
RolledRelation = tuple[int, HiddenParamOpRelation, HiddenGroup]


class _RollHost(ParamTraceHost, Protocol):
    """The learner (``ParamDimVjpAlgorithm``) as the backward roll reads it."""

    _roll_sink: RollSink | None
    _rolling_grouped: bool
    _rolled_now: frozenset[TraceKey]
    _rolled_relations: dict[TraceKey, RolledRelation]
    _sink_keys: tuple[TraceKey, ...]

    @property
    def vjp_method(self) -> str:
        """``'single-step'`` or ``'multi-step'``."""

    @property
    def sharding_plan(self) -> ShardingPlan | None:
        """Where the states live on a device mesh (``None``: not sharded)."""

    @property
    def _squeezed(self) -> frozenset[TraceKey]:
        """The trace keys stored without their trailing state axis."""

    @property
    def param_states(self) -> Mapping[Path, brainstate.ParamState]:
        """The model's parameters."""

    def _stored(self, key: TraceKey, view: Trace) -> Trace:
        """The trace of ``key`` as the learner stores it."""

    def _defined_in_library(self, *methods: str) -> bool:
        """Whether the learner's ``methods`` are the library's."""

    def _grouped_keys(self) -> tuple[TraceKey, ...]:
        """The keys a driver may roll over a group of calls."""

    def _zero_factors(self, key: TraceKey) -> StepFactors:
        """Zeros shaped like one call's factors of ``key``."""

    def _group_sums_own_terms(self, key: TraceKey) -> bool:
        """Whether the group's roll of ``key`` sums its calls' own gradient terms too."""


class BackwardRollMixin:
    """The backward roll of ``ParamDimVjpAlgorithm`` (see the module docstring)."""

    _roll_sink: RollSink | None = None
    #: Whether the current call returns its traces' factors (the driver rolls them over a group).
    _rolling_grouped: bool = False
    _rolled_now: frozenset[TraceKey] = frozenset()
    #: Per trace key the backward pass may roll: the relation's index, the relation, the group
    #: (set with the traces, :meth:`_find_rolled_relations`).
    _rolled_relations: dict[TraceKey, RolledRelation] = {}
    #: The keys the driver's current sink holds, in its order (:meth:`_seq_roll_sink`).
    _sink_keys: tuple[TraceKey, ...] = ()

    def _find_rolled_relations(self: _RollHost) -> dict[TraceKey, RolledRelation]:
        """The keys of :attr:`_rolled_relations`, found from the stored traces."""
        filtered = bool(self._trace_filters)
        hooks = ("_trace_for_backward", "_solve_weight_gradients")
        # A replaced signal's unfiltered traces are read in one term too (_rollable_keys).
        plain_signal = not self.replaces_signal or (not filtered and not self._modulated)
        if not (self._squeezed and self.vjp_method == "single-step" and plain_signal
                and self._rolls_plainly() and self._defined_in_library(*hooks)):
            return {}
        found: dict[TraceKey, RolledRelation] = {}
        for index, rel in enumerate(self.graph.hidden_param_op_relations):
            fp = self._fast_path(rel)
            kernel = None if fp is None else (fp.roll_filter_and_solve if filtered else fp.roll_and_solve)
            if (kernel is None or not reg.is_batched_primitive(rel.primitive)
                    or rel.control_flow_context is not None or rel.x_var is None or len(shape_of(rel.x_var)) != 2):
                continue
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                stored = self.etrace_bwg[key].value
                if (key in self._squeezed and stored["weight"].ndim == 3 and group.reads_its_past()
                        and all(v.dtype in _ROLLED_STORAGE for v in stored.values())):
                    found[key] = (index, rel, group)
        return found

    # --- the driver's side ----------------------------------------------------------------

    def _grouped_keys(self: _RollHost) -> tuple[TraceKey, ...]:
        """The keys a driver may roll over a group of calls: those whose kernel takes several
        steps at once (with the filter of a filtered trace), outside a mesh."""
        if self.sharding_plan is not None:
            return ()
        kernel = "roll_filter_and_solve_steps" if self._trace_filters else "roll_and_solve_steps"
        return tuple(key for key, (_, rel, _) in self._rolled_relations.items()
                     if getattr(self._fast_path(rel), kernel, None))

    def _seq_calls_per_roll(self: _RollHost, calls: int) -> int:
        """The largest divisor of ``calls`` up to :data:`MAX_CALLS_PER_ROLL` (``1``: no key rolls
        over a group)."""
        if not self._grouped_keys():
            return 1
        return max(k for k in range(1, MAX_CALLS_PER_ROLL + 1) if calls % k == 0)

    def _seq_roll_sink(self: _RollHost, grouped: bool = False) -> RollSink | None:
        """Zeros shaped like what the backward pass returns of each trace it may take, in order
        (``None``: none): the rolled trace, or (``grouped``) the call's :class:`StepFactors`."""
        if self.sharding_plan is not None:
            return None
        if grouped:
            self._sink_keys = self._grouped_keys()
            return [self._zero_factors(key) for key in self._sink_keys] or None
        traces = {key: self.etrace_bwg[key].value for key in self._rolled_relations}
        self._sink_keys = tuple(key for key, trace in traces.items() if trace["weight"].dtype == jnp.float32
                                and trace["weight"].size * trace["weight"].dtype.itemsize >= ROLL_MIN_BYTES)
        if not self._sink_keys:
            return None
        sink = [{k: jnp.zeros(v.shape, v.dtype) for k, v in traces[key].items()} for key in self._sink_keys]
        if self._trace_filters:
            return [{"eps": zeros, "filt": jax.tree.map(jnp.zeros_like, zeros)} for zeros in sink]
        return sink

    @contextlib.contextmanager
    def _seq_rolling_into(self, sink: RollSink | None) -> Iterator[None]:
        """Within this block, the learner's next call rolls its traces into ``sink``'s cotangent."""
        self._roll_sink, self._rolled_now = sink, frozenset()
        self._rolling_grouped = sink is not None and len(sink) > 0 and isinstance(sink[0], StepFactors)
        try:
            yield
        finally:
            self._roll_sink = None

    def _seq_write_rolled(self: _RollHost, rolled: RollSink) -> None:
        """Write the traces the backward pass rolled (``rolled``: the sink's cotangent)."""
        for key, value in zip(self._sink_keys, rolled):
            if key not in self._rolled_now:
                continue
            if isinstance(value, StepFactors):
                raise internal_error(f"the factors of trace {key} were written as its rolled trace")
            if self._trace_filters:
                self.etrace_bwg[key].value = value["eps"]
                self._trace_filters[key].value = value["filt"]
            else:
                self.etrace_bwg[key].value = value

    def _seq_roll_calls(self: _RollHost, factors: RollSink) -> Grads:
        """Roll the grouped traces over a group of calls from their factors (each stacked over
        the calls) with the kernel that takes the steps at once; the history terms of the
        group's gradients, keyed by every parameter's path."""
        weight_vals = {p: st.value for p, st in self.param_states.items()}
        grads: Grads = {p: zeros_like(v) for p, v in weight_vals.items()}
        for key, step in zip(self._sink_keys, factors):
            if key not in self._rolled_now:
                continue
            if not isinstance(step, StepFactors):
                raise internal_error(f"trace {key} was rolled over a group of calls without its factors")
            _, rel, _ = self._rolled_relations[key]
            fp = self._fast_path(rel)
            has_bias = bool(rel.eqn_params.get("has_bias", False))
            history: dict[str, jax.Array]
            old = self.etrace_bwg[key].value  # rolled in the factors' dtype, stored rounded back once per group
            if step.filt_signal is None:
                roll = None if fp is None else fp.roll_and_solve_steps
                if roll is None:
                    raise internal_error(f"trace {key} rolled over a group of calls without its kernel")
                new, history = roll(upcast(old, step.df.dtype), step.diag, step.x, step.df, step.signal, has_bias,
                                    **_own(step))
            else:
                roll_filtered = None if fp is None else fp.roll_filter_and_solve_steps
                if roll_filtered is None:
                    raise internal_error(f"filtered trace {key} rolled over a group of calls without its kernel")
                old_filter = self._trace_filters[key].value
                new, new_filter, history = roll_filtered(
                    upcast(old, step.df.dtype), upcast(old_filter, step.df.dtype), step.diag, step.x, step.df,
                    step.signal, step.filt_signal, self.kappa, has_bias, **_own(step))
                self._trace_filters[key].value = store(new_filter, old_filter)
            self.etrace_bwg[key].value = store(new, old)
            for k, v in history.items():
                grads = self._add_operand_gradient(grads, rel, k, v, weight_vals)
        return grads

    def _zero_factors(self: _RollHost, key: TraceKey) -> StepFactors:
        """Zeros shaped like one call's :class:`StepFactors` of ``key`` (in the relation's output
        dtype, whatever the trace's storage)."""
        _, rel, _ = self._rolled_relations[key]
        weight = self.etrace_bwg[key].value["weight"]  # (batch, in, out), see _find_rolled_relations
        rows = jnp.zeros((weight.shape[0], weight.shape[2]), dtype_of(rel.y_var))
        x_var = rel.x_var
        if x_var is None:
            raise internal_error(f"the relation of trace {key} rolled over a group of calls reads no input")
        return StepFactors(jnp.zeros(shape_of(x_var), dtype_of(x_var)), rows, rows, rows,
                           rows if self._trace_filters else None, rows if self._group_sums_own_terms(key) else None)

    def _group_sums_own_terms(self: _RollHost, key: TraceKey) -> bool:
        """Whether the group's roll of ``key`` also sums its calls' own gradient terms
        ``Σ_b x ⊗ (g df)``: where every operand of the trace is left out of the one-step VJP
        and the kernel takes ``own`` (otherwise each call adds the own terms of those left out)."""
        index, rel, _ = self._rolled_relations[key]
        covered = self._local_relation_weights().keys.get(index, frozenset())
        kernel = getattr(self._fast_path(rel), "roll_filter_and_solve_steps" if self._trace_filters
                         else "roll_and_solve_steps", None)
        return bool(covered) and covered == set(self.etrace_bwg[key].value) and _takes_own(kernel)

    def _take_roll_sink(self) -> RollSink | None:
        """The sink of the driver's step for this call (once: a second call gets none)."""
        sink, self._roll_sink = self._roll_sink, None
        return sink

    # --- the learner's side ---------------------------------------------------------------

    def _roll_in_backward(
        self: _RollHost, entering: Carried, new: Carried, residual: BackwardResidual, jac: CallJacobians,
    ) -> tuple[BackwardResidual, Carried]:
        """Move the roll of the plainly rolled keys from the forward to the backward pass.

        ``entering`` and ``new`` are the traces as the learner passes them (``{'eps', 'filt'}``
        of a filtered learner). Returns the residual, whose history (and entering filter) no
        longer reads those traces and whose ``rolled`` holds, per key of the sink, what the
        backward pass needs (for a key rolled in the forward pass: zeros, its sink's cotangent),
        and the new traces with the deferred keys as they entered.
        """
        if not is_step_jacobians(jac):
            raise internal_error("a learner that rolls traces in the backward pass got transition points")
        filtered = bool(self._trace_filters)
        eps_in, filt_in = split_filtered(entering, filtered)
        eps_new, filt_new = split_filtered(new, filtered)
        history = residual.trace
        plain = plain_rolls(self, jac, history.through_while)
        local_keys = self._local_relation_weights().keys
        takeable, read_off_new = _rollable_keys(residual, plain, self.replaces_signal)
        rolled: list[Rolled | RolledTrace | StepFactors] = []
        kept, taken = dict(eps_new), set()
        kept_filter: Traces = {} if filt_new is None else dict(filt_new)
        for key in self._sink_keys:
            index, _, group = self._rolled_relations[key]
            stored = self._stored(key, eps_in[key])
            stored_filter = None if filt_in is None else self._stored(key, filt_in[key])
            # Weights left out of the one-step VJP have a history read off the new trace only.
            if key not in takeable or (key not in read_off_new and local_keys.get(index)):
                if self._rolling_grouped:
                    rolled.append(self._zero_factors(key))
                    continue
                zeros = jax.tree.map(jnp.zeros_like, stored)
                rolled.append({"eps": zeros, "filt": jax.tree.map(jnp.zeros_like, stored)} if filtered else zeros)
                continue
            x, df = plain[key][2]
            if x is None:  # a rolled relation is a batched matmul (see _find_rolled_relations)
                raise internal_error(f"the relation of trace {key} rolled in the backward pass reads no input")
            if history.history_jacobians is None:
                raise internal_error(f"trace {key} rolled in the backward pass without its group's history Jacobian")
            rolls_old, rolls_filter = (None, None) if self._rolling_grouped else (stored, stored_filter)
            rolled.append(Rolled(rolls_old, rolls_filter, jac[1][group.index], x, df))
            kept[key] = eps_in[key]
            if filt_in is not None:
                kept_filter[key] = filt_in[key]
            taken.add(key)
        self._rolled_now = frozenset(taken)
        history = history._replace(
            traces={k: v for k, v in history.traces.items() if k not in taken},
            instant={k: v for k, v in history.instant.items() if k not in taken})
        old_filter = residual.old_filter
        if old_filter is not None:
            old_filter = {k: v for k, v in old_filter.items() if k not in taken}
        # A taken key of a replaced signal keeps its same-step term ⟨s − g, x ⊗ df⟩ and reads no trace.
        swapped = {k: v for k, v in residual.swapped.items() if k not in taken}
        learning_trace = None if residual.learning_trace is None else {
            k: v for k, v in residual.learning_trace.items() if k not in taken}
        residual = residual._replace(trace=history, old_filter=old_filter, rolled=rolled, swapped=swapped,
                                     roll_jacobians=residual.roll_jacobians if swapped else None,
                                     learning_trace=learning_trace)
        return residual, (FilteredTraces(eps=kept, filt=kept_filter) if filtered else kept)

    def _solve_rolled(
        self: _RollHost, residual: BackwardResidual, signals: Sequence[Signal], weight_vals: dict[Path, PyTree],
        grads: dict[Path, PyTree],
    ) -> tuple[dict[Path, PyTree], RollSink | None]:
        """Roll the traces the ``residual`` deferred and add their history term to ``grads``.

        The history term is the entering trace met by the signal the forward roll's history
        would have met it with: ``Hᵀ g`` (``H`` the group's history Jacobian, ``D`` where the
        history was read off the new trace) or, for a group read past its update, ``∂L/∂h^{t-1}``;
        a filtered trace adds its entering filter met by ``κ g``. Returns the gradients and the
        rolled traces, the roll sink's cotangent (zeros for the keys rolled in the forward pass,
        which the driver does not write; ``None``: no sink).
        """
        rolled: Sequence[Rolled | RolledTrace | StepFactors] | None = residual.rolled
        if rolled is None:
            return grads, None
        local_keys = self._local_relation_weights().keys
        traces: list[RolledTrace | StepFactors] = []
        for key, entry in zip(self._sink_keys, rolled):
            index, rel, group = self._rolled_relations[key]
            if not isinstance(entry, Rolled):
                traces.append(entry)
                continue
            pair = signals[group.index]
            g, learned = (pair.autodiff, pair.learning) if isinstance(pair, SignalPair) else (pair, None)
            entering_signal = history_signal(residual.trace, group.index, g)
            if learned is not None:  # and − Dᵀ (g − s), with the swap (solve.swapped_signals)
                entering_signal = entering_signal - transpose_signal(g - learned, entry.diag)
            fp = self._fast_path(rel)
            diag = rel.output_layout(group, entry.diag)[..., 0, 0]
            signal = rel.output_layout(group, entering_signal)[..., 0]
            has_bias = bool(rel.eqn_params.get("has_bias", False))
            own = g if learned is None else learned
            covered = local_keys.get(index, frozenset())
            history: dict[str, jax.Array]
            if entry.old is None:  # the driver rolls it over a group of calls, with its history term
                filt_signal = rel.output_layout(group, self.kappa * g)[..., 0] if self._trace_filters else None
                own_signal = None
                if self._group_sums_own_terms(key):  # and the call's own term
                    own_signal, covered = rel.output_layout(group, own)[..., 0], frozenset()
                traces.append(StepFactors(entry.x, diag, entry.df[..., 0], signal, filt_signal, own_signal))
                history = {}
            elif entry.old_filter is None:
                roll = None if fp is None else fp.roll_and_solve
                if roll is None:
                    raise internal_error(f"trace {key} rolled in the backward pass without its kernel")
                new, history = roll(entry.old, diag, entry.x, entry.df[..., 0], signal, has_bias)
                traces.append(new)
            else:
                roll_filtered = None if fp is None else fp.roll_filter_and_solve
                if roll_filtered is None:
                    raise internal_error(f"filtered trace {key} rolled in the backward pass without its kernel")
                filt_signal = rel.output_layout(group, self.kappa * g)[..., 0]
                new, new_filter, history = roll_filtered(
                    entry.old, entry.old_filter, diag, entry.x, entry.df[..., 0], signal, filt_signal,
                    self.kappa, has_bias)
                traces.append({"eps": new, "filt": new_filter})
            # Weights left out of the one-step VJP: their gradient is the whole ⟨g, ε^t⟩ (ē^t; s replacing g).
            if covered:
                weights = self._relation_operands(rel, weight_vals)
                same_step = solve_instant(rel, rel.output_layout(group, own), entry.x, entry.df, weights, fp)
                history = {**history, **{k: history[k] + same_step[k] if k in history else same_step[k]
                                         for k in covered}}
            for k, v in history.items():
                grads = self._add_operand_gradient(grads, rel, k, v, weight_vals)
        return grads, traces


def _takes_own(kernel: Callable[..., object] | None) -> bool:
    """Whether a kernel over several steps takes the steps' own signals (``own``): a kernel of
    the rule record written without it keeps each call's own term."""
    if kernel is None:
        return False
    try:
        return "own" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _own(step: StepFactors) -> dict[str, jax.Array]:
    """The keyword of a kernel over several steps that sums the steps' own terms too (if any)."""
    return {} if step.own_signal is None else {"own": step.own_signal}


def _rollable_keys(
    residual: BackwardResidual, plain: Mapping[TraceKey, object], replaces_signal: bool,
) -> tuple[set[TraceKey], set[TraceKey]]:
    """The plainly rolled keys whose history the ``residual`` reads in one term, and those of
    them whose history it reads off the new trace.

    Under a replaced signal (unfiltered) that term is ``⟨s, ε^t⟩`` with the swap of the
    same-step path, read off ``ε^{t-1}`` (:attr:`BackwardResidual.swapped`) or off ``ε^t`` (the
    learning trace): the backward pass contracts ``ε^{t-1}`` with ``q − Dᵀ (g − s)`` instead,
    and the key keeps its same-step term ``⟨s − g, x ⊗ df⟩``.
    """
    if not replaces_signal:
        return set(plain), set(residual.trace.instant)
    learning = residual.learning_trace or {}
    read_off_new = {k for k in residual.same_step if k in plain and k in learning and k not in residual.swapped}
    return read_off_new | {k for k in residual.swapped if k in plain}, read_off_new
