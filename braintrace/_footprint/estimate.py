"""One training method's memory: a :class:`MemoryEstimate`, and bytes written readably.

Examples
--------
>>> from braintrace._footprint.estimate import MemoryEstimate, format_bytes
>>> from braintrace._footprint.step_memory import StepMemory
>>> row = MemoryEstimate(method='d_rtrl', batch_size=8, steps=1, trace_bytes=4096, param_bytes=512,
...                      state_bytes=260, step=StepMemory(10240, 9728, 2048, 0))
>>> row.total_bytes, format_bytes(row.total_bytes)
(22016, '21.5 KiB')
"""

from __future__ import annotations

import dataclasses
from typing import TypedDict

from braintrace._footprint.step_memory import StepMemory

__all__ = ["MemoryEstimate", "EstimateRecord", "format_bytes"]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float | None) -> str:
    """``n`` bytes, readably: ``'512 B'``, ``'1.5 KiB'``, ``'3.0 GiB'`` (``'n/a'`` for ``None``).

    Examples
    --------
    >>> from braintrace._footprint.estimate import format_bytes
    >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**30), format_bytes(None)
    ('512 B', '1.5 KiB', '3.0 GiB', 'n/a')
    """
    if n is None:
        return "n/a"
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


class EstimateRecord(TypedDict):
    """A :class:`MemoryEstimate` as plain Python values (:meth:`MemoryEstimate.to_dict`): bytes, ``None``
    where unknown."""

    method: str
    batch_size: int | None
    steps: int
    trace_bytes: int
    param_bytes: int
    state_bytes: int
    argument_bytes: int | None
    output_bytes: int | None
    temp_bytes: int | None
    alias_bytes: int | None
    total_bytes: int | None
    max_batch_size: int | None


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The memory one training method needs at the planned sizes.

    Attributes
    ----------
    method : str
        The learner as it was named (``'d_rtrl'``, ``'pp_prop(decay_or_rank=0.9)'``, ``'BPTT'`` ...).
    batch_size : int or None
        The batch size measured (``None``: unbatched).
    steps : int
        The time steps one measured training step covers: 1 for an online learner (its memory
        does not depend on the sequence length), ``seq_len`` for BPTT.
    trace_bytes, param_bytes, state_bytes : int
        What the method keeps between steps: eligibility traces, parameters, and the other
        states (hidden states, counters); see :mod:`braintrace._footprint.inventory`.
    step : StepMemory or None
        XLA's buffers of the compiled training step (``None`` where the backend reports none).
    max_batch_size : int or None
        With a budget: the largest batch size whose step fits it (0: not even one sample).

    Examples
    --------
    >>> from braintrace._footprint.estimate import MemoryEstimate
    >>> row = MemoryEstimate(method='BPTT', batch_size=None, steps=100, trace_bytes=0, param_bytes=128,
    ...                      state_bytes=16, step=None)
    >>> row.total_bytes is None, row.persistent_bytes
    (True, 144)
    """

    method: str
    batch_size: int | None
    steps: int
    trace_bytes: int
    param_bytes: int
    state_bytes: int
    step: StepMemory | None
    max_batch_size: int | None = None

    @property
    def persistent_bytes(self) -> int:
        """Traces + parameters + states: what the method keeps between steps."""
        return self.trace_bytes + self.param_bytes + self.state_bytes

    @property
    def temp_bytes(self) -> int | None:
        """The step's temporary buffer (``None`` without a memory analysis)."""
        return None if self.step is None else self.step.temp_bytes

    @property
    def total_bytes(self) -> int | None:
        """The step's ``argument + output + temp − alias`` bytes (``None`` without a memory analysis)."""
        return None if self.step is None else self.step.total_bytes

    def to_dict(self) -> EstimateRecord:
        """The figures as a flat dict of plain Python values (``None`` where unknown).

        Examples
        --------
        >>> from braintrace._footprint.estimate import MemoryEstimate
        >>> row = MemoryEstimate(method='d_rtrl', batch_size=2, steps=1, trace_bytes=256, param_bytes=128,
        ...                      state_bytes=36, step=None)
        >>> row.to_dict()['trace_bytes'], row.to_dict()['total_bytes']
        (256, None)
        """
        step = self.step
        return {
            "method": self.method,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "trace_bytes": self.trace_bytes,
            "param_bytes": self.param_bytes,
            "state_bytes": self.state_bytes,
            "argument_bytes": None if step is None else step.argument_bytes,
            "output_bytes": None if step is None else step.output_bytes,
            "temp_bytes": self.temp_bytes,
            "alias_bytes": None if step is None else step.alias_bytes,
            "total_bytes": self.total_bytes,
            "max_batch_size": self.max_batch_size,
        }

    def __repr__(self) -> str:
        fit = "" if self.max_batch_size is None else f", max batch {self.max_batch_size}"
        return (
            f"MemoryEstimate({self.method!r}, batch {self.batch_size}, {self.steps} step(s): traces "
            f"{format_bytes(self.trace_bytes)}, params {format_bytes(self.param_bytes)}, states "
            f"{format_bytes(self.state_bytes)}, step temp {format_bytes(self.temp_bytes)}, step total "
            f"{format_bytes(self.total_bytes)}{fit})"
        )
