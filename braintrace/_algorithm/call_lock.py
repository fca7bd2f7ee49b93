"""One lock per learner: calls from several threads run one after another, never interleaved.

A learner's call, its drivers and its reset read and write the learner's states (weights, hidden
states, traces, counters). Two threads doing so at once would interleave those writes, and while
one thread traces a driver's loop the states hold its tracers, which the other thread would read
(JAX's ``UnexpectedTracerError``, with the states left holding leaked tracers). Each such entry
point holds the learner's re-entrant lock for its whole duration (:func:`serialised`), so a
thread waits for another's call to finish. A step function the user jits is not an entry point:
brainstate's ``jit`` reads and writes the states around the compiled program without calling the
learner, so one such function is to be called from one thread at a time.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
>>> learner_lock(learner) is learner_lock(learner)
True
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, TypeVar, cast

__all__ = ["learner_lock", "serialised"]

_LOCKS: dict[int, threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()

Method = TypeVar("Method", bound=Callable[..., Any])


def learner_lock(learner: Any) -> threading.RLock:
    """The re-entrant lock of ``learner`` (made on first use, dropped with the learner)."""
    key = id(learner)
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = threading.RLock()
            weakref.finalize(learner, _LOCKS.pop, key, None)
    return lock


def serialised(method: Method) -> Method:
    """``method`` of a learner, run while holding the learner's lock."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with learner_lock(self):
            return method(self, *args, **kwargs)

    return cast(Method, locked)
