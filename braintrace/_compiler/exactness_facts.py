"""What the compiler knows about a relation that decides whether a trace of it can equal BPTT.

An eligibility trace of a relation ``y = op(x, W)`` driving hidden groups holds ``∂h^t/∂W`` for
the states of those groups, rolled with the group's hidden Jacobian ``D``. Whether a learner's
trace holds *all* of the weight's influence on later steps is a property of the compiled step,
read here per relation and per driven group:

* ``cut_recurrence``: the group's transition reads a value computed from the group's own
  previous state outside the traced part (the diagonal scope cuts weight operations, so a
  recurrent weight's dependence is missing from ``D``);
* ``adjacency`` (or ``adjacency_unreadable``): which positions the traced transition mixes
  (:func:`~braintrace._compiler.position_dependence.group_adjacency`);
* ``tail_reach`` (or ``tail_unreadable``): where the ``y -> h`` tail delivers each position of
  ``y`` (:func:`~braintrace._compiler.position_dependence.read_tail`);
* ``feeds``: the states outside the group that its values reach (a stacked layer reading it):
  a trace of this group does not follow the influence into them;
* per relation, ``output_feeds`` (states outside its groups that ``y`` reaches other than
  through the groups' new values), ``untraced_uses`` (states the weight reaches other than
  through its traced operations) and ``indirect`` (``y`` also reaches a group through another
  trainable operation the tail stops at);
* per ``ParamState`` outside every relation (:func:`plain_weight_facts`), the states its value
  reaches: with none, its gradient within each step is all of its BPTT gradient.

Only differentiable paths count: a ``stop_gradient`` or an integer/boolean value carries no
gradient in BPTT either. The learners combine these facts with their own coordinate
(:mod:`braintrace._algorithm.engine.exactness`).

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._compiler.exactness_facts import relation_facts
>>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
>>> (facts,) = relation_facts(braintrace.compile_etrace_graph(cell, jnp.ones(3)))
>>> (group,) = facts.groups
>>> group.cut_recurrence, group.feeds  # h @ W is cut out of the diagonal scope's D
(True, ())
"""

from __future__ import annotations

from typing import Collection, Iterable, NamedTuple

import brainstate
import jax
import numpy as np

from braintrace._compatible_imports import Atom, Jaxpr, Var, is_var
from braintrace._compiler.graph import ETraceGraph
from braintrace._compiler.hid_param_op import HiddenParamOpRelation, PathClassification
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.jaxpr_graph import build_producer_map, differentiable_reach
from braintrace._compiler.module_info import Path
from braintrace._compiler.position_dependence import AxisPatterns, Dependence, group_adjacency, read_tail
from braintrace._compiler.snap_pattern import SnapPattern

__all__ = [
    "GroupFacts", "RelationFacts", "PlainWeightFacts", "relation_facts", "plain_weight_facts",
    "moves_positions", "traced_varshape",
]


class GroupFacts(NamedTuple):
    """What one driven group does with a relation's influence (see the module docstring).

    Attributes
    ----------
    group_index : int
    hidden_paths : tuple
    cut_recurrence : bool
    adjacency : tuple of ndarray or None
        Per axis of the group's ``varshape``, ``[q, p]``: ``h^t[q]`` reads ``h^{t-1}[p]`` in the
        traced transition; ``None`` when it could not be read.
    adjacency_unreadable : str or None
    tail_reach : tuple of ndarray or None
        Per axis, ``[q, p]``: ``h[q]`` reads ``y[p]``; ``None`` when it could not be read.
    tail_unreadable : str or None
    feeds : tuple
        Paths of the states outside the group that its values reach.
    snap : SnapPattern or None
        The group's SnAp neighbourhoods (graphs compiled with ``sparse_n >= 2``), when laid over
        the traced positions.
    """

    group_index: int
    hidden_paths: tuple[Path, ...]
    cut_recurrence: bool
    adjacency: AxisPatterns | None
    adjacency_unreadable: str | None
    tail_reach: Dependence | None
    tail_unreadable: str | None
    feeds: tuple[Path, ...]
    snap: SnapPattern | None

    @property
    def mixes_positions(self) -> bool:
        """Whether the traced transition provably moves values between positions."""
        return self.adjacency is not None and moves_positions(self.adjacency)

    @property
    def tail_moves_positions(self) -> bool:
        """Whether the ``y -> h`` tail provably delivers ``y[p]`` at another position."""
        return self.tail_reach is not None and moves_positions(self.tail_reach)


class RelationFacts(NamedTuple):
    """The facts of one relation and of every group it drives.

    Attributes
    ----------
    weight_path : tuple
        The relation's first trainable path (``relation.path``; a relation has at least one).
    weight_paths : tuple
        Every distinct ``ParamState`` path the relation trains.
    hidden_paths : tuple
        The driven hidden states.
    groups : tuple of GroupFacts
        Empty for a descended relation.
    output_feeds : tuple
        States outside the relation's groups that ``y`` reaches other than through their new values.
    untraced_uses : tuple
        States the weights reach other than through their relations' operations.
    indirect : bool
        ``y`` also reaches a driven state through another trainable operation the tail stops at.
    descended : bool
        The relation or a driven group lives in a descended scan (not analysed).
    """

    weight_path: Path
    weight_paths: tuple[Path, ...]
    hidden_paths: tuple[Path, ...]
    groups: tuple[GroupFacts, ...]
    output_feeds: tuple[Path, ...]
    untraced_uses: tuple[Path, ...]
    indirect: bool
    descended: bool


def moves_positions(patterns: Iterable[np.ndarray]) -> bool:
    """Whether a per-axis pattern has an entry off its diagonal.

    Examples
    --------
    >>> import numpy as np
    >>> moves_positions([np.eye(3, dtype=bool)]), moves_positions([np.ones((3, 3), dtype=bool)])
    (False, True)
    """
    return any(bool(np.any(a & ~np.eye(len(a), dtype=bool))) for a in patterns)


#: ``new value variable -> paths`` of the states the step writes with it.
StateWrites = dict[Var, tuple[Path, ...]]


def _state_outvars(graph: ETraceGraph) -> StateWrites:
    """The :data:`StateWrites` of every hidden and other (non-parameter) state: one variable may be
    the new value of several states (``self.copy.value = self.h.value``)."""
    _, hidden, other = graph.module_info.split_state_outvars()
    table: StateWrites = {}
    for path, tree in (*hidden.items(), *other.items()):
        for leaf in jax.tree.leaves(tree):
            if is_var(leaf):
                table[leaf] = (*table.get(leaf, ()), path)
    return table


def _outside(reached: set[Var], states: StateWrites, inside: Collection[Path]) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(path for var, paths in states.items() if var in reached
                               for path in paths if path not in inside))


def traced_varshape(group: HiddenGroup) -> tuple[int, ...]:
    """The positions the step traces for ``group``: its ``varshape``, but one lane's under a vmapped learner.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._compiler.exactness_facts import traced_varshape
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> traced_varshape(braintrace.compile_etrace_graph(cell, jnp.ones(3)).hidden_groups[0])
    (4,)
    """
    shape = tuple(getattr(group.hidden_invars[0].aval, "shape", group.varshape))
    return shape[:-1] if isinstance(group.hidden_states[0], brainstate.HiddenGroupState) else shape


def _group_facts(graph: ETraceGraph, group: HiddenGroup, tail: Jaxpr, states: StateWrites) -> GroupFacts:
    jaxpr = graph.module_info.jaxpr
    derived = differentiable_reach(jaxpr, group.hidden_invars)
    cut = any(v in derived for v in group.transition_jaxpr_constvars)
    varshape = traced_varshape(group)
    adjacency, adjacency_unreadable = group_adjacency(group, varshape)
    reach, tail_unreadable = read_tail(tail, varshape)
    reached = differentiable_reach(jaxpr, [*group.hidden_invars, *group.hidden_outvars])
    return GroupFacts(
        group_index=group.index, hidden_paths=tuple(group.hidden_paths), cut_recurrence=cut,
        adjacency=None if adjacency_unreadable is not None else adjacency,
        adjacency_unreadable=adjacency_unreadable, tail_reach=reach, tail_unreadable=tail_unreadable,
        feeds=_outside(reached, states, group.hidden_paths),
        snap=group.snap if group.snap is not None and group.snap.varshape == varshape else None,
    )


def _relation_eqn_ids(graph: ETraceGraph) -> dict[Path, set[int]]:
    """``weight path -> ids of the equations of the (flat) relations that train it``."""
    producers = build_producer_map(graph.module_info.jaxpr)
    ids: dict[Path, set[int]] = {}
    for rel in graph.hidden_param_op_relations:
        eqn = producers.get(rel.y_var)
        if rel.control_flow_context is None and eqn is not None:
            for path in rel.trainable_paths.values():
                ids.setdefault(path, set()).add(id(eqn))
    return ids


def _untraced_uses(graph: ETraceGraph, paths: tuple[Path, ...], eqn_ids: dict[Path, set[int]],
                   states: StateWrites) -> tuple[Path, ...]:
    minfo = graph.module_info
    seeds = [v for path in paths for v in minfo.weight_path_to_invars.get(path, ())]
    blocked = set().union(*(eqn_ids.get(path, set()) for path in paths))
    return _outside(differentiable_reach(minfo.jaxpr, seeds, blocked), states, ())


def _is_descended(rel: HiddenParamOpRelation) -> bool:
    return rel.control_flow_context is not None or any(g.descent is not None for g in rel.hidden_groups)


def _facts_of(graph: ETraceGraph, rel: HiddenParamOpRelation, eqn_ids: dict[Path, set[int]],
              states: StateWrites) -> RelationFacts:
    weight_paths = tuple(dict.fromkeys(rel.trainable_paths.values()))
    hidden_paths = tuple(rel.connected_hidden_paths)
    if _is_descended(rel):
        return RelationFacts(weight_paths[0], weight_paths, hidden_paths, groups=(), output_feeds=(), untraced_uses=(),
                             indirect=False, descended=True)
    tails = rel.y_to_hidden_group_jaxprs
    groups = tuple(_group_facts(graph, g, tail, states) for g, tail in zip(rel.hidden_groups, tails))
    inside = [p for g in rel.hidden_groups for p in g.hidden_paths]
    new_values = {v for g in rel.hidden_groups for v in g.hidden_outvars if is_var(v)}
    # A state written with a group's new value is reached through it, which the group's feeds report.
    reached = differentiable_reach(graph.module_info.jaxpr, [rel.y_var], stop=new_values) - new_values
    indirect = not rel.crossed_weight_paths and PathClassification.MIXED in rel.path_classification.values()
    return RelationFacts(weight_paths[0], weight_paths, hidden_paths, groups=groups,
                         output_feeds=_outside(reached, states, inside),
                         untraced_uses=_untraced_uses(graph, weight_paths, eqn_ids, states),
                         indirect=indirect, descended=False)


def relation_facts(graph: ETraceGraph) -> list[RelationFacts]:
    """The :class:`RelationFacts` of every relation of ``graph``, in relation order."""
    states = _state_outvars(graph)
    eqn_ids = _relation_eqn_ids(graph)
    return [_facts_of(graph, rel, eqn_ids, states) for rel in graph.hidden_param_op_relations]


class PlainWeightFacts(NamedTuple):
    """A ``ParamState`` that trains no relation, and the states the step writes from its value.

    Attributes
    ----------
    weight_path : tuple
    reaches : tuple
        Paths of the hidden and other states its value reaches (differentiably); empty for a
        readout, whose influence ends with the step's output.
    """

    weight_path: Path
    reaches: tuple[Path, ...]


def plain_weight_facts(graph: ETraceGraph) -> list[PlainWeightFacts]:
    """The :class:`PlainWeightFacts` of every ``ParamState`` outside the relations of ``graph``, in model order.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._compiler.exactness_facts import plain_weight_facts
    >>> class Net(brainstate.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.p = brainstate.ParamState(jnp.ones((3, 3)))  # a plain input projection
    ...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
    ...         self.readout = brainstate.ParamState(jnp.ones(2))
    ...         self.h = brainstate.HiddenState(jnp.zeros(2))
    ...     def update(self, x):
    ...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x @ self.p.value, self.w.value)
    ...         return self.h.value * self.readout.value
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter('ignore')  # the compiler's warning that p has no eligibility trace
    ...     graph = braintrace.compile_etrace_graph(Net(), jnp.ones(3))
    >>> plain_weight_facts(graph)
    [PlainWeightFacts(weight_path=('p',), reaches=(('h',),)), PlainWeightFacts(weight_path=('readout',), reaches=())]
    """
    minfo = graph.module_info
    states = _state_outvars(graph)
    traced = {path for rel in graph.hidden_param_op_relations for path in rel.trainable_paths.values()}
    return [
        PlainWeightFacts(path, _outside(differentiable_reach(minfo.jaxpr, minfo.weight_path_to_invars.get(path, ())),
                                        states, ()))
        for path, state in minfo.retrieved_model_states.items()
        if isinstance(state, brainstate.ParamState) and path not in traced
    ]
