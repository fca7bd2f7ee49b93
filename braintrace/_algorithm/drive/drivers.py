"""The sequence drivers as functions of a learner: :func:`etrace_grad` and :func:`etrace_evolve`.

A learner's call is one step (or one :class:`~braintrace.MultiStepData` window), and
``brainstate.transform.grad`` of a loss of its output is that call's online estimate. The drivers
own the time loop around that contract: they slice the sequences along their leading axis, call
a user ``step_fn`` once per step or window inside ``brainstate.transform.scan``, sum the per-call
estimates (:class:`~braintrace._algorithm.drive.grad_run.GradRun`), weight the losses by a
per-step ``mask`` and reduce. They own no numerics: whatever the learner computes for one call,
the driver adds up (:func:`~braintrace._algorithm.drive.train.etrace_train` runs the same loop
with an optimizer applied while it runs). Each takes the learner first and reads it through the
:class:`~braintrace._algorithm.drive.host.SequenceHost` protocol;
:class:`~braintrace.SequenceDriverMixin` makes them every learner's methods
(``learner.etrace_grad(...)`` is ``etrace_grad(learner, ...)``), and each holds the learner's
lock (:func:`~braintrace._algorithm.engine.call_lock.serialised`) for its whole run.

Every argument is checked before tracing (:mod:`braintrace._algorithm.drive.checks`). Failure
is transactional: the loop body is traced into a functional scan, which restores every state it
touched when tracing fails and writes the final values back only once the whole loop has run, so
an exception raised by ``step_fn`` leaves the learner exactly as it was.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, TypeVar

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.call_lock import serialised
from braintrace._algorithm.drive.checks import (
    Drive,
    check_loss_output,
    check_mask,
    check_reduction,
    checked_step_fn,
    checked_weights,
    guarded_states,
    validate,
)
from braintrace._algorithm.drive.grad_run import windows
from braintrace._algorithm.drive.host import Grads, SequenceHost, StepFn
from braintrace._algorithm.drive.finite import Status, StateGuard, advance, all_finite, raise_if_bad
from braintrace._algorithm.engine.input_data import MultiStepData
from braintrace._algorithm.drive.layout import in_declared_layout
from braintrace._compatible_imports import Tracer
from braintrace._typing import Path, PyTree

__all__ = ["etrace_grad", "etrace_evolve", "run_program", "divided"]

#: What a driver's loop returns.
Result = TypeVar("Result")


@serialised
def etrace_grad(
    learner: SequenceHost,
    *sequences: PyTree,
    step_fn: StepFn,
    mask: jax.typing.ArrayLike | None = None,
    chunk_size: int | None = None,
    weights: Mapping[Path, brainstate.ParamState] | None = None,
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
    check_reduction("etrace_grad", reduction)
    check_loss_output("etrace_grad", loss_output)
    drive = validate(learner, "etrace_grad", sequences, chunk_size, needs_multi_step=True, time_axis=time_axis)
    mask = check_mask("etrace_grad", mask, drive.length)
    weights = checked_weights(learner, "etrace_grad", weights)
    guarded = guarded_states(learner, "etrace_grad", check_finite, sequences, mask)
    run = learner._seq_run_type("etrace_grad", checked_step_fn(learner, "etrace_grad", step_fn), weights,
                                drive.window, has_aux, learner, guarded)
    grads, losses, aux, status = run_loop(learner, guarded is not None, run, drive.sequences, mask,
                                          jnp.arange(drive.length))
    if status is not None:
        raise_if_bad("etrace_grad", status)
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    if reduction == "mean":
        grads = divided(grads, denom)
    losses = jnp.reshape(losses, (drive.length,))
    if loss_output == "masked":
        losses = mask * losses
    elif loss_output == "scalar":
        losses = jnp.sum(mask * losses)
        losses = losses / denom if reduction == "mean" else losses
    out: tuple[PyTree, ...] = (grads, losses) if return_value else (grads,)
    out = (*out, aux) if has_aux else out
    return out[0] if len(out) == 1 else out


@serialised
def etrace_evolve(
    learner: SequenceHost,
    *sequences: PyTree,
    step_fn: StepFn | None = None,
    chunk_size: int | None = None,
    return_outputs: bool = False,
    check_finite: bool = False,
    time_axis: int = 0,
) -> PyTree:
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
    drive = validate(learner, "etrace_evolve", sequences, chunk_size, needs_multi_step=False, time_axis=time_axis)
    if step_fn is not None:
        call = checked_step_fn(learner, "etrace_evolve", step_fn)
    elif drive.window is None:
        call = learner._seq_call
    else:
        learner_call = learner._seq_call

        def call(*slices: PyTree) -> PyTree:
            return learner_call(*(MultiStepData(s) for s in slices))

    def body(*slices: PyTree) -> PyTree:
        out = call(*slices)
        return out if return_outputs else None

    guarded = guarded_states(learner, "etrace_evolve", check_finite, sequences)
    if guarded is None:
        outs = run_loop(learner, False, lambda calls: brainstate.transform.for_loop(body, *calls),
                        windows(drive.sequences, drive.window))
        return _declared(learner, drive, outs)

    def checked(status: Status, inputs: tuple[tuple[PyTree, ...], jax.Array]) -> tuple[Status, PyTree]:
        slices, step = inputs
        guard = StateGuard(guarded)
        out = body(*slices)
        status = advance(status, step, {"input": all_finite(slices), "trace": all_finite(guard.written())})
        guard.keep_if(status.fine)
        return status, out

    def loop(calls: tuple[PyTree, ...], starts: jax.Array) -> tuple[Status, PyTree]:
        return brainstate.transform.scan(checked, Status.fresh(), (calls, starts))

    starts = jnp.arange(0, drive.length, drive.window or 1)
    status, outs = run_program(loop, windows(drive.sequences, drive.window), starts)
    raise_if_bad("etrace_evolve", status)
    return _declared(learner, drive, outs)


# --- loop plumbing ----------------------------------------------------------------------------


def run_program(loop: Callable[..., Result], *args: PyTree) -> Result:
    """``loop(*args)``: on traced data, part of the caller's program; on concrete data,
    compiled as one program of its own, released with it (inside a ``jit`` that closes over
    concrete data, a nested one, which XLA inlines).

    JAX's eager dispatch would compile the loop too, but keeps every program it compiles for
    the process's lifetime, keyed by a jaxpr that is new at every call: a few hundred eager
    driver calls would then exhaust the process's memory mappings (each call still traces
    and compiles its loop once, as before).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> run_program(lambda xs: xs.sum(), jnp.ones(3))
    Array(3., dtype=float32)
    """
    if any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(args)):
        return loop(*args)
    return brainstate.transform.jit(loop)(*args)


def run_loop(learner: SequenceHost, checked: bool, loop: Callable[..., Result], *args: PyTree) -> Result:
    """:func:`run_program` of a driver's ``loop`` over ``learner``'s calls, whose traces without
    history are written once, when the loop ends (unless ``checked``: the run checks every
    step's values; ``braintrace._algorithm.carriers.instant_traces``)."""

    def written_once(*loop_args: PyTree) -> Result:
        with learner._seq_deferring_instant(checked):
            return loop(*loop_args)

    return run_program(written_once, *args)


def _declared(learner: SequenceHost, drive: Drive, outputs: PyTree) -> PyTree:
    """Per-call outputs stacked time-major, in the layout ``drive`` declared."""
    return in_declared_layout(outputs, drive.time_axis, learner._seq_batch_size, 1 if drive.window is None else 2)


def divided(grads: Grads, denom: jax.Array) -> Grads:
    """Every gradient leaf divided by ``denom`` (the total mask weight of ``reduction='mean'``)."""
    return jax.tree.map(lambda g: g / denom.astype(g.dtype), grads)
