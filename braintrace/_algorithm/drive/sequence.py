"""Sequence drivers on every learner: :class:`SequenceDriverMixin` with ``etrace_grad``, ``etrace_evolve`` and ``etrace_train``.

A learner's call is one step (or one :class:`~braintrace.MultiStepData` window), and
``brainstate.transform.grad`` of a loss of its output is that call's online estimate. The drivers
own the time loop around that contract: they slice the sequences along their leading axis, call
a user ``step_fn`` once per step or window inside ``brainstate.transform.scan``, sum the per-call
estimates, weight the losses by a per-step ``mask`` and reduce. They own no numerics: whatever
the learner computes for one call, the driver adds up.

The drivers are functions of a learner (:mod:`braintrace._algorithm.drive`): they read it through
the ``_seq_*`` members of the :class:`~braintrace._algorithm.drive.host.SequenceHost` protocol.
:class:`SequenceDriverMixin` gives those members their defaults (those of
:class:`~braintrace.ETraceAlgorithm`) and makes the drivers the learner's methods.

Data are positional sequences (inputs, targets, modulators ...), sliced in lockstep.
``etrace_train`` runs the same loop and applies an optimizer every ``update_every`` steps while
the stream runs, without resetting anything: online learning in the strict sense.

Sequences are time-major, every leaf ``(T, batch, ...)``, or batch-major ``(batch, T, ...)``
with ``time_axis=1`` (transposed on entry; :mod:`braintrace._algorithm.drive.layout`).
``etrace_evolve``'s outputs come back in the declared layout; losses stay ``(T,)`` and the
auxiliaries of ``etrace_grad`` / ``etrace_train`` stay stacked over calls, time-major.

The drivers continue from the learner's current hidden states, traces and ``running_index``
and leave the final ones installed; nothing is reset. Failure is transactional: the loop body is
traced into a functional scan, which restores every state it touched when tracing fails and
writes the final values back only once the whole loop has run, so an exception raised by
``step_fn`` leaves the learner exactly as it was.

Non-finite values are not checked by default: a NaN or infinity in an input, loss, gradient or
trace propagates through every later step, the traces and the summed estimate, at no checking
cost. ``check_finite=True`` carries the first bad step and what went bad through the scan,
freezes every state update from that step on (:mod:`braintrace._algorithm.drive.finite`) and raises
:class:`~braintrace.NonFiniteError` after the loop, with the learner left at the last finite step.
"""
from __future__ import annotations

import contextlib
import threading
from typing import ClassVar, Iterator, Mapping, Protocol

import brainstate

from braintrace._algorithm.engine.call_lock import learner_lock
from braintrace._algorithm.drive import drivers, train
from braintrace._algorithm.drive.grad_run import GradRun
from braintrace._algorithm.drive.host import Grads, RollSink, SequenceRunType
from braintrace._algorithm.drive.train import TrainResult
from braintrace._errors import internal_error
from braintrace._typing import Path, PyTree

__all__ = ["SequenceDriverMixin", "TrainResult"]


class _Callable(Protocol):
    """A host called as the learner is: ``host(*inputs, **options)``."""

    def __call__(self, *args: PyTree, **options: object) -> PyTree: ...


class SequenceDriverMixin:
    """``etrace_grad``, ``etrace_evolve`` and ``etrace_train``: drive a learner over whole sequences.

    Every learner (:class:`~braintrace.ETraceAlgorithm`) and the vmapped learner
    (:class:`~braintrace.ETraceVmap`) has these methods. See :meth:`etrace_grad` for the contract
    of ``step_fn``: it must call **this** learner exactly once per step (or window).

    Called eagerly, a driver traces ``step_fn`` and compiles its loop at every call, as a program
    of its own that is freed with the call; inside ``jit`` the loop becomes part of the caller's
    program. A training loop of many calls runs fastest as one ``brainstate.transform.jit`` step,
    compiled once.

    The methods are the functions of :mod:`braintrace._algorithm.drive`, which take the learner
    first (``learner.etrace_grad(...)`` is ``etrace_grad(learner, ...)``) and read it through the
    ``_seq_*`` members of :class:`~braintrace._algorithm.drive.host.SequenceHost`. This class
    gives every member a default but ``_seq_param_states``, which the host provides
    (:class:`~braintrace.ETraceAlgorithm` also gives its ``batch_size``, a VJP learner its
    ``vjp_method``).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> isinstance(learner, braintrace.SequenceDriverMixin)
    True
    >>> learner.etrace_evolve(jnp.ones((5, 3)))  # five steps, no gradient
    >>> int(learner.running_index.value)
    5
    """

    #: Whether the host maps its calls over a batch axis (window mode is then refused).
    _seq_is_vmapped: ClassVar[bool] = False
    #: Calls of the learner so far, traced or run: a host counts them in its call (or overrides
    #: :attr:`_seq_calls`).
    calls_traced: int

    @property
    def lock(self) -> threading.RLock:
        """The learner's re-entrant lock, held by its calls, drivers and reset.

        Threads sharing a learner wait for each other's calls. A function *you* compile around
        the learner (``brainstate.transform.jit``) is not entered through the learner: called
        from two threads at once, the later write-back is refused
        (:class:`~braintrace.ConcurrentCallError`); hold this lock around such calls to run
        them one after another.

        Examples
        --------
        >>> import brainstate, jax.numpy as jnp, braintrace
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
        >>> step = brainstate.transform.jit(lambda x: learner(x))
        >>> with learner.lock:
        ...     _ = step(jnp.ones(3))
        >>> int(learner.running_index.value)
        1
        """
        return learner_lock(self)

    # --- the SequenceHost protocol, with its defaults ----------------------------------------

    @property
    def _seq_call(self: _Callable) -> _Callable:
        """The callable ``etrace_evolve`` drives when it is given no ``step_fn``: the host itself."""
        return self

    @property
    def _seq_calls(self) -> int:
        """How many calls of the learner have been traced or run so far."""
        return self.calls_traced

    @property
    def _seq_param_states(self) -> Mapping[Path, brainstate.ParamState]:
        """The ``path -> ParamState`` mapping ``etrace_grad`` differentiates by default: the host's."""
        raise NotImplementedError(
            f"{type(self).__name__} must provide _seq_param_states, the path -> ParamState mapping the "
            f"sequence drivers differentiate by default.")

    @property
    def _seq_guarded(self) -> list[brainstate.State]:
        """The states ``check_finite=True`` freezes after a non-finite step: all of the host's."""
        return list(brainstate.graph.states(self).values())

    @property
    def _seq_vjp_method(self) -> str | None:
        """The learner's ``vjp_method`` (default ``None``: it has none, and ``etrace_grad`` refuses windows)."""
        return None

    @property
    def _seq_batch_size(self) -> int | None:
        """The batch size the learner runs at (default ``None``: unbatched, or unknown)."""
        return None

    @property
    def _seq_run_type(self) -> SequenceRunType:
        """How a driver takes a sequence's gradient: by default, the sum of the learner's per-call estimates."""
        return GradRun

    def _seq_after_gradient(self, grads: Grads) -> None:
        """Called with the gradient of each call, inside the traced step (default: nothing)."""

    def _seq_calls_per_roll(self, calls: int) -> int:
        """How many calls leave their traces' roll to one :meth:`_seq_roll_calls` (default ``1``:
        each call rolls its own)."""
        return 1

    def _seq_roll_sink(self, grouped: bool = False) -> RollSink | None:
        """Zeros shaped like what the next call's backward pass returns of its traces (default:
        ``None``, none)."""
        return None

    @contextlib.contextmanager
    def _seq_rolling_into(self, sink: RollSink | None) -> Iterator[None]:
        """Within this block, the learner's call rolls those traces into ``sink``'s cotangent."""
        yield

    def _seq_write_rolled(self, rolled: RollSink) -> None:
        """Write the traces rolled in the backward pass (``rolled``: the sink's cotangent)."""

    def _seq_roll_calls(self, factors: RollSink) -> Grads:
        """Roll the traces over a group of calls (default: the learner groups none)."""
        raise internal_error(f"{type(self).__name__} was asked to roll traces over calls it does not group")

    def _seq_deferring_instant(self, checked: bool) -> contextlib.AbstractContextManager[None]:
        """Around a driver's whole loop (default: every call writes its traces)."""
        return contextlib.nullcontext()

    # --- the drivers: functions of the learner (braintrace._algorithm.drive), as its methods ---

    etrace_grad = drivers.etrace_grad
    etrace_evolve = drivers.etrace_evolve
    etrace_train = train.etrace_train
