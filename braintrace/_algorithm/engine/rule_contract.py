"""The rule contract: a trace rule as a few pure functions over one carrier per relation.

A learning rule in the spirit of optax's ``GradientTransformation``: a :class:`TraceRule`
holds pure functions, and a learner runs them for every relation of the compiled graph and a
hidden group it drives, owning everything else (the carriers' storage, reset, checkpoints,
sharding, the model step and its custom VJP). Per (relation, hidden group):

* ``init(info) -> carrier``: the zero carrier, from the relation's shapes (:class:`RelationInfo`);
* ``roll(carrier, step) -> carrier``: the carrier after this step (:class:`RelationStep`: the
  operation's input ``x``, ``df = ∂h/∂y``, the group's hidden Jacobian ``D``, the weights);
* ``residual(entering, new, step) -> residual`` (optional): what the backward pass keeps,
  by default the carrier entering the step;
* ``solve(residual, signal, step) -> {operand: gradient}``: what the rule adds to the step's
  exact one-step gradient of the relation's trainable operands.

:class:`~braintrace._algorithm.rules.trace_rule.RuleLearner` runs any such rule. The library's
learners are records of it too, which their engines roll and solve with
(``braintrace.d_rtrl_rule``, ``pp_prop_rule``, ``ottt_rule``, ``otpe_rule``); an engine adds
what one relation's carrier cannot hold (storage shared between relations, multi-step windows,
closed-form kernels).

A rule whose carrier spans the relations of a hidden group is a :class:`GroupRule` instead,
with one carrier per group: ``init(info: GroupInfo)``, ``roll(carrier, step: GroupStep)`` and
``solve(entering, signal, step) -> (per relation: {operand: gradient})``, where a
:class:`GroupStep` holds the group's whole transition as a linear map both ways, each relation's
tail pull-back, and a key the learner splits every step. Random projection (UORO,
``braintrace.uoro_rule``), whose hidden factor ``s̃`` and normalisers are shared by every
parameter a group learns, is its record;
:class:`~braintrace._algorithm.rules.group_rule.GroupRuleLearner` runs it.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> step = braintrace.RelationStep(x=jnp.ones(3), df=jnp.ones((2, 1)), diag=jnp.full((2, 1, 1), 0.5),
...                                weights={'weight': jnp.ones((3, 2))})
>>> step.info is None  # a step built by hand names no relation
True
"""

from __future__ import annotations

from types import MappingProxyType, SimpleNamespace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax

from braintrace._algorithm.engine.graph_executor import trace_key
from braintrace._compatible_imports import Primitive, ShapedArray, Var
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._op._rule_helpers import dtype_of, shape_of
from braintrace._typing import PyTree, TraceKey

__all__ = [
    "RelationInfo", "RelationStep", "TraceRule", "GroupInfo", "GroupStep", "GroupRule", "Carrier", "relation_info",
    "relation_infos", "relation_step", "step_info", "info_primitive", "abstract_var",
]


class RelationInfo(NamedTuple):
    """What a rule knows of one relation and a hidden group it drives, to allocate its carrier.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, braintrace
    >>> info = braintrace.RelationInfo(
    ...     x=jax.ShapeDtypeStruct((4, 3), jnp.float32), y=jax.ShapeDtypeStruct((4, 2), jnp.float32),
    ...     weights={'weight': jax.ShapeDtypeStruct((3, 2), jnp.float32)}, num_state=1, primitive='etp_mm',
    ...     params={})
    >>> (*info.x.shape, info.y.shape[-1])  # a per-sample trace of the weight
    (4, 3, 2)
    """

    #: The operation's input (``None``: it has none, such as ``element_wise``).
    x: jax.ShapeDtypeStruct | None
    #: The operation's output.
    y: jax.ShapeDtypeStruct
    #: The trainable operands, by key (``'weight'``, ``'bias'``, ...).
    weights: dict[str, jax.ShapeDtypeStruct]
    #: The hidden group's states per position (``S``).
    num_state: int
    #: The operation's primitive name (``'etp_mm'``, ``'etp_conv'``, ...).
    primitive: str
    #: The equation's static parameters (``has_bias``, a transform hook ``weight_fn`` ...), which
    #: a rule that does not handle one of them should refuse.
    params: Mapping[str, Any]
    #: The primitive itself, whose registered eligibility-trace rules (``dt_to_t``, ``xy_to_dw``,
    #: ...) a rule generic over operations reads (``None``: not given).
    etp: Primitive | None = None
    #: Whether the group's new state reads its previous one other than through the relations
    #: (``False``: the step's ``diag`` is identically zero, and a trace of the relation holds no
    #: history, ``ε^t = x ⊗ df``; see :meth:`~braintrace.HiddenGroup.reads_its_past`).
    has_history: bool = True


class RelationStep(NamedTuple):
    """What one step hands a rule for one relation and a hidden group it drives.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> step = braintrace.RelationStep(x=jnp.ones((4, 3)), df=jnp.ones((4, 2, 1)),
    ...                                diag=jnp.full((4, 2, 1, 1), 0.5), weights={'weight': jnp.ones((3, 2))})
    >>> float(step.diag[0, 0, 0, 0]), step.df[..., 0].shape  # D and df of one state per unit
    (0.5, (4, 2))
    """

    #: The operation's input this step (``None``: it has none).
    x: jax.Array | None
    #: ``∂h/∂y`` over ``y``'s positions: ``(*y.shape, S)``.
    df: jax.Array
    #: The group's hidden Jacobian ``D = ∂h^t/∂h^{t-1}`` over ``y``'s positions: ``(*y.shape, S, S)``.
    diag: jax.Array
    #: The trainable operands' current values, by key.
    weights: dict[str, jax.Array]
    #: The relation this step belongs to (static; ``None``: not given), for a rule generic over
    #: operations, which dispatches on its primitive.
    info: RelationInfo | None = None


Carrier = PyTree


class TraceRule(NamedTuple):
    """A learning rule as pure functions of one relation's carrier (see the module docstring).

    Parameters
    ----------
    init : callable
        ``init(info: RelationInfo) -> carrier``, a pytree of zero arrays.
    roll : callable
        ``roll(carrier, step: RelationStep) -> carrier``, of the same structure, shapes and dtypes.
    solve : callable
        ``solve(residual, signal, step: RelationStep) -> dict``: per trainable operand key, what
        the rule adds to the step's exact one-step gradient (shaped like the operand, or with
        leading axes more, summed); ``signal`` is ``∂L/∂h^t`` over ``y``'s positions,
        ``(*y.shape, S)``. Keys left out add nothing.
    residual : callable, optional
        ``residual(entering, new, step) -> residual``, what ``solve`` receives (default: the
        carrier entering the step).

    Examples
    --------
    A rule that keeps no carrier history: the one-step gradient alone (truncated BPTT of one step).

    >>> import jax.numpy as jnp, braintrace
    >>> one_step = braintrace.TraceRule(init=lambda info: jnp.zeros(()), roll=lambda c, step: c,
    ...                                 solve=lambda c, g, step: {})
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), one_step, jnp.ones(3))
    >>> type(learner).__name__, learner(jnp.ones(3)).shape
    ('RuleLearner', (4,))
    """

    init: Callable[[RelationInfo], Carrier]
    roll: Callable[[Carrier, RelationStep], Carrier]
    solve: Callable[[Carrier, jax.Array, RelationStep], dict[str, jax.Array]]
    residual: Callable[[Carrier, Carrier, RelationStep], Carrier] | None = None


class GroupInfo(NamedTuple):
    """What a group rule knows of one hidden group and the relations that drive it, to allocate its carrier.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, braintrace
    >>> info = braintrace.GroupInfo(hidden=jax.ShapeDtypeStruct((4, 1), jnp.float32), relations=(), group_index=0)
    >>> info.hidden.shape  # four units of one state each
    (4, 1)
    """

    #: The group's state, its members stacked on a trailing axis: ``(*varshape, S)``, a batch
    #: axis leading where the group has one.
    hidden: jax.ShapeDtypeStruct
    #: The relations that drive the group, in the graph's order.
    relations: tuple[RelationInfo, ...]
    #: The group's index in the compiled graph.
    group_index: int


class GroupStep(NamedTuple):
    """What one step hands a group rule for one hidden group.

    Per relation (in the order of :attr:`GroupInfo.relations`) its input, its operands and the
    pull-back of its ``y -> h`` tail; the group's whole transition ``D = ∂h^t/∂h^{t-1}`` (every
    path within the step, through recurrent weights too) as a linear map both ways, matrix-free;
    and a key of the learner's, split afresh every step.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, braintrace
    >>> info = braintrace.GroupInfo(jax.ShapeDtypeStruct((2, 1), jnp.float32), (), 0)
    >>> step = braintrace.GroupStep(xs=(), weights=(), tail_vjps=(), transition_jvp=lambda t: 0.5 * t,
    ...                             transition_vjp=lambda g: 0.5 * g, key=jax.random.key(0), info=info)
    >>> step.transition_jvp(jnp.ones((2, 1)))[:, 0]  # D t of a group that halves its state
    Array([0.5, 0.5], dtype=float32)
    """

    #: Per relation, the operation's input this step (``None``: it has none).
    xs: tuple[jax.Array | None, ...]
    #: Per relation, the trainable operands' current values, by key.
    weights: tuple[dict[str, jax.Array], ...]
    #: Per relation, ``v ↦ vᵀ ∂h^t/∂y``: a cotangent on the group's state ``(*varshape, S)``
    #: pulled back to the relation's output ``y`` (one VJP of the tail, at this step's values).
    tail_vjps: tuple[Callable[[jax.Array], jax.Array], ...]
    #: ``t ↦ D t`` for a tangent ``t`` shaped like the group's state (one JVP of the transition).
    transition_jvp: Callable[[jax.Array], jax.Array]
    #: ``g ↦ Dᵀ g`` for a cotangent ``g`` shaped like the group's state (one VJP).
    transition_vjp: Callable[[jax.Array], jax.Array]
    #: This step's PRNG key for the group (the learner splits its own key every step).
    key: jax.Array
    #: The group (static).
    info: GroupInfo


class GroupRule(NamedTuple):
    """A learning rule as pure functions of one carrier per hidden group.

    For rules whose carrier spans the relations of a group, such as random projection (UORO),
    whose hidden factor ``s̃`` and normalisers are shared by every parameter the group learns
    (``braintrace.uoro_rule``). ``braintrace.compile(model, rule, x0)`` runs it on
    :class:`~braintrace._algorithm.rules.group_rule.GroupRuleLearner`, which stores, resets,
    checkpoints and exposes the carriers and owns the key.

    Parameters
    ----------
    init : callable
        ``init(info: GroupInfo) -> carrier``, a pytree of zero arrays.
    roll : callable
        ``roll(carrier, step: GroupStep) -> carrier``, of the same structure, shapes and dtypes.
    solve : callable
        ``solve(entering, signal, step: GroupStep) -> tuple``: per relation (in the order of
        :attr:`GroupInfo.relations`), ``{operand key: gradient}``, what the rule adds to the
        step's exact one-step gradient; ``entering`` is the carrier entering the step and
        ``signal`` is ``∂L/∂h^t`` over the group's state ``(*varshape, S)``. Keys left out add
        nothing.

    Examples
    --------
    A rule that keeps no history: the one-step gradient alone.

    >>> import jax.numpy as jnp, braintrace
    >>> one_step = braintrace.GroupRule(init=lambda info: jnp.zeros(()), roll=lambda c, step: c,
    ...                                 solve=lambda c, g, step: tuple({} for _ in step.xs))
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), one_step, jnp.ones(3))
    >>> type(learner).__name__, learner(jnp.ones(3)).shape
    ('GroupRuleLearner', (4,))
    """

    init: Callable[[GroupInfo], Carrier]
    roll: Callable[[Carrier, GroupStep], Carrier]
    solve: Callable[[Carrier, jax.Array, GroupStep], tuple[dict[str, jax.Array], ...]]


def relation_info(rel: HiddenParamOpRelation, group: HiddenGroup) -> RelationInfo:
    """What a rule knows of ``rel`` driving ``group``, from the compiled graph."""
    x = None if rel.x_var is None else _struct(rel.x_var)
    weights = {k: _struct(v) for k, v in rel.trainable_vars.items()}
    return RelationInfo(x, _struct(rel.y_var), weights, group.num_state, rel.primitive.name,
                        MappingProxyType(dict(rel.eqn_params)), rel.primitive, group.reads_its_past())


def relation_infos(relations: Sequence[HiddenParamOpRelation]) -> dict[TraceKey, RelationInfo]:
    """:func:`relation_info` of every (relation, hidden group it drives), by trace key."""
    return {trace_key(rel, group): relation_info(rel, group) for rel in relations for group in rel.hidden_groups}


def relation_step(
    rel: HiddenParamOpRelation, group: HiddenGroup, x: jax.Array | None, df: jax.Array, diag: jax.Array,
    weights: dict[str, jax.Array], info: RelationInfo | None = None,
) -> RelationStep:
    """One step of ``rel`` for ``group``, with ``df`` and ``diag`` (laid out over the group's
    positions) re-laid over ``y``'s positions (:meth:`HiddenParamOpRelation.output_layout`)."""
    return RelationStep(x, rel.output_layout(group, df), rel.output_layout(group, diag), weights, info)


def step_info(step: RelationStep, rule: str) -> RelationInfo:
    """The relation ``step`` belongs to, for a rule generic over operations (``rule`` names it).

    Raises
    ------
    ValueError
        If the step names no relation (``info=None``, a step built by hand).
    """
    if step.info is None:
        raise ValueError(
            f"{rule}: the step names no relation (RelationStep.info is None), and the rule reads the "
            f"relation's primitive and parameters; build steps with info=RelationInfo(..., etp=primitive), "
            f"as the learners do.")
    return step.info


def info_primitive(info: RelationInfo, rule: str) -> Primitive:
    """The primitive of ``info``, whose registered rules a rule generic over operations reads.

    Raises
    ------
    ValueError
        If ``info`` does not give it (``etp=None``).
    """
    if info.etp is None:
        raise ValueError(
            f"{rule}: the relation of {info.primitive!r} does not give its primitive (RelationInfo.etp is "
            f"None), and the rule reads the primitive's registered rules; pass etp=<the ETP primitive>.")
    return info.etp


def abstract_var(struct: jax.ShapeDtypeStruct) -> SimpleNamespace:
    """A stand-in for a jaxpr variable of ``struct``'s shape and dtype: what a primitive's
    ``init_drtrl`` / ``init_pp`` rule reads (``var.aval``), for a rule's ``init``."""
    return SimpleNamespace(aval=ShapedArray(struct.shape, struct.dtype))


def _struct(var: Var) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape_of(var), dtype_of(var))


for _public in (RelationInfo, RelationStep, TraceRule):
    _public.__module__ = "braintrace"
