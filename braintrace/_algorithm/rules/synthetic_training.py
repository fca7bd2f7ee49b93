"""``train_synthetic_gradient``: fit a DNI learner's synthesiser to bootstrapped future gradients.

The synthesiser ``M`` should predict, from a hidden state ``h^a`` entering a window, the gradient
of the loss from ``a`` on. One window ``[a, b)`` of the online learner gives a target for that:
the gradient of the window's loss with respect to its entry hidden state, which the DNI learner
returns with the synthetic exit gradient ``M(h^b)`` pushed back through the window,

``target = ∂(L_[a,b) + M(h^b) · h^b)/∂h^a``,

a *bootstrapped* target (exact in the window, ``M``'s own estimate beyond it). Every window takes
one regression step on ``Σ_groups mean((M(h^a) − target)²)``; after the last one, the terminal
state ``h^T`` is fitted to zero (nothing follows it). The model's parameters do not move.

Like any bootstrapped regression (temporal-difference learning), the fit can grow instead of
shrink when the recurrence expands gradients over a window or ``lr`` is large: watch the returned
errors and lower ``lr`` (or shorten ``chunk_size``) if they rise.

The fit is valid for the ``loss_fn`` and ``chunk_size`` it used: the learner then refuses windows
of another length (``SyntheticGradient.fitted_chunk_size``).

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> brainstate.random.seed(0)
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'dni', jnp.ones(3))
>>> learner.attach_synthesizer(braintrace.SyntheticGradient(learner.group_signal_shapes()))
>>> errors = braintrace.train_synthetic_gradient(learner, jnp.ones((6, 3)), chunk_size=2, epochs=3, lr=0.1)
>>> len(errors), errors[-1] < errors[0], learner.synthesizer.fitted_chunk_size
(3, True, 2)
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Callable

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._algorithm.rules.dni import DNI
from braintrace._algorithm.engine.input_data import MultiStepData
from braintrace._algorithm.rules.synthetic_gradient import SyntheticGradient
from braintrace._typing import Path, PyTree

if TYPE_CHECKING:
    import braintools

__all__ = ["train_synthetic_gradient"]

#: A key of the synthesiser's states (see :meth:`SyntheticGradient.states_dict`).
StateKey = tuple[str, int]
#: ``update(grads)``: one step on the synthesiser's states.
Update = Callable[[dict[StateKey, jax.Array]], None]

_CALL = "train_synthetic_gradient"


def _sum_of_squares(output: PyTree) -> jax.Array:
    """The default loss: ``Σ out²`` over every leaf of the output."""
    return jnp.sum(jnp.stack([jnp.sum(jnp.square(u.get_mantissa(leaf))) for leaf in jax.tree.leaves(output)]))


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_CALL}: {name} must be an int, got {value!r}.")
    if value < 1:
        raise ValueError(f"{_CALL}: {name} must be >= 1, got {value}.")
    return int(value)


def _synthesizer_of(learner: object) -> SyntheticGradient:
    """The synthesiser of a compiled DNI learner."""
    if not isinstance(learner, DNI):
        raise TypeError(f"{_CALL}: learner must be a braintrace.DNI learner, got {type(learner).__name__}.")
    learner._assert_compiled_for(_CALL)
    if learner.synthesizer is None:
        raise RuntimeError(
            f"{_CALL}: the learner has no synthesiser to train: attach one with learner.attach_synthesizer("
            f"braintrace.SyntheticGradient(learner.group_signal_shapes())) or pass synthesizer= to DNI.")
    return learner.synthesizer


def _windows(inputs: object, chunk_size: object) -> tuple[jax.Array, int]:
    """``inputs`` ``(T, ...)`` as ``(T // k, k, ...)`` windows, and ``k``."""
    if isinstance(inputs, (tuple, list, dict)) or not hasattr(inputs, "shape"):
        raise TypeError(f"{_CALL}: inputs must be one array (T, ...) with time on axis 0, got "
                        f"{type(inputs).__name__}.")
    seq = jnp.asarray(inputs)
    if seq.ndim < 1:
        raise ValueError(f"{_CALL}: inputs must have a leading time axis (T, ...), got a scalar.")
    chunk = _positive_int(chunk_size, "chunk_size")
    length = int(seq.shape[0])
    if length % chunk:
        raise ValueError(
            f"{_CALL}: the sequence has T={length} steps, which chunk_size={chunk} does not divide; "
            f"windows are never truncated. Pass a chunk_size that divides {length}, or trim the sequence.")
    return jnp.reshape(seq, (length // chunk, chunk, *seq.shape[1:])), chunk


def _sgd(states: dict[StateKey, brainstate.ParamState], lr: object) -> Update:
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not math.isfinite(float(lr)) or lr <= 0:
        raise ValueError(f"{_CALL}: lr must be a positive float, got {lr!r}.")

    def update(grads: dict[StateKey, jax.Array]) -> None:
        for key, state in states.items():
            state.value = state.value - lr * grads[key]

    return update


def _optimizer_update(optimizer: object, states: dict[StateKey, brainstate.ParamState]) -> Update:
    import braintools

    if not isinstance(optimizer, braintools.optim.OptaxOptimizer):
        raise TypeError(f"{_CALL}: optimizer must be a braintools.optim optimizer (SGD, Adam, ...), got "
                        f"{type(optimizer).__name__}.")
    if optimizer.opt_state is None:
        optimizer.register_trainable_weights(states)
    elif set(optimizer.param_states.to_pytree()) != set(states):
        raise ValueError(f"{_CALL}: the optimizer is registered on other weights than the synthesiser's "
                         f"states_dict(); pass a fresh optimizer (it is registered here).")
    update: Update = optimizer.update
    return update


def _group_values(learner: DNI, per_path: dict[Path, jax.Array]) -> dict[int, jax.Array]:
    """``{group index: (*varshape, S)}`` from per-hidden-path values."""
    return {g.index: g.concat_hidden([u.get_mantissa(per_path[p]) for p in g.hidden_paths])
            for g in learner.graph.hidden_groups}


def _regress(synth: SyntheticGradient, entry: dict[int, jax.Array], target: dict[int, jax.Array],
             update: Update) -> jax.Array:
    """One step on ``Σ_groups mean((M(entry) − target)²)``; returns the error before it."""
    states = synth.states_dict()

    def error() -> jax.Array:
        estimate = synth.apply(synth.param_values(), entry)
        return jnp.sum(jnp.stack([jnp.mean(jnp.square(estimate[i] - target[i])) for i in target]))

    grads, value = brainstate.transform.grad(error, states, return_value=True)()
    update(grads)
    return value


def _window_step(learner: DNI, synth: SyntheticGradient, loss_fn: Callable[[PyTree], jax.Array], chunk: int,
                 update: Update) -> Callable[[jax.Array], jax.Array]:
    """The loop body: run one window, take its bootstrapped target, regress on it."""

    def body(window: jax.Array) -> jax.Array:
        entry = _group_values(learner, {p: st.value for p, st in learner.hidden_states.items()})

        def online_loss() -> jax.Array:
            return loss_fn(learner(MultiStepData(window) if chunk > 1 else window[0]))

        per_path = brainstate.transform.grad(online_loss, learner.hidden_states)()
        target = jax.tree.map(jax.lax.stop_gradient, _group_values(learner, per_path))
        return _regress(synth, entry, target, update)

    return body


def train_synthetic_gradient(
    learner: DNI,
    inputs: jax.Array,
    *,
    chunk_size: int = 1,
    loss_fn: Callable[[PyTree], jax.Array] | None = None,
    optimizer: braintools.optim.OptaxOptimizer | None = None,
    lr: float = 1e-2,
    epochs: int = 1,
    reset: bool = True,
    batch_size: int | None = None,
) -> list[float]:
    """Fit ``learner``'s synthesiser to the bootstrapped future gradients of ``inputs`` (see the module docstring).

    Parameters
    ----------
    learner : DNI
        A compiled DNI learner with a synthesiser attached.
    inputs : array
        One sequence ``(T, ...)``, time on axis 0 (one step's input is ``inputs[t]``).
    chunk_size : int
        The window length ``k`` (dividing ``T``): ``1`` calls the learner on ``inputs[t]``, ``k > 1``
        on ``MultiStepData`` windows. Drive the learner at the same length afterwards.
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar`` of one call's output (default ``Σ out²``); the online loss
        the learner will be trained with.
    optimizer : braintools.optim optimizer, optional
        Registered here on the synthesiser's ``states_dict()``; default plain SGD with ``lr``.
    lr : float
        The SGD step (ignored with an ``optimizer``).
    epochs : int
        Passes over the sequence.
    reset : bool
        Re-initialise the model's states and the traces (``learner.reset``) before every epoch.
    batch_size : int, optional
        The batch size of that reset (default, the one the learner was compiled with, which the
        hidden states have).

    Returns
    -------
    list of float
        Per epoch, the mean regression error before each step (the windows and the terminal fit).
        The learner's hidden states and traces are left where the last epoch ended: reset them
        (``learner.reset()``) before a new sequence.

    Raises
    ------
    TypeError
        For a learner that is not DNI, inputs that are not one array, a non-int ``chunk_size`` or
        ``epochs``, or an optimizer that is not a ``braintools.optim`` one.
    ValueError
        For ``chunk_size < 1`` or one that does not divide ``T``, ``epochs < 1``, a non-positive ``lr``,
        or an uncompiled learner.
    RuntimeError
        When the learner has no synthesiser.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.DNI, jnp.ones(3),
    ...                              synthesizer=braintrace.SyntheticGradient({0: (4, 1)}))
    >>> params = {p: st.value for p, st in learner.param_states.items()}
    >>> errors = braintrace.train_synthetic_gradient(learner, jnp.ones((4, 3)), chunk_size=2, epochs=2)
    >>> len(errors), all(e > 0 for e in errors)
    (2, True)
    >>> all((params[p] is st.value) for p, st in learner.param_states.items())  # the model is untouched
    True
    >>> learner(braintrace.MultiStepData(jnp.ones((3, 3))))  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ValueError: DNI: the synthesiser was fitted at chunk_size=2, but this call is a window of 3 step(s) ...
    """
    synth = _synthesizer_of(learner)
    windows, chunk = _windows(inputs, chunk_size)
    epochs = _positive_int(epochs, "epochs")
    loss_fn = _sum_of_squares if loss_fn is None else loss_fn
    if not callable(loss_fn):
        raise TypeError(f"{_CALL}: loss_fn must be callable (output -> scalar), got {type(loss_fn).__name__}.")
    states = synth.states_dict()
    update = _sgd(states, lr) if optimizer is None else _optimizer_update(optimizer, states)
    body = _window_step(learner, synth, loss_fn, chunk, update)

    def epoch() -> jax.Array:
        errors = brainstate.transform.for_loop(body, windows)
        final = _group_values(learner, {p: st.value for p, st in learner.hidden_states.items()})
        terminal = _regress(synth, final, jax.tree.map(jnp.zeros_like, final), update)
        return jnp.mean(jnp.concatenate([errors, terminal[None]]))

    run = brainstate.transform.jit(epoch)
    previous = synth.fitted_chunk_size
    synth.fitted_chunk_size = chunk  # the windows below are driven at the length being fitted
    try:
        means = []
        for _ in range(epochs):
            if reset:
                learner.reset(batch_size)
            means.append(float(run()))
    except BaseException:
        synth.fitted_chunk_size = previous
        raise
    return means
