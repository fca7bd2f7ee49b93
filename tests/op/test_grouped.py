"""``grouped_matmul``: signature, dispatch, units, errors, dtypes, vmap, and exact D-RTRL rolls."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from braintrace._errors import OperandShapeError
from braintrace._op import _registries as reg
from braintrace._op.grouped import etp_gmm_p, etp_gmv_p, grouped_matmul

G, K, N = 3, 4, 2


def rand(seed: int, shape: tuple[int, ...]) -> Any:
    # NumPy draws: jax.random would compile once per shape, which dominates these small tests.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _reference(x: Any, w: Any, b: Any = None) -> Any:
    y = jnp.einsum("...gk,gkn->...gn", x, w)
    return y if b is None else y + b


def test_signature() -> None:
    sig = inspect.signature(grouped_matmul)
    assert list(sig.parameters) == ["x", "weight", "bias", "weight_fn", "bias_fn"]
    kinds = [p.kind for p in sig.parameters.values()]
    assert kinds[:3] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 3
    assert kinds[3:] == [inspect.Parameter.KEYWORD_ONLY] * 2
    assert all(sig.parameters[n].default is None for n in ("bias", "weight_fn", "bias_fn"))


@pytest.mark.parametrize("x_shape, prim", [((2, G, K), etp_gmm_p), ((G, K), etp_gmv_p)])
@pytest.mark.parametrize("bias", [False, True])
def test_dispatch_by_rank_and_bias_flag(x_shape: tuple[int, ...], prim: Any, bias: bool) -> None:
    args = (jnp.ones(x_shape), jnp.ones((G, K, N))) + ((jnp.ones((G, N)),) if bias else ())
    (eqn,) = [e for e in jax.make_jaxpr(grouped_matmul)(*args).eqns if e.primitive in reg.ETP_PRIMITIVES]
    assert eqn.primitive is prim
    assert eqn.params == dict(has_bias=bias, weight_fn=None, bias_fn=None)
    assert reg.get_trainable_invars(prim, eqn.params) == ({"weight": 1, "bias": 2} if bias else {"weight": 1})
    assert reg.get_x_invar_index(prim) == 0


def test_registry_flags_and_counterpart() -> None:
    assert etp_gmm_p in reg.BATCHED_PRIMITIVES and etp_gmv_p not in reg.BATCHED_PRIMITIVES
    assert etp_gmm_p not in reg.GRADIENT_ENABLED_PRIMITIVES
    assert reg.get_batched_counterpart(etp_gmv_p) is etp_gmm_p
    assert str(etp_gmm_p) == "etp_gmm" and str(etp_gmv_p) == "etp_gmv"


def test_one_shared_fast_path_bundle_without_chunk() -> None:
    fp = reg.get_fast_path_rules(etp_gmm_p)
    assert fp is not None and fp is reg.get_fast_path_rules(etp_gmv_p)
    assert fp.chunk is None
    assert fp.applicable(dict(has_bias=True, weight_fn=None, bias_fn=None))
    assert not fp.applicable(dict(has_bias=True, weight_fn=None, bias_fn=jnp.tanh))


def test_hooks_are_static_params_by_identity() -> None:
    hook = jnp.tanh
    jaxpr = jax.make_jaxpr(lambda x, w: grouped_matmul(x, w, weight_fn=hook))(jnp.ones((G, K)), jnp.ones((G, K, N)))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is etp_gmv_p]
    assert eqn.params["weight_fn"] is hook


@pytest.mark.parametrize("lead", [(2,), ()])
def test_values_with_hooks_and_bias(lead: tuple[int, ...]) -> None:
    x, w, b = rand(1, (*lead, G, K)), rand(2, (G, K, N)), rand(3, (G, N))
    got = grouped_matmul(x, w, b, weight_fn=jnp.tanh, bias_fn=jnp.abs)
    np.testing.assert_allclose(got, _reference(x, jnp.tanh(w), jnp.abs(b)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grouped_matmul(x, w), _reference(x, w), rtol=1e-5, atol=1e-6)


def test_groups_do_not_mix() -> None:
    """Perturbing group 0's input changes only group 0's output."""
    x, w = rand(1, (G, K)), rand(2, (G, K, N))
    delta = grouped_matmul(x.at[0].add(1.0), w) - grouped_matmul(x, w)
    assert np.all(np.asarray(delta[1:]) == 0) and np.any(np.asarray(delta[0]) != 0)


def test_gradients_with_hooks_are_wrt_the_raw_parameters() -> None:
    x, w, b, ct = rand(1, (2, G, K)), rand(2, (G, K, N)), rand(3, (G, N)), rand(4, (2, G, N))

    def loss(f: Any) -> Any:
        return lambda w, b: jnp.sum(ct * f(w, b))

    got = jax.jit(jax.grad(loss(lambda w, b: grouped_matmul(x, w, b, weight_fn=jnp.sin, bias_fn=jnp.exp)), (0, 1)))(w, b)
    want = jax.jit(jax.grad(loss(lambda w, b: _reference(x, jnp.sin(w), jnp.exp(b))), (0, 1)))(w, b)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6)


def test_units_are_carried_and_stripped() -> None:
    x = jnp.ones((G, K)) * u.mV
    w = jnp.ones((G, K, N)) * u.siemens
    y = grouped_matmul(x, w, jnp.ones((G, N)) * u.mV * u.siemens)
    assert isinstance(y, u.Quantity) and y.unit == u.mV * u.siemens
    np.testing.assert_allclose(y.to_decimal(u.mV * u.siemens), K + 1.0)
    converted = grouped_matmul(x, w, jnp.ones((G, N)) * u.volt * u.siemens)
    np.testing.assert_allclose(converted.to_decimal(u.mV * u.siemens), K + 1000.0)
    plain = grouped_matmul(jnp.ones((G, K)), jnp.ones((G, K, N)))
    assert not isinstance(plain, u.Quantity)
    with pytest.raises(u.UnitMismatchError):
        grouped_matmul(x, jnp.ones((G, K, N)), jnp.ones((G, N)))


@pytest.mark.parametrize(
    "x, w, b, exc, match",
    [
        (jnp.ones((G, K)), jnp.ones((K, N)), None, ValueError, r"weight must have rank 3.*\(4, 2\)"),
        # weight is checked first, even when x is also wrong
        (jnp.ones(K), jnp.ones((G * K, N)), None, ValueError, "weight must have rank 3"),
        (jnp.ones(K), jnp.ones((G, K, N)), None, ValueError, r"x must have rank 2 or 3.*\(4,\)"),
        (jnp.ones((1, 2, G, K)), jnp.ones((G, K, N)), None, ValueError, "x must have rank 2 or 3"),
        (jnp.ones((G, K + 1)), jnp.ones((G, K, N)), None, ValueError, r"\(3, 5\).*\(3, 4, 2\)"),
        (jnp.ones((2, G + 1, K)), jnp.ones((G, K, N)), None, OperandShapeError, "last two axes of x"),
        (jnp.ones((G, K)), jnp.ones((G, K, N)), jnp.ones(N), ValueError, r"bias must have shape .* \(3, 2\)"),
        (jnp.ones((G, K)), jnp.ones((G, K, N)), jnp.ones((N, G)), ValueError, "bias must have shape"),
        ([[1.0] * K] * G, jnp.ones((G, K, N)), None, TypeError, "x must be"),
        (jnp.ones((G, K)), [[[1.0] * N] * K] * G, None, AttributeError, "weight must be"),
    ],
)
def test_bad_input_is_rejected_before_binding(x: Any, w: Any, b: Any, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        grouped_matmul(x, w, b)


def test_non_callable_hooks_are_rejected() -> None:
    with pytest.raises(TypeError, match="weight_fn"):
        grouped_matmul(jnp.ones((G, K)), jnp.ones((G, K, N)), weight_fn=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bias_fn"):
        grouped_matmul(jnp.ones((G, K)), jnp.ones((G, K, N)), jnp.ones((G, N)), bias_fn="tanh")  # type: ignore[arg-type]


def _eqn_vars(fn: Any, *args: Any) -> tuple[Any, Any, dict[str, Any]]:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive in reg.ETP_PRIMITIVES]
    layout = reg.get_trainable_invars(eqn.primitive, eqn.params)
    return eqn.invars[0], eqn.outvars[0], {k: eqn.invars[i] for k, i in layout.items()}


@pytest.mark.parametrize(
    "x_dtype, w_dtype, b_dtype, want",
    [
        (jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32),
        (jnp.float32, jnp.float16, jnp.float16, jnp.float32),
        (jnp.float16, jnp.float16, jnp.float32, jnp.float32),
        (jnp.float16, jnp.float16, jnp.float16, jnp.float16),
        (jnp.int32, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    ],
)
@pytest.mark.parametrize("lead", [(2,), ()])
def test_init_rules_promote_across_operand_dtypes(
    x_dtype: Any, w_dtype: Any, b_dtype: Any, want: Any, lead: tuple[int, ...]
) -> None:
    x = jnp.ones((*lead, G, K), x_dtype)
    w, b = jnp.ones((G, K, N), w_dtype), jnp.ones((G, N), b_dtype)
    x_var, y_var, wv = _eqn_vars(grouped_matmul, x, w, b)
    prim = etp_gmm_p if lead else etp_gmv_p
    assert wv['bias'].aval.dtype == b_dtype
    init = reg.ETP_RULES_INIT_DRTRL[prim](x_var, y_var, wv, 3)
    assert init["weight"].shape == (*lead, G, K, N, 3) and init["bias"].shape == (*lead, G, N, 3)
    assert init["weight"].dtype == want and init["bias"].dtype == want
    pp = reg.ETP_RULES_INIT_PP[prim](x_var, y_var, wv, 3)
    assert pp.shape == (*lead, G, N, 3) and pp.dtype == y_var.aval.dtype


def test_vmap_promotes_gmv_to_one_gmm_for_any_x_axis() -> None:
    x, w, b = rand(1, (G, 5, K)), rand(2, (G, K, N)), rand(3, (G, N))
    hook = jnp.tanh

    def f(xi: Any, w: Any) -> Any:
        return grouped_matmul(xi, w, b, weight_fn=hook)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=(1, None)))(x, w)
        got = jax.jit(jax.vmap(f, in_axes=(1, None)))(x, w)
    etp = [e for e in jaxpr.eqns if e.primitive in reg.ETP_PRIMITIVES]
    assert [e.primitive for e in etp] == [etp_gmm_p]
    assert etp[0].params["weight_fn"] is hook
    assert not any(e.primitive.name in ("dot_general", "einsum") for e in jaxpr.eqns)
    xb = jnp.moveaxis(x, 1, 0)
    np.testing.assert_allclose(got, _reference(xb, jnp.tanh(w), b), rtol=1e-5, atol=1e-6)
    ct = rand(4, got.shape)
    g_got = jax.jit(jax.grad(lambda w: jnp.sum(ct * jax.vmap(f, in_axes=(1, None))(x, w))))(w)
    g_want = jax.jit(jax.grad(lambda w: jnp.sum(ct * _reference(xb, jnp.tanh(w), b))))(w)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)


def test_vmap_over_the_weight_decomposes_with_a_warning() -> None:
    x, ws = rand(1, (G, K)), rand(2, (2, G, K, N))
    with pytest.warns(UserWarning, match="decomposed"):
        got = jax.vmap(lambda w: grouped_matmul(x, w))(ws)
    np.testing.assert_allclose(got[1], _reference(x, ws[1]), rtol=1e-5, atol=1e-6)


# --- D-RTRL equals BPTT ---------------------------------------------------------------------

STEPS = 4


def _problem(batched: bool) -> dict[str, Any]:
    lead = (2,) if batched else ()
    return dict(
        lead=lead,
        xs=rand(11, (STEPS, *lead, G, K)),
        cs=rand(12, (STEPS, *lead, G, N)),
        a=jax.nn.sigmoid(rand(13, (*lead, G, N))),
        weights={"weight": rand(14, (G, K, N)), "bias": rand(15, (G, N))},
    )


def _bptt(p: dict[str, Any], weight_fn: Any, bias_fn: Any) -> dict[str, Any]:
    def loss(ws: dict[str, Any]) -> Any:
        h, total = jnp.zeros((*p["lead"], G, N)), 0.0
        for t in range(STEPS):
            y = grouped_matmul(p["xs"][t], ws["weight"], ws["bias"], weight_fn=weight_fn, bias_fn=bias_fn)
            h = p["a"] * h + y
            total = total + jnp.sum(p["cs"][t] * h)
        return total

    return jax.jit(jax.grad(loss))(p["weights"])  # type: ignore[no-any-return]


def _close_tree(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("weight_fn, bias_fn", [(None, None), (jnp.tanh, None), (lambda w: w**2, jnp.exp)])
def test_general_rules_compose_into_an_exact_drtrl_roll(batched: bool, weight_fn: Any, bias_fn: Any) -> None:
    """``h_t = a ⊙ h_{t-1} + grouped_matmul(x_t, W, b)``: D-RTRL with the rules equals BPTT
    (float32, rtol = atol = 1e-5)."""
    p = _problem(batched)
    lead, weights = p["lead"], p["weights"]
    prim = etp_gmm_p if batched else etp_gmv_p
    params = dict(has_bias=True, weight_fn=weight_fn, bias_fn=bias_fn)
    dt_to_t, xy_to_dw = reg.ETP_RULES_DT_TO_T[prim], reg.ETP_RULES_XY_TO_DW[prim]

    def instant(x: Any, d: Any) -> Any:
        return xy_to_dw(x, d, weights, **params)

    def solve(g: Any, e: Any) -> Any:
        return dt_to_t(g, e, **params)

    if batched:
        instant, solve = jax.vmap(instant), jax.vmap(solve)
    def roll() -> dict[str, Any]:
        trace = {"weight": jnp.zeros((*lead, G, K, N)), "bias": jnp.zeros((*lead, G, N))}
        grad = jax.tree.map(jnp.zeros_like, weights)
        for t in range(STEPS):
            inst = instant(p["xs"][t], jnp.ones((*lead, G, N)))
            trace = jax.tree.map(jnp.add, dt_to_t(p["a"], trace, **params), inst)
            step = solve(p["cs"][t], trace)
            grad = jax.tree.map(lambda g, s: g + (s.sum(0) if batched else s), grad, step)
        return grad

    grad = jax.jit(roll)()
    _close_tree(grad, _bptt(p, weight_fn, bias_fn))


@pytest.mark.parametrize("batched", [True, False])
def test_fast_path_roll_with_two_coupled_states_equals_bptt(batched: bool) -> None:
    """Two states per position, ``h_t[a] = Σ_b M[a, b] h_{t-1}[b] + u[a] y_t``: the closed-form
    kernels (instant, recurrent, solve with batch folding) reproduce BPTT (float32, 1e-5)."""
    p = _problem(batched)
    lead, weights, s = p["lead"], p["weights"], 2
    m = 0.5 * rand(16, (*lead, G, N, s, s))
    u_vec = jnp.array([1.0, -0.5])
    cs = rand(17, (STEPS, *lead, G, N, s))

    def loss(ws: dict[str, Any]) -> Any:
        h, total = jnp.zeros((*lead, G, N, s)), 0.0
        for t in range(STEPS):
            y = grouped_matmul(p["xs"][t], ws["weight"], ws["bias"])
            h = jnp.einsum("...ab,...b->...a", m, h) + y[..., None] * u_vec
            total = total + jnp.sum(cs[t] * h)
        return total

    fp = reg.ETP_FAST_PATH_RULES[etp_gmm_p if batched else etp_gmv_p]
    df = jnp.broadcast_to(u_vec, (*lead, G, N, s))
    def roll() -> dict[str, Any]:
        trace = {"weight": jnp.zeros((*lead, G, K, N, s)), "bias": jnp.zeros((*lead, G, N, s))}
        grad = jax.tree.map(jnp.zeros_like, weights)
        for t in range(STEPS):
            inst = fp.instant(p["xs"][t], df, True)
            trace = jax.tree.map(jnp.add, fp.recurrent(m, trace, s), inst)
            grad = jax.tree.map(jnp.add, grad, fp.solve(cs[t], trace, fold_batch=batched))
        return grad

    grad = jax.jit(roll)()
    _close_tree(grad, jax.jit(jax.grad(loss))(weights))


def test_fast_and_general_solves_agree_along_a_single_state_roll() -> None:
    """S = 1: the fast kernels (with the broadcast shortcut) and the general rules give the
    same trace at every step and the same per-step gradient."""
    p = _problem(True)
    params = dict(has_bias=True, weight_fn=None, bias_fn=None)
    fp = reg.ETP_FAST_PATH_RULES[etp_gmm_p]
    dt_to_t, xy_to_dw = reg.ETP_RULES_DT_TO_T[etp_gmm_p], reg.ETP_RULES_XY_TO_DW[etp_gmm_p]
    lead = p["lead"]

    def roll() -> tuple[list[Any], list[Any]]:
        fast = {"weight": jnp.zeros((*lead, G, K, N, 1)), "bias": jnp.zeros((*lead, G, N, 1))}
        slow = {"weight": jnp.zeros((*lead, G, K, N)), "bias": jnp.zeros((*lead, G, N))}
        ones = jnp.ones((*lead, G, N))
        fast_out, slow_out = [], []
        for t in range(STEPS):
            fast = jax.tree.map(jnp.add, fp.recurrent(p["a"][..., None, None], fast, 1),
                                fp.instant(p["xs"][t], ones[..., None], True))
            inst = jax.vmap(lambda x, d: xy_to_dw(x, d, p["weights"], **params))(p["xs"][t], ones)
            slow = jax.tree.map(jnp.add, dt_to_t(p["a"], slow, **params), inst)
            g_fast = fp.solve(p["cs"][t][..., None], fast, fold_batch=True)
            g_slow = jax.vmap(lambda g, e: dt_to_t(g, e, **params))(p["cs"][t], slow)
            fast_out.append(({k: v[..., 0] for k, v in fast.items()}, g_fast))
            slow_out.append((slow, jax.tree.map(lambda v: v.sum(0), g_slow)))
        return fast_out, slow_out

    fast_out, slow_out = jax.jit(roll)()
    for (f_trace, f_grad), (s_trace, s_grad) in zip(fast_out, slow_out):
        _close_tree(f_trace, s_trace)
        _close_tree(f_grad, s_grad)
