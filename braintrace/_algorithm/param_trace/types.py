"""The per-parameter engine's types: its traces, a step's inputs, the backward residual, its host learner.

:class:`~braintrace.ParamDimVjpAlgorithm` keeps its hooks and its trace storage; the work is
done by functions in four modules, one concern each: the one-step roll
(:mod:`~braintrace._algorithm.param_trace.roll`), the multi-step window
(:mod:`~braintrace._algorithm.param_trace.window`), what the forward pass keeps for the backward
pass (:mod:`~braintrace._algorithm.param_trace.residual`) and the gradient read off it
(:mod:`~braintrace._algorithm.param_trace.solve`). They read the learner through
:class:`ParamTraceHost` only, so none of them imports the class. This module imports the graph
executor's keys, the learning signals and the compiler's types.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.param_trace.types import BackwardResidual, BackwardTrace, split_filtered
>>> residual = BackwardResidual(BackwardTrace({}, None))  # multi-step: no traces, no Jacobians
>>> residual.trace.instant, residual.swapped_learn
({}, False)
>>> eps = {(0, 0): {"weight": jnp.zeros(2)}}
>>> split_filtered({"eps": eps, "filt": eps}, filtered=True)[1] is eps
True
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Protocol, Sequence, TypedDict, TypeGuard, Union, cast

import brainstate
import jax

from braintrace._algorithm.engine.base import EligibilityTrace
from braintrace._algorithm.engine.graph_executor import (
    CallHiddenJacobians,
    CallWeightJacobians,
    DfKey,
    StepJacobians,
    TailPoint,
    TransitionPoint,
)
from braintrace._algorithm.engine.learning_signal import SignalPair
from braintrace._algorithm.engine.operand_credit import CreditHost
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._errors import internal_error
from braintrace._op._registries import FastPathRules
from braintrace._typing import Path, PyTree, Trace, TraceKey

__all__ = [
    "Traces", "FilteredTraces", "Carried", "Inputs", "Tails", "RelationInput", "Term", "Terms", "Signal",
    "PlainRoll", "TraceStepper", "StepRelation", "BackwardTrace", "BackwardResidual", "ParamTraceHost",
    "split_filtered", "step_jacobians",
]

#: Per trace key, one relation's trace for one hidden group, as the rules see it (with its
#: trailing state axis).
Traces = dict[TraceKey, Trace]
#: Per ``id(x_var)``, the input ``x`` of the relations that read it (stacked over a window's steps).
Inputs = dict[int, jax.Array]
#: Per :data:`~braintrace._algorithm.engine.graph_executor.DfKey`, a relation's ``df`` (or a group's
#: history Jacobian) at a step (stacked over a window's steps).
Tails = dict[DfKey, jax.Array]
#: A relation's input ``x``; ``None`` for an element-wise relation, which reads none.
RelationInput = Union[jax.Array, None]
#: The ``(x, df)`` of an instantaneous term ``x ⊗ df``.
Term = tuple[RelationInput, jax.Array]
#: Per trace key, the ``(x, df)`` of a term ``x ⊗ df``.
Terms = dict[TraceKey, Term]
#: A group's signal: ``g = ∂L/∂h`` ``(*varshape, S)``, or ``g`` beside the learning signal that
#: replaces it (:class:`~braintrace._algorithm.engine.learning_signal.SignalPair`).
Signal = Union[jax.Array, SignalPair]
#: A trace rolled plainly this step (``ε^t = D ε^{t-1} + x ⊗ df``): its relation's index, its
#: group, and the ``(x, df)`` of ``x ⊗ df``.
PlainRoll = tuple[int, HiddenGroup, Term]


class FilteredTraces(TypedDict):
    """The traces of a learner with ``trace_filter='kappa'`` and their filters ``ē``."""

    eps: Traces
    filt: Traces


#: What a per-parameter learner carries from step to step: its traces, with their filters where
#: it filters them.
Carried = Union[Traces, FilteredTraces]
#: ``stepper(carried, (xs, dfs, Ds)) -> (carried, None)``: one step of a scan over a window.
TraceStepper = Callable[[Carried, tuple[Inputs, Tails, Sequence[jax.Array]]], tuple[Carried, None]]
#: ``step(rel, group, old, diag, x, df, weights) -> new``: one step of one relation's trace.
StepRelation = Callable[
    [HiddenParamOpRelation, HiddenGroup, Trace, jax.Array, RelationInput, jax.Array, Trace], Trace]


def split_filtered(carried: Carried, filtered: bool) -> tuple[Traces, Traces | None]:
    """The traces and the filters (``None``: the learner does not filter) of ``carried``."""
    if not filtered:
        return cast(Traces, carried), None
    both = cast(FilteredTraces, carried)
    return both["eps"], both["filt"]


def step_jacobians(weight_jac: CallWeightJacobians, hidden_jac: CallHiddenJacobians, learner: str) -> StepJacobians:
    """A call's ``((xs, dfs), Ds)`` as arrays, for a learner whose executor sets no
    ``transition_points`` (it receives no :class:`TailPoint` nor :class:`TransitionPoint`).

    Raises
    ------
    RuntimeError
        (an internal error) If the call holds points.
    """
    xs, dfs = weight_jac
    if not (_array_tails(dfs) and _array_hidden(hidden_jac)):
        raise internal_error(f"{learner} received transition points, though its executor sets no transition_points")
    return (xs, dfs), hidden_jac


def _array_tails(dfs: Mapping[DfKey, jax.Array | TailPoint]) -> TypeGuard[Tails]:
    return not any(isinstance(df, TailPoint) for df in dfs.values())


def _array_hidden(Ds: CallHiddenJacobians) -> TypeGuard[list[jax.Array]]:
    return not any(isinstance(D, TransitionPoint) for D in Ds)


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

    traces: Traces
    history_jacobians: list[jax.Array] | None
    through_while: Terms = {}
    instant: Terms = {}
    read_past_update: dict[int, jax.Array] = {}


class BackwardResidual(NamedTuple):
    """What the per-parameter engine's backward pass receives (see
    :func:`~braintrace._algorithm.param_trace.solve.solve_weight_gradients`).

    Attributes
    ----------
    trace : BackwardTrace
        Single step: D-RTRL's history term ``⟨Dᵀ g, ε^{t-1}⟩``; multi-step: the (filtered)
        trace entering the window, met by the learning signal.
    old_filter : dict or None
        Single step, filtered, symmetric signal: ``ē^{t-1}`` of the keys whose history is read
        off the entering trace (the term ``κ ⟨g, ē^{t-1}⟩``; the others read it off ``ē^t``).
    learning_trace : dict or None
        Single step, replaced signal: ``ē^t`` (``ε^t`` unfiltered), met by the learning signal;
        unfiltered, without the ``same_step`` keys whose group has no history (``ε^t = x ⊗ df``)
        or whose trace the backward pass rolls (``backward_roll``, which contracts ``ε^{t-1}``
        itself), whose ``⟨s, ε^t⟩ − ⟨g, x ⊗ df⟩`` is then ``⟨s − g, x ⊗ df⟩``: no trace of
        theirs is read.
    new_trace : dict or None
        Single step, replaced signal: ``ε^t`` of the keys not in ``same_step``, met by ``−g``
        (removing the autodiff's same-step term).
    same_step : dict
        Single step, replaced signal: per plainly rolled trace key (``ε^t = D ε^{t-1} + x ⊗ df``),
        the ``(x, df)`` of the autodiff's same-step term ``⟨g, x ⊗ df⟩``, subtracted in place of
        ``−⟨g, ε^t⟩`` (see
        :func:`~braintrace._algorithm.param_trace.residual.replaced_signal_residual`).
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
    old_filter: Traces | None = None
    learning_trace: Traces | None = None
    new_trace: Traces | None = None
    same_step: Terms = {}
    swapped: Traces = {}
    roll_jacobians: list[jax.Array] | None = None
    swapped_learn: bool = False
    rolled: list[PyTree] | None = None


class ParamTraceHost(CreditHost, Protocol):
    """The learner (:class:`~braintrace.ParamDimVjpAlgorithm`) as the engine's functions read it.

    The ``_step_relation`` and ``_step_all`` hooks are read through the learner, so that a
    subclass which overrides them is heard.
    """

    @property
    def chunked_trace(self) -> bool:
        """Whether multi-step windows are rolled in closed form."""

    @property
    def kappa(self) -> float:
        """The trace filter's ``κ`` (``0``: no filter)."""

    @property
    def replaces_signal(self) -> bool:
        """Whether the relation weights meet a learning signal other than ``∂L/∂h``."""

    @property
    def _trace_filters(self) -> Mapping[TraceKey, brainstate.ShortTermState]:
        """Per trace key, its filter's state (empty: no filter)."""

    @property
    def etrace_bwg(self) -> Mapping[TraceKey, EligibilityTrace]:
        """Per trace key, its stored trace."""

    def _fast_path(self, rel: HiddenParamOpRelation) -> FastPathRules | None:
        """The closed-form kernels that roll ``rel``'s trace (``None``: its own rules)."""

    def _groups_read_past_update(self) -> frozenset[int]:
        """The groups whose previous value an output of the step reads past its update."""

    def _rolls_plainly(self) -> bool:
        """Whether new traces are the plain roll ``D ε + x ⊗ df`` of the entering ones."""

    def _step_relation(
        self, rel: HiddenParamOpRelation, group: HiddenGroup, old: Trace, diag: jax.Array, x: RelationInput,
        df: jax.Array, weights: Trace,
    ) -> Trace:
        """One step of ``rel``'s trace for ``group``."""

    def _step_all(
        self, etrace: Traces, xs: Inputs, dfs: Tails, Ds: Sequence[jax.Array], weight_vals: dict[Path, PyTree],
    ) -> Traces:
        """One step of every trace."""
