"""Structured scan descent: blockers, ``add_scan_ys``, bundle contents and the compiled graph."""

from __future__ import annotations

import doctest
import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Jaxpr

import braintrace
from braintrace import ControlFlowPolicy, DiagnosticKind, DiagnosticLevel
from braintrace._compatible_imports import scan_params, split_jaxpr_invars
from braintrace._compiler import diagnostic_context, scan_descent
from braintrace._compiler.hid_param_op import tail_constvars
from braintrace._compiler.jaxpr_graph import new_jaxpr, subjaxprs
from braintrace._compiler.scan_descent import (
    ScanDescentInfo,
    _descent_blockers,
    _is_etp_relevant,
    add_scan_ys,
    apply_scan_descent,
)
from tests.compiler import control_flow_models as cf

Kind = DiagnosticKind


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn()


def _records(fn: Callable[[], Any]) -> tuple[Any, tuple[Any, ...]]:
    with diagnostic_context() as reporter:
        result = _quiet(fn)
    return result, reporter.records()


def _count_eqns(jaxpr: Jaxpr) -> int:
    return sum(1 + sum(_count_eqns(s) for s in subjaxprs(e)) for e in jaxpr.eqns)


def _scan_eqns(jaxpr: Jaxpr) -> list[Any]:
    return [e for e in jaxpr.eqns if e.primitive.name == "scan"]


def test_long_inner_loop_compiles_to_a_small_graph() -> None:
    graph = _quiet(lambda: braintrace.compile_etrace_graph(
        cf.SubstepModel(length=100, api="for_loop"), jnp.ones(3)))
    assert _count_eqns(graph.module_info.jaxpr) < 60
    assert graph.hidden_perturb is not None and _count_eqns(graph.hidden_perturb.perturb_jaxpr.jaxpr) < 60
    assert [(r.kind, r.level) for r in graph.diagnostics] == [
        (Kind.SCAN_UNROLL_SKIPPED, DiagnosticLevel.INFO),
        (Kind.RELATION_INCLUDED, DiagnosticLevel.INFO),
        (Kind.RELATION_INCLUDED, DiagnosticLevel.INFO),
        (Kind.SCAN_DESCENT_APPLIED, DiagnosticLevel.INFO),
    ]
    (applied,) = graph.explain(kind=Kind.SCAN_DESCENT_APPLIED)
    assert applied.hidden_paths == (("h",),)
    assert applied.context == {"length": 100, "weight_paths": [("tau",), ("w",)]}
    (group,) = graph.hidden_groups
    assert group.index == 0 and group.descent is not None and graph.hid_path_to_group[("h",)] is group
    assert all(r.control_flow_context is not None and r.hidden_groups == [group] for r in graph.hidden_param_op_relations)
    (scan,) = _scan_eqns(graph.module_info.jaxpr)
    assert id(scan) == group.descent.scan.scan_eqn_id


def test_bundle_contents() -> None:
    minfo = _quiet(lambda: braintrace.extract_module_info(cf.SubstepModel(length=20), jnp.ones(3)))
    (old,) = _scan_eqns(minfo.jaxpr)
    new_minfo, (bundle,) = _records(lambda: apply_scan_descent(minfo))[0]
    info: ScanDescentInfo = bundle.info
    (new,) = _scan_eqns(new_minfo.jaxpr)
    assert new is bundle.new_eqn and info.scan_eqn_id == id(new)
    assert new.outvars[:len(old.outvars)] == old.outvars and new.outvars[len(old.outvars):] == bundle.stacked_outer_vars
    assert (info.length, info.num_consts, info.num_carry) == (20, scan_params(old).num_consts, scan_params(old).num_carry)
    assert scan_params(new).length == 20 and scan_params(new).num_carry == scan_params(old).num_carry
    assert info.body_jaxpr is scan_params(new).body.jaxpr
    body_vars = set(info.body_jaxpr.invars) | {v for e in info.body_jaxpr.eqns for v in e.outvars}
    needed = []
    for rel in bundle.relations:
        needed += [rel.y_var, *tail_constvars(rel.y_to_hidden_group_jaxprs[0])] + ([rel.x_var] if rel.x_var is not None else [])
    (group,) = bundle.groups
    needed += [*group.descent.body_hidden_invars, *group.transition_jaxpr_constvars]
    for v in needed:
        assert v in body_vars and v in info.stacked_var_map
        assert info.stacked_var_map[v].aval.shape == (20, *v.aval.shape)
    assert set(info.stacked_var_map.values()) == set(bundle.stacked_outer_vars)
    # Groups are named by the scan's outer carries, the transition stays body-scoped.
    assert group.hidden_invars == [minfo.hidden_path_to_invar[("h",)]]
    assert group.hidden_outvars == [minfo.hidden_path_to_outvar[("h",)]]
    assert split_jaxpr_invars(group.transition_jaxpr, len(group.hidden_invars))[1] == group.descent.body_hidden_invars
    assert all(r.hidden_groups == [group] and r.control_flow_context.scan is info for r in bundle.relations)


def test_add_scan_ys_stacks_every_substep_value() -> None:
    def fn(h: Any, xs: Any) -> Any:
        return jax.lax.scan(lambda h, x: (0.5 * h + x, None), h, xs)[0]

    closed = jax.make_jaxpr(fn)(jnp.ones(2), jnp.ones((4, 2)))
    (eqn,) = closed.jaxpr.eqns
    body = scan_params(eqn).body.jaxpr
    carry_in, x_in = body.invars
    (new_h,) = body.outvars
    new, stacked = add_scan_ys(eqn, [carry_in, x_in, carry_in, new_h])
    assert len(stacked) == 3 and [v.aval.shape for v in stacked] == [(4, 2)] * 3
    assert new.outvars == [*eqn.outvars, *stacked]
    program = new_jaxpr([], closed.jaxpr.invars, new.outvars, [new])
    h0, xs = jnp.array([1.0, 2.0]), jnp.arange(8.0).reshape(4, 2)
    final, before, inputs, after = jax.core.eval_jaxpr(program, [], h0, xs)
    expected = [h0]
    for x in xs:
        expected.append(0.5 * expected[-1] + x)
    np.testing.assert_allclose(before, jnp.stack(expected[:-1]))
    np.testing.assert_allclose(inputs, xs)
    np.testing.assert_allclose(after, jnp.stack(expected[1:]))
    np.testing.assert_allclose(final, expected[-1])
    with pytest.raises(ValueError, match="expected a scan"):
        add_scan_ys(closed.jaxpr.eqns[0].replace(primitive=jax.lax.add_p), [])


# --- blockers -------------------------------------------------------------------------------


class LongLoop(brainstate.nn.Module):
    """A 20-substep ETP loop whose shape the test picks (reverse, a cond inside, weight as xs, ...)."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.w = brainstate.ParamState(0.3 * jax.random.normal(jax.random.PRNGKey(0), (20, 4)))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        v, w = self.variant, self.w.value
        if v == "weight_xs":
            self.h.value, _ = jax.lax.scan(
                lambda h, row: (0.9 * h + braintrace.element_wise(row) * x[0], None), self.h.value, w)
            return self.h.value

        def drive(k: Any) -> Any:
            y = braintrace.matmul(jnp.full((20,), x[0]), w)
            if v == "nested_cond":
                y = jax.lax.cond(k > 3, lambda y: y, lambda y: 2.0 * y, y)
            return y

        def body(h: Any, k: Any) -> Any:
            return 0.9 * h + 0.1 * drive(k), None

        init = 0.5 * self.h.value if v == "transformed_init" else self.h.value
        self.h.value, _ = jax.lax.scan(body, init, jnp.arange(20), reverse=v == "reverse")
        return self.h.value


@pytest.mark.parametrize(
    "variant, blocker",
    [
        ("reverse", "the scan runs in reverse"),
        ("nested_cond", "its body contains control flow (cond)"),
        ("weight_xs", "a trainable weight is scanned over as xs"),
        ("transformed_init", "carry initialized from a transformed value"),
    ],
)
def test_blocked_descent_warns_and_keeps_the_error(variant: str, blocker: str) -> None:
    minfo = _quiet(lambda: braintrace.extract_module_info(LongLoop(variant), jnp.ones(3)))
    with diagnostic_context() as reporter, pytest.warns(UserWarning, match="descen"):
        same, bundles = apply_scan_descent(minfo)
    assert same is minfo and bundles == []
    (skipped,) = [r for r in reporter.records() if r.kind is Kind.SCAN_DESCENT_SKIPPED]
    assert skipped.level is DiagnosticLevel.WARNING
    assert skipped.context == {"blocker": blocker, "length": 20}
    with pytest.raises(NotImplementedError):
        _quiet(lambda: braintrace.compile_etrace_graph(LongLoop(variant), jnp.ones(3)))


def test_blocker_reasons() -> None:
    minfo = _quiet(lambda: braintrace.extract_module_info(LongLoop("plain"), jnp.ones(3)))
    (eqn,) = _scan_eqns(minfo.jaxpr)
    assert _is_etp_relevant(eqn, minfo) and _descent_blockers(eqn, minfo) is None
    wide = minfo._replace(control_flow=ControlFlowPolicy(scan_unroll_limit=20))
    assert _descent_blockers(eqn, wide) == "the unroll path handles it"
    off = minfo._replace(control_flow=ControlFlowPolicy(scan_descent="off"))
    assert "disabled" in (_descent_blockers(eqn, off) or "")
    assert apply_scan_descent(off) == (off, [])


def test_descent_off_keeps_the_error() -> None:
    policy = ControlFlowPolicy(scan_descent="off")
    with pytest.warns(UserWarning, match="not unrolled"), pytest.raises(NotImplementedError):
        braintrace.compile_etrace_graph(cf.SubstepModel(length=20), jnp.ones(3), control_flow=policy)


class OuterDrive(brainstate.nn.Module):
    """The ETP drive is computed before a descended loop that integrates it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.3 * jnp.ones((3, 4)))
        self.tau = brainstate.ParamState(jnp.ones(4))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        drive = braintrace.matmul(x, self.w.value)

        def body(h: Any, _: Any) -> Any:
            return braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid) * h + 0.1 * drive, None

        self.h.value, _ = jax.lax.scan(body, self.h.value, None, length=20)
        return self.h.value


def test_outer_relation_into_a_descended_group_raises() -> None:
    with pytest.raises(NotImplementedError, match="move the operation inside the scan body"):
        _quiet(lambda: braintrace.compile_etrace_graph(OuterDrive(), jnp.ones(3)))


class BodyVariants(brainstate.nn.Module):
    """A descended body with a plain-JAX weight (``'plain'``) or one weight used twice (``'tied'``)."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.w = brainstate.ParamState(0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 4)))
        self.w2 = brainstate.ParamState(0.3 * jnp.ones((4, 4)))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        def body(h: Any, _: Any) -> Any:
            if self.variant == "tied":
                return jnp.tanh(braintrace.matmul(x, self.w.value) + braintrace.matmul(h, self.w.value)), None
            return 0.9 * h + 0.1 * braintrace.matmul(x, self.w.value) + 0.01 * (x @ self.w2.value), None

        self.h.value, _ = jax.lax.scan(body, self.h.value, None, length=20)
        return self.h.value


def test_plain_weight_in_a_descended_body_warns() -> None:
    with pytest.warns(UserWarning, match="do not learn online"):
        graph = braintrace.compile_etrace_graph(BodyVariants("plain"), jnp.ones(4))
    (rec,) = graph.explain(kind=Kind.SCAN_DESCENT_NO_RELATIONS)
    assert rec.level is DiagnosticLevel.WARNING and rec.context == {"weight_paths": [("w2",)]}
    assert [r.trainable_paths for r in graph.hidden_param_op_relations] == [{"weight": ("w",)}]


def test_tied_weight_in_a_descended_body_gives_two_relations() -> None:
    graph = _quiet(lambda: braintrace.compile_etrace_graph(BodyVariants("tied"), jnp.ones(4)))
    assert [r.trainable_paths for r in graph.hidden_param_op_relations] == [{"weight": ("w",)}] * 2
    assert graph.explain(kind=Kind.SCAN_DESCENT_APPLIED)


class FlatAndDescended(brainstate.nn.Module):
    """``g`` is updated outside any loop; ``h`` by a descended loop."""

    def __init__(self) -> None:
        super().__init__()
        self.v = brainstate.ParamState(0.3 * jnp.ones((3, 4)))
        self.w = brainstate.ParamState(0.2 * jnp.ones((3, 4)))
        self.g = brainstate.HiddenState(jnp.zeros(4))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        self.g.value = 0.5 * self.g.value + braintrace.matmul(x, self.v.value)

        def body(h: Any, _: Any) -> Any:
            return 0.9 * h + 0.1 * braintrace.matmul(x, self.w.value), None

        self.h.value, _ = jax.lax.scan(body, self.h.value, None, length=20)
        return self.g.value + self.h.value


def test_descended_groups_follow_the_flat_ones() -> None:
    graph = _quiet(lambda: braintrace.compile_etrace_graph(FlatAndDescended(), jnp.ones(3)))
    flat, descended = graph.hidden_groups
    assert (flat.index, flat.hidden_paths, flat.descent) == (0, [("g",)], None)
    assert (descended.index, descended.hidden_paths) == (1, [("h",)]) and descended.descent is not None
    assert graph.hid_path_to_group == {("g",): flat, ("h",): descended}
    first, second = graph.hidden_param_op_relations
    assert first.trainable_paths == {"weight": ("v",)} and first.hidden_groups == [flat]
    assert first.control_flow_context is None
    assert second.trainable_paths == {"weight": ("w",)} and second.hidden_groups == [descended]


class HiddenOnlyLoop(brainstate.nn.Module):
    """A long loop that touches only the hidden state (the weight is applied before it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.3 * jnp.ones((3, 4)))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        h = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
        self.h.value, _ = jax.lax.scan(lambda h, _: (0.99 * h, None), h, None, length=20)
        return self.h.value


def test_hidden_only_loop_stays_an_opaque_forward_node() -> None:
    graph = _quiet(lambda: braintrace.compile_etrace_graph(HiddenOnlyLoop(), jnp.ones(3)))
    (skip,) = graph.explain(kind=Kind.SCAN_UNROLL_SKIPPED)
    assert skip.level is DiagnosticLevel.INFO
    assert not [r for r in graph.diagnostics if r.kind.value.startswith("scan_descent")]
    assert graph.explain(kind=Kind.CONTROL_FLOW_OPAQUE_FWD)
    (rel,) = graph.hidden_param_op_relations
    assert rel.control_flow_context is None and graph.hidden_groups[0].descent is None


@pytest.mark.slow
def test_module_docstring_example_runs() -> None:
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(scan_descent, "braintrace._compiler.scan_descent") if t.examples]
    assert tests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for test in tests:
            runner.run(test)
    assert runner.failures == 0
