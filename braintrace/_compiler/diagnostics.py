"""Structured compiler diagnostics: what the compiler decided, and why.

Every decision that changes what learns online (a relation registered or excluded, a cond
converted, a scan unrolled, ...) is recorded as a :class:`CompilationRecord` on the active
:class:`DiagnosticReporter`. Warnings and errors are also raised as Python ``UserWarning``s,
so they surface even when no reporter collects them.

Examples
--------
>>> from braintrace._compiler.diagnostics import (
...     DiagnosticKind, DiagnosticLevel, diagnostic_context, emit)
>>> with diagnostic_context() as reporter:
...     record = emit(DiagnosticKind.HIDDEN_GROUP_MERGED, DiagnosticLevel.INFO, 'merged h1 and h2',
...                   hidden_paths=(('h1',), ('h2',)))
>>> len(reporter), reporter.records()[0].kind.value
(1, 'hidden_group_merged')
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Iterator, TypedDict

from braintrace._compatible_imports import Primitive
from braintrace._typing import Path

__all__ = [
    "DiagnosticLevel",
    "DiagnosticKind",
    "CompilationRecord",
    "DiagnosticContext",
    "DiagnosticReporter",
    "diagnostic_context",
    "emit",
    "get_reporter",
]


class DiagnosticLevel(str, Enum):
    """Severity of a :class:`CompilationRecord`.

    Examples
    --------
    >>> import braintrace
    >>> [level.value for level in braintrace.DiagnosticLevel]
    ['info', 'warning', 'error']
    """

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class DiagnosticKind(str, Enum):
    """What a :class:`CompilationRecord` is about; the value is the lower-case name.

    Examples
    --------
    >>> import braintrace
    >>> braintrace.DiagnosticKind('scan_unrolled') is braintrace.DiagnosticKind.SCAN_UNROLLED
    True
    """

    RELATION_INCLUDED = "relation_included"
    RELATION_EXCLUDED_NO_PARAMSTATE = "relation_excluded_no_paramstate"
    RELATION_EXCLUDED_NON_TEMPORAL = "relation_excluded_non_temporal"
    RELATION_EXCLUDED_SHAPE_MISMATCH = "relation_excluded_shape_mismatch"
    RELATION_EXCLUDED_WEIGHT_TO_WEIGHT = "relation_excluded_weight_to_weight"
    RELATION_PARTIAL_PATH = "relation_partial_path"
    TRAINABLE_INVAR_NOT_PARAMSTATE = "trainable_invar_not_paramstate"
    COND_IF_CONVERTED = "cond_if_converted"
    COND_CONVERSION_SKIPPED = "cond_conversion_skipped"
    SCAN_UNROLLED = "scan_unrolled"
    SCAN_UNROLL_SKIPPED = "scan_unroll_skipped"
    RELATION_EXCLUDED_SLICED_WEIGHT = "relation_excluded_sliced_weight"
    SCAN_DESCENT_APPLIED = "scan_descent_applied"
    SCAN_DESCENT_SKIPPED = "scan_descent_skipped"
    SCAN_DESCENT_NO_RELATIONS = "scan_descent_no_relations"
    WEIGHT_IN_WHILE = "weight_in_while"
    CONTROL_FLOW_OPAQUE_FWD = "control_flow_opaque_fwd"
    CONTROL_FLOW_RECURRENT_MIXING = "control_flow_recurrent_mixing"
    PRIMITIVE_INSIDE_NESTED_JIT = "primitive_inside_nested_jit"
    PRIMITIVE_INSIDE_CONTROL_FLOW = "primitive_inside_control_flow"
    MULTI_OUTPUT_PRIMITIVE_DETECTED = "multi_output_primitive_detected"
    PYTREE_WEIGHT_LEAF_AMBIGUOUS = "pytree_weight_leaf_ambiguous"
    #: Reserved; no pass emits it.
    TRANSITION_TAIL_BOUNDED = "transition_tail_bounded"
    HIDDEN_GROUP_MERGED = "hidden_group_merged"
    STATE_MISMATCH = "state_mismatch"
    WEIGHT_IN_CONTROL_FLOW = "weight_in_control_flow"
    WEIGHT_DRIVES_HIDDEN_UNTRACED = "weight_drives_hidden_untraced"
    #: An output of the step reads a hidden group other than through its new value (INFO).
    OUTPUT_READS_PAST_UPDATE = "output_reads_past_update"
    #: SnAp-n could not read a group's adjacency and follows every position (WARNING).
    SNAP_PATTERN_CONSERVATIVE = "snap_pattern_conservative"
    #: SnAp-n at n >= 2 finds no neighbour to widen onto (K = 1).
    SNAP_PATTERN_DEGENERATE = "snap_pattern_degenerate"
    #: A relation's y -> h tail moves values to other positions under a non-diagonal scope
    #: (coupled, sparse_n, random projection): no scope reaches BPTT there (WARNING).
    TAIL_RELABELS_POSITIONS = "tail_relabels_positions"


class DiagnosticContext(TypedDict, total=False):
    """The machine-readable details of a :class:`CompilationRecord`: each kind fills the ones it has.

    Examples
    --------
    >>> from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
    >>> emit(DiagnosticKind.SCAN_DESCENT_SKIPPED, DiagnosticLevel.INFO, 'kept', also_warn=False,
    ...      context={'blocker': 'a reverse scan', 'length': 40}).context['length']
    40
    """

    #: Where a while loop was met (``'perturbation'``) and how many of its inputs were detached.
    site: str
    n_detached: int
    #: The index of the hidden group concerned.
    group: int
    #: A trainable operand left out: its name and its position in the equation.
    key: str
    invar_index: int
    #: The shapes of an output and of a hidden state it does not lay over.
    y_shape: tuple[int, ...]
    hidden_shape: tuple[int, ...]
    #: A relation registered: its groups, how it reaches each hidden state, the weights it crosses.
    hidden_group_indices: list[int]
    path_classification: dict[Path, str]
    crossed_weight_paths: list[Path]
    #: The trainable operations (and their weights) between a weight and the hidden states.
    blocking_primitives: list[Primitive]
    blocking_weight_paths: list[Path]
    #: A state found by only one of the two state collections, and which one.
    direction: str
    path: Path
    #: A weight-free operation computing a hidden state, and the evaluator that met it.
    op_name: str
    evaluator: str
    hidden_path: Path | None
    #: A converted cond, an unrolled or descended scan, and why it was (or was not).
    n_branches: int
    n_outputs: int
    reason: str | None
    relevance: str
    length: int
    num_consts: int
    num_carry: int
    reverse: bool
    blocker: str
    weight_paths: list[Path]
    #: The SnAp neighbourhood size ``K``.
    num_neighbour: int


@dataclass(frozen=True)
class CompilationRecord:
    """One compiler decision.

    Attributes
    ----------
    kind : DiagnosticKind
    level : DiagnosticLevel
    message : str
        A sentence a user can act on.
    primitive : jax primitive, optional
        The ETP primitive concerned.
    weight_path : tuple, optional
        Path of the ``ParamState`` concerned.
    hidden_paths : tuple of tuples
        Paths of the hidden states concerned.
    context : DiagnosticContext, optional
        Machine-readable details (e.g. ``blocking_primitives``).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> record, = braintrace.compile_etrace_graph(cell, jnp.ones(3)).diagnostics
    >>> record.kind.name, record.level.name, record.weight_path, record.hidden_paths
    ('RELATION_INCLUDED', 'INFO', ('W', 'weight'), (('h',),))
    """

    kind: DiagnosticKind
    level: DiagnosticLevel
    message: str
    primitive: Primitive | None = None
    weight_path: Path | None = None
    hidden_paths: tuple[Path, ...] = ()
    context: DiagnosticContext | None = None

    def __repr__(self) -> str:
        parts = [f"kind={self.kind.name}", f"level={self.level.name}"]
        if self.primitive is not None:
            parts.append(f"primitive={self.primitive.name}")
        if self.weight_path is not None:
            parts.append(f"weight_path={self.weight_path}")
        if self.hidden_paths:
            parts.append(f"hidden_paths={self.hidden_paths}")
        parts.append(f"message={self.message!r}")
        if self.context:
            parts.append(f"context={self.context}")
        return f"CompilationRecord({', '.join(parts)})"


CompilationRecord.__module__ = "braintrace"
DiagnosticKind.__module__ = "braintrace"
DiagnosticLevel.__module__ = "braintrace"


class DiagnosticReporter:
    """Collects the records emitted while one graph compiles."""

    def __init__(self) -> None:
        self._records: list[CompilationRecord] = []

    def append(self, record: CompilationRecord) -> None:
        self._records.append(record)

    def records(self) -> tuple[CompilationRecord, ...]:
        return tuple(self._records)

    def __len__(self) -> int:
        return len(self._records)


_local = threading.local()


def get_reporter() -> DiagnosticReporter | None:
    """The reporter of the innermost active :func:`diagnostic_context` on this thread."""
    return getattr(_local, "reporter", None)


@contextlib.contextmanager
def diagnostic_context() -> Iterator[DiagnosticReporter]:
    """Collect every record emitted inside the ``with`` block (nested blocks restore)."""
    previous = get_reporter()
    reporter = DiagnosticReporter()
    _local.reporter = reporter
    try:
        yield reporter
    finally:
        _local.reporter = previous


def emit(
    kind: DiagnosticKind,
    level: DiagnosticLevel,
    message: str,
    *,
    primitive: Primitive | None = None,
    weight_path: Path | None = None,
    hidden_paths: tuple[Path, ...] = (),
    context: DiagnosticContext | None = None,
    also_warn: bool = True,
    stacklevel: int = 3,
) -> CompilationRecord:
    """Record a decision; warnings and errors are also issued as ``UserWarning``."""
    record = CompilationRecord(
        kind=kind,
        level=level,
        message=message,
        primitive=primitive,
        weight_path=weight_path,
        hidden_paths=tuple(hidden_paths),
        context=context,
    )
    reporter = get_reporter()
    if reporter is not None:
        reporter.append(record)
    if also_warn and level is not DiagnosticLevel.INFO:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
    return record
