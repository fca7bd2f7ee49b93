"""The hidden perturbation: unchanged values at zero, ``∂L/∂p_h = ∂L/∂h^t``."""

from __future__ import annotations

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

import braintrace
from tests.compiler import models


def _flat_inputs(graph: Any, x: Any) -> list:
    minfo = graph.module_info
    return jax.tree.leaves(((x,), [st.value for st in minfo.compiled_model_states]))


def test_zero_perturbation_leaves_every_output_unchanged(quiet: list) -> None:
    graph = braintrace.compile_etrace_graph(models.LSTM(), jnp.ones(3))
    x = jnp.linspace(-1, 1, 3)
    flat = _flat_inputs(graph, x)
    minfo = graph.module_info
    plain = jax.core.eval_jaxpr(minfo.jaxpr, minfo.closed_jaxpr.consts, *flat)
    pert = graph.hidden_perturb.eval_jaxpr(flat, graph.hidden_perturb.init_perturb_data())
    for a, b in zip(plain, pert):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_gradient_wrt_the_perturbation_is_the_gradient_wrt_the_hidden_state(quiet: list) -> None:
    model = models.LeakyRNN()
    graph = braintrace.compile_etrace_graph(model, jnp.ones(3))
    pert = graph.hidden_perturb
    x = jnp.linspace(-1, 1, 3)
    flat = _flat_inputs(graph, x)
    n_out = graph.module_info.num_var_out

    def loss(p: Any) -> Any:
        return jnp.sum(jnp.sin(pert.eval_jaxpr(flat, p)[0]))

    (g,) = jax.grad(loss)(pert.init_perturb_data())
    h = graph.module_info.jaxpr_call(x)[1][("h",)]
    np.testing.assert_allclose(g, jnp.cos(h), rtol=1e-6)  # the output is h itself
    assert n_out == 1


def test_two_hidden_outputs_of_one_equation_are_both_perturbed(quiet: list) -> None:
    class Split(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.W = models._w(60, (3, 4))
            self.a = brainstate.HiddenState(jnp.zeros(2))
            self.b = brainstate.HiddenState(jnp.zeros(2))

        def update(self, x: Any) -> Any:
            y = braintrace.matmul(x, self.W.value)
            a, b = jnp.split(y + jnp.concatenate([self.a.value, self.b.value]), 2)
            self.a.value, self.b.value = a, b
            return a + b

    graph = braintrace.compile_etrace_graph(Split(), jnp.ones(3))
    pert = graph.hidden_perturb
    assert pert.perturb_hidden_paths == [("a",), ("b",)]
    flat = _flat_inputs(graph, jnp.ones(3))
    shifted = pert.eval_jaxpr(flat, [jnp.full(2, 1.0), jnp.full(2, 10.0)])
    base = pert.eval_jaxpr(flat, pert.init_perturb_data())
    np.testing.assert_allclose(shifted[0] - base[0], jnp.full(2, 11.0), rtol=1e-6)


def test_read_only_hidden_state_is_shifted_only_in_the_outputs(quiet: list) -> None:
    class ReadOnly(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.W = models._w(61, (3, 2))
            self.h = brainstate.HiddenState(jnp.zeros(2))
            self.c = brainstate.HiddenState(jnp.ones(2))

        def update(self, x: Any) -> Any:
            self.h.value = 0.5 * self.h.value + self.c.value * braintrace.matmul(x, self.W.value)
            return self.h.value

    graph = braintrace.compile_etrace_graph(ReadOnly(), jnp.ones(3))
    pert = graph.hidden_perturb
    flat = _flat_inputs(graph, jnp.ones(3))
    idx = pert.perturb_hidden_paths.index(("c",))
    data = pert.init_perturb_data()
    data[idx] = jnp.full(2, 3.0)
    out = pert.eval_jaxpr(flat, data)
    base = pert.eval_jaxpr(flat, pert.init_perturb_data())
    np.testing.assert_allclose(out[0], base[0], rtol=1e-6)  # in-step reads see c unperturbed
    minfo = graph.module_info
    c_pos = minfo.jaxpr.outvars.index(minfo.hidden_path_to_outvar[("c",)])
    np.testing.assert_allclose(out[c_pos] - base[c_pos], 3.0)


def test_graph_call_hidden_perturb_matches_the_step(quiet: list) -> None:
    model = models.GRU()
    graph = braintrace.compile_etrace_graph(model, jnp.ones(3))
    x = jnp.linspace(-1, 1, 3)
    out, hidden, _, temps = graph.call_hidden_perturb((x,), graph.hidden_perturb.init_perturb_data())
    np.testing.assert_allclose(out, model(x), rtol=1e-6)
    assert set(temps) >= set(graph.hidden_groups[0].transition_jaxpr_constvars)
