"""Control-flow canonicalisation: cond if-conversion, inner-scan unrolling, their gates and records.

Model-level checks compare a canonicalised step with its hand-flattened twin
(:mod:`tests.compiler.control_flow_models`) in values and gradients; jaxpr-level checks run
:func:`if_convert_conds` / :func:`unroll_inner_scans` on small traced functions.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr

import braintrace
from braintrace import ControlFlowPolicy, DiagnosticKind, DiagnosticLevel
from braintrace._compiler import (
    DEFAULT_CONTROL_FLOW_POLICY,
    canonicalize_control_flow,
    diagnostic_context,
    if_convert_conds,
    unroll_inner_scans,
)
from tests.compiler import control_flow_models as cf

Kind = DiagnosticKind


def _names(closed: ClosedJaxpr) -> list[str]:
    return [e.primitive.name for e in closed.jaxpr.eqns]


def _records(fn: Callable[[], Any]) -> tuple[Any, tuple[Any, ...]]:
    """``fn()`` and the compiler records it emits (its Python warnings silenced)."""
    with diagnostic_context() as reporter, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = fn()
    return result, reporter.records()


def _compile(model: brainstate.nn.Module, *args: Any, **options: Any) -> tuple[Any, tuple[Any, ...]]:
    """The graph and its records (``compile_etrace_graph`` collects its own), warnings silenced."""
    graph = _records(lambda: braintrace.compile_etrace_graph(model, *args, **options))[0]
    return graph, graph.diagnostics


def _kinds(records: tuple[Any, ...], kind: DiagnosticKind) -> list[Any]:
    return [r for r in records if r.kind is kind]


# --- canonicalised models equal their twins -----------------------------------------------


def step_function(model: brainstate.nn.Module, x: Any) -> Callable[[Any, dict[Any, Any]], dict[Any, Any]]:
    """The canonicalised step as ``f(x, state values by path) -> outputs and new states by path``."""
    minfo = braintrace.extract_module_info(model, x)
    paths = [minfo.state_id_to_path[id(st)] for st in minfo.compiled_model_states]

    def f(x: Any, vals: dict[Any, Any]) -> dict[Any, Any]:
        flat = jax.tree.leaves((x, [vals[p] for p in paths]))
        outs = jax.core.eval_jaxpr(minfo.jaxpr, minfo.closed_jaxpr.consts, *flat)
        n = minfo.num_var_out
        return {**{("out", i): o for i, o in enumerate(outs[:n])}, **dict(zip(paths, outs[n:n + len(paths)]))}

    return f


def _state_values(model: brainstate.nn.Module) -> dict[Any, Any]:
    key = jax.random.PRNGKey(3)
    vals = {}
    for i, (path, st) in enumerate(model.states().items()):
        fresh = st.value if isinstance(st, brainstate.ParamState) else jax.random.normal(jax.random.fold_in(key, i), st.value.shape)
        vals[path] = fresh
    return vals


TWINS = {
    "cond": (cf.CondModel, {}),
    "switch3": (cf.SwitchModel, {}),
    "cond_in_scan": (cf.CondInScanModel, {}),
    "scan_len1": (cf.SubstepModel, {"length": 1}),
    "scan_len16": pytest.param((cf.SubstepModel, {"length": 16}), marks=pytest.mark.slow),
    "scan_reverse": (cf.SubstepModel, {"length": 3, "reverse": True}),
    "for_loop_reverse": (cf.SubstepModel, {"length": 3, "reverse": True, "api": "for_loop"}),
    "two_carries": (cf.TwoStateModel, {"length": 3}),
}


@pytest.mark.parametrize("case", list(TWINS.values()), ids=list(TWINS))
def test_canonicalised_model_equals_its_twin(case: Any) -> None:
    cls, kwargs = case
    model, twin = cls(**kwargs), cls(flat=True, **kwargs)
    x0 = jnp.array([0.7, -0.3, 0.5])
    f, g = _records(lambda: step_function(model, x0))[0], step_function(twin, x0)
    assert not {"cond", "scan"} & set(_names(braintrace.extract_module_info(model, x0).closed_jaxpr))
    vals = _state_values(model)

    def loss(fn: Callable[..., Any], x: Any, vals: dict[Any, Any]) -> Any:
        return sum(jnp.sum(jnp.sin(o)) for o in fn(x, vals).values())

    # One compiled program per side (eager evaluation would compile every operation).
    run_f = jax.jit(lambda x, v: (f(x, v), jax.grad(lambda x, v: loss(f, x, v), argnums=(0, 1))(x, v)))
    run_g = jax.jit(lambda x, v: (g(x, v), jax.grad(lambda x, v: loss(g, x, v), argnums=(0, 1))(x, v)))
    for first in (1.0, -1.0, 0.2):  # every branch of the cond / switch models
        x = x0.at[0].set(first)
        (got, got_g), (want, want_g) = run_f(x, vals), run_g(x, vals)
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cond_model_records_and_relations() -> None:
    graph, records = _compile(cf.CondModel(), jnp.ones(3))
    (converted,) = _kinds(records, Kind.COND_IF_CONVERTED)
    assert converted.level is DiagnosticLevel.INFO
    assert converted.context == {"n_branches": 2, "n_outputs": 1, "reason": "consumes a weight"}
    included = _kinds(records, Kind.RELATION_INCLUDED)
    # Branch 0 of a boolean cond is the false branch: its weight comes first.
    assert [r.weight_path for r in included] == [("w2",), ("w1",)]
    assert records.index(converted) < records.index(included[0])
    assert [r.trainable_paths for r in graph.hidden_param_op_relations] == [{"weight": ("w2",)}, {"weight": ("w1",)}]


def test_switch_model_converts_three_branches() -> None:
    graph, records = _compile(cf.SwitchModel(), jnp.ones(3))
    (converted,) = _kinds(records, Kind.COND_IF_CONVERTED)
    assert converted.context["n_branches"] == 3
    assert len(graph.hidden_param_op_relations) == 3


def test_cond_in_scan_flattens_both() -> None:
    minfo, records = _records(lambda: braintrace.extract_module_info(cf.CondInScanModel(), jnp.ones(3)))
    assert len(_kinds(records, Kind.SCAN_UNROLLED)) == 1
    assert len(_kinds(records, Kind.COND_IF_CONVERTED)) == 3  # one per unrolled substep
    assert not {"cond", "scan"} & set(_names(minfo.closed_jaxpr))


def test_unrolled_scan_records_and_relation_counts() -> None:
    graph, records = _compile(cf.SubstepModel(length=3), jnp.ones(3))
    (unrolled,) = _kinds(records, Kind.SCAN_UNROLLED)
    assert unrolled.context == {"length": 3, "num_consts": unrolled.context["num_consts"], "num_carry": 1,
                                "reverse": False, "reason": unrolled.context["reason"]}
    # Every substep's drive reaches h without crossing another trainable operation.
    assert len(graph.hidden_param_op_relations) == 6


class TiedSubsteps(brainstate.nn.Module):
    """``h = tanh(x @ W + h @ W)`` for three substeps: only the last substep's two uses are relations."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.3 * jax.random.normal(jax.random.PRNGKey(0), (4, 4)))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        def body(h: Any, _: Any) -> Any:
            return jnp.tanh(braintrace.matmul(x, self.w.value) + braintrace.matmul(h, self.w.value)), None

        self.h.value, _ = jax.lax.scan(body, self.h.value, None, length=3)
        return self.h.value


def test_unrolled_tied_weight_keeps_the_last_substep() -> None:
    graph, records = _compile(TiedSubsteps(), jnp.ones(4))
    assert len(graph.hidden_param_op_relations) == 2
    assert len(_kinds(records, Kind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT)) == 4


# --- jaxpr-level conversion ---------------------------------------------------------------

W = jnp.ones((3, 4)) * 0.5


def _same_values(before: ClosedJaxpr, after: ClosedJaxpr, *args: Any) -> None:
    a = jax.core.eval_jaxpr(before.jaxpr, before.consts, *args)
    b = jax.core.eval_jaxpr(after.jaxpr, after.consts, *args)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-6)


def _flatten(fn: Callable[..., Any], *args: Any, weight: int | None = None, hidden: int | None = None,
             which: Callable[..., ClosedJaxpr] = canonicalize_control_flow, **policy: Any) -> tuple[ClosedJaxpr, ClosedJaxpr]:
    closed = jax.make_jaxpr(fn)(*args)
    invars = closed.jaxpr.invars
    flat = which(
        closed,
        weight_invars=[] if weight is None else [invars[weight]],
        hidden_invars=[] if hidden is None else [invars[hidden]],
        hidden_outvars=[],
        policy=ControlFlowPolicy(**policy),
    )
    return closed, flat


def test_cond_multi_output_and_passthrough_branch() -> None:
    def fn(p: Any, x: Any, w: Any, h: Any) -> Any:
        def a(x: Any, w: Any, h: Any) -> Any:
            return braintrace.matmul(x, w), h

        def b(x: Any, w: Any, h: Any) -> Any:
            return jnp.tanh(braintrace.matmul(x, w)), 2.0 * h

        return jax.lax.cond(p, a, b, x, w, h)

    for p in (True, False):
        args = (p, jnp.arange(3.0), W, jnp.ones(4))
        closed, flat = _flatten(fn, *args, weight=2, which=if_convert_conds)
        assert "cond" not in _names(flat) and _names(flat).count("select_n") == 2
        assert all(a is b for a, b in zip(closed.jaxpr.invars, flat.jaxpr.invars))
        assert all(a is b for a, b in zip(closed.jaxpr.outvars, flat.jaxpr.outvars))
        _same_values(closed, flat, *args)


def test_cond_with_jitted_helpers_and_nesting() -> None:
    helper = jax.jit(lambda x, w: braintrace.matmul(x, w))

    def fn(p: Any, q: Any, x: Any, w: Any) -> Any:
        def inner(x: Any, w: Any) -> Any:
            return jax.lax.cond(q, lambda x, w: helper(x, w), lambda x, w: -helper(x, w), x, w)

        return jax.lax.cond(p, inner, lambda x, w: 2.0 * helper(x, w), x, w)

    for p, q in [(True, True), (True, False), (False, True)]:
        args = (p, q, jnp.arange(3.0), W)
        closed, flat = _flatten(fn, *args, weight=3)
        assert not {"cond", "jit", "pjit"} & set(_names(flat))
        _same_values(closed, flat, *args)
        grads = [jax.grad(lambda w, c=c: jnp.sum(jax.core.eval_jaxpr(c.jaxpr, c.consts, p, q, args[2], w)[0]))(W)
                 for c in (closed, flat)]
        np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)


def test_cond_relevance() -> None:
    def fn(p: Any, x: Any, h: Any) -> Any:
        return jax.lax.cond(p, lambda x, h: x.sum() + h, lambda x, h: h, x, h)

    args = (True, jnp.ones(3), jnp.ones(4))
    closed, flat = _flatten(fn, *args, which=if_convert_conds)
    assert flat is closed  # touches no weight, hidden state or ETP primitive: left alone
    closed, flat = _flatten(fn, *args, hidden=2, which=if_convert_conds)
    assert "cond" not in _names(flat)
    closed, flat = _flatten(fn, *args, hidden=2, which=if_convert_conds, cond="opaque")
    assert flat is closed


def test_scan_unrolling_variants() -> None:
    def fn(h: Any, xs: Any, w: Any) -> Any:
        def body(c: Any, x: Any) -> Any:
            h, k, same = c
            new = 0.5 * h + braintrace.matmul(x, w)
            return (new, k + 1, same), (new, new, k, h)  # duplicate ys, a passthrough carry

        return jax.lax.scan(body, (h, 0, h), xs, reverse=True)

    for length in (1, 4):
        args = (jnp.arange(4.0), jnp.arange(3.0 * length).reshape(length, 3), W)
        closed, flat = _flatten(fn, *args, weight=2, which=unroll_inner_scans)
        assert "scan" not in _names(flat)
        _same_values(closed, flat, *args)


def test_unused_ys_are_not_stacked_and_zero_xs_works() -> None:
    def fn(h: Any, w: Any) -> Any:
        def body(h: Any, _: Any) -> Any:
            return 0.5 * h + braintrace.matmul(jnp.ones(3), w), h

        return jax.lax.scan(body, h, None, length=3)[0]

    args = (jnp.arange(4.0), W)
    closed, flat = _flatten(fn, *args, weight=1, which=unroll_inner_scans)
    assert not {"scan", "stack", "concatenate"} & set(_names(flat))
    _same_values(closed, flat, *args)


def test_joint_fixpoint_scan_inside_cond() -> None:
    def fn(p: Any, h: Any, w: Any) -> Any:
        def loop(h: Any, w: Any) -> Any:
            return jax.lax.scan(lambda h, _: (0.5 * h + braintrace.matmul(jnp.ones(3), w), None), h, None, length=2)[0]

        return jax.lax.cond(p, loop, lambda h, w: h, h, w)

    args = (True, jnp.arange(4.0), W)
    closed, flat = _flatten(fn, *args, weight=2)
    assert not {"cond", "scan"} & set(_names(flat))
    _same_values(closed, flat, *args)
    # Without unrolling, a branch holding a scan keeps the cond opaque (the cond-only gates).
    (_, kept), records = _records(lambda: _flatten(fn, *args, weight=2, scan_unroll_limit=0))
    assert "cond" in _names(kept)
    (skip,) = _kinds(records, Kind.COND_CONVERSION_SKIPPED)
    assert skip.context["reason"] == "a branch contains a scan that cannot be unrolled"


# --- gates and their records ----------------------------------------------------------------


def test_cond_skip_warns_once_per_equation() -> None:
    def fn(p: Any, x: Any, w: Any) -> Any:
        def with_while(x: Any, w: Any) -> Any:
            return jax.lax.while_loop(lambda c: c.sum() < 0, lambda c: c + 1.0, braintrace.matmul(x, w))

        blocked = jax.lax.cond(p, with_while, lambda x, w: braintrace.matmul(x, w), x, w)
        # A convertible cond and a short scan force several fixpoint sweeps.
        other = jax.lax.cond(p, lambda x, w: braintrace.matmul(x, w), lambda x, w: -braintrace.matmul(x, w), x, w)
        looped = jax.lax.scan(lambda c, _: (c + braintrace.matmul(x, w), None), other, None, length=2)[0]
        return blocked + looped

    with diagnostic_context() as reporter, pytest.warns(UserWarning, match="kept opaque") as caught:
        _, flat = _flatten(fn, True, jnp.ones(3), W, weight=2)
    skips = _kinds(reporter.records(), Kind.COND_CONVERSION_SKIPPED)
    assert len(skips) == 1 and len(caught) == 1
    assert skips[0].level is DiagnosticLevel.WARNING
    assert skips[0].context == {"reason": "a branch contains a while_loop", "relevance": "consumes a weight"}
    assert _names(flat).count("cond") == 1 and len(_kinds(reporter.records(), Kind.COND_IF_CONVERTED)) == 1


def test_cond_with_effects_is_skipped() -> None:
    def fn(p: Any, x: Any, w: Any) -> Any:
        def noisy(x: Any, w: Any) -> Any:
            jax.debug.print("branch")
            return braintrace.matmul(x, w)

        return jax.lax.cond(p, noisy, lambda x, w: braintrace.matmul(x, w), x, w)

    (_, flat), records = _records(lambda: _flatten(fn, True, jnp.ones(3), W, weight=2))
    assert "cond" in _names(flat)
    assert _kinds(records, Kind.COND_CONVERSION_SKIPPED)[0].context["reason"] in ("the cond has effects", "a branch has effects")


def _long_scan(length: int, body_extra: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
    def fn(h: Any, w: Any) -> Any:
        def body(h: Any, _: Any) -> Any:
            h = 0.5 * h + braintrace.matmul(jnp.ones(3), w)
            return (h if body_extra is None else body_extra(h)), None

        return jax.lax.scan(body, h, None, length=length)[0]

    return fn


@pytest.mark.parametrize(
    "fn, policy, level",
    [
        (_long_scan(20), {}, DiagnosticLevel.INFO),
        (_long_scan(20), {"scan_descent": "off"}, DiagnosticLevel.WARNING),
        (_long_scan(3, lambda h: jax.lax.while_loop(lambda c: c.sum() < 0, lambda c: c + 1.0, h)), {},
         DiagnosticLevel.WARNING),
    ],
    ids=["over_limit_descent", "over_limit_no_descent", "while_in_body"],
)
def test_scan_unroll_skip_levels(fn: Callable[..., Any], policy: dict[str, Any], level: DiagnosticLevel) -> None:
    (_, flat), records = _records(lambda: _flatten(fn, jnp.ones(4), W, weight=1, **policy))
    assert "scan" in _names(flat)
    (skip,) = _kinds(records, Kind.SCAN_UNROLL_SKIPPED)
    assert skip.level is level
    assert not _kinds(records, Kind.SCAN_UNROLLED)


def test_sliced_weight_scan_is_kept() -> None:
    def fn(h: Any, w: Any) -> Any:
        return jax.lax.scan(lambda h, row: (0.5 * h + braintrace.matmul(row, w.T[:3]), None), h, 2.0 * w)[0]

    wide = jnp.ones((3, 3)) * 0.5
    with diagnostic_context() as reporter, pytest.warns(UserWarning, match="slices a trainable weight"):
        _, flat = _flatten(fn, jnp.ones(3), wide, weight=1)
    assert "scan" in _names(flat)
    (rec,) = _kinds(reporter.records(), Kind.RELATION_EXCLUDED_SLICED_WEIGHT)
    assert rec.level is DiagnosticLevel.WARNING


def test_scan_unroll_limit_zero_keeps_every_scan() -> None:
    policy = ControlFlowPolicy(scan_unroll_limit=0)
    minfo, records = _records(
        lambda: braintrace.extract_module_info(cf.SubstepModel(length=3), jnp.ones(3), control_flow=policy))
    assert "scan" in _names(minfo.closed_jaxpr)
    assert not _kinds(records, Kind.SCAN_UNROLLED) and not _kinds(records, Kind.SCAN_UNROLL_SKIPPED)
    assert unroll_inner_scans(minfo.closed_jaxpr, weight_invars=minfo.weight_invars, hidden_invars=[],
                              hidden_outvars=[], policy=policy) is minfo.closed_jaxpr


def test_opaque_cond_keeps_the_weight_error() -> None:
    with pytest.raises(NotImplementedError, match="used within a cond"):
        braintrace.compile_etrace_graph(cf.CondModel(), jnp.ones(3), control_flow=ControlFlowPolicy(cond="opaque"))


class DerivedWeightInCond(brainstate.nn.Module):
    """An opaque cond applying an ETP operation to a weight computed outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.3 * jnp.ones((3, 4)))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        scaled = 2.0 * self.w.value
        y = jax.lax.cond(x[0] > 0, lambda x, w: braintrace.matmul(x, w), lambda x, w: -x.sum() * jnp.ones(4), x, scaled)
        self.h.value = 0.9 * self.h.value + y
        return self.h.value


def test_etp_in_opaque_control_flow_error_and_exclude() -> None:
    opaque = {"cond": "opaque"}
    with pytest.raises(NotImplementedError, match="inside a cond body"):
        braintrace.compile_etrace_graph(DerivedWeightInCond(), jnp.ones(3), control_flow=ControlFlowPolicy(**opaque))
    minfo = braintrace.extract_module_info(DerivedWeightInCond(), jnp.ones(3), control_flow=ControlFlowPolicy(**opaque))
    _, groups = braintrace.find_hidden_groups_from_minfo(minfo)
    with diagnostic_context() as reporter, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the ERROR record raises, it does not warn
        with pytest.raises(NotImplementedError, match="inside a cond body"):
            braintrace.find_hidden_param_op_relations_from_minfo(minfo, groups)
    (err,) = _kinds(reporter.records(), Kind.PRIMITIVE_INSIDE_CONTROL_FLOW)
    assert err.level is DiagnosticLevel.ERROR and err.primitive.name == "etp_mv"
    with pytest.warns(UserWarning, match="inside a cond body"):
        graph = braintrace.compile_etrace_graph(
            DerivedWeightInCond(), jnp.ones(3),
            control_flow=ControlFlowPolicy(etp_in_control_flow="exclude", **opaque))
    assert graph.hidden_param_op_relations == ()
    (excluded,) = graph.explain(kind=Kind.PRIMITIVE_INSIDE_CONTROL_FLOW)
    assert excluded.level is DiagnosticLevel.WARNING


@pytest.mark.parametrize("field", ["cond", "while_hidden", "etp_in_control_flow", "scan_descent"])
def test_bogus_policy_values_are_rejected(field: str) -> None:
    with pytest.raises(ValueError, match=f"ControlFlowPolicy.{field} must be"):
        ControlFlowPolicy(**{field: "bogus"})


def test_compiler_exports() -> None:
    import braintrace._compiler as compiler
    from braintrace._compiler import canonicalize

    for name in ("canonicalize_control_flow", "if_convert_conds", "unroll_inner_scans", "DEFAULT_CONTROL_FLOW_POLICY"):
        assert name in compiler.__all__ and getattr(compiler, name) is getattr(canonicalize, name)
    assert DEFAULT_CONTROL_FLOW_POLICY == ControlFlowPolicy()
    assert not hasattr(braintrace, "DEFAULT_CONTROL_FLOW_POLICY")
