"""``embedding``: signature, dispatch, errors, units, the two ``xy_to_dw`` input kinds, the
one-hot ``pp_x_repr``, vmap promotion, init dtypes, and exact D-RTRL rolls."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from braintrace._compatible_imports import ShapedArray
from braintrace._op import _registries as reg
from braintrace._op.embedding import etp_emb_p, etp_emb_v_p, embedding

V, D = 6, 3


def rand(seed: int, shape: tuple[int, ...]) -> Any:
    # NumPy draws: jax.random would compile once per shape, which dominates these small tests.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _close(a: Any, b: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _etp_eqns(jaxpr: Any) -> list[Any]:
    return [e for e in jaxpr.eqns if e.primitive in reg.ETP_PRIMITIVES]


def test_signature() -> None:
    sig = inspect.signature(embedding)
    assert list(sig.parameters) == ["indices", "weight", "weight_fn"]
    kinds = [p.kind for p in sig.parameters.values()]
    assert kinds == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2 + [inspect.Parameter.KEYWORD_ONLY]
    assert sig.parameters["weight_fn"].default is None


@pytest.mark.parametrize(
    "indices, prim",
    [
        (jnp.array([1, 2, 2]), etp_emb_p),
        ([0, 5], etp_emb_p),
        (np.array([3], np.int64), etp_emb_p),
        (jnp.array([1, 4], jnp.uint8), etp_emb_p),
        (jnp.array(2), etp_emb_v_p),
        (4, etp_emb_v_p),
    ],
)
def test_dispatch_by_rank(indices: Any, prim: Any) -> None:
    table = rand(1, (V, D))
    (eqn,) = _etp_eqns(jax.make_jaxpr(lambda t: embedding(indices, t))(table))
    assert eqn.primitive is prim
    assert eqn.params == dict(weight_fn=None)
    assert len(eqn.invars) == 2 and eqn.invars[1].aval.shape == (V, D)
    assert jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.integer)
    _close(embedding(indices, table), table[np.asarray(indices)])


def test_registry_entries() -> None:
    assert etp_emb_p in reg.BATCHED_PRIMITIVES and etp_emb_v_p not in reg.BATCHED_PRIMITIVES
    assert etp_emb_p not in reg.GRADIENT_ENABLED_PRIMITIVES
    assert reg.get_batched_counterpart(etp_emb_v_p) is etp_emb_p
    for p in (etp_emb_p, etp_emb_v_p):
        assert reg.get_trainable_invars(p, dict(weight_fn=None)) == {"weight": 1}
        assert reg.get_x_invar_index(p) == 0 and reg.get_y_outvar_index(p) == 0
        assert reg.get_fast_path_rules(p) is None
    assert reg.get_pp_x_repr(etp_emb_p) is reg.get_pp_x_repr(etp_emb_v_p) is not None


def test_weight_fn_is_applied_and_is_a_static_param_by_identity() -> None:
    table, hook = rand(1, (V, D)), jnp.tanh
    (eqn,) = _etp_eqns(jax.make_jaxpr(lambda t: embedding(jnp.array([0, 3]), t, weight_fn=hook))(table))
    assert eqn.params["weight_fn"] is hook
    _close(embedding(jnp.array([0, 3]), table, weight_fn=hook), jnp.tanh(table)[jnp.array([0, 3])])


def test_out_of_range_indices_read_as_nan_rows() -> None:
    got = np.asarray(embedding(jnp.array([1, V]), jnp.ones((V, D))))
    assert np.all(got[0] == 1.0) and np.all(np.isnan(got[1]))


def test_units_only_the_table_unit_is_reattached() -> None:
    y = embedding(jnp.array([0, 1]), jnp.ones((V, D)) * u.mV)
    assert isinstance(y, u.Quantity) and y.unit == u.mV
    _close(y.to_decimal(u.mV), jnp.ones((2, D)))
    plain = embedding(u.Quantity(jnp.array([0, 1])), jnp.ones((V, D)))
    assert not isinstance(plain, u.Quantity)


@pytest.mark.parametrize(
    "indices, table, exc, match",
    [
        (jnp.array([0.0, 1.0]), jnp.ones((V, D)), TypeError, "embedding indices must be integers.*float32"),
        (jnp.array([True, False]), jnp.ones((V, D)), TypeError, "embedding indices must be integers.*bool"),
        (1.0, jnp.ones((V, D)), TypeError, "embedding indices must be integers"),
        ("abc", jnp.ones((V, D)), TypeError, "embedding indices must be integers.*str"),
        (jnp.array([0, 1]) * u.mV, jnp.ones((V, D)), TypeError, "without a unit"),
        (jnp.zeros((2, 2), jnp.int32), jnp.ones((V, D)), NotImplementedError, r"\(2, 2\).*(reshape|vmap)"),
        (jnp.array([0]), jnp.ones(V), ValueError, r"weight must have rank 2.*\(6,\)"),
        (jnp.array([0]), jnp.ones((V, D, 2)), ValueError, "weight must have rank 2"),
        (jnp.array([0]), [[1.0] * D] * V, TypeError, "weight must be"),
    ],
)
def test_bad_input_is_rejected_before_binding(indices: Any, table: Any, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        embedding(indices, table)


def test_non_callable_weight_fn_is_rejected() -> None:
    with pytest.raises(TypeError, match="weight_fn"):
        embedding(jnp.array([0]), jnp.ones((V, D)), weight_fn=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("weight_fn", [None, lambda t: t**3])
def test_grad_through_integer_indices_accumulates_repeated_rows(weight_fn: Any) -> None:
    table, idx, ct = rand(1, (V, D)), jnp.array([2, 0, 2]), rand(2, (3, D))
    f = weight_fn or (lambda t: t)
    got = jax.jit(jax.grad(lambda t: jnp.sum(ct * embedding(idx, t, weight_fn=weight_fn))))(table)
    want = jax.jit(jax.grad(lambda t: jnp.sum(ct * (jax.nn.one_hot(idx, V) @ f(t)))))(table)
    _close(got, want)
    assert np.all(np.asarray(got)[[1, 3, 4, 5]] == 0)


# --- xy_to_dw on both input kinds, and the one-hot representation ---------------------------


@pytest.mark.parametrize("prim, idx", [(etp_emb_p, jnp.array([4, 1, 4])), (etp_emb_v_p, jnp.array(5))])
@pytest.mark.parametrize("weight_fn", [None, jnp.tanh])
def test_xy_to_dw_integer_and_one_hot_inputs_give_the_same_table_gradient(
    prim: Any, idx: Any, weight_fn: Any
) -> None:
    table, hd = rand(1, (V, D)), rand(2, (*idx.shape, D))
    params = dict(weight_fn=weight_fn)
    rule, repr_fn = reg.ETP_RULES_XY_TO_DW[prim], reg.get_pp_x_repr(prim)
    assert repr_fn is not None
    one_hot = repr_fn(idx, {"weight": ShapedArray(table.shape, table.dtype)})
    from_int = rule(idx, hd, {"weight": table}, **params)
    from_float = rule(one_hot, hd, {"weight": table}, **params)
    assert set(from_int) == set(from_float) == {"weight"}
    _close(from_int["weight"], from_float["weight"])
    f = weight_fn or (lambda t: t)
    _, vjp = jax.vjp(lambda t: f(t)[idx], table)
    _close(from_int["weight"], vjp(hd)[0])


def test_xy_to_dw_on_a_filtered_float_trace_is_the_vjp_of_the_matmul_form() -> None:
    """The IO-dim x trace is a low-pass-filtered one-hot, not itself one-hot."""
    table, x_trace, hd = rand(1, (V, D)), jnp.abs(rand(2, (4, V))), rand(3, (4, D))
    got = reg.ETP_RULES_XY_TO_DW[etp_emb_p](x_trace, hd, {"weight": table}, weight_fn=jnp.sin)
    _, vjp = jax.vjp(lambda t: x_trace @ jnp.sin(t), table)
    _close(got["weight"], vjp(hd)[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("idx_shape", [(5,), ()])
def test_pp_x_repr_is_one_hot_in_the_table_dtype(dtype: Any, idx_shape: tuple[int, ...]) -> None:
    repr_fn = reg.get_pp_x_repr(etp_emb_p)
    assert repr_fn is not None
    avals = {"weight": ShapedArray((V, D), dtype)}
    idx = jnp.arange(5, dtype=jnp.int32)[: idx_shape[0]] if idx_shape else jnp.array(3)
    out = repr_fn(idx, avals)
    assert out.shape == (*idx_shape, V) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jax.nn.one_hot(idx, V)))
    shaped = jax.eval_shape(lambda i: repr_fn(i, avals), jax.ShapeDtypeStruct(idx_shape, jnp.int32))
    assert (shaped.shape, shaped.dtype) == ((*idx_shape, V), dtype)


def test_pp_x_repr_matches_the_lookup_for_negative_indices() -> None:
    table, idx = rand(1, (V, D)), jnp.array([-1, 2, -V])
    repr_fn = reg.get_pp_x_repr(etp_emb_p)
    assert repr_fn is not None
    one_hot = repr_fn(idx, {"weight": ShapedArray(table.shape, table.dtype)})
    _close(one_hot @ table, embedding(idx, table))


# --- vmap ------------------------------------------------------------------------------------


def test_vmap_of_a_scalar_lookup_is_one_batched_lookup_without_warning() -> None:
    table, idx, hook = rand(1, (V, D)), jnp.array([3, 0, 3, 5]), jnp.tanh

    def f(t: Any, i: Any) -> Any:
        return embedding(i, t, weight_fn=hook)

    batched = jax.vmap(f, in_axes=(None, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(batched)(table, idx)
        got = jax.jit(batched)(table, idx)
    (eqn,) = _etp_eqns(jaxpr)
    assert eqn.primitive is etp_emb_p and eqn.params["weight_fn"] is hook
    _close(got, jnp.tanh(table)[idx])
    ct = rand(2, got.shape)
    g_got = jax.jit(jax.grad(lambda t: jnp.sum(ct * batched(t, idx))))(table)
    g_want = jax.jit(jax.grad(lambda t: jnp.sum(ct * jnp.tanh(t)[idx])))(table)
    _close(g_got, g_want)


def test_vmap_over_the_table_or_of_a_batched_lookup_decomposes_with_a_warning() -> None:
    tables = rand(1, (2, V, D))
    with pytest.warns(UserWarning, match="decomposed"):
        got = jax.vmap(lambda t: embedding(jnp.array(1), t))(tables)
    _close(got, tables[:, 1])
    idx = jnp.array([[0, 1], [2, 3]])
    with pytest.warns(UserWarning, match="decomposed"):
        got = jax.vmap(lambda i: embedding(i, tables[0]))(idx)
    _close(got, tables[0][idx])


# --- init rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("idx", [jnp.array([0, 1]), jnp.array(1)])
@pytest.mark.parametrize("idx_dtype", [jnp.int32, jnp.uint8])
@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_init_rules_take_the_float_dtype(idx: Any, idx_dtype: Any, table_dtype: Any) -> None:
    idx = idx.astype(idx_dtype)
    jaxpr = jax.make_jaxpr(lambda t: embedding(idx, t))(jnp.ones((V, D), table_dtype)).jaxpr
    (eqn,) = _etp_eqns(jaxpr)
    x_var, y_var, wv = eqn.invars[0], eqn.outvars[0], {"weight": eqn.invars[1]}
    init = reg.ETP_RULES_INIT_DRTRL[eqn.primitive](x_var, y_var, wv, 2)
    assert set(init) == {"weight"}
    assert init["weight"].shape == (*idx.shape, V, D, 2) and init["weight"].dtype == table_dtype
    pp = reg.ETP_RULES_INIT_PP[eqn.primitive](x_var, y_var, wv, 2)
    assert pp.shape == (*idx.shape, D, 2) and pp.dtype == table_dtype


# --- D-RTRL equals BPTT ----------------------------------------------------------------------


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("weight_fn", [None, jnp.tanh])
def test_rules_compose_into_an_exact_drtrl_roll_with_two_relations(batched: bool, weight_fn: Any) -> None:
    """``h_t = a ⊙ h_{t-1} + emb(i_t, T) + emb(j_t, T)`` over an integer token sequence: one
    D-RTRL trace per relation, gradients summed, equals BPTT (float32, rtol = atol = 1e-5)."""
    steps, lead = 4, ((3,) if batched else ())
    rng = np.random.default_rng(7)
    tokens = jnp.asarray(rng.integers(0, V, size=(2, steps, *lead)), jnp.int32)
    cs, a, table = rand(8, (steps, *lead, D)), jax.nn.sigmoid(rand(9, (*lead, D))), rand(10, (V, D))
    prim = etp_emb_p if batched else etp_emb_v_p
    params = dict(weight_fn=weight_fn)
    dt_to_t, xy_to_dw = reg.ETP_RULES_DT_TO_T[prim], reg.ETP_RULES_XY_TO_DW[prim]

    def loss(t: Any) -> Any:
        h, total = jnp.zeros((*lead, D)), 0.0
        for s in range(steps):
            h = a * h + embedding(tokens[0, s], t, weight_fn=weight_fn) + embedding(tokens[1, s], t, weight_fn=weight_fn)
            total = total + jnp.sum(cs[s] * h)
        return total

    def instant(x: Any, d: Any) -> Any:
        return xy_to_dw(x, d, {"weight": table}, **params)["weight"]

    def solve(g: Any, e: Any) -> Any:
        return dt_to_t(g, {"weight": e}, **params)["weight"]

    if batched:
        instant, solve = jax.vmap(instant), jax.vmap(solve)

    def roll() -> Any:
        traces = [jnp.zeros((*lead, V, D)) for _ in range(2)]
        grad = jnp.zeros((V, D))
        for s in range(steps):
            for r in range(2):
                prop = dt_to_t(a, {"weight": traces[r]}, **params)["weight"]
                traces[r] = prop + instant(tokens[r, s], jnp.ones((*lead, D)))
                step = solve(cs[s], traces[r])
                grad = grad + (step.sum(0) if batched else step)
        return grad

    _close(jax.jit(roll)(), jax.jit(jax.grad(loss))(table))
