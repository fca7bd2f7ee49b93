"""Every registered ETP primitive against first principles (one row per case in ``cases/``).

The D-RTRL rules are checked against the trace geometry of each row (see ``opcase.py``):

* ``dt_to_t(hd, ε[y])`` equals ``ε[hd ⊙ y]`` (context R: propagation through a hidden
  Jacobian slice is the Jacobian of ``hd ⊙ y``);
* the instantaneous term (``instant_drtrl``, else ``xy_to_dw`` per sample) equals ``ε[hd ⊙ y]``;
* the solve (``solve_drtrl``, else ``dt_to_t``) contracts ``g`` with ``ε[y]`` to ``vjp(y)(g)``;
* ``xy_to_dw`` equals ``jax.vjp`` of the impl (context P, and per sample for batched rows).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from braintrace._op import _registries as reg
from braintrace._op.op_rule_oracle import assert_xy_to_dw_matches_vjp
from tests.op.cases import ALL_CASES
from tests.op.opcase import OpCase, close, rand, scale_y

CASES = ALL_CASES
every_case = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
geometry_cases = [c for c in CASES if c.trace_of is not None]
with_geometry = pytest.mark.parametrize("case", geometry_cases, ids=[c.id for c in geometry_cases])


def _batched(case: OpCase) -> bool:
    return case.prim in reg.BATCHED_PRIMITIVES


def _tree_close(a: Any, b: Any, atol: float = 1e-5) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: close(u, v, atol=atol), a, b)


def _sum_to_param(grads: dict[str, jax.Array], weights: dict[str, jax.Array]) -> dict[str, jax.Array]:
    out = {}
    for k, g in grads.items():
        extra = g.ndim - weights[k].ndim
        out[k] = g.sum(axis=tuple(range(extra))) if extra else g
    return out


@every_case
def test_bind_matches_impl_eagerly_under_jit_and_in_abstract_eval(case: OpCase) -> None:
    want = case.y()
    close(case.bind(case.x, case.weights), want)
    close(jax.jit(case.bind)(case.x, case.weights), want)
    aval = jax.eval_shape(case.bind, case.x, case.weights)
    assert (aval.shape, aval.dtype) == (want.shape, want.dtype)


@every_case
def test_grad_and_jvp_match_the_impl(case: OpCase) -> None:
    ct = rand(7, case.y().shape)

    def loss(f: Any) -> Any:
        return lambda ws: jnp.sum(ct * f(case.x, ws))

    _tree_close(jax.grad(loss(case.bind))(case.weights), jax.grad(loss(case.fn))(case.weights))
    tangents = {k: rand(20 + i, w.shape) for i, (k, w) in enumerate(case.weights.items())}
    got = jax.jvp(lambda ws: case.bind(case.x, ws), (case.weights,), (tangents,))
    want = jax.jvp(lambda ws: case.fn(case.x, ws), (case.weights,), (tangents,))
    _tree_close(got, want)


@every_case
def test_xy_to_dw_equals_the_vjp_of_the_impl(case: OpCase) -> None:
    rule = reg.ETP_RULES_XY_TO_DW[case.prim]
    hd = rand(9, case.y().shape)
    common = dict(rule=rule, impl=case.impl, weights=case.weights, params=case.params)
    assert_xy_to_dw_matches_vjp(x=case.x, hidden_dim=hd, **common)  # type: ignore[arg-type]
    if _batched(case):  # the per-sample context of the D-RTRL instantaneous term
        assert_xy_to_dw_matches_vjp(x=case.x[0], hidden_dim=hd[0], **common)  # type: ignore[arg-type]


@with_geometry
def test_dt_to_t_propagates_the_trace_through_a_hidden_jacobian(case: OpCase) -> None:
    assert case.trace_of is not None
    hd = rand(10, case.y().shape)
    trace = case.trace_of(case.fn, case.x, case.weights, case.params)
    got = reg.ETP_RULES_DT_TO_T[case.prim](hd, trace, **case.params)
    want = case.trace_of(scale_y(case.fn, hd), case.x, case.weights, case.params)
    _tree_close(got, want)


@with_geometry
def test_library_dt_to_t_scales_each_trace_entry(case: OpCase) -> None:
    """``dt_to_t(hd, ε) = ε ⊙ dt_to_t(hd, 1)``: the D-RTRL engine rolls a one-state trace of a
    library primitive as that product, on the stored trace (see
    ``braintrace._algorithm.param_trace.relation_rule.general_recurrent``)."""
    if not reg.has_library_rules(case.prim):
        pytest.skip("user rules may roll the trace in any linear way")
    assert case.trace_of is not None
    hd = rand(10, case.y().shape)
    shapes = case.trace_of(case.fn, case.x, case.weights, case.params)
    trace = {k: rand(30 + i, v.shape) for i, (k, v) in enumerate(sorted(shapes.items()))}
    rule = reg.ETP_RULES_DT_TO_T[case.prim]
    factor = rule(hd, {k: jnp.ones_like(v) for k, v in trace.items()}, **case.params)
    _tree_close(rule(hd, trace, **case.params), {k: trace[k] * factor[k] for k in trace})


@with_geometry
def test_instantaneous_term_is_the_trace_of_df_times_y(case: OpCase) -> None:
    assert case.trace_of is not None
    rule = reg.get_instant_drtrl_rule(case.prim) or reg.ETP_RULES_XY_TO_DW[case.prim]
    df = rand(11, case.y().shape)
    if _batched(case):
        got = jax.vmap(lambda x, d: rule(x, d, case.weights, **case.params))(case.x, df)
    else:
        got = rule(case.x, df, case.weights, **case.params)
    want = case.trace_of(scale_y(case.fn, df), case.x, case.weights, case.params)
    _tree_close(got, want)


@with_geometry
def test_solve_contracts_signal_and_trace_to_the_gradient(case: OpCase) -> None:
    assert case.trace_of is not None
    g = rand(12, case.y().shape)
    trace = case.trace_of(case.fn, case.x, case.weights, case.params)
    solve_rule = reg.get_solve_drtrl_rule(case.prim)
    if solve_rule is not None:
        def solve(gs: Any, tr: Any) -> Any:
            return solve_rule(gs, tr, case.weights, **case.params)
    else:
        def solve(gs: Any, tr: Any) -> Any:
            return reg.ETP_RULES_DT_TO_T[case.prim](gs, tr, **case.params)
    got = jax.vmap(solve)(g, trace) if _batched(case) else solve(g, trace)
    _, vjp = jax.vjp(lambda ws: case.fn(case.x, ws), case.weights)
    _tree_close(_sum_to_param(got, case.weights), vjp(g)[0])


def _eqn_vars(case: OpCase) -> tuple[Any, Any, dict[str, Any]]:
    jaxpr = jax.make_jaxpr(case.bind)(case.x, case.weights).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is case.prim]
    xi = reg.get_x_invar_index(case.prim)
    x_var = None if xi is None else eqn.invars[xi]
    layout = reg.get_trainable_invars(case.prim, eqn.params)
    weight_vars = {k: eqn.invars[i] for k, i in layout.items()}
    return x_var, eqn.outvars[reg.get_y_outvar_index(case.prim)], weight_vars


@every_case
@pytest.mark.parametrize("num_state", [1, 2])
def test_init_rules_give_exact_shapes_and_dtypes(case: OpCase, num_state: int) -> None:
    x_var, y_var, weight_vars = _eqn_vars(case)
    init = reg.ETP_RULES_INIT_DRTRL[case.prim](x_var, y_var, weight_vars, num_state, **case.init_kwargs)
    assert set(init) == set(case.drtrl_shapes) == set(weight_vars)
    for k, leaf in init.items():
        assert leaf.shape == (*case.drtrl_shapes[k], num_state), k
        assert not np.any(np.asarray(leaf)), k
    pp = reg.ETP_RULES_INIT_PP[case.prim](x_var, y_var, weight_vars, num_state, **case.init_kwargs)
    assert pp.shape == (*y_var.aval.shape, num_state)
    assert pp.dtype == y_var.aval.dtype


@every_case
def test_vmap_over_x_rebinds_the_batched_counterpart_or_warns(case: OpCase) -> None:
    if case.x is None:  # no input: only the parameter can be mapped, which always decomposes
        ws = jax.tree.map(lambda w: jnp.stack([w, 2 * w]), case.weights)
        with pytest.warns(UserWarning, match="decomposed"):
            got = jax.vmap(lambda w: case.bind(None, w))(ws)
        close(got[1], case.fn(None, jax.tree.map(lambda w: 2 * w, case.weights)))
        return
    xs = jnp.stack([case.x, 2 * case.x])

    def f(x: Any) -> Any:
        return case.bind(x, case.weights)

    counterpart = reg.get_batched_counterpart(case.prim)
    if counterpart is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jaxpr = jax.make_jaxpr(jax.vmap(f))(xs)
            got = jax.vmap(f)(xs)
        assert [e.primitive for e in jaxpr.eqns if e.primitive in reg.ETP_PRIMITIVES] == [counterpart]
    else:
        with pytest.warns(UserWarning, match="decomposed"):
            got = jax.vmap(f)(xs)
    close(got[1], case.fn(2 * case.x, case.weights))
