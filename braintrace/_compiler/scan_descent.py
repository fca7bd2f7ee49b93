"""Structured scan descent: a long ETP scan kept as one equation and learned through its substeps.

A ``lax.scan`` / ``brainstate.transform.for_loop`` inside the model step that is too long to
unroll (``length > ControlFlowPolicy.scan_unroll_limit``) but applies ETP operations to a
hidden state it carries is *descended*: the compiler runs the ordinary hidden-group and
relation finders on the scan body, then rewrites the scan to also return, stacked along a
leading substep axis ``L``, every body value the learners need (relation inputs, ``y -> h``
tail inputs, transition inputs). The compiled step keeps one scan equation, so its size does
not grow with ``L``; the executor computes per-substep ``df`` and ``D`` by vmapping over the
stacked axis, and the D-RTRL family folds its trace over the substeps
(``ε ← D_τ ε + x_τ ⊗ df_τ``).

Restrictions (each keeps the scan as it is and records ``SCAN_DESCENT_SKIPPED``): reverse
scans, control flow directly inside the body, a trainable weight scanned over as ``xs``, and a
carried hidden state whose initial value is not the state's value at step entry. An ETP
operation *outside* the scan that drives a hidden state the scan carries is rejected when the
graph is compiled (move it inside the body). Only the D-RTRL family
(``ParamDimVjpAlgorithm``) learns through descended scans. The single-step learning signal is
read off the perturbation of the scan's carried outputs; a loss that reads the hidden state
through the scan's stacked ``ys`` (``for_loop(...)[-1]``) reads it past that perturbation, which
:func:`groups_read_past_update` detects so that the learner takes the full ``∂L/∂h^{t-1}``.

Exactness: when the substep recurrence is element-wise (leaky integrators, LIF neurons), the
descended D-RTRL gradient equals backpropagation through time, single-step and multi-step.

Examples
--------
A leaky neuron integrated with 20 substeps per step (more than the default unroll limit of
16) learns online with D-RTRL; its one-step gradients summed over a sequence equal BPTT:

>>> import brainstate, jax, jax.numpy as jnp, braintrace
>>> class SubStepped(brainstate.nn.Module):
...     def __init__(self, n_in=3, n_hid=4, substeps=20):
...         super().__init__()
...         self.substeps = substeps
...         self.w = brainstate.ParamState(0.3 * jax.random.normal(jax.random.PRNGKey(0), (n_in, n_hid)))
...         self.h = brainstate.HiddenState(jnp.zeros(n_hid))
...     def update(self, x):
...         def substep(i):
...             self.h.value = 0.9 * self.h.value + 0.1 * braintrace.matmul(x, self.w.value)
...         brainstate.transform.for_loop(substep, jnp.arange(self.substeps))
...         return self.h.value
>>> model = SubStepped()
>>> learner = braintrace.compile(model, braintrace.D_RTRL, jnp.ones(3))
>>> [r.kind.value for r in learner.graph.explain(kind=braintrace.DiagnosticKind.SCAN_DESCENT_APPLIED)]
['scan_descent_applied']
>>> xs = jax.random.normal(jax.random.PRNGKey(1), (3, 3))
>>> online = jnp.zeros((3, 4))
>>> for t in range(3):
...     online += brainstate.transform.grad(lambda: learner(xs[t]).sum(), learner.param_states)()[('w',)]
>>> _ = brainstate.nn.init_all_states(model)
>>> def total():
...     return sum(model(xs[t]).sum() for t in range(3))
>>> bptt = brainstate.transform.grad(total, model.states(brainstate.ParamState))()[('w',)]
>>> bool(jnp.allclose(online, bptt, atol=1e-5))
True
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from braintrace._compatible_imports import (
    CONTROL_FLOW_PRIMITIVES,
    Atom,
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    ShapedArray,
    Var,
    closed_jaxpr_constvars,
    is_var,
    jaxpr_all_invars,
    replace_scan_body,
    scan_params,
)
from braintrace._compiler.descended_scan import GroupDescent, RelationDescent, ScanDescentInfo
from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
from braintrace._compiler.hid_param_op import HiddenParamOpRelation, find_hidden_param_op_relations_from_minfo
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.hidden_group_discovery import find_hidden_groups_from_minfo
from braintrace._compiler.jaxpr_graph import contains_eqn, inline_jit_calls, new_jaxpr
from braintrace._compiler.module_info import ModuleInfo, Path
from braintrace._op._registries import is_etp_primitive
from braintrace._op._rule_helpers import dtype_of, shape_of

__all__ = [
    "ScanDescentInfo",
    "GroupDescent",
    "RelationDescent",
    "ScanDescentBundle",
    "add_scan_ys",
    "analyze_and_rewrite_scan",
    "apply_scan_descent",
]


class ScanDescentBundle(NamedTuple):
    """What descending one scan adds to the graph.

    Attributes
    ----------
    info : ScanDescentInfo
    new_eqn : JaxprEqn
        The rewritten scan equation.
    groups : list of HiddenGroup
        The body's groups, re-scoped to the scan's outer carry variables (body-local indices).
    relations : list of HiddenParamOpRelation
        The body's relations, pointing at ``groups``.
    stacked_outer_vars : list of Var
        The extra outputs of ``new_eqn``, to be hoisted as step outputs.
    """

    info: ScanDescentInfo
    new_eqn: JaxprEqn
    groups: list[HiddenGroup]
    relations: list[HiddenParamOpRelation]
    stacked_outer_vars: list[Var]


def _is_etp_relevant(eqn: JaxprEqn, minfo: ModuleInfo) -> bool:
    """A scan consuming a weight directly, or whose body (at any depth) holds an ETP primitive."""
    if eqn.primitive.name != "scan":
        return False
    if any(is_var(a) and a in minfo.invar_to_weight_path for a in eqn.invars):
        return True
    return contains_eqn(scan_params(eqn).body.jaxpr, lambda e: is_etp_primitive(e.primitive))


def _descent_blockers(eqn: JaxprEqn, minfo: ModuleInfo) -> str | None:
    """Why ``eqn`` cannot be descended (the first reason), or ``None``."""
    policy = minfo.control_flow
    p = scan_params(eqn)
    if policy.scan_descent != "auto":
        return "scan descent is disabled (ControlFlowPolicy.scan_descent='off')"
    if p.length <= policy.scan_unroll_limit:
        return "the unroll path handles it"
    if p.reverse:
        return "the scan runs in reverse"
    body = p.body.jaxpr
    nested = [e.primitive.name for e in body.eqns if e.primitive.name in CONTROL_FLOW_PRIMITIVES]
    if nested:
        return f"its body contains control flow ({nested[0]})"
    xs = eqn.invars[p.num_consts + p.num_carry:]
    if any(is_var(a) and a in minfo.invar_to_weight_path for a in xs):
        return "a trainable weight is scanned over as xs"
    return None


def add_scan_ys(eqn: JaxprEqn, extra_body_outvars: Sequence[Atom]) -> tuple[JaxprEqn, list[Var]]:
    """The scan ``eqn`` rewritten to also stack ``extra_body_outvars`` over its substeps.

    Each distinct body variable (body inputs included) becomes one more ``ys`` output with a
    fresh outer variable of aval ``(length, *shape)``. The original outputs keep their
    ``Var`` objects and positions; ``num_consts``, ``num_carry`` and ``length`` are unchanged.

    Returns
    -------
    (new_eqn, stacked)
        The rewritten equation and the outer variables, one per distinct extra body variable.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda c: jax.lax.scan(lambda c, _: (c * 2.0, None), c, None, length=5))(jnp.ones(3))
    >>> eqn = closed.jaxpr.eqns[0]
    >>> body = scan_params(eqn).body.jaxpr
    >>> new, stacked = add_scan_ys(eqn, [body.invars[0], body.invars[0]])
    >>> [v.aval.shape for v in stacked], len(new.outvars)
    ([(5, 3)], 2)
    """
    if eqn.primitive.name != "scan":
        raise ValueError(f"add_scan_ys: expected a scan equation, got {eqn.primitive.name}.")
    closed = scan_params(eqn).body
    body = closed.jaxpr
    length = scan_params(eqn).length
    extra = list(dict.fromkeys(v for v in extra_body_outvars if is_var(v)))
    stacked = [
        Var(ShapedArray((length, *shape_of(v)), dtype_of(v), weak_type=getattr(v.aval, "weak_type", False)))
        for v in extra
    ]
    constvars = closed_jaxpr_constvars(closed)
    new_body = new_jaxpr(constvars, jaxpr_all_invars(body)[len(constvars):], [*body.outvars, *extra], body.eqns,
                         body.effects, name="descended_scan_body")
    return replace_scan_body(eqn, ClosedJaxpr(new_body, closed.consts), [*eqn.outvars, *stacked]), stacked


class _BodyScope(NamedTuple):
    """The carried hidden states and consumed weights of a scan, named by body variables."""

    hidden_in: dict[Path, Var]
    hidden_out: dict[Path, Var]
    weight_aliases: dict[Var, Path]  # body const invar -> the ParamState it carries a leaf of
    weight_leaves: dict[Path, list[Var]]  # per state, its leaves in pytree order, body aliases swapped in


def _carried_hidden(eqn: JaxprEqn, minfo: ModuleInfo) -> dict[int, Path]:
    """Carry position -> hidden path, for the carries whose outer output is a hidden state."""
    nk = scan_params(eqn).num_carry
    return {
        c: minfo.outvar_to_hidden_path[v]
        for c, v in enumerate(eqn.outvars[:nk])
        if is_var(v) and v in minfo.outvar_to_hidden_path
    }


def _init_guard(eqn: JaxprEqn, minfo: ModuleInfo, carried: dict[int, Path]) -> Path | None:
    """The first carried hidden state not initialised from its own step-entry value."""
    nc = scan_params(eqn).num_consts
    for c, path in carried.items():
        if eqn.invars[nc + c] is not minfo.hidden_path_to_invar.get(path):
            return path
    return None


def _body_scope(eqn: JaxprEqn, body: Jaxpr, minfo: ModuleInfo, carried: dict[int, Path]) -> _BodyScope | None:
    nc = scan_params(eqn).num_consts
    order = {p: i for i, p in enumerate(minfo.hidden_path_to_outvar)}
    ordered = sorted(carried.items(), key=lambda item: order[item[1]])
    hidden_in = {path: body.invars[nc + c] for c, path in ordered}
    outs = [body.outvars[c] for c, _ in ordered]
    if not all(isinstance(v, Var) and not isinstance(v, Literal) for v in outs) or len(set(outs)) != len(outs):
        return None
    hidden_out = {path: v for (_, path), v in zip(ordered, outs) if isinstance(v, Var)}
    aliases: dict[Var, Path] = {}
    leaves: dict[Path, list[Var]] = {}
    for k in range(nc):  # weights scanned as xs block descent; carried weights do not learn
        outer = eqn.invars[k]
        if is_var(outer) and outer in minfo.invar_to_weight_path:
            path = minfo.invar_to_weight_path[outer]
            aliases[body.invars[k]] = path
            order_ = leaves.setdefault(path, list(minfo.weight_path_to_invars[path]))
            if outer in order_:  # keep the leaf position, so that leaf indices resolve
                order_[order_.index(outer)] = body.invars[k]
    return _BodyScope(hidden_in, hidden_out, aliases, leaves)


def _body_minfo(minfo: ModuleInfo, body: ClosedJaxpr, scope: _BodyScope) -> ModuleInfo:
    """``minfo`` re-scoped to the scan body, so that the flat finders run on it unchanged."""
    return minfo._replace(
        closed_jaxpr=body,
        hidden_path_to_invar=dict(scope.hidden_in),
        hidden_path_to_outvar=dict(scope.hidden_out),
        invar_to_hidden_path={v: p for p, v in scope.hidden_in.items()},
        outvar_to_hidden_path={v: p for p, v in scope.hidden_out.items()},
        hidden_outvar_to_invar={scope.hidden_out[p]: scope.hidden_in[p] for p in scope.hidden_out},
        weight_invars=list(scope.weight_aliases),
        weight_path_to_invars=scope.weight_leaves,
        invar_to_weight_path=dict(scope.weight_aliases),
    )


def _hoist_list(groups: Sequence[HiddenGroup], relations: Sequence[HiddenParamOpRelation]) -> list[Var]:
    """Body variables whose per-substep values the executor reads (ordered, deduplicated)."""
    found: list[Atom] = []
    for rel in relations:
        if rel.x_var is not None:
            found.append(rel.x_var)
        for tail in rel.y_to_hidden_group_jaxprs:
            found.extend(jaxpr_all_invars(tail))
    for group in groups:
        found.extend([*group.hidden_invars, *group.transition_jaxpr_constvars])
    return list(dict.fromkeys(v for v in found if is_var(v)))


def _warn_skipped(message: str, blocker: str, length: int, paths: Sequence[Path] = ()) -> None:
    emit(DiagnosticKind.SCAN_DESCENT_SKIPPED, DiagnosticLevel.WARNING, message, hidden_paths=tuple(paths),
         context={"blocker": blocker, "length": length})


def analyze_and_rewrite_scan(eqn: JaxprEqn, minfo: ModuleInfo) -> ScanDescentBundle | None:
    """Descend one (unblocked) scan: body groups and relations, and the rewritten equation.

    Returns ``None`` (the scan is left as it is) when the scan carries no hidden state, or a
    carried hidden state is not initialised from its step-entry value.
    """
    p = scan_params(eqn)
    length = p.length
    body_closed = inline_jit_calls(p.body)
    if body_closed is not p.body:
        eqn = replace_scan_body(eqn, body_closed, eqn.outvars)
    carried = _carried_hidden(eqn, minfo)
    if not carried:
        return None
    bad = _init_guard(eqn, minfo, carried)
    if bad is not None:
        _warn_skipped(
            f"A scan of length {length} carries hidden state {bad}, but the carry is initialized from a "
            f"transformed value instead of the state itself; structured descent needs the loop to start "
            f"from the state's value (assign the transformed value to the state before the loop).",
            "carry initialized from a transformed value", length, (bad,))
        return None
    scope = _body_scope(eqn, body_closed.jaxpr, minfo, carried)
    if scope is None:
        _warn_skipped(
            f"A scan of length {length} returns its carried hidden states through shared or constant "
            f"body outputs; structured descent cannot tell them apart.",
            "carried hidden states share a body output", length, tuple(carried.values()))
        return None
    body_minfo = _body_minfo(minfo, body_closed, scope)
    groups, hid_path_to_group = find_hidden_groups_from_minfo(body_minfo, include_recurrent_mixing=False)
    relations = find_hidden_param_op_relations_from_minfo(body_minfo, hid_path_to_group)
    _warn_uncovered_weights(scope, relations, length)
    hoisted = _hoist_list(groups, relations)
    new_eqn, stacked = add_scan_ys(eqn, hoisted)
    info = ScanDescentInfo(
        length=length, num_consts=p.num_consts, num_carry=p.num_carry,
        body_jaxpr=scan_params(new_eqn).body.jaxpr, stacked_var_map=dict(zip(hoisted, stacked)),
        scan_eqn_id=id(new_eqn),
    )
    rescoped = {id(g): _rescope_group(g, info, minfo) for g in groups}
    new_relations = [
        rel._replace(hidden_groups=[rescoped[id(g)] for g in rel.hidden_groups],
                     control_flow_context=RelationDescent(scan=info))
        for rel in relations
    ]
    return ScanDescentBundle(info, new_eqn, list(rescoped.values()), new_relations, stacked)


def _warn_uncovered_weights(scope: _BodyScope, relations: Sequence[HiddenParamOpRelation], length: int) -> None:
    covered = {path for rel in relations for path in rel.trainable_paths.values()}
    missing = [path for path in scope.weight_leaves if path not in covered]
    if missing:
        emit(DiagnosticKind.SCAN_DESCENT_NO_RELATIONS, DiagnosticLevel.WARNING,
             f"A descended scan of length {length} uses the weights {missing}, but no ETP operation in "
             f"its body drives a carried hidden state with them; they do not learn online (apply them "
             f"with a braintrace ETP operation that updates the carried state).",
             context={"weight_paths": missing})


def _rescope_group(group: HiddenGroup, info: ScanDescentInfo, minfo: ModuleInfo) -> HiddenGroup:
    """The body group named by the scan's outer variables (the transition stays body-scoped)."""
    return group._replace(
        hidden_invars=[minfo.hidden_path_to_invar[p] for p in group.hidden_paths],
        hidden_outvars=[minfo.hidden_path_to_outvar[p] for p in group.hidden_paths],
        descent=GroupDescent(scan=info, body_hidden_invars=list(group.hidden_invars)),
    )


def apply_scan_descent(minfo: ModuleInfo) -> tuple[ModuleInfo, list[ScanDescentBundle]]:
    """Descend every ETP-relevant, unblocked top-level scan of a traced step.

    Returns
    -------
    (minfo, bundles)
        ``minfo`` with the descended scans replaced by their rewritten equations, and one
        :class:`ScanDescentBundle` per descended scan (``(minfo, [])`` when descent is off).
    """
    policy = minfo.control_flow
    if policy.scan_descent != "auto":
        return minfo, []
    eqns = list(minfo.jaxpr.eqns)
    bundles: list[ScanDescentBundle] = []
    for i, eqn in enumerate(eqns):
        if not _is_etp_relevant(eqn, minfo):
            continue
        length = scan_params(eqn).length
        blocker = _descent_blockers(eqn, minfo)
        if blocker is not None:
            if length > policy.scan_unroll_limit:
                _warn_skipped(
                    f"A scan of length {length} with ETP operations or weights is not descended because "
                    f"{blocker}; its weights cannot learn online there (restructure the loop, or keep it "
                    f"within ControlFlowPolicy.scan_unroll_limit).", blocker, length)
            continue
        bundle = analyze_and_rewrite_scan(eqn, minfo)
        if bundle is None:
            continue
        eqns[i] = bundle.new_eqn
        bundles.append(bundle)
        paths = tuple(p for g in bundle.groups for p in g.hidden_paths)
        weight_paths = sorted({wp for r in bundle.relations for wp in r.trainable_paths.values()}, key=str)
        emit(DiagnosticKind.SCAN_DESCENT_APPLIED, DiagnosticLevel.INFO,
             f"A scan of length {length} carrying hidden states {list(paths)} was descended: its ETP "
             f"operations learn online through {length} stacked substeps.",
             hidden_paths=paths, context={"length": length, "weight_paths": weight_paths})
    if not bundles:
        return minfo, []
    closed = ClosedJaxpr(minfo.jaxpr.replace(eqns=eqns), minfo.closed_jaxpr.consts)
    return minfo._replace(closed_jaxpr=closed), bundles
