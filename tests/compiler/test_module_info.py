"""``extract_module_info``: state tables, misuse errors, and user-jit inlining."""

from __future__ import annotations

from typing import Any

import brainstate
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import DiagnosticKind, NotSupportedError
from braintrace._compiler.diagnostics import diagnostic_context
from tests.compiler import models


def test_tables_of_a_gru() -> None:
    minfo = braintrace.extract_module_info(models.GRU(), jnp.ones(3))
    assert list(minfo.hidden_path_to_invar) == [("h",)]
    assert list(minfo.weight_path_to_invars) == [("Wh",), ("Wr",), ("Wz",)] or set(minfo.weight_path_to_invars) == {("Wh",), ("Wr",), ("Wz",)}
    for path, leaves in minfo.weight_path_to_invars.items():
        assert len(leaves) == 2 and all(minfo.invar_to_weight_path[v] == path for v in leaves)
    h_in, h_out = minfo.hidden_path_to_invar[("h",)], minfo.hidden_path_to_outvar[("h",)]
    assert minfo.hidden_outvar_to_invar == {h_out: h_in}
    assert minfo.num_var_out == 1 and minfo.num_var_state == 7
    assert minfo.control_flow == braintrace.ControlFlowPolicy()


def test_jaxpr_call_reproduces_the_model_step() -> None:
    model = models.LeakyRNN()
    minfo = braintrace.extract_module_info(model, jnp.ones(3))
    x = jnp.linspace(-1, 1, 3)
    out, hidden, others, temps = minfo.jaxpr_call(x)
    np.testing.assert_allclose(out, model(x), rtol=1e-6)
    np.testing.assert_allclose(hidden[("h",)], model.h.value, rtol=1e-6)
    assert others == {}


def test_a_written_param_state_is_not_supported() -> None:
    with pytest.raises(NotSupportedError, match=r"\('W',\).*written"):
        braintrace.extract_module_info(models.WritesWeight(), jnp.ones(3))


def test_a_non_module_is_rejected() -> None:
    with pytest.raises(TypeError, match="brainstate.nn.Module"):
        braintrace.extract_module_info(lambda x: x, jnp.ones(3))  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        braintrace.compile_etrace_graph(object(), jnp.ones(3))  # type: ignore[arg-type]


def test_a_bad_control_flow_argument_is_rejected() -> None:
    with pytest.raises(TypeError, match="ControlFlowPolicy"):
        braintrace.extract_module_info(models.LeakyRNN(), jnp.ones(3), control_flow="opaque")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scan_descent"):
        braintrace.ControlFlowPolicy(scan_descent="x")
    with pytest.raises(ValueError, match="cond"):
        braintrace.ControlFlowPolicy(cond="maybe")


def test_untouched_states_are_reported(quiet: list) -> None:
    class Unused(models.LeakyRNN):
        def __init__(self) -> None:
            super().__init__()
            self.spare = brainstate.ParamState(jnp.ones(2))

    with diagnostic_context() as reporter:
        minfo = braintrace.extract_module_info(Unused(), jnp.ones(3))
    (rec,) = reporter.records()
    assert rec.kind is DiagnosticKind.STATE_MISMATCH and rec.context["direction"] == "retrieved_not_in_compiled"
    assert ("spare",) not in minfo.retrieved_model_states
    assert any("spare" in str(w.message) for w in quiet)


def test_user_jit_is_transparent() -> None:
    minfo = braintrace.extract_module_info(models.JitInside(), jnp.ones(3))
    names = [e.primitive.name for e in minfo.jaxpr.eqns]
    assert "jit" not in names and "etp_mv" in names


def test_units_of_states_must_not_change() -> None:
    import brainunit as u

    class Drift(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = brainstate.HiddenState(jnp.zeros(2) * u.mV)

        def update(self, x: Any) -> Any:
            self.h.value = self.h.value.mantissa * u.second + x * u.second
            return x

    with pytest.raises(ValueError):
        braintrace.extract_module_info(Drift(), jnp.ones(2))


class SharedNewValue(brainstate.nn.Module):
    """``prev`` and ``copy`` set to ``h``'s new value, ``old`` twice to ``h``'s previous one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.ones((3, 2)))
        for name in ("h", "prev", "copy", "old", "old_too"):
            setattr(self, name, brainstate.HiddenState(jnp.zeros(2)))

    def update(self, x: Any) -> Any:
        self.old.value = self.h.value
        self.old_too.value = self.h.value
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
        self.prev.value = self.h.value
        self.copy.value = self.h.value
        return self.prev.value


def test_every_hidden_state_gets_its_own_new_value_variable() -> None:
    model = SharedNewValue()
    minfo = braintrace.extract_module_info(model, jnp.ones(3))
    outs = minfo.hidden_path_to_outvar
    assert len({id(v) for v in outs.values()}) == 5
    assert minfo.outvar_to_hidden_path == {v: p for p, v in outs.items()}
    assert list(minfo.hidden_outvar_to_invar) == list(outs.values())
    producers = {v: e for e in minfo.jaxpr.eqns for v in e.outvars}
    # The first state writing a variable keeps it; each later one is a copy of it.
    assert outs[("old",)] is minfo.hidden_path_to_invar[("h",)]
    assert [producers[outs[p]].primitive.name for p in [("old_too",), ("prev",), ("copy",)]] == ["copy"] * 3
    assert producers[outs[("old_too",)]].invars == [outs[("old",)]]
    assert producers[outs[("prev",)]].invars == producers[outs[("copy",)]].invars == [outs[("h",)]]
    x = jnp.array([0.2, -0.4, 1.0])
    _, hidden, _, _ = minfo.jaxpr_call(x)
    out = model(x)
    for path in outs:
        np.testing.assert_allclose(hidden[path], getattr(model, path[0]).value)
    np.testing.assert_allclose(hidden[("prev",)], out)


def test_states_sharing_a_new_value_are_each_perturbed() -> None:
    graph = braintrace.compile_etrace_graph(SharedNewValue(), jnp.ones(3))
    assert graph.hidden_perturb is not None
    paths = {("h",), ("prev",), ("copy",), ("old",), ("old_too",)}
    assert set(graph.hidden_perturb.perturb_hidden_paths) == paths
    assert {p for g in graph.hidden_groups for p in g.hidden_paths} == paths
