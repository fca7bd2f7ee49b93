"""Which hidden positions a value computed in one step reads: the per-axis dependence walk.

A hidden group's positions are the indices of its ``varshape``. Walking a jaxpr forward from
values whose dependence on those positions is known, this module relates every derived value
to the positions it reads, **per axis**: along axis ``i`` a boolean ``(len of the value's axis,
V_i)`` matrix whose entry ``[j, q]`` says that index ``j`` of the value reads index ``q`` of the
group. Element-wise operations OR the relations of their operands, ``concatenate`` / ``slice``
/ ``rev`` move rows, a plain ``h @ W`` mixes the last axis, and an ETP primitive composes the
pattern of its ``snap_adjacency`` rule. An operation without a rule of its own (a library's
primitive, such as the surrogate spike ``heaviside_surrogate_gradient`` of
``braintools.surrogate``) is read through its JVP rule, the derivative that BPTT and the learners
take of it: its outputs read what the primal and tangent outputs of that rule read. Anything else
(a JVP rule that cannot be traced or read, control flow, a changed rank) makes the value
unreadable.

Two readers use it:

* :func:`group_adjacency`: the one-step adjacency ``A[q, p]`` ("``h_q^t`` reads
  ``h_p^{t-1}``") of a group's transition, from which SnAp-n builds its neighbourhoods
  (:mod:`braintrace._compiler.snap_pattern`);
* :func:`warn_relabelling_tails`: a relation's ``y -> h`` tail that provably moves values to
  other positions (``jnp.roll`` of the drive, a mix after the ETP operation). Its trace slots are
  rolled at the position of ``y`` while the influence lands elsewhere, so no recurrence scope
  (``coupled``, ``sparse_n`` at any order, the random projection) reaches BPTT there.

The relation of a value is the product of its per-axis relations, which is exact when at most
one axis mixes and a superset otherwise.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from braintrace._compiler.position_dependence import tail_relabels_positions
>>> rolled = jax.make_jaxpr(lambda y: jnp.tanh(jnp.roll(y, 1)))(jnp.zeros(4)).jaxpr
>>> kept = jax.make_jaxpr(lambda y: jnp.tanh(2.0 * y))(jnp.zeros(4)).jaxpr
>>> tail_relabels_positions(rolled, (4,)), tail_relabels_positions(kept, (4,))
(True, False)
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from braintrace._compatible_imports import (
    CALL_PRIMITIVES,
    Atom,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Var,
    bind_equation,
    concatenate_axis,
    dot_general_dims,
    is_var,
    rev_axes,
    slice_params,
    split_jaxpr_invars,
    subjaxprs,
)
from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
from braintrace._op._registries import get_snap_adjacency_rule, get_x_invar_index, is_etp_primitive
from braintrace._typing import HiddenGroupLike, RelationLike

__all__ = [
    "Dependence",
    "AxisPatterns",
    "group_adjacency",
    "tail_reach",
    "read_tail",
    "tail_relabels_positions",
    "tail_keeps_positions",
    "Coverage",
    "warn_relabelling_tails",
]

#: Per axis of ``varshape``, a boolean ``(len of the value's axis, len of the group's axis)``:
#: entry ``[j, q]`` says that the value at index ``j`` of that axis reads hidden index ``q``.
Dependence = tuple[np.ndarray, ...]
#: Per axis of ``varshape``, a boolean ``(V_i, V_i)`` adjacency or closure.
AxisPatterns = tuple[np.ndarray, ...]


class _Unreadable(Exception):
    """The walk cannot relate a value to the hidden positions (the message says why)."""


#: Element-wise primitives: the output at an index reads the operands at that same index.
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "rem", "neg", "max", "min", "pow", "integer_pow", "square",
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt",
    "abs", "sign", "floor", "ceil", "round", "is_finite", "erf", "erfc", "erf_inv", "lgamma",
    "digamma", "nextafter", "select_n", "clamp", "convert_element_type", "copy", "copy_p",
    "reduce_precision", "stop_gradient", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "real", "imag", "conj", "custom_lin", "add_any",
})
#: Call-like primitives whose single body takes the equation's operands and returns its outputs.
_CALLS = CALL_PRIMITIVES


def _shape(atom: Atom) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _or(deps: Sequence[Dependence]) -> Dependence:
    return tuple(np.logical_or.reduce([d[i] for d in deps]) for i in range(len(deps[0])))


def _identity(varshape: tuple[int, ...]) -> Dependence:
    return tuple(np.eye(v, dtype=bool) for v in varshape)


def _elementwise(eqn: JaxprEqn, deps: list[Dependence | None]) -> list[Dependence | None]:
    out_shape = _shape(eqn.outvars[0])
    known = [d for a, d in zip(eqn.invars, deps) if d is not None and _shape(a) == out_shape]
    if len(known) != sum(d is not None for d in deps):
        raise _Unreadable(f"`{eqn.primitive.name}` broadcasts a hidden-derived operand")
    return [_or(known)] * len(eqn.outvars)


def _concatenate(eqn: JaxprEqn, deps: list[Dependence | None], widths: tuple[int, ...]) -> Dependence:
    axis = concatenate_axis(eqn)
    hidden = [d for d in deps if d is not None]
    rows = [d[axis] if d is not None else np.zeros((_shape(a)[axis], widths[axis]), bool)
            for a, d in zip(eqn.invars, deps)]
    # The other axes OR the operands' relations; the joined axis differs in length between them.
    return tuple(np.concatenate(rows, axis=0) if i == axis else np.logical_or.reduce([d[i] for d in hidden])
                 for i in range(len(widths)))


def _slice(eqn: JaxprEqn, dep: Dependence) -> Dependence:
    cut = slice_params(eqn)
    return tuple(d[s:l:st] for d, s, l, st in zip(dep, cut.start, cut.limit, cut.strides))


def _mixing(eqn: JaxprEqn, deps: list[Dependence | None]) -> Dependence:
    """An ETP primitive with a ``snap_adjacency`` rule, read through its ``x`` operand."""
    rule = get_snap_adjacency_rule(eqn.primitive)
    name = eqn.primitive.name
    x_index = get_x_invar_index(eqn.primitive)
    if rule is None or x_index is None:
        raise _Unreadable(f"`{name}` mixes positions and has no registered snap_adjacency rule")
    dep_x = deps[x_index]
    if dep_x is None or any(d is not None for i, d in enumerate(deps) if i != x_index):
        raise _Unreadable(f"`{name}` reads a hidden-derived value through an operand other than x")
    x_shape, y_shape = _shape(eqn.invars[x_index]), _shape(eqn.outvars[0])
    per_axis = rule(x_shape, y_shape, operand_shapes=tuple(_shape(a) for a in eqn.invars), **eqn.params)
    if per_axis is None or len(per_axis) != len(y_shape) or len(x_shape) != len(y_shape):
        raise _Unreadable(f"the snap_adjacency rule of `{name}` cannot describe x {x_shape} -> y {y_shape}")
    out = []
    for i, (reads, d) in enumerate(zip(per_axis, dep_x)):
        if reads is None:
            if x_shape[i] != y_shape[i]:
                raise _Unreadable(f"`{name}` changes axis {i} ({x_shape[i]} -> {y_shape[i]})")
            out.append(d)
        else:
            reads = np.asarray(reads, dtype=bool)
            if reads.shape != (y_shape[i], x_shape[i]):
                raise ValueError(
                    f"The snap_adjacency rule of {name} returned a {reads.shape} pattern for axis {i}; "
                    f"it must be (y axis, x axis) = {(y_shape[i], x_shape[i])}.")
            out.append(np.matmul(reads, d))
    return tuple(out)


def _dot_general(eqn: JaxprEqn, deps: list[Dependence | None]) -> Dependence:
    """``h @ W`` (hidden on the left, its last axis contracted) or ``W @ h`` with a vector ``h``."""
    lhs_c, rhs_c, lhs_b, _ = dot_general_dims(eqn)
    lhs, rhs = (_shape(a) for a in eqn.invars)
    out = _shape(eqn.outvars[0])
    if deps[0] is not None and deps[1] is None and not lhs_b and lhs_c == (len(lhs) - 1,) \
            and len(rhs) == 2 and rhs_c == (0,):
        return (*deps[0][:-1], np.ones((out[-1], lhs[-1]), bool) @ deps[0][-1])
    if deps[1] is not None and deps[0] is None and not lhs_b and len(rhs) == 1 and len(lhs) == 2 \
            and lhs_c == (1,) and rhs_c == (0,):
        return (np.ones((out[0], rhs[0]), bool) @ deps[1][0],)
    raise _Unreadable("`dot_general` contracts hidden-derived values in a layout SnAp cannot read")


def _walk(jaxpr: Jaxpr, deps_in: Sequence[Dependence | None], widths: tuple[int, ...],
          *, through_jvp: bool = True) -> list[Dependence | None]:
    """The dependence of every output of ``jaxpr`` given that of its inputs (``None``: none).

    ``through_jvp``: an operation without a rule is read through its JVP rule (one level: not
    inside such a rule, so that a rule binding its own primitive does not recurse).

    Raises
    ------
    _Unreadable
        When some hidden-derived value cannot be related to the positions.
    """
    seeds = {v: d for v, d in zip(jaxpr.invars, deps_in) if d is not None}
    return _walk_from(jaxpr, seeds, widths, through_jvp=through_jvp)


def _walk_from(jaxpr: Jaxpr, seeds: dict[Var, Dependence], widths: tuple[int, ...],
               *, through_jvp: bool = True) -> list[Dependence | None]:
    """:func:`_walk` from the dependence of some of ``jaxpr``'s inputs (the others: none)."""
    env: dict[Var, Dependence] = dict(seeds)
    for eqn in jaxpr.eqns:
        deps = [env.get(a) if is_var(a) else None for a in eqn.invars]
        if all(d is None for d in deps):
            continue
        outs = _eqn_dependence(eqn, deps, widths, through_jvp)
        for v, d in zip(eqn.outvars, outs):
            if d is not None and not isinstance(v, DropVar):
                if len(_shape(v)) != len(widths):
                    raise _Unreadable(f"`{eqn.primitive.name}` gives a hidden-derived value of shape {_shape(v)}")
                env[v] = d
    return [env.get(v) if is_var(v) else None for v in jaxpr.outvars]


def _through_jvp(eqn: JaxprEqn, deps: list[Dependence | None], widths: tuple[int, ...]) -> list[Dependence | None]:
    """An operation without a position rule, read through its JVP rule (see the module docstring).

    Output ``k`` reads what the rule's primal and tangent outputs ``k`` read, each tangent input
    reading what its primal does. The rule's own operations must have rules.
    """
    no_rule = _Unreadable(f"`{eqn.primitive.name}` has no position rule")
    dtypes = [getattr(a.aval, "dtype", None) for a in eqn.invars]
    if eqn.effects or not all(d is not None and jax.numpy.issubdtype(d, jax.numpy.inexact) for d in dtypes):
        raise no_rule
    avals = [jax.ShapeDtypeStruct(_shape(a), d) for a, d in zip(eqn.invars, dtypes)]

    def jvp(primals: list[jax.Array], tangents: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
        return jax.jvp(lambda *args: bind_equation(eqn, args), primals, tangents)

    try:
        rule = jax.make_jaxpr(jvp)(avals, avals).jaxpr
    except Exception:  # no JVP rule, or one that cannot be traced on abstract values: nothing is known
        raise no_rule from None
    _, invars = split_jaxpr_invars(rule, 2 * len(avals))
    try:
        outs = _walk_from(rule, {v: d for v, d in zip(invars, deps + deps) if d is not None}, widths,
                          through_jvp=False)
    except _Unreadable:
        raise no_rule from None
    n = len(eqn.outvars)
    if len(outs) != 2 * n:
        raise no_rule
    pairs = [[d for d in (outs[k], outs[n + k]) if d is not None] for k in range(n)]
    return [_or(pair) if pair else None for pair in pairs]


def _eqn_dependence(eqn: JaxprEqn, deps: list[Dependence | None], widths: tuple[int, ...],
                    through_jvp: bool = True) -> list[Dependence | None]:
    name = eqn.primitive.name
    hidden_shapes = [_shape(a) for a, d in zip(eqn.invars, deps) if d is not None]
    if any(len(s) != len(widths) for s in hidden_shapes):
        raise _Unreadable(f"`{name}` reads a hidden-derived value of another rank")
    if name in _ELEMENTWISE:
        return _elementwise(eqn, deps)
    if name == "concatenate":
        return [_concatenate(eqn, deps, widths)]
    known = next(d for d in deps if d is not None)
    if name == "slice":
        return [_slice(eqn, known)]
    if name == "rev":
        reversed_axes = rev_axes(eqn)
        return [tuple(d[::-1] if i in reversed_axes else d for i, d in enumerate(known))]
    if name in ("reshape", "broadcast_in_dim", "squeeze") and _shape(eqn.outvars[0]) == hidden_shapes[0]:
        return [known]
    if is_etp_primitive(eqn.primitive):
        return [_mixing(eqn, deps)]
    if name == "dot_general":
        return [_dot_general(eqn, deps)]
    if name in _CALLS:
        body = next((j for j in subjaxprs(eqn) if len(j.invars) == len(eqn.invars)
                     and len(j.outvars) == len(eqn.outvars)), None)
        if body is not None:
            return _walk(body, deps, widths, through_jvp=through_jvp)
    if any(True for _ in subjaxprs(eqn)):
        raise _Unreadable(f"control flow (`{name}`) on the recurrent path")
    if through_jvp:
        return _through_jvp(eqn, deps, widths)
    raise _Unreadable(f"`{name}` has no position rule")


def group_adjacency(group: HiddenGroupLike, varshape: Sequence[int] | None = None) -> tuple[AxisPatterns, str | None]:
    """The one-step adjacency of ``group`` per axis of its ``varshape``, and why it is conservative.

    The walk starts from the group's hidden inputs with the identity relation and ORs the
    relations of the hidden outputs: ``A_i[q, p]`` says that index ``q`` of axis ``i`` reads
    index ``p`` of the previous step. When it cannot read the transition, every axis is
    all-to-all and the reason is returned. ``varshape`` replaces the group's (the positions one
    lane of a vmapped learner traces, without the batch axis its states carry).

    Returns
    -------
    (adjacency, reason)
        ``reason`` is ``None`` when the adjacency was read precisely.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._compiler.position_dependence import group_adjacency
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> graph = braintrace.compile_etrace_graph(cell, jnp.ones(3), include_recurrent_mixing=True)
    >>> (adjacency,), reason = group_adjacency(graph.hidden_groups[0])
    >>> bool(adjacency.all()), reason  # the dense recurrence: every unit reads every unit
    (True, None)
    """
    varshape = tuple(group.varshape if varshape is None else varshape)
    everything = tuple(np.ones((v, v), bool) for v in varshape)
    jaxpr = group.transition_jaxpr
    try:
        for var in group.hidden_invars:
            if _shape(var) != varshape:
                raise _Unreadable(f"the hidden input of shape {_shape(var)} carries a state axis")
        _, hidden_invars = split_jaxpr_invars(jaxpr, len(group.hidden_invars))
        outs = _walk_from(jaxpr, {v: _identity(varshape) for v in hidden_invars}, varshape)
    except _Unreadable as why:
        return everything, str(why)
    reached = [d for d in outs if d is not None]
    if not reached:
        return tuple(np.zeros((v, v), bool) for v in varshape), None
    return _or(reached), None


def tail_reach(tail: Jaxpr, varshape: Sequence[int]) -> Dependence | None:
    """Per axis, ``[q, p]``: some hidden output at index ``q`` reads ``y`` at index ``p``.

    ``None`` when ``y`` is not laid out over the group's positions or the tail cannot be read.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from braintrace._compiler.position_dependence import tail_reach
    >>> rolled = jax.make_jaxpr(lambda y: jnp.tanh(jnp.roll(y, 1)))(jnp.zeros(3)).jaxpr
    >>> tail_reach(rolled, (3,))[0].astype(int).tolist()  # h[q] reads y[q - 1]
    [[0, 0, 1], [1, 0, 0], [0, 1, 0]]
    """
    return read_tail(tail, varshape)[0]


def read_tail(tail: Jaxpr, varshape: Sequence[int]) -> tuple[Dependence | None, str | None]:
    """:func:`tail_reach` and, when it is ``None``, why the tail could not be read.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from braintrace._compiler.position_dependence import read_tail
    >>> summed = jax.make_jaxpr(lambda y: jnp.cumsum(y))(jnp.zeros(3)).jaxpr
    >>> read_tail(summed, (3,))
    (None, '`cumsum` has no position rule')
    >>> read_tail(summed, (1, 3))[1]
    'y of shape (3,) is not laid out over the positions (1, 3)'
    """
    varshape = tuple(varshape)
    _, (y,) = split_jaxpr_invars(tail, 1)  # y is the last input, after the tail's constants
    if _shape(y) != varshape:
        return None, f"y of shape {_shape(y)} is not laid out over the positions {varshape}"
    try:
        outs = [d for d in _walk_from(tail, {y: _identity(varshape)}, varshape) if d is not None]
    except _Unreadable as why:
        return None, str(why)
    return (_or(outs) if outs else tuple(np.zeros((v, v), bool) for v in varshape)), None


def tail_relabels_positions(tail: Jaxpr, varshape: Sequence[int]) -> bool:
    """Whether a ``y -> h`` tail provably moves a value to another position (``roll``, a mix).

    ``False`` when every hidden output at a position reads ``y`` only at that position, when
    ``y`` is not laid out over the group's positions, or when the tail cannot be read (nothing
    is proven then).
    """
    if _element_wise_only(tail):  # nothing moves, and no (V, V) pattern is built (a connectome's V²)
        return False
    reach = tail_reach(tail, varshape)
    return reach is not None and _off_diagonal(reach)


def tail_keeps_positions(tail: Jaxpr, varshape: Sequence[int]) -> bool:
    """Whether a ``y -> h`` tail provably keeps every value at its position (every hidden output
    at a position reads ``y`` only at that position). ``False`` where it moves one, or where the
    tail cannot be read."""
    if _element_wise_only(tail):
        return True
    reach = tail_reach(tail, varshape)
    return reach is not None and not _off_diagonal(reach)


def _off_diagonal(reach: AxisPatterns) -> bool:
    """Whether some axis of ``reach`` relates a position to another one."""
    return any(np.any(a & ~np.eye(len(a), dtype=bool)) for a in reach)


def _element_wise_only(jaxpr: Jaxpr) -> bool:
    """Whether every equation is element-wise (or a call of only such), so no value changes index."""
    return all(
        eqn.primitive.name in _ELEMENTWISE
        or (eqn.primitive.name in _CALLS and all(_element_wise_only(body) for body in subjaxprs(eqn)))
        for eqn in jaxpr.eqns
    )


#: ``covered(relation, group, reach)``: whether a learner's traces hold the influence a
#: relabelling tail moves (the per-axis ``reach`` of :func:`tail_reach`).
Coverage = Callable[[RelationLike, HiddenGroupLike, Dependence], bool]


def warn_relabelling_tails(relations: Sequence[RelationLike], covered: Coverage | None = None) -> None:
    """Emit ``TAIL_RELABELS_POSITIONS`` for every relation whose ``y -> h`` tail moves positions
    that the learner's traces do not follow.

    A per-position trace sits at the positions of ``y`` and is rolled there, while such a tail
    delivers the influence elsewhere: the coupled scope misses it whatever its transition.
    SnAp-n gathers the tail's Jacobian onto each position's neighbourhood, so it misses only
    what lies outside the neighbourhoods (``covered`` tells). UORO projects through the tail
    and is not asked.
    """
    for rel in relations:
        for group, tail in zip(rel.hidden_groups, rel.y_to_hidden_group_jaxprs):
            if not tail_relabels_positions(tail, group.varshape):
                continue
            reach = tail_reach(tail, group.varshape)
            if covered is not None and reach is not None and covered(rel, group, reach):
                continue
            emit(DiagnosticKind.TAIL_RELABELS_POSITIONS, DiagnosticLevel.WARNING,
                 f"The y -> h tail of `{rel.primitive.name}` (parameter {rel.path}) moves values to "
                 f"other positions of hidden group {group.index} {group.hidden_paths} (a roll, a "
                 f"permutation or a mix after the operation), and this learner's trace stays at the "
                 f"positions of y (the coupled scope: OSTLRecurrent, SnAp-1) or its neighbourhoods "
                 f"do not hold where the tail moves the influence (SnAp-n), so the learner misses "
                 f"that influence and does not reach BPTT on this model. Use SnAp with a larger n or "
                 f"UORO, which follow it, or apply the relabelling to the operation's input or "
                 f"weight instead, so that y lands where the hidden state reads it.",
                 primitive=rel.primitive, weight_path=rel.path, hidden_paths=tuple(group.hidden_paths),
                 context={"group": group.index})
