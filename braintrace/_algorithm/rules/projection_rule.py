"""Random projection's rule for one hidden group: the rank-one factors of UORO as a :class:`~braintrace.GroupRule`.

The per-group maths of the random-projection engine (:class:`~braintrace.RandomProjectionVjpAlgorithm`,
:class:`~braintrace.UORO`), as a record (:func:`uoro_rule`) and the functions it is made of:

* the draw ``ν`` (Rademacher, ±1) of a group at a step: :func:`rademacher_draw`;
* the projection ``νᵀ J_f`` of a relation, its primitive's ``xy_to_dw`` rule at the tail's
  cotangent ``νᵀ ∂h/∂y``: :func:`tail_pullback`, :func:`relation_projection`;
* the group's transition applied matrix-free: :func:`transition_jvp` (``D s̃``) and
  :func:`transition_vjp` (``Dᵀ g``);
* the factors' update with its normalisers: :func:`projection_update`.

The engine rolls its factors with these functions and keeps what a per-group carrier of the
contract does not hold: one factor ``θ̃`` per *parameter* (a weight read by several relations of
a group, or through an operand chain, sums their projections into one factor), windows of
steps, and ``∂L/∂h^{t-1}`` through every path of the step where an output reads the previous
state. Run on its own by ``braintrace.compile(model, braintrace.uoro_rule(), x0)``, the record
gives UORO's single-step gradients, draw for draw, where each parameter is one operand of one
relation of a group and no output reads a group's previous state
(``tests/algorithm/test_uoro_rule.py``).

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.uoro_rule(), jnp.ones(3))
>>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
>>> grads[('W', 'weight')]['weight'].shape
(7, 4)
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm.engine.graph_executor import TailPoint, TransitionPoint
from braintrace._algorithm.engine.rule_contract import GroupInfo, GroupRule, GroupStep, info_primitive
from braintrace._compatible_imports import Primitive, eval_jaxpr
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._op import _registries as reg
from braintrace._typing import PyTree

__all__ = [
    "uoro_rule", "UOROCarrier", "rademacher_draw", "tail_pullback", "relation_projection", "transition_jvp",
    "transition_vjp", "projection_update", "key_data", "checked_eps",
]


class UOROCarrier(NamedTuple):
    """One group's factors: ``ε̃ = s̃ θ̃ᵀ``."""

    #: The hidden factor, shaped like the group's state ``(*varshape, S)``.
    s_tilde: jax.Array
    #: Per relation of the group, per trainable operand key, the parameter factor (shaped like the operand).
    theta_tilde: tuple[dict[str, jax.Array], ...]


def uoro_rule(eps: float = 1e-12) -> GroupRule:
    """Random projection (UORO) as a :class:`~braintrace.GroupRule`: rank-one factors per hidden group.

    Each step draws ``ν`` (±1, shaped like the group's state) from the step's key and updates

    .. code-block:: text

        proj = νᵀ J_f                              per relation operand, by the primitive's xy_to_dw
        ds   = D s̃                                 one JVP of the group's transition
        rho0 = sqrt((‖θ̃‖ + eps) / (‖ds‖ + eps))     ‖θ̃‖ over every factor of the group
        rho1 = sqrt((‖proj‖ + eps) / (‖ν‖ + eps))
        s̃   ← rho0 · ds + rho1 · ν,   θ̃ ← θ̃ / rho0 + proj / rho1

    and ``solve`` adds ``⟨Dᵀ g, s̃⟩ · θ̃`` (the entering factors describe ``h^{t-1}``) to the
    one-step gradient. ``E[s̃ θ̃ᵀ]`` is the group's exact influence: on a model of one hidden
    group the gradient is an unbiased estimate of backpropagation through time.

    Parameters
    ----------
    eps : float
        The normalisers' regulariser: positive, and still positive in float32.

    Returns
    -------
    GroupRule
        The same record for the same ``eps``.

    Raises
    ------
    TypeError
        For a non-numeric ``eps``.
    ValueError
        For an ``eps`` that is not positive or underflows to zero in float32.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.uoro_rule(), jnp.ones(3), key=0)
    >>> out = learner(jnp.ones(3))
    >>> carrier = learner.get_etrace_of(('W', 'weight'))[0]
    >>> carrier.s_tilde.shape, carrier.theta_tilde[0]['weight'].shape  # s̃ per unit, θ̃ per weight
    ((4, 1), (7, 4))
    >>> braintrace.uoro_rule() is braintrace.uoro_rule(1e-12)
    True
    """
    return _uoro_record(checked_eps(eps))


@functools.cache
def _uoro_record(eps: float) -> GroupRule:
    def init(info: GroupInfo) -> UOROCarrier:
        theta = tuple({k: jnp.zeros(v.shape, v.dtype) for k, v in rel.weights.items()} for rel in info.relations)
        return UOROCarrier(jnp.zeros(info.hidden.shape, info.hidden.dtype), theta)

    def roll(carrier: UOROCarrier, step: GroupStep) -> UOROCarrier:
        s_old = carrier.s_tilde
        nu = rademacher_draw(step.key, tuple(s_old.shape), s_old.dtype)
        proj = tuple(
            project(info_primitive(rel, "uoro_rule"), rel.params, x, pull(nu), w)
            for rel, x, pull, w in zip(step.info.relations, step.xs, step.tail_vjps, step.weights, strict=True))
        s_new, theta_new = projection_update(s_old, carrier.theta_tilde, nu, proj, step.transition_jvp(s_old), eps)
        return UOROCarrier(s_new, theta_new)

    def solve(carrier: UOROCarrier, signal: jax.Array, step: GroupStep) -> tuple[dict[str, jax.Array], ...]:
        s = carrier.s_tilde
        acc = jnp.promote_types(s.dtype, jnp.float32)
        scale = jnp.sum(step.transition_vjp(signal).astype(acc) * s.astype(acc))
        return tuple({k: (scale * t).astype(t.dtype) for k, t in theta.items()} for theta in carrier.theta_tilde)

    return GroupRule(init, roll, solve)


uoro_rule.__module__ = "braintrace"


def rademacher_draw(key: jax.Array, shape: tuple[int, ...], dtype: jax.typing.DTypeLike) -> jax.Array:
    """The draw ``ν`` of one group at one step: entries ±1 of ``shape`` from ``key``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from braintrace._algorithm.rules.projection_rule import rademacher_draw
    >>> nu = rademacher_draw(jax.random.key(0), (1000,), jnp.float32)
    >>> sorted(set(nu.tolist())), abs(float(nu.mean())) < 0.1
    ([-1.0, 1.0], True)
    """
    return jax.random.rademacher(key, shape, dtype=jnp.int8).astype(dtype)


def tail_pullback(rel: HiddenParamOpRelation, group: HiddenGroup, point: TailPoint) -> Callable[[jax.Array], jax.Array]:
    """``v ↦ vᵀ ∂h/∂y``: the VJP of ``rel``'s ``y -> h`` tail for ``group`` at ``point``, from a
    cotangent on the group's state ``(*varshape, S)`` to one on ``y``."""
    tail = rel.y_to_hidden_group_jaxprs[rel.hidden_groups.index(group)]

    def to_hidden(y: jax.Array) -> jax.Array:
        out: jax.Array = group.concat_hidden(eval_jaxpr(tail, point.consts, y))
        return out

    hidden, pullback = jax.vjp(to_hidden, point.y)

    def pull(v: jax.Array) -> jax.Array:
        (dy,) = pullback(v.astype(hidden.dtype))
        out: jax.Array = dy
        return out

    return pull


def project(
    etp: Primitive, params: Mapping[str, object], x: jax.Array | None, dy: jax.Array, weights: dict[str, jax.Array],
) -> dict[str, jax.Array]:
    """``xy_to_dw(x, dy)`` of the primitive ``etp``: a cotangent on ``y`` taken to the operands."""
    rule = reg.required_rules(etp).xy_to_dw
    projected: dict[str, jax.Array] = rule(x, dy, weights, **params)
    return projected


def relation_projection(
    rel: HiddenParamOpRelation, group: HiddenGroup, nu: jax.Array, x: jax.Array | None, point: TailPoint,
    weights: dict[str, jax.Array],
) -> dict[str, jax.Array]:
    """``νᵀ J_f`` of one relation for one group, per trainable operand: the primitive's
    ``xy_to_dw`` rule at the cotangent ``νᵀ ∂h/∂y`` of the ``y -> h`` tail evaluated at ``point``."""
    return project(rel.primitive, rel.eqn_params, x, tail_pullback(rel, group, point)(nu), weights)


def _stacked_transition(group: HiddenGroup, point: TransitionPoint) -> Callable[[jax.Array], jax.Array]:
    def fn(stacked: jax.Array) -> jax.Array:
        out: jax.Array = group.concat_hidden(group.transition(group.split_hidden(stacked), point.inputs))
        return out

    return fn


def transition_jvp(group: HiddenGroup, point: TransitionPoint, tangent: jax.Array) -> jax.Array:
    """``D_full · tangent``: the group's whole hidden Jacobian at ``point`` applied to ``tangent``.

    One forward-mode pass through the transition, ``(*varshape, S) -> (*varshape, S)``; equal to
    ``tensordot(group.full_jacobian(point.hidden, point.inputs), tangent, tangent.ndim)`` without
    building the ``(P·S)²`` matrix.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._algorithm.engine.graph_executor import TransitionPoint
    >>> from braintrace._algorithm.rules.projection_rule import transition_jvp
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 2))
    >>> graph = braintrace.compile_etrace_graph(cell, jnp.ones(3), include_recurrent_mixing=True)
    >>> group = graph.hidden_groups[0]
    >>> point = TransitionPoint([jnp.zeros(2)], [jnp.zeros(v.aval.shape) for v in group.transition_jaxpr_constvars])
    >>> transition_jvp(group, point, jnp.ones((2, 1))).shape
    (2, 1)
    """
    hidden = group.concat_hidden(point.hidden)
    out: jax.Array = jax.jvp(_stacked_transition(group, point), (hidden,), (tangent.astype(hidden.dtype),))[1]
    return out


def transition_vjp(group: HiddenGroup, point: TransitionPoint, cotangent: jax.Array) -> jax.Array:
    """``D_fullᵀ · cotangent``: the transpose of :func:`transition_jvp`, one reverse-mode pass."""
    hidden = group.concat_hidden(point.hidden)
    _, pullback = jax.vjp(_stacked_transition(group, point), hidden)
    out: jax.Array = pullback(cotangent.astype(hidden.dtype))[0]
    return out


def projection_update(
    s_tilde: jax.Array, theta_tilde: PyTree, nu: jax.Array, proj: PyTree, ds: jax.Array, eps: float,
) -> tuple[jax.Array, PyTree]:
    """One group's factor update (``rho0``, ``rho1`` and the new ``s̃``, ``θ̃``).

    ``theta_tilde`` and ``proj`` are pytrees of one structure (every factor of the group). Norms
    are over all their leaves, accumulated in at least float32; the results are cast back to the
    factors' dtypes.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._algorithm.rules.projection_rule import projection_update
    >>> s, theta = projection_update(jnp.zeros(2), {('w',): jnp.zeros(2)}, jnp.array([1., -1.]),
    ...                              {('w',): jnp.array([3., 4.])}, jnp.zeros(2), 1e-12)
    >>> rho1 = (5 / 2 ** 0.5) ** 0.5  # ‖proj‖ = 5, ‖ν‖ = √2; rho0 = 1 (both factors start at zero)
    >>> [round(float(v), 4) for v in s], round(rho1, 4)  # rho1 · ν
    ([1.8803, -1.8803], 1.8803)
    >>> [round(float(v), 4) for v in theta[('w',)]]  # proj / rho1
    [1.5955, 2.1273]
    """
    leaves = [s_tilde, *jax.tree.leaves(theta_tilde)]
    acc = jnp.result_type(jnp.float32, *[leaf.dtype for leaf in leaves])
    eps_acc = jnp.asarray(eps, acc)
    rho0 = jnp.sqrt((_norm(theta_tilde, acc) + eps_acc) / (_norm(ds, acc) + eps_acc))
    rho1 = jnp.sqrt((_norm(proj, acc) + eps_acc) / (_norm(nu, acc) + eps_acc))
    s_new = (rho0 * ds.astype(acc) + rho1 * nu.astype(acc)).astype(s_tilde.dtype)
    theta_new = jax.tree.map(
        lambda t, q: (t.astype(acc) / rho0 + q.astype(acc) / rho1).astype(t.dtype), theta_tilde, proj)
    return s_new, theta_new


def _norm(tree: PyTree, dtype: jax.typing.DTypeLike) -> jax.Array:
    """The L2 norm over every leaf of ``tree``, accumulated in ``dtype``."""
    total = sum((jnp.sum(jnp.square(leaf.astype(dtype))) for leaf in jax.tree.leaves(tree)), jnp.zeros((), dtype))
    return jnp.sqrt(total)


def key_data(key: object, name: str = "projection_key") -> np.ndarray:
    """Raw ``uint32`` key data of a seed or a key (the argument ``name``).

    Raises
    ------
    TypeError
        For anything else than an integer seed or a PRNG key.
    """
    if isinstance(key, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer seed or a PRNG key, got {key!r}.")
    if isinstance(key, numbers.Integral):
        return np.asarray(jax.random.key_data(jax.random.key(int(key))))
    arr = key
    if isinstance(arr, jax.Array) and jnp.issubdtype(arr.dtype, jax.dtypes.prng_key):
        arr = jax.random.key_data(arr)
    data = np.asarray(arr)
    if data.dtype != np.uint32 or data.ndim != 1:
        raise TypeError(
            f"{name} must be an integer seed or a PRNG key (jax.random.key or PRNGKey), "
            f"got {type(key).__name__} with dtype {data.dtype} and shape {data.shape}."
        )
    return data


def checked_eps(eps: object, name: str = "eps") -> float:
    """The normalisers' regulariser (the argument ``name``) as a float, if it is positive and
    stays positive in float32.

    Raises
    ------
    TypeError
        For a non-numeric value.
    ValueError
        For a value that is not positive and finite, or underflows to zero in float32.
    """
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{name} must be a positive float, got {eps!r}.")
    value = float(eps)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be a positive, finite float, got {eps!r}: at the first step both "
            f"factors are zero and each normaliser is (0 + eps) / (0 + eps), so eps must keep it "
            f"finite and positive (eps = 0 gives NaN). Use a small positive value such as the default 1e-12."
        )
    if np.float32(value) == 0:
        raise ValueError(
            f"{name}={eps!r} underflows to 0 in float32, where the normalisers are computed; "
            f"use at least {float(np.finfo(np.float32).smallest_subnormal):g} (default 1e-12)."
        )
    return value
