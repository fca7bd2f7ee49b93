"""Learner base classes: ``ETraceAlgorithm`` and the custom-VJP engine ``ETraceVjpAlgorithm``.

A learner wraps a model. Calling it runs the model step (or a window of steps) forward and
rolls the eligibility traces; differentiating through the call (``jax.grad`` of a loss of its
output) gives the online gradient of every ``ParamState``:

* ``vjp_method='single-step'``: the exact one-step gradient of every parameter (hidden inputs
  held fixed), plus, for the weights of compiled relations, the history term that the
  eligibility trace carries (how earlier steps' hidden states depended on the weight);
* ``vjp_method='multi-step'``: the exact gradient within the window (backpropagation through
  the window), plus the trace term of the state entering the window.

Where a primitive's rules were registered by the user, "exact" means "by the registered rule":
every weight gradient through its output is ``xy_to_dw(x, ∂L/∂y, weights)`` (see
:mod:`braintrace._algorithm.engine.rule_vjp`).

A learning rule is a subclass that fills in the trace hooks (:meth:`init_etrace_state`,
:meth:`_update_etrace_data`, :meth:`_solve_weight_gradients`, ...); the engine is shared. The hooks
pass the rule's own trace data (:data:`TraceData`) and backward residual (:data:`Residual`), the
type parameters of :class:`ETraceVjpAlgorithm`.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Generic, Mapping, Self, Sequence, TypeVar, cast

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.batch_size import checked_batch_size
from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._algorithm.drive.host import RollSink, StepFn
from braintrace._algorithm.engine.graph_executor import (
    CallHiddenJacobians,
    CallJacobians,
    CallWeightJacobians,
    ETraceGraphExecutor,
    ETraceVjpGraphExecutor,
    EtraceStepper,
)
from braintrace._algorithm.engine.input_data import get_single_step_data, has_multistep_data
from braintrace._algorithm.engine.call_lock import serialised
from braintrace._algorithm.engine.compiled_model import (
    SplitStates,
    check_hidden_shapes,
    check_learnable,
    check_registered_rules_reachable,
    check_states_are_compiled,
    check_step_keeps_hidden_shapes,
    reset_in_place,
    split_states,
)
from braintrace._algorithm.engine.eager_calls import watched_call
from braintrace._algorithm.engine.exactness_reasons import label_plain_weights, label_relations
from braintrace._algorithm.engine.operand_credit import (
    OperandChains,
    add_operand_gradient,
    build_operand_chains,
    relation_operands,
    relation_parameter_paths,
)
from braintrace._algorithm.drive.predict import forward_step, predict_sequences
from braintrace._algorithm.drive.sequence import SequenceDriverMixin
from braintrace._algorithm.engine.sharding import ShardingPlan, rows_follow_sharding, sharded_call
from braintrace._compiler import (
    CompilationReport,
    ControlFlowPolicy,
    ETraceGraph,
    LocalRelationWeights,
    groups_read_past_update,
    local_relation_weights,
)
from braintrace._compatible_imports import CustomVJPPrimal, SymbolicZero, ad, call_pullback
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._errors import internal_error
from braintrace._footprint import MemoryEstimate, learner_memory
from braintrace._typing import Path, PyTree

__all__ = ["EligibilityTrace", "ETraceAlgorithm", "ETraceVjpAlgorithm", "TraceData", "Residual"]

#: A learning rule's own trace data: what its ``_get_etrace_data`` returns, its
#: ``_update_etrace_data`` rolls and its ``_assign_etrace_data`` stores (a pytree of arrays).
TraceData = TypeVar("TraceData")
#: What a learning rule's backward pass reads of its traces: its ``_trace_for_backward`` returns
#: it, the forward pass keeps it, and its ``_solve_weight_gradients`` meets it with the signal.
Residual = TypeVar("Residual")
#: What an abstract evaluation of one step gives (:meth:`ETraceVjpAlgorithm._shapes_after_one_step`).
Shapes = TypeVar("Shapes")
#: Values by state path: parameters, hidden or other states (each a pytree of arrays).
StateValues = dict[Path, PyTree]
#: A call's results: ``(out, new hidden values, new other values, new traces)``.
CallOutput = tuple[PyTree, StateValues, StateValues, TraceData]
#: What a call's forward pass keeps for its backward pass: ``(pullback of the step or window,
#: the rule's residual, weight values, running index, model inputs, aux, exit cotangent)``.
CallResiduals = tuple[Callable[..., PyTree], Residual, StateValues, jax.Array, tuple[PyTree, ...], PyTree,
                      StateValues | None]
#: The cotangents of a call's ``(model inputs, weight values, hidden values, other values)``.
InputCotangents = tuple[tuple[PyTree, ...], StateValues, StateValues, StateValues]


class EligibilityTrace(brainstate.ShortTermState):
    """The state type eligibility traces are stored in (a ``ShortTermState``).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> traces = learner.states(braintrace.EligibilityTrace)
    >>> [trace.value['weight'].shape for trace in traces.values()]  # (3 + 4 inputs, 4 units, 1 state)
    [(7, 4, 1)]
    """


EligibilityTrace.__module__ = "braintrace"


class ETraceAlgorithm(SequenceDriverMixin, brainstate.nn.Module):
    """A model wrapped with an eligibility-trace learning rule.

    Parameters
    ----------
    model : brainstate.nn.Module
    graph_executor : ETraceGraphExecutor
    name : str, optional

    Attributes
    ----------
    graph : ETraceGraph
        The compiled graph of the model step.
    report : CompilationReport
        A readable view of :attr:`graph` (once compiled).
    param_states : dict
        ``path -> ParamState`` of the parameters the model step reads; differentiate a loss
        with respect to these.
    hidden_states : dict
        ``path -> HiddenState`` of the hidden states the model step updates.
    other_states : dict
        ``path -> state`` of the other states the model step touches.
    is_compiled : bool
        Whether :meth:`compile_graph` has run.
    batch_size : int or None
        The batch size the model's states were initialised with by :func:`braintrace.compile`
        (``None``: unbatched, or compiled by hand); :meth:`reset` uses it.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> isinstance(learner, braintrace.ETraceAlgorithm), learner.is_compiled
    (True, True)
    >>> list(learner.param_states), list(learner.hidden_states)
    ([('W', 'weight')], [('h',)])
    >>> learner.report.hidden_groups
    [(0, [('h',)])]
    """

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        check_constructor_keywords(cls, kwargs)
        check_required_arguments(cls, args, kwargs)
        return super().__new__(cls)

    def __init__(self, model: brainstate.nn.Module, graph_executor: ETraceGraphExecutor, name: str | None = None) -> None:
        super().__init__(name=name)
        if not isinstance(model, brainstate.nn.Module):
            raise ValueError(f"The model must be a brainstate.nn.Module, got {type(model).__name__}.")
        if not isinstance(graph_executor, ETraceGraphExecutor):
            raise ValueError(f"graph_executor must be an ETraceGraphExecutor, got {type(graph_executor).__name__}.")
        self.model4compile = model
        self.graph_executor = graph_executor
        self.running_index = brainstate.LongTermState(jnp.asarray(0, dtype=jnp.int32))
        #: The batch size the model's states were initialised with (set by braintrace.compile).
        self.batch_size: int | None = None
        self.is_compiled = False
        #: Calls of :meth:`update` so far, traced or run (the sequence drivers check ``step_fn`` calls it).
        self.calls_traced = 0
        #: Set while :meth:`predict` runs: a call runs the model forward only (:meth:`_forward_step`).
        self._forward_only = False
        self._split_cache: SplitStates | None = None
        self._trace_shapes: object = None
        # id(operand var) -> how a relation's trainable operand is computed from parameters.
        self._operand_chains: OperandChains = {}

    # --- compilation ----------------------------------------------------------------------

    @property
    def executor(self) -> ETraceGraphExecutor:
        return self.graph_executor

    @property
    def graph(self) -> ETraceGraph:
        return self.graph_executor.graph

    @property
    def report(self) -> CompilationReport:
        if not self.is_compiled:
            raise RuntimeError("The learner is not compiled yet: call compile_graph(example_input) first.")
        labels = label_relations(self.graph, self.rule_approximations, self.config)
        return CompilationReport(self.graph, labels=labels, plain_labels=label_plain_weights(self.graph))

    @property
    def path_to_states(self) -> dict[Path, brainstate.State]:
        return self.graph_executor.path_to_states

    @property
    def state_id_to_path(self) -> dict[int, Path]:
        return self.graph_executor.state_id_to_path

    def _split_states(self) -> SplitStates:
        if self._split_cache is None:
            self._split_cache = split_states(self.graph.module_info)
        return self._split_cache

    @property
    def param_states(self) -> dict[Path, brainstate.ParamState]:
        return self._split_states()[0]

    @property
    def hidden_states(self) -> dict[Path, brainstate.HiddenState]:
        return self._split_states()[1]

    @property
    def other_states(self) -> dict[Path, brainstate.State]:
        return self._split_states()[2]

    @property
    def _seq_param_states(self) -> dict[Path, brainstate.ParamState]:
        return self.param_states

    @property
    def _seq_batch_size(self) -> int | None:
        return self.batch_size

    _supports_scan_descent = False
    #: Attributes brainstate's graph does not walk: the cache of the model's states by kind would
    #: otherwise be the first path to them (``'_split_cache'`` sorts before ``'model'``), so
    #: ``learner.states()`` would name every state by its cache slot once the learner ran.
    graph_invisible_attrs = ("_split_cache",)
    #: Where the states live on a device mesh (set by ``braintrace.compile(..., sharding=...)``).
    sharding_plan: ShardingPlan | None = None
    #: The learner's coordinate among the learning rules (``None``: a rule outside that space).
    config: ETraceConfig | None = None
    #: Why the rule differs from BPTT's gradient whatever the model, beyond what ``config`` says
    #: (a rule outside ETraceConfig's space names its own); read by the exactness labels.
    rule_approximations: tuple[str, ...] = ()

    def compile_graph(self, *args: PyTree) -> None:
        """Compile the model step for example inputs and allocate the traces (once)."""
        probe = getattr(brainstate.transform, "in_new_state_probe", None)
        if probe is not None and probe():
            return
        if self.is_compiled:
            return
        self._split_cache = None
        self.graph_executor.compile_graph(*args)
        check_learnable(type(self).__name__, self.graph, self._supports_scan_descent, self.config)
        check_step_keeps_hidden_shapes(self.graph.module_info)
        check_registered_rules_reachable(self.graph)
        self._operand_chains = build_operand_chains(self.graph)
        self.init_etrace_state(*args)  # a learner's own refusals come first
        self._trace_shapes = self._current_trace_shapes()
        self.is_compiled = True

    def _current_trace_shapes(self) -> object:
        """The shapes of the traces as they are now (``None`` before they exist)."""
        getter = getattr(self, "_get_etrace_data", None)
        return None if getter is None else jax.tree.map(jnp.shape, getter())

    def _check_traces_and_states(self) -> None:
        """Refuse a call whose traces or model states are not the ones the learner was compiled for."""
        if self._current_trace_shapes() != self._trace_shapes:
            raise ValueError(
                f"{type(self).__name__}: the eligibility traces no longer have the shapes this learner "
                f"was compiled for (reset_state(batch_size=n) with another batch size resizes them). "
                f"Reset them at the compiled batch size with learner.reset() (or "
                f"reset_state(batch_size={self.batch_size})); a new batch size needs a new braintrace.compile."
            )
        check_states_are_compiled(self.model4compile, self.graph.module_info)

    def _relation_parameter_paths(self) -> frozenset[Path]:
        """The parameters some relation reads (:func:`~braintrace._algorithm.engine.operand_credit.relation_parameter_paths`)."""
        return relation_parameter_paths(self.graph, self._operand_chains)

    def _relation_operands(self, rel: HiddenParamOpRelation, weight_vals: dict[Path, PyTree]) -> dict[str, jax.Array]:
        """The current values of a relation's trainable operands (mantissas)."""
        return relation_operands(self._operand_chains, rel, weight_vals)

    def _add_operand_gradient(
        self, grads: dict[Path, PyTree], rel: HiddenParamOpRelation, key: str, g: jax.Array,
        weight_vals: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        """``grads`` plus ``g``, credited from the relation's operand ``key`` to the parameters it is
        computed from (:func:`~braintrace._algorithm.engine.operand_credit.add_operand_gradient`)."""
        return add_operand_gradient(self._operand_chains, grads, rel, key, g, weight_vals)

    @serialised
    def reset(self, batch_size: int | None = None) -> None:
        """Start a new sequence: the model's states as initialised, the traces and counters zero.

        The model's states are reset **in place**: ``reset_state`` and then ``init_state`` run
        on the model (``brainstate.nn.reset_all_states`` / ``init_all_states``), and every
        value ``init_state`` produces is written into the state object the learner was compiled
        with, which stays in the model. Calling ``init_all_states`` yourself instead would put
        new state objects in the model, which the compiled learner never reads: a silent
        detachment. Parameters are not touched. Works eagerly and inside ``jit``.

        Parameters
        ----------
        batch_size : int, optional
            The batch size to initialise the states with; default, the one the learner was
            compiled for (:attr:`batch_size`).

        Raises
        ------
        ValueError
            If ``batch_size`` is not a positive int, or a reset hidden state does not have the
            shape the learner was compiled for (another batch size); the states are then left
            as they were.

        Examples
        --------
        >>> import jax.numpy as jnp, braintrace
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones((2, 3)),
        ...                              batch_size=2)
        >>> _ = learner(jnp.ones((2, 3)))
        >>> learner.reset()
        >>> float(abs(learner.hidden_states[('h',)].value).sum()), int(learner.running_index.value)
        (0.0, 0)
        """
        if batch_size is None:
            batch_size = self.batch_size
        else:
            batch_size = checked_batch_size(batch_size, f"{type(self).__name__}.reset")
        reset_in_place(self.model4compile, self.graph.module_info, batch_size)
        self.reset_state(batch_size=batch_size)
        if self.sharding_plan is not None:
            self.sharding_plan.place()

    @serialised
    def predict(self, *sequences: PyTree, step_fn: StepFn | None = None, time_axis: int = 0) -> PyTree:
        """The model's per-step outputs over ``sequences``, from fresh states, at their batch size.

        The model runs forward from states initialised afresh (its ``init_state``) at the batch
        size of the sequences, which need not be the one the learner was compiled for (an
        unbatched single sequence too, if the model supports it); no trace is kept and no
        gradient taken. The learner is left exactly as it was: weights, hidden states, traces,
        ``running_index`` and other states. Each new batch size (and ``step_fn``) compiles one
        program, kept on the learner: later calls with sequences of the same shapes reuse it.

        Parameters
        ----------
        *sequences : pytree
            One or more pytrees whose leaves share the time length ``T``: time-major
            ``(T, batch, ...)`` (or ``(T, ...)`` for one sequence) with ``time_axis=0``,
            batch-major ``(batch, T, ...)`` with ``time_axis=1``. The first is the model's input.
        step_fn : callable, optional
            ``step_fn(*slices) -> output``: calls the learner once, exactly as the ``step_fn``
            of training does (which may reuse a readout), and returns the step's output pytree;
            inside ``predict`` that call runs the model forward only. Default: the learner's
            output for the first sequence's slice (the other sequences are not read). Pass the
            same function object to reuse its compiled program.
        time_axis : {0, 1}
            The layout of the sequences, and of the outputs returned.

        Returns
        -------
        pytree
            The per-step outputs stacked on the time axis: ``(T, batch, ...)``, or with
            ``time_axis=1`` ``(batch, T, ...)`` (leaves without the batch keep time first).

        Raises
        ------
        TypeError, ValueError
            For a non-callable ``step_fn`` or one that does not call the learner exactly once,
            a bad ``time_axis``, missing, empty, scalar or ragged sequences, or a first sequence
            whose steps are neither one sample nor a batch of samples of the compiled input.

        Examples
        --------
        >>> import jax.numpy as jnp, braintrace
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones((32, 3)),
        ...                              batch_size=32)
        >>> learner.predict(jnp.ones((6, 37, 3))).shape  # 37 sequences of 6 steps
        (6, 37, 4)
        >>> learner.predict(jnp.ones((37, 6, 3)), time_axis=1).shape
        (37, 6, 4)
        >>> learner.predict(jnp.ones((6, 3))).shape  # one sequence, unbatched
        (6, 4)
        >>> int(learner.running_index.value)  # the learner is untouched
        0
        """
        return predict_sequences(self, self, sequences, step_fn, time_axis, mapped=False)

    def _forward_step(self, args: tuple[PyTree, ...]) -> PyTree:
        """A call while :meth:`predict` runs: the model forward on ``args``, nothing else."""
        self.calls_traced += 1
        return forward_step(self.model4compile, args)

    def show_graph(self, verbose: bool = True, return_msg: bool = False) -> str | None:
        return self.graph_executor.show_graph(verbose=verbose, return_msg=return_msg)

    @serialised
    def __call__(self, *args: PyTree, **options: object) -> PyTree:
        """:meth:`update`: model inputs positionally, the learner's own options (``modulator=``) by keyword.

        A sharded learner (``braintrace.compile(..., sharding=...)``) constrains the inputs and
        the states the call writes to their placement (see :class:`~braintrace.Sharding`).
        Called eagerly (outside ``jit`` and the sequence drivers), the call traces the step
        every time: the third eager call warns, once per learner, with the measured time per
        call (:class:`~braintrace.EagerCallWarning`).
        """
        return watched_call(self, lambda: sharded_call(self.sharding_plan, self.update, args, options),
                            lambda out: (args, options, out, self.running_index.value))

    # ``Any`` options: a learner's update may name its own (OSTTP's ``update(x, y_target)``).
    def update(self, *args: PyTree, **options: Any) -> PyTree:
        raise NotImplementedError(f"{type(self).__name__} must implement update().")

    def init_etrace_state(self, *args: PyTree, **kwargs: object) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement init_etrace_state().")

    def memory(self, *example_inputs: PyTree) -> MemoryEstimate:
        """How much memory one training step of this learner needs (compiled by XLA, not run).

        Parameters
        ----------
        *example_inputs
            Inputs of one step, as the learner is called with (arrays or ``jax.ShapeDtypeStruct``).

        Returns
        -------
        MemoryEstimate
            The learner's trace, parameter and state bytes, and XLA's memory of one online
            training step (see :func:`braintrace.learner_memory`; :func:`braintrace.estimate_memory`
            compares learners and BPTT before building any).

        Examples
        --------
        >>> import jax.numpy as jnp, braintrace
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
        >>> row = learner.memory(jnp.ones((2, 3)))
        >>> row.trace_bytes  # 2 samples · (7·4 + 4) parameters · 1 state · 4 B
        256
        >>> row.total_bytes >= row.persistent_bytes
        True
        """
        return learner_memory(self, *example_inputs)

    def get_etrace_of(self, weight: brainstate.ParamState | Path) -> PyTree:
        raise NotImplementedError(f"{type(self).__name__} must implement get_etrace_of().")

    def _states_without_state_axis(self) -> list[brainstate.State]:
        """The trace states held without the trailing state axis of one their rules see (none here;
        see ``ParamDimVjpAlgorithm._stored``). Checkpoints store them with the axis."""
        return []

    def named_etraces(self) -> dict[tuple[Path, int], PyTree]:
        """Every trace, keyed by ``(parameter path, hidden group index)`` instead of object ids.

        The value is the relation's trace for that group, in the learner's own form (what
        :meth:`get_etrace_of` holds for it: D_RTRL ``{key: trace}``, pp_prop ``(x trace or
        None, df trace)``, ...). A parameter read by several operations that drive the same
        group maps to a tuple of their traces.

        Examples
        --------
        >>> import jax.numpy as jnp, braintrace
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
        >>> {key: {k: v.shape for k, v in trace.items()} for key, trace in learner.named_etraces().items()}
        {(('W', 'weight'), 0): {'weight': (7, 4, 1), 'bias': (4, 1)}}
        """
        self._assert_compiled_for("named_etraces")
        found: dict[tuple[Path, int], list[PyTree]] = {}
        for rel in self.graph.hidden_param_op_relations:
            for group in rel.hidden_groups:
                trace = self._relation_etrace(rel, group)
                for path in dict.fromkeys(rel.trainable_paths.values()):
                    found.setdefault((path, group.index), []).append(trace)
        return {key: traces[0] if len(traces) == 1 else tuple(traces) for key, traces in found.items()}

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> PyTree:
        """The trace of one relation for one of its groups (see :meth:`named_etraces`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _relation_etrace().")

    def _assert_compiled_for(self, call: str) -> None:
        if not self.is_compiled:
            raise ValueError(
                f"{call}: {type(self).__name__} is not compiled; build it with "
                f"braintrace.compile(model, algorithm, example_input)."
            )


ETraceAlgorithm.__module__ = "braintrace"


class ETraceVjpAlgorithm(ETraceAlgorithm, Generic[TraceData, Residual]):
    """The custom-VJP engine shared by the learning rules (see the module docstring).

    Generic over the rule's :data:`TraceData` and :data:`Residual`, which its hooks pass.

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
        ``'single-step'`` (default): every call is one step, and the trace's history meets
        ``∂L/∂h^t`` through the compiled per-position hidden Jacobian ``D^t``. ``'multi-step'``:
        a call may be a window of steps (:class:`~braintrace.MultiStepData`), differentiated
        exactly inside, and the trace entering the window meets the exact ``∂L/∂h`` at its
        entry. Where the rule's trace is exact the two agree; for an approximate rule they are
        different estimators, also for one-step calls: a multi-step learner given one step
        back-propagates through that step exactly (cross-position mixing included) before it
        meets the trace, where a single-step learner uses ``D^t``.
    control_flow : ControlFlowPolicy, optional
    config : ETraceConfig, optional
        The learner's coordinate, checked by :meth:`_check_config` (an engine's own); its
        ``recurrence_scope`` decides what the compiled hidden Jacobians include.

    Attributes
    ----------
    config : ETraceConfig or None
        The coordinate (``None`` for a rule outside :class:`~braintrace.ETraceConfig`'s space).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3),
    ...                              vjp_method='multi-step')
    >>> isinstance(learner, braintrace.ETraceVjpAlgorithm), learner.vjp_method
    (True, 'multi-step')
    >>> learner(braintrace.MultiStepData(jnp.ones((5, 3)))).shape  # a window of 5 steps in one call
    (5, 4)
    >>> learner.config
    ETraceConfig(trace_factorization='per_param')
    """

    #: Single step: whether the rule's history term of a relation already holds this step's
    #: ``⟨∂L/∂h^t, x ⊗ df⟩``. The engine then leaves the weights for which that term is the whole
    #: one-step gradient (``braintrace._compiler.local_relation_weights``) out of the step's
    #: VJP, and the rule must not subtract the term for them.
    _history_holds_same_step = False

    def __init__(
        self,
        model: brainstate.nn.Module,
        name: str | None = None,
        vjp_method: str = "single-step",
        control_flow: ControlFlowPolicy | None = None,
        config: ETraceConfig | None = None,
    ) -> None:
        if vjp_method not in ("single-step", "multi-step"):
            raise ValueError(f"vjp_method must be 'single-step' or 'multi-step', got {vjp_method!r}.")
        config = self._check_config(config)
        executor = ETraceVjpGraphExecutor(
            model, vjp_method=vjp_method, control_flow=control_flow,
            include_recurrent_mixing=config is not None and config.include_recurrent_mixing,
            sparse_n=None if config is None else config.sparse_n,
        )
        super().__init__(model, executor, name=name)
        self.config = config
        self.vjp_method = vjp_method
        self._read_past_update: frozenset[int] | None = None
        self._local_weights: LocalRelationWeights | None = None
        self._entering_reads: frozenset[int] = frozenset()
        fn = jax.custom_vjp(self._update_fn)
        # Symbolic zeros: a cotangent that is zero by construction (typically that of the new
        # hidden values, which a per-step loss does not read) stays symbolic through the step's
        # VJP instead of being multiplied through the step's products.
        fn.defvjp(self._update_fn_fwd_primals, self._update_fn_bwd, symbolic_zeros=True)
        self._true_update_fun = fn

    def _check_config(self, config: ETraceConfig | None) -> ETraceConfig | None:
        """The learner's coordinate given ``config`` (an engine checks it and supplies its default)."""
        if config is not None:
            raise TypeError(
                f"{type(self).__name__} takes no config: it is a rule outside ETraceConfig's space. Pass "
                f"the config to the engine of its trace_factorization (or to braintrace.compile).")
        return None

    @property
    def _seq_vjp_method(self) -> str:
        return self.vjp_method

    @property
    def vjp_executor(self) -> ETraceVjpGraphExecutor:
        if not isinstance(self.graph_executor, ETraceVjpGraphExecutor):
            raise internal_error(f"{type(self).__name__} runs on a {type(self.graph_executor).__name__}, not a VJP executor")
        return self.graph_executor

    def _assert_compiled(self) -> None:
        if not self.is_compiled:
            raise ValueError(
                f"{type(self).__name__} is not compiled. Please call `compile_graph()` first (or build "
                f"the learner with braintrace.compile(model, algorithm, example_input))."
            )

    def update(self, *args: PyTree, **options: Any) -> PyTree:
        """Run one call (a step, or a :class:`MultiStepData` window) and roll the traces.

        ``args`` are the model's inputs; ``options`` are the learner's own keyword options
        (``modulator=`` of ``learning_signal='modulatory'``), never passed to the model.
        """
        if self._forward_only:
            return self._forward_step(args)
        self.calls_traced += 1
        self._assert_compiled()
        aux = self._get_update_aux(args, **options)
        self._check_traces_and_states()
        params, hidden, other = self._split_states()
        weight_vals = {p: st.value for p, st in params.items()}
        hidden_vals = {p: st.value for p, st in hidden.items()}
        check_hidden_shapes(self.graph.module_info, hidden_vals)
        other_vals = {p: st.value for p, st in other.items()}
        self._entering_reads = frozenset()  # recorded again where this call's gradient is traced
        out, new_hidden, new_other, new_etrace = self._true_update_fun(
            args, weight_vals, hidden_vals, other_vals, self._get_etrace_data(),
            self.running_index.value, aux, self._take_roll_sink(),
        )
        for p, v in new_hidden.items():
            hidden[p].value = v
        for p, v in new_other.items():
            other[p].value = v
        self._assign_etrace_data(new_etrace)
        ri = self.running_index.value + 1
        self.running_index.value = jax.lax.stop_gradient(jnp.where(ri >= 0, ri, 0))
        return out

    # --- the custom VJP -------------------------------------------------------------------

    def _update_fn(
        self, args: tuple[PyTree, ...], weight_vals: StateValues, hidden_vals: StateValues, other_vals: StateValues,
        etrace_vals: TraceData, running_index: jax.Array, aux: PyTree = None, roll_sink: RollSink | None = None,
    ) -> CallOutput[TraceData]:
        ex = self.vjp_executor
        multi = has_multistep_data(*args)
        stepper = self._make_etrace_stepper(weight_vals) if multi else None
        called = ex.run_call(args, {**weight_vals, **hidden_vals, **other_vals}, stepper, etrace_vals)
        out, new_vals, jac, final = called
        if stepper is not None:
            new_etrace = _rolled(final)
        else:
            jac = _jacobians(jac)
            new_etrace = self._update_etrace_data(running_index, etrace_vals, jac[0], jac[1], weight_vals, multi)
            new_etrace = self._defer_instant_traces(etrace_vals, new_etrace, jac)
        hid, oth = ex.split_hidden_other(new_vals)
        return out, hid, oth, new_etrace

    def _update_fn_fwd_primals(self, *primals: PyTree) -> tuple[CallOutput[TraceData], CallResiduals[Residual]]:
        """:meth:`_update_fn_fwd` on the values of ``custom_vjp``'s primal wrappers."""
        values = jax.tree.map(lambda p: p.value, primals, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
        return self._update_fn_fwd(*values)

    def _update_fn_fwd(
        self, args: tuple[PyTree, ...], weight_vals: StateValues, hidden_vals: StateValues, other_vals: StateValues,
        etrace_vals: TraceData, running_index: jax.Array, aux: PyTree = None, roll_sink: RollSink | None = None,
    ) -> tuple[CallOutput[TraceData], CallResiduals[Residual]]:
        ex = self.vjp_executor
        multi = has_multistep_data(*args)
        if ex.is_single_step_vjp:
            if multi:
                raise NotImplementedError(
                    "The single-step VJP can only support the input data that is at a single time "
                    "step. Use vjp_method='multi-step' for MultiStepData inputs."
                )
            perturb0 = self.graph.hidden_perturb.init_perturb_data()  # type: ignore[union-attr]
            detached = self._local_relation_weights().paths

            def step(
                a: tuple[PyTree, ...], w: StateValues, h: StateValues, o: StateValues, p: list[jax.Array],
            ) -> tuple[tuple[PyTree, StateValues, StateValues], CallJacobians]:
                w = {k: jax.lax.stop_gradient(v) if k in detached else v for k, v in w.items()}
                out, new_vals, env = ex.run_step(a, {**w, **h, **o}, p)
                return (out, *ex.split_hidden_other(new_vals)), ex.extract_jacobians(env)

            primal, vjp_fn, jac = jax.vjp(step, args, weight_vals, hidden_vals, other_vals, perturb0, has_aux=True)
            new_etrace = self._update_etrace_data(running_index, etrace_vals, jac[0], jac[1], weight_vals, False)
            trace_for_bwd = self._trace_for_backward(etrace_vals, new_etrace, jac, single_step=True)
            if roll_sink is not None:  # the driver takes the rolled traces from the backward pass
                trace_for_bwd, new_etrace = self._roll_in_backward(etrace_vals, new_etrace, trace_for_bwd, jac)
            self._entering_reads = _entering_leaves_read(etrace_vals, new_etrace, trace_for_bwd)
            new_etrace = self._defer_instant_traces(etrace_vals, new_etrace, jac, trace_for_bwd)
        else:
            stepper = self._make_etrace_stepper(weight_vals) if multi else None

            def window(
                a: tuple[PyTree, ...], w: StateValues, h: StateValues, o: StateValues,
            ) -> tuple[tuple[PyTree, StateValues, StateValues], tuple[CallJacobians | None, TraceData | None]]:
                called = ex.run_call(a, {**w, **h, **o}, stepper, etrace_vals)
                out, new_vals, jacs, final = called
                return (out, *ex.split_hidden_other(new_vals)), (jacs, final)

            primal, vjp_fn, (jacs, final) = jax.vjp(window, args, weight_vals, hidden_vals, other_vals, has_aux=True)
            if stepper is not None:
                new_etrace = _rolled(final)
            else:
                jacs = _jacobians(jacs)
                new_etrace = self._update_etrace_data(running_index, etrace_vals, jacs[0], jacs[1], weight_vals, multi)
            trace_for_bwd = self._trace_for_backward(etrace_vals, new_etrace, jacs, single_step=False)
        out, hid, oth = primal
        # A learner that injects a cotangent at the window's exit (DNI) computes it here, where
        # the exit hidden values exist; ``None`` (every other learner) traces no second pass.
        exit_cotangent = None if ex.is_single_step_vjp else self._exit_cotangent(aux, hid)
        residuals = (vjp_fn, trace_for_bwd, weight_vals, running_index, args, aux, exit_cotangent)
        return (out, hid, oth, new_etrace), residuals

    @rows_follow_sharding
    def _update_fn_bwd(self, residuals: CallResiduals[Residual], cotangents: tuple[PyTree, ...]) -> tuple[PyTree, ...]:
        vjp_fn, trace_for_bwd, weight_vals, running_index, args, aux, exit_cotangent = residuals
        d_out, d_hid, d_oth, _ = jax.tree.map(
            lambda c: ad.Zero(c.aval) if isinstance(c, SymbolicZero) else c, cotangents,
            is_leaf=lambda x: isinstance(x, SymbolicZero))
        if not self.vjp_executor.is_single_step_vjp:
            d_out = _materialised(d_out)  # a window's outputs are stacked by a scan (see the helper)
        grads = call_pullback(vjp_fn, (d_out, d_hid, d_oth))
        groups = self.graph.hidden_groups
        if self.vjp_executor.is_single_step_vjp:
            dg_args, dg_weights, dg_hidden, dg_other, dg_perturb = grads
            perturb = self.graph.hidden_perturb
            if perturb is None:
                raise internal_error("a single-step VJP graph without the hidden perturbation")
            signal = perturb.perturb_data_to_hidden_group_data(dg_perturb, groups)
            previous = [
                g.concat_hidden([u.get_mantissa(dg_hidden[p]) for p in g.hidden_paths]) for g in groups
            ]
            trace_for_bwd = self._with_previous_signal(trace_for_bwd, previous)
        else:
            dg_args, dg_weights, dg_hidden, dg_other = grads
            signal = [
                g.concat_hidden([u.get_mantissa(dg_hidden[p]) for p in g.hidden_paths]) for g in groups
            ]
        signal = self._compute_learning_signal(signal, (*args, aux))
        dg_weights = self._solve_weight_gradients(running_index, trace_for_bwd, signal, weight_vals, {}, dg_weights)
        dg_weights, rolled = self._solve_rolled(trace_for_bwd, signal, weight_vals, dg_weights)
        if exit_cotangent is not None:
            injected = call_pullback(vjp_fn, _injection_cotangents(d_out, d_hid, d_oth, exit_cotangent))
            dg_args, dg_weights, dg_hidden, dg_other = _with_exit_pass(
                (dg_args, dg_weights, dg_hidden, dg_other), injected, self._relation_parameter_paths())
        return dg_args, dg_weights, dg_hidden, dg_other, None, None, None, rolled

    # --- hooks ----------------------------------------------------------------------------

    def _exit_cotangent(self, aux: PyTree, new_hidden: dict[Path, PyTree]) -> dict[Path, PyTree] | None:
        """Multi-step: an extra cotangent on the window's exit hidden values (default: none).

        A learner that returns ``{path: cotangent}`` (shaped, typed and unit-carrying like
        ``new_hidden[path]``; missing paths count as zero) gets it pushed through the window's
        transposed computation a second time (see :func:`_with_exit_pass`); ``aux`` is what
        :meth:`_get_update_aux` returned for the call.
        """
        return None

    def _seq_after_gradient(self, grads: dict[Path, PyTree]) -> None:
        """Single step: the new traces whose entering value the gradient reads are written after it.

        XLA updates a trace in place only if nothing reads the entering trace after the update:
        where the gradient reads it (a group whose previous value an output reads past its
        update, the entering filter of EProp) XLA would otherwise copy the whole trace every
        step. Or-ing the bits of those new traces with a zero computed from the gradient
        (:func:`_zero_after`, :func:`_or_zero_bits`) makes their update wait for the gradient;
        the zero is fused into the update. The traces' values are unchanged, bit for bit.
        """
        if not self._entering_reads:
            return
        zero = _zero_after(grads)
        leaves, treedef = jax.tree.flatten(self._get_etrace_data())
        ordered = [_or_zero_bits(v, zero) if i in self._entering_reads else v for i, v in enumerate(leaves)]
        self._assign_etrace_data(jax.tree.unflatten(treedef, ordered))

    def _get_etrace_data(self) -> TraceData:
        raise NotImplementedError

    # --- traces rolled in the backward pass (``braintrace._algorithm.carriers.backward_roll``) --------

    def _take_roll_sink(self) -> RollSink | None:
        """The sink a driver gave this call for traces rolled in the backward pass (``None``:
        this learner rolls every trace in its forward pass)."""
        return None

    def _roll_in_backward(
        self, entering: TraceData, new: TraceData, residual: Residual, jac: CallJacobians,
    ) -> tuple[Residual, TraceData]:
        raise internal_error(f"{type(self).__name__} took a roll sink but rolls no trace in its backward pass")

    def _solve_rolled(
        self, residual: Residual, signals: Sequence[Any], weight_vals: dict[Path, PyTree], grads: dict[Path, PyTree]
    ) -> tuple[dict[Path, PyTree], RollSink | None]:
        """``grads`` and the cotangent of the call's roll sink (``None``: it had none)."""
        return grads, None

    def _assign_etrace_data(self, etrace_vals: TraceData) -> None:
        raise NotImplementedError

    def _defer_instant_traces(self, entering: TraceData, new: TraceData, jac: CallJacobians,
                              residual: object = None) -> TraceData:
        """Single step, in a driver's loop: ``new`` with the traces written once after it kept as their
        factors (``carriers/instant_traces.py``; none by default); ``residual`` must read none of them."""
        return new

    def _update_etrace_data(
        self, running_index: jax.Array, etrace_vals_util_t_1: TraceData,
        hid2weight_jac_single_or_multi_times: CallWeightJacobians,
        hid2hid_jac_single_or_multi_times: CallHiddenJacobians, weight_vals: StateValues, input_is_multi_step: bool,
    ) -> TraceData:
        raise NotImplementedError

    def _solve_weight_gradients(
        self, running_index: jax.Array, etrace_h2w_at_t: Residual, dl_to_hidden_groups: Sequence[Any],
        weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        raise NotImplementedError

    def _trace_for_backward(
        self, old_etrace: TraceData, new_etrace: TraceData, jac: CallJacobians | None, single_step: bool,
    ) -> Residual:
        """What the backward pass receives of the traces (``jac``: ``None`` where a stepper rolled
        them); by default the traces entering the call, so a rule that keeps the default has the
        :data:`Residual` of its :data:`TraceData`."""
        return cast(Residual, old_etrace)

    def _groups_read_past_update(self) -> frozenset[int]:
        """The groups whose previous value an output of the step reads other than through its update."""
        if self._read_past_update is None:
            perturb = self.graph.hidden_perturb
            self._read_past_update = frozenset() if perturb is None else groups_read_past_update(
                perturb, self.graph.hidden_groups, self.graph.module_info)
        return self._read_past_update

    def _local_relation_weights(self) -> LocalRelationWeights:
        """Single step: the weights left out of the one-step VJP (see :attr:`_history_holds_same_step`)."""
        if self._local_weights is None:
            perturb = self.graph.hidden_perturb
            # A subclass defined elsewhere that replaces the gradient may rely on the one-step
            # gradient of every weight.
            library_rule = self._defined_in_library("_trace_for_backward", "_solve_weight_gradients")
            if not (self._history_holds_same_step and library_rule) or perturb is None:
                self._local_weights = LocalRelationWeights(frozenset(), {})
            else:
                relations = self.graph.hidden_param_op_relations
                self._local_weights = local_relation_weights(
                    perturb, relations, self.graph.hidden_groups, self.graph.module_info,
                    excluded_groups=self._groups_read_past_update(),
                    candidates=frozenset(i for i, rel in enumerate(relations) if self._same_step_in_history(rel)))
        return self._local_weights

    def _same_step_in_history(self, rel: HiddenParamOpRelation) -> bool:
        """Single step: whether the history term of ``rel`` holds ``⟨∂L/∂h^t, x ⊗ df⟩`` (when
        :attr:`_history_holds_same_step`; a rule may narrow it down per relation)."""
        return True

    def _defined_in_library(self, *methods: str) -> bool:
        """Whether this learner's ``methods`` are the library's (not overridden by user code)."""
        cls = type(self)
        return all(getattr(cls, name).__module__.startswith("braintrace._algorithm") for name in methods)

    def _with_previous_signal(self, trace_for_bwd: Residual, previous: list[jax.Array]) -> Residual:
        """Single step: give the backward residual ``∂L/∂h^{t-1}`` per group (default: unused).

        It is the step loss's derivative with respect to each group's previous value through
        every path of the step, which a rule needs where outputs read that value past its update.
        """
        return trace_for_bwd

    def _shapes_after_one_step(
        self, roll: Callable[[CallJacobians, dict[Path, PyTree]], Shapes], *args: PyTree,
    ) -> Shapes:
        """The shapes ``roll(jacobians, weight_vals)`` gives on one step of ``args``, evaluated
        abstractly (nothing runs): what a trace becomes once the step's Jacobians meet it."""
        ex = self.vjp_executor
        state_vals = {p: st.value for p, st in ex.states.items()}
        weight_vals = {p: state_vals[p] for p in self.param_states}

        def one_step() -> Shapes:
            _, _, env = ex.run_step(get_single_step_data(*args), state_vals)
            return roll(ex.extract_jacobians(env), weight_vals)

        return jax.eval_shape(one_step)

    def _make_etrace_stepper(self, weight_vals: dict[Path, PyTree]) -> EtraceStepper[TraceData] | None:
        return None

    def _compute_learning_signal(
        self, dl_to_hidden_from_autodiff: list[jax.Array], args: tuple[PyTree, ...],
    ) -> list[Any]:
        """Each group's signal for the rule's gradient: ``∂L/∂h`` (default), or a rule's own
        (:class:`~braintrace._algorithm.engine.learning_signal.SignalPair`, a modulator's ...)."""
        return dl_to_hidden_from_autodiff

    def _get_update_aux(self, args: tuple[PyTree, ...], **options: object) -> PyTree:
        """What the call passes to the rule beside the model's inputs (read before tracing).

        A learner that takes keyword options validates them here; by default there are none
        (:func:`_refuse_options`).
        """
        _refuse_options(type(self).__name__, options)
        return None


ETraceVjpAlgorithm.__module__ = "braintrace"


def _rolled(final: TraceData | None) -> TraceData:
    """The trace a call's stepper rolled inside the executor's scan."""
    if final is None:
        raise internal_error("the executor returned no rolled trace for a call with a stepper")
    return final


def _refuse_options(learner: str, options: Mapping[str, object]) -> None:
    """Refuse keyword options given to the call of a learner that takes none.

    Examples
    --------
    >>> _refuse_options('D_RTRL', {})
    >>> _refuse_options('D_RTRL', {'modulator': 1.0})
    Traceback (most recent call last):
    ...
    TypeError: D_RTRL.update() got keyword option(s) modulator= it does not take: model inputs are passed positionally (learner(x)), and this learner has no keyword options. modulator= is read by learning_signal='modulatory' (braintrace.ThreeFactor).
    """
    if options:
        names = ", ".join(f"{k}=" for k in sorted(options))
        hint = (" modulator= is read by learning_signal='modulatory' (braintrace.ThreeFactor)."
                if "modulator" in options else "")
        raise TypeError(
            f"{learner}.update() got keyword option(s) {names} it does not take: model inputs are passed "
            f"positionally (learner(x)), and this learner has no keyword options.{hint}")


def _jacobians(jac: CallJacobians | None) -> CallJacobians:
    """The Jacobians of a call without a stepper."""
    if jac is None:
        raise internal_error("the executor returned no Jacobians for a call without a stepper")
    return jac


def _entering_leaves_read(old: object, new: object, residual: object) -> frozenset[int]:
    """The positions (in ``old``'s flattened order) of the entering trace's arrays that the
    backward ``residual`` holds while it holds no new value at that position."""
    held = {id(leaf) for leaf in jax.tree.leaves(residual)}
    old_leaves, new_leaves = jax.tree.leaves(old), jax.tree.leaves(new)
    if len(old_leaves) != len(new_leaves):
        return frozenset()
    return frozenset(i for i, (o, n) in enumerate(zip(old_leaves, new_leaves))
                     if id(o) in held and id(n) not in held)


def _zero_after(tree: object) -> jax.Array:
    """A float32 zero that XLA can compute only once every floating leaf of ``tree`` is.

    ``0 · s`` for the sum ``s`` of one element of each leaf (``0`` where ``s`` is not finite):
    XLA does not fold a floating product with zero, so the dependency survives compilation.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> _zero_after({'w': jnp.ones((2, 3)), 'b': jnp.array([jnp.inf])})
    Array(0., dtype=float32)
    """
    firsts = [jnp.ravel(u.get_mantissa(leaf))[0].astype(jnp.float32) for leaf in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) and jnp.size(leaf)]
    if not firsts:
        return jnp.zeros((), jnp.float32)
    s = sum(firsts[1:], firsts[0])
    return jnp.where(jnp.isfinite(s), 0.0 * s, 0.0)


def _zero_after_written(tree: object, after: jax.Array) -> jax.Array:
    """A float32 zero that XLA can compute only once every array of ``tree`` is in memory.

    :func:`_zero_after` reads one element of each leaf, which XLA computes inline from the
    leaf's own inputs when the leaf is an element-wise expression (a trace update): the zero
    then waits for those inputs, not for the leaf to be written. The operands of a conditional
    are buffers, so a zero computed in its branch waits for every leaf. The branch is chosen on
    ``after`` (a zero from :func:`_zero_after`, which XLA cannot fold), so the zero also comes
    after what ``after`` does.

    Only on CPU, where the copy this ordering removes was found and measured; elsewhere a
    conditional synchronises with the host every step, and the zero is ``_zero_after(tree) +
    after``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> _zero_after_written({'e': jnp.ones((2, 3))}, jnp.zeros(()))
    Array(0., dtype=float32)
    """
    def in_a_branch(t: object, a: jax.Array) -> jax.Array:
        return jax.lax.cond(a == 0, _zero_after, lambda _: jnp.zeros((), jnp.float32), t)

    def inline(t: object, a: jax.Array) -> jax.Array:
        return _zero_after(t) + a

    return jax.lax.platform_dependent(tree, after, cpu=in_a_branch, default=inline)


def _or_zero_bits(value: jax.Array, zero: jax.Array) -> jax.Array:
    """``value`` with its bits or-ed with those of ``zero`` cast to an unsigned integer: the same
    value, bit for bit, computed only once ``zero`` is.

    Integer arithmetic, so that XLA does not widen a half-precision trace to float32 and round it
    back a second time to add the zero.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> _or_zero_bits(jnp.array([-0.0, 1.5], jnp.bfloat16), jnp.zeros(()))
    Array([-0, 1.5], dtype=bfloat16)
    """
    bits = jnp.dtype(f"uint{8 * value.dtype.itemsize}")
    or_ed = jax.lax.bitcast_convert_type(value, bits) | zero.astype(bits)
    return jax.lax.bitcast_convert_type(or_ed, value.dtype)


def _zero_cotangent(c: jax.Array | ad.Zero) -> ad.Zero:
    """A symbolic zero in place of the cotangent ``c``."""
    return c if isinstance(c, ad.Zero) else ad.Zero(jax.typeof(c).to_tangent_aval())


def _materialised(tree: PyTree) -> PyTree:
    """``tree`` with its symbolic zeros made arrays.

    For a window's outputs: JAX's transpose of the scan that stacks them passes a symbolic zero
    on the stacked outputs into the per-step body unsliced, and fails on its shape.
    """
    return jax.tree.map(lambda c: ad.instantiate_zeros(c) if isinstance(c, ad.Zero) else c, tree,
                        is_leaf=lambda x: isinstance(x, ad.Zero))


def _injection_cotangents(
    d_out: PyTree, d_hid: StateValues, d_oth: StateValues, exit_cotangent: StateValues,
) -> tuple[PyTree, StateValues, StateValues]:
    """The window's output cotangents with only ``exit_cotangent`` on the new hidden values."""
    def zeros(tree: PyTree) -> PyTree:
        return jax.tree.map(_zero_cotangent, tree, is_leaf=lambda x: isinstance(x, ad.Zero))

    hidden = {p: exit_cotangent[p] if p in exit_cotangent else zeros(c) for p, c in d_hid.items()}
    return _materialised(zeros(d_out)), hidden, zeros(d_oth)


def _with_exit_pass(first: InputCotangents, second: InputCotangents, etp: frozenset[Path]) -> InputCotangents:
    """Route the second linear pass (the exit cotangent pushed through the window).

    The boundary learning signal and the gradients of ``etp``, the parameters some relation reads
    (their cross-window credit is already in the trace), keep the first pass only; plain
    parameters, the inputs, the other states and the returned hidden cotangent get both.
    """
    dg_args, dg_weights, dg_hidden, dg_other = first
    in_args, in_weights, in_hidden, in_other = second
    weights = {p: g if p in etp else _add_cotangents(g, in_weights[p]) for p, g in dg_weights.items()}
    return (_add_cotangents(dg_args, in_args), weights, _add_cotangents(dg_hidden, in_hidden),
            _add_cotangents(dg_other, in_other))


def _add_cotangents(a: PyTree, b: PyTree) -> PyTree:
    """``a + b`` leaf by leaf (integer inputs' ``float0`` cotangents stay as they are)."""
    def add(x: jax.Array, y: jax.Array) -> jax.Array:
        return x if getattr(x, "dtype", None) == jax.dtypes.float0 else x + y

    return jax.tree.map(add, a, b)


def constructor_options(cls: type) -> list[str]:
    """The keyword options of ``cls``'s constructor, following ``**kwargs`` up to the base that
    takes them (``model`` and ``*args`` excluded)."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name not in ("self", "model") and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def check_constructor_keywords(cls: type, kwargs: dict[str, object]) -> None:
    """Refuse keywords ``cls`` does not take, naming its options and the closest match.

    Raises
    ------
    TypeError
        For an unknown keyword, e.g. ``EProp(model, kappa=0.5)``.
    """
    valid = constructor_options(cls)
    unknown = [name for name in kwargs if name not in valid]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = [v for v in valid if name in v or v in name] or difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
        if close:
            hints.append(f" Did you mean {close[0]!r} for {name!r}?")
    raise TypeError(
        f"{cls.__name__} has no option {', '.join(map(repr, unknown))}; its options are {valid}."
        + "".join(hints)
    )


def check_required_arguments(cls: type, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """Refuse a construction that leaves out an argument without a default, naming it and how to pass it.

    Raises
    ------
    TypeError
        For a missing required argument, e.g. ``pp_prop(model)`` without ``decay_or_rank``.
    """
    params = [p for p in inspect.signature(getattr(cls, "__init__")).parameters.values() if p.name != "self"]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(positional):
        return  # Python's own error names the extra positional arguments
    given = {p.name for p in positional[: len(args)]} | set(kwargs)
    missing = [p.name for p in params if p.default is p.empty and p.kind is not p.VAR_KEYWORD and p.name not in given]
    if missing:
        name = missing[0]
        raise TypeError(
            f"{cls.__name__} needs {name!r}, which has no default: pass it as "
            f"braintrace.compile(model, {cls.__name__}, example_input, {name}=...) or "
            f"{cls.__name__}(model, {name}=...) (see help(braintrace.{cls.__name__}))."
        )
