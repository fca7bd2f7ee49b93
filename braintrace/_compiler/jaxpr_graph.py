"""Jaxpr graph utilities: producer/consumer maps, reachability, sub-jaxprs, jit inlining.

The compiler analyses one flat jaxpr by ``Var`` identity. User ``jax.jit`` boundaries would
hide the ETP equations and hidden-state updates inside them, so :func:`inline_jit_calls`
splices every jit body into its caller (freshening the body's variables per call site,
since JAX reuses one body jaxpr for every call of the same jitted function).

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from braintrace._compiler.jaxpr_graph import inline_jit_calls
>>> g = jax.jit(lambda x: 2 * x)
>>> closed = jax.make_jaxpr(lambda x: g(x) + g(x))(1.0)
>>> [e.primitive.name for e in inline_jit_calls(closed).jaxpr.eqns]
['mul', 'mul', 'add']
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Collection, Iterable

import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._compatible_imports import (
    CONTROL_FLOW_PRIMITIVES,
    Atom,
    ClosedJaxpr,
    DebugInfo,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    closed_jaxpr_constvars,
    is_jit,
    is_var,
    jit_body,
    map_closed_subjaxprs,
    subjaxprs,
)

__all__ = [
    "CONTROL_FLOW_PRIMITIVES",
    "ELEMENTWISE_PRIMITIVES",
    "is_jit",
    "subjaxprs",
    "contains_eqn",
    "build_producer_map",
    "build_consumer_map",
    "forward_closure",
    "backward_closure",
    "differentiable_reach",
    "inline_jit_calls",
    "fresh_var",
    "new_jaxpr",
]

#: Primitives that act position by position: each output element reads only the same-index
#: elements of its operands.
ELEMENTWISE_PRIMITIVES = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq",
    "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow",
    "is_finite", "le", "lgamma", "digamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "pow", "reduce_precision", "rem", "round",
    "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan",
    "tanh", "xor", "real", "imag", "conj",
})


def contains_eqn(jaxpr: Jaxpr, predicate: Callable[[JaxprEqn], bool]) -> bool:
    """Whether any equation of ``jaxpr`` or of its sub-jaxprs (transitively) satisfies ``predicate``."""
    for eqn in jaxpr.eqns:
        if predicate(eqn):
            return True
        if any(contains_eqn(sub, predicate) for sub in subjaxprs(eqn)):
            return True
    return False


def build_producer_map(jaxpr: Jaxpr) -> dict[Var, JaxprEqn]:
    """``outvar -> the equation producing it``."""
    return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars if not isinstance(v, DropVar)}


def build_consumer_map(jaxpr: Jaxpr) -> dict[Var, list[JaxprEqn]]:
    """``var -> the equations reading it``, in equation order (``Var`` operands only)."""
    consumers: dict[Var, list[JaxprEqn]] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, Var) and not isinstance(v, Literal):
                bucket = consumers.setdefault(v, [])
                if not bucket or bucket[-1] is not eqn:
                    bucket.append(eqn)
    return consumers


def forward_closure(start: Var, consumers: dict[Var, list[JaxprEqn]]) -> list[Var]:
    """Every var reachable forward from ``start`` (breadth first, ``start`` included)."""
    seen = {start: None}
    queue = deque([start])
    while queue:
        for eqn in consumers.get(queue.popleft(), ()):
            for out in eqn.outvars:
                if not isinstance(out, DropVar) and out not in seen:
                    seen[out] = None
                    queue.append(out)
    return list(seen)


def backward_closure(targets: Iterable[Var], producers: dict[Var, JaxprEqn]) -> list[Var]:
    """Every var ``targets`` depend on through ``producers`` (targets included)."""
    seen: dict[Var, None] = {}
    queue = deque(v for v in targets if isinstance(v, Var) and not isinstance(v, Literal))
    while queue:
        v = queue.popleft()
        if v in seen:
            continue
        seen[v] = None
        eqn = producers.get(v)
        if eqn is not None:
            queue.extend(a for a in eqn.invars if isinstance(a, Var) and not isinstance(a, Literal))
    return list(seen)


def _carries_gradient(var: Atom) -> bool:
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return is_var(var) and dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def differentiable_reach(
    jaxpr: Jaxpr, seeds: Iterable[Atom], blocked: Collection[int] = (), stop: Collection[Var] = ()
) -> set[Var]:
    """The variables of ``jaxpr`` a gradient can reach from ``seeds`` (the seeds included).

    Skips ``stop_gradient``, the equations whose ``id`` is in ``blocked`` and outputs of integer
    or boolean dtype; the variables in ``stop`` are reached but not followed further. An equation
    with a body counts as reading every input into every output.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from braintrace._compiler.jaxpr_graph import differentiable_reach
    >>> jaxpr = jax.make_jaxpr(lambda a, b: (jnp.sin(a), jax.lax.stop_gradient(a) + b))(1.0, 2.0).jaxpr
    >>> reached = differentiable_reach(jaxpr, [jaxpr.invars[0]])
    >>> [v in reached for v in jaxpr.outvars]
    [True, False]
    """
    reached = {v for v in seeds if is_var(v)}
    for eqn in jaxpr.eqns:
        if id(eqn) in blocked or eqn.primitive.name == "stop_gradient":
            continue
        if any(is_var(a) and a in reached and a not in stop for a in eqn.invars):
            reached.update(v for v in eqn.outvars if _carries_gradient(v))
    return reached


def fresh_var(like: Var) -> Var:
    """A new variable with the abstract value of ``like``."""
    if isinstance(like, DropVar):
        return DropVar(like.aval)
    return Var(like.aval)


def new_jaxpr(
    constvars: Iterable[Var],
    invars: Iterable[Var],
    outvars: Iterable[Atom],
    eqns: Iterable[JaxprEqn],
    effects: Any = None,
    name: str = "braintrace",
) -> Jaxpr:
    """A jaxpr with debug info sized to its inputs and outputs; effects default to the eqns'."""
    constvars, invars, outvars, eqns = list(constvars), list(invars), list(outvars), list(eqns)
    if effects is None:
        effects = frozenset(e for eqn in eqns for e in eqn.effects)
    info = DebugInfo(
        "braintrace", name, tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    return Jaxpr(constvars, invars, outvars, eqns, effects, info)


# --- jit inlining -------------------------------------------------------------------------


def _has_inlinable_jit(jaxpr: Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if is_jit(eqn):
            return True
        if eqn.primitive.name in CONTROL_FLOW_PRIMITIVES and any(
            _has_inlinable_jit(sub) for sub in subjaxprs(eqn)
        ):
            return True
    return False


def inline_jit_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Splice every user ``jit`` body into its caller, also inside scan/while/cond bodies.

    Returns ``closed`` itself when there is nothing to inline. The jaxpr's invars are kept;
    outvars produced by a jit call are replaced by the spliced atoms. Closure constants of
    inlined bodies become new constvars. ``custom_jvp``/``custom_vjp`` bodies are left alone.
    """
    jaxpr = closed.jaxpr
    if not _has_inlinable_jit(jaxpr):
        return closed
    constvars, consts = closed_jaxpr_constvars(closed), list(closed.consts)
    subst: dict[Var, Atom] = {}
    eqns: list[JaxprEqn] = []
    _splice(jaxpr.eqns, subst, eqns, constvars, consts, freshen=False)
    outvars = [_read(subst, v) for v in jaxpr.outvars]
    new = Jaxpr(constvars, jaxpr.invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info)
    return ClosedJaxpr(new, consts)


def _read(subst: dict[Var, Atom], atom: Atom) -> Atom:
    if isinstance(atom, Literal) or not isinstance(atom, Var):
        return atom
    return subst.get(atom, atom)


def _splice(
    src: Iterable[JaxprEqn],
    subst: dict[Var, Atom],
    out: list[JaxprEqn],
    constvars: list[Var],
    consts: list[ArrayLike],
    *,
    freshen: bool,
) -> None:
    for eqn in src:
        invars = [_read(subst, a) for a in eqn.invars]
        if is_jit(eqn):
            body = jit_body(eqn)
            inner: dict[Var, Atom] = {}
            for cv, c in zip(closed_jaxpr_constvars(body), body.consts, strict=True):
                nv = fresh_var(cv)
                constvars.append(nv)
                consts.append(c)
                inner[cv] = nv
            inner.update(zip(body.jaxpr.invars, invars))
            _splice(body.jaxpr.eqns, inner, out, constvars, consts, freshen=True)
            for outer_v, inner_v in zip(eqn.outvars, body.jaxpr.outvars):
                if not isinstance(outer_v, DropVar):
                    subst[outer_v] = _read(inner, inner_v)
            continue
        if eqn.primitive.name in CONTROL_FLOW_PRIMITIVES:
            eqn = map_closed_subjaxprs(eqn, inline_jit_calls)
        outvars = eqn.outvars
        if freshen:
            outvars = [fresh_var(v) for v in eqn.outvars]
            subst.update((o, n) for o, n in zip(eqn.outvars, outvars) if not isinstance(o, DropVar))
        changed = freshen or any(a is not b for a, b in zip(invars, eqn.invars))
        out.append(eqn.replace(invars=invars, outvars=outvars) if changed else eqn)
