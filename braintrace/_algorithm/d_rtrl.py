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

import inspect
import warnings
from typing import Any, ClassVar, NamedTuple, Sequence

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm.backward_roll import BackwardRollMixin
from braintrace._algorithm.base import (
    EligibilityTrace,
    ETraceVjpAlgorithm,
    _or_zero_bits,
    _zero_after,
    _zero_after_written,
)
from braintrace._algorithm.config import (
    ETraceConfig,
    engine_config,
    recurrence,
    require_feedback_key,
    require_single_step_modulator,
)
from braintrace._algorithm.graph_executor import detached_df_key, df_key, history_jacobian_key, trace_key, widens
from braintrace._algorithm.learning_signal import SignalPair, draw_feedback, feedback_signals
from braintrace._algorithm.modulator import ModulatorSlot, modulator_signals, without_etp_gradients
from braintrace._algorithm.snn_helpers import FixedRandomFeedback
from braintrace._algorithm.trace_storage import computed_once, fresh_zeros, math_dtype, storage_dtype, store, upcast
from braintrace._compiler import DEFAULT_MAX_JACOBIAN_ELEMENTS, ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.snap_pattern import gather_signal
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import SPELLED_OUT_STATES, mix_states
from braintrace._typing import Path, PyTree, TraceKey

__all__ = ["ParamDimVjpAlgorithm", "D_RTRL", "init_rule_kwargs"]

Trace = dict[str, jax.Array]

#: The most bytes of per-step terms a window rolled in closed form off the fast path sums at once
#: (``ParamDimVjpAlgorithm._general_chunk``): a group of steps whose terms fit, one group after another.
CHUNK_TERM_BYTES = 64 << 20


def init_rule_kwargs(rule: Any, **available: Any) -> dict[str, Any]:
    """The optional context (``group=``, ``eqn_params=``) an init rule declares it accepts."""
    try:
        params = inspect.signature(rule).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(available)
    return {k: v for k, v in available.items() if k in params}


def transpose_signal(signal: jax.Array, diag: jax.Array) -> jax.Array:
    """``Dᵀ g`` per position: ``g'[..., c] = Σ_a g[..., a] D[..., a, c]``."""
    return mix_states(jnp.swapaxes(diag, -1, -2), signal)


class BackwardTrace(NamedTuple):
    """What the D-RTRL backward pass contracts the hidden-state signal with.

    Attributes
    ----------
    traces : dict
        Per trace key, the trace entering the step, or, for keys in ``instant``, the new trace
        (the new filter ``ē^t`` under ``trace_filter='kappa'``).
    history_jacobians : list or None
        Per hidden group, the Jacobian ``D`` the signal is transposed by before it meets an
        entering trace (``None``: contract the signal with the traces as they are).
    through_while : dict
        Per trace key, the ``(x, df)`` of a tail part that crosses a detached ``while_loop``.
    instant : dict
        Per trace key whose ``traces`` entry is the new trace, the ``(x, df)`` of its
        instantaneous term ``x ⊗ df``, subtracted to leave the history ``D ε^{t-1}``.
    read_past_update : dict
        Per index of a group whose previous value the step reads past its update, the signal
        ``∂L/∂h^{t-1}`` (through every path) that meets the entering trace instead of ``Dᵀ g``.
    """

    traces: dict[TraceKey, Trace]
    history_jacobians: list[Any] | None
    through_while: dict[Any, tuple[Any, jax.Array]] = {}
    instant: dict[Any, tuple[Any, jax.Array]] = {}
    read_past_update: dict[int, jax.Array] = {}


class BackwardResidual(NamedTuple):
    """What the per-parameter engine's backward pass receives (see :meth:`ParamDimVjpAlgorithm._solve_weight_gradients`).

    Attributes
    ----------
    trace : BackwardTrace
        Single step: D-RTRL's history term ``⟨Dᵀ g, ε^{t-1}⟩``; multi-step: the (filtered)
        trace entering the window, met by the learning signal.
    old_filter : dict or None
        Single step, filtered, symmetric signal: ``ē^{t-1}`` of the keys whose history is read
        off the entering trace (the term ``κ ⟨g, ē^{t-1}⟩``; the others read it off ``ē^t``).
    learning_trace : dict or None
        Single step, replaced signal: ``ē^t`` (``ε^t`` unfiltered), met by the learning signal.
    new_trace : dict or None
        Single step, replaced signal: ``ε^t`` of the keys not in ``same_step``, met by ``−g``
        (removing the autodiff's same-step term).
    same_step : dict
        Single step, replaced signal: per plainly rolled trace key (``ε^t = D ε^{t-1} + x ⊗ df``),
        the ``(x, df)`` of the autodiff's same-step term ``⟨g, x ⊗ df⟩``, subtracted in place of
        ``−⟨g, ε^t⟩`` (see :meth:`ParamDimVjpAlgorithm._replaced_signal_residual`).
    swapped : dict
        Single step, replaced signal: ``ε^{t-1}`` of the plainly rolled keys whose history is
        read off the entering trace, met once by the history's signal minus ``Dᵀ g`` (plus
        ``Dᵀ s`` under ``swapped_learn``).
    roll_jacobians : list or None
        Per hidden group, the ``D`` that rolled the ``swapped`` traces.
    swapped_learn : bool
        Whether the ``swapped`` keys' ``⟨s, ε^t⟩`` (an unfiltered learning trace) is read off
        ``ε^{t-1}`` as ``⟨Dᵀ s, ε^{t-1}⟩ + ⟨s, x ⊗ df⟩``, so that the step reads no new trace
        of theirs and rolls them in place.
    rolled : list or None
        Single step, the trace rolled in the backward pass (``backward_roll``): per key that
        may be, what its roll needs, or its sink's zero cotangent.
    """

    trace: BackwardTrace
    old_filter: dict[TraceKey, Trace] | None = None
    learning_trace: dict[TraceKey, Trace] | None = None
    new_trace: dict[TraceKey, Trace] | None = None
    same_step: dict[Any, tuple[Any, jax.Array]] = {}
    swapped: dict[TraceKey, Trace] = {}
    roll_jacobians: list[Any] | None = None
    swapped_learn: bool = False
    rolled: list[Any] | None = None


class ParamDimVjpAlgorithm(BackwardRollMixin, ModulatorSlot, ETraceVjpAlgorithm):
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
      ``∂L/∂h`` (see :mod:`braintrace._algorithm.learning_signal`) in place of their same-step term;
    * ``learning_signal='modulatory'`` (single step only): the relation weights' whole gradient is
      ``⟨expand(m), ē^t⟩`` for the call's modulator ``m`` (see :mod:`braintrace._algorithm.modulator`),
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
        and rounds once on write (see :mod:`braintrace._algorithm.trace_storage`). Only the
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
        trace_dtype: Any = None,
        chunked_trace: bool = True,
        control_flow: ControlFlowPolicy | None = None,
        config: ETraceConfig | None = None,
        random_feedback_key: Any = None,
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
        self.etrace_bwg: dict[Any, EligibilityTrace] = {}
        self._trace_filters: dict[Any, brainstate.ShortTermState] = {}
        self._squeezed: frozenset[Any] = frozenset()
        self._feedback_matrices: dict[int, FixedRandomFeedback] = {}

    def _check_config(self, config: Any) -> ETraceConfig:
        return engine_config(self._default_config if config is None else config, "per_param",
                             type(self).__name__, ("symmetric", "random_feedback", "modulatory"))

    @property
    def replaces_signal(self) -> bool:
        """Whether the relation weights meet a learning signal other than ``∂L/∂h`` (random
        feedback, a modulator)."""
        return self.config.learning_signal in ("random_feedback", "modulatory")

    def _learning_signals(self, signals: Sequence[jax.Array], args: Any) -> list[jax.Array]:
        """The learning signal of every group, replacing ``g`` when :attr:`replaces_signal`
        (``args`` ends with the call's modulator under ``learning_signal='modulatory'``)."""
        if self._modulated:
            return modulator_signals(args[-1], signals, self.graph)
        return feedback_signals(signals, self._feedback_matrices, self.graph, type(self).__name__)

    # --- trace storage --------------------------------------------------------------------

    def _fast_path(self, rel: HiddenParamOpRelation) -> reg.FastPathRules | None:
        fp = reg.get_fast_path_rules(rel.primitive)
        if self.fast_solve and fp is not None and fp.applicable(rel.eqn_params):
            return fp
        return None

    def init_etrace_state(self, *args: Any, **kwargs: Any) -> None:
        """Allocate a zero trace per (relation, hidden group), its filter (``κ > 0``) and the
        random feedback matrices (``learning_signal='random_feedback'``)."""
        traces: dict[TraceKey, Trace] = {}
        squeezed: set[Any] = set()
        squeeze = jax.default_backend() == "tpu"  # see _stored
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
        self.etrace_bwg = {k: EligibilityTrace(self._stored(k, v)) for k, v in traces.items()}
        self._warn_unused_trace_dtype()
        self._allocate_final_shapes(*args)
        self._trace_filters = {
            k: brainstate.ShortTermState(jax.tree.map(jnp.zeros_like, st.value)) for k, st in self.etrace_bwg.items()
        } if self.kappa > 0 else {}
        self._feedback_matrices = {}
        if self.config.learning_signal == "random_feedback":
            self._feedback_matrices = draw_feedback(self.graph, self.random_feedback_key)
        self._rolled_relations = self._find_rolled_relations()

    def _warn_unused_trace_dtype(self) -> None:
        if self.trace_dtype is None or any(self._fast_path(r) for r in self.graph.hidden_param_op_relations):
            return
        warnings.warn(
            f"{type(self).__name__}: trace_dtype={self.trace_dtype} applies to no trace: only relations on "
            f"the fast path store their trace in it, and none is (a transform hook such as weight_fn, "
            f"an operation without closed-form kernels, or fast_solve=False). Every trace stays in "
            f"the parameters' dtype.", UserWarning, stacklevel=3)

    def _allocate_final_shapes(self, *args: Any) -> None:
        """Re-allocate traces that one step would broadcast to a larger shape.

        An operation that sees no batch axis (``matmul`` of an unbatched input) driving a
        batched hidden group gets one trace per sample once the group's per-sample Jacobian
        meets it. The step is evaluated abstractly here, so every trace starts at the shape it
        keeps and a scan can carry it.
        """
        if not args:
            return

        def roll(jac: Any, weight_vals: dict[Path, PyTree]) -> dict[TraceKey, Trace]:
            (xs, dfs), Ds = jac
            return self._step_all(self._trace_views(), xs, dfs, Ds, weight_vals)

        stepped = self._shapes_after_one_step(roll, *args)
        for key, st in self.etrace_bwg.items():
            view = self._view(key, st.value)
            grown = {k: v for k, v in stepped[key].items() if v.shape != view[k].shape}
            if grown:
                view = {k: jnp.zeros(grown[k].shape, v.dtype) if k in grown else v for k, v in view.items()}
                st.value = self._stored(key, view)

    def _seq_after_gradient(self, grads: dict[Path, PyTree]) -> None:
        """Single step: the new traces are written after the gradient reads the entering ones
        (see the base class), and a filtered trace the gradient reads entering after its filter.

        Both updates read the entering trace (``ē^t = κ ē^{t-1} + D ε^{t-1} + x ⊗ df``). Where
        the gradient reads ``ε^{t-1}`` too (a group read past its update), XLA orders the two
        updates only after the gradient and copies ``ε^{t-1}`` every step so that the filter's
        update can read it whenever it runs. Or-ing the new ``ε`` with a zero computed from the
        written filters (:func:`_zero_after_written`) has the filter read ``ε^{t-1}`` first,
        and ``ε`` is updated in place. Values unchanged, bit for bit.
        """
        super()._seq_after_gradient(grads)
        if not (self._trace_filters and self._entering_reads):
            return
        data = self._get_etrace_data()
        leaves = jax.tree_util.tree_flatten_with_path(data)[0]  # the order _entering_reads indexes
        read = {path[1].key for i, (path, _) in enumerate(leaves)
                if i in self._entering_reads and path[0].key == "eps"}
        if not read:
            return
        zero = _zero_after_written({k: data["filt"][k] for k in read}, _zero_after(grads))
        eps = {k: jax.tree.map(lambda v: _or_zero_bits(v, zero), tr) if k in read else tr
               for k, tr in data["eps"].items()}
        self._assign_etrace_data({"eps": eps, "filt": data["filt"]})

    # --- stored traces and their rule view ------------------------------------------------

    def _view(self, key: Any, stored: Trace) -> Trace:
        """The trace of ``key`` as the rules and :meth:`get_etrace_of` see it: with its trailing
        state axis (of one entry, for a key stored without it; see :meth:`_stored`)."""
        if key not in self._squeezed:
            return dict(stored)
        return {k: v[..., None] for k, v in stored.items()}

    def _stored(self, key: Any, view: Trace) -> Trace:
        """The trace of ``key`` as :attr:`etrace_bwg` holds it.

        On a TPU, the trace of a group of one state is stored without its trailing state axis, as
        the state itself is. There an array whose last axis has one entry is laid out in tiles
        padded 128-fold along that axis wherever XLA picks its default layout, and XLA does so for
        some buffers a time loop carries: with the axis, a GRU-256 D_RTRL training step (batch 32,
        T = 100, a TPU v5e) moved 1.1 GiB per time step for 17 MiB of traces and ran 240× BPTT's
        time; without it, 2.3×. Elsewhere every trace keeps the axis: on CPU, XLA computes a new
        trace twice, once per shape, where the gradient reads it reshaped
        (``tests/algorithm/test_trace_traffic.py``). The rules, :meth:`get_etrace_of` and
        checkpoints see the axis on every platform.
        """
        if key not in self._squeezed:
            return dict(view)
        return {k: v[..., 0] for k, v in view.items()}

    def _states_without_state_axis(self) -> list[brainstate.State]:
        states = [*self.etrace_bwg.items(), *self._trace_filters.items()]
        return [st for key, st in states if key in self._squeezed]

    def _trace_views(self) -> dict[TraceKey, Trace]:
        return {k: self._view(k, st.value) for k, st in self.etrace_bwg.items()}

    def _get_etrace_data(self) -> Any:
        """The traces (and filters) in their rule view (see :meth:`_stored`)."""
        eps = self._trace_views()
        if not self._trace_filters:
            return eps
        return {"eps": eps, "filt": {k: self._view(k, st.value) for k, st in self._trace_filters.items()}}

    def _assign_etrace_data(self, etrace_vals: Any) -> None:
        eps = etrace_vals["eps"] if self._trace_filters else etrace_vals
        for k, v in eps.items():
            self.etrace_bwg[k].value = self._stored(k, v)
        if self._trace_filters:
            for k, v in etrace_vals["filt"].items():
                self._trace_filters[k].value = self._stored(k, v)

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        """Zero every trace (and its filter) and the step counter (model states are not touched).

        With ``batch_size``, every trace that leads with the batch axis of its hidden group gets
        that leading size (see :meth:`HiddenParamOpRelation.traces_lead_with_batch`); the others
        keep their shape. The learner stays compiled for its example's shapes: calls at another
        batch size need a learner compiled for it.
        """
        self.running_index.value = jnp.zeros_like(self.running_index.value)
        batched = {
            trace_key(rel, g): rel.traces_lead_with_batch(g)
            for rel in self.graph.hidden_param_op_relations for g in rel.hidden_groups
        }
        for key, st in self.etrace_bwg.items():
            def zeros(v: jax.Array, resize: bool = batched.get(key, False)) -> jax.Array:
                shape = (batch_size, *v.shape[1:]) if (batch_size is not None and resize) else v.shape
                return fresh_zeros(shape, v.dtype)

            st.value = jax.tree.map(zeros, st.value)
        for key, st in self._trace_filters.items():
            st.value = jax.tree.map(lambda v: fresh_zeros(v.shape, v.dtype), self.etrace_bwg[key].value)

    def get_etrace_of(self, weight: Any) -> dict[TraceKey, Trace]:
        """The traces of every relation that has ``weight`` (a ``ParamState`` or its path) as a key.

        Each relation's whole trace: one entry per trainable key (``'weight'``, ``'bias'``, ...),
        whichever of its parameters is asked for.

        Raises
        ------
        ValueError
            If no relation learns ``weight``.
        """
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        found = {}
        for rel in self.graph.hidden_param_op_relations:
            if path in rel.trainable_paths.values():
                for g in rel.hidden_groups:
                    found[trace_key(rel, g)] = self._view(trace_key(rel, g), self.etrace_bwg[trace_key(rel, g)].value)
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
        self, rel: HiddenParamOpRelation, group: HiddenGroup, old: Trace, diag: jax.Array, x: Any, df: jax.Array,
        weights: Trace,
    ) -> Trace:
        diag, df = rel.output_layout(group, diag), rel.output_layout(group, df)
        num_state = diag.shape[-1]  # the trace's trailing width (HiddenGroup.trace_state_width)
        fp = self._fast_path(rel)
        if fp is not None:
            # Upcast on read, one roll in the math dtype, one rounding on write (trace_storage).
            math = math_dtype(*[w.dtype for w in weights.values()], df.dtype)
            new = fp.recurrent(computed_once(diag, old), upcast(old, math), num_state)
            inst = fp.instant(x, df, bool(rel.eqn_params.get("has_bias", False)))
            return store({k: new[k] + inst[k] for k in old}, old)
        recurrent = self._general_recurrent(rel, diag, old, num_state)
        inst = self._general_instant(rel, x, df, weights)
        return {k: (recurrent[k] + inst[k]).astype(old[k].dtype) for k in old}

    @staticmethod
    def _general_recurrent(rel: HiddenParamOpRelation, diag: jax.Array, old: Trace, num_state: int) -> Trace:
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
                out: Trace = dt_to_t(d, o, **rel.eqn_params)
                return out

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

    @staticmethod
    def _general_instant(rel: HiddenParamOpRelation, x: Any, df: jax.Array, weights: Trace) -> Trace:
        rule = reg.get_instant_drtrl_rule(rel.primitive) or reg.required_rules(rel.primitive).xy_to_dw

        def one_state(d: jax.Array) -> Trace:
            if reg.is_batched_primitive(rel.primitive):
                return jax.vmap(lambda xb, db: rule(xb, db, weights, **rel.eqn_params))(x, d)
            return rule(x, d, weights, **rel.eqn_params)

        out: Trace = jax.vmap(one_state, in_axes=-1, out_axes=-1)(df)
        return out

    def _step_all(
        self, etrace: dict[TraceKey, Trace], xs: dict[int, Any], dfs: dict[Any, Any], Ds: Sequence[Any],
        weight_vals: Any,
    ) -> dict[TraceKey, Trace]:
        new = dict(etrace)
        for rel in self.graph.hidden_param_op_relations:
            weights = self._relation_operands(rel, weight_vals)
            x = None if rel.x_var is None else xs[id(rel.x_var)]
            step = self._fold_substeps if rel.control_flow_context is not None else self._step_relation
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                new[key] = step(rel, group, etrace[key], Ds[group.index], x, dfs[df_key(rel, group)], weights)
        return new

    def _fold_substeps(
        self, rel: HiddenParamOpRelation, group: HiddenGroup, old: Trace, diag_seq: jax.Array, x_seq: Any,
        df_seq: jax.Array, weights: Trace,
    ) -> Trace:
        """One step of a relation inside a descended scan: the trace folded over its ``L`` substeps.

        ``ε ← D_τ ε + x_τ ⊗ df_τ`` for ``τ = 1..L``, with the stacked per-substep values.
        """

        def substep(eps: Trace, values: Any) -> tuple[Trace, None]:
            diag, x, df = values
            return self._step_relation(rel, group, eps, diag, x, df, weights), None

        new, _ = jax.lax.scan(substep, old, (diag_seq, x_seq, df_seq))
        return new

    def _through_while(self, h2w: Any) -> dict[Any, tuple[Any, jax.Array]]:
        """``(x, df through while)`` per trace key whose tail crosses a detached ``while_loop``.

        The perturbed step cuts reverse mode at such loops, so the one-step gradient lacks the
        same-step credit ``⟨g, x ⊗ df⟩`` of that part of the tail; the backward adds it.
        """
        xs, dfs = h2w
        found = {}
        for rel in self.graph.hidden_param_op_relations:
            for group in rel.hidden_groups:
                key = detached_df_key(rel, group)
                if key in dfs:
                    x = None if rel.x_var is None else xs[id(rel.x_var)]
                    found[trace_key(rel, group)] = (x, dfs[key])
        return found

    def _history_jacobians(self, Ds: Sequence[Any], h2w: dict[Any, Any]) -> list[Any]:
        """Per group, the ``∂h^t/∂h^{t-1}`` the single-step history term contracts the signal with.

        ``D``; for a descended group the substep product ``D_L…D_1``; for a group whose members
        read each other's new values within the step, the partial Jacobian with those reads held
        fixed (the perturbation signal already carries those in-step paths).
        """
        out = []
        for group, D in zip(self.graph.hidden_groups, Ds):
            if group.descent is not None:
                out.append(substep_product(D))
            else:
                out.append(h2w.get(history_jacobian_key(group), D))
        return out

    def _update_etrace_data(
        self, running_index: Any, etrace_vals_util_t_1: Any, hid2weight_jac_single_or_multi_times: Any,
        hid2hid_jac_single_or_multi_times: Any, weight_vals: Any, input_is_multi_step: bool,
    ) -> Any:
        xs, dfs = hid2weight_jac_single_or_multi_times
        Ds = hid2hid_jac_single_or_multi_times
        if self._trace_filters:
            if input_is_multi_step:
                return jax.lax.scan(self._make_etrace_stepper(weight_vals), etrace_vals_util_t_1, (xs, dfs, Ds))[0]
            return self._filtered_step(etrace_vals_util_t_1, xs, dfs, Ds, weight_vals)
        if not input_is_multi_step:
            return self._step_all(etrace_vals_util_t_1, xs, dfs, Ds, weight_vals)
        return self._roll_window(etrace_vals_util_t_1, xs, dfs, Ds, weight_vals)

    def _filtered_step(self, etrace: Any, xs: Any, dfs: Any, Ds: Any, weight_vals: Any) -> Any:
        """One step of the traces and their filters, ``ē ← κ ē + ε`` (each state channel apart)."""
        eps = self._step_all(etrace["eps"], xs, dfs, Ds, weight_vals)
        kappa = self.kappa

        def filtered(f: jax.Array, e: jax.Array) -> jax.Array:
            math = math_dtype(f, e, jnp.float32)  # a bfloat16 filter is advanced in float32
            return (kappa * f.astype(math) + e.astype(math)).astype(f.dtype)

        filt = {k: jax.tree.map(filtered, etrace["filt"][k], eps[k]) for k in etrace["filt"]}
        return {"eps": eps, "filt": filt}

    def _roll_window(
        self, etrace: dict[TraceKey, Trace], xs: Any, dfs: Any, Ds: Any, weight_vals: Any,
    ) -> dict[TraceKey, Trace]:
        """Roll the trace over a window of stacked Jacobians (closed form where possible)."""
        chunkable, rest = self._chunk_split()
        new = dict(etrace)
        if self.chunked_trace and chunkable:
            new.update(self._chunk_roll(etrace, xs, dfs, Ds, chunkable, weight_vals))
        else:
            rest = rest + chunkable

        if rest:
            keys = [trace_key(r, g) for r in rest for g in r.hidden_groups]

            def body(carry: dict[TraceKey, Trace], jac: Any) -> tuple[dict[TraceKey, Trace], None]:
                (x_t, df_t, D_t) = jac
                stepped = self._step_all({**etrace, **carry}, x_t, df_t, D_t, weight_vals)
                return {k: stepped[k] for k in keys}, None

            rolled, _ = jax.lax.scan(body, {k: etrace[k] for k in keys}, (xs, dfs, Ds))
            new.update(rolled)
        return new

    def _chunk_split(self) -> tuple[list[Any], list[Any]]:
        """The relations a window rolls in closed form, and the rest (rolled step by step).

        Closed form: a fast path's ``chunk`` kernel, or else the library's own rules of the
        operation (:meth:`_general_chunk`); never inside control flow, nor where a subclass
        rolls the traces its own way.
        """
        chunkable: list[Any] = []
        rest: list[Any] = []
        plain = self._rolls_plainly()
        for rel in self.graph.hidden_param_op_relations:
            fp = self._fast_path(rel)
            ok = rel.control_flow_context is None and (
                (fp is not None and fp.chunk is not None) or (plain and reg.has_library_rules(rel.primitive)))
            (chunkable if ok else rest).append(rel)
        return chunkable, rest

    def _chunk_roll(
        self, etrace: dict[TraceKey, Trace], xs: Any, dfs: Any, Ds: Any, relations: list[HiddenParamOpRelation],
        weight_vals: Any,
    ) -> dict[TraceKey, Trace]:
        suffix: dict[int, tuple[jax.Array, jax.Array]] = {}
        out = {}
        for rel in relations:
            fp = self._fast_path(rel)
            x_seq = None if rel.x_var is None else xs[id(rel.x_var)]
            for group in rel.hidden_groups:
                if group.index not in suffix:
                    suffix[group.index] = suffix_products(Ds[group.index])
                p_seq, m_full = suffix[group.index]
                key = trace_key(rel, group)
                old = etrace[key]
                df_seq = rel.output_layout(group, dfs[df_key(rel, group)], lead=1)
                p_seq, m_full = rel.output_layout(group, p_seq, lead=1), rel.output_layout(group, m_full)
                if fp is None or fp.chunk is None:
                    weights = self._relation_operands(rel, weight_vals)
                    out[key] = self._general_chunk(rel, old, x_seq, df_seq, p_seq, m_full, weights)
                    continue
                new = fp.chunk(x_seq, df_seq, p_seq, m_full, upcast(old, df_seq.dtype), df_seq.shape[-1])
                out[key] = store(new, old)
        return out

    def _general_chunk(
        self, rel: HiddenParamOpRelation, old: Trace, x_seq: Any, df_seq: jax.Array, p_seq: jax.Array,
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
        recurrent = self._general_recurrent(rel, m_full, work, num_state)
        carried = mix_states(p_seq, df_seq)
        x_axis = None if x_seq is None else 0

        def terms(x_part: Any, df_part: jax.Array) -> Trace:
            per_step = jax.vmap(lambda x, d: self._general_instant(rel, x, d, weights), in_axes=(x_axis, 0))
            return {k: v.sum(axis=0) for k, v in per_step(x_part, df_part).items()}

        steps = df_seq.shape[0]
        trace_bytes = sum(v.size * v.dtype.itemsize for v in work.values())
        group = max(1, min(steps, CHUNK_TERM_BYTES // max(trace_bytes, 1)))
        while steps % group:
            group -= 1
        if group == steps:
            summed = terms(x_seq, carried)
        else:
            def fold(acc: Trace, part: Any) -> tuple[Trace, None]:
                more = terms(*part)
                return {k: acc[k] + more[k] for k in acc}, None

            def split(a: Any) -> Any:
                return None if a is None else a.reshape(steps // group, group, *a.shape[1:])

            zero = {k: jnp.zeros_like(v) for k, v in recurrent.items()}
            summed, _ = jax.lax.scan(fold, zero, (split(x_seq), split(carried)))
        return store({k: recurrent[k] + summed[k] for k in old}, old)

    def _make_etrace_stepper(self, weight_vals: Any) -> Any:
        # The filter needs every step's trace, so filtered windows always roll step by step.
        if self.chunked_trace and not self._trace_filters:
            return None
        step = self._filtered_step if self._trace_filters else self._step_all

        def stepper(carry: Any, jac: Any) -> tuple[Any, None]:
            xs, dfs, Ds = jac
            return step(carry, xs, dfs, Ds, weight_vals), None

        return stepper

    # --- the gradient ---------------------------------------------------------------------

    def _trace_for_backward(self, old_etrace: Any, new_etrace: Any, jac: Any, single_step: bool) -> Any:
        # Only what the configured terms read is kept (see BackwardResidual).
        filtered = bool(self._trace_filters)
        if not single_step:  # the trace term of the state entering the window
            return BackwardResidual(BackwardTrace(old_etrace["filt"] if filtered else old_etrace, None))
        old_eps = old_etrace["eps"] if filtered else old_etrace
        new_eps = new_etrace["eps"] if filtered else new_etrace
        if self._modulated:
            return BackwardResidual(BackwardTrace({}, None), learning_trace=new_etrace["filt"] if filtered else new_eps)
        if not self.replaces_signal and filtered:
            # ē^t − x ⊗ df = κ ē^{t-1} + D ε^{t-1}: where the history is read off a new trace it is
            # read off the new filter, which holds both terms; the entering filter is then read by
            # its update alone (in place) and only the other keys keep the term κ ⟨g, ē^{t-1}⟩.
            history = self._history_trace(old_eps, new_etrace["filt"], jac)
            old_filter = {k: v for k, v in old_etrace["filt"].items() if k not in history.instant}
            return BackwardResidual(history, old_filter=old_filter)
        history = self._history_trace(old_eps, new_eps, jac)
        if not self.replaces_signal:
            return BackwardResidual(history)
        return self._replaced_signal_residual(history, old_eps, new_eps, new_etrace["filt"] if filtered else None, jac)

    def _replaced_signal_residual(
        self, history: BackwardTrace, old_eps: Any, new_eps: Any, new_filter: Any, jac: Any,
    ) -> BackwardResidual:
        """Single step, replaced signal: the history, ``+ ⟨s, ē^t⟩`` and ``− ⟨g, ε^t⟩`` (the swap
        of the same-step relation path), with each plainly rolled trace read once.

        For a key rolled as ``ε^t = D ε^{t-1} + x ⊗ df``, ``−⟨g, ε^t⟩`` is
        ``−⟨Dᵀ g, ε^{t-1}⟩ − ⟨g, x ⊗ df⟩``. Where the history is read off ``ε^t`` (it is then
        ``⟨Dᵀ g, ε^{t-1}⟩``) the two cancel to ``−⟨g, x ⊗ df⟩``. Elsewhere (``swapped``) the
        history's signal ``q`` (``∂L/∂h^{t-1}`` of a group read past its update) meets
        ``ε^{t-1}`` as ``q − Dᵀ g`` in one contraction, and an unfiltered ``⟨s, ε^t⟩`` joins it
        as ``+ Dᵀ s`` and ``+ ⟨s, x ⊗ df⟩``. The other keys keep the three terms.
        """
        same_step = dict(history.instant)
        swapped = {}
        local_keys = self._local_relation_weights().keys
        for key, (index, group, instant) in self._plain_rolls(jac, history.through_while).items():
            if key not in same_step and index not in local_keys and group.descent is None:
                same_step[key] = instant
                swapped[key] = old_eps[key]
        # The learning trace is ē^t, or ε^t without a filter (then read off ε^{t-1} where swapped).
        learning = new_filter if new_filter is not None else {k: v for k, v in new_eps.items() if k not in swapped}
        rest = history._replace(traces={k: v for k, v in history.traces.items() if k not in same_step}, instant={})
        return BackwardResidual(rest, learning_trace=learning,
                                new_trace={k: v for k, v in new_eps.items() if k not in same_step},
                                same_step=same_step, swapped=swapped, roll_jacobians=list(jac[1]) if swapped else None,
                                swapped_learn=new_filter is None)

    def _plain_rolls(self, jac: Any, through_while: dict[Any, Any]) -> dict[Any, tuple[int, Any, tuple[Any, jax.Array]]]:
        """Per trace key rolled plainly this step (``ε^t = D ε^{t-1} + x ⊗ df``, ``D`` its
        group's Jacobian): the relation's index, the group and the ``(x, df)`` of ``x ⊗ df``."""
        (xs, dfs), _ = jac
        relations = self.graph.hidden_param_op_relations if self._rolls_plainly() else []
        out = {}
        for index, rel in enumerate(relations):
            if rel.control_flow_context is not None:
                continue
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                if key not in through_while:
                    x = None if rel.x_var is None else xs[id(rel.x_var)]
                    out[key] = (index, group, (x, rel.output_layout(group, dfs[df_key(rel, group)])))
        return out

    def _history_trace(self, old_etrace: Any, new_etrace: Any, jac: Any) -> BackwardTrace:
        # Single step: the one-step autodiff gradient already holds the instantaneous term, so
        # the trace contributes its history ⟨g, D ε^{t-1}⟩. Where the trace was rolled with that
        # same D (by a fast path or by the primitive's rules), D ε^{t-1} is ε^t − x ⊗ df: reading
        # the new trace leaves the old one a single reader (the update, which then runs in place
        # instead of on a copy) and needs no transposed signal.
        # Elsewhere the history is ⟨Dᵀ g, ε^{t-1}⟩, with the history Jacobian (a descended group's
        # substep product; the partial Jacobian of a group whose members read each other's new
        # values).
        (_, dfs), Ds = jac
        history = self._history_jacobians(Ds, dfs)
        through_while = self._through_while(jac[0])
        read_past = self._groups_read_past_update()
        traces, instant = dict(old_etrace), {}
        for key, (_, group, term) in self._plain_rolls(jac, through_while).items():
            if history[group.index] is Ds[group.index] and group.index not in read_past:
                traces[key] = new_etrace[key]
                instant[key] = term
        return BackwardTrace(traces, history, through_while, instant)

    def _same_step_in_history(self, rel: HiddenParamOpRelation) -> bool:
        # The history is read off the new trace (ε^t − x ⊗ df) only for plainly rolled traces
        # whose groups contract the signal with D itself.
        return (
            self._rolls_plainly()
            and self._defined_in_library("_solve_history_from_new", "_solve_relation")
            and all(g.descent is None and not g.reads_new_members() for g in rel.hidden_groups)
        )

    def _rolls_plainly(self) -> bool:
        """Whether new traces are the plain roll ``D ε + x ⊗ df`` of the entering ones.

        Only then is ``ε^t − x ⊗ df`` the history ``D ε^{t-1}``. The library's rules roll plainly;
        a subclass defined elsewhere that overrides how traces are rolled (to clip or filter
        them) gets the history from the entering trace, as the rolled-trace hooks describe.
        """
        return self._defined_in_library("_update_etrace_data", "_step_all", "_step_relation")

    def _with_previous_signal(self, trace_for_bwd: Any, previous: list[Any]) -> Any:
        read_past = self._groups_read_past_update()
        if not read_past:
            return trace_for_bwd
        previous = self._gathered(previous)
        residual = BackwardResidual(*trace_for_bwd)
        history = residual.trace._replace(read_past_update={i: previous[i] for i in read_past})
        return residual._replace(trace=history)

    def _gathered(self, signals: Sequence[Any]) -> list[Any]:
        """Per group, the signal on the trace's slots: SnAp-widened groups gather each slot's
        ``∂L/∂h[nbr[p, k], a]``; the others keep theirs."""
        out = list(signals)
        for group in self.graph.hidden_groups:
            if group.snap is not None and widens(group):
                out[group.index] = gather_signal(out[group.index], group.snap)
        return out

    def _compute_learning_signal(self, dl_to_hidden_from_autodiff: list[Any], args: Any) -> list[Any]:
        signals = self._gathered(dl_to_hidden_from_autodiff)
        if not self.replaces_signal:
            return signals
        learning = self._gathered(self._learning_signals(dl_to_hidden_from_autodiff, args))
        return [SignalPair(g, s) for g, s in zip(signals, learning)]

    def _solve_weight_gradients(
        self, running_index: Any, etrace_h2w_at_t: Any, dl_to_hidden_groups: Sequence[Any],
        weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        residual = BackwardResidual(*etrace_h2w_at_t)
        if self._modulated:  # ⟨s, ē^t⟩ is the relation weights' whole gradient
            s = [p.learning for p in dl_to_hidden_groups]
            plain = without_etp_gradients(dl_to_etws_at_t, self._relation_parameter_paths())
            if residual.learning_trace is None:
                raise internal_error("the single-step residual of a modulated rule has no learning trace")
            return self._solve_traces(BackwardTrace(residual.learning_trace, None), s, weight_vals, plain)
        if self.replaces_signal:
            g = [p.autodiff for p in dl_to_hidden_groups]
            s = [p.learning for p in dl_to_hidden_groups]
        else:
            g = s = list(dl_to_hidden_groups)
        if not self.vjp_executor.is_single_step_vjp:  # multi-step: ⟨s, (filtered) entering trace⟩
            return self._solve_traces(residual.trace, s, weight_vals, dl_to_etws_at_t)
        grads = self._solve_traces(residual.trace, g, weight_vals, dl_to_etws_at_t)  # ⟨Dᵀ g, ε^{t-1}⟩
        if residual.old_filter:  # + κ ⟨g, ē^{t-1}⟩
            kappa_g = [self.kappa * x for x in g]
            grads = self._solve_traces(BackwardTrace(residual.old_filter, None), kappa_g, weight_vals, grads)
        if residual.learning_trace is not None and residual.new_trace is not None:
            # Swap the same-step relation path: + ⟨s, ē^t⟩ − ⟨g, ε^t⟩, which is − ⟨g, x ⊗ df⟩ for
            # the keys whose history above was read off ε^t (BackwardResidual.same_step).
            minus_g = [-x for x in g]
            grads = self._solve_traces(BackwardTrace(residual.learning_trace, None), s, weight_vals, grads)
            grads = self._solve_traces(BackwardTrace(residual.new_trace, None), minus_g, weight_vals, grads)
            swapped = residual.swapped
            simple = {k: v for k, v in residual.same_step.items() if k not in swapped}
            grads = self._solve_same_step(simple, minus_g, weight_vals, grads)
            if swapped and residual.roll_jacobians is not None:
                learned = s if residual.swapped_learn else None
                entering = self._swapped_signals(residual.trace, residual.roll_jacobians, g, learned)
                grads = self._solve_traces(BackwardTrace(swapped, None), entering, weight_vals, grads)
                instant = minus_g if learned is None else [si - gi for si, gi in zip(learned, g)]
                grads = self._solve_same_step({k: residual.same_step[k] for k in swapped}, instant, weight_vals, grads)
        return grads

    def _swapped_signals(
        self, history: BackwardTrace, roll_jacobians: Sequence[Any], g: Sequence[Any], learned: Sequence[Any] | None,
    ) -> list[Any]:
        """Per group, what meets ``ε^{t-1}`` of :attr:`BackwardResidual.swapped`: the history's
        signal ``q`` minus ``Dᵀ g`` (``D`` the Jacobian that rolled the trace), plus ``Dᵀ s``
        for a ``learned`` signal ``s``."""
        out = []
        for group in self.graph.hidden_groups:
            i = group.index
            if i in history.read_past_update:
                q = history.read_past_update[i]
            elif history.history_jacobians is not None:
                q = transpose_signal(g[i], history.history_jacobians[i])
            else:
                q = g[i]
            rolled = g[i] if learned is None else g[i] - learned[i]
            out.append(q - transpose_signal(rolled, roll_jacobians[i]))
        return out

    def _solve_traces(
        self, backward: BackwardTrace, dl_to_hidden_groups: Sequence[Any], weight_vals: dict[Path, PyTree],
        dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        """``dl_to_etws_at_t`` plus the contraction of the signals with ``backward``'s traces."""
        etrace, Ds, through_while, instant, read_past = backward
        grads = dict(dl_to_etws_at_t)
        local_keys = self._local_relation_weights().keys
        for index, rel in enumerate(self.graph.hidden_param_op_relations):
            weights = self._relation_operands(rel, weight_vals)
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                if key not in etrace:  # a term that reads some keys only (the entering filter)
                    continue
                signal = dl_to_hidden_groups[group.index]
                if key in instant:
                    per_key = self._solve_history_from_new(
                        rel, rel.output_layout(group, signal), etrace[key], *instant[key], weights,
                        local_keys.get(index, frozenset()))
                elif group.index in read_past:
                    previous = rel.output_layout(group, read_past[group.index])
                    per_key = self._solve_relation(rel, previous, etrace[key], weights)
                else:
                    if Ds is not None:
                        signal = transpose_signal(signal, Ds[group.index])
                    per_key = self._solve_relation(rel, rel.output_layout(group, signal), etrace[key], weights)
                if key in through_while:
                    x, df = through_while[key]
                    zero = {k: jnp.zeros_like(v) for k, v in etrace[key].items()}
                    no_history = jnp.zeros((*df.shape, df.shape[-1]), df.dtype)
                    inst = self._step_relation(rel, group, zero, no_history, x, df, weights)
                    current = rel.output_layout(group, dl_to_hidden_groups[group.index])
                    extra = self._solve_relation(rel, current, inst, weights)
                    per_key = {k: per_key[k] + extra[k] for k in per_key}
                for k, g in per_key.items():
                    grads = self._add_operand_gradient(grads, rel, k, g, weight_vals)
        return grads

    def _solve_history_from_new(
        self, rel: HiddenParamOpRelation, signal: jax.Array, new: Trace, x: Any, df: jax.Array, weights: Trace,
        covered: frozenset[str] = frozenset(),
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
        total = self._solve_relation(rel, signal, new, weights)
        if not set(total) - covered:
            return total
        current = self._solve_instant(rel, signal, x, df, weights)
        return {k: v if k in covered else v - current[k] for k, v in total.items()}

    def _solve_instant(
        self, rel: HiddenParamOpRelation, signal: jax.Array, x: Any, df: jax.Array, weights: Trace,
    ) -> Trace:
        """``⟨signal, x ⊗ df⟩``, the instantaneous term built by the rule that rolls the trace
        (the fast path's kernel, or the primitive's ``instant_drtrl`` / ``xy_to_dw``)."""
        fp = self._fast_path(rel)
        has_bias = bool(rel.eqn_params.get("has_bias", False))
        if fp is not None and fp.solve_instant is not None:
            result: Trace = fp.solve_instant(signal, x, df, has_bias, fold_batch=reg.is_batched_primitive(rel.primitive))
            return result
        if fp is not None:
            inst = fp.instant(x, df, has_bias)
        else:
            inst = self._general_instant(rel, x, df, weights)
        return self._solve_relation(rel, signal, inst, weights)

    def _solve_same_step(
        self, same_step: dict[Any, tuple[Any, jax.Array]], dl_to_hidden_groups: Sequence[Any],
        weight_vals: dict[Path, PyTree], grads: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        """``grads`` plus ``⟨signal, x ⊗ df⟩`` of every key in ``same_step``, except for the weights
        left out of the one-step VJP, whose gradient holds no same-step term."""
        local_keys = self._local_relation_weights().keys
        for index, rel in enumerate(self.graph.hidden_param_op_relations):
            weights = self._relation_operands(rel, weight_vals)
            covered = local_keys.get(index, frozenset())
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                if key not in same_step or not set(self.etrace_bwg[key].value) - covered:
                    continue
                signal = rel.output_layout(group, dl_to_hidden_groups[group.index])
                term = self._solve_instant(rel, signal, *same_step[key], weights)
                for k, v in term.items():
                    if k not in covered:
                        grads = self._add_operand_gradient(grads, rel, k, v, weight_vals)
        return grads

    def _solve_relation(self, rel: HiddenParamOpRelation, signal: jax.Array, trace: Trace, weights: Trace) -> Trace:
        fp = self._fast_path(rel)
        batched = reg.is_batched_primitive(rel.primitive)
        if fp is not None:
            result: Trace = fp.solve(signal, trace, fold_batch=batched)
            return result
        solve_rule = reg.get_solve_drtrl_rule(rel.primitive)
        dt_to_t = reg.required_rules(rel.primitive).dt_to_t

        def solve(g: jax.Array, tr: Trace) -> Trace:
            parts = []
            for a in range(g.shape[-1]):
                sl = {k: v[..., a] for k, v in tr.items()}
                if solve_rule is not None:
                    parts.append(solve_rule(g[..., a], sl, weights, **rel.eqn_params))
                else:
                    parts.append(dt_to_t(g[..., a], sl, **rel.eqn_params))
            return {k: sum(p[k] for p in parts) for k in tr}

        if batched:
            return {k: v.sum(axis=0) for k, v in jax.vmap(solve)(signal, trace).items()}
        return solve(signal, trace)


def _element_ceiling(value: Any, learner: str) -> int:
    """``snap_max_jacobian_elements`` as a positive int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{learner}: snap_max_jacobian_elements must be an int (a count of elements), got {value!r}.")
    if value < 1:
        raise ValueError(f"{learner}: snap_max_jacobian_elements must be >= 1, got {value}.")
    return int(value)


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


def substep_product(Ds: jax.Array) -> jax.Array:
    """``D_{L-1}…D_0`` of stacked per-position Jacobians ``(L, ..., S, S)``: ``(..., S, S)``."""
    if Ds.shape[-1] == 1:
        return jnp.prod(Ds, axis=0)

    def fold(acc: jax.Array, D: jax.Array) -> tuple[jax.Array, None]:
        return D @ acc, None

    eye = jnp.broadcast_to(jnp.eye(Ds.shape[-1], dtype=Ds.dtype), Ds.shape[1:])
    return jax.lax.scan(fold, eye, Ds)[0]


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
