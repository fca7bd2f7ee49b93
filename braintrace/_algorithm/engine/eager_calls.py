"""Eager learner calls: timed, and warned about once per learner (:class:`~braintrace.EagerCallWarning`).

A learner called outside ``jit`` (``learner(x)`` in a Python loop) traces its step and dispatches
it operation by operation at every call: measured on a CPU for a 4-unit RNN, about 12 ms per call,
against 0.4 ms for the same step compiled once under ``brainstate.transform.jit``. The first
eager call also compiles every operation (a second or so), so it says nothing about the calls
after it. :func:`watched_call` times each call; at a learner's :data:`WARN_AT`-th eager call it
warns, once, with the mean host time of the eager calls after the first, and names the fix.

A call is eager when it ran on concrete values: every brainstate transform (``jit``, ``grad``,
``vmap``, ``scan``, the sequence drivers) runs the step on tracers, so after a traced call its
inputs or output are tracers, or the learner's step counter holds one (``jit`` over constant
inputs; ``vmap`` leaves the shared counter concrete but maps the inputs). Reading the counter
adds nothing to a traced program (the call has read and written it), and the check costs two
clock reads, a dictionary look-up and a walk over the call's inputs and output, nothing once the
learner has warned.

Examples
--------
>>> import warnings, jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter('always')
...     for _ in range(WARN_AT + 2):
...         _ = learner(jnp.ones(3))
>>> len(caught), 'ms per call' in str(caught[0].message)
(1, True)
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from typing import Callable, TypeVar

import jax

from braintrace._compatible_imports import Tracer
from braintrace._errors import EagerCallWarning

__all__ = ["WARN_AT", "watched_call"]

#: The eager call of a learner that warns.
WARN_AT = 3

Result = TypeVar("Result")


@dataclasses.dataclass
class _EagerCalls:
    """A learner's eager calls so far."""

    count: int = 0
    seconds: float = 0.0  # the host time of the eager calls after the first
    warned: bool = False


_WATCHED: weakref.WeakKeyDictionary[object, _EagerCalls] = weakref.WeakKeyDictionary()


def watched_call(learner: object, call: Callable[[], Result], seen: Callable[[Result], object]) -> Result:
    """``call()``, timed; ``seen(result)`` is a pytree (the call's inputs, its output, the
    learner's step counter) holding a tracer unless the call ran eagerly.

    Called with the learner's lock held (its ``__call__``), so one learner's count is never
    updated by two threads at once.
    """
    watch = _WATCHED.get(learner)
    if watch is not None and watch.warned:
        return call()
    start = time.perf_counter()
    result = call()
    elapsed = time.perf_counter() - start
    if any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(seen(result))):
        return result
    if watch is None:
        watch = _WATCHED.setdefault(learner, _EagerCalls())
    watch.count += 1
    if watch.count > 1:
        watch.seconds += elapsed
    if watch.count >= WARN_AT:
        watch.warned = True
        per_call = 1e3 * watch.seconds / (watch.count - 1)
        warnings.warn(
            f"{type(learner).__name__} learner: called eagerly (outside jit) {watch.count} times; each "
            f"eager call traces the step and runs it operation by operation, measured {per_call:.1f} ms "
            f"per call. Compile the training step once: wrap it in brainstate.transform.jit (jax.jit "
            f"over the learner's states), or drive whole sequences with learner.etrace_grad, "
            f"etrace_train or etrace_evolve (one compiled loop per sequence). Warned once per learner.",
            EagerCallWarning,
            stacklevel=4,  # the caller of learner(x) (through __call__ and the learner's lock)
        )
    return result
