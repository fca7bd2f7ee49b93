"""Non-finite detection for the sequence drivers: the machinery behind ``check_finite=True``.

A scan cannot stop early, so a checked run carries a :class:`Status` through the loop: the
code of what first went non-finite and the step it happened at. From that step on every state
update is discarded: a :class:`StateGuard` remembers the states' values before a step (or an
optimizer update) and writes them back with ``jnp.where`` on the status, so the loop runs to
its end with the states frozen at the last finite step. After the loop :func:`raise_if_bad`
reads the status on the host and raises :class:`~braintrace.NonFiniteError`.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._compatible_imports import Tracer
from braintrace._errors import NonFiniteError, internal_error
from braintrace._typing import PyTree

__all__ = ["WHAT", "Status", "StateGuard", "all_finite", "advance", "refuse_traced", "raise_if_bad"]

#: What a step checks, in the order of precedence of a report (codes 1, 2, ...): the step's
#: input (the first sequence), its targets (the other sequences), its mask entry, the weights
#: entering it, its loss, its gradient and the states it wrote. ``'update'`` is an optimizer
#: update of ``etrace_train`` that made a weight or an optimizer state non-finite.
WHAT = ("input", "target", "mask", "weight", "loss", "gradient", "trace", "update")


class Status(NamedTuple):
    """The scan carry of a checked run: ``code`` 0 while all is finite, else ``1 + WHAT.index``."""

    code: jax.Array
    step: jax.Array  # the first non-finite step, -1 while there is none

    @staticmethod
    def fresh() -> Status:
        return Status(jnp.asarray(0, jnp.int32), jnp.asarray(-1, jnp.int32))

    @property
    def fine(self) -> jax.Array:
        return self.code == 0


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (the mantissa of a quantity); a bool scalar."""
    ok = jnp.asarray(True)
    for leaf in jax.tree.leaves(tree):
        leaf = jnp.asarray(u.get_mantissa(leaf))
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(leaf))
    return ok


def advance(status: Status, step: jax.typing.ArrayLike, checks: dict[str, jax.Array]) -> Status:
    """The status after ``step``, whose ``checks`` (``what -> all finite``) are given."""
    code = jnp.asarray(0, jnp.int32)
    for what in reversed(WHAT):  # the first failing check in WHAT's order wins
        if what in checks:
            code = jnp.where(checks[what], code, WHAT.index(what) + 1)
    first = status.fine & (code > 0)
    return Status(jnp.where(first, code, status.code), jnp.where(first, jnp.asarray(step, jnp.int32), status.step))


class StateGuard:
    """The values of ``states`` now; :meth:`keep_if` writes them back where a condition fails."""

    def __init__(self, states: Iterable[brainstate.State]) -> None:
        self._saved = [(st, st.value) for st in states]

    def written(self) -> list[PyTree]:
        """The new values of the states written since the guard was made."""
        return [st.value for st, old in self._saved if st.value is not old]

    def keep_if(self, keep: jax.Array) -> None:
        """Keep the new values where ``keep``; restore the saved ones otherwise."""
        for st, old in self._saved:
            if st.value is not old:
                st.value = jax.tree.map(lambda new, prev: jnp.where(keep, new, prev), st.value, old)


def refuse_traced(call: str, *trees: PyTree) -> None:
    """Refuse ``check_finite=True`` under ``jax.jit``: the status is read on the host after the loop."""
    if any(isinstance(leaf, Tracer) for tree in trees for leaf in jax.tree.leaves(tree)):
        raise ValueError(
            f"{call}: check_finite=True reads the loop's outcome on the host to raise, so the "
            f"driver must run outside jax.jit (the drivers compile their own loop), but it got "
            f"traced values. Call it outside jit, or pass check_finite=False inside jit."
        )


def raise_if_bad(call: str, status: Status) -> None:
    """Raise :class:`~braintrace.NonFiniteError` if the run met a non-finite value."""
    if isinstance(status.code, Tracer):
        refuse_traced(call, status.code)
    code = int(status.code)
    if code == 0:
        return
    if not 1 <= code <= len(WHAT):
        raise internal_error(f"non-finite status code {code} outside 1..{len(WHAT)}")
    raise NonFiniteError(call, int(status.step), WHAT[code - 1])
