"""``ExactnessLabel``: whether a learner's online gradient of one relation's weights equals BPTT's.

A learner labels each of its relations (:func:`braintrace._algorithm.engine.exactness.relation_labels`)
and each weight outside every relation (:func:`~braintrace._algorithm.engine.exactness.plain_weight_labels`);
:class:`~braintrace.CompilationReport` lists the labels. ``exact`` is a guarantee of the
math for single steps, or windows with the trace entering each window; everything else is
``approximate``, with the reasons in words.

Examples
--------
>>> from braintrace._compiler.exactness_label import ExactnessLabel
>>> label = ExactnessLabel(('w',), (('w',),), (('h',),), False, ('the y→h tail moves values between positions',))
>>> label.describe()
'approximate: the y→h tail moves values between positions'
>>> ExactnessLabel(('w',), (('w',),), (('h',),), True).describe()
'exact'
"""

from __future__ import annotations

import dataclasses

from braintrace._typing import Path

__all__ = ["ExactnessLabel"]


@dataclasses.dataclass(frozen=True)
class ExactnessLabel:
    """The exactness of one relation's weights, or of one weight outside every relation, under one learner.

    Attributes
    ----------
    weight_path : tuple
        The relation's first trainable ``ParamState`` path (``relation.path``), or the weight's.
    weight_paths : tuple
        Every ``ParamState`` path the relation trains (the weight's alone, outside a relation).
    hidden_paths : tuple
        The hidden states the relation drives (the states the weight reaches, outside a relation).
    exact : bool
        Whether the online gradient of these weights equals BPTT's (see the module docstring).
    reasons : tuple of str
        Why not (empty when ``exact``).

    Raises
    ------
    TypeError
        If ``exact`` is not a bool or a reason is not a string.
    ValueError
        For an exact label with reasons, or an approximate one without.
    """

    weight_path: Path
    weight_paths: tuple[Path, ...]
    hidden_paths: tuple[Path, ...]
    exact: bool
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.exact, bool):
            raise TypeError(f"ExactnessLabel: exact must be True or False, got {self.exact!r}.")
        reasons = tuple(self.reasons)
        if not all(isinstance(r, str) and r for r in reasons):
            raise TypeError(f"ExactnessLabel: reasons must be non-empty strings, got {self.reasons!r}.")
        if self.exact and reasons:
            raise ValueError(f"ExactnessLabel: an exact label has no reasons, got {reasons!r}.")
        if not self.exact and not reasons:
            raise ValueError("ExactnessLabel: an approximate label needs at least one reason, in words.")
        object.__setattr__(self, "reasons", reasons)

    def describe(self) -> str:
        """``'exact'``, or ``'approximate: reason; reason'``."""
        return "exact" if self.exact else "approximate: " + "; ".join(self.reasons)
