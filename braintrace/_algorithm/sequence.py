"""Sequence drivers: :class:`SequenceDriverMixin` with ``etrace_grad``, ``etrace_evolve`` and ``etrace_train``.

A learner's call is one step (or one :class:`~braintrace.MultiStepData` window), and
``brainstate.transform.grad`` of a loss of its output is that call's online estimate. The drivers
own the time loop around that contract: they slice the sequences along their leading axis, call
a user ``step_fn`` once per step or window inside ``brainstate.transform.scan``, sum the per-call
estimates, weight the losses by a per-step ``mask`` and reduce. They own no numerics: whatever
the learner computes for one call, the driver adds up.

Data are positional sequences (inputs, targets, modulators ...), sliced in lockstep. The host
class provides these hooks (defaults are those of :class:`~braintrace.ETraceAlgorithm`):

* ``_seq_call`` — the callable ``etrace_evolve`` drives when it has no ``step_fn``;
* ``_seq_calls`` — how many calls of the learner have been traced or run so far: a ``step_fn``
  that leaves it unchanged never called the learner and is refused;
* ``_seq_param_states`` — the ``path -> ParamState`` mapping differentiated by default;
* ``_seq_vjp_method`` — ``'single-step'``, ``'multi-step'`` or ``None``; window mode of
  ``etrace_grad`` requires ``'multi-step'``;
* ``_seq_is_vmapped`` (class flag) — a vmapped learner refuses window mode;
* ``_seq_batch_size`` — the batch size the learner runs at (``None``: unbatched), against which a
  sequence's layout is checked (:mod:`braintrace._algorithm.layout`);
* ``_seq_run_type`` — the loop that takes a sequence's gradient: the sum of the learner's
  per-call estimates (:class:`_GradRun`), or BPTT's gradient through the whole loop;
* ``_seq_after_gradient`` — called with each call's gradient inside the traced step (a learner
  orders its trace writes after the gradient there; default: nothing).
* ``_seq_roll_sink``, ``_seq_rolling_into``, ``_seq_write_rolled`` — a learner that rolls some
  traces in the backward pass of a step whose gradient the driver takes gives zeros shaped like
  them (the sink), is told which step's call receives it, and has the sink's cotangent, the
  rolled traces, written back (:mod:`braintrace._algorithm.backward_roll`; default: no sink).

``etrace_train`` runs the same loop and applies an optimizer every ``update_every`` steps while
the stream runs, without resetting anything: online learning in the strict sense.

Sequences are time-major, every leaf ``(T, batch, ...)``, or batch-major ``(batch, T, ...)``
with ``time_axis=1`` (transposed on entry; :mod:`braintrace._algorithm.layout`).
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
freezes every state update from that step on (:mod:`braintrace._algorithm.finite`) and raises
:class:`~braintrace.NonFiniteError` after the loop, with the learner left at the last finite step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Iterator, Mapping, NamedTuple

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm.call_lock import serialised
from braintrace._algorithm.finite import Status, StateGuard, advance, all_finite, raise_if_bad, refuse_traced
from braintrace._algorithm.input_data import ETraceInputData, MultiStepData
from braintrace._algorithm.layout import check_layout, checked_time_axis, in_declared_layout, time_major
from braintrace._algorithm.train_optimizer import train_optimizer
from braintrace._compatible_imports import Tracer
from braintrace._errors import internal_error
from braintrace._typing import Path

__all__ = ["SequenceDriverMixin", "TrainResult"]

#: ``path -> gradient`` keyed like the ``weights`` that were differentiated.
Grads = dict[Path, Any]
#: ``step_fn(*slices) -> loss`` (or ``(loss, aux)``): calls the learner once and scores its output.
StepFn = Callable[..., Any]

_REDUCTIONS = ("mean", "sum")
_LOSS_OUTPUTS = ("per_step", "masked", "scalar")


class TrainResult(NamedTuple):
    """What :meth:`SequenceDriverMixin.etrace_train` returns.

    Attributes
    ----------
    losses : array
        The raw per-step losses, ``(T,)``.
    aux : pytree or None
        ``step_fn``'s auxiliary outputs stacked over calls (``has_aux``), else ``None``.
    optimizer : braintools.optim.OptaxOptimizer
        The optimizer holding the training state (the one given, or the wrapper the learner
        keeps for an optax transformation): pass it back, or the same transformation, to
        continue with the same state.
    """

    losses: jax.Array
    aux: Any
    optimizer: Any


class _Drive(NamedTuple):
    """A validated request: ``T`` steps, driven in windows of ``window`` steps (``None``: plain), over
    ``sequences`` put time-major from the declared ``time_axis``."""

    length: int
    window: int | None
    sequences: tuple[Any, ...]
    time_axis: int


class SequenceDriverMixin:
    """``etrace_grad``, ``etrace_evolve`` and ``etrace_train``: drive a learner over whole sequences.

    Every learner (:class:`~braintrace.ETraceAlgorithm`) and the vmapped learner
    (:class:`~braintrace.ETraceVmap`) has these methods. See :meth:`etrace_grad` for the contract
    of ``step_fn``: it must call **this** learner exactly once per step (or window).

    Called eagerly, a driver traces ``step_fn`` and compiles its loop at every call, as a program
    of its own that is freed with the call; inside ``jit`` the loop becomes part of the caller's
    program. A training loop of many calls runs fastest as one ``brainstate.transform.jit`` step,
    compiled once.

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

    @property
    def _seq_call(self) -> Any:
        """The callable ``etrace_evolve`` drives when it is given no ``step_fn``."""
        return self

    @property
    def _seq_calls(self) -> int:
        """How many calls of the learner have been traced or run so far."""
        return int(getattr(self, "calls_traced"))  # the host class provides it

    @property
    def _seq_param_states(self) -> Mapping[Path, Any]:
        """The ``path -> ParamState`` mapping ``etrace_grad`` differentiates by default."""
        return getattr(self, "param_states")  # the host class provides it

    @property
    def _seq_guarded(self) -> list[Any]:
        """The states ``check_finite=True`` freezes after a non-finite step: all of the host's."""
        return list(brainstate.graph.states(self).values())

    @property
    def _seq_vjp_method(self) -> str | None:
        """The learner's ``vjp_method`` (``None`` when it has none)."""
        return getattr(self, "vjp_method", None)

    @property
    def _seq_batch_size(self) -> int | None:
        """The batch size the learner runs at (``None``: unbatched, or unknown)."""
        return getattr(self, "batch_size", None)

    @property
    def _seq_run_type(self) -> type[_GradRun]:
        """How a driver takes a sequence's gradient: by default, the sum of the learner's per-call estimates."""
        return _GradRun

    def _seq_after_gradient(self, grads: Grads) -> None:
        """Called with the gradient of each call, inside the traced step (default: nothing)."""

    def _seq_roll_sink(self) -> Any:
        """Zeros shaped like the traces the next call rolls in its backward pass (default: ``None``, none)."""
        return None

    @contextlib.contextmanager
    def _seq_rolling_into(self, sink: Any) -> Iterator[None]:
        """Within this block, the learner's call rolls those traces into ``sink``'s cotangent."""
        yield

    def _seq_write_rolled(self, rolled: Any) -> None:
        """Write the traces rolled in the backward pass (``rolled``: the sink's cotangent)."""

    # --- the drivers ------------------------------------------------------------------------

    @serialised
    def etrace_grad(
        self,
        *sequences: Any,
        step_fn: StepFn,
        mask: Any = None,
        chunk_size: int | None = None,
        weights: Mapping[Path, Any] | None = None,
        reduction: str = "mean",
        loss_output: str = "per_step",
        has_aux: bool = False,
        return_value: bool = False,
        check_finite: bool = False,
        time_axis: int = 0,
    ) -> Any:
        """The learner's online estimate of ``∇J`` for a masked sequence loss ``J``, summed over its calls.

        **step_fn must call this learner exactly once per invocation** (for a vmapped learner:
        the :class:`~braintrace.ETraceVmap` wrapper, never its ``.module``). Zero calls
        leave the traces behind for that step; two calls advance them twice. Either way the
        result is a plausible-looking, wrong estimate, and nothing can detect it. ``step_fn``
        is traced once inside ``brainstate.transform.scan`` (Python side effects happen once),
        must not mutate states the learner reads, and must not call the learner conditionally
        (weight the loss with ``mask`` instead).

        For each call ``c`` the learner's online estimate ``ĝ_c`` of the gradient of
        ``J_c = Σ_{t in call c} mask_t · loss_t`` is taken with ``brainstate.transform.grad``;
        the driver returns ``G = Σ_c ĝ_c``, divided once by ``max(Σ_t mask_t, 1)`` under
        ``reduction='mean'``. ``G`` is the rule's online estimate of ``∇J``: equal to it where
        the rule's trace is exact, an approximation otherwise. Parameters outside the
        eligibility-trace relations get the exact gradient within each call (a readout is exact,
        earlier calls are not reached).

        Each call's new traces are written after its gradient is taken: where the gradient
        reads the entering trace (a model whose output reads a hidden state's value before its
        update, such as the spike of the previous potential), XLA then updates the trace in
        place instead of copying it every step. A hand-written loop of ``grad`` calls over the
        learner does not get that ordering.

        Parameters
        ----------
        *sequences : pytree
            One or more pytrees whose leaves share the time length ``T`` (on axis 0, or on axis
            1 with ``time_axis=1``); they are sliced in lockstep and handed to ``step_fn``
            positionally, in this order. Pass bare arrays (wrap them in ``MultiStepData`` inside
            ``step_fn``); close over constants.
        step_fn : callable
            ``step_fn(*slices) -> loss`` (``(loss, aux)`` with ``has_aux``): calls the learner
            once and returns a scalar loss (plain mode) or one loss per step, shape ``(k,)``
            (window mode).
        mask : array, optional
            ``(T,)`` per-step loss weights (any real values; default all ones). The learner
            still runs at every step; only the loss is weighted.
        chunk_size : int, optional
            ``None`` or ``1``: one learner call per step, slices ``seq[t]``. ``k >= 2``: one call
            per window of ``k`` steps, slices ``seq[t:t+k]`` (requires
            ``vjp_method='multi-step'`` and ``T % k == 0``); ``step_fn`` then calls
            ``learner(braintrace.MultiStepData(x))``.
        weights : dict, optional
            ``path -> ParamState`` to differentiate (default: the learner's ``param_states``).
            A subset freezes the others.
        reduction : {'mean', 'sum'}
            ``'mean'`` divides by the total mask weight ``max(Σ mask, 1)``; ``'sum'`` does not.
        loss_output : {'per_step', 'masked', 'scalar'}
            With ``return_value``: the raw per-step losses ``(T,)``, the masked ones ``(T,)``,
            or the reduced objective ``()``.
        has_aux : bool
            ``step_fn`` returns ``(loss, aux)``; ``aux`` is stacked over calls.
        return_value : bool
            Also return the losses.
        check_finite : bool
            Stop at the first step whose input, loss, gradient or trace (any state the learner
            writes: hidden states, eligibility traces) is NaN or infinite. A scan cannot stop,
            so the remaining steps run but change nothing: the learner is left as it was after
            the last finite step, and :class:`~braintrace.NonFiniteError` (with ``.step`` and
            ``.what``) is raised after the loop. Needs concrete values: call the driver outside
            ``jax.jit``. The check adds a fixed cost per step (a finiteness reduction and a
            select of every state the step writes): measured on CPU with a 16-unit RNN,
            batch 1, a checked step took 27 µs against 8 µs unchecked, a share that shrinks
            as the model grows. Default ``False``: nothing is checked, a non-finite value
            propagates into every later trace and the result.
        time_axis : {0, 1}
            The layout of every sequence leaf: ``0``, time-major ``(T, batch, ...)``; ``1``,
            batch-major ``(batch, T, ...)``, transposed on entry (a batched learner only). A
            batched learner refuses a sequence that reads as the other layout (axis 0, not the
            other axis, is its batch size), naming the fix; when ``T`` equals the batch size,
            the declared axis decides.

        Returns
        -------
        grads, or (grads, losses), (grads, aux), (grads, losses, aux)
            ``grads`` is keyed like ``weights`` and carries each weight's unit; ``aux`` has a
            leading axis of ``T`` calls (plain) or ``T // k`` (window), whatever ``time_axis``.

        Raises
        ------
        TypeError
            For a non-integer ``chunk_size``, a non-bool ``check_finite``, a sequence holding
            ``SingleStepData`` or ``MultiStepData``, or a ``step_fn`` result that is not a pair
            under ``has_aux``.
        NonFiniteError
            With ``check_finite=True``, for a non-finite input, loss, gradient or trace.
        ValueError
            For a bad ``reduction`` / ``loss_output`` / ``chunk_size`` / ``time_axis`` value,
            missing, empty, scalar or ragged sequences, a sequence in the other layout than
            ``time_axis`` declares, window mode on a vmapped or single-step learner or with
            ``T % k != 0``, a ``mask`` not of shape ``(T,)``, or a loss of the wrong shape.

        Examples
        --------
        >>> import brainstate, jax.numpy as jnp, braintrace
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
        >>> xs, ys = jnp.ones((6, 3)), jnp.zeros((6, 4))
        >>> def step_fn(x, y):  # one call of this learner per step
        ...     return jnp.mean((learner(x) - y) ** 2)
        >>> grads, losses = learner.etrace_grad(xs, ys, step_fn=step_fn, return_value=True)
        >>> grads[('W', 'weight')]['weight'].shape, losses.shape, int(learner.running_index.value)
        ((7, 4), (6,), 6)

        Windows of two steps on a multi-step learner (one call, and one loss per step, a window):

        >>> windowed = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3),
        ...                               vjp_method='multi-step')
        >>> def window_fn(x, y):  # x: (2, 3), returns (2,)
        ...     return jnp.mean((windowed(braintrace.MultiStepData(x)) - y) ** 2, axis=-1)
        >>> grads = windowed.etrace_grad(xs, ys, step_fn=window_fn, chunk_size=2, reduction='sum')
        >>> int(windowed.running_index.value)  # three calls
        3

        Batch-major sequences ``(batch, T, ...)`` with ``time_axis=1``:

        >>> batched = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones((2, 3)),
        ...                              batch_size=2)
        >>> def batch_fn(x, y):  # x: (2, 3), one step of the batch
        ...     return jnp.mean((batched(x) - y) ** 2)
        >>> grads = batched.etrace_grad(jnp.ones((2, 6, 3)), jnp.zeros((2, 6, 4)), step_fn=batch_fn, time_axis=1)
        >>> batched.etrace_grad(jnp.ones((2, 6, 3)), jnp.zeros((2, 6, 4)), step_fn=batch_fn)
        Traceback (most recent call last):
        ...
        ValueError: etrace_grad: sequences[0] has shape (2, 6, 3): axis 0 is the batch size 2 and axis 1 is not, ...
        """
        _check_reduction("etrace_grad", reduction)
        if loss_output not in _LOSS_OUTPUTS:
            raise ValueError(
                f"etrace_grad: loss_output must be one of {_LOSS_OUTPUTS}, got {loss_output!r} "
                f"(raw per-step losses, mask-weighted losses, or the reduced objective)."
            )
        drive = self._seq_validate("etrace_grad", sequences, chunk_size, needs_multi_step=True, time_axis=time_axis)
        mask = _check_mask("etrace_grad", mask, drive.length)
        weights = self._seq_weights("etrace_grad", weights)
        guarded = self._seq_checked("etrace_grad", check_finite, sequences, mask)
        run = self._seq_run_type("etrace_grad", self._seq_stepper("etrace_grad", step_fn), weights, drive.window,
                                 has_aux, self, guarded)
        grads, losses, aux, status = self._seq_program(run, drive.sequences, mask, jnp.arange(drive.length))
        if status is not None:
            raise_if_bad("etrace_grad", status)
        denom = jnp.maximum(jnp.sum(mask), 1.0)
        if reduction == "mean":
            grads = _divided(grads, denom)
        losses = jnp.reshape(losses, (drive.length,))
        if loss_output == "masked":
            losses = mask * losses
        elif loss_output == "scalar":
            losses = jnp.sum(mask * losses)
            losses = losses / denom if reduction == "mean" else losses
        out: tuple[Any, ...] = (grads, losses) if return_value else (grads,)
        out = (*out, aux) if has_aux else out
        return out[0] if len(out) == 1 else out

    @serialised
    def etrace_evolve(
        self,
        *sequences: Any,
        step_fn: StepFn | None = None,
        chunk_size: int | None = None,
        return_outputs: bool = False,
        check_finite: bool = False,
        time_axis: int = 0,
    ) -> Any:
        """Advance hidden states and traces over sequences as :meth:`etrace_grad` would, without a gradient.

        Parameters
        ----------
        *sequences : pytree
            One or more pytrees whose leaves share the time length ``T`` (on axis 0, or on axis
            1 with ``time_axis=1``).
        step_fn : callable, optional
            ``step_fn(*slices)``, which must call **this** learner exactly once; its result is
            the per-call output. Default: the learner itself, ``learner(*slices)``, with each
            window slice wrapped in ``MultiStepData`` in window mode (a custom ``step_fn``
            wraps for itself).
        chunk_size : int, optional
            ``None`` or ``1``: one call per step; ``k >= 2``: one call per window of ``k`` steps
            (any ``vjp_method``; ``T % k == 0``).
        return_outputs : bool
            Return the per-call outputs stacked on a leading axis of ``T`` (plain) or
            ``T // k`` (window; each element the window's own ``(k, ...)`` output). Default:
            return ``None`` and stack nothing.
        check_finite : bool
            As in :meth:`etrace_grad`, for the inputs and the states the learner writes
            (there is no loss or gradient).
        time_axis : {0, 1}
            As in :meth:`etrace_grad`. With ``1`` the outputs that carry the batch come back
            batch-major: ``(batch, T, ...)``, or ``(batch, T // k, k, ...)`` for windows.

        Returns
        -------
        None or pytree

        Raises
        ------
        TypeError, ValueError
            For the argument errors of :meth:`etrace_grad` that concern ``chunk_size``,
            ``check_finite`` and the sequences.
        NonFiniteError
            With ``check_finite=True``, for a non-finite input or trace.

        Examples
        --------
        >>> import jax.numpy as jnp, braintrace
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
        >>> learner.etrace_evolve(jnp.ones((6, 3)), chunk_size=2, return_outputs=True).shape
        (3, 2, 4)
        >>> int(learner.running_index.value)  # one call per window
        3
        >>> batched = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones((2, 3)),
        ...                              batch_size=2)
        >>> batched.etrace_evolve(jnp.ones((2, 6, 3)), return_outputs=True, time_axis=1).shape  # (batch, T, 4)
        (2, 6, 4)
        """
        drive = self._seq_validate("etrace_evolve", sequences, chunk_size, needs_multi_step=False,
                                   time_axis=time_axis)
        if step_fn is not None:
            call = self._seq_stepper("etrace_evolve", step_fn)
        elif drive.window is None:
            call = self._seq_call
        else:
            learner = self._seq_call

            def call(*slices: Any) -> Any:
                return learner(*(MultiStepData(s) for s in slices))

        def body(*slices: Any) -> Any:
            out = call(*slices)
            return out if return_outputs else None

        guarded = self._seq_checked("etrace_evolve", check_finite, sequences)
        if guarded is None:
            outs = self._seq_program(lambda windows: brainstate.transform.for_loop(body, *windows),
                                     _windows(drive.sequences, drive.window))
            return self._seq_declared(drive, outs)

        def checked(status: Status, inputs: tuple[tuple[Any, ...], jax.Array]) -> tuple[Status, Any]:
            slices, step = inputs
            guard = StateGuard(guarded)
            out = body(*slices)
            status = advance(status, step, {"input": all_finite(slices), "trace": all_finite(guard.written())})
            guard.keep_if(status.fine)
            return status, out

        def loop(windows: Any, starts: jax.Array) -> tuple[Status, Any]:
            return brainstate.transform.scan(checked, Status.fresh(), (windows, starts))

        starts = jnp.arange(0, drive.length, drive.window or 1)
        status, outs = self._seq_program(loop, _windows(drive.sequences, drive.window), starts)
        raise_if_bad("etrace_evolve", status)
        return self._seq_declared(drive, outs)


    @serialised
    def etrace_train(
        self,
        *sequences: Any,
        step_fn: StepFn,
        optimizer: Any,
        update_every: int | None = None,
        mask: Any = None,
        chunk_size: int | None = None,
        weights: Mapping[Path, Any] | None = None,
        reduction: str = "mean",
        has_aux: bool = False,
        check_finite: bool = False,
        time_axis: int = 0,
    ) -> TrainResult:
        """Learn online while the sequences stream: apply the optimizer every ``update_every`` steps.

        One scan runs over the whole stream. It accumulates the learner's online estimate
        exactly as :meth:`etrace_grad` does (same ``step_fn`` contract: **one call of this
        learner per step or window**), and every ``update_every`` steps hands the accumulated
        estimate to ``optimizer`` (divided by the span's total mask weight ``max(Σ mask, 1)``
        under ``reduction='mean'``), clears it and goes on. Hidden states and traces are never
        reset: the weights move while the stream runs, as in a model fitted to one long
        recording or a controller that adapts while it acts. Steps left over after the last
        full span are applied once at the end.

        Once the weights move, a trace is the sensitivity of the hidden state to the weights
        *under the weights that were in force at each past step*, not under the current ones:
        the standard approximation of real-time recurrent learning, which vanishes as the step
        size goes to zero. ``update_every=None`` updates once, at the end, and then equals
        :meth:`etrace_grad` followed by one optimizer step; ``update_every=1`` with SGD equals
        the hand-written per-step loop (call, gradient, update).

        Parameters
        ----------
        *sequences : pytree
            As in :meth:`etrace_grad`: leaves with a common time length ``T`` (on axis 0, or on
            axis 1 with ``time_axis=1``).
        step_fn : callable
            ``step_fn(*slices) -> loss`` (``(loss, aux)`` with ``has_aux``): calls the learner
            once; a scalar loss (plain mode) or ``(k,)`` losses (window mode).
        optimizer : braintools.optim.OptaxOptimizer or optax.GradientTransformation
            A ``braintools.optim`` optimizer (``SGD``, ``Adam``, ...), registered on the
            weights here if it has no weights yet (else it must be registered on these very
            ``ParamState`` objects), or an optax transformation, which is wrapped in a
            ``braintools.optim.OptaxOptimizer`` that the learner keeps: the next call with the
            same transformation object goes on from the same state (a new object starts a new
            one, warned where the learner trained these weights with a stateful one). The
            state lives in ``brainstate`` states of the returned
            :attr:`TrainResult.optimizer`: pass that to :func:`braintrace.save_checkpoint` to
            save it. Inside ``jit`` the learner keeps no new wrapper (its states would die with
            the trace): a stateful transformation it keeps no state for starts afresh at every
            call of the compiled function, which is warned; make the optimizer outside ``jit``.
        update_every : int, optional
            Steps between updates (a multiple of ``chunk_size`` in window mode); ``None``: one
            update at the end of the stream.
        mask : array, optional
            ``(T,)`` per-step loss weights (default all ones).
        chunk_size : int, optional
            ``None``/``1``: one learner call per step; ``k >= 2``: one call per window of ``k``
            steps (multi-step learners, ``T % k == 0``).
        weights : dict, optional
            ``path -> ParamState`` to train (default: the learner's ``param_states``).
        reduction : {'mean', 'sum'}
            Whether each update divides the span's summed estimate by its total mask weight.
        has_aux : bool
            ``step_fn`` returns ``(loss, aux)``.
        check_finite : bool
            As in :meth:`etrace_grad`; besides, the weights and the optimizer's states are left
            at the last update applied before the first non-finite step (the span that holds it
            is not applied), and an update that makes a weight or an optimizer state non-finite
            is reported as ``what='update'`` at the span's last step and not applied.
        time_axis : {0, 1}
            As in :meth:`etrace_grad`: ``1`` for batch-major sequences ``(batch, T, ...)``.

        Returns
        -------
        TrainResult
            ``losses`` (the raw per-step losses, ``(T,)``), ``aux`` (stacked over calls, or
            ``None``) and ``optimizer`` (the optimizer that holds the training state).

        Raises
        ------
        TypeError
            For an ``optimizer`` of another type, a non-integer ``update_every``, and the
            argument errors of :meth:`etrace_grad`.
        ValueError
            For ``update_every < 1`` or not a multiple of ``chunk_size``, an optimizer
            registered on other weights (other paths, or another learner's ``ParamState``
            objects at the same paths), and the argument errors of :meth:`etrace_grad`.
        NonFiniteError
            With ``check_finite=True``, for a non-finite input, loss, gradient, trace or update.

        Examples
        --------
        >>> import braintools, jax.numpy as jnp, numpy as np, braintrace
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(2, 3), braintrace.D_RTRL, jnp.ones(2))
        >>> xs = jnp.asarray(np.random.default_rng(0).normal(size=(200, 2)), jnp.float32)
        >>> ys = jnp.tanh(xs[:, :1]) * jnp.ones((1, 3))
        >>> def step_fn(x, y):  # one call of this learner per step
        ...     return jnp.mean((learner(x) - y) ** 2)
        >>> result = learner.etrace_train(xs, ys, step_fn=step_fn, optimizer=braintools.optim.SGD(lr=0.1),
        ...                               update_every=1)
        >>> result.losses.shape, bool(result.losses[-50:].mean() < result.losses[:50].mean())
        ((200,), True)
        """
        _check_reduction("etrace_train", reduction)
        drive = self._seq_validate("etrace_train", sequences, chunk_size, needs_multi_step=True, time_axis=time_axis)
        mask = _check_mask("etrace_train", mask, drive.length)
        weights = self._seq_weights("etrace_train", weights)
        span = _check_update_every(update_every, drive)
        optimizer, keep_optimizer = train_optimizer(self, optimizer, weights)
        guarded = self._seq_checked("etrace_train", check_finite, sequences, mask)
        run = self._seq_run_type("etrace_train", self._seq_stepper("etrace_train", step_fn), weights, drive.window,
                                 has_aux, self, guarded)
        optimizer_states = list(brainstate.graph.states(optimizer).values())
        Span = tuple[tuple[Any, ...], jax.Array, jax.Array]

        def train_span(status: Status | None, inputs: Span) -> tuple[Status | None, tuple[jax.Array, Any]]:
            seqs, span_mask, span_steps = inputs
            grads, losses, aux, status = run(seqs, span_mask, span_steps, status)
            if reduction == "mean":
                grads = _divided(grads, jnp.maximum(jnp.sum(span_mask), 1.0))
            if status is None:
                optimizer.update(grads)
            else:
                guard = StateGuard(optimizer_states)
                optimizer.update(grads)
                status = advance(status, span_steps[-1], {"update": all_finite(guard.written())})
                guard.keep_if(status.fine)
            return status, (jnp.reshape(losses, (-1,)), aux)

        full, rest = divmod(drive.length, span)

        def train(sequences: tuple[Any, ...], mask: jax.Array, steps: jax.Array) -> tuple[Status | None, list[Any]]:
            status = None if guarded is None else Status.fresh()
            parts = []
            if full == 1:
                status, part = train_span(status, (_steps(sequences, 0, span), mask[:span], steps[:span]))
                parts.append(part)
            elif full > 1:
                spans = jax.tree.map(lambda a: jnp.reshape(a[: full * span], (full, span, *np.shape(a)[1:])),
                                     (sequences, mask, steps))
                status, (losses, aux) = brainstate.transform.scan(train_span, status, spans)
                parts.append((jnp.reshape(losses, (-1,)), jax.tree.map(_merge_leading, aux)))
            if rest:
                tail = (_steps(sequences, full * span, drive.length), mask[full * span:], steps[full * span:])
                status, part = train_span(status, tail)
                parts.append(part)
            return status, parts

        status, parts = self._seq_program(train, drive.sequences, mask, jnp.arange(drive.length))
        keep_optimizer()  # the updates before a non-finite step were applied: their state goes on
        if status is not None:
            raise_if_bad("etrace_train", status)
        losses = jnp.concatenate([p[0] for p in parts])
        aux = jax.tree.map(lambda *a: jnp.concatenate(a), *[p[1] for p in parts]) if has_aux else None
        return TrainResult(losses, aux, optimizer)

    # --- helpers ----------------------------------------------------------------------------

    def _seq_checked(self, call: str, check_finite: Any, *data: Any) -> list[Any] | None:
        """The states to freeze after a non-finite step under ``check_finite`` (``None``: unchecked)."""
        if not isinstance(check_finite, bool):
            raise TypeError(
                f"{call}: check_finite must be True or False, got {check_finite!r} of type "
                f"{type(check_finite).__name__}."
            )
        if not check_finite:
            return None
        guarded = self._seq_guarded
        refuse_traced(call, *data, [st.value for st in guarded])
        return guarded

    def _seq_program(self, loop: Callable[..., Any], *args: Any) -> Any:
        """``loop(*args)``: on traced data, part of the caller's program; on concrete data,
        compiled as one program of its own, released with it (inside a ``jit`` that closes over
        concrete data, a nested one, which XLA inlines).

        JAX's eager dispatch would compile the loop too, but keeps every program it compiles for
        the process's lifetime, keyed by a jaxpr that is new at every call: a few hundred eager
        driver calls would then exhaust the process's memory mappings (each call still traces
        and compiles its loop once, as before).
        """
        if any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(args)):
            return loop(*args)
        return brainstate.transform.jit(loop)(*args)

    def _seq_stepper(self, call: str, step_fn: StepFn) -> StepFn:
        """``step_fn`` (refused unless callable), refused at each traced call that does not call this
        learner exactly once.

        A ``step_fn`` that never calls the learner would leave every estimate zero (or fail
        with a message about states missing from a trace); the learner counts its calls as they
        are traced, so a ``step_fn`` that made none is caught while tracing, without reading any
        state (a read would change the traced program).
        """
        if not callable(step_fn):
            raise TypeError(
                f"{call}: step_fn must be a function step_fn(*slices) that calls this learner once and "
                f"returns what the driver needs (the loss), got {step_fn!r} of type {type(step_fn).__name__}; "
                f"e.g. step_fn=lambda x, y: jnp.mean((learner(x) - y) ** 2)."
            )
        def stepped(*slices: Any) -> Any:
            before = self._seq_calls
            result = step_fn(*slices)
            calls = self._seq_calls - before
            if calls == 0:
                raise ValueError(
                    f"{call}: step_fn did not call this learner, so its step never ran. Call the learner "
                    f"on the step's inputs inside step_fn, once, e.g. "
                    f"step_fn=lambda x, y: jnp.mean((learner(x) - y) ** 2)."
                )
            if calls > 1:
                raise ValueError(
                    f"{call}: step_fn called this learner {calls} times in one step. Each call advances the "
                    f"hidden states and traces by a step, so the driver's per-step gradient would be wrong. "
                    f"Call the learner once per step and reuse its output, e.g. "
                    f"out = learner(x); loss = loss_a(out, y) + loss_b(out)."
                )
            return result

        return stepped

    def _seq_weights(self, call: str, weights: Mapping[Path, Any] | None) -> dict[Path, Any]:
        """The ``path -> ParamState`` mapping to differentiate (default: the learner's parameters)."""
        weights = self._seq_param_states if weights is None else weights
        if not isinstance(weights, Mapping):
            raise TypeError(
                f"{call}: weights must be a mapping path -> ParamState (like learner.param_states), "
                f"got {type(weights).__name__}."
            )
        return dict(weights)

    def _seq_validate(
        self, call: str, sequences: tuple[Any, ...], chunk_size: Any, needs_multi_step: bool,
        time_axis: Any = 0, any_batch: bool = False,
    ) -> _Drive:
        """Checks every argument before tracing (rows 3-13 of the driver contract, in order, with
        ``time_axis`` after ``chunk_size`` and the layout before the lengths), and puts the
        sequences time-major.

        The layout is checked against the learner's batch size, unless the call runs at the batch
        size of the sequences (``any_batch``: ``predict``).
        """
        if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)):
            raise TypeError(
                f"{call}: chunk_size must be None or a Python int >= 1, got {chunk_size!r} of type "
                f"{type(chunk_size).__name__}. Pass a plain int (int(k) converts a NumPy or JAX integer)."
            )
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(
                f"{call}: chunk_size must be >= 1, got {chunk_size}. Use None (or 1) for one learner "
                f"call per step, or k >= 2 for one call per window of k steps."
            )
        time_axis = checked_time_axis(call, time_axis)
        batch_size = None if any_batch else self._seq_batch_size
        if time_axis == 1 and batch_size is None and not any_batch:
            raise ValueError(
                f"{call}: time_axis=1 declares batch-major sequences (batch, time, ...), but this learner "
                f"is unbatched (compiled without batch_size), so its sequences have no batch axis. Pass "
                f"them time-major, (time, ...), with time_axis=0, or compile with batch_size=B."
            )
        window = chunk_size if chunk_size is not None and chunk_size >= 2 else None
        length = _check_sequences(call, sequences, time_axis, batch_size)
        sequences = time_major(sequences, time_axis)
        if window is not None and self._seq_is_vmapped:
            raise ValueError(
                f"{call}: window mode (chunk_size={window}) is refused on a vmapped learner "
                f"(braintrace.ETraceVmap): the vmap maps axis 0 of every input, which in a window "
                f"slice (k, batch, ...) is time. Use chunk_size=None to drive it one step per call, "
                f"or compile the batched learner (vmap=False, batch_size=B) for window mode."
            )
        if window is not None and needs_multi_step and self._seq_vjp_method != "multi-step":
            raise ValueError(
                f"{call}: window mode (chunk_size={window}) needs a multi-step learner, but this "
                f"learner's vjp_method is {self._seq_vjp_method!r}. Build it with "
                f"braintrace.compile(..., vjp_method='multi-step'), or use chunk_size=None. "
                f"(etrace_evolve drives any learner in window mode.)"
            )
        if window is not None and length % window != 0:
            trimmed = length - length % window
            advice = f"Trim the sequences to {trimmed} steps, or choose" if trimmed else "Choose"
            raise ValueError(
                f"{call}: chunk_size={window} does not divide the sequence length {length} (T must be "
                f"a multiple of chunk_size; a ragged tail is never truncated). {advice} a chunk_size "
                f"that divides {length}."
            )
        return _Drive(length, window, sequences, time_axis)

    def _seq_declared(self, drive: _Drive, outputs: Any) -> Any:
        """Per-call outputs stacked time-major, in the layout ``drive`` declared."""
        return in_declared_layout(outputs, drive.time_axis, self._seq_batch_size, 1 if drive.window is None else 2)


class _GradRun:
    """The scan of :meth:`SequenceDriverMixin.etrace_grad`: ``(Σ_c ĝ_c, losses, aux)``."""

    def __init__(
        self, call: str, step_fn: StepFn, weights: dict[Path, Any], window: int | None, has_aux: bool,
        host: SequenceDriverMixin, guarded: list[Any] | None = None,
    ) -> None:
        self.call = call
        self.step_fn = step_fn
        self.weights = weights
        self.window = window
        self.has_aux = has_aux
        self.host = host
        self.guarded = guarded  # check_finite: the states frozen after a non-finite step

    def __call__(
        self, sequences: tuple[Any, ...], mask: jax.Array, steps: jax.Array, status: Status | None = None
    ) -> tuple[Grads, jax.Array, Any, Status | None]:
        """The summed estimate, losses and aux; and the status, checked from ``status`` on."""
        xs = _windows(sequences, self.window)
        mask_rows = mask if self.window is None else mask.reshape((-1, self.window))
        zeros = {path: _zeros_like(st.value) for path, st in self.weights.items()}
        if self.guarded is None:
            grads, (losses, aux) = brainstate.transform.scan(self._body, zeros, (xs, mask_rows))
            return grads, losses, aux, None
        starts = steps if self.window is None else steps[:: self.window]
        carry = (zeros, Status.fresh() if status is None else status)
        (grads, status), (losses, aux) = brainstate.transform.scan(self._checked_body, carry, (xs, mask_rows, starts))
        return grads, losses, aux, status

    def _grad(self, slices: tuple[Any, ...], w: jax.Array) -> tuple[Grads, tuple[Any, Any]]:
        def objective(*sink: Any) -> tuple[Any, tuple[Any, Any]]:
            with self.host._seq_rolling_into(sink[0] if sink else None):
                loss, aux = self._loss(self.step_fn(*slices))
            return u.math.sum(w * loss), (loss, aux)

        sink = None if self.window is not None else self.host._seq_roll_sink()
        if sink is None:
            grads, loss_aux = brainstate.transform.grad(objective, self.weights, has_aux=True)()
        else:
            (grads, (rolled,)), loss_aux = brainstate.transform.grad(
                objective, self.weights, argnums=(0,), has_aux=True)(sink)
            self.host._seq_write_rolled(rolled)
        self.host._seq_after_gradient(grads)
        return grads, loss_aux

    def _body(self, acc: Grads, inputs: tuple[tuple[Any, ...], jax.Array]) -> tuple[Grads, Any]:
        g, loss_aux = self._grad(*inputs)
        return jax.tree.map(lambda a, b: a + b, acc, g), loss_aux

    def _checked_body(
        self, carry: tuple[Grads, Status], inputs: tuple[tuple[Any, ...], jax.Array, jax.Array]
    ) -> tuple[tuple[Grads, Status], Any]:
        """:meth:`_body`, with every update discarded from the first non-finite step on."""
        (acc, status), (slices, w, step) = carry, inputs
        guard = StateGuard(self.guarded or ())
        entering = [st.value for st in self.weights.values()]
        g, (loss, aux) = self._grad(slices, w)
        checks = {**self._step_checks(slices, w, entering, loss, guard), "gradient": all_finite(g)}
        status = advance(status, step, checks)
        guard.keep_if(status.fine)
        acc = jax.tree.map(lambda a, b: jnp.where(status.fine, a + b, a), acc, g)
        return (acc, status), (loss, aux)

    @staticmethod
    def _step_checks(
        slices: tuple[Any, ...], w: jax.Array, entering: list[Any], loss: Any, guard: StateGuard
    ) -> dict[str, jax.Array]:
        """What ``check_finite`` checks at a step, its gradient aside (``what -> all finite``)."""
        # The first sequence is the input; the others (targets, modulators) are named targets.
        return {"input": all_finite(slices[:1]), "target": all_finite(slices[1:]), "mask": all_finite(w),
                "weight": all_finite(entering), "loss": all_finite(loss), "trace": all_finite(guard.written())}

    def _loss(self, result: Any) -> tuple[Any, Any]:
        """``(loss, aux)`` of one ``step_fn`` result, with the loss's shape checked."""
        if self.has_aux:
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise TypeError(
                    f"{self.call}: has_aux=True, so step_fn must return a pair (loss, aux), got "
                    f"{_describe(result)}. Return (loss, aux), or pass has_aux=False."
                )
            loss, aux = result
        else:
            loss, aux = result, None
        shape = tuple(np.shape(loss))
        if self.window is None and shape != ():
            raise ValueError(
                f"{self.call}: with chunk_size None or 1, step_fn must return a scalar loss, got shape "
                f"{shape}. Reduce it inside step_fn (e.g. jnp.mean), or weight steps with mask."
            )
        if self.window is not None and shape != (self.window,):
            raise ValueError(
                f"{self.call}: in window mode step_fn must return one loss per step of the window: "
                f"expected shape (k,) = ({self.window},), got shape {shape}. Reduce every axis but "
                f"the window's time axis (e.g. jnp.mean(..., axis=-1)); spread a window-level "
                f"objective v as jnp.broadcast_to(v / k, (k,))."
            )
        return loss, aux


# --- argument checks --------------------------------------------------------------------------


def _is_marker(x: Any) -> bool:
    return isinstance(x, ETraceInputData)


def _check_sequences(call: str, sequences: tuple[Any, ...], time_axis: int = 0, batch_size: int | None = None) -> int:
    """The common length ``T`` of every leaf of every sequence along ``time_axis`` (rows 5-10), each
    leaf's layout checked against ``batch_size`` where it is known (:func:`check_layout`)."""
    if not sequences:
        raise ValueError(
            f"{call}: no sequences given. Pass one or more sequences with a leading time axis, "
            f"e.g. learner.{call}(xs, ys, step_fn=...)."
        )
    for i, seq in enumerate(sequences):
        marker = next((m for m in jax.tree.leaves(seq, is_leaf=_is_marker) if _is_marker(m)), None)
        if marker is not None:
            raise TypeError(
                f"{call}: sequence {i} is or contains a {type(marker).__name__}; the driver slices bare "
                f"arrays. Pass the arrays and wrap inside step_fn, e.g. "
                f"learner(braintrace.MultiStepData(x))."
            )
    reference: tuple[str, int] | None = None
    for i, seq in enumerate(sequences):
        leaves = jax.tree_util.tree_flatten_with_path(seq)[0]
        if not leaves:
            raise ValueError(
                f"{call}: sequence {i} is an empty pytree ({seq!r}); every sequence needs at least one "
                f"array with a leading time axis. Drop it, or close over it in step_fn."
            )
        for keypath, leaf in leaves:
            where = f"sequences[{i}]{jax.tree_util.keystr(keypath)}"
            if np.ndim(leaf) == 0:
                raise ValueError(
                    f"{call}: {where} is a scalar ({leaf!r}) with no time axis to slice. Close over "
                    f"constants in step_fn instead of passing them as sequences."
                )
            check_layout(call, where, tuple(np.shape(leaf)), time_axis, batch_size)
            n = int(np.shape(leaf)[time_axis])
            if reference is None:
                reference = (where, n)
            elif n != reference[1]:
                raise ValueError(
                    f"{call}: every leaf must have the same {'leading ' if time_axis == 0 else ''}(time) "
                    f"length, but {reference[0]} has length {reference[1]} and {where} has length {n}."
                )
    if reference is None:
        raise internal_error("non-empty sequences without leaves")
    if reference[1] == 0:
        raise ValueError(f"{call}: the sequences are empty (length 0 along the time axis); give at least one step.")
    return reference[1]


def _check_reduction(call: str, reduction: Any) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"{call}: reduction must be one of {_REDUCTIONS}, got {reduction!r}. Use 'mean' "
            f"to divide by the total mask weight or 'sum' to add the steps' contributions."
        )


def _check_update_every(update_every: Any, drive: _Drive) -> int:
    """The steps between optimizer updates (the whole stream for ``None``)."""
    if update_every is None:
        return drive.length
    if not isinstance(update_every, int) or isinstance(update_every, bool):
        raise TypeError(
            f"etrace_train: update_every must be None or a Python int >= 1, got {update_every!r} of "
            f"type {type(update_every).__name__}."
        )
    if update_every < 1:
        raise ValueError(
            f"etrace_train: update_every must be >= 1 step, got {update_every}. Use None to update "
            f"once, at the end of the stream."
        )
    if drive.window is not None and update_every % drive.window:
        raise ValueError(
            f"etrace_train: update_every={update_every} is not a multiple of chunk_size={drive.window}; "
            f"updates happen between windows. Use a multiple of {drive.window}."
        )
    return update_every


def _check_mask(call: str, mask: Any, length: int) -> jax.Array:
    """The ``(T,)`` floating mask (all ones by default)."""
    if mask is None:
        return jnp.ones((length,), jnp.float32)
    shape = tuple(np.shape(mask))
    if shape != (length,):
        raise ValueError(
            f"{call}: mask must have shape (T,) = ({length},), one loss weight per step, got "
            f"shape {shape}."
        )
    dtype = np.dtype(mask.dtype) if hasattr(mask, "dtype") else np.asarray(mask).dtype
    if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer) or dtype == np.bool_):
        raise TypeError(
            f"{call}: mask must hold real numbers (per-step loss weights; bool, int or float), got "
            f"dtype {dtype}. Pass e.g. jnp.asarray(mask, jnp.float32)."
        )
    mask = jnp.asarray(mask)
    return mask if jnp.issubdtype(mask.dtype, jnp.floating) else mask.astype(jnp.float32)


# --- loop plumbing ----------------------------------------------------------------------------


def _windows(sequences: tuple[Any, ...], window: int | None) -> tuple[Any, ...]:
    """The sequences, every leaf reshaped ``(T, ...) -> (T // k, k, ...)`` in window mode."""
    if window is None:
        return sequences
    return jax.tree.map(lambda a: jnp.reshape(a, (-1, window, *np.shape(a)[1:])), sequences)


def _steps(sequences: tuple[Any, ...], start: int, stop: int) -> tuple[Any, ...]:
    """Steps ``start:stop`` of every sequence."""
    return jax.tree.map(lambda a: a[start:stop], sequences)


def _merge_leading(a: jax.Array) -> jax.Array:
    """``(n, m, ...) -> (n * m, ...)``: calls stacked per span, then over spans."""
    return jnp.reshape(a, (-1, *np.shape(a)[2:]))


def _divided(grads: Grads, denom: jax.Array) -> Grads:
    return jax.tree.map(lambda g: g / denom.astype(g.dtype), grads)


def _zeros_like(value: Any) -> Any:
    """Zeros shaped, typed and (for a ``brainunit`` quantity) unit-carrying like ``value``."""
    return jax.tree.map(u.math.zeros_like, value, is_leaf=lambda x: isinstance(x, u.Quantity))


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    shape = getattr(value, "shape", None)
    return type(value).__name__ if shape is None else f"{type(value).__name__} of shape {tuple(shape)}"
