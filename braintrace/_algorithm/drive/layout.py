"""The layout of sequences: which axis is time, read from the declared ``time_axis``, never guessed.

The drivers and ``predict`` take sequences time-major by default, every leaf ``(T, batch, ...)``
(``time_axis=0``), or batch-major, every leaf ``(batch, T, ...)`` (``time_axis=1``), which is
transposed on entry. The per-step outputs of ``etrace_evolve`` and ``predict`` that carry the batch
go back in the declared layout; per-step losses stay ``(T,)``, and the auxiliaries of
``etrace_grad`` / ``etrace_train`` stay stacked over the learner's calls, time-major.

A batch-major sequence given as time-major is refused with the fix named: where the learner's
batch size ``B`` is known, axis 1 of every leaf of a time-major sequence must be ``B``; a leaf
whose axis 1 is not ``B`` while its axis 0 is reads as batch-major. When ``T == B`` both layouts
have the same shape and the declared axis decides.

Examples
--------
>>> import jax.numpy as jnp
>>> xs = jnp.zeros((5, 7, 3))  # 5 sequences of 7 steps
>>> check_layout('etrace_grad', 'sequences[0]', xs.shape, time_axis=1, batch_size=5)
>>> time_major((xs,), time_axis=1)[0].shape
(7, 5, 3)
>>> check_layout('etrace_grad', 'sequences[0]', xs.shape, time_axis=0, batch_size=5)
Traceback (most recent call last):
...
ValueError: etrace_grad: sequences[0] has shape (5, 7, 3): axis 0 is the batch size 5 and axis 1 is not, ...
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._typing import PyTree

__all__ = ["TIME_AXES", "checked_time_axis", "check_layout", "time_major", "in_declared_layout"]

#: The accepted values of ``time_axis``: 0, time-major ``(T, batch, ...)``; 1, batch-major ``(batch, T, ...)``.
TIME_AXES = (0, 1)


def checked_time_axis(call: str, time_axis: object) -> int:
    """``time_axis`` (0 or 1), refused otherwise.

    Raises
    ------
    ValueError
        For any other value (a bool, a negative axis, a float), naming it.
    """
    if isinstance(time_axis, bool) or not isinstance(time_axis, numbers.Integral) or time_axis not in TIME_AXES:
        raise ValueError(
            f"{call}: time_axis must be 0 (time-major sequences, every leaf (time, batch, ...)) or 1 "
            f"(batch-major, every leaf (batch, time, ...)), got {time_axis!r}."
        )
    return int(time_axis)


def check_layout(call: str, where: str, shape: tuple[int, ...], time_axis: int, batch_size: int | None) -> None:
    """Refuse a sequence leaf (``where``, of ``shape``) that cannot be in the declared layout.

    ``batch_size`` is the learner's (``None``: unknown, nothing is checked against it).

    Raises
    ------
    ValueError
        Under ``time_axis=1``, for a leaf with fewer than two axes; where ``batch_size`` is known,
        for a leaf that reads as the other layout (its batch axis is not ``batch_size`` while the
        other of its first two axes is).
    """
    if time_axis == 1 and len(shape) < 2:
        raise ValueError(
            f"{call}: time_axis=1 declares batch-major sequences, every leaf (batch, time, ...), but "
            f"{where} has shape {shape}. Give it a batch axis, or pass time-major sequences with "
            f"time_axis=0."
        )
    if batch_size is None or len(shape) < 2:
        return
    batch, other = shape[1 - time_axis], shape[time_axis]
    if batch != batch_size and other == batch_size:
        declared, read = "time-major (time, batch, ...)", "batch-major (batch, time, ...)"
        if time_axis == 1:
            declared, read = read, declared
        raise ValueError(
            f"{call}: {where} has shape {shape}: axis {time_axis} is the batch size {batch_size} and axis "
            f"{1 - time_axis} is not, so it reads as {read}, but time_axis={time_axis} declares {declared}. "
            f"Pass time_axis={1 - time_axis}, or transpose it (jnp.swapaxes(x, 0, 1))."
        )


def time_major(sequences: tuple[PyTree, ...], time_axis: int) -> tuple[PyTree, ...]:
    """The sequences with time on axis 0 of every leaf: batch-major ones (``time_axis=1``) transposed."""
    if time_axis == 0:
        return sequences
    return tuple(jax.tree.map(lambda a: jnp.swapaxes(jnp.asarray(a), 0, 1), seq) for seq in sequences)


def in_declared_layout(tree: PyTree, time_axis: int, batch_size: int | None, time_dims: int = 1) -> PyTree:
    """Per-step results stacked time-major, back in the declared layout.

    ``tree``'s leaves have ``time_dims`` leading time axes (``(T, ...)``, or ``(T // k, k, ...)``
    for windows). Under ``time_axis=1`` a leaf whose next axis is the batch (``batch_size``)
    gets it moved to the front; other leaves (a per-step scalar) keep their layout.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> outs = {'y': jnp.zeros((7, 5, 2)), 'loss': jnp.zeros(7)}
    >>> {k: v.shape for k, v in in_declared_layout(outs, 1, 5).items()}
    {'loss': (7,), 'y': (5, 7, 2)}
    """
    if time_axis == 0 or batch_size is None:
        return tree

    def declared(a: jax.Array) -> jax.Array:
        shape = np.shape(a)
        if len(shape) > time_dims and shape[time_dims] == batch_size:
            return jnp.moveaxis(a, time_dims, 0)
        return a

    return jax.tree.map(declared, tree)
