"""The hidden perturbation: reading ``∂L/∂h^t`` off additive perturbations of the step.

Every hidden output ``h^t = f(...)`` is rewritten to ``ĥ = f(...)``, ``h^t = ĥ + p_h`` with a
new jaxpr input ``p_h``. Since ``∂L/∂p_h = ∂L/∂h^t``, the VJP of the perturbed step at
``p = 0`` gives the same-step learning signal of every hidden state, and everything downstream
of ``h^t`` (readouts) sees the perturbed value. (The module name keeps upstream's spelling.)

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((2, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value.sum()
>>> pert = braintrace.add_hidden_perturbation_in_module(Leaky(), jnp.ones(2))
>>> pert.perturb_hidden_paths, [p.shape for p in pert.init_perturb_data()]
([('h',)], [(2,)])
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._compatible_imports import (
    Atom,
    CONTROL_FLOW_PRIMITIVES,
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    ShapedArray,
    Var,
    closed_jaxpr_constvars,
    eval_jaxpr,
    is_var,
    jaxpr_all_invars,
    new_jaxpr_eqn,
)

from braintrace._compiler.base import JaxprEvaluation, check_unsupported_op
from braintrace._compiler.control_flow_policy import DEFAULT_CONTROL_FLOW_POLICY, ControlFlowPolicy
from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.jaxpr_graph import (
    ELEMENTWISE_PRIMITIVES,
    build_consumer_map,
    contains_eqn,
    fresh_var,
    new_jaxpr,
)
from braintrace._compiler.module_info import ModuleInfo, Path, extract_module_info
from braintrace._op._rule_helpers import dtype_of, shape_of
from braintrace._typing import PyTree

__all__ = [
    "HiddenPerturbation",
    "JaxprEvalForHiddenPerturbation",
    "add_hidden_perturbation_from_minfo",
    "add_hidden_perturbation_in_module",
    "groups_read_past_update",
    "LocalRelationWeights",
    "local_relation_weights",
]

_STOP_GRADIENT = jax.make_jaxpr(jax.lax.stop_gradient)(0.0).jaxpr.eqns[0].primitive


class HiddenPerturbation(NamedTuple):
    """The perturbed step: original inputs, then one perturbation per hidden state.

    Attributes
    ----------
    perturb_vars : list of Var
        The perturbation inputs, in compiled-state order of their hidden states.
    perturb_hidden_paths : list
        The perturbed hidden states' paths.
    perturb_hidden_states : list
        The perturbed hidden states.
    perturb_jaxpr : ClosedJaxpr
        The perturbed step.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> perturbation = braintrace.compile_etrace_graph(cell, jnp.ones(3)).hidden_perturb
    >>> perturbation.perturb_hidden_paths, [v.aval.shape for v in perturbation.perturb_vars]
    ([('h',)], [(4,)])
    """

    perturb_vars: list[Var]
    perturb_hidden_paths: list[Path]
    perturb_hidden_states: list[brainstate.HiddenState]
    perturb_jaxpr: ClosedJaxpr

    def eval_jaxpr(self, inputs: Sequence[jax.Array], perturb_data: Sequence[jax.Array]) -> list[jax.Array]:
        """Evaluate the perturbed step on flat ``inputs`` and ``perturb_data``."""
        jaxpr = self.perturb_jaxpr
        return eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *inputs, *perturb_data)

    def init_perturb_data(self) -> list[jax.Array]:
        """Zero perturbations."""
        return [jnp.zeros(shape_of(v), dtype_of(v)) for v in self.perturb_vars]

    def perturb_data_to_hidden_group_data(
        self, perturb_data: Sequence[jax.Array], hidden_groups: Sequence[HiddenGroup]
    ) -> list[jax.Array]:
        """Per group, the member perturbations (or their cotangents) stacked on a trailing state axis.

        Raises
        ------
        ValueError
            Unless ``perturb_data`` holds one value per perturbed hidden state, each of the shape
            and dtype of its perturbation, and every group member is a perturbed hidden state.
        """
        by_path = self._values_by_path(perturb_data)
        stacked = []
        for group in hidden_groups:
            missing = [p for p in group.hidden_paths if p not in by_path]
            if missing:
                raise ValueError(
                    f"Hidden group {group.index} has member(s) {missing} without a perturbation; the "
                    f"perturbed hidden states are {self.perturb_hidden_paths}. Build the perturbation "
                    f"and the groups from the same compiled graph."
                )
            stacked.append(group.concat_hidden([by_path[p] for p in group.hidden_paths]))
        return stacked

    def _values_by_path(self, perturb_data: Sequence[jax.Array]) -> dict[Path, jax.Array]:
        """``path -> value`` (mantissa) of ``perturb_data``, checked against the perturbation inputs."""
        values = list(perturb_data)
        if len(values) != len(self.perturb_hidden_paths):
            raise ValueError(
                f"Expected one perturbation value per perturbed hidden state ({len(self.perturb_hidden_paths)}, "
                f"for {self.perturb_hidden_paths}), got {len(values)}."
            )
        by_path = {}
        for path, var, value in zip(self.perturb_hidden_paths, self.perturb_vars, values):
            mantissa = u.get_mantissa(value)
            got = (tuple(jnp.shape(mantissa)), jnp.result_type(mantissa))
            expected = (shape_of(var), jnp.dtype(dtype_of(var)))
            if got != expected:
                raise ValueError(
                    f"The perturbation value of hidden state {path} has shape {got[0]} and dtype "
                    f"{got[1]}; expected shape {expected[0]} and dtype {expected[1]}, those of the state."
                )
            by_path[path] = mantissa
        return by_path

    def dict(self) -> dict[str, object]:
        return self._asdict()


HiddenPerturbation.__module__ = "braintrace"


def _add_eqn(a: Atom, b: Atom, out: Var, like: JaxprEqn | None) -> JaxprEqn:
    return new_jaxpr_eqn([a, b], [out], jax.lax.add_p, {}, set(),
                         None if like is None else like.source_info, None if like is None else like.ctx)


class JaxprEvalForHiddenPerturbation(JaxprEvaluation):
    """Rewrites a step jaxpr into its perturbed form (see the module docstring)."""

    def __init__(
        self,
        closed_jaxpr: ClosedJaxpr,
        hidden_outvar_to_invar: dict[Var, Var],
        weight_invars: Sequence[Var],
        invar_to_hidden_path: dict[Var, Path],
        outvar_to_hidden_path: dict[Var, Path],
        path_to_state: dict[Path, brainstate.State],
        control_flow: ControlFlowPolicy = DEFAULT_CONTROL_FLOW_POLICY,
        descended_scan_eqn_ids: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(weight_invars, hidden_outvar_to_invar.values(), hidden_outvar_to_invar,
                         invar_to_hidden_path, outvar_to_hidden_path, control_flow=control_flow)
        self.closed_jaxpr = closed_jaxpr
        self.path_to_state = path_to_state
        self.descended_scan_eqn_ids = descended_scan_eqn_ids
        self.perturb: dict[Var, Var] = {
            h: Var(ShapedArray(shape_of(h), dtype_of(h))) for h in hidden_outvar_to_invar
        }
        self.pending = dict.fromkeys(hidden_outvar_to_invar)
        self.eqns: list[JaxprEqn] = []
        # The whiles between a weight or hidden state and a hidden update: reverse mode, which
        # cannot enter a while, would otherwise reach them from the perturbation.
        jaxpr = closed_jaxpr.jaxpr
        feeds_hidden = _vars_feeding(jaxpr, set(hidden_outvar_to_invar))
        from_state = _vars_reached(jaxpr, {*weight_invars, *hidden_outvar_to_invar.values()})
        self.detached_whiles = {
            id(eqn) for eqn in jaxpr.eqns if eqn.primitive.name == "while"
            and any(v in feeds_hidden for v in eqn.outvars)
            and any(not isinstance(v, Literal) and v in from_state for v in eqn.invars)
        }

    def compile(self) -> HiddenPerturbation:
        jaxpr = self.closed_jaxpr.jaxpr
        self._eval_jaxpr(jaxpr)
        outvars = list(jaxpr.outvars)
        every = jaxpr_all_invars(jaxpr)
        constvars = closed_jaxpr_constvars(self.closed_jaxpr)
        for h in list(self.pending):
            if h in every:  # read-only: h^t = h^{t-1}
                shifted = fresh_var(h)
                self.eqns.append(_add_eqn(h, self.perturb[h], shifted, None))
                outvars = [shifted if v is h else v for v in outvars]
                del self.pending[h]
        if self.pending:
            missing = [self.outvar_to_hidden_path.get(h) for h in self.pending]
            raise ValueError(
                f"Error: we did not found your defined hidden state {missing} in the step jaxpr. "
                f"Please report an issue with the model that triggers it."
            )
        perturb_vars = list(self.perturb.values())
        new = new_jaxpr(constvars, [*every[len(constvars):], *perturb_vars], outvars, self.eqns,
                        jaxpr.effects, name="perturbed_step")
        paths = [self.outvar_to_hidden_path[h] for h in self.perturb]
        return HiddenPerturbation(
            perturb_vars=perturb_vars,
            perturb_hidden_paths=paths,
            perturb_hidden_states=[self.path_to_state[p] for p in paths],
            perturb_jaxpr=ClosedJaxpr(new, self.closed_jaxpr.consts),
        )

    def _eval_jaxpr(self, jaxpr: Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in CONTROL_FLOW_PRIMITIVES:
                check_unsupported_op(self, eqn, name)
            self._eval_eqn(eqn)

    def _eval_eqn(self, eqn: JaxprEqn) -> None:
        if id(eqn) in self.detached_whiles:
            eqn = self._detach_inputs(eqn)
        hits = [v for v in eqn.outvars if isinstance(v, Var) and v in self.pending]
        if not hits:
            self.eqns.append(eqn)
            return
        renamed = {h: fresh_var(h) for h in hits}
        self.eqns.append(eqn.replace(outvars=[renamed.get(v, v) for v in eqn.outvars]))
        for h, fresh in renamed.items():
            self.eqns.append(_add_eqn(fresh, self.perturb[h], h, eqn))
            del self.pending[h]

    def _detach_inputs(self, eqn: JaxprEqn) -> JaxprEqn:
        """Feed a while that a hidden update reads through ``stop_gradient``: reverse mode cannot
        enter it (the learners take what crosses it in forward mode, see ``detached_df_key``)."""
        invars: list[Atom] = []
        n_detached = 0
        for a in eqn.invars:
            if is_var(a):
                detached = fresh_var(a)
                self.eqns.append(new_jaxpr_eqn([a], [detached], _STOP_GRADIENT, {}, set(), eqn.source_info, eqn.ctx))
                invars.append(detached)
                n_detached += 1
            else:
                invars.append(a)
        emit(DiagnosticKind.CONTROL_FLOW_OPAQUE_FWD, DiagnosticLevel.WARNING,
             "A while_loop computes a hidden state: its inputs are detached in the perturbed step, "
             "so parameters whose only same-step path to the loss crosses the loop get no "
             "same-step learning signal.",
             context={"site": "perturbation", "n_detached": n_detached})
        return eqn.replace(invars=invars)


def _vars_feeding(jaxpr: Jaxpr, targets: set[Var]) -> set[Var]:
    """``targets`` and every variable of ``jaxpr`` some target is computed from."""
    feeding = set(targets)
    for eqn in reversed(jaxpr.eqns):
        if any(isinstance(v, Var) and v in feeding for v in eqn.outvars):
            feeding.update(v for v in eqn.invars if isinstance(v, Var) and not isinstance(v, Literal))
    return feeding


def _vars_reached(jaxpr: Jaxpr, sources: set[Var]) -> set[Var]:
    """``sources`` and every variable of ``jaxpr`` computed from one of them."""
    reached = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and not isinstance(v, Literal) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return reached


def _update_paths(perturbation: HiddenPerturbation) -> dict[int, Path]:
    """``id(eqn) -> hidden path`` of every perturbation equation (``ĥ + p -> h^t``)."""
    return {
        id(eqn): path
        for eqn in perturbation.perturb_jaxpr.jaxpr.eqns
        for v, path in zip(perturbation.perturb_vars, perturbation.perturb_hidden_paths)
        if v in eqn.invars
    }


def _step_outputs(perturbation: HiddenPerturbation, minfo: ModuleInfo) -> set[Var]:
    """The step's model outputs and new state values, but for parameters, which the step passes
    through (nor the intermediates the compiler hoisted for the learners)."""
    outvars = perturbation.perturb_jaxpr.jaxpr.outvars
    states = [v for v, st in zip(outvars[minfo.num_var_out:], minfo.compiled_model_states)
              if not isinstance(st, brainstate.ParamState)]
    return {v for v in [*outvars[: minfo.num_var_out], *states] if is_var(v)}


def groups_read_past_update(
    perturbation: HiddenPerturbation, hidden_groups: Sequence[HiddenGroup], minfo: ModuleInfo
) -> frozenset[int]:
    """The groups whose previous value reaches an output of the step other than through their new value.

    ``∂L/∂h^{t-1}`` of a group is ``Dᵀ ∂L/∂h^t`` only when every output (model output, other
    states, other groups' new values) reads ``h^{t-1}`` through ``h^t``. A step that returns a
    value computed before the update (a spike of the pre-reset potential, a component stacked into
    a ``HiddenGroupState``) or feeds the old value into another group reads it past the update.
    Found by propagating, from each group's input values, a dependency mark that stops at the
    group's own perturbed new values; a control-flow equation passes the mark to all its outputs.
    Only the step's model outputs and new state values count, not the intermediates the compiler
    hoisted for the learners.
    """
    jaxpr = perturbation.perturb_jaxpr.jaxpr
    perturb_vars = set(perturbation.perturb_vars)
    member_of = {p: g.index for g in hidden_groups for p in g.hidden_paths}
    update_group = {eqn: member_of.get(path) for eqn, path in _update_paths(perturbation).items()}
    marks: dict[Var, frozenset[int]] = {
        v: frozenset({member_of[path]}) for v, path in minfo.invar_to_hidden_path.items() if path in member_of
    }
    for eqn in jaxpr.eqns:
        found = frozenset().union(*(marks.get(v, frozenset()) for v in eqn.invars if is_var(v)
                                    and v not in perturb_vars))
        cut = update_group.get(id(eqn))
        if cut is not None:
            found = found - {cut}
        if found:
            for v in eqn.outvars:
                marks[v] = found
    reached: set[int] = set()
    for v in _step_outputs(perturbation, minfo):
        reached |= marks.get(v, frozenset())
    return frozenset(reached)


class LocalRelationWeights(NamedTuple):
    """Weights whose one-step gradient is the same-step term of their eligibility trace.

    Attributes
    ----------
    paths : frozenset
        ``ParamState`` paths every leaf of which is used only as a trainable operand of local
        relations (see :func:`local_relation_weights`).
    keys : dict
        ``relation index -> trainable keys`` of each local relation whose path is in ``paths``.
    """

    paths: frozenset[Path]
    keys: dict[int, frozenset[str]]



def report_reads_past_update(
    perturbation: HiddenPerturbation, hidden_groups: Sequence[HiddenGroup], minfo: ModuleInfo
) -> None:
    """Record, per group an output reads past its update (:func:`groups_read_past_update`), how a
    single-step learner takes that group's history instead."""
    for index in sorted(groups_read_past_update(perturbation, hidden_groups, minfo)):
        group = hidden_groups[index]
        emit(
            DiagnosticKind.OUTPUT_READS_PAST_UPDATE, DiagnosticLevel.INFO,
            f"An output of the step reads hidden group {index} ({list(group.hidden_paths)}) other than through "
            f"its new value (a value computed before the update, such as a spike of the pre-reset potential, "
            f"or the old value fed to another group). Single-step learners meet that group's entering trace "
            f"with dL/dh^(t-1) through every path of the step, taken by the step's VJP, instead of "
            f"D^T dL/dh^t; the outputs' direct paths are in the one-step gradient.",
            hidden_paths=tuple(group.hidden_paths), context={"group": index},
        )

def local_relation_weights(
    perturbation: HiddenPerturbation,
    relations: Sequence[HiddenParamOpRelation],
    hidden_groups: Sequence[HiddenGroup],
    minfo: ModuleInfo,
    excluded_groups: frozenset[int] = frozenset(),
    candidates: frozenset[int] | None = None,
) -> LocalRelationWeights:
    """The weights for which the exact one-step gradient equals ``⟨∂L/∂h^t, x ⊗ df⟩``.

    A relation ``y = op(x, W)`` is *local* when its output reaches the step's outputs only
    through the new values of the hidden states it drives, along element-wise equations of
    ``y``'s shape. The cotangent of ``y`` is then ``Σ_a df_a ⊙ ∂L/∂h^t_a`` exactly, so the part of
    the one-step gradient that flows through ``y`` is the same-step term of the trace. A learner
    whose history already holds that term may leave such a weight out of the one-step VJP, which
    saves one product of the size of the weight per step. Relations inside descended scans,
    with a ``while_loop`` in their tail, driving a group in ``excluded_groups`` or a group whose
    members read each other's new values are never local, nor, when ``candidates`` (relation
    indices) is given, relations outside it; a weight qualifies only when every use of every leaf
    is a trainable operand of a local relation.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> class Leaky(brainstate.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = brainstate.ParamState(jnp.ones((2, 2)))
    ...         self.h = brainstate.HiddenState(jnp.zeros(2))
    ...     def update(self, x):
    ...         self.h.value = 0.5 * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value))
    ...         return self.h.value
    >>> graph = braintrace.compile_etrace_graph(Leaky(), jnp.ones(2))
    >>> local_relation_weights(graph.hidden_perturb, graph.hidden_param_op_relations, graph.hidden_groups,
    ...                        graph.module_info)
    LocalRelationWeights(paths=frozenset({('w',)}), keys={0: frozenset({'weight'})})
    """
    jaxpr = perturbation.perturb_jaxpr.jaxpr
    path_of_update = _update_paths(perturbation)
    outputs = _step_outputs(perturbation, minfo)
    local: dict[int, HiddenParamOpRelation] = {}
    for i, rel in enumerate(relations):
        groups = {g.index for g in rel.hidden_groups}
        if (
            (candidates is not None and i not in candidates)
            or rel.control_flow_context is not None
            or groups & excluded_groups
            or any(g.reads_new_members() for g in rel.hidden_groups)
            or any(contains_eqn(t, lambda e: e.primitive.name == "while") for t in rel.y_to_hidden_group_jaxprs)
        ):
            continue
        reached = _updates_reached_elementwise(jaxpr, rel.y_var, path_of_update, outputs)
        if reached is not None and reached == set(rel.connected_hidden_paths):
            local[i] = rel
    eqn_relation = {id(eqn): i for eqn in jaxpr.eqns for i, rel in local.items() if rel.y_var in eqn.outvars}
    consumers = build_consumer_map(jaxpr)

    def trainable_use(v: Var, eqn: JaxprEqn) -> bool:
        i = eqn_relation.get(id(eqn))
        return i is not None and v in local[i].trainable_vars.values() and v is not local[i].x_var

    paths = frozenset(
        path for path, invars in minfo.weight_path_to_invars.items()
        if any(v in consumers for v in invars)
        and all(v not in outputs and all(trainable_use(v, e) for e in consumers.get(v, [])) for v in invars)
    )
    keys = {i: frozenset(k for k, p in rel.trainable_paths.items() if p in paths) for i, rel in local.items()}
    return LocalRelationWeights(paths, {i: k for i, k in keys.items() if k})


def _updates_reached_elementwise(
    jaxpr: Jaxpr, y: Var, path_of_update: dict[int, Path], outputs: set[Var]
) -> set[Path] | None:
    """The hidden paths whose perturbation ``y`` reaches along element-wise equations of its
    shape, or ``None`` when ``y`` reaches an output any other way."""
    shape = shape_of(y)
    marked = {y}
    reached: set[Path] = set()
    for eqn in jaxpr.eqns:
        if not any(is_var(v) and v in marked for v in eqn.invars):
            continue
        if id(eqn) in path_of_update:
            reached.add(path_of_update[id(eqn)])
            continue
        if eqn.primitive.name not in ELEMENTWISE_PRIMITIVES or any(shape_of(o) != shape for o in eqn.outvars):
            return None
        marked.update(eqn.outvars)
    return None if marked & outputs else reached


def add_hidden_perturbation_from_minfo(
    minfo: ModuleInfo, descended_scan_eqn_ids: frozenset[int] = frozenset()
) -> HiddenPerturbation:
    """The perturbed form of a traced step.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> minfo = braintrace.extract_module_info(cell, jnp.ones(3))
    >>> braintrace.add_hidden_perturbation_from_minfo(minfo).perturb_hidden_paths
    [('h',)]
    """
    return JaxprEvalForHiddenPerturbation(
        minfo.closed_jaxpr, minfo.hidden_outvar_to_invar, minfo.weight_invars,
        minfo.invar_to_hidden_path, minfo.outvar_to_hidden_path, minfo.retrieved_model_states,
        control_flow=minfo.control_flow, descended_scan_eqn_ids=descended_scan_eqn_ids,
    ).compile()


def add_hidden_perturbation_in_module(
    model: brainstate.nn.Module, *model_args: PyTree, **model_kwargs: PyTree
) -> HiddenPerturbation:
    """Trace one step of ``model`` and return its perturbed form.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> perturbation = braintrace.add_hidden_perturbation_in_module(cell, jnp.ones(3))
    >>> perturbation.perturb_hidden_paths
    [('h',)]
    """
    return add_hidden_perturbation_from_minfo(extract_module_info(model, *model_args, **model_kwargs))
