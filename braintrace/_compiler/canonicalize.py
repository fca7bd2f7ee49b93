"""Control-flow canonicalisation: cond if-conversion and inner-scan unrolling.

The compiler's passes read one flat jaxpr. A ``lax.cond`` or a short ``lax.scan`` /
``for_loop`` that touches a weight, a hidden state or an ETP primitive is flattened here:

* a cond becomes the inlined bodies of all its branches followed by one ``select_n`` per
  output (``select_n``'s index semantics and JVP match cond's, so values and forward-mode
  derivatives are unchanged; both branches now run every step — see the note below);
* a scan of static length ``<= scan_unroll_limit`` becomes its body cloned once per iteration.

Both run as a joint fixpoint (a cond inside a scan body, a scan inside a branch), re-inlining
``jit`` bodies exposed by either, for at most ``ControlFlowPolicy.fixpoint_iteration_limit``
rewriting sweeps (:class:`braintrace.CompilationError` past it). Warnings about conds and scans
left as they are come from the settling sweep only, once per equation. The jaxpr's invars and
outvars are never changed, so the state tables built on them stay valid.

Reverse-mode note: after if-conversion the dead branch is evaluated too. If its local Jacobian
is NaN/Inf (a cond guarding a ``sqrt`` domain), ``0 * nan`` contaminates reverse-mode gradients
of shared inputs; keep such conds opaque (``ControlFlowPolicy(cond='opaque')``) or guard the
operand inside the branch.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from braintrace._compiler.canonicalize import if_convert_conds
>>> closed = jax.make_jaxpr(lambda p, w: jax.lax.cond(p, lambda w: 2 * w, lambda w: w + 1, w))(True, 1.0)
>>> w = closed.jaxpr.invars[1]
>>> flat = if_convert_conds(closed, weight_invars=[w], hidden_invars=[], hidden_outvars=[])
>>> [e.primitive.name for e in flat.jaxpr.eqns]
['convert_element_type', 'add', 'mul', 'select_n']
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import jax
from jax.typing import ArrayLike

from braintrace._compatible_imports import (
    Atom,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Var,
    closed_jaxpr_constvars,
    cond_branches,
    is_var,
    new_jaxpr_eqn,
    scan_params,
    source_line,
)
from braintrace._compiler.control_flow_policy import DEFAULT_CONTROL_FLOW_POLICY, ControlFlowPolicy
from braintrace._compiler.diagnostics import DiagnosticContext, DiagnosticKind, DiagnosticLevel, emit
from braintrace._compiler.jaxpr_graph import (
    build_producer_map,
    contains_eqn,
    fresh_var,
    inline_jit_calls,
    subjaxprs,
)
from braintrace._errors import CompilationError, internal_error
from braintrace._op._registries import is_etp_primitive
from braintrace._op._rule_helpers import dtype_of, shape_of

__all__ = [
    "ControlFlowPolicy",
    "DEFAULT_CONTROL_FLOW_POLICY",
    "canonicalize_control_flow",
    "if_convert_conds",
    "unroll_inner_scans",
]


def _read(subst: dict[Var, Atom], a: Atom) -> Atom:
    return subst.get(a, a) if is_var(a) else a


class _Context:
    """What a sweep needs: the vars of interest, the policy, and the sweep's deferred warnings."""

    def __init__(self, weight_invars: Iterable[Var], hidden_invars: Iterable[Var], hidden_outvars: Iterable[Var],
                 policy: ControlFlowPolicy) -> None:
        self.weights = set(weight_invars)
        self.hidden_in = set(hidden_invars)
        self.hidden_out = set(hidden_outvars)
        self.policy = policy
        self.deferred: list[tuple[DiagnosticKind, DiagnosticLevel, str, DiagnosticContext]] = []

    def relevance(self, eqn: JaxprEqn) -> str | None:
        if any(is_var(a) and a in self.weights for a in eqn.invars):
            return "consumes a weight"
        if any(is_var(a) and a in self.hidden_in for a in eqn.invars):
            return "consumes a hidden state"
        if any(is_var(v) and v in self.hidden_out for v in eqn.outvars):
            return "produces a hidden state"
        if any(contains_eqn(s, lambda e: is_etp_primitive(e.primitive)) for s in subjaxprs(eqn)):
            return "contains an ETP primitive"
        return None

    def defer_warning(self, kind: DiagnosticKind, level: DiagnosticLevel, message: str,
                      context: DiagnosticContext) -> None:
        """Keep a warning about an equation left as it is; only the settling sweep's are emitted."""
        self.deferred.append((kind, level, message, context))

    def emit_deferred(self) -> None:
        for kind, level, message, context in self.deferred:
            emit(kind, level, message, context=context)
        self.deferred.clear()


def _clone(eqns: Sequence[JaxprEqn], subst: dict[Var, Atom], out: list[JaxprEqn],
           rename: Callable[[Var], Var] = fresh_var) -> None:
    """Append ``eqns`` to ``out`` reading through ``subst``, with outvars renamed by ``rename``."""
    for eqn in eqns:
        invars = [_read(subst, a) for a in eqn.invars]
        outvars = []
        for v in eqn.outvars:
            new = DropVar(v.aval) if isinstance(v, DropVar) else rename(v)
            if not isinstance(v, DropVar):
                subst[v] = new
            outvars.append(new)
        out.append(eqn.replace(invars=invars, outvars=outvars))


def _splice_fn(fn: Callable[..., jax.Array], inputs: Sequence[Atom], outvars: Sequence[Var] | None,
               out: list[JaxprEqn]) -> list[Atom]:
    """Append the equations of ``fn`` applied to ``inputs``; results written to ``outvars`` if given."""
    avals = [jax.ShapeDtypeStruct(shape_of(a), dtype_of(a)) for a in inputs]
    closed = jax.make_jaxpr(fn)(*avals)
    if closed.consts:
        raise internal_error("a spliced helper closes over arrays")
    subst: dict[Var, Atom] = dict(zip(closed.jaxpr.invars, inputs))
    targets = dict(zip(closed.jaxpr.outvars, outvars)) if outvars is not None else {}

    def rename(v: Var) -> Var:
        return targets.get(v, fresh_var(v))

    _clone(closed.jaxpr.eqns, subst, out, rename)
    results = [_read(subst, v) for v in closed.jaxpr.outvars]
    if outvars is not None:
        for res, target in zip(results, outvars):
            if res is not target:  # a passthrough result still needs a producer of the outvar
                out.append(new_jaxpr_eqn([res], [target], jax.lax.copy_p, {}, set()))
        return list(outvars)
    return results


# --- cond ---------------------------------------------------------------------------------


def _cond_blocker(eqn: JaxprEqn, ctx: _Context) -> str | None:
    if eqn.effects:
        return "the cond has effects"
    for branch in cond_branches(eqn):
        if branch.jaxpr.effects:
            return "a branch has effects"
        if contains_eqn(branch.jaxpr, lambda e: e.primitive.name == "while"):
            return "a branch contains a while_loop"
        if contains_eqn(branch.jaxpr, lambda e: e.primitive.name == "scan" and _scan_static_blocker(e, ctx) is not None):
            return "a branch contains a scan that cannot be unrolled"
    return None


def _convert_cond(eqn: JaxprEqn, out: list[JaxprEqn], constvars: list[Var], consts: list[ArrayLike]) -> None:
    index, operands = eqn.invars[0], eqn.invars[1:]
    branch_outs = []
    for branch in cond_branches(eqn):
        subst: dict[Var, Atom] = dict(zip(branch.jaxpr.invars, operands))
        for cv, c in zip(closed_jaxpr_constvars(branch), branch.consts, strict=True):
            nv = fresh_var(cv)
            constvars.append(nv)
            consts.append(c)
            subst[cv] = nv
        _clone(branch.jaxpr.eqns, subst, out)
        branch_outs.append([_read(subst, v) for v in branch.jaxpr.outvars])
    for k, target in enumerate(eqn.outvars):
        if isinstance(target, DropVar):
            continue
        cases = [outs[k] for outs in branch_outs]
        out.append(new_jaxpr_eqn([index, *cases], [target], jax.lax.select_n_p, {}, set(), eqn.source_info, eqn.ctx))


def _cond_sweep(closed: ClosedJaxpr, ctx: _Context) -> ClosedJaxpr:
    jaxpr = closed.jaxpr
    constvars, consts = closed_jaxpr_constvars(closed), list(closed.consts)
    out: list[JaxprEqn] = []
    changed = False
    for eqn in jaxpr.eqns:
        reason = ctx.relevance(eqn) if eqn.primitive.name == "cond" else None
        if reason is None:
            out.append(eqn)
            continue
        blocker = _cond_blocker(eqn, ctx)
        if blocker is not None:
            ctx.defer_warning(DiagnosticKind.COND_CONVERSION_SKIPPED, DiagnosticLevel.WARNING,
                              f"A lax.cond that {reason} is kept opaque because {blocker}; ETP operations and "
                              f"weights inside it cannot learn online.",
                              {"reason": blocker, "relevance": reason})
            out.append(eqn)
            continue
        _convert_cond(eqn, out, constvars, consts)
        emit(DiagnosticKind.COND_IF_CONVERTED, DiagnosticLevel.INFO,
             f"A lax.cond that {reason} was converted into its branches and select_n.",
             context={"n_branches": len(cond_branches(eqn)), "n_outputs": len(eqn.outvars), "reason": reason})
        changed = True
    if not changed:
        return closed
    return ClosedJaxpr(jaxpr.replace(constvars=constvars, eqns=out), consts)


# --- scan ---------------------------------------------------------------------------------


def _scan_static_blocker(eqn: JaxprEqn, ctx: _Context) -> str | None:
    p = scan_params(eqn)
    limit = ctx.policy.scan_unroll_limit
    if limit <= 0:
        return "scan unrolling is disabled (scan_unroll_limit <= 0)"
    if p.length == 0:
        return "the scan has length 0"
    if p.length > limit:
        return f"its length {p.length} exceeds scan_unroll_limit={limit}"
    if eqn.effects or p.body.jaxpr.effects:
        return "the scan has effects"
    if contains_eqn(p.body.jaxpr, lambda e: e.primitive.name == "while"):
        return "its body contains a while_loop"
    return None


def _xs_from_weight(eqn: JaxprEqn, producers: dict[Var, JaxprEqn], weights: set[Var]) -> bool:
    p = scan_params(eqn)
    xs = [a for a in eqn.invars[p.num_consts + p.num_carry:] if is_var(a)]
    seen: set[Var] = set()
    stack: list[Var] = list(xs)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in weights:
            return True
        producer = producers.get(v)
        if producer is not None:
            stack.extend(a for a in producer.invars if is_var(a))
    return False


def _unroll(
    eqn: JaxprEqn, out: list[JaxprEqn], constvars: list[Var], consts: list[ArrayLike], consumed: set[Var]
) -> None:
    p = scan_params(eqn)
    body, length, nc, nk = p.body, p.length, p.num_consts, p.num_carry
    const_ops, carry, xs = eqn.invars[:nc], list(eqn.invars[nc:nc + nk]), eqn.invars[nc + nk:]
    hoisted: dict[Var, Atom] = {}
    for cv, c in zip(closed_jaxpr_constvars(body), body.consts, strict=True):
        nv = fresh_var(cv)
        constvars.append(nv)
        consts.append(c)
        hoisted[cv] = nv
    carry_out, ys_out = eqn.outvars[:nk], eqn.outvars[nk:]
    ys_parts: list[dict[int, Atom]] = [{} for _ in ys_out]
    order = range(length - 1, -1, -1) if p.reverse else range(length)
    for step_i, t in enumerate(order):
        last = step_i == length - 1
        subst: dict[Var, Atom] = dict(hoisted)
        subst.update(zip(body.jaxpr.invars[:nc], const_ops))
        subst.update(zip(body.jaxpr.invars[nc:nc + nk], carry))
        slices = [
            _splice_fn(lambda a, t=t: jax.lax.squeeze(jax.lax.slice_in_dim(a, t, t + 1, axis=0), (0,)), [x], None, out)[0]
            if is_var(x) else x
            for x in xs
        ]
        subst.update(zip(body.jaxpr.invars[nc + nk:], slices))
        targets = _direct_carry_targets(body.jaxpr, carry_out, consumed) if last else {}
        _clone(body.jaxpr.eqns, subst, out, lambda v: targets.get(v, fresh_var(v)))
        carry = [_read(subst, v) for v in body.jaxpr.outvars[:nk]]
        for k, v in enumerate(body.jaxpr.outvars[nk:]):
            ys_parts[k][t] = _read(subst, v)
    for target, value in zip(carry_out, carry):
        if is_var(target) and target in consumed and value is not target:
            out.append(new_jaxpr_eqn([value], [target], jax.lax.copy_p, {}, set()))
    for target, parts in zip(ys_out, ys_parts):
        if is_var(target) and target in consumed:
            _splice_fn(lambda *a: jax.numpy.stack(a), [parts[t] for t in range(length)], [target], out)


def _direct_carry_targets(body: Jaxpr, carry_out: Sequence[Var], consumed: set[Var]) -> dict[Var, Var]:
    """Final-iteration body outputs written straight into the scan's carry outvars."""
    produced = {v for e in body.eqns for v in e.outvars if is_var(v)}
    targets: dict[Var, Var] = {}
    for body_v, outer in zip(body.outvars, carry_out):
        if is_var(outer) and outer in consumed and is_var(body_v) and body_v in produced and body_v not in targets:
            targets[body_v] = outer
    return targets


def _scan_sweep(closed: ClosedJaxpr, ctx: _Context) -> ClosedJaxpr:
    jaxpr = closed.jaxpr
    producers = build_producer_map(jaxpr)
    consumed = {a for e in jaxpr.eqns for a in e.invars if is_var(a)} | {v for v in jaxpr.outvars if is_var(v)}
    constvars, consts = closed_jaxpr_constvars(closed), list(closed.consts)
    out: list[JaxprEqn] = []
    changed = False
    for eqn in jaxpr.eqns:
        reason = ctx.relevance(eqn) if eqn.primitive.name == "scan" else None
        if reason is None:
            out.append(eqn)
            continue
        blocker = _scan_static_blocker(eqn, ctx)
        if blocker is not None:
            over_limit = scan_params(eqn).length > ctx.policy.scan_unroll_limit > 0
            info = over_limit and ctx.policy.scan_descent == "auto"
            ctx.defer_warning(DiagnosticKind.SCAN_UNROLL_SKIPPED,
                              DiagnosticLevel.INFO if info else DiagnosticLevel.WARNING,
                              f"A scan that {reason} is not unrolled because {blocker}" +
                              ("; structured scan descent will try it." if info else "."),
                              {"reason": blocker, "length": scan_params(eqn).length})
            out.append(eqn)
            continue
        if _xs_from_weight(eqn, producers, ctx.weights):
            ctx.defer_warning(DiagnosticKind.RELATION_EXCLUDED_SLICED_WEIGHT, DiagnosticLevel.WARNING,
                              "A scan slices a trainable weight as its xs; per-slice eligibility traces are not "
                              "supported, so the scan is kept and those weights do not learn online.",
                              {"reason": "weight sliced as xs"})
            out.append(eqn)
            continue
        _unroll(eqn, out, constvars, consts, consumed)
        p = scan_params(eqn)
        emit(DiagnosticKind.SCAN_UNROLLED, DiagnosticLevel.INFO,
             f"A scan of length {p.length} that {reason} was unrolled.",
             context={"length": p.length, "num_consts": p.num_consts, "num_carry": p.num_carry,
                      "reverse": p.reverse, "reason": reason})
        changed = True
    if not changed:
        return closed
    return ClosedJaxpr(jaxpr.replace(constvars=constvars, eqns=out), consts)


# --- drivers ------------------------------------------------------------------------------


def _sweep(closed: ClosedJaxpr, ctx: _Context, conds: bool, scans: bool) -> ClosedJaxpr:
    """One rewriting round: convert the relevant conds, then unroll the relevant short scans."""
    ctx.deferred.clear()
    if conds and ctx.policy.cond == "convert":
        new = _cond_sweep(closed, ctx)
        closed = inline_jit_calls(new) if new is not closed else closed
    if scans and ctx.policy.scan_unroll_limit > 0:
        new = _scan_sweep(closed, ctx)
        closed = inline_jit_calls(new) if new is not closed else closed
    return closed


def _pending_rewrites(closed: ClosedJaxpr, ctx: _Context, conds: bool, scans: bool) -> list[str]:
    """What the next sweep would still rewrite, one description per equation."""
    jaxpr = closed.jaxpr
    producers = build_producer_map(jaxpr)
    pending = []
    for eqn in jaxpr.eqns:
        if ctx.relevance(eqn) is None:
            continue
        name = eqn.primitive.name
        if conds and ctx.policy.cond == "convert" and name == "cond" and _cond_blocker(eqn, ctx) is None:
            pending.append(f"cond with {len(cond_branches(eqn))} branches{_located(eqn)}")
        elif (scans and ctx.policy.scan_unroll_limit > 0 and name == "scan"
              and _scan_static_blocker(eqn, ctx) is None and not _xs_from_weight(eqn, producers, ctx.weights)):
            pending.append(f"scan of length {scan_params(eqn).length}{_located(eqn)}")
    return pending


def _located(eqn: JaxprEqn) -> str:
    line = source_line(eqn.source_info)
    return f" at {line}" if line else ""


def _raise_if_unsettled(closed: ClosedJaxpr, ctx: _Context, conds: bool, scans: bool) -> None:
    pending = _pending_rewrites(closed, ctx, conds, scans)
    if not pending:
        return
    counts = {text: pending.count(text) for text in pending}
    described = [text if n == 1 else f"{text} ({n} equations)" for text, n in counts.items()]
    limit = ctx.policy.fixpoint_iteration_limit
    raise CompilationError(
        f"Control-flow canonicalisation did not settle within ControlFlowPolicy.fixpoint_iteration_limit="
        f"{limit} sweeps; still being rewritten: {'; '.join(described)}. Raise fixpoint_iteration_limit "
        f"(ControlFlowPolicy(fixpoint_iteration_limit={2 * limit})), or keep this control flow as it is "
        f"with ControlFlowPolicy(cond='opaque') for conds or ControlFlowPolicy(scan_unroll_limit=0) for scans."
    )


def _run(closed: ClosedJaxpr, ctx: _Context, conds: bool, scans: bool) -> ClosedJaxpr:
    if ctx.policy.cond not in ("convert", "opaque"):
        raise ValueError(f"ControlFlowPolicy.cond must be 'convert' or 'opaque', got {ctx.policy.cond!r}.")
    for _ in range(ctx.policy.fixpoint_iteration_limit):
        before = closed
        closed = _sweep(closed, ctx, conds, scans)
        if closed is before:
            ctx.emit_deferred()
            return closed
    _raise_if_unsettled(closed, ctx, conds, scans)
    settled = _sweep(closed, ctx, conds, scans)  # rewrites nothing: it only gathers the warnings
    ctx.emit_deferred()
    return settled


def _canonicalize(
    closed_jaxpr: ClosedJaxpr, weight_invars: Iterable[Var], hidden_invars: Iterable[Var],
    hidden_outvars: Iterable[Var], policy: ControlFlowPolicy, conds: bool, scans: bool,
) -> ClosedJaxpr:
    ctx = _Context(weight_invars, hidden_invars, hidden_outvars, policy)
    return _run(closed_jaxpr, ctx, conds=conds, scans=scans)


def canonicalize_control_flow(
    closed_jaxpr: ClosedJaxpr,
    *,
    weight_invars: Iterable[Var],
    hidden_invars: Iterable[Var],
    hidden_outvars: Iterable[Var],
    policy: ControlFlowPolicy = DEFAULT_CONTROL_FLOW_POLICY,
) -> ClosedJaxpr:
    """If-convert relevant conds and unroll relevant short scans until nothing changes.

    Returns ``closed_jaxpr`` itself when nothing is rewritten.

    Raises
    ------
    CompilationError
        If a cond or scan is still to be rewritten after ``policy.fixpoint_iteration_limit``
        sweeps; the message names each one (primitive, branch count or length, source line).
    """
    return _canonicalize(closed_jaxpr, weight_invars, hidden_invars, hidden_outvars, policy, True, True)


def if_convert_conds(
    closed_jaxpr: ClosedJaxpr,
    *,
    weight_invars: Iterable[Var],
    hidden_invars: Iterable[Var],
    hidden_outvars: Iterable[Var],
    policy: ControlFlowPolicy = DEFAULT_CONTROL_FLOW_POLICY,
) -> ClosedJaxpr:
    """Only the cond part of :func:`canonicalize_control_flow` (same keyword-only arguments)."""
    return _canonicalize(closed_jaxpr, weight_invars, hidden_invars, hidden_outvars, policy,
                         conds=True, scans=False)


def unroll_inner_scans(
    closed_jaxpr: ClosedJaxpr,
    *,
    weight_invars: Iterable[Var],
    hidden_invars: Iterable[Var],
    hidden_outvars: Iterable[Var],
    policy: ControlFlowPolicy = DEFAULT_CONTROL_FLOW_POLICY,
) -> ClosedJaxpr:
    """Only the scan part of :func:`canonicalize_control_flow` (same keyword-only arguments)."""
    return _canonicalize(closed_jaxpr, weight_invars, hidden_invars, hidden_outvars, policy,
                         conds=False, scans=True)
