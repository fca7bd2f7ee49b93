"""Per-position Jacobian blocks of hidden transitions that mix positions through dense weights.

With ``include_recurrent_mixing=True`` a group's transition may contain dense mixing ops
(``h @ W``, ``braintrace.matmul(s, W)``, ``concatenate([x, h]) @ W``): the Jacobian
``∂h^t/∂h^{t-1}`` is then dense over positions, yet the learners only need its per-position
``(S, S)`` blocks ``D[p, a, b] = ∂h^t[p, a] / ∂h^{t-1}[p, b]``. Materialising the dense
``(P·S)²`` Jacobian to read its diagonal blocks costs quadratic memory in the number of
positions ``P`` (batch × neurons).

This module computes the blocks exactly without it, in one forward-mode pass per state:

1. A static analysis labels every element of every transition variable with the position it
   belongs to (``-1`` for none), following element-wise ops, within-position reductions and
   the structural ops (concatenate, slice, reshape, broadcast, transpose, ...).
2. Every mixing equation ``z = x @ W`` whose input ``x`` is hidden-derived gets a tangent rule
   that keeps only the same-position part of its Jacobian: ``ż[..., n] = Σ_k [pos(x_k) =
   pos(z_n)] W[k, n] ẋ[..., k]`` (for the usual layouts a gather and a scale, ``O(P)``).
3. ``jacfwd`` with the tangent ``e_b`` set at every position at once then yields exactly the
   diagonal blocks.

This is exact when every path from ``h^{t-1}`` to ``h^t`` crosses at most one mixing op (the
block of a product of two dense maps is not the product of their blocks) and the analysis
recognises every op on the way; :func:`block_diagonal_plan` returns ``None`` otherwise and the
caller falls back to the general (slower, still exact) per-position probing of
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
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var

from braintrace._compatible_imports import split_jaxpr_invars
from braintrace._compiler.jaxpr_graph import ELEMENTWISE_PRIMITIVES, subjaxprs

__all__ = ["MixingRule", "BlockDiagonalPlan", "block_diagonal_plan", "structured_block_diagonal"]

Array = jax.Array

# Ops that only move elements; their position labels are the op applied to the labels.
_STRUCTURAL = frozenset({
    "broadcast_in_dim", "concatenate", "expand_dims", "pad", "reshape", "rev", "slice", "split",
    "squeeze", "stack", "transpose",
})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
# Call-like ops whose body is analysed and then bound as is.
_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "pjit", "jit",
                    "closed_call", "core_call", "remat", "checkpoint"})
_ETP_DENSE = frozenset({"etp_mm", "etp_mv"})


class MixingRule(NamedTuple):
    """How one mixing equation contributes to the position-diagonal blocks.

    Attributes
    ----------
    operand : int
        Index in ``eqn.invars`` of the hidden-derived input ``x``.
    select : numpy.ndarray or None
        ``(N,)``: for each output column the one input column at the same position (``-1``:
        none). Set when no column meets more than one input column.
    mask : numpy.ndarray
        ``(K, N)`` bool: ``mask[k, n]`` when input column ``k`` and output column ``n`` are at
        the same position.
    """

    operand: int
    select: np.ndarray | None
    mask: np.ndarray


class BlockDiagonalPlan(NamedTuple):
    """The result of the analysis: one :class:`MixingRule` per mixing equation (by ``id``)."""

    rules: dict[int, MixingRule]


class _Unsupported(Exception):
    """Raised inside the analysis when an op defeats the structured extraction."""


class _Label(NamedTuple):
    """Per-element position labels of one variable and whether it went through a mixing op."""

    ids: np.ndarray
    mixed: bool


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.aval.shape)


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
        exactly (two mixing ops in series, an unknown op on a hidden-derived value, ...).
    """
    positions = np.arange(math.prod(varshape), dtype=np.int64).reshape(varshape)
    _, hidden_invars = split_jaxpr_invars(jaxpr, len(member_has_state_axis))
    expected = [
        np.broadcast_to(positions[..., None], _shape(v)) if has_axis else positions
        for v, has_axis in zip(hidden_invars, member_has_state_axis)
    ]
    if any(e.shape != _shape(v) for e, v in zip(expected, hidden_invars)):
        return None
    labels: dict[Var, _Label] = {v: _Label(e, False) for v, e in zip(hidden_invars, expected)}
    rules: dict[int, MixingRule] = {}
    try:
        _analyse(jaxpr, labels, rules, positions)
    except _Unsupported:
        return None
    for v, want in zip(jaxpr.outvars, expected):
        got = labels.get(v) if isinstance(v, Var) and not isinstance(v, Literal) else None
        if got is not None and not np.all((got.ids == want) | (got.ids < 0)):
            return None
    return BlockDiagonalPlan(rules)


def _analyse(jaxpr: Jaxpr, labels: dict[Var, _Label], rules: dict[int, MixingRule], positions: np.ndarray) -> None:
    for eqn in jaxpr.eqns:
        ins = [labels.get(v) if isinstance(v, Var) and not isinstance(v, Literal) else None for v in eqn.invars]
        if all(lab is None for lab in ins):
            continue
        for v, lab in zip(eqn.outvars, _eqn_labels(eqn, ins, rules, positions)):
            labels[v] = lab


def _eqn_labels(
    eqn: JaxprEqn, ins: list[_Label | None], rules: dict[int, MixingRule], positions: np.ndarray
) -> list[_Label]:
    name = eqn.primitive.name
    mixed = any(lab.mixed for lab in ins if lab is not None)
    if name in ELEMENTWISE_PRIMITIVES:
        return [_Label(_merge(eqn, ins), mixed) for _ in eqn.outvars]
    if name in _STRUCTURAL:
        return [_Label(ids, mixed) for ids in _structural(eqn, ins)]
    if name in _REDUCTIONS:
        return [_Label(_reduce(eqn, ins[0]), mixed)]
    if name in _CALLS:
        return _call(eqn, ins, positions)
    if name == "dot_general" or name in _ETP_DENSE:
        return [_mixing(eqn, ins, rules, positions)]
    raise _Unsupported(name)


def _merge(eqn: JaxprEqn, ins: list[_Label | None]) -> np.ndarray:
    """Labels of an element-wise op: the common label of its hidden-derived inputs."""
    out_shape = _shape(eqn.outvars[0])
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
        lab.ids if lab is not None else np.full(_shape(v) if isinstance(v, Var) else (), -1)
        for v, lab in zip(eqn.invars, ins)
    ]
    params = eqn.primitive.get_bind_params(eqn.params)
    # Evaluated now on concrete labels, even while the caller is being traced by jit.
    with jax.ensure_compile_time_eval():
        out = eqn.primitive.bind(*[jnp.asarray(a, jnp.int32) for a in labels], **params)
    outs = out if eqn.primitive.multiple_results else [out]
    return [np.asarray(o, np.int64) for o in outs]


def _reduce(eqn: JaxprEqn, lab: _Label | None) -> np.ndarray:
    """A reduction stays within a position only when the reduced axes share one label."""
    if lab is None:
        raise _Unsupported(f"`{eqn.primitive.name}` reduces a value that does not carry the positions")
    axes = tuple(eqn.params["axes"])
    ref = lab.ids
    for ax in sorted(axes, reverse=True):
        if not np.all(ref == np.take(ref, [0], axis=ax)):
            raise _Unsupported("reduction across positions")
        ref = np.take(ref, 0, axis=ax)
    return np.asarray(ref)


def _call(eqn: JaxprEqn, ins: list[_Label | None], positions: np.ndarray) -> list[_Label]:
    bodies = list(subjaxprs(eqn))
    if len(bodies) != 1 or len(bodies[0].invars) != len(eqn.invars):
        raise _Unsupported(eqn.primitive.name)
    body = bodies[0]
    inner = {v: lab for v, lab in zip(body.invars, ins) if lab is not None}
    inner_rules: dict[int, MixingRule] = {}
    _analyse(body, inner, inner_rules, positions)
    if inner_rules:
        # A mixing op inside a call would need the call rewritten too; leave it to the fallback.
        raise _Unsupported(f"mixing inside {eqn.primitive.name}")
    mixed = any(lab.mixed for lab in ins if lab is not None)
    return [
        inner.get(v, _Label(np.full(_shape(v), -1, np.int64), mixed)) if isinstance(v, Var) else
        _Label(np.full((), -1, np.int64), mixed)
        for v in body.outvars
    ]


def _mixing(eqn: JaxprEqn, ins: list[_Label | None], rules: dict[int, MixingRule], positions: np.ndarray) -> _Label:
    """A dense ``x @ W`` with a hidden-derived ``x``: record its same-position mask."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        x_ndim = len(_shape(eqn.invars[0]))
        standard = (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) == ((x_ndim - 1,), (0,), (), ())
        if not standard or len(_shape(eqn.invars[1])) != 2:
            raise _Unsupported("dot_general layout")
    x_lab, others = ins[0], ins[1:]
    if x_lab is None or any(lab is not None for lab in others) or x_lab.mixed:
        raise _Unsupported("mixing of a mixed value, or of a hidden-derived weight")
    out_shape = _shape(eqn.outvars[0])
    out_ids = _output_positions(out_shape, positions)
    x_ids = x_lab.ids
    if x_ids.shape[:-1] != out_shape[:-1]:
        raise _Unsupported("mixing changes the leading axes")
    k, n = x_ids.shape[-1], out_shape[-1]
    xs, outs = x_ids.reshape(-1, k), out_ids.reshape(-1, n)
    if not _rows_shifted(xs, outs):
        raise _Unsupported("position mask differs across leading axes")
    mask = (xs[0][:, None] == outs[0][None, :]) & (xs[0][:, None] >= 0)
    counts = mask.sum(axis=0)
    select = np.where(counts == 1, mask.argmax(axis=0), -1) if np.all(counts <= 1) else None
    rules[id(eqn)] = MixingRule(0, select, mask)
    return _Label(out_ids, True)


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


def _bind(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _mixing_weight(eqn: JaxprEqn, invals: Sequence[Any]) -> Array:
    """The effective ``(K, N)`` matrix of a dense mixing equation (hooks applied)."""
    w = invals[1]
    if eqn.primitive.name in _ETP_DENSE:
        fn = eqn.params.get("weight_fn")
        if fn is not None:
            w = fn(w)
    return jnp.asarray(w)


def _masked_mixing(eqn: JaxprEqn, rule: MixingRule) -> Callable[..., Any]:
    """The equation as a function whose tangent keeps only the same-position part."""

    @jax.custom_jvp
    def fn(*invals: Any) -> Any:
        return _bind(eqn, invals)[0]

    @fn.defjvp
    def fn_jvp(primals: Any, tangents: Any) -> Any:
        # Only ``x`` carries a tangent here: the weights are held fixed (stop_gradient-ed).
        out = fn(*primals)
        x_dot = tangents[rule.operand]
        w = _mixing_weight(eqn, primals).astype(out.dtype)
        x_dot = jnp.asarray(x_dot, out.dtype)
        if rule.select is not None:
            cols = np.maximum(rule.select, 0)
            scale = jnp.where(jnp.asarray(rule.select >= 0), w[cols, jnp.arange(w.shape[1])], 0)
            return out, x_dot[..., cols] * scale
        return out, x_dot @ (w * jnp.asarray(rule.mask, w.dtype))

    return fn


def structured_block_diagonal(
    plan: BlockDiagonalPlan,
    jaxpr: Jaxpr,
    consts: Sequence[Any],
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
    mixers = {i: _masked_mixing(e, plan.rules[id(e)]) for i, e in enumerate(jaxpr.eqns) if id(e) in plan.rules}
    constvars, hidden_invars = split_jaxpr_invars(jaxpr, len(hidden_vals))

    def fn(stacked: Array) -> Array:
        env: dict[Var, Any] = dict(zip(constvars, consts))
        env.update(zip(hidden_invars, split(stacked)))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            outs = [mixers[i](*invals)] if i in mixers else _bind(eqn, invals)
            env.update(zip(eqn.outvars, outs))
        return concat([read(v) for v in jaxpr.outvars])

    stacked = jax.lax.stop_gradient(concat(hidden_vals))
    num_state = stacked.shape[-1]
    eye = jnp.eye(num_state, dtype=stacked.dtype).reshape(num_state, *([1] * (stacked.ndim - 1)), num_state)
    tangents = jnp.broadcast_to(eye, (num_state, *stacked.shape))
    cols = jax.vmap(lambda t: jax.jvp(fn, (stacked,), (t,))[1])(tangents)
    return jnp.moveaxis(cols, 0, -1)  # cols[b, ..., a] -> [..., a, b]
