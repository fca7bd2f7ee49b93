"""The figures of a gradient audit: :class:`GradientRow` per parameter leaf and :class:`GradientAudit`.

For an online gradient ``g`` and the BPTT gradient ``b`` of the same objective (one parameter
leaf, or all of them concatenated), the audit reports

* the cosine ``g·b / (‖g‖ ‖b‖)``: the direction (1 for the same direction);
* the relative error ``‖g − b‖ / ‖b‖``: the distance (0 when equal);
* the norm ratio ``‖g‖ / ‖b‖``: the size (1 for the same length);

and calls a leaf *exact* when its relative error is at most ``rtol``. The figures are computed in
float64 from the gradients' mantissas (their units dropped). Where ``b`` is zero the relative
error and the norm ratio are ``inf`` (``0`` and ``1`` when ``g`` is zero too) and the cosine is
``nan`` (``1`` when ``g`` is zero too).

Examples
--------
>>> import numpy as np
>>> from braintrace._audit.report import gradient_figures
>>> cosine, relative_error, norm_ratio = gradient_figures(np.array([1.0, 1.0]), np.array([1.0, 0.0]))
>>> round(cosine, 4), round(relative_error, 4), round(norm_ratio, 4)
(0.7071, 1.0, 1.4142)
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Mapping, Sequence

import brainunit as u
import jax
import numpy as np

from braintrace._typing import Path, PyTree

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["GradientRow", "GradientAudit", "gradient_figures", "gradient_rows", "overall_row"]

#: ``path -> gradient`` (a pytree for a dict-valued parameter), keyed like the audited weights.
Grads = Mapping[Path, PyTree]

_HEADER = ("parameter", "cosine", "rel. error", "norm ratio", "verdict")


def gradient_figures(online: np.ndarray, bptt: np.ndarray) -> tuple[float, float, float]:
    """``(cosine, relative error, norm ratio)`` of the flat vectors ``online`` against ``bptt``.

    Examples
    --------
    >>> import numpy as np
    >>> gradient_figures(np.zeros(3), np.zeros(3))  # both zero: identical
    (1.0, 0.0, 1.0)
    """
    online = np.asarray(online, np.float64).ravel()
    bptt = np.asarray(bptt, np.float64).ravel()
    norm_online = float(np.linalg.norm(online))
    norm_bptt = float(np.linalg.norm(bptt))
    if norm_bptt == 0.0:
        return (1.0, 0.0, 1.0) if norm_online == 0.0 else (math.nan, math.inf, math.inf)
    relative_error = float(np.linalg.norm(online - bptt)) / norm_bptt
    if norm_online == 0.0:
        return math.nan, relative_error, 0.0
    cosine = float(online @ bptt) / (norm_online * norm_bptt)
    return cosine, relative_error, norm_online / norm_bptt


@dataclasses.dataclass(frozen=True)
class GradientRow:
    """The audit figures of one parameter leaf (or, named ``'overall'``, of all of them).

    Attributes
    ----------
    name : str
        The parameter path joined by dots, with the leaf's key for a dict-valued parameter,
        e.g. ``"cell.W.weight['bias']"``.
    path : tuple
        The parameter's path (a key of ``learner.param_states``); ``()`` for the overall row.
    leaf : str
        The leaf's key inside the parameter's value (``"['bias']"``; ``""`` for an array).
    size : int
        The number of entries compared.
    cosine, relative_error, norm_ratio : float
        See :mod:`braintrace._audit.report`.
    exact : bool
        ``relative_error <= rtol``.

    Examples
    --------
    >>> row = GradientRow('w', ('w',), '', 4, 1.0, 2e-7, 1.0, True)
    >>> row.name, row.exact
    ('w', True)
    """

    name: str
    path: Path
    leaf: str
    size: int
    cosine: float
    relative_error: float
    norm_ratio: float
    exact: bool

    def cells(self) -> tuple[str, str, str, str, str]:
        """The row's text cells: name, cosine, relative error, norm ratio, verdict."""
        verdict = "exact" if self.exact else "approximate"
        return (self.name, f"{self.cosine:.6f}", f"{self.relative_error:.3e}", f"{self.norm_ratio:.6f}", verdict)

    def to_dict(self) -> dict[str, object]:
        """The row as plain Python values (non-finite figures as ``None``)."""
        return {
            "name": self.name,
            "path": [key if isinstance(key, (str, int)) else str(key) for key in self.path],
            "leaf": self.leaf,
            "size": self.size,
            "cosine": _finite_or_none(self.cosine),
            "relative_error": _finite_or_none(self.relative_error),
            "norm_ratio": _finite_or_none(self.norm_ratio),
            "exact": self.exact,
        }


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _leaves(grad: PyTree) -> list[tuple[str, np.ndarray]]:
    """``(key string, float64 mantissa)`` of every leaf of one parameter's gradient."""
    flat = jax.tree_util.tree_flatten_with_path(grad, is_leaf=lambda x: isinstance(x, u.Quantity))[0]
    return [(jax.tree_util.keystr(keys), np.asarray(u.get_mantissa(leaf), np.float64)) for keys, leaf in flat]


def _row_name(path: Path, leaf: str) -> str:
    return ".".join(str(key) for key in path) + leaf


def _leaf_pairs(online: Grads, bptt: Grads) -> list[tuple[Path, str, np.ndarray, np.ndarray]]:
    """``(path, leaf key, online leaf, BPTT leaf)`` for every leaf of every parameter of ``bptt``."""
    return [(tuple(path), leaf, g, b) for path, reference in bptt.items()
            for (leaf, b), (_, g) in zip(_leaves(reference), _leaves(online[path]), strict=True)]


def gradient_rows(online: Grads, bptt: Grads, rtol: float) -> tuple[GradientRow, ...]:
    """One :class:`GradientRow` per leaf of every parameter of ``bptt``, in its order.

    Examples
    --------
    >>> import numpy as np
    >>> rows = gradient_rows({('w',): {'a': np.ones(2)}}, {('w',): {'a': np.ones(2)}}, rtol=1e-6)
    >>> [(row.name, row.relative_error, row.exact) for row in rows]
    [("w['a']", 0.0, True)]
    """
    rows = []
    for path, leaf, g, b in _leaf_pairs(online, bptt):
        cosine, relative_error, norm_ratio = gradient_figures(g, b)
        rows.append(GradientRow(_row_name(path, leaf), path, leaf, int(b.size), cosine, relative_error, norm_ratio,
                                relative_error <= rtol))
    return tuple(rows)


def overall_row(online: Grads, bptt: Grads, rtol: float) -> GradientRow:
    """The figures of every audited leaf concatenated, as a row named ``'overall'``."""
    pairs = _leaf_pairs(online, bptt)
    g = np.concatenate([p[2].ravel() for p in pairs]) if pairs else np.zeros(0)
    b = np.concatenate([p[3].ravel() for p in pairs]) if pairs else np.zeros(0)
    cosine, relative_error, norm_ratio = gradient_figures(g, b)
    return GradientRow("overall", (), "", int(b.size), cosine, relative_error, norm_ratio, relative_error <= rtol)


def format_table(title: str, prefix: tuple[str, ...], lines: Sequence[tuple[tuple[str, ...], GradientRow]]) -> str:
    """An aligned text table: a title line, a header (``prefix`` columns, then the row columns)."""
    body = [(*extra, *row.cells()) for extra, row in lines]
    header = (*prefix, *_HEADER)
    widths = [max(len(cells[i]) for cells in [header, *body]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return "\n".join([title, line(header), *(line(cells) for cells in body)])


@dataclasses.dataclass(frozen=True)
class GradientAudit:
    """A learner's online gradient compared with BPTT of the same objective (see :func:`~braintrace.check_gradients`).

    Attributes
    ----------
    learner : str
        What was audited (the learner's class name, or the label given to
        :func:`~braintrace.compare_learners`).
    rows : tuple of GradientRow
        One row per parameter leaf.
    overall : GradientRow
        The figures of all leaves concatenated.
    rtol : float
        The relative error up to which a leaf counts as exact.
    objective : float
        The audited objective ``J = Σ_t mask_t · loss_t`` (from the BPTT run).
    online_grads, bptt_grads : dict
        ``path -> gradient`` of the learner and of BPTT (``reduction='sum'``).

    Examples
    --------
    >>> import numpy as np
    >>> from braintrace._audit.report import GradientAudit
    >>> audit = GradientAudit.from_gradients('demo', {('w',): np.array([1.0, 0.0])}, {('w',): np.array([1.0, 1e-6])},
    ...                                      rtol=1e-4, objective=0.5)
    >>> audit.exact, [row.name for row in audit.rows]
    (True, ['w'])
    >>> print(audit.table())
    demo vs BPTT (rtol=0.0001): exact
    parameter  cosine    rel. error  norm ratio  verdict
    w          1.000000  1.000e-06   1.000000    exact
    overall    1.000000  1.000e-06   1.000000    exact
    """

    learner: str
    rows: tuple[GradientRow, ...]
    overall: GradientRow
    rtol: float
    objective: float
    online_grads: dict[Path, PyTree] = dataclasses.field(repr=False, compare=False)
    bptt_grads: dict[Path, PyTree] = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_gradients(cls, learner: str, online: Grads, bptt: Grads, rtol: float, objective: float) -> GradientAudit:
        """The audit of ``online`` against ``bptt`` (both ``path -> gradient``, same keys)."""
        return cls(learner, gradient_rows(online, bptt, rtol), overall_row(online, bptt, rtol), float(rtol),
                   float(objective), dict(online), dict(bptt))

    @property
    def exact(self) -> bool:
        """Whether every leaf is exact (relative error ``<= rtol``)."""
        return all(row.exact for row in self.rows)

    @property
    def verdict(self) -> str:
        """``'exact'`` or ``'approximate'``."""
        return "exact" if self.exact else "approximate"

    def table(self) -> str:
        """The figures as an aligned text table, one line per leaf and an ``overall`` line."""
        title = f"{self.learner} vs BPTT (rtol={self.rtol:g}): {self.verdict}"
        return format_table(title, (), [((), row) for row in (*self.rows, self.overall)])

    def __repr__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, object]:
        """Plain Python values (JSON-serialisable; non-finite figures as ``None``)."""
        return {
            "learner": self.learner,
            "rtol": self.rtol,
            "objective": _finite_or_none(self.objective),
            "exact": self.exact,
            "overall": self.overall.to_dict(),
            "rows": [row.to_dict() for row in self.rows],
        }

    def plot(self, ax: Axes | None = None) -> Axes:
        """A bar chart of the relative error per leaf on a log axis, with the ``rtol`` line.

        Parameters
        ----------
        ax : matplotlib.axes.Axes, optional
            Where to draw (default: a new figure's axes).

        Returns
        -------
        matplotlib.axes.Axes
        """
        ax = axes_for(ax)
        names = [row.name for row in self.rows]
        ax.bar(range(len(names)), [plotted_error(row.relative_error) for row in self.rows], color="tab:blue")
        finish_error_axes(ax, names, self.rtol, f"{self.learner} vs BPTT")
        return ax


#: Relative errors below this are drawn at it (a log axis cannot show zero).
PLOT_FLOOR = 1e-16


def plotted_error(relative_error: float) -> float:
    return max(relative_error, PLOT_FLOOR) if not math.isnan(relative_error) else math.nan


def axes_for(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 3.5))[1]


def finish_error_axes(ax: Axes, names: list[str], rtol: float, title: str) -> None:
    """Log scale, parameter names on the x axis, the tolerance line and its legend."""
    ax.set_yscale("log")
    ax.axhline(rtol, color="tab:red", linestyle="--", label=f"rtol = {rtol:g}")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("relative error ‖g − g_BPTT‖ / ‖g_BPTT‖")
    ax.set_title(title)
    ax.legend()
