"""``pp_prop`` (ES-D-RTRL): the IO-dim learning rule, a factored eligibility trace.

Instead of one trace entry per parameter (D-RTRL), ``pp_prop`` keeps two low-pass filtered
factors per relation ``y = op(x, W)`` driving a hidden group ``h``:

* an input trace per distinct input ``x`` (shaped like ``x``, or like the primitive's
  ``pp_x_repr`` of it, e.g. the one-hot of embedding indices):
  ``ε_x ← α ε_x + x̃``;
* an output trace per (relation, hidden group), shaped ``(*varshape, S)``:
  ``ε_f ← α (D ⊙ ε_f) + (1 − α) df`` with ``(D ⊙ ε_f)[..., a] = Σ_c D[..., a, c] ε_f[..., c]``.

The gradient pulls the learning signal ``g = ∂L/∂h`` back through the primitive at the
filtered input: ``xy_to_dw(ε_x, Σ_a (ε_f / c)[..., a] g[..., a])``, where
``c = 1 − α^k`` (``k`` = number of time steps the trace has absorbed since the last reset)
undoes the bias of the zero-initialised filters. The memory is ``O(|x| + |y|)`` per relation
instead of ``O(|W|)``.

What a call adds to the engine's gradient (see :mod:`braintrace._algorithm.engine.base`):

* single-step: the one-step gradient is exact and already holds this step's path
  ``W -> y -> h^t``; the rule adds the *history* part of its estimate, i.e. the estimate at the
  new trace minus the same-step term ``xy_to_dw(x̃_t, Σ_a df_t[..., a] g[..., a])``. At the
  first step after a reset the two cancel, so a single step from a reset equals
  backpropagation through time for every parameter. A weight whose relation reaches the
  step's outputs only element-wise through its hidden states
  (``braintrace._compiler.local_relation_weights``) has no other one-step path: it is left
  out of the one-step VJP and gets the whole estimate, which is the same sum with two
  weight-sized products fewer;
* multi-step: the exact gradient within the window plus the estimate at the trace entering
  the window (zero for the first window after a reset, so one window over the whole
  sequence equals backpropagation through time).

After the first step the history term is an approximation (the outer product of two filtered
factors stands in for the filtered outer product); the decay trades bias for memory length.

The class holds the hooks and the storage of the traces; the step
(:mod:`~braintrace._algorithm.io_trace.roll`) and the gradient
(:mod:`~braintrace._algorithm.io_trace.solve`) are functions of the learner, made of the
per-relation functions of :mod:`~braintrace._algorithm.io_trace.relation_rule`, whose record
:func:`~braintrace.pp_prop_rule` runs the same maths through the rule contract.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> learner = braintrace.compile(Leaky(), braintrace.pp_prop, jnp.ones(3), decay_or_rank=0.9)
>>> learner.decay, learner.num_rank
(0.9, 19)
>>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
>>> grads[('w',)]
Array([[1., 1.],
       [1., 1.],
       [1., 1.]], dtype=float32)
"""

from __future__ import annotations

from typing import Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import EligibilityTrace, ETraceVjpAlgorithm
from braintrace._algorithm.carriers.carrier_store import CarrierStore, TraceStore
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
    df_key,
)
from braintrace._algorithm.io_trace.relation_rule import (
    DecayOrRank,
    XRepr,
    input_representation,
    output_trace_zeros,
    parse_decay_pair,
    represented_spec,
    unfit_output_error,
)
from braintrace._algorithm.io_trace.roll import IOStepper, IOTrace, step, stepper, x_tilde
from braintrace._algorithm.io_trace.solve import IOResidual, solve_weight_gradients
from braintrace._algorithm.engine.learning_signal import SignalPair, draw_feedback, feedback_signals
from braintrace._algorithm.engine.modulator import ModulatorSlot, modulator_signals
from braintrace._algorithm.param_trace.types import step_jacobians
from braintrace._algorithm.rules.snn_helpers import FixedRandomFeedback
from braintrace._algorithm.carriers.trace_storage import storage_dtype
from braintrace._compatible_imports import Var
from braintrace._compiler import ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import dtype_of, shape_of
from braintrace._op.elemwise import etp_elemwise_p
from braintrace._typing import Path, PyTree

__all__ = ["IODimVjpAlgorithm", "pp_prop", "ES_D_RTRL"]

class IODimVjpAlgorithm(ModulatorSlot, ETraceVjpAlgorithm[IOTrace, IOResidual]):
    """The IO-dim eligibility-trace learner: every ``io_factorized`` coordinate of
    :class:`~braintrace.ETraceConfig` (see the module docstring).

    The two factors have their own decays, ``ε_x ← α_x ε_x + x̃`` and
    ``ε_f ← α_f (R ε_f) + (1 − α_f) df``, where ``R`` is what the f side's recursion reads:
    ``D`` (``'jacobian'``), ``I`` (``'scalar_leak'``: the leak is ``α_f``) or ``0`` (``'none'``,
    whose decay is 0). ``learning_signal='random_feedback'`` projects ``∂L/∂h`` as
    :class:`ParamDimVjpAlgorithm` does; the estimate then meets the projected signal and the
    same-step term removed is the autodiff's.

    Parameters
    ----------
    model : brainstate.nn.Module
    decay_or_rank : float, int or pair
        The filter decay ``α`` (a float, ``0 <= α < 1``) or a rank ``r`` (an int ``> 0``,
        ``α = (r − 1) / (r + 1)``), for both factors, or a pair ``(x side, f side)`` of them.
        With a ``config`` it may be ``None`` (the config's decays); if given it must agree.
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
    fast_solve : bool
        Pull the learning signal back with one ``xy_to_dw`` call (summed over the hidden
        states of the group) instead of one call per state; the results agree.
    control_flow : ControlFlowPolicy, optional
        Forwarded to the compiler. Descended scans are not supported (use D_RTRL there).
    config : ETraceConfig, optional
        The coordinate (``trace_factorization='io_factorized'``), authoritative when given;
        default ``ETraceConfig(trace_factorization='io_factorized', decay=(α_x, α_f))``.
    random_feedback_key : int or PRNG key, optional
        Seed of the feedback matrices; required by ``learning_signal='random_feedback'``.
    trace_dtype : dtype, optional
        Storage dtype of both factors (e.g. ``jnp.bfloat16``); each step upcasts them, filters
        in the step's precision and rounds once on write (see
        :mod:`braintrace._algorithm.carriers.trace_storage`). Input traces of a non-float input (integer
        indices without a ``pp_x_repr``) keep their dtype. The factors are ``O(|x| + |y|)``, so
        this saves little memory next to D_RTRL's per-parameter trace.

    Attributes
    ----------
    config : ETraceConfig
        The coordinate.
    decay_x, decay_f : float
        The decays of the input and output factors.
    decay : float
        The decay both factors share (read-only; ``AttributeError`` when they differ).
    etrace_xs : dict
        ``{id(x_var): EligibilityTrace}``, the input traces.
    etrace_dfs : dict
        ``{(id(y_var), 'hidden_group_i'): EligibilityTrace}``, the output traces.
    trace_steps : brainstate.LongTermState
        Time steps absorbed by the traces since the last reset (drives the bias correction).

    Raises
    ------
    ValueError
        For a bad ``decay_or_rank``, one that disagrees with the config's decays, a config of
        another trace factorization, ``'random_feedback'`` without a key, or a ``trace_dtype``
        that is not a floating dtype.
    TypeError
        For a ``config`` that is not an ETraceConfig.
        Also for ``learning_signal='modulatory'`` with ``vjp_method='multi-step'``.
    NotImplementedError
        For ``learning_signal='bootstrapped'`` (DNI's coordinate).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.IODimVjpAlgorithm,
    ...                              jnp.ones(3), decay_or_rank=3)
    >>> learner.decay  # rank 3: (3 - 1) / (3 + 1)
    0.5
    >>> x_traces, f_traces = learner.get_etrace_of(learner.param_states[('W', 'weight')])
    >>> [v.shape for v in x_traces.values()], [v.shape for v in f_traces.values()]  # O(|x| + |y|)
    ([(7,)], [(4, 1)])
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.IODimVjpAlgorithm,
    ...                              jnp.ones(3), decay_or_rank=(0.9, 0.0))
    >>> learner.decay_x, learner.decay_f, learner.config.temporal_recursion
    (0.9, 0.0, ('scalar_leak', 'none'))
    """

    _supports_scan_descent = False
    _history_holds_same_step = True
    config: ETraceConfig

    def __init__(
        self,
        model: brainstate.nn.Module,
        decay_or_rank: DecayOrRank | None,
        name: str | None = None,
        vjp_method: str = "single-step",
        fast_solve: bool = True,
        control_flow: ControlFlowPolicy | None = None,
        config: ETraceConfig | None = None,
        random_feedback_key: int | jax.Array | None = None,
        trace_dtype: jax.typing.DTypeLike | None = None,
    ) -> None:
        self.trace_dtype = storage_dtype(trace_dtype, type(self).__name__)
        if config is None:
            config = ETraceConfig(trace_factorization="io_factorized", decay=parse_decay_pair(decay_or_rank))
        else:
            config = self._check_config(config)
            if decay_or_rank is not None and parse_decay_pair(decay_or_rank) != (config.decay_x, config.decay_f):
                raise ValueError(
                    f"{type(self).__name__}: decay_or_rank={decay_or_rank!r} disagrees with the config's "
                    f"decays ({config.decay_x}, {config.decay_f}); the config is authoritative, so pass "
                    f"decay_or_rank=None (or the same decays).")
        require_feedback_key(config, random_feedback_key, type(self).__name__)
        require_single_step_modulator(config, vjp_method, type(self).__name__)
        super().__init__(model, name=name, vjp_method=vjp_method, control_flow=control_flow, config=config)
        self.vjp_executor.recurrence = recurrence(config)
        self.random_feedback_key = random_feedback_key
        self._feedback_matrices: dict[int, FixedRandomFeedback] = {}
        self.fast_solve = bool(fast_solve)
        self.etrace_xs: TraceStore[int] = CarrierStore()
        self.etrace_dfs: TraceStore[tuple[int, str]] = CarrierStore()
        self.trace_steps = brainstate.LongTermState(jnp.asarray(0, dtype=jnp.int32))
        # Per x key: the primitive's pp_x_repr rule (or None) and the weight avals it reads.
        self._x_reprs: dict[int, XRepr] = {}

    def _check_config(self, config: ETraceConfig | None) -> ETraceConfig:
        return engine_config(config, "io_factorized", type(self).__name__,
                             ("symmetric", "random_feedback", "modulatory"))

    @property
    def decay_x(self) -> float:
        """``α_x``, the decay of the input traces."""
        return self.config.decay_x

    @property
    def decay_f(self) -> float:
        """``α_f``, the decay of the output traces (and of their bias correction)."""
        return self.config.decay_f

    @property
    def decay(self) -> float:
        """The decay both factors share."""
        if self.decay_x != self.decay_f:
            raise AttributeError(
                f"{type(self).__name__}.decay: the factors have different decays (decay_x={self.decay_x}, "
                f"decay_f={self.decay_f}); read decay_x and decay_f.")
        return self.decay_x

    @property
    def num_rank(self) -> int:
        """The rank equivalent to :attr:`decay`, ``round(2 / (1 − α) − 1)``."""
        return round(2.0 / (1.0 - self.decay) - 1.0)

    # --- trace storage --------------------------------------------------------------------

    def init_etrace_state(self, *args: PyTree, **kwargs: object) -> None:
        """Allocate the zero input and output traces of every relation (and the random feedback
        matrices of ``learning_signal='random_feedback'``)."""
        xs: dict[int, jax.Array] = {}
        dfs: dict[tuple[int, str], jax.Array] = {}
        reprs: dict[int, XRepr] = {}
        for rel in self.graph.hidden_param_op_relations:
            if rel.x_var is not None:
                self._init_x_trace(rel, rel.x_var, xs, reprs)
            for group in rel.hidden_groups:
                key = df_key(rel, group)
                if key in dfs:
                    raise ValueError(f"The relation {rel} has been added (duplicate trace key {key}).")
                value = self._init_df_trace(rel, group)
                dfs[key] = value.astype(self._stored_dtype(value.dtype))
        self.etrace_xs = CarrierStore.of_zeros(xs, EligibilityTrace)
        self.etrace_dfs = CarrierStore.of_zeros(dfs, EligibilityTrace)
        self._x_reprs = reprs
        self._feedback_matrices = {}
        if self.config.learning_signal == "random_feedback":
            seed = self.random_feedback_key
            if seed is None:  # given at construction (require_feedback_key), set to None since
                raise ValueError(f"{type(self).__name__}: learning_signal='random_feedback' needs random_feedback_key "
                                 f"(an int seed or a PRNG key), got None; set learner.random_feedback_key = 0.")
            self._feedback_matrices = draw_feedback(self.graph, seed)

    def _stored_dtype(self, dtype: jax.typing.DTypeLike) -> jax.typing.DTypeLike:
        """The dtype a trace of native ``dtype`` is stored in (``trace_dtype`` for floats)."""
        if self.trace_dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return dtype
        return self.trace_dtype

    def _init_x_trace(
        self, rel: HiddenParamOpRelation, x_var: Var, xs: dict[int, jax.Array],
        reprs: dict[int, XRepr],
    ) -> None:
        x_repr = input_representation(rel.primitive, {k: v.aval for k, v in rel.trainable_vars.items()})
        spec = represented_spec(jax.ShapeDtypeStruct(shape_of(x_var), dtype_of(x_var)), x_repr)
        key = id(x_var)
        dtype = self._stored_dtype(spec.dtype)
        if key in xs:
            old = xs[key]
            if (old.shape, old.dtype) != (tuple(spec.shape), dtype):
                raise ValueError(
                    f"pp_prop: two relations read the same input {rel.x_var} but represent it "
                    f"differently ({old.shape}/{old.dtype} vs {tuple(spec.shape)}/{spec.dtype}); "
                    f"feed them separate inputs or train them with D_RTRL."
                )
            return
        xs[key] = jnp.zeros(spec.shape, dtype)
        reprs[key] = x_repr

    @staticmethod
    def _init_df_trace(rel: HiddenParamOpRelation, group: HiddenGroup) -> jax.Array:
        y_shape, varshape = shape_of(rel.y_var), tuple(group.varshape)
        elemwise = rel.primitive is etp_elemwise_p
        # An element-wise weight may broadcast over leading (batch) axes of the hidden state; any
        # output may add leading axes of size one (a layer's batch of one on an unbatched state).
        fits = varshape[len(varshape) - len(y_shape):] == y_shape if elemwise else (
            y_shape == varshape or rel.adds_unit_axes(group))
        if not fits:
            raise unfit_output_error(rel.primitive.name, y_shape, f"hidden group {group.index} of shape {varshape}")
        value = output_trace_zeros(rel.primitive, rel.x_var, rel.y_var, rel.trainable_vars, group.num_state, group)
        expected = (*varshape, group.num_state)
        if tuple(getattr(value, "shape", ())) == (*y_shape, group.num_state):
            value = jnp.reshape(value, expected)  # kept over the group's positions, like D
        if tuple(getattr(value, "shape", ())) != expected:
            raise ValueError(
                f"init_pp of {rel.primitive.name} returned shape {getattr(value, 'shape', None)}; "
                f"pp_prop needs the hidden group's shape plus the state axis, {expected}."
            )
        return jnp.asarray(value)

    def _get_etrace_data(self) -> IOTrace:
        return {"xs": self.etrace_xs.read(), "dfs": self.etrace_dfs.read(), "steps": self.trace_steps.value}

    def _assign_etrace_data(self, etrace_vals: IOTrace) -> None:
        self.etrace_xs.assign(etrace_vals["xs"])
        self.etrace_dfs.assign(etrace_vals["dfs"])
        self.trace_steps.value = etrace_vals["steps"]

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Zero both traces and the step counters (model states are not touched).

        With ``batch_size``, the traces that carry a batch axis (inputs of batched primitives,
        outputs driving batched hidden groups) get that leading size; the others keep theirs.
        """
        if self.etrace_xs or self.etrace_dfs:
            batched_xs, batched_dfs = self._batched_trace_keys()
            self.etrace_xs.reset(batch_size, batched_xs.__contains__)
            self.etrace_dfs.reset(batch_size, batched_dfs.__contains__)
        self.running_index.value = jnp.zeros_like(self.running_index.value)
        self.trace_steps.value = jnp.zeros_like(self.trace_steps.value)

    def _batched_trace_keys(self) -> tuple[set[int], set[tuple[int, str]]]:
        relations = self.graph.hidden_param_op_relations
        batched_groups = {g.index for r in relations for g in r.hidden_groups if r.traces_lead_with_batch(g)}
        xs = {
            id(r.x_var) for r in relations
            if r.x_var is not None and reg.is_batched_primitive(r.primitive)
            and any(r.traces_lead_with_batch(g) for g in r.hidden_groups)
        }
        dfs = {df_key(r, g) for r in relations for g in r.hidden_groups if g.index in batched_groups}
        return xs, dfs

    def get_etrace_of(self, weight: brainstate.ParamState | Path) -> tuple[dict[int, jax.Array], dict[tuple[int, str], jax.Array]]:
        """The input and output traces of every relation that has ``weight`` as a trainable key.

        Parameters
        ----------
        weight : brainstate.ParamState or tuple
            The parameter state, or its path.

        Returns
        -------
        (dict, dict)
            ``{id(x_var): ε_x}`` (empty for element-wise weights, which have no input) and
            ``{(id(y_var), 'hidden_group_i'): ε_f}``.

        Raises
        ------
        ValueError
            If no compiled relation learns ``weight``.
        """
        self._assert_compiled()
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        relations = [r for r in self.graph.hidden_param_op_relations
                     if path is not None and path in r.trainable_paths.values()]
        xs: dict[int, jax.Array] = self.etrace_xs.select(id(r.x_var) for r in relations if r.x_var is not None)
        dfs: dict[tuple[int, str], jax.Array] = self.etrace_dfs.select(
            df_key(r, group) for r in relations for group in r.hidden_groups)
        if not dfs:
            known = sorted({p for r in self.graph.hidden_param_op_relations for p in r.trainable_paths.values()})
            raise ValueError(
                f"Do not the etrace of the given weight: {weight if path is None else path}. "
                f"Weights with traces: {known}."
            )
        return xs, dfs

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> tuple[jax.Array | None, jax.Array]:
        x_trace = None if rel.x_var is None else self.etrace_xs[id(rel.x_var)].value
        return x_trace, self.etrace_dfs[df_key(rel, group)].value

    # --- one step of the traces -----------------------------------------------------------

    def _update_etrace_data(
        self, running_index: jax.Array, etrace_vals_util_t_1: IOTrace,
        hid2weight_jac_single_or_multi_times: CallWeightJacobians,
        hid2hid_jac_single_or_multi_times: CallHiddenJacobians, weight_vals: dict[Path, PyTree],
        input_is_multi_step: bool,
    ) -> IOTrace:
        (xs, dfs), Ds = step_jacobians(hid2weight_jac_single_or_multi_times, hid2hid_jac_single_or_multi_times,
                                       type(self).__name__)
        if not input_is_multi_step:
            return step(self, etrace_vals_util_t_1, xs, dfs, Ds)
        rolled: IOTrace = jax.lax.scan(self._make_etrace_stepper(weight_vals), etrace_vals_util_t_1, (xs, dfs, Ds))[0]
        return rolled

    def _make_etrace_stepper(self, weight_vals: dict[Path, PyTree]) -> IOStepper:
        # Always fused into the executor's scan: the counter then advances once per time step.
        return stepper(self)

    # --- the gradient ---------------------------------------------------------------------

    def _trace_for_backward(
        self, old_etrace: IOTrace, new_etrace: IOTrace, jac: CallJacobians | None, single_step: bool,
    ) -> IOResidual:
        # Single step: the estimate at the new trace, minus its same-step term (x̃_t, df_t),
        # which the exact one-step gradient already holds. Multi-step: the entering trace.
        if single_step:
            if jac is None:
                raise internal_error("a single step's residual needs the step's Jacobians")
            (xs, dfs), _ = step_jacobians(jac[0], jac[1], type(self).__name__)
            return new_etrace, (x_tilde(xs, self._x_reprs), dfs), old_etrace, {}
        return old_etrace, None, None, {}

    def _with_previous_signal(self, trace_for_bwd: IOResidual, previous: list[jax.Array]) -> IOResidual:
        # A group whose previous value the step reads past its update takes its history as
        # ⟨∂L/∂h^{t-1}, x̄^{t-1} ⊗ df̄^{t-1}⟩ from the entering traces (as D_RTRL does).
        new, instant, old, _ = trace_for_bwd
        return new, instant, old, {i: previous[i] for i in self._groups_read_past_update()}

    def _compute_learning_signal(
        self, dl_to_hidden_from_autodiff: list[jax.Array], args: tuple[PyTree, ...],
    ) -> list[jax.Array] | list[SignalPair]:
        if self._modulated:  # args ends with the call's modulator
            return modulator_signals(args[-1], dl_to_hidden_from_autodiff, self.graph)
        if self.config.learning_signal != "random_feedback":
            return dl_to_hidden_from_autodiff
        learning = feedback_signals(dl_to_hidden_from_autodiff, self._feedback_matrices, self.graph,
                                    type(self).__name__)
        return [SignalPair(g, s) for g, s in zip(dl_to_hidden_from_autodiff, learning)]

    def _solve_weight_gradients(
        self, running_index: jax.Array, etrace_h2w_at_t: IOResidual, dl_to_hidden_groups: Sequence[jax.Array | SignalPair],
        weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        return solve_weight_gradients(self, etrace_h2w_at_t, dl_to_hidden_groups, weight_vals, dl_to_nonetws_at_t,
                                      dl_to_etws_at_t)

class pp_prop(IODimVjpAlgorithm):
    """pp_prop (ES-D-RTRL) under its canonical name (identical to :class:`IODimVjpAlgorithm`).

    Parameters
    ----------
    model : brainstate.nn.Module
    decay_or_rank : float, int or pair
        The filter decay ``α`` (``0 <= α < 1``) or a rank ``r > 0`` (``α = (r − 1) / (r + 1)``),
        or a pair ``(x side, f side)`` of them.
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
        The estimator (see :class:`~braintrace.ETraceVjpAlgorithm`).
    fast_solve : bool
        One ``xy_to_dw`` call per relation instead of one per hidden state.
    control_flow : ControlFlowPolicy, optional
    config : ETraceConfig, optional
        As :class:`IODimVjpAlgorithm` (default
        ``ETraceConfig(trace_factorization='io_factorized', decay=(α, α))``).
    random_feedback_key : int or PRNG key, optional
        Required by ``learning_signal='random_feedback'``.
    trace_dtype : dtype, optional
        Storage dtype of both factors (e.g. ``jnp.bfloat16``); the arithmetic stays in the
        step's precision (see :class:`IODimVjpAlgorithm`).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.pp_prop, jnp.ones(3),
    ...                              decay_or_rank=0.9)
    >>> learner.decay, learner.num_rank
    (0.9, 19)
    >>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    >>> braintrace.ES_D_RTRL is braintrace.pp_prop
    True
    """


pp_prop.__module__ = "braintrace"

#: The legacy name of :class:`pp_prop`.
ES_D_RTRL = pp_prop
