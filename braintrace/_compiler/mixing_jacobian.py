"""Per-position Jacobian blocks of hidden transitions that mix positions through dense weights.

With ``include_recurrent_mixing=True`` a group's transition may contain mixing ops (``h @ W``,
``braintrace.matmul(s, W)``, ``concatenate([x, h]) @ W``, ``braintrace.conv``,
``braintrace.sparse_matmul``): the Jacobian
``∂h^t/∂h^{t-1}`` is then dense over positions, yet the learners only need its per-position
``(S, S)`` blocks ``D[p, a, b] = ∂h^t[p, a] / ∂h^{t-1}[p, b]``. Materialising the dense
``(P·S)²`` Jacobian to read its diagonal blocks costs quadratic memory in the number of
positions ``P`` (batch × neurons).

This module computes the blocks exactly without it, in one forward-mode pass per state:

1. A static analysis labels every element of every transition variable with the position it
   belongs to (``-1`` for none), following element-wise ops, within-position reductions and
   the structural ops (concatenate, slice, reshape, broadcast, transpose, ...), and counts the
   mixing ops each value has crossed.
2. A mixing equation ``z = x @ W`` whose input ``x`` has crossed none keeps only the
   same-position part of its Jacobian: ``ż[..., n] = Σ_k [pos(x_k) = pos(z_n)] W[k, n] ẋ[..., k]``
   (for the usual layouts a gather and a scale, ``O(P)``). A convolution (stride 1) keeps the
   kernel's tap that reads the output's own location, between the channels at one position:
   one convolution of ``ẋ`` with that masked kernel. A sparse product keeps its stored entries
   that join a position to itself (a connectome's self-connections): a gather and a scatter
   over those entries only.
3. Two mixings in series (a GRU's ``r = σ([x, h] W_r)`` read by ``[x, r h] W_h``): the block of a
   product of dense maps is not the product of their blocks, since the path from ``h[p]`` back to
   ``h[p]`` may pass through any position ``q`` in between. With ``x`` the first mixing's input
   (one column ``i(p)`` per position), ``k_g(q)`` its output column of slot ``g`` (a gate) at
   ``q``, and ``m_g`` the element-wise derivative from that slot to the second mixing's input
   ``y``, the second mixing's output column ``l`` at position ``p`` moves by

   ``ż[l] = ẋ[i(p)] · Σ_g Σ_j m_g[j] H_g[j, l]``,  ``H_g[j, l] = W₁[i(p), k_g(pos j)] · W₂[j, l]``,

   one product with a weight-only matrix per slot, ``O(P·N)`` like the mixing itself. The
   forward pass carries the tangent in parts: the unmixed part, the same-position part of
   mixed values (which may not enter another mixing), and per first mixing and slot the
   derivative ``m_g`` seeded with ones on that slot's columns.
4. ``jacfwd`` with the tangent ``e_b`` set at every position at once then yields exactly the
   diagonal blocks.

This is exact when every path from ``h^{t-1}`` to ``h^t`` crosses at most two mixing ops (a
convolution or a sparse product only one), a first mixing read by a second reads one column per position, and the
analysis recognises every op on the way; :func:`block_diagonal_plan` returns ``None`` otherwise and the caller falls back
to the general (slower, still exact) per-position probing of
:func:`braintrace._compiler.hidden_group.block_diagonal_last_dim`.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from braintrace._compiler.mixing_jacobian import block_diagonal_plan, structured_block_diagonal
>>> W = jnp.array([[0.5, 2.0], [3.0, 0.25]])
>>> closed = jax.make_jaxpr(lambda h: jnp.tanh(h @ W))(jnp.zeros((1, 2)))
>>> plan = block_diagonal_plan(closed.jaxpr, [False], (1, 2))
>>> d = structured_block_diagonal(plan, closed.jaxpr, closed.consts, [jnp.zeros((1, 2))])
>>> d[..., 0, 0]  # tanh'(0) · W[n, n]
Array([[0.5 , 0.25]], dtype=float32)

Two mixings in series: ``∂h'_n/∂h_n = Σ_k W[n, k] · 1 · W[k, n]`` at zero, the diagonal of ``W²``:

>>> closed = jax.make_jaxpr(lambda h: (h @ W) @ W)(jnp.zeros((1, 2)))
>>> plan = block_diagonal_plan(closed.jaxpr, [False], (1, 2))
>>> structured_block_diagonal(plan, closed.jaxpr, closed.consts, [jnp.zeros((1, 2))])[..., 0, 0]
Array([[6.25  , 6.0625]], dtype=float32)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from braintrace._compatible_imports import (
    CALL_PRIMITIVES,
    Atom,
    DotDims,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    bind_equation,
    dot_general_dims,
    is_var,
    reduction_axes,
    split_jaxpr_invars,
    subjaxprs,
)
from braintrace._compiler.jaxpr_graph import ELEMENTWISE_PRIMITIVES
from braintrace._errors import internal_error
from braintrace._op._rule_helpers import materialised, shape_of
from braintrace._op.conv import resolved_padding
from braintrace._op.sparse import stored_entries

__all__ = ["MixingRule", "SeriesRule", "BlockDiagonalPlan", "block_diagonal_plan", "structured_block_diagonal"]

Array = jax.Array

# Ops that only move elements; their position labels are the op applied to the labels.
_STRUCTURAL = frozenset({
    "broadcast_in_dim", "concatenate", "expand_dims", "pad", "reshape", "rev", "slice", "split",
    "squeeze", "stack", "transpose",
})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
# Call-like ops whose body is analysed and then bound as is.
_CALLS = CALL_PRIMITIVES
_ETP_DENSE = frozenset({"etp_mm", "etp_mv"})
_ETP_CONV = "etp_conv"
_ETP_SPARSE = frozenset({"etp_sp_mm", "etp_sp_mv"})


class MixingRule(NamedTuple):
    """How one mixing equation contributes to the position-diagonal blocks.

    Attributes
    ----------
    operand : int
        Index in ``eqn.invars`` of the hidden-derived input ``x``.
    select : numpy.ndarray or None
        ``(N,)``: for each output column the one input column at the same position (``-1``:
        none). Set when no column meets more than one input column (dense mixings only).
    mask : numpy.ndarray
        Shaped like the weight, bool: the weight entries that join an input element to an
        output element at the same position (dense ``(K, N)``: ``mask[k, n]`` when input column
        ``k`` and output column ``n`` are at the same position; a convolution's kernel: the
        taps that read the output's own location, between channels at the same position; a
        sparse matrix's stored values: the entries that join one position to itself).
    """

    operand: int
    select: np.ndarray | None
    mask: np.ndarray


class SeriesRule(NamedTuple):
    """How a first mixing ``u = x W₁``, read element-wise by a second ``z = y W₂``, adds to it.

    Attributes
    ----------
    first : int
        ``id`` of the first mixing equation.
    pre_cols : numpy.ndarray
        ``(L,)``: for each column of ``z``, the column of ``x`` at the same position (``-1``:
        none).
    mid_cols : numpy.ndarray
        ``(G, J)``: for each slot ``g`` of ``u`` and column ``j`` of ``y``, the column of ``u`` in
        slot ``g`` at ``j``'s position (``-1``: none).
    """

    first: int
    pre_cols: np.ndarray
    mid_cols: np.ndarray


class BlockDiagonalPlan(NamedTuple):
    """The result of the analysis, keyed by the ``id`` of mixing equations.

    Attributes
    ----------
    rules : dict
        One :class:`MixingRule` per mixing equation.
    series : dict
        Per second mixing, one :class:`SeriesRule` per first mixing its input reads.
    slots : dict
        Per first mixing read by a second, the slot of each output column, ``(K,)``.
    """

    rules: dict[int, MixingRule]
    series: dict[int, tuple[SeriesRule, ...]]
    slots: dict[int, np.ndarray]


class _Unsupported(Exception):
    """Raised inside the analysis when an op defeats the structured extraction."""


class _Label(NamedTuple):
    """Per-element position labels of one variable, the number of mixing ops it crossed, and
    the first mixings it reads without having crossed a second."""

    ids: np.ndarray
    depth: int
    sources: frozenset[int]


class _FirstMixing(NamedTuple):
    """Row-0 position labels of a first mixing's input and output, and its leading shape."""

    x_ids: np.ndarray
    out_ids: np.ndarray
    leading: tuple[int, ...]


class _Analysis:
    """What the analysis collects while it walks a transition."""

    def __init__(self, positions: np.ndarray) -> None:
        self.positions = positions
        self.rules: dict[int, MixingRule] = {}
        self.series: dict[int, tuple[SeriesRule, ...]] = {}
        self.slots: dict[int, np.ndarray] = {}
        self.firsts: dict[int, _FirstMixing] = {}


def block_diagonal_plan(
    jaxpr: Jaxpr, member_has_state_axis: Sequence[bool], varshape: tuple[int, ...]
) -> BlockDiagonalPlan | None:
    """Analyse a transition ``h^{t-1} -> h^t`` for the structured block extraction.

    Parameters
    ----------
    jaxpr : Jaxpr
        The transition: invars are the member hidden values, outvars their new values.
    member_has_state_axis : sequence of bool
        Per member, whether it carries a trailing state axis (a ``HiddenGroupState``).
    varshape : tuple of int
        The positions of the group.

    Returns
    -------
    BlockDiagonalPlan or None
        ``None`` when the transition is outside what the structured extraction handles
        exactly (three mixing ops in series, an unknown op on a hidden-derived value, ...).
    """
    positions = np.arange(math.prod(varshape), dtype=np.int64).reshape(varshape)
    _, hidden_invars = split_jaxpr_invars(jaxpr, len(member_has_state_axis))
    expected = [
        np.broadcast_to(positions[..., None], shape_of(v)) if has_axis else positions
        for v, has_axis in zip(hidden_invars, member_has_state_axis)
    ]
    if any(e.shape != shape_of(v) for e, v in zip(expected, hidden_invars)):
        return None
    labels: dict[Var, _Label] = {v: _Label(e, 0, frozenset()) for v, e in zip(hidden_invars, expected)}
    analysis = _Analysis(positions)
    try:
        _analyse(jaxpr, labels, analysis)
    except _Unsupported:
        return None
    for v, want in zip(jaxpr.outvars, expected):
        got = labels.get(v) if is_var(v) else None
        if got is not None and not np.all((got.ids == want) | (got.ids < 0)):
            return None
    return BlockDiagonalPlan(analysis.rules, analysis.series, analysis.slots)


def _analyse(jaxpr: Jaxpr, labels: dict[Var, _Label], analysis: _Analysis) -> None:
    for eqn in jaxpr.eqns:
        ins = [labels.get(v) if is_var(v) else None for v in eqn.invars]
        if all(lab is None for lab in ins):
            continue
        for v, lab in zip(eqn.outvars, _eqn_labels(eqn, ins, analysis)):
            labels[v] = lab


def _eqn_labels(eqn: JaxprEqn, ins: list[_Label | None], analysis: _Analysis) -> list[_Label]:
    name = eqn.primitive.name
    known = [lab for lab in ins if lab is not None]
    depth = max(lab.depth for lab in known)
    sources = frozenset().union(*(lab.sources for lab in known))
    if name in ELEMENTWISE_PRIMITIVES:
        return [_Label(_merge(eqn, ins), depth, sources) for _ in eqn.outvars]
    if name in _STRUCTURAL:
        return [_Label(ids, depth, sources) for ids in _structural(eqn, ins)]
    if name in _REDUCTIONS:
        return [_Label(_reduce(eqn, ins[0]), depth, sources)]
    if name in _CALLS:
        return _call(eqn, ins, analysis.positions, depth, sources)
    if name == "dot_general" or name in _ETP_DENSE:
        return [_mixing(eqn, ins, analysis)]
    if name == _ETP_CONV:
        return [_conv_mixing(eqn, ins, analysis)]
    if name in _ETP_SPARSE:
        return [_sparse_mixing(eqn, ins, analysis)]
    raise _Unsupported(name)


def _merge(eqn: JaxprEqn, ins: list[_Label | None]) -> np.ndarray:
    """Labels of an element-wise op: the common label of its hidden-derived inputs."""
    out_shape = shape_of(eqn.outvars[0])
    out = np.full(out_shape, -1, np.int64)
    for lab in ins:
        if lab is None:
            continue
        ids = np.broadcast_to(lab.ids, out_shape)
        clash = (out >= 0) & (ids >= 0) & (out != ids)
        if clash.any():
            raise _Unsupported("element-wise op across positions")
        out = np.where(out >= 0, out, ids)
    return out


def _structural(eqn: JaxprEqn, ins: list[_Label | None]) -> list[np.ndarray]:
    """Apply the op itself to the labels (non-hidden operands carry ``-1``)."""
    labels = [
        lab.ids if lab is not None else np.full(shape_of(v) if isinstance(v, Var) else (), -1)
        for v, lab in zip(eqn.invars, ins)
    ]
    # Evaluated now on concrete labels, even while the caller is being traced by jit.
    with jax.ensure_compile_time_eval():
        outs = bind_equation(eqn, [jnp.asarray(a, jnp.int32) for a in labels])
    return [np.asarray(o, np.int64) for o in outs]


def _reduce(eqn: JaxprEqn, lab: _Label | None) -> np.ndarray:
    """A reduction stays within a position only when the reduced axes share one label."""
    if lab is None:
        raise _Unsupported(f"`{eqn.primitive.name}` reduces a value that does not carry the positions")
    ref = lab.ids
    for ax in sorted(reduction_axes(eqn), reverse=True):
        if not np.all(ref == np.take(ref, [0], axis=ax)):
            raise _Unsupported("reduction across positions")
        ref = np.take(ref, 0, axis=ax)
    return np.asarray(ref)


def _call(
    eqn: JaxprEqn, ins: list[_Label | None], positions: np.ndarray, depth: int, sources: frozenset[int]
) -> list[_Label]:
    bodies = list(subjaxprs(eqn))
    if len(bodies) != 1 or len(bodies[0].invars) != len(eqn.invars):
        raise _Unsupported(eqn.primitive.name)
    body = bodies[0]
    inner = {v: lab for v, lab in zip(body.invars, ins) if lab is not None}
    inner_analysis = _Analysis(positions)
    _analyse(body, inner, inner_analysis)
    if inner_analysis.rules:
        # A mixing op inside a call would need the call rewritten too; leave it to the fallback.
        raise _Unsupported(f"mixing inside {eqn.primitive.name}")
    return [
        inner.get(v, _Label(np.full(shape_of(v), -1, np.int64), depth, sources)) if isinstance(v, Var) else
        _Label(np.full((), -1, np.int64), depth, sources)
        for v in body.outvars
    ]


def _mixing(eqn: JaxprEqn, ins: list[_Label | None], analysis: _Analysis) -> _Label:
    """A dense ``x @ W`` with a hidden-derived ``x``: record its same-position mask, and for a
    second mixing in series what it needs of each first one."""
    name = eqn.primitive.name
    if name == "dot_general":
        standard = DotDims((len(shape_of(eqn.invars[0])) - 1,), (0,), (), ())  # x @ W, W a matrix
        if dot_general_dims(eqn) != standard or len(shape_of(eqn.invars[1])) != 2:
            raise _Unsupported("dot_general layout")
    x_lab = _mixed_operand(ins)
    if x_lab.depth >= 2:
        raise _Unsupported("three mixings in series")
    out_shape = shape_of(eqn.outvars[0])
    out_ids, xs, outs = _position_rows(x_lab.ids, out_shape, analysis.positions)
    mask = (xs[0][:, None] == outs[0][None, :]) & (xs[0][:, None] >= 0)
    counts = mask.sum(axis=0)
    select = np.where(counts == 1, mask.argmax(axis=0), -1) if np.all(counts <= 1) else None
    analysis.rules[id(eqn)] = MixingRule(0, select, mask)
    leading = out_shape[:-1]
    if x_lab.depth == 0:
        analysis.firsts[id(eqn)] = _FirstMixing(xs[0], outs[0], leading)
        return _Label(out_ids, 1, frozenset({id(eqn)}))
    rules = []
    for first_id in sorted(x_lab.sources):
        first = analysis.firsts.get(first_id)
        if first is None:
            raise _Unsupported("a convolution in series with another mixing")
        if first.leading != leading:
            raise _Unsupported("mixings in series over different leading axes")
        slots = _slots(first.out_ids)
        analysis.slots[first_id] = slots
        rules.append(SeriesRule(first_id, _column_at(first.x_ids, outs[0]), _slot_columns(first.out_ids, slots, xs[0])))
    analysis.series[id(eqn)] = tuple(rules)
    return _Label(out_ids, 2, frozenset())


def _mixed_operand(ins: list[_Label | None]) -> _Label:
    """The labels of a mixing equation's ``x``, the only operand that may be hidden-derived."""
    x_lab, others = ins[0], ins[1:]
    if x_lab is None or any(lab is not None for lab in others):
        raise _Unsupported("mixing of a hidden-derived weight")
    return x_lab


def _position_rows(
    x_ids: np.ndarray, out_shape: tuple[int, ...], positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The output's labels, and per leading row (a batch entry) the input's and the output's last
    axis, checked to be row 0 shifted by one offset."""
    out_ids = _output_positions(out_shape, positions)
    if x_ids.shape[:-1] != out_shape[:-1]:
        raise _Unsupported("mixing changes the leading axes")
    xs, outs = x_ids.reshape(-1, x_ids.shape[-1]), out_ids.reshape(-1, out_shape[-1])
    if not _rows_shifted(xs, outs):
        raise _Unsupported("position mask differs across leading axes")
    return out_ids, xs, outs


def _conv_mixing(eqn: JaxprEqn, ins: list[_Label | None], analysis: _Analysis) -> _Label:
    """``braintrace.conv`` of a hidden-derived ``x`` (stride 1, no input dilation or groups): the
    same-position part is the convolution with the kernel masked to the tap that reads the
    output's own location, between the channels at one position."""
    params = eqn.params
    x_lab = _mixed_operand(ins)
    if x_lab.depth >= 1:
        raise _Unsupported("a convolution in series with another mixing")
    x_shape, k_shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1]), shape_of(eqn.outvars[0])
    out_ids = _output_positions(out_shape, analysis.positions)
    x_ids = x_lab.ids
    if len(x_shape) != len(k_shape) or any(s != 1 for s in params["strides"]) \
            or any(d != 1 for d in params["lhs_dilation"] or ()) \
            or params["feature_group_count"] != 1 or params["batch_group_count"] != 1:
        raise _Unsupported("a strided, input-dilated or grouped convolution")
    lhs_spec, rhs_spec, out_spec = jax.lax.conv_dimension_numbers(x_shape, k_shape, params["dimension_numbers"])
    rhs_dilation = params["rhs_dilation"] or (1,) * len(params["strides"])
    pads = resolved_padding(x_shape, k_shape, params)
    # Rows: one per batch entry and location; columns: the channels there.
    xs = np.transpose(x_ids, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])).reshape(-1, x_shape[lhs_spec[1]])
    outs = np.transpose(out_ids, (out_spec[0], *out_spec[2:], out_spec[1]))
    outs = outs.reshape(-1, out_shape[out_spec[1]])
    if xs.shape[0] != outs.shape[0] or not _rows_shifted(xs, outs) \
            or not set(xs[0][xs[0] >= 0].tolist()) <= set(outs[0].tolist()):
        raise _Unsupported("convolution positions")
    # The tap reading input location i at output location i: tap · dilation = low padding.
    taps = [lo // d if lo % d == 0 and 0 <= lo // d < k_shape[a] else -1
            for (lo, _), d, a in zip(pads, rhs_dilation, rhs_spec[2:])]
    channels = (xs[0][:, None] == outs[0][None, :]) & (xs[0][:, None] >= 0)  # (C_in, C_out)
    mask = np.zeros(k_shape, bool)
    if all(t >= 0 for t in taps):
        index: list[slice | int] = [slice(None)] * len(k_shape)
        for a, t in zip(rhs_spec[2:], taps):
            index[a] = t
        # With the spatial axes indexed away, the in and out channel axes keep their order.
        in_first = rhs_spec[1] < rhs_spec[0]
        mask[tuple(index)] = channels if in_first else channels.T
    analysis.rules[id(eqn)] = MixingRule(0, None, mask)
    return _Label(out_ids, 1, frozenset({id(eqn)}))


def _sparse_mixing(eqn: JaxprEqn, ins: list[_Label | None], analysis: _Analysis) -> _Label:
    """``braintrace.sparse_matmul`` of a hidden-derived ``x``: the same-position part keeps the
    stored entries that join a position to itself (a connectome's self-connections)."""
    x_lab = _mixed_operand(ins)
    if x_lab.depth >= 1:
        raise _Unsupported("a sparse product in series with another mixing")
    entries = stored_entries(eqn.params["sparse_mat"])
    if entries is None:
        raise _Unsupported("a sparse structure without host coordinates")
    out_ids, xs, outs = _position_rows(x_lab.ids, shape_of(eqn.outvars[0]), analysis.positions)
    rows, cols = entries
    mask = (xs[0][rows] == outs[0][cols]) & (xs[0][rows] >= 0)
    analysis.rules[id(eqn)] = MixingRule(0, None, mask)
    return _Label(out_ids, 1, frozenset({id(eqn)}))


def _slots(ids: np.ndarray) -> np.ndarray:
    """The slot of each column: how many earlier columns carry its position."""
    slots = np.zeros(ids.shape, np.int64)
    seen: dict[int, int] = {}
    for c, p in enumerate(ids.tolist()):
        slots[c] = seen.get(p, 0)
        seen[p] = slots[c] + 1
    return slots


def _column_at(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each wanted position, the one column of ``ids`` carrying it (``-1``: none)."""
    valid = ids[ids >= 0]
    if len(np.unique(valid)) != len(valid):
        raise _Unsupported("a first mixing in series reads a position twice")
    where = {p: c for c, p in enumerate(ids.tolist()) if p >= 0}
    return np.array([where.get(p, -1) if p >= 0 else -1 for p in wanted.tolist()], np.int64)


def _slot_columns(ids: np.ndarray, slots: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``(G, len(wanted))``: per slot, the column of ``ids`` in that slot at each wanted position."""
    where = {(p, s): c for c, (p, s) in enumerate(zip(ids.tolist(), slots.tolist()))}
    num_slots = int(slots.max()) + 1 if slots.size else 0
    return np.array(
        [[where.get((p, g), -1) if p >= 0 else -1 for p in wanted.tolist()] for g in range(num_slots)], np.int64
    ).reshape(num_slots, len(wanted))


def _rows_shifted(xs: np.ndarray, outs: np.ndarray) -> bool:
    """Whether every leading row is row 0 with all labels shifted by one offset (so the
    same-position mask is the same for every row); O(rows · (K + N))."""
    valid_x, valid_o = xs >= 0, outs >= 0
    if not (np.all(valid_x == valid_x[:1]) and np.all(valid_o == valid_o[:1])):
        return False
    if xs.shape[0] == 1:
        return True
    dx = np.where(valid_x, xs - xs[:1], 0)
    do = np.where(valid_o, outs - outs[:1], 0)
    shift = do[:, valid_o[0].argmax()] if valid_o[0].any() else np.zeros(len(xs), np.int64)
    return bool(np.all(dx[:, valid_x[0]] == shift[:, None]) and np.all(do[:, valid_o[0]] == shift[:, None]))


def _output_positions(out_shape: tuple[int, ...], positions: np.ndarray) -> np.ndarray:
    """The positions of a mixing op's output: the group layout, or gates stacked on the last axis.

    A wrong guess cannot go unnoticed: labels must agree wherever values meet and at the
    transition outputs, so a mismatch sends the group to the general fallback.
    """
    varshape = positions.shape
    if out_shape == varshape:
        return positions
    if varshape and out_shape[:-1] == varshape[:-1] and out_shape[-1] % varshape[-1] == 0:
        reps = out_shape[-1] // varshape[-1]
        return np.concatenate([positions] * reps, axis=-1)
    raise _Unsupported("mixing output layout")


# --- evaluation ---------------------------------------------------------------------------

# The parts a tangent is carried in: not yet mixed, and the same-position part of mixed values.
# A first mixing read by a second adds one part per slot, keyed ``(id(eqn), slot)``.
_PURE, _SAME_POSITION = "pure", "same-position"
_PartKey = Union[str, tuple[int, int]]
_Parts = dict[_PartKey, Array]


def _mixing_weight(eqn: JaxprEqn, invals: Sequence[ArrayLike]) -> Array:
    """The effective weight of a mixing equation (hooks applied): a dense ``(K, N)`` matrix or
    a convolution's kernel."""
    w = invals[1]
    hook = {_ETP_CONV: "kernel_fn", **dict.fromkeys(_ETP_DENSE | _ETP_SPARSE, "weight_fn")}.get(eqn.primitive.name)
    fn = eqn.params.get(hook) if hook is not None else None
    if fn is not None:
        w = fn(w)
    return jnp.asarray(w)


def _same_position_tangent(eqn: JaxprEqn, rule: MixingRule, w: Array, x_dot: Array) -> Array:
    """The same-position part of ``ẋ @ W`` (or of the convolution of ``ẋ``)."""
    if eqn.primitive.name == _ETP_CONV:
        p = eqn.params
        return jax.lax.conv_general_dilated(
            x_dot, w * jnp.asarray(rule.mask, w.dtype), window_strides=p["strides"], padding=p["padding"],
            rhs_dilation=p["rhs_dilation"], dimension_numbers=p["dimension_numbers"])
    if eqn.primitive.name in _ETP_SPARSE:
        entries = stored_entries(eqn.params["sparse_mat"])
        if entries is None:
            raise internal_error("a sparse mixing planned without host coordinates")
        kept = np.flatnonzero(rule.mask)
        rows, cols = entries[0][kept], entries[1][kept]
        zeros = jnp.zeros((*x_dot.shape[:-1], shape_of(eqn.outvars[0])[-1]), x_dot.dtype)
        return zeros.at[..., cols].add(x_dot[..., rows] * w[kept])
    if rule.select is not None:
        selected = _static_take(w, rule.select, axis=0)  # selected[n] = w[select[n]], an (N, N) matrix
        scale = jnp.sum(jnp.where(jnp.eye(selected.shape[0], dtype=bool), selected, 0), axis=0)
        return _static_take(x_dot, rule.select, axis=-1) * scale
    return x_dot @ (w * jnp.asarray(rule.mask, w.dtype))


def _series_tangent(rule: SeriesRule, slot: int, w1: Array, w2: Array, x1_dot: Array, mid: Array) -> Array:
    """``ẋ₁[i(p)] · (m_g @ H_g)`` for one first mixing and slot (see the module docstring)."""
    w1_at = _static_take(_static_take(w1, rule.pre_cols, axis=0), rule.mid_cols[slot], axis=1)  # (L, J)
    return _static_take(x1_dot, rule.pre_cols, axis=-1) * (mid @ (w1_at.T * w2))


def _static_take(a: Array, index: np.ndarray, axis: int) -> Array:
    """``a`` indexed along ``axis`` by a static ``index``, zero where ``index`` is ``-1``.

    The indices the analysis produces are mostly one run of consecutive columns (the hidden
    columns of ``[x, h] @ W``, a gate's block); that run is a slice, padded with zeros, since a
    gather of single elements is slow on a TPU (one such gather per step took OSTLRecurrent on
    a GRU to 44x BPTT there). Any other index is a gather of whole rows along ``axis``.

    >>> import jax.numpy as jnp, numpy as np
    >>> _static_take(jnp.arange(12.0).reshape(3, 4), np.array([-1, 1, 2, -1]), axis=1)
    Array([[ 0.,  1.,  2.,  0.],
           [ 0.,  5.,  6.,  0.],
           [ 0.,  9., 10.,  0.]], dtype=float32)
    >>> _static_take(jnp.arange(4.0), np.array([3, -1, 0]), axis=0)
    Array([3., 0., 0.], dtype=float32)
    """
    axis = axis % a.ndim
    valid = np.flatnonzero(index >= 0)
    if valid.size and np.array_equal(index[valid[0]:valid[-1] + 1], index[valid[0]] + np.arange(valid[-1] + 1 - valid[0])):
        run = jax.lax.slice_in_dim(a, int(index[valid[0]]), int(index[valid[-1]]) + 1, axis=axis)
        padding = [(0, 0, 0)] * a.ndim
        padding[axis] = (int(valid[0]), len(index) - 1 - int(valid[-1]), 0)
        return jax.lax.pad(run, jnp.zeros((), a.dtype), padding)
    kept = jnp.take(a, np.maximum(index, 0), axis=axis)
    shape = [1] * a.ndim
    shape[axis] = len(index)
    return jnp.where(jnp.asarray((index >= 0).reshape(shape)), kept, 0)


def _pushed_tangents(
    eqn: JaxprEqn, invals: list[ArrayLike], parts: list[_Parts]
) -> tuple[list[Array], list[_Parts]]:
    """A non-mixing equation's outputs, and each tangent part pushed through it (one linearisation)."""
    carried = [i for i, p in enumerate(parts) if p]

    def fn(*vals: ArrayLike) -> list[Array]:
        full = list(invals)
        for i, v in zip(carried, vals):
            full[i] = v
        return bind_equation(eqn, full)

    outs, linear = jax.linearize(fn, *[invals[i] for i in carried])
    pushed: list[_Parts] = [{} for _ in eqn.outvars]
    for key in dict.fromkeys(k for i in carried for k in parts[i]):
        out_dots = linear(*[parts[i].get(key, jnp.zeros_like(invals[i])) for i in carried])
        for out, dot in zip(pushed, out_dots):
            if dot.dtype != jax.dtypes.float0:
                out[key] = dot
    return outs, pushed


class _MixingTangents:
    """The tangent parts a mixing equation produces, within one forward pass over the transition."""

    def __init__(self, plan: BlockDiagonalPlan) -> None:
        self.plan = plan
        # Without mixings in series the same-position part never meets a mixing again, so it
        # travels with the unmixed part as one tangent.
        self.same_position = _SAME_POSITION if plan.series else _PURE
        self.first_inputs: dict[int, tuple[Array, Array]] = {}

    def __call__(
        self, eqn: JaxprEqn, rule: MixingRule, invals: list[ArrayLike], out: Array, x_parts: _Parts
    ) -> _Parts:
        w = _mixing_weight(eqn, invals).astype(out.dtype)
        parts: _Parts = {}
        same = self.same_position
        if _PURE in x_parts:
            parts[same] = _same_position_tangent(eqn, rule, w, x_parts[_PURE].astype(out.dtype))
        slots = self.plan.slots.get(id(eqn))
        if slots is not None:  # a first mixing read by a second: seed each slot's part
            x_dot = x_parts.get(_PURE, jnp.zeros_like(invals[rule.operand])).astype(out.dtype)
            self.first_inputs[id(eqn)] = (w, x_dot)
            for g in range(int(slots.max()) + 1):
                parts[(id(eqn), g)] = jnp.broadcast_to(jnp.asarray(slots == g, out.dtype), out.shape)
        for series in self.plan.series.get(id(eqn), ()):  # a second mixing: close each path
            w1, x1_dot = self.first_inputs[series.first]
            for g in range(series.mid_cols.shape[0]):
                mid = x_parts.get((series.first, g))
                if mid is not None:
                    term = _series_tangent(series, g, w1, w, x1_dot, mid.astype(out.dtype))
                    parts[same] = parts[same] + term if same in parts else term
        return parts


def structured_block_diagonal(
    plan: BlockDiagonalPlan,
    jaxpr: Jaxpr,
    consts: Sequence[ArrayLike],
    hidden_vals: Sequence[Array],
    concat: Callable[[Sequence[Array]], Array] | None = None,
    split: Callable[[Array], list[Array]] | None = None,
) -> Array:
    """The per-position blocks ``(*varshape, S, S)`` of a transition analysed by ``plan``.

    ``concat``/``split`` stack the members on a trailing state axis and back (default: each
    member is one state without its own state axis).
    """
    if concat is None:
        concat = lambda vals: jnp.stack(list(vals), axis=-1)  # noqa: E731
    if split is None:
        split = lambda s: [s[..., i] for i in range(s.shape[-1])]  # noqa: E731
    consts = [jax.lax.stop_gradient(c) for c in consts]
    constvars, hidden_invars = split_jaxpr_invars(jaxpr, len(hidden_vals))
    stacked = jax.lax.stop_gradient(concat(hidden_vals))

    def column(direction: Array) -> Array:
        env: dict[Var, ArrayLike] = dict(zip(constvars, consts))
        env.update(zip(hidden_invars, split(stacked)))
        tangents: dict[Var, _Parts] = {v: {_PURE: d} for v, d in zip(hidden_invars, split(direction))}
        mixing_tangents = _MixingTangents(plan)

        def read(v: Atom) -> ArrayLike:
            return v.val if isinstance(v, Literal) else env[v]

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            parts = [tangents.get(v, {}) if is_var(v) else {} for v in eqn.invars]
            rule = plan.rules.get(id(eqn))
            if not any(parts):
                outs = bind_equation(eqn, invals)
            elif rule is None:
                outs, pushed = _pushed_tangents(eqn, invals, parts)
                tangents.update(zip(eqn.outvars, pushed))
            else:
                outs = bind_equation(eqn, invals)
                tangents[eqn.outvars[0]] = mixing_tangents(eqn, rule, invals, outs[0], parts[rule.operand])
            env.update(zip(eqn.outvars, outs))

        def total(v: Atom) -> Array:
            parts = tangents.get(v, {}) if is_var(v) else {}
            kept = [parts[k] for k in (_PURE, _SAME_POSITION) if k in parts]
            return sum(kept[1:], kept[0]) if kept else jnp.zeros_like(read(v))

        return concat([total(v) for v in jaxpr.outvars])

    num_state = stacked.shape[-1]
    eye = jnp.eye(num_state, dtype=stacked.dtype).reshape(num_state, *([1] * (stacked.ndim - 1)), num_state)
    directions = jnp.broadcast_to(eye, (num_state, *stacked.shape))
    cols = jax.vmap(column)(directions)
    # Computed once: the trace update that broadcasts the blocks would otherwise recompute
    # the whole tangent pass for every trace entry.
    return materialised(jnp.moveaxis(cols, 0, -1))  # cols[b, ..., a] -> [..., a, b]
