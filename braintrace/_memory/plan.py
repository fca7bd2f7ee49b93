"""The planner's result: a :class:`MemoryPlan` gathers one :class:`~braintrace.MemoryEstimate` per training method.

Examples
--------
>>> from braintrace._footprint import MemoryEstimate
>>> from braintrace._footprint.step_memory import StepMemory
>>> from braintrace._memory.plan import MemoryPlan
>>> row = MemoryEstimate(method='d_rtrl', batch_size=8, steps=1, trace_bytes=4096, param_bytes=512,
...                      state_bytes=260, step=StepMemory(10240, 9728, 2048, 0))
>>> print(MemoryPlan((row,), batch_size=8, seq_len=1, budget_bytes=None, backend='cpu').table())
method  steps  batch  traces   params  states  step temp  step total
d_rtrl      1      8  4.0 KiB   512 B   260 B    2.0 KiB    21.5 KiB
step total: arguments + outputs + temporaries - aliased bytes of the compiled training step (XLA's memory_analysis on cpu); traces, params and states are what the method keeps between steps, included in the step's arguments.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterator, TypedDict

from braintrace._footprint.estimate import EstimateRecord, MemoryEstimate, format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["MemoryPlan", "PlanRecord"]

_COLUMNS = ("method", "steps", "batch", "traces", "params", "states", "step temp", "step total")


def _cells(row: MemoryEstimate, with_budget: bool) -> list[str]:
    cells = [row.method, str(row.steps), "-" if row.batch_size is None else str(row.batch_size),
             format_bytes(row.trace_bytes), format_bytes(row.param_bytes), format_bytes(row.state_bytes),
             format_bytes(row.temp_bytes), format_bytes(row.total_bytes)]
    if with_budget:
        cells.append("n/a" if row.max_batch_size is None else str(row.max_batch_size))
    return cells


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


class PlanRecord(TypedDict):
    """A :class:`MemoryPlan` as plain Python values (:meth:`MemoryPlan.to_dict`)."""

    batch_size: int | None
    seq_len: int
    budget_bytes: float | None
    backend: str
    estimates: list[EstimateRecord]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What each training method needs at the planned sizes (:func:`~braintrace.estimate_memory`).

    Attributes
    ----------
    estimates : tuple of MemoryEstimate
        One per method, in the order asked.
    batch_size : int or None
    seq_len : int
        The sequence length of the BPTT step (the online learners' steps cover one time step).
    budget_bytes : int, float or None
    backend : str
        The JAX backend the steps were compiled for (``'cpu'``, ``'gpu'``, ``'tpu'``).

    Examples
    --------
    >>> from braintrace._footprint import MemoryEstimate
    >>> from braintrace._memory.plan import MemoryPlan
    >>> rows = (MemoryEstimate('BPTT', 8, 100, 0, 512, 64, None), MemoryEstimate('d_rtrl', 8, 1, 4096, 512, 68, None))
    >>> plan = MemoryPlan(rows, batch_size=8, seq_len=100, budget_bytes=None, backend='cpu')
    >>> plan.methods, plan['d_rtrl'].trace_bytes
    (['BPTT', 'd_rtrl'], 4096)
    """

    estimates: tuple[MemoryEstimate, ...]
    batch_size: int | None
    seq_len: int
    budget_bytes: float | None
    backend: str

    @property
    def methods(self) -> list[str]:
        """The methods' names, in order."""
        return [row.method for row in self.estimates]

    def __getitem__(self, method: str) -> MemoryEstimate:
        for row in self.estimates:
            if row.method == method:
                return row
        raise KeyError(f"MemoryPlan has no method {method!r}; its methods are {self.methods}.")

    def __iter__(self) -> Iterator[MemoryEstimate]:
        return iter(self.estimates)

    def __len__(self) -> int:
        return len(self.estimates)

    def table(self) -> str:
        """The plan as a text table, one line per method, with a note on what the columns mean.

        Examples
        --------
        >>> from braintrace._footprint import MemoryEstimate
        >>> from braintrace._memory.plan import MemoryPlan
        >>> from braintrace._footprint.step_memory import StepMemory
        >>> row = MemoryEstimate('d_rtrl', 8, 1, 4096, 512, 68, StepMemory(9000, 8000, 2000, 0), max_batch_size=57)
        >>> print(MemoryPlan((row,), 8, 1, 2**20, 'cpu').table())
        method  steps  batch  traces   params  states  step temp  step total  max batch
        d_rtrl      1      8  4.0 KiB   512 B    68 B    2.0 KiB    18.6 KiB         57
        step total: arguments + outputs + temporaries - aliased bytes of the compiled training step (XLA's memory_analysis on cpu); traces, params and states are what the method keeps between steps, included in the step's arguments.
        max batch: the largest batch size whose step total fits the budget of 1.0 MiB, checked by compiling it and the next one (0: none fits).
        """
        with_budget = self.budget_bytes is not None
        header = [*_COLUMNS, "max batch"] if with_budget else list(_COLUMNS)
        lines = _aligned([header, *(_cells(row, with_budget) for row in self.estimates)])
        lines.append(
            f"step total: arguments + outputs + temporaries - aliased bytes of the compiled training "
            f"step (XLA's memory_analysis on {self.backend}); traces, params and states are what the "
            f"method keeps between steps, included in the step's arguments."
        )
        if any(row.step is None for row in self.estimates):
            lines.append(f"n/a: the {self.backend} backend reports no memory analysis.")
        if with_budget:
            lines.append(
                f"max batch: the largest batch size whose step total fits the budget of "
                f"{format_bytes(self.budget_bytes)}, checked by compiling it and the next one (0: none fits)."
            )
        return "\n".join(lines)

    def to_dict(self) -> PlanRecord:
        """The plan as plain Python values (JSON-serialisable).

        Examples
        --------
        >>> from braintrace._footprint import MemoryEstimate
        >>> from braintrace._memory.plan import MemoryPlan
        >>> plan = MemoryPlan((MemoryEstimate('d_rtrl', 2, 1, 256, 128, 36, None),), 2, 1, None, 'cpu')
        >>> sorted(plan.to_dict()), plan.to_dict()['estimates'][0]['trace_bytes']
        (['backend', 'batch_size', 'budget_bytes', 'estimates', 'seq_len'], 256)
        """
        return {
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "budget_bytes": self.budget_bytes,
            "backend": self.backend,
            "estimates": [row.to_dict() for row in self.estimates],
        }

    def plot(self, ax: Axes | None = None) -> Axes:
        """A bar chart: per method, its traces, params, states, step temporaries and step total.

        The budget, when given, is drawn as a dashed line. Needs matplotlib.

        Parameters
        ----------
        ax : matplotlib.axes.Axes, optional
            Where to draw (default: a new figure).

        Returns
        -------
        matplotlib.axes.Axes

        Examples
        --------
        >>> import matplotlib
        >>> matplotlib.use('Agg')
        >>> from braintrace._footprint import MemoryEstimate
        >>> from braintrace._memory.plan import MemoryPlan
        >>> plan = MemoryPlan((MemoryEstimate('d_rtrl', 2, 1, 256, 128, 36, None),), 2, 1, 1000, 'cpu')
        >>> ax = plan.plot()
        >>> [t.get_text() for t in ax.get_xticklabels()]
        ['d_rtrl']
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(1.8 + 1.6 * len(self.estimates), 3.6))
        parts = {
            "traces": [row.trace_bytes for row in self.estimates],
            "params": [row.param_bytes for row in self.estimates],
            "states": [row.state_bytes for row in self.estimates],
            "step temp": [row.temp_bytes or 0 for row in self.estimates],
            "step total": [row.total_bytes or 0 for row in self.estimates],
        }
        width = 0.8 / len(parts)
        for i, (label, values) in enumerate(parts.items()):
            positions = [j + (i - (len(parts) - 1) / 2) * width for j in range(len(self.estimates))]
            ax.bar(positions, values, width=width, label=label)
        if self.budget_bytes is not None:
            ax.axhline(self.budget_bytes, color="black", linestyle="--", linewidth=1,
                       label=f"budget {format_bytes(self.budget_bytes)}")
        ax.set_xticks(range(len(self.estimates)))
        ax.set_xticklabels(self.methods)
        ax.set_ylabel("bytes")
        batch = "unbatched" if self.batch_size is None else f"batch {self.batch_size}"
        ax.set_title(f"Memory per training step ({batch}, BPTT over {self.seq_len} steps)")
        ax.legend(fontsize="small")
        return ax

    def __repr__(self) -> str:
        budget = "None" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (f"MemoryPlan(batch_size={self.batch_size}, seq_len={self.seq_len}, budget={budget}, "
                f"backend={self.backend!r})\n{self.table()}")
