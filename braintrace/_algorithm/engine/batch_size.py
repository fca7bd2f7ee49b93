"""The ``batch_size`` argument of ``braintrace.compile``, ``learner.reset`` and the memory planner.

Examples
--------
>>> checked_batch_size(32, 'compile'), checked_batch_size(None, 'compile')
(32, None)
>>> checked_batch_size(-1, 'compile')
Traceback (most recent call last):
...
ValueError: compile: batch_size must be a positive int (or None for unbatched inputs), got -1;
pass the number of sequences in a batch, the leading axis of each step's input, e.g. batch_size=32.
"""

from __future__ import annotations

import numbers

__all__ = ["checked_batch_size"]


def checked_batch_size(batch_size: object, call: str) -> int | None:
    """``batch_size`` as an ``int`` (``None`` stays ``None``), refused unless a positive integer.

    Raises
    ------
    ValueError
        For a bool, a non-integer (``2.5``, ``'4'``) or an integer below 1, naming ``call``
        and the value.
    """
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(
            f"{call}: batch_size must be a positive int (or None for unbatched inputs), got "
            f"{batch_size!r}; pass the number of sequences in a batch, the leading axis of each step's "
            f"input, e.g. batch_size=32."
        )
    return int(batch_size)
