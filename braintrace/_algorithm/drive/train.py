"""Online learning over a stream: :func:`etrace_train`, an optimizer applied while the sequences run.

One scan runs over the whole stream. It accumulates the learner's online estimate exactly as
:func:`~braintrace._algorithm.drive.drivers.etrace_grad` does and, every ``update_every`` steps,
hands the accumulated estimate to the optimizer, clears it and goes on, without resetting
anything. The optimizer is the one given, or the ``braintools`` wrapper the learner keeps for an
optax transformation (:mod:`braintrace._algorithm.drive.train_optimizer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, NamedTuple

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm.engine.call_lock import serialised
from braintrace._algorithm.drive.checks import (
    check_mask,
    check_reduction,
    check_update_every,
    checked_step_fn,
    checked_weights,
    guarded_states,
    validate,
)
from braintrace._algorithm.drive.drivers import divided, run_loop
from braintrace._algorithm.drive.host import SequenceHost, StepFn
from braintrace._algorithm.drive.finite import Status, StateGuard, advance, all_finite, raise_if_bad
from braintrace._algorithm.drive.train_optimizer import train_optimizer
from braintrace._typing import Path, PyTree

if TYPE_CHECKING:
    import braintools
    import optax

__all__ = ["TrainResult", "etrace_train"]


class TrainResult(NamedTuple):
    """What :meth:`~braintrace.SequenceDriverMixin.etrace_train` returns.

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
    aux: PyTree
    optimizer: braintools.optim.OptaxOptimizer


@serialised
def etrace_train(
    learner: SequenceHost,
    *sequences: PyTree,
    step_fn: StepFn,
    optimizer: braintools.optim.OptaxOptimizer | optax.GradientTransformation,
    update_every: int | None = None,
    mask: jax.typing.ArrayLike | None = None,
    chunk_size: int | None = None,
    weights: Mapping[Path, brainstate.ParamState] | None = None,
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
    check_reduction("etrace_train", reduction)
    drive = validate(learner, "etrace_train", sequences, chunk_size, needs_multi_step=True, time_axis=time_axis)
    mask = check_mask("etrace_train", mask, drive.length)
    weights = checked_weights(learner, "etrace_train", weights)
    span = check_update_every(update_every, drive)
    optimizer, keep_optimizer = train_optimizer(learner, optimizer, weights)
    guarded = guarded_states(learner, "etrace_train", check_finite, sequences, mask)
    run = learner._seq_run_type("etrace_train", checked_step_fn(learner, "etrace_train", step_fn), weights,
                                drive.window, has_aux, learner, guarded)
    optimizer_states = list(brainstate.graph.states(optimizer).values())
    Span = tuple[tuple[PyTree, ...], jax.Array, jax.Array]

    def train_span(status: Status | None, inputs: Span) -> tuple[Status | None, tuple[jax.Array, PyTree]]:
        seqs, span_mask, span_steps = inputs
        grads, losses, aux, status = run(seqs, span_mask, span_steps, status)
        if reduction == "mean":
            grads = divided(grads, jnp.maximum(jnp.sum(span_mask), 1.0))
        if status is None:
            optimizer.update(grads)
        else:
            guard = StateGuard(optimizer_states)
            optimizer.update(grads)
            status = advance(status, span_steps[-1], {"update": all_finite(guard.written())})
            guard.keep_if(status.fine)
        return status, (jnp.reshape(losses, (-1,)), aux)

    full, rest = divmod(drive.length, span)

    def train(
        sequences: tuple[PyTree, ...], mask: jax.Array, steps: jax.Array,
    ) -> tuple[Status | None, list[tuple[jax.Array, PyTree]]]:
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

    status, parts = run_loop(learner, guarded is not None, train, drive.sequences, mask,
                             jnp.arange(drive.length))
    keep_optimizer()  # the updates before a non-finite step were applied: their state goes on
    if status is not None:
        raise_if_bad("etrace_train", status)
    losses = jnp.concatenate([p[0] for p in parts])
    aux = jax.tree.map(lambda *a: jnp.concatenate(a), *[p[1] for p in parts]) if has_aux else None
    return TrainResult(losses, aux, optimizer)


def _steps(sequences: tuple[PyTree, ...], start: int, stop: int) -> tuple[PyTree, ...]:
    """Steps ``start:stop`` of every sequence."""
    return jax.tree.map(lambda a: a[start:stop], sequences)


def _merge_leading(a: jax.Array) -> jax.Array:
    """``(n, m, ...) -> (n * m, ...)``: calls stacked per span, then over spans."""
    return jnp.reshape(a, (-1, *np.shape(a)[2:]))
