"""Relations: which ETP equation drives which hidden groups, through which trainable states.

For every ETP equation of the step, the compiler traces each trainable operand back to the
``ParamState`` leaf it comes from, then walks forward from the output ``y`` to the hidden
states it drives without crossing another trainable ETP equation (the *non-parametric tail*:
a per-position trace cannot express ``weight -> weight -> hidden``). Each driven group gets the
``y -> h`` tail as a small jaxpr, whose Jacobian is the ``df`` of the eligibility trace. The
primitive of every relation must have the rules every learner reads (``dt_to_t``, ``xy_to_dw``,
``init_drtrl``): a missing one is a ``CompilationError`` here, naming it, the weight and the line.

Learners whose traces follow an influence onto other positions (SnAp-n, random projections)
compile with ``include_weight_to_weight=True``: the walk then crosses trainable ETP equations,
whose weights become constants of the tail, so a weight that reaches the hidden states only
through another one (a GRU's reset gate) gets a relation too (see
:attr:`HiddenParamOpRelation.crossed_weight_paths`).

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class RNN(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((2, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.9 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> (rel,) = braintrace.find_hidden_param_op_relations_from_module(RNN(), jnp.ones(2))
>>> rel.primitive.name, rel.trainable_paths, rel.connected_hidden_paths
('etp_mv', {'weight': ('w',)}, [('h',)])
"""

from __future__ import annotations

from collections import deque
from typing import Container, Mapping, NamedTuple

import brainstate
import jax
import jax.numpy as jnp

from braintrace._compatible_imports import (
    Atom,
    Jaxpr,
    JaxprEqn,
    Primitive,
    Var,
    eval_jaxpr,
    is_var,
    source_line,
    split_jaxpr_invars,
)
from braintrace._compiler.control_flow_policy import DEFAULT_CONTROL_FLOW_POLICY, ControlFlowPolicy
from braintrace._compiler.descended_scan import RelationDescent
from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.hidden_group_discovery import find_hidden_groups_from_minfo
from braintrace._compiler.jaxpr_graph import (
    CONTROL_FLOW_PRIMITIVES,
    build_consumer_map,
    build_producer_map,
    contains_eqn,
    is_jit,
    new_jaxpr,
    subjaxprs,
)
from braintrace._compiler.module_info import ModuleInfo, Path, extract_module_info
from braintrace._op._registries import (
    get_trainable_invars,
    get_x_invar_index,
    get_y_outvar_index,
    is_batched_primitive,
    is_etp_enable_gradient_primitive,
    is_etp_primitive,
    required_rules,
)
from braintrace._op._rule_helpers import shape_of
from braintrace._typing import Params, PyTree

__all__ = [
    "HiddenParamOpRelation",
    "PathClassification",
    "find_hidden_param_op_relations_from_jaxpr",
    "find_hidden_param_op_relations_from_minfo",
    "find_hidden_param_op_relations_from_module",
    "tail_constvars",
]


def tail_constvars(tail: Jaxpr) -> list[Var]:
    """The inputs of a ``y -> h`` tail other than ``y``, its last and only ordinary input.

    Derived from that count, not read back from the jaxpr (a symbol-only jaxpr may fold them
    into its ordinary inputs).
    """
    constvars, _ = split_jaxpr_invars(tail, 1)
    return constvars


class PathClassification:
    """How a relation's output reaches one of its hidden states."""

    ALL_DIRECT = "all_direct"
    ALL_THROUGH_OTHER_ETP = "all_through_other_etp"
    MIXED = "mixed"


class HiddenParamOpRelation(NamedTuple):
    """One ETP equation, the trainable states it consumes and the hidden groups it drives.

    Attributes
    ----------
    primitive : ETPPrimitive
    x_var, y_var : Var
        The equation's input (``None`` when it has none) and output.
    hidden_groups : list of HiddenGroup
        The driven groups, first-seen order.
    y_to_hidden_group_jaxprs : list of Jaxpr
        Per group, ``y -> (h^t of every member)``; other inputs are constvars.
    connected_hidden_paths : list
        The driven hidden states.
    eqn_params : dict
        The equation's static params.
    path_classification : dict
        ``hidden path -> PathClassification`` value.
    trainable_vars, trainable_paths, trainable_leaf_indices, trainable_param_states : dict
        Per trainable key: the operand variable, the ``ParamState`` path, the leaf index inside
        that state's pytree, and the state.
    trainable_processing_chains : dict
        Per trainable key, the primitives between the state leaf and the operand.
    control_flow_context : RelationDescent, optional
        Set for relations inside a descended scan.
    crossed_weight_paths : tuple
        The weights of the trainable ETP equations the ``y -> h`` tails cross (compiled with
        ``include_weight_to_weight=True``); empty when the tails are non-parametric.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> relation = braintrace.compile_etrace_graph(cell, jnp.ones(3)).hidden_param_op_relations[0]
    >>> relation.primitive.name, relation.trainable_paths, relation.connected_hidden_paths
    ('etp_mv', {'weight': ('W', 'weight'), 'bias': ('W', 'weight')}, [('h',)])
    """

    primitive: Primitive
    x_var: Var | None
    y_var: Var
    hidden_groups: list[HiddenGroup]
    y_to_hidden_group_jaxprs: list[Jaxpr]
    connected_hidden_paths: list[Path]
    eqn_params: Params
    path_classification: dict[Path, str] = {}
    trainable_vars: dict[str, Var] = {}
    trainable_paths: dict[str, Path] = {}
    trainable_leaf_indices: dict[str, int] = {}
    trainable_param_states: dict[str, brainstate.ParamState] = {}
    trainable_processing_chains: dict[str, tuple[Primitive, ...]] = {}
    control_flow_context: RelationDescent | None = None
    crossed_weight_paths: tuple[Path, ...] = ()

    @property
    def x(self) -> Var | None:
        return self.x_var

    @property
    def y(self) -> Var:
        return self.y_var

    @property
    def path(self) -> Path | None:
        """The path of the first trainable state."""
        return next(iter(self.trainable_paths.values()), None)

    def y_to_hidden_groups(
        self, y_val: jax.Array, const_vals: Mapping[Var, jax.Array], concat_hidden_vals: bool = True
    ) -> list[jax.Array | list[jax.Array]]:
        """Evaluate every ``y -> h`` tail; stacked per group when ``concat_hidden_vals``."""
        outs: list[jax.Array | list[jax.Array]] = []
        for group, jaxpr in zip(self.hidden_groups, self.y_to_hidden_group_jaxprs):
            hs = eval_jaxpr(jaxpr, [const_vals[v] for v in tail_constvars(jaxpr)], y_val)
            outs.append(group.concat_hidden(hs) if concat_hidden_vals else hs)
        return outs

    def output_layout(self, group: HiddenGroup, value: jax.Array, lead: int = 0) -> jax.Array:
        """``value``, laid out over ``group``'s positions, re-laid over the positions of ``y``.

        ``value`` is ``(*lead axes, *group.varshape, *rest)`` (a ``df``, a hidden Jacobian, a
        learning signal). Where ``y`` is the group's shape with extra axes of size one (a layer
        that adds a batch of one to an unbatched state, ``(1, 28, 28, 8)`` driving
        ``(28, 28, 8)``; a channel axis of one, ``(B, 1, N)`` driving ``(B, N)``) the result is ``(*lead axes, *y.shape, *rest)``, the layout the
        primitive's rules work in; otherwise ``value`` itself.

        Examples
        --------
        >>> import brainstate, jax.numpy as jnp, braintrace
        >>> class Squeezed(brainstate.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
        ...         self.h = brainstate.HiddenState(jnp.zeros(2))
        ...     def update(self, x):
        ...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x[None], self.w.value)[0]
        ...         return self.h.value
        >>> (rel,) = braintrace.find_hidden_param_op_relations_from_module(Squeezed(), jnp.ones(3))
        >>> rel.output_layout(rel.hidden_groups[0], jnp.ones((2, 1))).shape  # (*varshape, S)
        (1, 2, 1)
        """
        if not self.adds_unit_axes(group):
            return value
        shape, rank = tuple(value.shape), len(group.varshape)
        return value.reshape(shape[:lead] + shape_of(self.y_var) + shape[lead + rank:])

    def adds_unit_axes(self, group: HiddenGroup) -> bool:
        """Whether ``y`` is ``group``'s shape with extra axes of size one (see :meth:`output_layout`).

        The extra axes may lead (``(1, 28, 28, 8)`` driving ``(28, 28, 8)``) or sit behind the
        batch (``(B, 1, N)`` driving ``(B, N)``): either way the values keep their order, so a
        reshape moves between the two layouts.
        """
        return _adds_unit_axes(shape_of(self.y_var), tuple(group.varshape))

    def traces_lead_with_batch(self, group: HiddenGroup) -> bool:
        """Whether this relation's traces for ``group`` lead with the group's batch axis.

        Assuming the group's leading axis is a batch (the caller knows): true when ``y``
        broadcasts over the group's leading axes, or has the group's shape and comes from a
        batched primitive; false when ``y`` adds leading axes of its own (see
        :meth:`output_layout`) or the primitive is unbatched.
        """
        y_shape, varshape = shape_of(self.y_var), tuple(group.varshape)
        if len(y_shape) != len(varshape):
            if self.adds_unit_axes(group) and y_shape[0] == varshape[0] != 1:
                return is_batched_primitive(self.primitive)  # unit axes behind the batch
            return len(y_shape) < len(varshape)
        return is_batched_primitive(self.primitive)

    def dict(self) -> dict[str, object]:
        return self._asdict()

    def __repr__(self) -> str:
        return (
            f"HiddenParamOpRelation(primitive={self.primitive.name}, "
            f"trainable_paths={self.trainable_paths}, hidden_paths={self.connected_hidden_paths}, "
            f"groups={[g.index for g in self.hidden_groups]})"
        )


HiddenParamOpRelation.__module__ = "braintrace"


def _adds_unit_axes(y_shape: tuple[int, ...], varshape: tuple[int, ...]) -> bool:
    """Whether ``y_shape`` is ``varshape`` with extra axes of size one (in any places)."""
    return (len(y_shape) > len(varshape)
            and [n for n in y_shape if n != 1] == [n for n in varshape if n != 1])


def _lays_over_hidden(y_shape: tuple[int, ...], varshape: tuple[int, ...], resized: bool) -> bool:
    """Whether each position of a hidden state of ``varshape`` reads one position of ``y``.

    True when ``y`` broadcasts to the hidden shape, or is it with extra axes of size one
    (:meth:`HiddenParamOpRelation.output_layout` re-lays those). A ``y`` that only broadcasts
    *with* it (``(2, 1)`` against ``(4,)``, giving ``(2, 4)``) was reshaped into another layout or
    reaches the state through a reduction: its positions are not the state's. A state the step
    ``resized`` (a batch the state lacks) only has to broadcast with ``y``: the learner refuses
    the resize itself, with the fix, before any trace is built.
    """
    try:
        joint = jnp.broadcast_shapes(y_shape, varshape)
    except ValueError:
        return False
    return resized or joint == varshape or _adds_unit_axes(y_shape, varshape)


def _blocks(eqn: JaxprEqn) -> bool:
    """A trainable ETP equation: the tail walk does not cross it."""
    return is_etp_primitive(eqn.primitive) and not is_etp_enable_gradient_primitive(eqn.primitive)


class _Graph:
    """Producer/consumer lookups of one jaxpr, built once per relation pass."""

    def __init__(self, jaxpr: Jaxpr) -> None:
        self.jaxpr = jaxpr
        self.producers = build_producer_map(jaxpr)
        self.consumers = build_consumer_map(jaxpr)

    def reach(
        self, start: Var, source: JaxprEqn, stop: Container[Var], restricted: bool
    ) -> tuple[list[Var], list[JaxprEqn]]:
        """Vars reachable forward from ``start`` (not expanding through ``stop`` vars)."""
        seen: dict[Var, None] = {start: None}
        blocked: dict[int, JaxprEqn] = {}
        queue = deque([start])
        while queue:
            v = queue.popleft()
            if v in stop:
                continue
            for eqn in self.consumers.get(v, ()):
                if eqn is source:
                    continue
                if restricted and _blocks(eqn):
                    blocked.setdefault(id(eqn), eqn)
                    continue
                for out in eqn.outvars:
                    if is_var(out) and out not in seen:
                        seen[out] = None
                        queue.append(out)
        return list(seen), list(blocked.values())


def _collect_etp_eqns(jaxpr: Jaxpr, policy: ControlFlowPolicy, descended: frozenset[int]) -> list[JaxprEqn]:
    found = []
    for eqn in jaxpr.eqns:
        if is_etp_primitive(eqn.primitive):
            found.append(eqn)
        elif eqn.primitive.name in CONTROL_FLOW_PRIMITIVES and id(eqn) not in descended:
            _check_etp_in_body(eqn, policy)
        elif is_jit(eqn) and any(contains_eqn(s, lambda e: is_etp_primitive(e.primitive)) for s in subjaxprs(eqn)):
            emit(DiagnosticKind.PRIMITIVE_INSIDE_NESTED_JIT, DiagnosticLevel.WARNING,
                 "ETP operations inside a jit that was not inlined are ignored; compile through "
                 "extract_module_info, which inlines user jit bodies.")
    return found


def _check_etp_in_body(eqn: JaxprEqn, policy: ControlFlowPolicy) -> None:
    inner: list[JaxprEqn] = []
    for body in subjaxprs(eqn):
        _gather_etp(body, inner)
    for etp in inner:
        message = (
            f"ETP primitive {etp.primitive.name} found inside a {eqn.primitive.name} body that "
            f"the compiler could not flatten; its weight cannot learn online there. Move the "
            f"operation out of the loop/branch, keep the loop within "
            f"ControlFlowPolicy.scan_unroll_limit, or pass "
            f"ControlFlowPolicy(etp_in_control_flow='exclude') to leave it out."
        )
        if policy.etp_in_control_flow == "error":
            emit(DiagnosticKind.PRIMITIVE_INSIDE_CONTROL_FLOW, DiagnosticLevel.ERROR, message,
                 primitive=etp.primitive, also_warn=False)
            raise NotImplementedError(message)
        emit(DiagnosticKind.PRIMITIVE_INSIDE_CONTROL_FLOW, DiagnosticLevel.WARNING, message,
             primitive=etp.primitive)


def _gather_etp(jaxpr: Jaxpr, out: list[JaxprEqn]) -> None:
    for eqn in jaxpr.eqns:
        if is_etp_primitive(eqn.primitive):
            out.append(eqn)
        for sub in subjaxprs(eqn):
            _gather_etp(sub, out)


class _Trainable(NamedTuple):
    var: Var
    path: Path
    leaf_index: int
    chain: tuple[Primitive, ...]


def _resolve(
    graph: _Graph, start: Atom, invar_to_weight_path: dict[Var, Path], weight_path_to_invars: dict[Path, list[Var]]
) -> _Trainable | None:
    """Backward BFS from an operand to the first ``ParamState`` leaf it is computed from."""
    if not is_var(start):
        return None
    chain: dict[Primitive, None] = {}
    seen = {start}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v in invar_to_weight_path:
            path = invar_to_weight_path[v]
            leaves = weight_path_to_invars.get(path, [v])
            if v in leaves:
                index = leaves.index(v)
            else:
                emit(DiagnosticKind.PYTREE_WEIGHT_LEAF_AMBIGUOUS, DiagnosticLevel.WARNING,
                     f"Could not tell which leaf of the state {path} feeds this ETP operation; "
                     f"using leaf 0.", weight_path=path)
                index = 0
            return _Trainable(start, path, index, tuple(chain))
        eqn = graph.producers.get(v)
        if eqn is None:
            continue
        chain.setdefault(eqn.primitive)
        for a in eqn.invars:
            if is_var(a) and a not in seen:
                seen.add(a)
                queue.append(a)
    return None


def _tail_jaxpr(graph: _Graph, y_var: Var, source: JaxprEqn, outvars: list[Var], restricted: bool) -> Jaxpr:
    """``y -> outvars`` over the equations between them; everything else is a constvar.

    ``restricted``: the tail stops at trainable ETP equations (else it crosses them).
    """
    forward, _ = graph.reach(y_var, source, stop=(), restricted=restricted)
    downstream = set(forward)
    needed = {v for v in outvars if is_var(v)}
    kept: list[JaxprEqn] = []
    for eqn in reversed(graph.jaxpr.eqns):
        if eqn is source or (restricted and _blocks(eqn)):
            continue
        outs = [v for v in eqn.outvars if is_var(v)]
        if any(v in needed for v in outs) and any(is_var(a) and a in downstream for a in eqn.invars):
            kept.append(eqn)
            needed.update(a for a in eqn.invars if is_var(a))
    kept.reverse()
    produced = {v for e in kept for v in e.outvars if is_var(v)}
    referenced = [a for e in kept for a in e.invars if is_var(a)] + [v for v in outvars if is_var(v)]
    constvars = list(dict.fromkeys(v for v in referenced if v not in produced and v is not y_var))
    return new_jaxpr(constvars, [y_var], outvars, kept, name="y_to_hidden")


def find_hidden_param_op_relations_from_jaxpr(
    jaxpr: Jaxpr,
    invar_to_weight_path: dict[Var, Path],
    path_to_state: dict[Path, brainstate.State],
    outvar_to_hidden_path: dict[Var, Path],
    hid_path_to_group: dict[Path, HiddenGroup],
    weight_path_to_invars: dict[Path, list[Var]] | None = None,
    control_flow: ControlFlowPolicy = DEFAULT_CONTROL_FLOW_POLICY,
    descended_scan_eqn_ids: frozenset[int] = frozenset(),
    include_weight_to_weight: bool = False,
    **_ignored: object,
) -> tuple[HiddenParamOpRelation, ...]:
    """The relations of a flat step jaxpr (see the module docstring).

    With ``include_weight_to_weight``, ``y -> h`` tails cross other trainable ETP equations.
    """
    for path in outvar_to_hidden_path.values():
        if path not in hid_path_to_group:
            raise ValueError(f"Hidden state {path} has no hidden group; compute the groups of this jaxpr first.")
    for group in hid_path_to_group.values():
        for out in group.hidden_outvars:
            if is_var(out) and out not in outvar_to_hidden_path:
                raise ValueError(f"Hidden group {group.index} does not belong to this jaxpr (unknown output {out}).")
    weight_path_to_invars = weight_path_to_invars or {}
    graph = _Graph(jaxpr)
    relations = []
    for eqn in _collect_etp_eqns(jaxpr, control_flow, descended_scan_eqn_ids):
        relation = _relation_of(eqn, graph, invar_to_weight_path, weight_path_to_invars, path_to_state,
                                outvar_to_hidden_path, hid_path_to_group, include_weight_to_weight)
        if relation is not None:
            relations.append(relation)
    return tuple(relations)


def _relation_of(
    eqn: JaxprEqn, graph: _Graph, invar_to_weight_path: dict[Var, Path],
    weight_path_to_invars: dict[Path, list[Var]], path_to_state: dict[Path, brainstate.State],
    outvar_to_hidden_path: dict[Var, Path], hid_path_to_group: dict[Path, HiddenGroup],
    include_weight_to_weight: bool,
) -> HiddenParamOpRelation | None:
    prim = eqn.primitive
    restricted = not include_weight_to_weight
    xi = get_x_invar_index(prim)
    x_atom = eqn.invars[xi] if xi is not None else None
    x_var = x_atom if is_var(x_atom) else None
    y_var = eqn.outvars[get_y_outvar_index(prim)]
    if len(eqn.outvars) > 1:
        emit(DiagnosticKind.MULTI_OUTPUT_PRIMITIVE_DETECTED, DiagnosticLevel.INFO,
             f"ETP primitive {prim.name} has {len(eqn.outvars)} outputs; output "
             f"{get_y_outvar_index(prim)} is traced.", primitive=prim)
    trainables: dict[str, _Trainable] = {}
    for key, index in get_trainable_invars(prim, eqn.params).items():
        found = _resolve(graph, eqn.invars[index], invar_to_weight_path, weight_path_to_invars)
        if found is None:
            emit(DiagnosticKind.TRAINABLE_INVAR_NOT_PARAMSTATE, DiagnosticLevel.INFO,
                 f"The {key!r} operand of {prim.name} is not computed from a ParamState and does "
                 f"not learn online; wrap it in a brainstate.ParamState if it should.",
                 primitive=prim, context={"key": key, "invar_index": index})
        else:
            trainables[key] = found
    if not trainables:
        emit(DiagnosticKind.RELATION_EXCLUDED_NO_PARAMSTATE, DiagnosticLevel.WARNING,
             f"No trainable operand of {prim.name} is computed from a ParamState; the operation "
             f"is left out of online learning.", primitive=prim)
        return None
    weight_path = next(iter(trainables.values())).path
    targets, blocked = _targets(eqn, y_var, graph, outvar_to_hidden_path, hid_path_to_group, restricted)
    kept: dict[Var, str] = {}
    for h in targets:
        h_path = outvar_to_hidden_path[h]
        # Compare with the state's varshape: a HiddenGroupState's trailing state axis is not a
        # position axis (0.2.4 compared the full shape and excluded every such relation).
        y_shape, h_shape = shape_of(y_var), tuple(path_to_state[h_path].varshape)
        if not _lays_over_hidden(y_shape, h_shape, resized=shape_of(h)[:len(h_shape)] != h_shape):
            emit(DiagnosticKind.RELATION_EXCLUDED_SHAPE_MISMATCH, DiagnosticLevel.WARNING,
                 f"The output of {prim.name} with weight {weight_path} has shape {y_shape}, which "
                 f"neither broadcasts to hidden state {h_path} of shape {h_shape} nor is that shape "
                 f"with axes of size one; that hidden state is left out of the relation.",
                 primitive=prim, weight_path=weight_path,
                 hidden_paths=(h_path,), context={"y_shape": y_shape, "hidden_shape": h_shape})
            continue
        kept[h] = _classify(graph, eqn, y_var, h)
    if not kept:
        _emit_no_target(prim, weight_path, blocked, trainables)
        return None
    line = source_line(eqn.source_info)
    required_rules(prim, used_at=f"the operation on weight {weight_path}{f' at {line}' if line else ''}")
    for h, cls in kept.items():
        if cls == PathClassification.MIXED and restricted:
            emit(DiagnosticKind.RELATION_PARTIAL_PATH, DiagnosticLevel.WARNING,
                 f"The output of {prim.name} with weight {weight_path} reaches hidden state "
                 f"{outvar_to_hidden_path[h]} both directly and through another trainable ETP "
                 f"operation; the credit of the indirect path is not traced.",
                 primitive=prim, weight_path=weight_path, hidden_paths=(outvar_to_hidden_path[h],))
    groups: list[HiddenGroup] = list({id(hid_path_to_group[outvar_to_hidden_path[h]]): hid_path_to_group[outvar_to_hidden_path[h]] for h in kept}.values())
    connected = [outvar_to_hidden_path[h] for h in kept]
    tails = [_tail_jaxpr(graph, y_var, eqn, list(g.hidden_outvars), restricted) for g in groups]
    crossed = () if restricted else _crossed_weight_paths(tails, invar_to_weight_path, weight_path_to_invars, graph)
    relation = HiddenParamOpRelation(
        primitive=prim, x_var=x_var, y_var=y_var, hidden_groups=groups,
        y_to_hidden_group_jaxprs=tails, connected_hidden_paths=connected,
        eqn_params=dict(eqn.params),
        path_classification={outvar_to_hidden_path[h]: c for h, c in kept.items()},
        trainable_vars={k: t.var for k, t in trainables.items()},
        trainable_paths={k: t.path for k, t in trainables.items()},
        trainable_leaf_indices={k: t.leaf_index for k, t in trainables.items()},
        trainable_param_states={k: path_to_state[t.path] for k, t in trainables.items()},
        trainable_processing_chains={k: t.chain for k, t in trainables.items()},
        crossed_weight_paths=crossed,
    )
    through = f", through the trainable operation(s) of {list(crossed)}" if crossed else ""
    emit(DiagnosticKind.RELATION_INCLUDED, DiagnosticLevel.INFO,
         f"{prim.name} with weight {weight_path} learns online through hidden states {connected}{through}.",
         primitive=prim, weight_path=weight_path, hidden_paths=tuple(connected),
         context={"hidden_group_indices": [g.index for g in groups],
                  "path_classification": dict(relation.path_classification),
                  "crossed_weight_paths": list(crossed)})
    return relation


def _targets(
    eqn: JaxprEqn, y_var: Var, graph: _Graph, outvar_to_hidden_path: dict[Var, Path],
    hid_path_to_group: dict[Path, HiddenGroup], restricted: bool,
) -> tuple[list[Var], list[JaxprEqn]]:
    """Hidden outputs ``y`` drives (``restricted``: without crossing a trainable ETP equation)."""
    hidden = outvar_to_hidden_path
    direct, blocked = graph.reach(y_var, eqn, stop=hidden, restricted=restricted)
    groups = {id(hid_path_to_group[hidden[v]]) for v in direct if v in hidden}
    if not groups:
        return [], blocked
    own = {v: None for v in hidden if id(hid_path_to_group[hidden[v]]) in groups}
    other = {v: None for v in hidden if v not in own}
    reach, _ = graph.reach(y_var, eqn, stop=other, restricted=restricted)
    return [v for v in reach if v in own], blocked


def _crossed_weight_paths(
    tails: list[Jaxpr], invar_to_weight_path: dict[Var, Path], weight_path_to_invars: dict[Path, list[Var]],
    graph: _Graph,
) -> tuple[Path, ...]:
    """The ``ParamState`` paths of the trainable ETP equations inside ``tails``."""
    paths: dict[Path, None] = {}
    for tail in tails:
        for inner in tail.eqns:
            if not _blocks(inner):
                continue
            for index in get_trainable_invars(inner.primitive, inner.params).values():
                found = _resolve(graph, inner.invars[index], invar_to_weight_path, weight_path_to_invars)
                if found is not None:
                    paths.setdefault(found.path)
    return tuple(paths)


def _classify(graph: _Graph, eqn: JaxprEqn, y_var: Var, h: Var) -> str:
    forward, _ = graph.reach(y_var, eqn, stop=(), restricted=False)
    fwd = set(forward)
    backward: set[Var] = set()
    queue: deque[Var] = deque([h])
    while queue:
        v = queue.popleft()
        if v in backward:
            continue
        backward.add(v)
        producer = graph.producers.get(v)
        if producer is not None:
            queue.extend(a for a in producer.invars if is_var(a))
    mid = [
        e for e in graph.jaxpr.eqns
        if e is not eqn and any(is_var(v) and v in fwd and v in backward for v in e.outvars)
    ]
    if not any(_blocks(e) for e in mid):
        return PathClassification.ALL_DIRECT
    direct, _ = graph.reach(y_var, eqn, stop=(), restricted=True)
    return PathClassification.MIXED if h in direct else PathClassification.ALL_THROUGH_OTHER_ETP


def _emit_no_target(
    prim: Primitive, weight_path: Path, blocked: list[JaxprEqn], trainables: dict[str, _Trainable]
) -> None:
    if blocked:
        emit(DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT, DiagnosticLevel.WARNING,
             f"The output of {prim.name} with weight {weight_path} reaches hidden states only "
             f"through another trainable ETP operation ({', '.join(e.primitive.name for e in blocked)}); "
             f"this learner's per-position traces cannot hold weight -> weight -> hidden, so this "
             f"weight has no eligibility trace (it still gets its exact gradient within each step, "
             f"or within the window in multi-step mode). SnAp (n >= 2) and UORO trace it.",
             primitive=prim, weight_path=weight_path,
             context={"blocking_primitives": [e.primitive for e in blocked],
                      "blocking_weight_paths": list(dict.fromkeys(t.path for t in trainables.values()))})
    else:
        emit(DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL, DiagnosticLevel.WARNING,
             f"The output of {prim.name} with weight {weight_path} reaches no hidden state; "
             f"it has no temporal dependence, so it gets no eligibility trace and learns from its "
             f"exact same-step gradient (a plain JAX op does the same for readout weights).",
             primitive=prim, weight_path=weight_path)


def find_hidden_param_op_relations_from_minfo(
    minfo: ModuleInfo, hid_path_to_group: dict[Path, HiddenGroup], descended_scan_eqn_ids: frozenset[int] = frozenset(),
    include_weight_to_weight: bool = False,
) -> tuple[HiddenParamOpRelation, ...]:
    """The relations of a traced step, given its hidden groups.

    With ``include_weight_to_weight``, ``y -> h`` tails cross other trainable ETP equations
    (see the module docstring).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> minfo = braintrace.extract_module_info(cell, jnp.ones(3))
    >>> groups, hid_path_to_group = braintrace.find_hidden_groups_from_minfo(minfo)
    >>> relations = braintrace.find_hidden_param_op_relations_from_minfo(minfo, hid_path_to_group)
    >>> [r.trainable_paths['weight'] for r in relations]
    [('W', 'weight')]
    """
    invar_to_weight_path = dict(minfo.invar_to_weight_path)
    return find_hidden_param_op_relations_from_jaxpr(
        minfo.jaxpr, invar_to_weight_path, minfo.retrieved_model_states, minfo.outvar_to_hidden_path,
        hid_path_to_group, weight_path_to_invars=minfo.weight_path_to_invars,
        control_flow=minfo.control_flow, descended_scan_eqn_ids=descended_scan_eqn_ids,
        include_weight_to_weight=include_weight_to_weight,
    )


def find_hidden_param_op_relations_from_module(
    model: brainstate.nn.Module, *model_args: PyTree, **model_kwargs: PyTree
) -> tuple[HiddenParamOpRelation, ...]:
    """Trace one step of ``model`` and return its relations (default hidden groups).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> relations = braintrace.find_hidden_param_op_relations_from_module(cell, jnp.ones(3))
    >>> [(r.primitive.name, r.connected_hidden_paths) for r in relations]
    [('etp_mv', [('h',)])]
    """
    minfo = extract_module_info(model, *model_args, **model_kwargs)
    _, hid_path_to_group = find_hidden_groups_from_minfo(minfo)
    return find_hidden_param_op_relations_from_minfo(minfo, hid_path_to_group)

