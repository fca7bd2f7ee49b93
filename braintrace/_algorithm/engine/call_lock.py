"""One lock per learner: calls from several threads run one after another, never interleaved.

A learner's call, its drivers and its reset read and write the learner's states (weights, hidden
states, traces, counters). Two threads doing so at once would interleave those writes, and while
one thread traces a driver's loop the states hold its tracers, which the other thread would read
(JAX's ``UnexpectedTracerError``, with the states left holding leaked tracers). Each such entry
point holds the learner's re-entrant lock for its whole duration (:func:`serialised`), so a
thread waits for another's call to finish.

A step function the user compiles (``brainstate.transform.jit``, or any brainstate
``StatefulFunction``) calls the learner only while it is traced; each later call reads the
states, runs the compiled program and writes every state back, without entering the learner.
Two threads calling one such function could both read the same states and the later write-back
would erase the earlier one's update. When a learner's entry point is traced inside such a
function, :func:`guard_enclosing_traces` makes that function's write-back check, under the
lock, that no state changed since the call read it; if one did, the call is refused
(:class:`~braintrace.ConcurrentCallError`) before anything is written, so every update that
lands is whole and none is silently lost. Holding ``learner.lock`` around the call serialises
such calls instead.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
>>> learner_lock(learner) is learner_lock(learner) is learner.lock
True
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, Concatenate, ParamSpec, Sequence, TypeVar

from brainstate import StateTraceStack
from brainstate._state import TRACE_CONTEXT  # the current thread's enclosing traces; no public accessor

from braintrace._errors import ConcurrentCallError
from braintrace._typing import PyTree

__all__ = ["learner_lock", "serialised", "guard_enclosing_traces"]

_LOCKS: dict[int, threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()

Learner = TypeVar("Learner")
Arguments = ParamSpec("Arguments")
Result = TypeVar("Result")


def learner_lock(learner: object) -> threading.RLock:
    """The re-entrant lock of ``learner`` (made on first use, dropped with the learner)."""
    key = id(learner)
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = threading.RLock()
            weakref.finalize(learner, _LOCKS.pop, key, None)
    return lock


def serialised(
    method: Callable[Concatenate[Learner, Arguments], Result],
) -> Callable[Concatenate[Learner, Arguments], Result]:
    """``method`` of a learner, run while holding the learner's lock (and guarding the traces enclosing it)."""

    @functools.wraps(method)
    def locked(self: Learner, /, *args: Arguments.args, **kwargs: Arguments.kwargs) -> Result:
        with learner_lock(self):
            guard_enclosing_traces(self)
            return method(self, *args, **kwargs)

    return locked


def guard_enclosing_traces(learner: object) -> None:
    """Make every brainstate function now tracing a call of ``learner`` refuse a lost update at its write-back."""
    for stack in TRACE_CONTEXT.state_stack:
        guard = stack.__dict__.get(_WriteBackGuard.ATTRIBUTE)
        if guard is None:
            guard = _WriteBackGuard(stack)
        guard.add(learner_lock(learner))


class _WriteBackGuard:
    """The check around one ``StateTraceStack``'s write-back: every state is still what the call read.

    A compiled brainstate function's call reads its states (``get_read_state_values``, then
    ``get_state_values`` for the program's arguments), runs the program and writes them back
    (``assign_state_vals_v2``: a written state gets its new value, a read one its read value
    back). The guard wraps the stack's own ``get_state_values`` and ``assign_state_vals_v2`` to
    remember, per thread, the values the call read, and to write back only if, under the locks
    of the learners traced into the function, every state still holds them.
    """

    ATTRIBUTE = "_braintrace_write_back_guard"

    def __init__(self, stack: StateTraceStack) -> None:
        self._stack = stack
        self._locks: tuple[threading.RLock, ...] = ()
        self._read = threading.local()
        self._read_states = stack.get_state_values
        self._write_back = stack.assign_state_vals_v2
        stack.__dict__[self.ATTRIBUTE] = self
        stack.__dict__["get_state_values"] = self.read_states
        stack.__dict__["assign_state_vals_v2"] = self.write_back

    def add(self, lock: threading.RLock) -> None:
        """Hold ``lock`` too at write-back (the locks are taken in one order, by ``id``)."""
        if all(held is not lock for held in self._locks):
            self._locks = tuple(sorted((*self._locks, lock), key=id))

    def read_states(self, separate: bool = False, replace: bool = False) -> Sequence[PyTree] | tuple[
            Sequence[PyTree], Sequence[PyTree]]:
        values = self._read_states(separate, replace)
        if not separate:  # the call's read of every state, in the stack's order
            self._read.values = tuple(values)
        return values

    def write_back(self, read_values: Sequence[PyTree], write_values: Sequence[PyTree]) -> None:
        seen: tuple[PyTree, ...] | None = self._read.__dict__.pop("values", None)
        locks = self._locks
        for lock in locks:
            lock.acquire()
        try:
            if seen is not None:
                self._refuse_changed(seen, read_values)
            self._write_back(read_values, write_values)
        finally:
            for lock in reversed(locks):
                lock.release()

    def _refuse_changed(self, seen: tuple[PyTree, ...], read_values: Sequence[PyTree]) -> None:
        changed = []
        for st, at_call, read in zip(self._stack.states, seen, read_values, strict=True):
            now = st.value
            if now is not at_call or (read is not None and now is not read):
                changed.append(st)
        if changed:
            names = ", ".join(sorted({type(st).__name__ + (f" {st.name!r}" if st.name else "") for st in changed}))
            raise ConcurrentCallError(
                f"A compiled function that calls a learner was called from thread "
                f"{threading.current_thread().name!r} while another call changed {len(changed)} of its "
                f"states ({names}) between this call's read of them and its write-back; writing back "
                f"would erase that update, so nothing was written and the states hold the other call's "
                f"result. Call such a function from one thread at a time: hold the learner's lock around "
                f"it (`with learner.lock: step(x)`), or give each thread its own learner."
            )
