"""The largest batch size whose training step fits a memory budget.

The assumption: the compiled step's memory is close to **affine in the batch size**,
``M(b) ≈ a + s·b`` (every trace, state, input and activation of these models has the batch on
one axis; parameters do not). Two measurements give ``a`` and ``s``, and ``(budget − a) / s``
the candidate. XLA's memory is affine only piecewise (its fusion and layout choices change at
some sizes, and a step's memory can even drop a little between neighbouring sizes), so the
candidate is then **verified**: the answer is a batch ``b`` with ``M(b) ≤ budget < M(b + 1)``,
both measured. When the candidate is not one, the sizes measured so far bracket the answer,
``M(lo) ≤ budget < M(hi)``, and the bracket is narrowed (by interpolation, which lands on the
answer on an affine stretch, and bisection) until ``hi = lo + 1``.

Examples
--------
>>> from braintrace._memory.batch_fit import largest_fitting_batch
>>> memory = lambda b: 1000 + 96 * b + (512 if b >= 40 else 0)  # affine, with a step at 40
>>> largest_fitting_batch(memory, budget_bytes=5000, measured_batch=8)  # M(39) = 4744, M(40) = 5352
39
>>> largest_fitting_batch(memory, budget_bytes=900, measured_batch=8)  # not even one sample
0
"""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["largest_fitting_batch", "affine_candidate"]

#: The bracket stops growing here: a step whose memory stays under the budget beyond this many
#: samples does not depend on the batch size.
MAX_BATCH = 2**40


def affine_candidate(b1: int, m1: int, b2: int, m2: int, budget_bytes: float) -> int | None:
    """``⌊(budget − a) / s⌋`` for the line through ``(b1, m1)`` and ``(b2, m2)``; ``None`` if it does not rise.

    Examples
    --------
    >>> from braintrace._memory.batch_fit import affine_candidate
    >>> affine_candidate(4, 1400, 8, 1800, budget_bytes=3000)  # M(b) = 1000 + 100·b
    20
    """
    slope = (m1 - m2) / (b1 - b2)
    if slope <= 0:
        return None
    intercept = m1 - slope * b1
    return math.floor((budget_bytes - intercept) / slope)


class _Memo:
    """``measure`` with each batch size measured once."""

    def __init__(self, measure: Callable[[int], int]) -> None:
        self._measure = measure
        self.seen: dict[int, int] = {}

    def __call__(self, batch: int) -> int:
        if batch not in self.seen:
            self.seen[batch] = self._measure(batch)
        return self.seen[batch]


def _bracket(memory: _Memo, budget: float) -> tuple[int, int] | None:
    """``(lo, hi)`` with ``M(lo) ≤ budget < M(hi)``, ``lo < hi``, from the sizes measured so far
    (grown where needed); ``None`` when not even batch 1 fits."""
    over = [b for b, m in memory.seen.items() if m > budget]
    if not over:
        lo = max(memory.seen)
        step = lo
        while memory(lo + step) <= budget:
            lo += step
            step *= 2
            if lo > MAX_BATCH:
                raise ValueError(
                    f"the step's memory stays under the budget of {budget:g} bytes up to batch size {lo}: "
                    f"it does not grow with the batch, so no batch size bounds it. Check that the example "
                    f"inputs have the batch on axis 0."
                )
        return lo, lo + step
    hi = min(over)
    fitting = [b for b, m in memory.seen.items() if m <= budget and b < hi]
    if fitting:
        return max(fitting), hi
    if hi == 1 or memory(1) > budget:
        return None
    return 1, hi


def _interpolated(memory: _Memo, budget: float, lo: int, hi: int) -> int:
    """The batch where the line through ``lo`` and ``hi`` meets the budget, strictly between them."""
    m_lo, m_hi = memory.seen[lo], memory.seen[hi]
    guess = lo + math.floor((budget - m_lo) * (hi - lo) / (m_hi - m_lo))
    return min(max(guess, lo + 1), hi - 1)


def _narrow(memory: _Memo, budget: float, lo: int, hi: int) -> int:
    """Narrow ``M(lo) ≤ budget < M(hi)`` to ``hi == lo + 1``; returns ``lo``.

    Interpolation (exact on an affine stretch), with a bisection after two interpolations in a
    row that did not halve the bracket (XLA's steps in memory would otherwise slow it down).
    """
    slow = 0
    while hi - lo > 1:
        width = hi - lo
        mid = (lo + hi) // 2 if slow >= 2 else _interpolated(memory, budget, lo, hi)
        if memory(mid) <= budget:
            lo = mid
        else:
            hi = mid
        slow = 0 if slow >= 2 or (hi - lo) * 2 <= width else slow + 1
    return lo


def largest_fitting_batch(measure: Callable[[int], int], budget_bytes: float, measured_batch: int) -> int:
    """A batch size ``b`` with ``measure(b) ≤ budget < measure(b + 1)`` (0 when batch 1 does not fit).

    Parameters
    ----------
    measure : callable
        Batch size ``->`` bytes of the step at that batch size (called once per size).
    budget_bytes : float
    measured_batch : int
        The batch size of the plan; it and a second size seed the affine candidate (see the
        module docstring).

    Returns
    -------
    int
    """
    memory = _Memo(measure)
    other = measured_batch // 2 if measured_batch > 1 else 2
    candidate = affine_candidate(measured_batch, memory(measured_batch), other, memory(other), budget_bytes)
    if candidate is not None:
        candidate = min(max(candidate, 1), MAX_BATCH)
        if memory(candidate) <= budget_bytes:
            memory(candidate + 1)
    bracket = _bracket(memory, budget_bytes)
    if bracket is None:
        return 0
    return _narrow(memory, budget_bytes, *bracket)
