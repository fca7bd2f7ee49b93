"""``while_loop`` policy: weight-free opaque-forward loops, the perturbation detach, the errors."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import ControlFlowPolicy, DiagnosticKind, DiagnosticLevel
from braintrace._compiler import diagnostic_context
from tests.compiler import control_flow_models as cf

Kind = DiagnosticKind


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn()


def _whiles(jaxpr: Any) -> list[Any]:
    return [e for e in jaxpr.eqns if e.primitive.name == "while"]


def test_settle_model_compiles_with_one_relation() -> None:
    with pytest.warns(UserWarning, match="detached"):
        graph = braintrace.compile_etrace_graph(cf.SettleModel(), jnp.ones(3))
    (rel,) = graph.hidden_param_op_relations
    assert rel.trainable_paths == {"weight": ("w",)}
    assert any(e.primitive.name == "while" for e in rel.y_to_hidden_group_jaxprs[0].eqns)
    assert [(r.kind, r.level) for r in graph.diagnostics] == [
        (Kind.CONTROL_FLOW_OPAQUE_FWD, DiagnosticLevel.INFO),
        (Kind.RELATION_INCLUDED, DiagnosticLevel.INFO),
        (Kind.CONTROL_FLOW_OPAQUE_FWD, DiagnosticLevel.INFO),
        (Kind.CONTROL_FLOW_OPAQUE_FWD, DiagnosticLevel.WARNING),
    ]
    group_pass, _, perturb_pass, detach = graph.diagnostics
    assert group_pass.context["evaluator"] != perturb_pass.context["evaluator"]
    assert group_pass.hidden_paths == (("h",),) and group_pass.context["op_name"] == "while"
    (while_eqn,) = _whiles(graph.module_info.jaxpr)
    n_vars = sum(isinstance(a, jax.extend.core.Var) and not isinstance(a, jax.extend.core.Literal)
                 for a in while_eqn.invars)
    assert detach.context == {"site": "perturbation", "n_detached": n_vars}


def _group_jacobian(graph: Any, x: Any, h: Any) -> tuple[Any, Any]:
    """The group's transition output and ``D`` at hidden value ``h`` (inputs read off the step)."""
    (group,) = graph.hidden_groups
    minfo = graph.module_info
    state_vals = [h if isinstance(st, brainstate.HiddenState) else st.value for st in minfo.compiled_model_states]
    temps = minfo.jaxpr_call(x, old_state_vals=state_vals)[3]
    inputs = [temps[v] for v in group.transition_jaxpr_constvars]
    return group.transition([h], inputs)[0], group.diagonal_jacobian([h], inputs)


def test_transition_and_jacobian_match_the_twin() -> None:
    x, h = jnp.array([0.3, -0.2, 0.5]), jnp.array([0.1, -0.4, 0.2, 0.7])
    models = [cf.SettleModel(), cf.SettleModel(flat=True)]
    got, want = [_group_jacobian(_quiet(lambda m=m: braintrace.compile_etrace_graph(m, x)), x, h) for m in models]
    assert any(e.primitive.name == "while"
               for e in _quiet(lambda: braintrace.compile_etrace_graph(models[0], x)).hidden_groups[0].transition_jaxpr.eqns)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    # Relaxing n = 6 times towards 0.8 h + drive: dh'/dh = 0.5^6 + 0.8 (1 - 0.5^6) per position.
    np.testing.assert_allclose(got[1][..., 0, 0], 0.5 ** 6 + 0.8 * (1 - 0.5 ** 6), rtol=1e-6)


def test_perturbed_step_detaches_the_loop_and_stays_differentiable() -> None:
    graph = _quiet(lambda: braintrace.compile_etrace_graph(cf.SettleModel(), jnp.ones(3)))
    assert graph.hidden_perturb is not None
    perturbed = graph.hidden_perturb.perturb_jaxpr.jaxpr
    (while_eqn,) = _whiles(perturbed)
    stops = [e for e in perturbed.eqns if e.primitive.name == "stop_gradient"]
    var_inputs = [a for a in while_eqn.invars if not isinstance(a, jax.extend.core.Literal)]
    assert len(stops) == len(var_inputs) and {e.outvars[0] for e in stops} == set(var_inputs)
    minfo = graph.module_info
    flat = jax.tree.leaves(((jnp.array([0.3, -0.2, 0.5]),), [st.value for st in minfo.compiled_model_states]))
    zero = graph.hidden_perturb.init_perturb_data()
    plain = jax.core.eval_jaxpr(minfo.jaxpr, minfo.closed_jaxpr.consts, *flat)
    shifted = graph.hidden_perturb.eval_jaxpr(flat, zero)
    for a, b in zip(plain, shifted):
        np.testing.assert_allclose(a, b)

    def loss(p: Any) -> Any:
        return jnp.sum(graph.hidden_perturb.eval_jaxpr(flat, p)[0] ** 2)

    (g,) = jax.grad(loss)(zero)  # reverse mode no longer enters the loop
    assert g.shape == (4,) and bool(jnp.all(jnp.isfinite(g)))


class SideWhile(brainstate.nn.Module):
    """A weight-free while computing a non-hidden input; the hidden update is ordinary."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.3 * jnp.ones((3, 4)))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        s, _ = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (0.5 * c[0] + 1.0, c[1] + 1), (x, 0))
        self.h.value = 0.9 * self.h.value + braintrace.matmul(s, self.w.value)
        return self.h.value


def test_non_hidden_whiles_are_untouched() -> None:
    graph = _quiet(lambda: braintrace.compile_etrace_graph(SideWhile(), jnp.ones(3)))
    (original,) = _whiles(graph.module_info.jaxpr)
    assert graph.hidden_perturb is not None
    perturbed = graph.hidden_perturb.perturb_jaxpr.jaxpr
    assert any(e is original for e in perturbed.eqns)
    assert not [e for e in perturbed.eqns if e.primitive.name == "stop_gradient"]
    assert not graph.explain(kind=Kind.CONTROL_FLOW_OPAQUE_FWD)


def test_while_hidden_error_policy_raises_in_both_passes() -> None:
    policy = ControlFlowPolicy(while_hidden="error")
    minfo = braintrace.extract_module_info(cf.SettleModel(), jnp.ones(3), control_flow=policy)
    with pytest.raises(NotImplementedError, match="hidden states are computed within a while"):
        braintrace.find_hidden_groups_from_minfo(minfo)
    with pytest.raises(NotImplementedError, match="hidden states are computed within a while"):
        braintrace.add_hidden_perturbation_from_minfo(minfo)
    with pytest.raises(NotImplementedError):
        braintrace.compile_etrace_graph(cf.SettleModel(), jnp.ones(3), control_flow=policy)


def test_weight_in_while_is_an_error() -> None:
    minfo = braintrace.extract_module_info(cf.WeightInWhile(), jnp.ones(4))
    with diagnostic_context() as reporter, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an ERROR record, not a Python warning
        with pytest.raises(braintrace.NotSupportedError,
                           match=r"inside a while_loop at .*control_flow_models.py:\d+.*"
                                 r"fori_loop with static bounds, or lax.scan"):
            braintrace.find_hidden_groups_from_minfo(minfo)
    (rec,) = reporter.records()
    assert rec.kind is Kind.WEIGHT_IN_WHILE and rec.level is DiagnosticLevel.ERROR
    with pytest.raises(braintrace.NotSupportedError, match="while_loop"):
        braintrace.compile_etrace_graph(cf.WeightInWhile(), jnp.ones(4))


class MixingWhile(brainstate.nn.Module):
    """A weight-free while that mixes the hidden state with a fixed matrix (through a jitted helper)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.3 * jnp.ones((3, 4)))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        mix = jax.jit(lambda v: v @ (0.2 * jnp.eye(4) + 0.05))
        drive = braintrace.matmul(x, self.w.value)
        self.h.value, _ = jax.lax.while_loop(
            lambda c: c[1] < 3, lambda c: (jnp.tanh(mix(c[0]) + drive), c[1] + 1), (self.h.value, 0))
        return self.h.value


def test_mixing_inside_a_while_falls_back_to_zero_recurrence() -> None:
    minfo = braintrace.extract_module_info(MixingWhile(), jnp.ones(3))
    with pytest.warns(UserWarning, match="mixes hidden-state values"):
        (group,), _ = braintrace.find_hidden_groups_from_minfo(minfo)
    assert group.transition_jaxpr.eqns == []
    with diagnostic_context() as reporter, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        (mixed,), _ = braintrace.find_hidden_groups_from_minfo(minfo, include_recurrent_mixing=True)
    assert not [r for r in reporter.records() if r.kind is Kind.CONTROL_FLOW_RECURRENT_MIXING]
    assert any(e.primitive.name == "while" for e in mixed.transition_jaxpr.eqns)
