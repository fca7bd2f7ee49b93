"""The compiler's 0.2.5 surface: the fixpoint limit, explicit hidden-value checks, jaxpr input helpers."""

from __future__ import annotations

import re
import types
import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import CompilationError, ControlFlowPolicy, DiagnosticKind
from braintrace._compatible_imports import jaxpr_all_invars, jaxpr_constvars, split_jaxpr_invars
from braintrace._compiler import canonicalize_control_flow, diagnostic_context

W = 0.2 * jax.random.normal(jax.random.PRNGKey(0), (3, 3))


class CondInScan(brainstate.nn.Module):
    """A short scan whose body branches on the input: unrolling exposes conds (two sweeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(W)
        self.h = brainstate.HiddenState(jnp.zeros(3))

    def update(self, x: jax.Array) -> jax.Array:
        w = self.w.value

        def body(h: jax.Array, _: Any) -> tuple[jax.Array, None]:
            h = jax.lax.cond(x.sum() > 0, lambda h: 0.5 * h + braintrace.matmul(x, w), lambda h: 0.9 * h, h)
            return h, None

        self.h.value = jax.lax.scan(body, self.h.value, None, length=2)[0]
        return self.h.value


class Coupled(brainstate.nn.Module):
    """Two hidden states reading each other: one group with two members."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(W)
        self.a = brainstate.HiddenState(jnp.zeros(3))
        self.b = brainstate.HiddenState(jnp.zeros(3))

    def update(self, x: jax.Array) -> jax.Array:
        a, b = self.a.value, self.b.value
        self.a.value = 0.5 * a + 0.1 * b + braintrace.matmul(x, self.w.value)
        self.b.value = 0.9 * b + 0.2 * a
        return self.a.value + self.b.value


def _graph(model: brainstate.nn.Module, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile_etrace_graph(model, jnp.ones(3), **options)


def _primitive_names(graph: Any) -> list[str]:
    return [e.primitive.name for e in graph.module_info.jaxpr.eqns]


# --- ControlFlowPolicy.fixpoint_iteration_limit --------------------------------------------


def test_fixpoint_limit_defaults_to_64() -> None:
    assert ControlFlowPolicy().fixpoint_iteration_limit == 64


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "64", None])
def test_fixpoint_limit_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"fixpoint_iteration_limit must be a positive int, got {bad!r}"):
        ControlFlowPolicy(fixpoint_iteration_limit=bad)


def test_exhausted_limit_names_the_pending_conds_and_the_remedies() -> None:
    policy = ControlFlowPolicy(fixpoint_iteration_limit=1)
    with pytest.raises(CompilationError) as err:
        _graph(CondInScan(), control_flow=policy)
    message = str(err.value)
    assert "fixpoint_iteration_limit=1" in message
    assert "cond with 2 branches at" in message and "test_adopt_0_2_5.py" in message
    assert "(2 equations)" in message  # one cond per unrolled iteration
    assert "cond='opaque'" in message and "scan_unroll_limit=0" in message


def test_exhausted_limit_names_a_pending_scan_with_its_length() -> None:
    def step(w: jax.Array, h: jax.Array) -> jax.Array:
        def inner(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return jax.lax.scan(lambda c, _: (0.5 * c + w, None), c, None, length=3)[0], None

        return jax.lax.scan(inner, h, None, length=2)[0]  # unrolling it exposes two inner scans

    closed = jax.make_jaxpr(step)(jnp.ones(2), jnp.ones(2))
    w, h = closed.jaxpr.invars
    with pytest.raises(CompilationError, match=r"scan of length 3 at .*test_adopt_0_2_5\.py.*\(2 equations\)"):
        canonicalize_control_flow(closed, weight_invars=[w], hidden_invars=[h], hidden_outvars=[],
                                  policy=ControlFlowPolicy(fixpoint_iteration_limit=1))


def test_a_limit_that_covers_the_rewrites_compiles_as_the_default() -> None:
    default = _graph(CondInScan())
    just_enough = _graph(CondInScan(), control_flow=ControlFlowPolicy(fixpoint_iteration_limit=2))
    assert _primitive_names(just_enough) == _primitive_names(default)
    assert not {"cond", "scan"} & set(_primitive_names(default))
    assert len(default.hidden_param_op_relations) == 2  # one per unrolled iteration


def test_warnings_about_kept_control_flow_come_from_the_settling_sweep_once() -> None:
    def step(p: jax.Array, w: jax.Array, h: jax.Array) -> jax.Array:
        kept = jax.lax.scan(lambda c, _: (0.5 * c + w, None), h, None, length=40)[0]  # too long
        return jax.lax.cond(p, lambda h: h * w, lambda h: h + w, kept)  # converted in sweep 1

    closed = jax.make_jaxpr(step)(True, jnp.ones(2), jnp.ones(2))
    _, w, h = closed.jaxpr.invars
    with diagnostic_context() as reporter, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        canonicalize_control_flow(closed, weight_invars=[w], hidden_invars=[h], hidden_outvars=[])
    kinds = [r.kind for r in reporter.records()]
    assert kinds.count(DiagnosticKind.COND_IF_CONVERTED) == 1
    assert kinds.count(DiagnosticKind.SCAN_UNROLL_SKIPPED) == 1


# --- hidden values and their cotangents --------------------------------------------------


def test_concat_hidden_needs_one_value_per_hidden_state() -> None:
    group = _graph(Coupled()).hidden_groups[0]
    a, b = jnp.arange(3.0), -jnp.arange(3.0)
    np.testing.assert_array_equal(group.split_hidden(group.concat_hidden([a, b]))[1], b)
    for values, count in (([a], 1), ([a, b, a], 3)):
        expected = rf"exactly one value per hidden state \(2, for \[\('a',\), \('b',\)\]\), got {count}"
        with pytest.raises(ValueError, match=expected):
            group.concat_hidden(values)


@pytest.mark.parametrize("shape", [(3, 3), (3,), ()])
def test_split_hidden_checks_the_trailing_width(shape: tuple[int, ...]) -> None:
    group = _graph(Coupled()).hidden_groups[0]
    with pytest.raises(ValueError, match=rf"num_state=2, got a value of shape {re.escape(str(shape))}"):
        group.split_hidden(jnp.ones(shape))


def test_perturbation_to_group_stacks_checked_values() -> None:
    graph = _graph(Coupled())
    perturb, groups = graph.hidden_perturb, graph.hidden_groups
    values = [jnp.arange(3.0), 10 + jnp.arange(3.0)]
    (stacked,) = perturb.perturb_data_to_hidden_group_data(values, groups)
    np.testing.assert_array_equal(stacked, jnp.stack(values, axis=-1))
    with pytest.raises(ValueError, match=r"one perturbation value per perturbed hidden state \(2, .*got 1"):
        perturb.perturb_data_to_hidden_group_data(values[:1], groups)
    with pytest.raises(ValueError, match=r"hidden state \('b',\) has shape \(4,\) .*expected shape \(3,\)"):
        perturb.perturb_data_to_hidden_group_data([values[0], jnp.ones(4)], groups)
    with pytest.raises(ValueError, match=r"hidden state \('a',\) has shape \(3,\) and dtype int32"):
        perturb.perturb_data_to_hidden_group_data([jnp.arange(3), values[1]], groups)


def test_perturbation_to_group_names_a_missing_path() -> None:
    graph = _graph(Coupled())
    stray = graph.hidden_groups[0]._replace(hidden_paths=[("a",), ("c",)])
    with pytest.raises(ValueError, match=r"Hidden group 0 has member\(s\) \[\('c',\)\] without a perturbation"):
        graph.hidden_perturb.perturb_data_to_hidden_group_data([jnp.ones(3), jnp.ones(3)], [stray])


# --- jaxpr input helpers -----------------------------------------------------------------


def test_split_jaxpr_invars_puts_constants_first() -> None:
    closed = jax.make_jaxpr(lambda a, b: a * b + W.sum())(1.0, 2.0)  # W is a constant input
    jaxpr = closed.jaxpr
    assert jaxpr_constvars(jaxpr) == list(jaxpr.constvars) and len(jaxpr.constvars) == 1
    assert jaxpr_all_invars(jaxpr) == [*jaxpr.constvars, *jaxpr.invars]
    assert split_jaxpr_invars(jaxpr, 2) == (list(jaxpr.constvars), list(jaxpr.invars))
    assert split_jaxpr_invars(jaxpr, 0) == (jaxpr_all_invars(jaxpr), [])
    assert split_jaxpr_invars(jaxpr, 3) == ([], jaxpr_all_invars(jaxpr))


def test_split_jaxpr_invars_reads_a_jaxpr_without_a_stored_split() -> None:
    jaxpr = _graph(Coupled()).hidden_groups[0].transition_jaxpr
    every = jaxpr_all_invars(jaxpr)
    symbol_only = types.SimpleNamespace(invars=every)  # constants lead the single input list
    assert jaxpr_constvars(symbol_only) == []
    assert split_jaxpr_invars(symbol_only, 2) == split_jaxpr_invars(jaxpr, 2)


def test_the_transition_split_is_the_groups_inputs() -> None:
    group = _graph(Coupled(), include_recurrent_mixing=True).hidden_groups[0]
    constvars, hidden = split_jaxpr_invars(group.transition_jaxpr, len(group.hidden_invars))
    assert constvars == group.transition_jaxpr_constvars and hidden == group.hidden_invars


@pytest.mark.parametrize("bad", [-1, 4, True, 1.0])
def test_split_jaxpr_invars_is_range_checked(bad: Any) -> None:
    jaxpr = jax.make_jaxpr(lambda a, b, c: a + b + c)(1.0, 2.0, 3.0).jaxpr
    with pytest.raises(ValueError, match=rf"n_invars={bad!r} is out of range for a jaxpr with 3 inputs"):
        split_jaxpr_invars(jaxpr, bad)
