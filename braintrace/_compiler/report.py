"""``CompilationReport``: a readable summary of an ``ETraceGraph``.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> report = braintrace.CompilationReport(braintrace.compile_etrace_graph(Leaky(), jnp.ones(3)))
>>> report.counts['etrace_weights'], report.hidden_groups
(1, [(0, [('h',)])])
"""

from __future__ import annotations

import sys
import textwrap
from typing import Iterable, TextIO

import brainstate

from braintrace._compiler.diagnostics import CompilationRecord, DiagnosticKind, DiagnosticLevel
from braintrace._compiler.exactness_label import ExactnessLabel
from braintrace._compiler.graph import ETraceGraph
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.module_info import Path

__all__ = ["CompilationReport"]

_EXCLUSION_KINDS = (
    DiagnosticKind.RELATION_EXCLUDED_NO_PARAMSTATE,
    DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL,
    DiagnosticKind.RELATION_EXCLUDED_SHAPE_MISMATCH,
    DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT,
    DiagnosticKind.WEIGHT_DRIVES_HIDDEN_UNTRACED,
)


class CompilationReport:
    """A read-only view of an :class:`ETraceGraph` for people.

    Parameters
    ----------
    graph : ETraceGraph
    labels : iterable of ExactnessLabel, optional
        One per relation of ``graph``, in relation order: whether a learner's online gradient of
        the relation's weights equals BPTT's (``learner.report`` passes the learner's; see
        :mod:`braintrace._algorithm.engine.exactness`). Without labels the report lists none.
    plain_labels : iterable of ExactnessLabel, optional
        One per ``ParamState`` outside every relation, in the order of :attr:`excluded_weights`
        (``learner.report`` passes the learner's). With ``labels``, :attr:`weight_exactness`
        and ``to_str(2)`` give the exactness of every weight, and why.

    Raises
    ------
    TypeError
        If a label is not an ``ExactnessLabel``.
    ValueError
        If the labels do not match the graph's relations one by one, or the plain labels its
        weights outside every relation.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> report = learner.report  # a CompilationReport of learner.graph, with D_RTRL's labels
    >>> report.hidden_groups, report.excluded_weights
    ([(0, [('h',)])], [])
    >>> report.counts
    {'hidden_groups': 1, 'etrace_weights': 2, 'excluded_weights': 0, 'warnings': 0, 'errors': 0}
    >>> [label.exact for label in report.exactness]  # the recurrent weight mixes the units
    [False]
    >>> snap = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'snap', jnp.ones(3))
    >>> print(snap.report.to_str().splitlines()[-1])  # SnAp-2 saturates on a dense recurrence
       Relation 0: ('W', 'weight') -> hidden group 0 [('h',)]: exact

    Level 2 adds every weight's exactness and its reasons:

    >>> print(report.to_str(2).split("\\n\\n")[-1])
    Exactness of the online gradient per weight (single step, or windows with the trace entering each window):
       ('W', 'weight'): approximate, through its eligibility trace (hidden group 0):
          - hidden group 0's recurrence passes through a weight operation (a recurrent weight mixing
            hidden units), which the diagonal scope leaves out of D: it keeps only each unit's own
            element-wise dependence
    """

    def __init__(self, graph: ETraceGraph, labels: Iterable[ExactnessLabel] | None = None,
                 plain_labels: Iterable[ExactnessLabel] | None = None) -> None:
        self.graph = graph
        self._labels = _checked_labels(graph, labels)
        self._plain_labels = _checked_plain_labels(self.excluded_weights, plain_labels)

    @property
    def hidden_groups(self) -> list[tuple[int, list[Path]]]:
        """``(index, member paths)`` per group."""
        return [(g.index, list(g.hidden_paths)) for g in self.graph.hidden_groups]

    @property
    def etrace_weights(self) -> list[tuple[Path, list[int]]]:
        """``(path, group indices)`` per trainable key of every relation.

        As in 0.2.4, a weight and its bias are two entries, also when one ``ParamState`` holds
        both (a GRU's three gates give four entries for two traced states); the text of
        :meth:`to_str` lists the same entries, with their keys.
        """
        return [
            (path, [g.index for g in rel.hidden_groups])
            for rel in self.graph.hidden_param_op_relations
            for path in rel.trainable_paths.values()
        ]

    @property
    def excluded_weights(self) -> list[tuple[Path, str | None]]:
        """``(path, reason)`` per ``ParamState`` that learns through no relation."""
        included = {p for rel in self.graph.hidden_param_op_relations for p in rel.trainable_paths.values()}
        out = []
        for path, state in self.graph.module_info.retrieved_model_states.items():
            if isinstance(state, brainstate.ParamState) and path not in included:
                out.append((path, self._exclusion_reason(path)))
        return out

    @property
    def read_past_update(self) -> list[tuple[int, list[Path]]]:
        """The hidden groups an output of the step reads other than through their new values (a
        pre-reset spike, an old value fed to another group), with their paths."""
        return [(int(r.context["group"]), list(r.hidden_paths)) for r in self.graph.diagnostics
                if r.kind is DiagnosticKind.OUTPUT_READS_PAST_UPDATE and r.context is not None]

    def _exclusion_reason(self, path: Path) -> str | None:
        for record in self.graph.diagnostics:
            if record.weight_path == path and record.kind in _EXCLUSION_KINDS:
                return str(record.kind.value)
        return None

    @property
    def dynamic_states(self) -> list[Path]:
        """``ShortTermState`` paths that belong to no hidden group."""
        grouped = set(self.graph.hid_path_to_group)
        return [
            path for path, st in self.graph.module_info.retrieved_model_states.items()
            if isinstance(st, brainstate.ShortTermState) and path not in grouped
        ]

    @property
    def diagnostics(self) -> tuple[CompilationRecord, ...]:
        return tuple(self.graph.diagnostics)

    @property
    def exactness(self) -> tuple[ExactnessLabel, ...]:
        """The learner's :class:`ExactnessLabel` per relation (empty for a report of a bare graph)."""
        return self._labels

    @property
    def weight_exactness(self) -> dict[Path, ExactnessLabel]:
        """``path -> ExactnessLabel`` of every labelled weight, in model order: a relation weight's
        label (its relations' merged, when it trains several), or its plain label."""
        by_path: dict[Path, list[ExactnessLabel]] = {}
        for label in (*self._labels, *self._plain_labels):
            for path in label.weight_paths:
                by_path.setdefault(path, []).append(label)
        order = [p for p, st in self.graph.module_info.retrieved_model_states.items() if p in by_path]
        return {path: _merged(path, by_path[path]) for path in order}

    @property
    def counts(self) -> dict[str, int]:
        levels = [r.level for r in self.graph.diagnostics]
        return {
            "hidden_groups": len(self.graph.hidden_groups),
            "etrace_weights": len(self.etrace_weights),
            "excluded_weights": len(self.excluded_weights),
            "warnings": levels.count(DiagnosticLevel.WARNING),
            "errors": levels.count(DiagnosticLevel.ERROR),
        }

    def to_str(self, level: int = 1) -> str:
        """The report as text; ``level >= 2`` adds every weight's exactness with its reasons (when
        labelled) and the compiler's warnings and errors."""
        sections = ["=" * 120]
        lines = ["The hidden groups are:"]
        lines += [f"   Group {i}: {paths}" for i, paths in self.hidden_groups]
        sections.append("\n".join(lines))
        if self.dynamic_states:
            lines = ["The dynamic (non-hidden) states are:"]
            lines += [f"   Dynamic state {i}: {p}" for i, p in enumerate(self.dynamic_states)]
            sections.append("\n".join(lines))
        relations = self.graph.hidden_param_op_relations
        if relations:
            # One line per trainable key, like etrace_weights and counts (a weight and its bias
            # are two entries, also when one ParamState holds both).
            lines = ["The weight parameters which are associated with the hidden states are:"]
            keyed = [(key, path, rel) for rel in relations for key, path in rel.trainable_paths.items()]
            for i, (key, path, rel) in enumerate(keyed):
                lines.append(f"   Weight {i}: {path} ({key!r})  is associated with hidden {_groups_of(rel)}")
            sections.append("\n".join(lines))
        if self._labels:
            lines = ["Exactness of the online gradient per relation (single step, or windows with the trace "
                     "entering each window):"]
            for i, (label, rel) in enumerate(zip(self._labels, relations)):
                lines.append(f"   Relation {i}: {label.weight_path} -> hidden {_groups_of(rel)} "
                             f"{list(label.hidden_paths)}: {label.describe()}")
            sections.append("\n".join(lines))
        if self.read_past_update:
            lines = ["Outputs read these hidden groups other than through their new values; single-step "
                     "learners meet their entering traces with dL/dh^(t-1) through every path of the step:"]
            lines += [f"   Group {i}: {paths}" for i, paths in self.read_past_update]
            sections.append("\n".join(lines))
        if self.excluded_weights:
            lines = ["The non-etrace weight parameters are:"]
            for i, (path, reason) in enumerate(self.excluded_weights):
                lines.append(f"   Weight {i}: {path}" + (f"  (excluded: {reason})" if reason else ""))
            sections.append("\n".join(lines))
        if level >= 2 and self.weight_exactness:
            sections.append(self._weight_section())
        issues = [r for r in self.graph.diagnostics if r.level is not DiagnosticLevel.INFO]
        if level >= 2 and issues:
            lines = ["Compiler diagnostics (warnings / errors):"]
            lines += [f"   [{r.level.value}] {r.kind.value}: {r.message}" for r in issues]
            sections.append("\n".join(lines))
        return "\n\n".join(sections)

    def _weight_section(self) -> str:
        """Every labelled weight: exact or approximate, how it learns, and each reason on its own line."""
        traced: dict[Path, list[int]] = {}
        for rel in self.graph.hidden_param_op_relations:
            for p in dict.fromkeys(rel.trainable_paths.values()):
                traced.setdefault(p, []).extend(g.index for g in rel.hidden_groups)
        excluded = dict(self.excluded_weights)
        lines = ["Exactness of the online gradient per weight (single step, or windows with the trace "
                 "entering each window):"]
        for path, label in self.weight_exactness.items():
            verdict = "exact" if label.exact else "approximate"
            if path in traced:
                groups = sorted(set(traced[path]))
                how = "through its eligibility trace (hidden " + (
                    f"group {groups[0]})" if len(groups) == 1 else f"groups {groups})")
                how += ", which holds all of its influence on later steps" if label.exact else ""
            elif label.exact:
                how = ("without an eligibility trace: it reaches no state, so its gradient within each step is "
                       "all of BPTT's")
            else:
                how = "without an eligibility trace" + (f" (excluded: {excluded[path]})" if excluded.get(path) else "")
            lines.append(f"   {path}: {verdict}, {how}" + (":" if label.reasons else ""))
            lines += [_bullet(reason) for reason in label.reasons]
        return "\n".join(lines)

    def show(self, level: int = 1, *, file: TextIO | None = None) -> None:
        """Print :meth:`to_str`."""
        print(self.to_str(level), file=file if file is not None else sys.stdout)

    def __repr__(self) -> str:
        c = self.counts
        return (
            f"CompilationReport(hidden_groups={c['hidden_groups']}, etrace_weights={c['etrace_weights']}, "
            f"excluded_weights={c['excluded_weights']}, warnings={c['warnings']}, errors={c['errors']})"
        )


CompilationReport.__module__ = "braintrace"


def _groups_of(relation: HiddenParamOpRelation) -> str:
    """``'group 0'`` or ``'groups [0, 1]'``: the hidden groups a relation drives."""
    idx = [g.index for g in relation.hidden_groups]
    return f"group {idx[0]}" if len(idx) == 1 else f"groups {idx}"


def _bullet(reason: str, width: int = 100) -> str:
    """``reason`` as an indented ``-`` item, wrapped at ``width`` characters."""
    return "\n".join(textwrap.wrap(reason, width, initial_indent="      - ", subsequent_indent="        "))


def _merged(path: Path, labels: list[ExactnessLabel]) -> ExactnessLabel:
    """One weight's label from those of the relations it trains (or its plain label): exact when all are."""
    reasons = tuple(dict.fromkeys(r for label in labels for r in label.reasons))
    hidden = tuple(dict.fromkeys(h for label in labels for h in label.hidden_paths))
    return ExactnessLabel(path, (path,), hidden, not reasons, reasons)


def _checked_plain_labels(excluded: list[tuple[Path, str | None]],
                          labels: Iterable[ExactnessLabel] | None) -> tuple[ExactnessLabel, ...]:
    if labels is None:
        return ()
    labels = tuple(labels)
    for label in labels:
        if not isinstance(label, ExactnessLabel):
            raise TypeError(
                f"CompilationReport: plain_labels must be ExactnessLabel objects, got {type(label).__name__}.")
    paths = [path for path, _ in excluded]
    if [label.weight_paths for label in labels] != [(path,) for path in paths]:
        raise ValueError(
            f"CompilationReport: the {len(labels)} plain label(s) do not match the graph's {len(paths)} weight(s) "
            f"outside every relation one by one ({paths}, in model order); label the learner that compiled this "
            f"graph, e.g. learner.report.")
    return labels


def _checked_labels(graph: ETraceGraph, labels: Iterable[ExactnessLabel] | None) -> tuple[ExactnessLabel, ...]:
    if labels is None:
        return ()
    labels = tuple(labels)
    for label in labels:
        if not isinstance(label, ExactnessLabel):
            raise TypeError(f"CompilationReport: labels must be ExactnessLabel objects, got {type(label).__name__}.")
    relations = graph.hidden_param_op_relations
    if len(labels) != len(relations) or any(
            label.weight_path != rel.path or label.hidden_paths != tuple(rel.connected_hidden_paths)
            for label, rel in zip(labels, relations)):
        raise ValueError(
            f"CompilationReport: the {len(labels)} label(s) do not match the graph's {len(relations)} relation(s) "
            f"one by one (weight path and hidden paths, in relation order); label the learner that compiled "
            f"this graph, e.g. learner.report.")
    return labels

