"""What a sequence driver reads from the learner it drives: the :class:`SequenceHost` protocol.

The drivers (:mod:`braintrace._algorithm.drive.drivers`) are functions of a learner. They read
the learner through the ``_seq_*`` members named here and nothing else, so any object that has
them can be driven: every learner (:class:`~braintrace.ETraceAlgorithm`) and the vmapped learner
(:class:`~braintrace.ETraceVmap`), through the defaults of
:class:`~braintrace.SequenceDriverMixin`. This module also names the drivers' own types: a
gradient keyed like its weights (:data:`Grads`), a user's step function (:data:`StepFn`), the
traces a call may roll in its backward pass (:data:`RollSink`), and the loop that takes a
sequence's gradient (:class:`SequenceRun`, built by a :class:`SequenceRunType`).

It imports the non-finite status only (:mod:`braintrace._algorithm.drive.finite`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, ClassVar, Mapping, NamedTuple, Protocol, Sequence, Union

import brainstate
import jax

from braintrace._algorithm.drive.finite import Status
from braintrace._typing import Path, PyTree, Trace

__all__ = ["Grads", "StepFn", "RolledTrace", "StepFactors", "RollSink", "SequenceHost", "SequenceRun", "SequenceRunType"]

#: ``path -> gradient`` keyed like the ``weights`` that were differentiated (each shaped like the
#: parameter's value, a pytree).
Grads = dict[Path, PyTree]
#: ``step_fn(*slices) -> loss`` (or ``(loss, aux)``): calls the learner once and scores its output.
StepFn = Callable[..., PyTree]
#: One trace rolled in the backward pass, in its stored form: the trace, or a filtered trace's
#: ``{'eps': trace, 'filt': filter}``.
RolledTrace = Union[Trace, dict[str, Trace]]


class StepFactors(NamedTuple):
    """What a call's backward pass returns of a trace the driver rolls over several calls at once:
    the roll's factors and the signals the entering trace (and filter) meet, each ``(batch, ...)``."""

    #: The relation's input, ``(batch, in)``.
    x: jax.Array
    #: The group's factor ``d`` of the roll ``ε' = d ε + x ⊗ df``, ``(batch, out)``.
    diag: jax.Array
    #: The relation's ``df``, ``(batch, out)``.
    df: jax.Array
    #: The signal ``q`` of the gradient's history term ``Σ_b q ⊙ ε``, ``(batch, out)``.
    signal: jax.Array
    #: The signal ``r`` the entering filter ``ē`` of a filtered trace meets, ``Σ_b r ⊙ ē``
    #: (``None``: no filter).
    filt_signal: jax.Array | None = None
    #: The signal ``g`` of the call's own gradient term ``Σ_b x ⊗ (g df)``, which the group's
    #: roll sums with the others' (``None``: the call adds its own term).
    own_signal: jax.Array | None = None


#: Zeros shaped like what a call's backward pass returns of each trace it leaves to the driver, in
#: the learner's order: the rolled traces, or, where the driver rolls them over several calls at
#: once, their :class:`StepFactors`. The backward pass returns these as the sink's cotangent.
RollSink = Sequence[Union[RolledTrace, StepFactors]]


class SequenceRun(Protocol):
    """The loop that takes a sequence's gradient, ``(Σ_c ĝ_c, losses, aux, status)``.

    ``sequences`` are time-major, ``mask`` is ``(T,)`` and ``steps`` the steps' indices ``(T,)``
    in the whole stream; ``status`` is the non-finite status entering the loop (``None``:
    unchecked, or the first span of a checked run). ``losses`` are ``(T,)`` (plain) or
    ``(T // k, k)`` (windows of ``k`` steps); ``aux`` is stacked over calls.
    """

    def __call__(
        self, sequences: tuple[PyTree, ...], mask: jax.Array, steps: jax.Array, status: Status | None = None
    ) -> tuple[Grads, jax.Array, PyTree, Status | None]: ...


class SequenceRunType(Protocol):
    """How a host builds its :class:`SequenceRun`: a class such as
    :class:`~braintrace._algorithm.drive.grad_run.GradRun` (the sum of the per-call estimates)."""

    def __call__(
        self, call: str, step_fn: StepFn, weights: dict[Path, brainstate.ParamState], window: int | None,
        has_aux: bool, host: SequenceHost, guarded: list[brainstate.State] | None = None,
    ) -> SequenceRun: ...


class SequenceHost(Protocol):
    """The learner a driver drives, as the driver sees it.

    :class:`~braintrace.SequenceDriverMixin` gives every member a default but
    :attr:`_seq_param_states`, which the learner provides.

    Attributes
    ----------
    _seq_is_vmapped : bool
        Whether the host maps its calls over a batch axis (window mode is then refused).
    """

    _seq_is_vmapped: ClassVar[bool]

    @property
    def _seq_call(self) -> Callable[..., PyTree]:
        """The callable ``etrace_evolve`` drives when it is given no ``step_fn``."""

    @property
    def _seq_calls(self) -> int:
        """How many calls of the learner have been traced or run so far: a ``step_fn`` that leaves
        it unchanged never called the learner and is refused."""

    @property
    def _seq_param_states(self) -> Mapping[Path, brainstate.ParamState]:
        """The ``path -> ParamState`` mapping a driver differentiates by default."""

    @property
    def _seq_guarded(self) -> list[brainstate.State]:
        """The states ``check_finite=True`` freezes after a non-finite step."""

    @property
    def _seq_vjp_method(self) -> str | None:
        """``'single-step'``, ``'multi-step'`` or ``None``; window mode of ``etrace_grad`` needs
        ``'multi-step'``."""

    @property
    def _seq_batch_size(self) -> int | None:
        """The batch size the learner runs at, against which a sequence's layout is checked
        (``None``: unbatched, or unknown)."""

    @property
    def _seq_run_type(self) -> SequenceRunType:
        """The loop that takes a sequence's gradient: the sum of the learner's per-call estimates,
        or BPTT's gradient through the whole loop."""

    def _seq_after_gradient(self, grads: Grads) -> None:
        """Called with each call's gradient inside the traced step (a learner orders its trace
        writes after the gradient there)."""

    def _seq_calls_per_roll(self, calls: int) -> int:
        """How many of a loop's ``calls`` single-step calls leave their traces' roll to one
        :meth:`_seq_roll_calls` (``1``: each call rolls its own)."""

    def _seq_roll_sink(self, grouped: bool = False) -> RollSink | None:
        """Zeros shaped like what the next call's backward pass returns of its traces (``None``:
        none): the rolled traces, or (``grouped``) their :class:`StepFactors`."""

    def _seq_rolling_into(self, sink: RollSink | None) -> AbstractContextManager[None]:
        """Within this block, the learner's call rolls those traces into ``sink``'s cotangent."""

    def _seq_write_rolled(self, rolled: RollSink) -> None:
        """Write the traces rolled in the backward pass (``rolled``: the sink's cotangent)."""

    def _seq_roll_calls(self, factors: RollSink) -> Grads:
        """Roll the traces over a group of calls from their :class:`StepFactors` (each stacked
        over the calls); the gradients' history terms, keyed by every parameter's path."""

    def _seq_deferring_instant(self, checked: bool) -> AbstractContextManager[None]:
        """Around a driver's whole loop: the traces without history that the loop's calls keep
        as their factors are written once when it ends (``checked``: the run checks every step's
        values, and every call writes its traces)."""
