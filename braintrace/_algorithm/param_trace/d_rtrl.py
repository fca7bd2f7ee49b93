"""``D_RTRL`` and the per-parameter trace engine ``ParamDimVjpAlgorithm``.

D_RTRL (diagonal real-time recurrent learning) is the engine's default coordinate,
``ETraceConfig()``; the engine realises every ``per_param`` coordinate (a scalar-leak or no
recursion, coupled or SnAp scopes, EProp's filter and random feedback; see
:class:`ParamDimVjpAlgorithm`) by substituting what the roll below reads.

For every relation (ETP equation ``y = op(x, W)`` driving hidden group ``h``) and trainable key,
the trace ``ε_W ≈ ∂h^t / ∂W`` (one entry per parameter and hidden state, see the primitive's
``init_drtrl``) is rolled forward every step:

``ε^t = D^t ε^{t-1} + diag(df^t) ⊗ x^t``

with ``D^t`` the per-position hidden Jacobian of the group and ``df^t`` the Jacobian of the
``y -> h`` tail. The gradient of a loss at step ``t`` is the exact one-step gradient plus the
history term ``⟨∂L/∂h^t, D^t ε^{t-1}⟩`` (with ``D^t`` taken with in-step reads of other members'
new values held fixed, since ``∂L/∂h^t`` already contains those paths). A weight whose relation
reaches the step's outputs only element-wise through its hidden states
(``braintrace._compiler.local_relation_weights``) has no one-step path besides
``⟨∂L/∂h^t, x^t ⊗ df^t⟩``: it is left out of the one-step VJP and gets ``⟨∂L/∂h^t, ε^t⟩``, the
same sum read off the new trace.

Between sequences, reset the model's states in place (``brainstate.nn.reset_all_states(model)``,
which calls each module's ``reset_state``) and the traces with :meth:`reset_state`; re-running
``init_all_states`` after compiling replaces the state objects the learner was compiled with.

The class holds the hooks of the engine and the storage of its traces. Each relation's maths is
its rule record (:mod:`~braintrace._algorithm.param_trace.relation_rule`, ``learner.relation_rule``),
by which every trace is rolled; the roll of all traces
(:mod:`~braintrace._algorithm.param_trace.roll`), the multi-step window
(:mod:`~braintrace._algorithm.param_trace.window`), what the backward pass receives
(:mod:`~braintrace._algorithm.param_trace.residual`) and the gradient read off it
(:mod:`~braintrace._algorithm.param_trace.solve`) are functions of the learner.

Control flow: a relation inside a descended scan (an inner loop longer than
``ControlFlowPolicy.scan_unroll_limit``) folds its trace over the ``L`` substeps of every step,
``ε ← D_τ ε + x_τ ⊗ df_τ``, and its single-step history goes through the substep product
``D_L…D_1``. A tail that crosses a hidden-producing ``while_loop`` (detached in the perturbed
step) gets its same-step credit through that loop from the trace.

Exactness: equal to backpropagation through time, element-wise, when the true hidden Jacobian
is the compiled per-position ``D`` (element-wise leaks, LIF neurons driven by ETP operations,
no hidden mixing through weights) and the tail is element-wise. Otherwise it is an
approximation that drops cross-position (weight-mixing) recurrence from the trace.

Examples
--------
>>> import brainstate, jax, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> learner = braintrace.compile(Leaky(), braintrace.D_RTRL, jnp.ones(3))
>>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
>>> grads[('w',)].shape
(3, 2)
"""

from __future__ import annotations

import warnings
from typing import ClassVar, Sequence

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm.carriers.backward_roll import BackwardRollMixin
from braintrace._algorithm.carriers.carrier_store import CarrierStore, TraceStore
from braintrace._algorithm.carriers.instant_traces import InstantFactors, InstantTraceMixin, factors_of
from braintrace._algorithm.engine.base import EligibilityTrace, ETraceVjpAlgorithm
from braintrace._algorithm.engine.config import (
    ETraceConfig,
    engine_config,
    recurrence,
    require_feedback_key,
    require_single_step_modulator,
)
from braintrace._algorithm.engine.graph_executor import (
    CallHiddenJacobians,
    CallJacobians,
    CallWeightJacobians,
    trace_key,
)
from braintrace._algorithm.engine.learning_signal import SignalPair, draw_feedback, feedback_signals
from braintrace._algorithm.engine.modulator import ModulatorSlot, modulator_signals
from braintrace._algorithm.param_trace.residual import slot_signals, trace_for_backward, with_previous_signal
from braintrace._algorithm.engine.rule_contract import RelationInfo, TraceRule, relation_infos, relation_step
from braintrace._algorithm.param_trace.relation_rule import d_rtrl_rule, fast_path_of, init_rule_kwargs
from braintrace._algorithm.param_trace.roll import eps_after_filters, step_all, trace_stepper
from braintrace._algorithm.param_trace.solve import solve_weight_gradients
from braintrace._algorithm.param_trace.types import (
    BackwardResidual,
    Carried,
    FilteredTraces,
    Inputs,
    RelationInput,
    Signal,
    Tails,
    Traces,
    TraceStepper,
    split_filtered,
    step_jacobians,
)
from braintrace._algorithm.param_trace.window import roll_traces
from braintrace._algorithm.rules.snn_helpers import FixedRandomFeedback
from braintrace._algorithm.carriers.trace_storage import storage_dtype
from braintrace._compiler import DEFAULT_MAX_JACOBIAN_ELEMENTS, ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._op import _registries as reg
from braintrace._typing import Path, PyTree, TraceKey

__all__ = ["ParamDimVjpAlgorithm", "D_RTRL"]

Trace = dict[str, jax.Array]


class ParamDimVjpAlgorithm(BackwardRollMixin, InstantTraceMixin, ModulatorSlot, ETraceVjpAlgorithm[Carried, BackwardResidual]):
    """The per-parameter trace engine: every ``per_param`` coordinate of :class:`~braintrace.ETraceConfig`.

    The trace has the dimension of the parameters (see the module docstring). The coordinate
    decides how it is rolled and read:

    * ``temporal_recursion``: the roll ``ε ← R ε + x ⊗ df`` reads ``R = D`` (``'jacobian'``,
      D-RTRL), ``R = decay · I`` (``'scalar_leak'``) or ``R = 0`` (``'none'``);
    * ``recurrence_scope``: what enters ``D`` — its element-wise part (``'diagonal'``), the
      diagonal blocks of the recurrent weight mixing too (``'coupled'``, OSTLRecurrent), or each
      position's ``n``-step neighbourhood, on traces widened to ``K·S`` (``'sparse_n'``, SnAp);
    * ``trace_filter='kappa'``: the gradient reads the filtered trace ``ē ← κ ē + ε`` (EProp's
      filter, advanced once per time step in the forward pass; windows then roll step by step);
    * ``learning_signal='random_feedback'``: the relation weights meet the random projection of
      ``∂L/∂h`` (see :mod:`braintrace._algorithm.engine.learning_signal`) in place of their same-step term;
    * ``learning_signal='modulatory'`` (single step only): the relation weights' whole gradient is
      ``⟨expand(m), ē^t⟩`` for the call's modulator ``m`` (see :mod:`braintrace._algorithm.engine.modulator`),
      the other parameters keep their exact one-step gradient.

    What a call adds to the exact one-step (single-step) or in-window (multi-step) gradient:

    * single step, symmetric signal: the history ``⟨Dᵀ g, ε^{t-1}⟩``, plus ``κ ⟨g, ē^{t-1}⟩``
      with the filter;
    * single step, replaced signal ``s``: ``⟨s, ē^t⟩ − ⟨g, ε^t⟩ + ⟨Dᵀ g, ε^{t-1}⟩`` (the last two
      terms remove the autodiff's ``⟨g, x ⊗ df⟩``; ``ē = ε`` without the filter);
    * multi-step: ``⟨s, ē⟩`` at the state entering the window.

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
    fast_solve : bool
        Use the primitive's closed-form kernels when it has them and no transform hook is active.
    trace_dtype : dtype, optional
        Storage dtype of the traces (e.g. ``jnp.bfloat16``: half the memory and memory traffic
        of float32). Each step upcasts the stored trace, rolls it in the parameters' precision
        and rounds once on write (see :mod:`braintrace._algorithm.carriers.trace_storage`). Only the
        traces of fast-path relations are stored in it (and their ``trace_filter='kappa'``
        filters); a relation off the fast path (a transform hook such as ``weight_fn``, an
        operation without closed-form kernels, ``fast_solve=False``) keeps its trace in the
        parameters' dtype. :meth:`get_etrace_of` shows each trace's dtype.
    chunked_trace : bool
        Roll multi-step windows in closed form (one write of each trace per window): by the
        fast path's kernel, or through the operation's own rules where it has none (conv,
        sparse, einsum ...; a trace inside control flow is rolled step by step).
    control_flow : ControlFlowPolicy, optional
    config : ETraceConfig, optional
        The coordinate (``trace_factorization='per_param'``); default the class's, D-RTRL's
        ``ETraceConfig()`` here.
    random_feedback_key : int or PRNG key, optional
        Seed of the feedback matrices; required by ``learning_signal='random_feedback'``.
    snap_max_jacobian_elements : int
        Under ``recurrence_scope='sparse_n'``, the ceiling on each widened group's block Jacobian
        ``P·(K·S)²`` (default ``2**24``).

    Attributes
    ----------
    config : ETraceConfig
        The coordinate.
    kappa : float
        The trace filter's ``κ`` (``0``: no filter).

    Raises
    ------
    TypeError
        For a ``config`` that is not an ETraceConfig, or a non-integer ceiling.
    ValueError
        For a config of another trace factorization, ``'random_feedback'`` without a key, or a
        ceiling below 1.
    ValueError
        For ``learning_signal='modulatory'`` with ``vjp_method='multi-step'``, or a
        ``trace_dtype`` that is not a floating dtype.
    NotImplementedError
        For ``learning_signal='bootstrapped'`` (DNI's coordinate); at compile time, for a
        ``coupled`` or ``sparse_n`` scope over a descended scan.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.ParamDimVjpAlgorithm,
    ...                              jnp.ones(3))
    >>> loss = lambda x: learner(x).sum()
    >>> for t in range(3):  # one gradient per time step; the trace carries the history
    ...     grads = brainstate.transform.grad(loss, learner.param_states)(jnp.ones(3))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    >>> trace, = learner.get_etrace_of(learner.param_states[('W', 'weight')]).values()
    >>> trace['weight'].shape  # one entry per parameter and hidden state
    (7, 4, 1)
    >>> leaky = braintrace.ETraceConfig(temporal_recursion='scalar_leak', decay=0.9)
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), leaky, jnp.ones(3))
    >>> type(learner).__name__, learner.config.decay
    ('ParamDimVjpAlgorithm', 0.9)
    """

    _supports_scan_descent = True
    _history_holds_same_step = True
    #: The coordinate when no ``config`` is given.
    _default_config: ClassVar[ETraceConfig] = ETraceConfig()
    config: ETraceConfig

    def __init__(
        self,
        model: brainstate.nn.Module,
        name: str | None = None,
        vjp_method: str = "single-step",
        fast_solve: bool = True,
        trace_dtype: jax.typing.DTypeLike | None = None,
        chunked_trace: bool = True,
        control_flow: ControlFlowPolicy | None = None,
        config: ETraceConfig | None = None,
        random_feedback_key: int | jax.Array | None = None,
        snap_max_jacobian_elements: int = DEFAULT_MAX_JACOBIAN_ELEMENTS,
    ) -> None:
        ceiling = _element_ceiling(snap_max_jacobian_elements, type(self).__name__)
        super().__init__(model, name=name, vjp_method=vjp_method, control_flow=control_flow, config=config)
        require_feedback_key(self.config, random_feedback_key, type(self).__name__)
        require_single_step_modulator(self.config, vjp_method, type(self).__name__)
        self.fast_solve = bool(fast_solve)
        self.trace_dtype = storage_dtype(trace_dtype, type(self).__name__)
        self.chunked_trace = bool(chunked_trace)
        self.random_feedback_key = random_feedback_key
        self.snap_max_jacobian_elements = ceiling
        executor = self.vjp_executor
        executor.snap_max_jacobian_elements = ceiling
        executor.recurrence = recurrence(self.config)
        self.kappa = 0.0 if self.config.kappa is None else self.config.kappa
        if self._modulated:
            # A modulated rule drops the autodiff's gradient of every relation parameter.
            self._history_holds_same_step = False
        self.etrace_bwg: TraceStore[TraceKey] = CarrierStore()
        self._trace_filters: CarrierStore[TraceKey, brainstate.ShortTermState] = CarrierStore()
        self._squeezed: frozenset[TraceKey] = frozenset()
        self._relation_infos: dict[TraceKey, RelationInfo] = {}
        self._feedback_matrices: dict[int, FixedRandomFeedback] = {}

    def _check_config(self, config: ETraceConfig | None) -> ETraceConfig:
        return engine_config(self._default_config if config is None else config, "per_param",
                             type(self).__name__, ("symmetric", "random_feedback", "modulatory"))

    @property
    def replaces_signal(self) -> bool:
        """Whether the relation weights meet a learning signal other than ``∂L/∂h`` (random
        feedback, a modulator)."""
        return self.config.learning_signal in ("random_feedback", "modulatory")

    def _learning_signals(self, signals: Sequence[jax.Array], args: tuple[PyTree, ...]) -> list[jax.Array]:
        """The learning signal of every group, replacing ``g`` when :attr:`replaces_signal`
        (``args`` ends with the call's modulator under ``learning_signal='modulatory'``)."""
        if self._modulated:
            return modulator_signals(args[-1], signals, self.graph)
        return feedback_signals(signals, self._feedback_matrices, self.graph, type(self).__name__)

    # --- trace storage --------------------------------------------------------------------

    def _fast_path(self, rel: HiddenParamOpRelation) -> reg.FastPathRules | None:
        return fast_path_of(rel.primitive, rel.eqn_params, self.fast_solve)

    @property
    def relation_rule(self) -> TraceRule:
        """The record every trace of this learner rolls by (:func:`~braintrace.d_rtrl_rule`)."""
        return d_rtrl_rule(self.fast_solve)

    def init_etrace_state(self, *args: PyTree, **kwargs: object) -> None:
        """Allocate a zero trace per (relation, hidden group), its filter (``κ > 0``) and the
        random feedback matrices (``learning_signal='random_feedback'``)."""
        traces: dict[TraceKey, Trace] = {}
        squeezed: set[TraceKey] = set()
        squeeze = jax.default_backend() == "tpu"  # see _stored
        self._relation_infos = relation_infos(self.graph.hidden_param_op_relations)
        for rel in self.graph.hidden_param_op_relations:
            init = reg.required_rules(rel.primitive).init_drtrl
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                if key in traces:
                    raise ValueError(f"The relation {rel} has been added.")
                extra = init_rule_kwargs(init, group=group, eqn_params=rel.eqn_params)
                value = init(rel.x_var, rel.y_var, rel.trainable_vars, group.trace_state_width, **extra)
                if not isinstance(value, dict):
                    raise TypeError(
                        f"init_drtrl of {rel.primitive.name} must return a dict of traces, got "
                        f"{type(value).__name__}."
                    )
                if self.trace_dtype is not None and self._fast_path(rel) is not None:
                    value = {k: v.astype(self.trace_dtype) for k, v in value.items()}
                if squeeze and group.trace_state_width == 1 and all(v.ndim and v.shape[-1] == 1 for v in value.values()):
                    squeezed.add(key)
                traces[key] = value
        self._squeezed = frozenset(squeezed)
        self.etrace_bwg = CarrierStore.of_zeros({k: self._stored(k, v) for k, v in traces.items()}, EligibilityTrace)
        if self.trace_dtype is not None and not any(map(self._fast_path, self.graph.hidden_param_op_relations)):
            _warn_unused_trace_dtype(type(self).__name__, self.trace_dtype)
        self._instant_relations = self._find_instant_relations() if args else {}
        self._allocate_final_shapes(*args)
        self._trace_filters = (self.etrace_bwg.zeros_like(brainstate.ShortTermState) if self.kappa > 0
                               else CarrierStore())
        self._feedback_matrices = {}
        if self.config.learning_signal == "random_feedback":
            seed = self.random_feedback_key
            if seed is None:  # given at construction (require_feedback_key), set to None since
                raise ValueError(f"{type(self).__name__}: learning_signal='random_feedback' needs random_feedback_key "
                                 f"(an int seed or a PRNG key), got None; set learner.random_feedback_key = 0.")
            self._feedback_matrices = draw_feedback(self.graph, seed)
        self._rolled_relations = self._find_rolled_relations()

    def _allocate_final_shapes(self, *args: PyTree) -> None:
        """Re-allocate traces one step would broadcast to a larger shape; allocate the factor states (``instant_traces``).

        An operation that sees no batch axis (``matmul`` of an unbatched input) driving a
        batched hidden group gets one trace per sample once the group's per-sample Jacobian
        meets it. The step is evaluated abstractly here, so every trace starts at the shape it
        keeps and a scan can carry it.
        """
        if not args:
            return self._allocate_instant_factors({})

        def roll(jac: CallJacobians, weight_vals: dict[Path, PyTree]) -> tuple[Traces, dict[TraceKey, InstantFactors]]:
            (xs, dfs), Ds = step_jacobians(jac[0], jac[1], type(self).__name__)
            traces = self._step_all(self._trace_views(), xs, dfs, Ds, weight_vals)
            return traces, factors_of(self._instant_relations, xs, dfs)

        traces, factors = self._shapes_after_one_step(roll, *args)
        self.etrace_bwg.reallocate(traces, self._view, self._stored)
        self._allocate_instant_factors(factors)

    def _seq_after_gradient(self, grads: dict[Path, PyTree]) -> None:
        """Single step: the new traces are written after the gradient reads the entering ones
        (see the base class), and a filtered trace the gradient reads entering after its filter
        (:func:`~braintrace._algorithm.param_trace.roll.eps_after_filters`)."""
        super()._seq_after_gradient(grads)
        if self._trace_filters and self._entering_reads:
            ordered = eps_after_filters(self._filtered_traces(), self._entering_reads, grads)
            if ordered is not None:
                self._assign_etrace_data(ordered)

    # --- stored traces and their rule view ------------------------------------------------

    def _view(self, key: TraceKey, stored: Trace) -> Trace:
        """The trace of ``key`` as the rules and :meth:`get_etrace_of` see it: with the state axis :meth:`_stored` drops."""
        if key not in self._squeezed:
            return dict(stored)
        return {k: v[..., None] for k, v in stored.items()}

    def _stored(self, key: TraceKey, view: Trace) -> Trace:
        """The trace of ``key`` as :attr:`etrace_bwg` holds it.

        On a TPU the trace of a group of one state is stored without its trailing state axis, as
        the state is: XLA pads an array whose last axis has one entry 128-fold along it where it
        picks the default layout, as for some buffers a time loop carries (with the axis, a
        GRU-256 D_RTRL training step on a v5e, batch 32, T = 100, moved 1.1 GiB per time step for
        17 MiB of traces and ran 240× BPTT's time; without it, 2.3×). Elsewhere every trace keeps
        it: on CPU XLA computes a new trace twice, once per shape, where the gradient reads it
        reshaped (``tests/algorithm/test_trace_traffic.py``). Rules, :meth:`get_etrace_of` and
        checkpoints see the axis everywhere.
        """
        if key not in self._squeezed:
            return dict(view)
        return {k: v[..., 0] for k, v in view.items()}

    def _states_without_state_axis(self) -> list[brainstate.State]:
        states = [*self.etrace_bwg.items(), *self._trace_filters.items()]
        return [st for key, st in states if key in self._squeezed]

    def _trace_views(self) -> dict[TraceKey, Trace]:
        return self.etrace_bwg.read(self._view)

    def _get_etrace_data(self) -> Carried:
        """The traces (and filters) in their rule view (see :meth:`_stored`)."""
        if not self._trace_filters:
            return self._trace_views()
        return self._filtered_traces()

    def _filtered_traces(self) -> FilteredTraces:
        """The traces and their filters in their rule view (of a learner that filters them)."""
        return FilteredTraces(eps=self._trace_views(), filt=self._trace_filters.read(self._view))

    def _assign_etrace_data(self, etrace_vals: Carried) -> None:
        eps, filt = split_filtered(etrace_vals, bool(self._trace_filters))
        self.etrace_bwg.assign(self._assign_instant(eps), self._stored)
        if filt is not None:
            self._trace_filters.assign(filt, self._stored)

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Zero every trace (and its filter) and the step counter (model states are not touched).

        With ``batch_size``, every trace that leads with the batch axis of its hidden group gets
        that leading size (see :meth:`HiddenParamOpRelation.traces_lead_with_batch`); the others
        keep their shape. The learner stays compiled for its example's shapes: calls at another
        batch size need a learner compiled for it.
        """
        batched = {
            trace_key(rel, g) for rel in self.graph.hidden_param_op_relations for g in rel.hidden_groups
            if rel.traces_lead_with_batch(g)
        }
        self.etrace_bwg.reset(batch_size, batched.__contains__)
        self._trace_filters.reset(batch_size, batched.__contains__)  # a filter has its trace's shapes
        self._reset_instant(batch_size)
        self.running_index.value = jnp.zeros_like(self.running_index.value)

    def get_etrace_of(self, weight: brainstate.ParamState | Path) -> dict[TraceKey, Trace]:
        """The traces of every relation that has ``weight`` (a ``ParamState`` or its path) as a key.

        Each relation's whole trace: one entry per trainable key (``'weight'``, ``'bias'``, ...),
        whichever of its parameters is asked for.

        Raises
        ------
        ValueError
            If no relation learns ``weight``.
        """
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        keys = [trace_key(rel, g) for rel in self.graph.hidden_param_op_relations
                if path in rel.trainable_paths.values() for g in rel.hidden_groups]
        found = self.etrace_bwg.select(keys, self._view)
        if not found:
            shown = f"a {type(weight).__name__} that is not a state of this model" if path is None else path
            raise ValueError(
                f"get_etrace_of: there is no etrace of the given weight ({shown}). Only the weights "
                f"of compiled relations (ETP operations that drive hidden states) have traces; "
                f"learner.report lists them."
            )
        return found

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> Trace:
        key = trace_key(rel, group)
        return self._view(key, self.etrace_bwg[key].value)

    # --- one step of the trace ------------------------------------------------------------

    def _step_relation(
        self, rel: HiddenParamOpRelation, group: HiddenGroup, old: Trace, diag: jax.Array, x: RelationInput,
        df: jax.Array, weights: Trace,
    ) -> Trace:
        """One step ``D ε + x ⊗ df`` of ``rel``'s trace for ``group`` by :attr:`relation_rule` (every roll)."""
        step = relation_step(rel, group, x, df, diag, weights, self._relation_infos[trace_key(rel, group)])
        return self.relation_rule.roll(old, step)

    def _step_all(
        self, etrace: Traces, xs: Inputs, dfs: Tails, Ds: Sequence[jax.Array], weight_vals: dict[Path, PyTree],
    ) -> Traces:
        """One step of every trace, each by :meth:`_step_relation`."""
        return step_all(self, etrace, xs, dfs, Ds, weight_vals)

    def _update_etrace_data(
        self, running_index: jax.Array, etrace_vals_util_t_1: Carried,
        hid2weight_jac_single_or_multi_times: CallWeightJacobians,
        hid2hid_jac_single_or_multi_times: CallHiddenJacobians, weight_vals: dict[Path, PyTree],
        input_is_multi_step: bool,
    ) -> Carried:
        (xs, dfs), Ds = step_jacobians(hid2weight_jac_single_or_multi_times, hid2hid_jac_single_or_multi_times,
                                       type(self).__name__)
        return roll_traces(self, etrace_vals_util_t_1, xs, dfs, Ds, weight_vals, input_is_multi_step)

    def _make_etrace_stepper(self, weight_vals: dict[Path, PyTree]) -> TraceStepper | None:
        # The filter needs every step's trace, so filtered windows always roll step by step.
        return None if self.chunked_trace and not self._trace_filters else trace_stepper(self, weight_vals)

    # --- the gradient ---------------------------------------------------------------------

    def _trace_for_backward(
        self, old_etrace: Carried, new_etrace: Carried, jac: CallJacobians | None, single_step: bool,
    ) -> BackwardResidual:
        return trace_for_backward(self, old_etrace, new_etrace, jac, single_step)

    def _same_step_in_history(self, rel: HiddenParamOpRelation) -> bool:
        # The history is read off the new trace (ε^t − x ⊗ df) only for plainly rolled traces
        # whose groups contract the signal with D itself. A group without history (D ≡ 0) has
        # none to read: the one-step VJP (a product with x) gives the same-step term, and the
        # trace is not read at all.
        return self._rolls_plainly() and all(
            g.descent is None and not g.reads_new_members() and g.reads_its_past() for g in rel.hidden_groups)

    def _rolls_plainly(self) -> bool:
        """Whether new traces are the plain roll ``D ε + x ⊗ df`` of the entering ones.

        Only then is ``ε^t − x ⊗ df`` the history ``D ε^{t-1}``. The library's rules roll plainly;
        a subclass defined elsewhere that overrides how traces are rolled (to clip or filter
        them) gets the history from the entering trace, as the rolled-trace hooks describe.
        """
        return self._defined_in_library("_update_etrace_data", "_step_all", "_step_relation")

    def _with_previous_signal(self, trace_for_bwd: BackwardResidual, previous: list[jax.Array]) -> BackwardResidual:
        return with_previous_signal(self, BackwardResidual(*trace_for_bwd), previous)

    def _compute_learning_signal(
        self, dl_to_hidden_from_autodiff: list[jax.Array], args: tuple[PyTree, ...],
    ) -> list[jax.Array] | list[SignalPair]:
        signals = slot_signals(self.graph.hidden_groups, dl_to_hidden_from_autodiff)
        if not self.replaces_signal:
            return signals
        learning = slot_signals(self.graph.hidden_groups, self._learning_signals(dl_to_hidden_from_autodiff, args))
        return [SignalPair(g, s) for g, s in zip(signals, learning)]

    def _solve_weight_gradients(
        self, running_index: jax.Array, etrace_h2w_at_t: BackwardResidual, dl_to_hidden_groups: Sequence[Signal],
        weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        return solve_weight_gradients(self, BackwardResidual(*etrace_h2w_at_t), dl_to_hidden_groups, weight_vals,
                                      dl_to_etws_at_t, self.vjp_executor.is_single_step_vjp)


def _warn_unused_trace_dtype(learner: str, trace_dtype: jax.typing.DTypeLike) -> None:
    warnings.warn(
        f"{learner}: trace_dtype={trace_dtype} applies to no trace: only relations on the fast path store "
        f"their trace in it, and none is (a transform hook such as weight_fn, an operation without "
        f"closed-form kernels, or fast_solve=False). Every trace stays in the parameters' dtype.",
        UserWarning, stacklevel=3)


def _element_ceiling(value: object, learner: str) -> int:
    """``snap_max_jacobian_elements`` as a positive int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{learner}: snap_max_jacobian_elements must be an int (a count of elements), got {value!r}.")
    if value < 1:
        raise ValueError(f"{learner}: snap_max_jacobian_elements must be >= 1, got {value}.")
    return int(value)


class D_RTRL(ParamDimVjpAlgorithm):
    """D-RTRL under its canonical name (identical to :class:`ParamDimVjpAlgorithm`).

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
        The estimator (see :class:`~braintrace.ETraceVjpAlgorithm`).
    fast_solve : bool
        Use the primitive's closed-form kernels when the library's rules are in force.
    trace_dtype : dtype, optional
        Storage dtype of fast-path traces (e.g. ``jnp.bfloat16``); the arithmetic stays in the
        parameters' precision (see :class:`ParamDimVjpAlgorithm`).
    chunked_trace : bool
        Roll multi-step windows in closed form (one write of each trace per window): by the
        fast path's kernel, or through the operation's own rules where it has none (conv,
        sparse, einsum ...; a trace inside control flow is rolled step by step).
    control_flow : ControlFlowPolicy, optional
    config : ETraceConfig, optional
        The coordinate (default ``ETraceConfig()``; see :class:`ParamDimVjpAlgorithm`).
    random_feedback_key : int or PRNG key, optional
        Required by ``learning_signal='random_feedback'``.
    snap_max_jacobian_elements : int
        The SnAp ceiling of ``recurrence_scope='sparse_n'``.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
    >>> {path: g['weight'].shape for path, g in grads.items()}
    {('W', 'weight'): (7, 4)}
    >>> issubclass(braintrace.D_RTRL, braintrace.ParamDimVjpAlgorithm)
    True
    >>> learner.config == braintrace.ETraceConfig()
    True
    """
