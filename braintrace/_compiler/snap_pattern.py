"""SnAp-n sparsity patterns: which hidden positions a widened eligibility trace follows.

SnAp-n (Menick et al., 2021) keeps RTRL's influence recursion ``J^t = D^t J^{t-1} + I^t`` but
masks ``J`` to the pattern of the instantaneous term propagated ``n - 1`` times,
``S_n = nz(⋁_{k<n} A^k)`` with ``A[q, p]`` = "``h_q^t`` reads ``h_p^{t-1}``". A parameter whose
trace slot lands on hidden position ``p`` keeps its influence on the **column** ``p`` of the
closure: the positions ``p`` reaches within ``n - 1`` steps (``p`` itself first).

This module owns

* the boolean closure of a group's one-step adjacency **per axis** of its ``varshape`` (a batch
  axis stays the identity) and the padded neighbour table, :class:`SnapPattern`
  (:func:`snap_pattern`, :func:`analyse_group`; the adjacency itself is read by
  :func:`~braintrace._compiler.position_dependence.group_adjacency`);
* the widening of the quantities a per-parameter trace is rolled with: the gathered block
  Jacobian ``Dg (*varshape, K·S, K·S)`` (:func:`widened_jacobian`), the learning signal gathered
  onto the neighbour slots (:func:`gather_signal`) and ``df`` zero-padded into slot 0
  (:func:`pad_states`);
* what ``compile_etrace_graph(..., sparse_n=n)`` checks and attaches: the arguments, the
  anchors of the relations, the refusal of descended scans, the Jacobian budget and the
  diagnostics (:func:`trained_group_patterns`).

The factorised closure is exact with at most one non-identity axis and a superset otherwise.
A transition the adjacency walk cannot read makes the whole group all-to-all, flagged
``conservative`` with the reason.

Examples
--------
>>> import numpy as np
>>> from braintrace._compiler.snap_pattern import snap_pattern
>>> ring = np.eye(4, dtype=bool) | np.roll(np.eye(4, dtype=bool), 1, axis=0)  # h_q reads h_q, h_(q-1)
>>> pattern = snap_pattern(3, (4,), (ring,))
>>> pattern.num_neighbour, pattern.neighbours[0].tolist(), pattern.is_saturated
(3, [0, 1, 2], False)
>>> snap_pattern(4, (4,), (ring,)).is_saturated
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, Sequence, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
from braintrace._compiler.position_dependence import AxisPatterns, group_adjacency
from braintrace._errors import NotSupportedError
from braintrace._op._registries import is_snap_anchored
from braintrace._typing import HiddenGroupLike, Path, RelationLike

__all__ = [
    "DEFAULT_MAX_JACOBIAN_ELEMENTS",
    "SnapPattern",
    "snap_pattern",
    "axis_closure",
    "analyse_group",
    "widened_jacobian",
    "tail_within_neighbourhoods",
    "widened_tail_jacobian",
    "gather_signal",
    "pad_states",
    "check_snap_arguments",
    "reject_snap_descent",
    "check_snap_anchors",
    "trained_group_patterns",
]

#: Default ceiling on the widened block Jacobian ``P·(K·S)²`` (``P = K = 256, S = 1`` fits).
DEFAULT_MAX_JACOBIAN_ELEMENTS = 2**24

Array = jax.Array


@dataclass(frozen=True, eq=False)
class SnapPattern:
    """The SnAp-n neighbourhoods of one hidden group.

    Attributes
    ----------
    n : int
        The SnAp order.
    varshape : tuple of int
        The group's positions (without the state axis).
    adjacency : tuple of ndarray
        Per axis of ``varshape``, the one-step adjacency ``A_i[q, p]`` ("index ``q`` reads ``p``").
    axes : tuple of ndarray
        Per axis, the closed pattern ``C_i = ⋁_{k<n} A_i^k`` (boolean).
    neighbours : ndarray
        ``(P, K)`` flat positions: row ``p`` lists the positions ``p`` reaches within ``n - 1``
        steps, ``p`` itself first; short rows repeat ``p``.
    valid : ndarray
        ``(P, K)`` boolean, ``False`` on the padding of short rows.
    conservative : bool
        Whether the adjacency could not be read and was widened to all-to-all.
    reason : str or None
        Why it is conservative.

    Examples
    --------
    >>> import numpy as np
    >>> from braintrace._compiler.snap_pattern import snap_pattern
    >>> pattern = snap_pattern(2, (2, 3), (np.eye(2, dtype=bool), np.ones((3, 3), dtype=bool)))
    >>> pattern.num_position, pattern.num_neighbour  # the batch-like axis stays the identity
    (6, 3)
    """

    n: int
    varshape: tuple[int, ...]
    adjacency: AxisPatterns
    axes: AxisPatterns
    neighbours: np.ndarray
    valid: np.ndarray
    conservative: bool = False
    reason: str | None = None

    @property
    def num_position(self) -> int:
        """``P``: the number of positions."""
        return int(self.neighbours.shape[0])

    @property
    def num_neighbour(self) -> int:
        """``K``: the slots per position (the widest neighbourhood)."""
        return int(self.neighbours.shape[1])

    @property
    def is_degenerate(self) -> bool:
        """``K == 1``: nothing to widen (the order adds no neighbour; SnAp is ``coupled`` here)."""
        return self.num_neighbour == 1

    @property
    def is_saturated(self) -> bool:
        """Whether a higher order would keep the same neighbourhoods (full within-group RTRL)."""
        return all(np.array_equal(c, _close_once(a, c)) for a, c in zip(self.adjacency, self.axes))

    def identity_axes(self) -> tuple[bool, ...]:
        """Per axis, whether its closure is the identity (positions along it never mix)."""
        return tuple(bool(np.array_equal(c, np.eye(len(c), dtype=bool))) for c in self.axes)

    def __repr__(self) -> str:
        extra = f", conservative, reason={self.reason!r}" if self.conservative else ""
        return (f"SnapPattern(n={self.n}, varshape={self.varshape}, P={self.num_position}, "
                f"K={self.num_neighbour}{extra})")


# --- closure and neighbour tables ----------------------------------------------------------


def _close_once(adjacency: np.ndarray, closed: np.ndarray) -> np.ndarray:
    """``I ∨ A·C`` in boolean arithmetic (one more order)."""
    return np.eye(len(adjacency), dtype=bool) | np.matmul(adjacency, closed)


def axis_closure(adjacency: np.ndarray, n: int) -> np.ndarray:
    """``⋁_{k<n} A^k`` of a boolean adjacency (stops early at the fixed point).

    Boolean matrix products cannot overflow: counting paths in integers instead would wrap
    around on long chains and drop entries.

    Examples
    --------
    >>> import numpy as np
    >>> chain = np.eye(3, k=-1, dtype=bool)  # h_q reads h_(q-1)
    >>> axis_closure(chain, 2).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    adjacency = np.asarray(adjacency, dtype=bool)
    closed = np.eye(len(adjacency), dtype=bool)
    for _ in range(n - 1):
        grown = _close_once(adjacency, closed)
        if np.array_equal(grown, closed):
            break
        closed = grown
    return closed


def snap_pattern(
    n: int, varshape: Sequence[int], adjacency: Sequence[np.ndarray], conservative: bool = False,
    reason: str | None = None,
) -> SnapPattern:
    """Close a per-axis adjacency at order ``n`` and lay out the padded neighbour table.

    Parameters
    ----------
    n : int
        The SnAp order (``>= 1``).
    varshape : sequence of int
    adjacency : sequence of ndarray
        Per axis, a boolean ``(V_i, V_i)`` with ``[q, p]`` = "index ``q`` reads index ``p``".
    conservative : bool
    reason : str, optional

    Returns
    -------
    SnapPattern
    """
    varshape = tuple(int(v) for v in varshape)
    adjacency = tuple(np.asarray(a, dtype=bool) for a in adjacency)
    if len(adjacency) != len(varshape) or any(a.shape != (v, v) for a, v in zip(adjacency, varshape)):
        raise ValueError(
            f"snap_pattern: the adjacency needs one square boolean matrix per axis of varshape "
            f"{varshape}, got shapes {[a.shape for a in adjacency]}.")
    axes = tuple(axis_closure(a, n) for a in adjacency)
    neighbours, valid = _neighbour_table(varshape, axes)
    return SnapPattern(n, varshape, adjacency, axes, neighbours, valid, conservative, reason)


def _neighbour_table(varshape: tuple[int, ...], axes: AxisPatterns) -> tuple[np.ndarray, np.ndarray]:
    """``(neighbours, valid)``, both ``(P, K)``: each position's reach, itself first."""
    columns = [[np.flatnonzero(c[:, p]) for p in range(len(c))] for c in axes]
    size = math.prod(max(len(col) for col in cols) for cols in columns) if axes else 1
    positions = math.prod(varshape)
    neighbours = np.repeat(np.arange(positions, dtype=np.int32)[:, None], size, axis=1)
    valid = np.zeros((positions, size), dtype=bool)
    for p, index in enumerate(np.ndindex(*varshape)):
        per_axis = [columns[i][index[i]] for i in range(len(varshape))]
        reach = np.ravel_multi_index(np.ix_(*per_axis), varshape).ravel() if per_axis else np.zeros(1, np.int64)
        reach = np.concatenate([[p], np.sort(reach[reach != p])])
        neighbours[p, :len(reach)] = reach
        valid[p, :len(reach)] = True
    return neighbours, valid


# --- a group's pattern ------------------------------------------------------------------


def analyse_group(group: HiddenGroupLike, n: int) -> SnapPattern:
    """:func:`snap_pattern` of ``group``'s transition at order ``n``."""
    adjacency, reason = group_adjacency(group)
    return snap_pattern(n, group.varshape, adjacency, conservative=reason is not None, reason=reason)


# --- widening --------------------------------------------------------------------------------


def _flat_index_on(pattern: SnapPattern, keep: Sequence[int]) -> np.ndarray:
    """``(P, K)``: each neighbour's flat index over the axes ``keep`` only."""
    coords = np.unravel_index(pattern.neighbours, pattern.varshape)
    sizes = [pattern.varshape[i] for i in keep]
    if not keep:
        return np.zeros_like(pattern.neighbours)
    return np.ravel_multi_index(tuple(coords[i] for i in keep), sizes).astype(np.int32)


def widened_jacobian(fn: Callable[[Array], Array], stacked: Array, pattern: SnapPattern) -> Array:
    """``Dg (*varshape, K·S, K·S)``: the within-group Jacobian gathered onto the neighbour slots.

    ``Dg[p, (k, a), (k', b)] = ∂h^t[nbr[p, k], a] / ∂h^{t-1}[nbr[p, k'], b]`` on valid slots, zero
    on padding. ``fn`` maps the stacked group ``(*varshape, S)`` to its next value. Forward-mode
    probes are summed along the axes whose closure is the identity (a batch axis): positions
    that never mix share a probe, so the probes number ``S·∏(mixing axes)`` and the dense
    ``(P·S)²`` Jacobian is materialised only when every axis mixes.
    """
    varshape, num_state = pattern.varshape, stacked.shape[-1]
    mixing = [i for i, ident in enumerate(pattern.identity_axes()) if not ident]
    mixing_sizes = [varshape[i] for i in mixing]
    num_probe = math.prod(mixing_sizes) * num_state
    basis = jnp.eye(num_probe, dtype=stacked.dtype).reshape(num_probe, *mixing_sizes, num_state)
    expand = [1 + i for i in range(len(varshape)) if i not in mixing]
    basis = jnp.broadcast_to(jnp.expand_dims(basis, expand) if expand else basis, (num_probe, *varshape, num_state))
    columns = jax.vmap(lambda t: jax.jvp(fn, (stacked,), (t,))[1])(basis)  # [(r, b), *varshape, a]
    positions = pattern.num_position
    compact = columns.reshape(num_probe // num_state, num_state, positions, num_state)
    compact = jnp.transpose(compact, (2, 3, 0, 1))  # [q, a, r, b] = ∂h[q, a] / ∂h[(q off the mixing axes, r), b]
    rows = pattern.neighbours
    cols = _flat_index_on(pattern, mixing)
    gathered = compact[rows[:, :, None], :, cols[:, None, :], :]  # [p, k, k', a, b]
    size = pattern.num_neighbour * num_state
    dg = jnp.transpose(gathered, (0, 1, 3, 2, 4)).reshape(positions, size, size)
    mask = jnp.asarray(np.repeat(pattern.valid, num_state, axis=1), dtype=dg.dtype)
    dg = dg * mask[:, :, None] * mask[:, None, :]
    return dg.reshape(*varshape, size, size)


def tail_within_neighbourhoods(reach: Sequence[np.ndarray], pattern: SnapPattern) -> bool:
    """Whether a ``y -> h`` tail delivers ``y[p]`` only inside ``p``'s neighbourhood.

    ``reach`` is the tail's per-axis dependence ``R_i[q, p]`` (hidden index ``q`` reads ``y``
    index ``p``; see :func:`~braintrace._compiler.position_dependence.tail_reach`). Both it and
    the neighbourhoods are products over the axes, so containment holds axis by axis.
    """
    return all(bool(np.all(~r | c)) for r, c in zip(reach, pattern.axes))


def widened_tail_jacobian(
    fn: Callable[[Array], Array], y: Array, pattern: SnapPattern, identity_axes_kept: bool,
) -> Array:
    """``(*varshape, K·S)``: ``df[p, (k, a)] = ∂h^t[nbr[p, k], a] / ∂y[p]`` on valid slots, zero on padding.

    The instantaneous term of a relation whose ``y -> h`` tail moves ``y[p]`` to other positions
    (a roll, a mix through another trainable operation): the tail's Jacobian gathered onto
    ``p``'s neighbourhood, what the SnAp mask keeps of it. ``fn`` maps ``y`` (laid out over
    ``varshape``) to the stacked group ``(*varshape, S)``. With ``identity_axes_kept`` (the tail
    never moves a value along an axis whose closure is the identity) the forward-mode probes are
    summed along those axes, as in :func:`widened_jacobian`; otherwise one probe per position.
    """
    varshape = pattern.varshape
    identity = pattern.identity_axes()
    probed = [i for i in range(len(varshape)) if not (identity_axes_kept and identity[i])]
    sizes = [varshape[i] for i in probed]
    num_probe = math.prod(sizes)
    basis = jnp.eye(num_probe, dtype=y.dtype).reshape(num_probe, *sizes)
    spread = [1 + i for i in range(len(varshape)) if i not in probed]
    basis = jnp.broadcast_to(jnp.expand_dims(basis, spread) if spread else basis, (num_probe, *varshape))
    columns = jax.vmap(lambda t: jax.jvp(fn, (y,), (t,))[1])(basis)  # [r, *varshape, a]
    num_state = columns.shape[-1]
    columns = columns.reshape(num_probe, pattern.num_position, num_state)
    probe_of = _flat_index_on(pattern, probed)[:, :1]  # each position's probe: its own coordinates
    gathered = columns[probe_of, pattern.neighbours, :]  # [p, k, a] = ∂h[nbr[p, k], a] / ∂y[p]
    gathered = gathered * jnp.asarray(pattern.valid, dtype=gathered.dtype)[..., None]
    return gathered.reshape(*varshape, pattern.num_neighbour * num_state)


def gather_signal(signal: Array, pattern: SnapPattern) -> Array:
    """``(*varshape, S) -> (*varshape, K·S)``: ``sig[p, (k, a)] = g[nbr[p, k], a]`` on valid slots.

    Leading axes beyond ``varshape`` (none in the learners) are not supported.
    """
    num_state = signal.shape[-1]
    flat = signal.reshape(pattern.num_position, num_state)
    gathered = flat[pattern.neighbours] * jnp.asarray(pattern.valid, dtype=signal.dtype)[..., None]
    return gathered.reshape(*pattern.varshape, pattern.num_neighbour * num_state)


def pad_states(value: Array, num_neighbour: int) -> Array:
    """``(..., S) -> (..., K·S)`` with ``value`` in slot 0 and zeros in the neighbour slots."""
    if num_neighbour == 1:
        return value
    pad = [(0, 0)] * (value.ndim - 1) + [(0, (num_neighbour - 1) * value.shape[-1])]
    return jnp.pad(value, pad)


# --- what compile_etrace_graph does with it ------------------------------------------------


def check_snap_arguments(sparse_n: object, include_recurrent_mixing: bool, max_elements: object) -> None:
    """Refuse a bad ``sparse_n`` / ``snap_max_jacobian_elements`` of :func:`compile_etrace_graph`.

    Raises
    ------
    TypeError
        If ``sparse_n`` or the ceiling is a ``bool`` or not an integer.
    ValueError
        If ``sparse_n < 1``, the ceiling is not positive, or ``sparse_n`` is given without
        ``include_recurrent_mixing=True``.
    """
    if sparse_n is not None and not _is_int(sparse_n):
        raise TypeError(f"compile_etrace_graph: sparse_n must be an int, got {sparse_n!r}.")
    if not _is_int(max_elements):
        raise TypeError(f"compile_etrace_graph: snap_max_jacobian_elements must be an int, got {max_elements!r}.")
    if sparse_n is not None and sparse_n < 1:
        raise ValueError(
            f"compile_etrace_graph: sparse_n must be >= 1 (n = 1 is the coupled scope; the diagonal "
            f"scope is not n = 0), got {sparse_n}.")
    if max_elements < 1:
        raise ValueError(f"compile_etrace_graph: snap_max_jacobian_elements must be positive, got {max_elements}.")
    if sparse_n is not None and not include_recurrent_mixing:
        raise ValueError(
            "compile_etrace_graph: sparse_n needs include_recurrent_mixing=True: SnAp-n follows the "
            "recurrent mixing, which the diagonal scope cuts out of the transitions.")


def _is_int(value: object) -> TypeGuard[int | np.integer]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def reject_snap_descent(sparse_n: int, descended_paths: Collection[Path]) -> None:
    """SnAp needs the within-group Jacobian of a whole step; a descended scan folds substeps."""
    if descended_paths:
        raise NotImplementedError(
            f"SnAp (sparse_n={sparse_n}) cannot follow hidden states {sorted(descended_paths, key=str)} "
            f"carried by a descended scan. Unroll the loop with ControlFlowPolicy(scan_descent='off', "
            f"scan_unroll_limit=N), N at least its length, or learn with D_RTRL.")


def check_snap_anchors(relations: Sequence[RelationLike], sparse_n: int) -> None:
    """Every relation's traces must land on single hidden positions to be widened (at any order)."""
    for rel in relations:
        if not is_snap_anchored(rel.primitive, rel.eqn_params):
            raise NotImplementedError(
                f"SnAp (sparse_n={sparse_n}) cannot widen the trace of `{rel.primitive.name}` "
                f"(parameter {rel.path}): its trace slots are not anchored to single hidden "
                f"positions. The same model compiles with D_RTRL (diagonal) or OSTLRecurrent "
                f"(coupled); a primitive of your own can declare snap_anchor=... in register_etp_rules.")


def trained_group_patterns(
    groups: Sequence[HiddenGroupLike], relations: Sequence[RelationLike], n: int, max_elements: int,
) -> dict[int, SnapPattern]:
    """The :class:`SnapPattern` of every group a relation trains, by group index.

    Emits ``SNAP_PATTERN_CONSERVATIVE`` (WARNING) for a group whose adjacency could not be read,
    ``SNAP_PATTERN_DEGENERATE`` (INFO) for a group without neighbours. (A ``y -> h`` tail that
    relabels positions is reported for every non-diagonal scope, see
    :func:`~braintrace._compiler.position_dependence.warn_relabelling_tails`.)

    Raises
    ------
    NotSupportedError
        If a group's widened block Jacobian ``P·(K·S)²`` exceeds ``max_elements``.
    """
    trained = {g.index for rel in relations for g in rel.hidden_groups}
    patterns = {}
    for group in groups:
        if group.index not in trained:
            continue
        pattern = analyse_group(group, n)
        _report(group, pattern)
        _check_budget(group, pattern, max_elements)
        patterns[group.index] = pattern
    return patterns


def _report(group: HiddenGroupLike, pattern: SnapPattern) -> None:
    where = f"hidden group {group.index} {group.hidden_paths}"
    if pattern.conservative:
        emit(DiagnosticKind.SNAP_PATTERN_CONSERVATIVE, DiagnosticLevel.WARNING,
             f"SnAp-{pattern.n}: the neighbourhoods of {where} are taken all-to-all (K = "
             f"{pattern.num_neighbour}) because {pattern.reason}. The trace stays correct (a "
             f"superset of the SnAp pattern) but costs more; write the recurrence with "
             f"braintrace.matmul / sparse_matmul, or register a snap_adjacency rule.",
             hidden_paths=tuple(group.hidden_paths),
             context={"reason": pattern.reason, "num_neighbour": pattern.num_neighbour})
    elif pattern.is_degenerate:
        emit(DiagnosticKind.SNAP_PATTERN_DEGENERATE, DiagnosticLevel.INFO,
             f"SnAp-{pattern.n}: {where} has no neighbour to widen onto (K = 1, no position reads "
             f"another); SnAp equals the coupled scope (OSTLRecurrent) there.",
             hidden_paths=tuple(group.hidden_paths), context={"num_neighbour": 1})


def _check_budget(group: HiddenGroupLike, pattern: SnapPattern, max_elements: int) -> None:
    positions, size, states = pattern.num_position, pattern.num_neighbour, group.num_state
    count = positions * (size * states) ** 2
    if pattern.is_degenerate or count <= max_elements:
        return
    raise NotSupportedError(
        f"SnAp-{pattern.n}: hidden group {group.index} {group.hidden_paths} needs a widened block "
        f"Jacobian of P·(K·S)² = {positions}·({size}·{states})² = {count:,} elements, above "
        f"snap_max_jacobian_elements={max_elements:,}. Use a smaller n, the coupled scope "
        f"(SnAp(n=1) or OSTLRecurrent), or raise snap_max_jacobian_elements.")
