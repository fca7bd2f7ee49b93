"""Discovering hidden groups in a step jaxpr.

One tracer per hidden input ``h^{t-1}`` follows the values derived from it, equation by
equation. In the default mode the walk stops at weight-mixing operations (non-gradient-enabled
ETP primitives, ``dot_general`` and ``conv_general_dilated`` on hidden-derived values, and
control flow whose body mixes them): what remains is the per-position, element-wise part of
the recurrence, whose Jacobian the D-RTRL family can keep exactly. Hidden outputs a tracer
reaches form a group with it; intersecting groups merge. A hidden state no tracer connects
gets a zero-recurrence group (``D = 0``).

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Cell(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((2, 2)))
...         self.v = brainstate.HiddenState(jnp.zeros(2))
...         self.a = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.a.value = 0.9 * self.a.value + self.v.value
...         self.v.value = 0.5 * self.v.value - self.a.value + braintrace.matmul(x, self.w.value)
...         return self.v.value
>>> groups, _ = braintrace.find_hidden_groups_from_module(Cell(), jnp.ones(2))
>>> [g.hidden_paths for g in groups]  # compiled-state order: a is read first
[[('a',), ('v',)]]
"""

from __future__ import annotations

from typing import Container, Iterable

import brainstate

from braintrace._compatible_imports import (
    CONTROL_FLOW_PRIMITIVES,
    Atom,
    Jaxpr,
    JaxprEqn,
    Var,
    cond_branches,
    is_var,
    scan_params,
    subjaxprs,
    while_params,
)
from braintrace._compiler.base import JaxprEvaluation
from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.jaxpr_graph import new_jaxpr
from braintrace._compiler.module_info import ModuleInfo, Path, extract_module_info
from braintrace._op._registries import is_etp_enable_gradient_primitive, is_etp_primitive
from braintrace._typing import PyTree

__all__ = ["find_hidden_groups_from_minfo", "find_hidden_groups_from_module", "JaxprEvalForHiddenGroup"]

_MIXING = ("dot_general", "conv_general_dilated")


def _vars(atoms: Iterable[Atom]) -> list[Var]:
    return [a for a in atoms if is_var(a)]


class _Tracer:
    """The equations reached from one hidden input and the hidden outputs they produce."""

    def __init__(self, hidden_invar: Var) -> None:
        self.hidden_invar = hidden_invar
        self.eqns: dict[int, JaxprEqn] = {}
        self.needed: dict[Var, None] = {}
        self.connected: dict[Var, None] = {}

    def add(self, eqn: JaxprEqn, hidden_outvars: Container[Var], include_hidden_outvars: bool) -> None:
        self.eqns.setdefault(id(eqn), eqn)
        for v in _vars(eqn.outvars):
            if v in hidden_outvars:
                self.connected.setdefault(v)
                if not include_hidden_outvars:
                    continue
            self.needed.setdefault(v)


class JaxprEvalForHiddenGroup(JaxprEvaluation):
    """Runs the tracers over a step jaxpr (see the module docstring)."""

    def __init__(self, minfo: ModuleInfo, include_recurrent_mixing: bool, descended_scan_eqn_ids: frozenset[int]) -> None:
        super().__init__(
            minfo.weight_invars, minfo.hidden_path_to_invar.values(), minfo.hidden_path_to_outvar.values(),
            minfo.invar_to_hidden_path, minfo.outvar_to_hidden_path, control_flow=minfo.control_flow,
        )
        self.include_recurrent_mixing = include_recurrent_mixing
        self.descended_scan_eqn_ids = descended_scan_eqn_ids
        self.tracers: dict[Var, _Tracer] = {}

    def compile(self, jaxpr: Jaxpr) -> dict[Var, _Tracer]:
        self._eval_jaxpr(jaxpr)
        return self.tracers

    def _eval_jaxpr(self, jaxpr: Jaxpr) -> None:
        remaining = [e for e in jaxpr.eqns if id(e) not in self.descended_scan_eqn_ids]
        super()._eval_jaxpr(jaxpr.replace(eqns=remaining) if len(remaining) != len(jaxpr.eqns) else jaxpr)

    def _hidden_derived(self, v: Var) -> bool:
        return v in self.hidden_invars or any(v in t.needed for t in self.tracers.values())

    def _is_boundary(self, eqn: JaxprEqn) -> bool:
        if self.include_recurrent_mixing:
            return False
        if is_etp_primitive(eqn.primitive) and not is_etp_enable_gradient_primitive(eqn.primitive):
            return True
        taint = [is_var(a) and self._hidden_derived(a) for a in eqn.invars]
        if eqn.primitive.name in _MIXING:
            return any(taint)
        if any(taint) and any(True for _ in subjaxprs(eqn)) and _eqn_mixes(eqn, taint)[0]:
            if eqn.primitive.name in CONTROL_FLOW_PRIMITIVES:
                emit(
                    DiagnosticKind.CONTROL_FLOW_RECURRENT_MIXING, DiagnosticLevel.WARNING,
                    f"A `{eqn.primitive.name}` body mixes hidden-state values through "
                    f"dot_general/conv_general_dilated; a per-position Jacobian cannot express it, "
                    f"so it is treated as a boundary (zero recurrence through it). Use "
                    f"include_recurrent_mixing=True (OSTLRecurrent) to keep it.",
                    context={"op_name": eqn.primitive.name},
                )
            return True
        return False

    def _eval_eqn(self, eqn: JaxprEqn) -> None:
        if eqn.primitive.name == "stop_gradient" or self._is_boundary(eqn):
            return
        # Distinct hidden inputs: ``h * h`` reads one state twice and is an ordinary eqn.
        own = list(dict.fromkeys(v for v in _vars(eqn.invars) if v in self.hidden_invars))
        for h in own:
            self.tracers.setdefault(h, _Tracer(h)).add(eqn, self.hidden_outvars, include_hidden_outvars=False)
        invars = _vars(eqn.invars)
        for h, tracer in list(self.tracers.items()):
            if h not in own and any(v in tracer.needed for v in invars):
                tracer.add(eqn, self.hidden_outvars, include_hidden_outvars=True)


def _jaxpr_mixes(jaxpr: Jaxpr, taint_in: list[bool]) -> tuple[bool, list[bool]]:
    """Whether ``jaxpr`` applies a mixing op to a value derived from a tainted input."""
    tainted = {v for v, t in zip(jaxpr.invars, taint_in) if t}
    for eqn in jaxpr.eqns:
        in_t = [is_var(a) and a in tainted for a in eqn.invars]
        if not any(in_t):
            continue
        if eqn.primitive.name in _MIXING:
            return True, []
        if any(True for _ in subjaxprs(eqn)):
            mixes, out_t = _eqn_mixes(eqn, in_t)
            if mixes:
                return True, []
            tainted.update(v for v, t in zip(eqn.outvars, out_t) if t)
        else:
            tainted.update(_vars(eqn.outvars))
    return False, [isinstance(v, Var) and v in tainted for v in jaxpr.outvars]


def _eqn_mixes(eqn: JaxprEqn, taint: list[bool]) -> tuple[bool, list[bool]]:
    """Mixing check for an equation with bodies; maps operands into the bodies by position."""
    name = eqn.primitive.name
    if name == "scan":
        scan = scan_params(eqn)
        nc, nk = scan.num_consts, scan.num_carry
        return _fixpoint(scan.body.jaxpr, taint, carry_in=slice(nc, nc + nk), carry_out=slice(0, nk))
    if name == "while":
        loop = while_params(eqn)
        cn, bn = loop.cond_nconsts, loop.body_nconsts
        carry = taint[cn + bn:]
        mixes, _ = _jaxpr_mixes(loop.cond.jaxpr, taint[:cn] + carry)
        if mixes:
            return True, []
        body_taint = taint[cn:cn + bn] + carry
        return _fixpoint(loop.body.jaxpr, body_taint, carry_in=slice(bn, None), carry_out=slice(None))
    if name == "cond":
        outs: list[bool] = [False] * len(eqn.outvars)
        for branch in cond_branches(eqn):
            mixes, out_t = _jaxpr_mixes(branch.jaxpr, taint[1:])
            if mixes:
                return True, []
            outs = [a or b for a, b in zip(outs, out_t)]
        return False, outs
    bodies = list(subjaxprs(eqn))
    outs = [False] * len(eqn.outvars)
    for body in bodies:
        if len(body.invars) != len(taint):
            return True, []
        mixes, out_t = _jaxpr_mixes(body, taint)
        if mixes:
            return True, []
        outs = [a or b for a, b in zip(outs, out_t)]
    return False, outs


def _fixpoint(body: Jaxpr, taint: list[bool], carry_in: slice, carry_out: slice) -> tuple[bool, list[bool]]:
    taint = list(taint)
    while True:
        mixes, out_t = _jaxpr_mixes(body, taint)
        if mixes:
            return True, []
        idx = list(range(len(taint)))[carry_in]
        fed = out_t[carry_out]
        new = list(taint)
        for i, t in zip(idx, fed):
            new[i] = new[i] or t
        if new == taint:
            return False, out_t
        taint = new


# --- post-processing ----------------------------------------------------------------------


def _same_recurrence_layer(a: Path, b: Path) -> bool:
    """Paths differing first at an integer index (``layers[0]`` vs ``layers[1]``) are different layers."""
    for x, y in zip(a, b):
        if x != y:
            return not (isinstance(x, int) or isinstance(y, int))
    return True


def _tracer_transition(tracer: _Tracer, minfo: ModuleInfo) -> list[Var]:
    """The hidden outputs ``tracer`` legitimately connects to (same shape, same layer)."""
    own_path = minfo.invar_to_hidden_path[tracer.hidden_invar]
    own_state = minfo.retrieved_model_states[own_path]
    kept = []
    for out in tracer.connected:
        path = minfo.outvar_to_hidden_path[out]
        state = minfo.retrieved_model_states[path]
        if tuple(state.varshape) == tuple(own_state.varshape) and _same_recurrence_layer(own_path, path):
            kept.append(out)
    return kept


def _needed_eqns(eqns: Iterable[JaxprEqn], outputs: Iterable[Var]) -> list[JaxprEqn]:
    """The equations ``outputs`` depend on, in their given order.

    Swept to a fixpoint: merged member traces are not topologically ordered, so one reverse
    sweep could meet a producer before the equation that needs it.
    """
    eqns = list(eqns)
    needed = set(_vars(outputs))
    kept: set[int] = set()
    changed = True
    while changed:
        changed = False
        for i in range(len(eqns) - 1, -1, -1):
            if i not in kept and any(v in needed for v in _vars(eqns[i].outvars)):
                kept.add(i)
                needed.update(_vars(eqns[i].invars))
                changed = True
    return [e for i, e in enumerate(eqns) if i in kept]


def _merge(member_lists: list[list[Var]]) -> list[list[Var]]:
    merged: list[list[Var]] = []
    for members in member_lists:
        current = dict.fromkeys(members)
        rest = []
        for group in merged:
            if any(v in current for v in group):
                current = dict.fromkeys([*group, *current])
            else:
                rest.append(group)
        merged = [*rest, list(current)]
    return merged


def _topological(eqns: list[JaxprEqn], available: set[Var]) -> list[JaxprEqn]:
    produced = {v for e in eqns for v in _vars(e.outvars)}
    ready = set(available)
    ordered: list[JaxprEqn] = []
    pending = list(eqns)
    for _ in range(len(eqns) ** 2 + 1):
        if not pending:
            return ordered
        rest = []
        for eqn in pending:
            if all(v in ready or v not in produced for v in _vars(eqn.invars)):
                ordered.append(eqn)
                ready.update(_vars(eqn.outvars))
            else:
                rest.append(eqn)
        pending = rest
    raise RuntimeError("Topological sort failed: the hidden-group transition has a dependency cycle.")


def _group_transition(eqns: list[JaxprEqn], invars: list[Var], outvars: list[Var]) -> tuple[Jaxpr, list[Var]]:
    unique: list[JaxprEqn] = []
    produced: set[Var] = set()
    for eqn in eqns:
        outs = _vars(eqn.outvars)
        if outs and all(v in produced for v in outs):
            continue
        unique.append(eqn)
        produced.update(outs)
    unique = _needed_eqns(unique, outvars)
    produced = {v for e in unique for v in _vars(e.outvars)}
    referenced = [*(_vars(a for e in unique for a in e.invars)), *_vars(outvars)]
    constvars = list(dict.fromkeys(v for v in referenced if v not in produced and v not in invars))
    ordered = _topological(unique, set(invars) | set(constvars))
    return new_jaxpr(constvars, invars, outvars, ordered, name="transition"), constvars


def _fallback_group(index: int, path: Path, minfo: ModuleInfo) -> HiddenGroup:
    h_in, h_out = minfo.hidden_path_to_invar[path], minfo.hidden_path_to_outvar[path]
    passthrough = h_out is h_in or not is_var(h_out)
    constvars = [] if passthrough else [h_out]
    jaxpr = new_jaxpr(constvars, [h_in], [h_out], [], name="transition")
    return HiddenGroup(
        index=index, hidden_paths=[path], hidden_states=[minfo.retrieved_model_states[path]],
        hidden_invars=[h_in], hidden_outvars=[h_out], transition_jaxpr=jaxpr,
        transition_jaxpr_constvars=constvars,
    )


def find_hidden_groups_from_minfo(
    minfo: ModuleInfo,
    include_recurrent_mixing: bool = False,
    descended_scan_eqn_ids: frozenset[int] = frozenset(),
    descended_hidden_paths: frozenset[Path] = frozenset(),
) -> tuple[list[HiddenGroup], dict[Path, HiddenGroup]]:
    """Hidden groups of a traced step, in compiled-state order of their first member.

    Parameters
    ----------
    minfo : ModuleInfo
    include_recurrent_mixing : bool
        Trace weight-mixing operations into the transitions too (block-diagonal Jacobians).
    descended_scan_eqn_ids, descended_hidden_paths : frozenset
        Scans handled by structured descent, and the hidden states they carry (skipped here).

    Returns
    -------
    (groups, hid_path_to_group)

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> minfo = braintrace.extract_module_info(cell, jnp.ones(3))
    >>> groups, hid_path_to_group = braintrace.find_hidden_groups_from_minfo(minfo)
    >>> [group.hidden_paths for group in groups]
    [[('h',)]]
    """
    tracers = JaxprEvalForHiddenGroup(minfo, include_recurrent_mixing, descended_scan_eqn_ids).compile(minfo.jaxpr)
    order = {v: i for i, v in enumerate(minfo.hidden_outvar_to_invar)}
    own_out = {h_in: h_out for h_out, h_in in minfo.hidden_outvar_to_invar.items()}
    member_lists, eqns_of = [], {}
    for h_in, tracer in tracers.items():
        kept = _tracer_transition(tracer, minfo)
        if not kept or h_in not in own_out:
            continue
        members = list(dict.fromkeys([own_out[h_in], *kept]))
        member_lists.append(members)
        eqns_of[h_in] = _needed_eqns(tracer.eqns.values(), kept)
    merged = sorted((sorted(g, key=order.__getitem__) for g in _merge(member_lists)), key=lambda g: order[g[0]])
    groups: list[HiddenGroup] = []
    for outs in merged:
        ins = [minfo.hidden_outvar_to_invar[o] for o in outs]
        paths = [minfo.outvar_to_hidden_path[o] for o in outs]
        eqns = [e for h in ins if h in eqns_of for e in eqns_of[h]]
        jaxpr, constvars = _group_transition(eqns, ins, outs)
        group = HiddenGroup(
            index=len(groups), hidden_paths=paths,
            hidden_states=[minfo.retrieved_model_states[p] for p in paths],
            hidden_invars=ins, hidden_outvars=outs, transition_jaxpr=jaxpr,
            transition_jaxpr_constvars=constvars, is_diagonal_recurrence=not include_recurrent_mixing,
        )
        group.check_consistent_varshape()
        if len(paths) > 1:
            emit(DiagnosticKind.HIDDEN_GROUP_MERGED, DiagnosticLevel.INFO,
                 f"Hidden states {paths} are coupled recurrently and form one group.",
                 hidden_paths=tuple(paths))
        groups.append(group)
    covered = {p for g in groups for p in g.hidden_paths}
    for path in minfo.hidden_path_to_outvar:
        if path not in covered and path not in descended_hidden_paths:
            groups.append(_fallback_group(len(groups), path, minfo))
    hid_path_to_group: dict[Path, HiddenGroup] = {}
    for group in groups:
        for path in group.hidden_paths:
            if path in hid_path_to_group:
                raise ValueError(f"Hidden state {path} was assigned to two hidden groups.")
            hid_path_to_group[path] = group
    return groups, hid_path_to_group


def find_hidden_groups_from_module(
    model: brainstate.nn.Module, *model_args: PyTree, include_recurrent_mixing: bool = False, **model_kwargs: PyTree
) -> tuple[list[HiddenGroup], dict[Path, HiddenGroup]]:
    """Trace one step of ``model`` and return its hidden groups (see :func:`find_hidden_groups_from_minfo`).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> groups, hid_path_to_group = braintrace.find_hidden_groups_from_module(cell, jnp.ones(3))
    >>> groups[0].hidden_paths, hid_path_to_group[('h',)] is groups[0]
    ([('h',)], True)
    """
    minfo = extract_module_info(model, *model_args, **model_kwargs)
    return find_hidden_groups_from_minfo(minfo, include_recurrent_mixing=include_recurrent_mixing)
