"""``compile_etrace_graph``: a model step turned into an ``ETraceGraph``.

The graph holds the traced step (with every intermediate the learners need hoisted as extra
outputs), its hidden groups, the relations from ETP equations to those groups, the perturbed
step that yields the same-step learning signal, and the record of every compiler decision.

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
>>> graph = braintrace.compile_etrace_graph(Leaky(), jnp.ones(3))
>>> len(graph.hidden_groups), len(graph.hidden_param_op_relations)
(1, 1)
>>> [r.kind.value for r in graph.explain(kind=braintrace.DiagnosticKind.RELATION_INCLUDED)]
['relation_included']
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, NamedTuple, Sequence

import brainstate
import jax

from braintrace._compatible_imports import Atom, Var, is_var, jaxpr_all_invars
from braintrace._compiler.control_flow_policy import ControlFlowPolicy
from braintrace._compiler.diagnostics import CompilationRecord, DiagnosticKind, diagnostic_context
from braintrace._compiler.hid_param_op import HiddenParamOpRelation, find_hidden_param_op_relations_from_minfo
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.hidden_group_discovery import find_hidden_groups_from_minfo
from braintrace._compiler.hidden_pertubation import (
    HiddenPerturbation,
    add_hidden_perturbation_from_minfo,
    report_reads_past_update,
)
from braintrace._compiler.module_info import ModuleInfo, Path, StepOutputs, extract_module_info
from braintrace._compiler.position_dependence import Dependence, warn_relabelling_tails
from braintrace._compiler.scan_descent import ScanDescentBundle, apply_scan_descent
from braintrace._compiler.snap_pattern import (
    DEFAULT_MAX_JACOBIAN_ELEMENTS,
    check_snap_anchors,
    tail_within_neighbourhoods,
    check_snap_arguments,
    reject_snap_descent,
    trained_group_patterns,
)
from braintrace._compiler.untraced_weights import warn_untraced_weights
from braintrace._typing import PyTree

__all__ = ["ETraceGraph", "compile_etrace_graph", "DEFAULT_MAX_JACOBIAN_ELEMENTS"]


class ETraceGraph(NamedTuple):
    """Everything the learners need to know about one model step.

    Attributes
    ----------
    module_info : ModuleInfo
        The traced step; its jaxpr also returns the hoisted intermediates.
    hidden_groups : list of HiddenGroup
    hid_path_to_group : dict
    hidden_param_op_relations : tuple of HiddenParamOpRelation
    hidden_perturb : HiddenPerturbation or None
    diagnostics : tuple of CompilationRecord

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> graph = learner.graph
    >>> len(graph.hidden_groups), len(graph.hidden_param_op_relations)
    (1, 1)
    >>> [record.kind.name for record in graph.diagnostics]
    ['RELATION_INCLUDED']
    """

    module_info: ModuleInfo
    hidden_groups: list[HiddenGroup]
    hid_path_to_group: dict[Path, HiddenGroup]
    hidden_param_op_relations: tuple[HiddenParamOpRelation, ...]
    hidden_perturb: HiddenPerturbation | None
    diagnostics: tuple[CompilationRecord, ...] = ()

    def explain(
        self,
        *,
        weight_path: Path | None = None,
        hidden_path: Path | None = None,
        kind: DiagnosticKind | None = None,
    ) -> tuple[CompilationRecord, ...]:
        """The compiler records matching every given filter (all records without filters)."""
        return tuple(
            r for r in self.diagnostics
            if (weight_path is None or r.weight_path == weight_path)
            and (hidden_path is None or hidden_path in r.hidden_paths)
            and (kind is None or r.kind is kind)
        )

    def call_hidden_perturb(
        self, args: PyTree, perturb_data: Sequence[jax.Array], old_state_vals: Sequence[PyTree] | None = None
    ) -> StepOutputs:
        """Run the perturbed step; returns what :meth:`ModuleInfo.jaxpr_call` returns."""
        if self.hidden_perturb is None:
            raise ValueError("This graph was compiled with include_hidden_perturb=False.")
        minfo = self.module_info
        if old_state_vals is None:
            old_state_vals = [st.value for st in minfo.compiled_model_states]
        if not isinstance(args, tuple):
            args = (args,)
        flat = jax.tree.leaves((args, list(old_state_vals)))
        outs = self.hidden_perturb.eval_jaxpr(flat, perturb_data)
        return minfo._process(*args, jaxpr_outs=outs)

    def dict(self) -> dict[str, object]:
        return self._asdict()

    def __repr__(self) -> str:
        return (
            f"ETraceGraph(hidden_groups={[g.hidden_paths for g in self.hidden_groups]}, "
            f"relations={list(self.hidden_param_op_relations)}, n_diagnostics={len(self.diagnostics)})"
        )


ETraceGraph.__module__ = "braintrace"

_guard = threading.local()


@contextlib.contextmanager
def _no_recursion() -> Iterator[None]:
    if getattr(_guard, "active", False):
        raise NotImplementedError(
            'Detected recursive call to "compile_graph". Do not compile a learner inside the '
            "step of a model that is itself being compiled."
        )
    _guard.active = True
    try:
        yield
    finally:
        _guard.active = False


def _hoisted_vars(
    minfo: ModuleInfo, groups: Sequence[HiddenGroup], relations: Sequence[HiddenParamOpRelation],
    bundles: Sequence[ScanDescentBundle] = (),
) -> list[Var]:
    """The intermediates the executors read: relation inputs, tail and transition inputs.

    Descended relations and groups are read through their scans' stacked outputs instead.
    """
    candidates: list[Atom] = []
    for rel in relations:
        if rel.control_flow_context is not None:
            continue
        if rel.x_var is not None:
            candidates.append(rel.x_var)
        for tail in rel.y_to_hidden_group_jaxprs:
            candidates.extend(jaxpr_all_invars(tail))
    for group in groups:
        if group.descent is None:
            candidates.extend([*group.hidden_invars, *group.transition_jaxpr_constvars])
    for bundle in bundles:
        candidates.extend(bundle.stacked_outer_vars)
    existing = set(v for v in minfo.jaxpr.outvars if isinstance(v, Var))
    hoisted = dict.fromkeys(v for v in candidates if is_var(v) and v not in existing)
    return list(hoisted)


def _append_descended_groups(
    groups: list[HiddenGroup], hid_path_to_group: dict[Path, HiddenGroup], bundles: Sequence[ScanDescentBundle]
) -> list[HiddenParamOpRelation]:
    """Add the bundles' groups after the flat ones (re-indexed); their relations, re-pointed."""
    for group in groups:
        taken = [p for p in group.hidden_paths if any(p in g.hidden_paths for b in bundles for g in b.groups)]
        if taken:
            raise NotImplementedError(
                f"Hidden states {group.hidden_paths} are coupled outside a descended scan, but {taken} "
                f"is carried by that scan. Compute the coupled states inside the scan body too, or set "
                f"ControlFlowPolicy(scan_descent='off', scan_unroll_limit=N) with N at least the loop's "
                f"length, so that the loop is unrolled."
            )
    relations: list[HiddenParamOpRelation] = []
    for bundle in bundles:
        renamed = {}
        for group in bundle.groups:
            new = group._replace(index=len(groups))
            renamed[id(group)] = new
            groups.append(new)
            for path in new.hidden_paths:
                hid_path_to_group[path] = new
        relations.extend(
            rel._replace(hidden_groups=[renamed[id(g)] for g in rel.hidden_groups]) for rel in bundle.relations
        )
    return relations


def _attach_snap_patterns(
    groups: list[HiddenGroup], hid_path_to_group: dict[Path, HiddenGroup],
    relations: Sequence[HiddenParamOpRelation], n: int, max_elements: int,
) -> tuple[HiddenParamOpRelation, ...]:
    """Give every group a relation trains its SnAp-``n`` pattern (in place); the relations, re-pointed."""
    for index, pattern in trained_group_patterns(groups, relations, n, max_elements).items():
        groups[index] = groups[index]._replace(snap=pattern)
        for path in groups[index].hidden_paths:
            hid_path_to_group[path] = groups[index]
    return tuple(rel._replace(hidden_groups=[groups[g.index] for g in rel.hidden_groups]) for rel in relations)


def _within_snap(group: HiddenGroup, reach: Dependence) -> bool:
    """Whether ``group``'s SnAp neighbourhoods hold what a relabelling tail reaches."""
    return group.snap is not None and tail_within_neighbourhoods(reach, group.snap)


def _reject_relations_into_descent(relations: Sequence[HiddenParamOpRelation]) -> None:
    for rel in relations:
        targets = [p for g in rel.hidden_groups if g.descent is not None for p in g.hidden_paths]
        if targets:
            raise NotImplementedError(
                f"An ETP relation outside a descended scan targets hidden state(s) {targets} carried by "
                f"that scan ({rel.primitive.name} with weight {rel.path}). Per-substep eligibility traces "
                f"need the operation inside the loop: move the operation inside the scan body, "
                f"restructure the model, or set ControlFlowPolicy(scan_descent='off', scan_unroll_limit=N) "
                f"with N at least the loop's length, so that the loop is unrolled."
            )


def compile_etrace_graph(
    model: brainstate.nn.Module,
    *model_args: PyTree,
    include_hidden_perturb: bool = True,
    include_recurrent_mixing: bool = False,
    control_flow: ControlFlowPolicy | None = None,
    sparse_n: int | None = None,
    snap_max_jacobian_elements: int = DEFAULT_MAX_JACOBIAN_ELEMENTS,
    include_weight_to_weight: bool = False,
) -> ETraceGraph:
    """Compile one step of ``model`` into an :class:`ETraceGraph`.

    Parameters
    ----------
    model : brainstate.nn.Module
        The model, states initialised.
    *model_args
        Example inputs of one step.
    include_hidden_perturb : bool
        Build the perturbed step (needed by the learners).
    include_recurrent_mixing : bool
        Trace weight mixing into the group transitions (block-diagonal Jacobians). A relation
        whose ``y -> h`` tail moves values to other positions is then reported
        (``TAIL_RELABELS_POSITIONS``) unless the learner follows the moved influence: with
        ``include_weight_to_weight``, UORO follows all of it and SnAp-n what its
        neighbourhoods hold.
    control_flow : ControlFlowPolicy, optional
        Treatment of control flow inside the step.
    sparse_n : int, optional
        The SnAp order (needs ``include_recurrent_mixing=True``). Every relation must be
        anchored (its primitive's ``snap_anchor``); from ``2`` on, every group a relation
        trains gets its :class:`~braintrace._compiler.snap_pattern.SnapPattern` as
        ``HiddenGroup.snap`` (``1`` is the coupled scope: checks only).
    snap_max_jacobian_elements : int
        Ceiling on a group's widened block Jacobian ``P·(K·S)²`` (default ``2**24``).
    include_weight_to_weight : bool
        Let ``y -> h`` tails cross other trainable ETP operations, so that a weight reaching
        the hidden states only through another one gets a relation: for learners that follow
        a tail's influence onto other positions (SnAp-n with ``n >= 2``, UORO).

    Returns
    -------
    ETraceGraph

    Raises
    ------
    TypeError
        If ``model`` is not a ``brainstate.nn.Module``.
    NotSupportedError
        If the step writes a ``ParamState``, coupled hidden states differ in shape, or a SnAp
        pattern exceeds ``snap_max_jacobian_elements``.
    NotImplementedError
        On a recursive compile, control flow the policy rejects, or, with ``sparse_n``, a
        relation whose primitive is not SnAp-anchored or a descended scan.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> graph = braintrace.compile_etrace_graph(cell, jnp.ones(3))
    >>> graph.hidden_groups[0].hidden_paths, graph.hidden_perturb.perturb_hidden_paths
    ([('h',)], [('h',)])
    """
    check_snap_arguments(sparse_n, include_recurrent_mixing, snap_max_jacobian_elements)
    with _no_recursion(), diagnostic_context() as reporter:
        minfo = extract_module_info(model, *model_args, control_flow=control_flow)
        minfo, bundles = apply_scan_descent(minfo)
        descended = frozenset(b.info.scan_eqn_id for b in bundles)
        descended_paths = frozenset(p for b in bundles for g in b.groups for p in g.hidden_paths)
        if sparse_n is not None:
            reject_snap_descent(sparse_n, descended_paths)
        groups, hid_path_to_group = find_hidden_groups_from_minfo(
            minfo, include_recurrent_mixing=include_recurrent_mixing,
            descended_scan_eqn_ids=descended, descended_hidden_paths=descended_paths,
        )
        descended_relations = _append_descended_groups(groups, hid_path_to_group, bundles)
        for i, group in enumerate(groups):
            if group.index != i:
                raise RuntimeError(f"Hidden group {group.index} sits at position {i}.")
        flat = find_hidden_param_op_relations_from_minfo(minfo, hid_path_to_group, descended, include_weight_to_weight)
        _reject_relations_into_descent(flat)
        relations = (*flat, *descended_relations)
        if sparse_n is not None:
            check_snap_anchors(relations, sparse_n)
            if sparse_n >= 2:
                relations = _attach_snap_patterns(
                    groups, hid_path_to_group, relations, sparse_n, snap_max_jacobian_elements)
        if include_recurrent_mixing and not include_weight_to_weight:
            warn_relabelling_tails(relations)
        elif sparse_n is not None and sparse_n >= 2:
            warn_relabelling_tails(
                relations, covered=lambda rel, group, reach: _within_snap(groups[group.index], reach))
        warn_untraced_weights(minfo, relations)
        minfo = minfo.add_jaxpr_outs(_hoisted_vars(minfo, groups, relations, bundles))
        perturb = add_hidden_perturbation_from_minfo(minfo, descended) if include_hidden_perturb else None
        if perturb is not None:
            report_reads_past_update(perturb, groups, minfo)
    return ETraceGraph(
        module_info=minfo,
        hidden_groups=groups,
        hid_path_to_group=hid_path_to_group,
        hidden_param_op_relations=relations,
        hidden_perturb=perturb,
        diagnostics=reporter.records(),
    )
