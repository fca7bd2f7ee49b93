"""The optimizer ``etrace_train`` applies: checked against the weights it trains, its state kept.

``etrace_train(..., optimizer=...)`` takes a ``braintools.optim`` optimizer or an optax
transformation (:func:`train_optimizer`).

A ``braintools.optim`` optimizer without weights is registered on the weights to train. One that
has weights must hold exactly these ``ParamState`` objects: two learners compiled from two
instances of one model class have the same weight paths but states of their own, and an optimizer
registered on the other learner's would update that learner's weights, not these. It is refused.

An optax transformation is a pair of pure functions with no state of its own; ``etrace_train``
wraps it in a ``braintools.optim.OptaxOptimizer`` that holds the state (Adam's count and
moments). The learner keeps that wrapper, for this transformation object and these weights, once
a call has run through, so that the next call with the same transformation object goes on from
the same state; a failed call writes no state and keeps no new wrapper. A new
transformation object starts a new state: where a stateful one replaces a stateful one that
trained the same weights, that is warned, as a transformation built inside a loop
(``optimizer=optax.adam(1e-3)`` at every call) restarts Adam at every call.

States made inside ``jit`` die with its trace: a wrapper made there is not kept, and its state
starts afresh at every call of the compiled function. For a stateful transformation the learner
keeps no state for, that is warned (at tracing) with the fix named: make the optimizer outside
``jit``, or call ``etrace_train`` once outside ``jit`` with the transformation.

Examples
--------
>>> import optax, jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(2, 3), braintrace.D_RTRL, jnp.ones(2))
>>> adam = optax.adam(1e-2)
>>> step_fn = lambda x: jnp.mean(learner(x) ** 2)
>>> first = learner.etrace_train(jnp.ones((4, 2)), step_fn=step_fn, optimizer=adam, update_every=2)
>>> second = learner.etrace_train(jnp.ones((4, 2)), step_fn=step_fn, optimizer=adam, update_every=2)
>>> second.optimizer is first.optimizer, int(second.optimizer.step_count.value)
(True, 4)
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple

import brainstate
import jax

from braintrace._compatible_imports import Tracer
from braintrace._typing import Path

if TYPE_CHECKING:
    import braintools
    import optax

__all__ = ["train_optimizer"]

#: The weights a wrapper is registered on: each path with the ``id`` of its ``ParamState``.
WeightsKey = frozenset[tuple[Path, int]]


class _Kept(NamedTuple):
    """An optax transformation and the ``OptaxOptimizer`` that holds its state for a learner."""

    tx: optax.GradientTransformation  # held, so that its id stays its own while it is kept
    optimizer: braintools.optim.OptaxOptimizer


#: learner -> the wrapper it keeps for each set of weights (the last transformation used on them).
_KEPT: weakref.WeakKeyDictionary[object, dict[WeightsKey, _Kept]] = weakref.WeakKeyDictionary()
_KEPT_GUARD = threading.Lock()


def train_optimizer(
    learner: object, optimizer: object, weights: Mapping[Path, brainstate.ParamState],
) -> tuple[braintools.optim.OptaxOptimizer, Callable[[], None]]:
    """The ``braintools.optim.OptaxOptimizer`` that trains ``weights`` of ``learner``, and ``keep``.

    Call ``keep()`` once the training call has run: the learner then keeps a new optax wrapper
    for the next call (for a ``braintools`` optimizer it does nothing).

    Raises
    ------
    TypeError
        For an ``optimizer`` that is neither a ``braintools.optim`` optimizer nor an optax
        transformation.
    ValueError
        For an optimizer registered on other weights (other paths, or the ``ParamState`` objects
        of another learner).
    """
    import braintools
    import optax

    if isinstance(optimizer, optax.GradientTransformation):
        return _optax_optimizer(learner, optimizer, weights)
    if not isinstance(optimizer, braintools.optim.OptaxOptimizer):
        raise TypeError(
            f"etrace_train: optimizer must be a braintools.optim optimizer (braintools.optim.SGD, "
            f"Adam, ...) or an optax.GradientTransformation, got {type(optimizer).__name__}."
        )
    if optimizer.opt_state is None:
        optimizer.register_trainable_weights(dict(weights))
    else:
        _check_registered_on(optimizer, weights)
    return optimizer, _nothing


def _optax_optimizer(
    learner: object, tx: optax.GradientTransformation, weights: Mapping[Path, brainstate.ParamState],
) -> tuple[braintools.optim.OptaxOptimizer, Callable[[], None]]:
    import braintools

    key: WeightsKey = frozenset((path, id(state)) for path, state in weights.items())
    with _KEPT_GUARD:
        kept = _KEPT.get(learner, {}).get(key)
    if kept is not None and kept.tx is tx:
        return kept.optimizer, _nothing
    wrapper = braintools.optim.OptaxOptimizer(tx=tx)
    wrapper.register_trainable_weights(dict(weights))
    if any(isinstance(leaf, Tracer) for state in weights.values() for leaf in jax.tree.leaves(state.value)):
        if _has_state(wrapper):
            warnings.warn(
                "etrace_train: inside jit (the weights are traced), this optax transformation's state "
                "(Adam's count and moments) is made in the trace and dies with it: every call of the "
                "compiled function starts it afresh. Make the optimizer outside jit: "
                "opt = braintools.optim.OptaxOptimizer(tx); opt.register_trainable_weights(learner.param_states); "
                "pass optimizer=opt. Or call etrace_train once outside jit with this transformation: the "
                "learner then keeps its state, also for the calls inside jit.",
                UserWarning,
                stacklevel=5,
            )
        return wrapper, _nothing
    steps_lost = int(kept.optimizer.step_count.value) if kept is not None and _has_state(kept.optimizer) else 0
    if steps_lost and _has_state(wrapper):
        warnings.warn(
            f"etrace_train: this optax transformation is another object than the one that trained these "
            f"weights before (whose state had taken {steps_lost} steps), so its state starts afresh "
            f"(a step count of 0, zero moments). A transformation built at every call "
            f"(optimizer=optax.adam(1e-3) inside a loop) restarts its state at every call: build it once "
            f"and pass the same object, or pass result.optimizer back.",
            UserWarning,
            stacklevel=5,  # the caller of etrace_train (through train_optimizer and the learner's lock)
        )

    def keep() -> None:
        with _KEPT_GUARD:
            _KEPT.setdefault(learner, {})[key] = _Kept(tx, wrapper)

    return wrapper, keep


def _check_registered_on(
    optimizer: braintools.optim.OptaxOptimizer, weights: Mapping[Path, brainstate.ParamState],
) -> None:
    """Refuse an optimizer registered on other paths, or on other ``ParamState`` objects."""
    registered = optimizer.param_states.to_pytree()
    if set(registered) != set(weights):
        raise ValueError(
            f"etrace_train: the optimizer is registered on other weights than it is asked to train: "
            f"missing {sorted(map(str, set(weights) - set(registered)))}, extra "
            f"{sorted(map(str, set(registered) - set(weights)))}. Pass a fresh optimizer (etrace_train "
            f"registers it), or the weights it was registered on."
        )
    others = [path for path, state in weights.items() if registered[path] is not state]
    if others:
        raise ValueError(
            f"etrace_train: the optimizer is registered on other weights than it is asked to train: "
            f"the ParamStates at {sorted(map(str, others))} have this learner's paths but are other "
            f"objects (those of another learner or model instance), so its updates would change those "
            f"and not this learner's. Pass a fresh optimizer (etrace_train registers it on this "
            f"learner's weights), or the one registered on this learner's param_states "
            f"(result.optimizer of this learner's last call)."
        )


def _has_state(optimizer: braintools.optim.OptaxOptimizer) -> bool:
    """Whether the transformation keeps any array state (Adam does, plain SGD does not)."""
    return bool(jax.tree.leaves(optimizer.opt_state.value))


def _nothing() -> None:
    """``keep`` for an optimizer the user holds."""
