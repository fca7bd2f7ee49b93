"""``register_primitive``, ``ETPPrimitive`` and the registries: the registration contract."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import braintrace
from braintrace import _op
from braintrace._op import _registries as reg
from braintrace._op._registries import FastPathRules, register_batched_counterpart


def _impl(x, w, *, scale=1.0):  # type: ignore[no-untyped-def]
    return scale * (x @ w)


def _fresh(name: str = "t_scaled", **kwargs):  # type: ignore[no-untyped-def]
    return braintrace.register_primitive(name, _impl, **kwargs)


def test_register_primitive_signature_matches_upstream() -> None:
    sig = inspect.signature(braintrace.register_primitive)
    assert list(sig.parameters) == [
        "name", "impl_fn", "batched", "gradient_enabled", "trainable_invars_fn",
        "x_invar_index", "y_outvar_index",
    ]
    kw_only = [n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY]
    assert kw_only == list(sig.parameters)[2:]
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not p.empty}
    assert defaults == dict(batched=False, gradient_enabled=False, trainable_invars_fn=None,
                            x_invar_index=0, y_outvar_index=0)


def test_registration_side_effects() -> None:
    fn = lambda params: {"weight": 1}  # noqa: E731
    p = _fresh(batched=True, gradient_enabled=True, trainable_invars_fn=fn, x_invar_index=0, y_outvar_index=0)
    assert isinstance(p, braintrace.ETPPrimitive) and isinstance(p, Primitive)
    assert str(p) == p.name == "t_scaled" and not p.multiple_results
    assert p in reg.ETP_PRIMITIVES and p in reg.BATCHED_PRIMITIVES and p in reg.GRADIENT_ENABLED_PRIMITIVES
    assert reg.ETP_TRAINABLE_INVARS_FNS[p] is fn
    assert reg.ETP_X_INVAR_INDICES[p] == 0 and reg.ETP_Y_OUTVAR_INDICES[p] == 0
    q = _fresh(x_invar_index=None)
    assert q is not p and q.name == p.name
    assert q not in reg.BATCHED_PRIMITIVES and q not in reg.GRADIENT_ENABLED_PRIMITIVES
    assert q not in reg.ETP_TRAINABLE_INVARS_FNS and reg.ETP_X_INVAR_INDICES[q] is None


def test_lookup_helpers_and_their_fallbacks() -> None:
    p = _fresh()
    assert reg.get_trainable_invars(p, {}) == {"weight": 1}
    assert reg.get_x_invar_index(jax.lax.add_p) == 0 and reg.get_y_outvar_index(jax.lax.add_p) == 0
    assert not reg.is_etp_primitive(jax.lax.add_p) and reg.is_etp_primitive(p)
    assert not reg.is_batched_primitive(jax.lax.add_p) and not reg.is_etp_enable_gradient_primitive(jax.lax.add_p)
    for getter in (reg.get_batched_counterpart, reg.get_fast_path_rules, reg.get_instant_drtrl_rule,
                   reg.get_solve_drtrl_rule, reg.get_pp_x_repr):
        assert getter(p) is None


def test_register_methods_overwrite_and_register_etp_rules_skips_none() -> None:
    p = _fresh()
    f1, f2 = (lambda *a, **k: 1), (lambda *a, **k: 2)
    p.register_dt_to_t(f1)
    p.register_xy_to_dw(f1)
    p.register_init_drtrl(f1)
    p.register_init_pp(f1)
    tables = (reg.ETP_RULES_DT_TO_T, reg.ETP_RULES_XY_TO_DW, reg.ETP_RULES_INIT_DRTRL, reg.ETP_RULES_INIT_PP)
    assert all(t[p] is f1 for t in tables)
    p.register_etp_rules(dt_to_t=f2)
    assert reg.ETP_RULES_DT_TO_T[p] is f2 and reg.ETP_RULES_XY_TO_DW[p] is f1
    fp = FastPathRules(f1, f1, f1, lambda params: True)
    p.register_etp_rules(fast_path=fp, pp_x_repr=f2, instant_drtrl=f1, solve_drtrl=f2)
    assert reg.get_fast_path_rules(p) is fp and fp.chunk is None
    assert reg.get_pp_x_repr(p) is f2 and reg.get_instant_drtrl_rule(p) is f1 and reg.get_solve_drtrl_rule(p) is f2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name=3, impl_fn=_impl), "name"),
        (dict(name="p", impl_fn="nope"), "impl_fn"),
        (dict(name="p", impl_fn=_impl, trainable_invars_fn=5), "trainable_invars_fn"),
        (dict(name="p", impl_fn=_impl, x_invar_index="0"), "x_invar_index"),
        (dict(name="p", impl_fn=_impl, y_outvar_index=-1), "y_outvar_index"),
    ],
)
def test_register_primitive_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        braintrace.register_primitive(**kwargs)


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        braintrace.register_primitive("p", _impl, batch=True)  # type: ignore[call-arg]


def test_rules_must_be_callable() -> None:
    p = _fresh()
    with pytest.raises(TypeError, match="dt_to_t"):
        p.register_dt_to_t(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FastPathRules"):
        p.register_etp_rules(fast_path=(1, 2, 3, 4))  # type: ignore[arg-type]


def test_batched_counterpart_misuse() -> None:
    unbatched, batched = _fresh(), _fresh(batched=True)
    with pytest.raises(ValueError, match="ETP"):
        register_batched_counterpart(jax.lax.add_p, batched)
    with pytest.raises(ValueError, match="ETP"):
        register_batched_counterpart(unbatched, jax.lax.add_p)
    with pytest.raises(ValueError, match="unbatched"):
        register_batched_counterpart(batched, batched)
    with pytest.raises(ValueError, match="batched"):
        register_batched_counterpart(unbatched, _fresh())
    register_batched_counterpart(unbatched, batched)
    other = _fresh(batched=True)
    register_batched_counterpart(unbatched, other)
    assert reg.get_batched_counterpart(unbatched) is other


def test_derived_rules_eager_jit_grad_jvp() -> None:
    p = _fresh()
    x, w = jnp.arange(6.0).reshape(2, 3), jnp.ones((3, 4))
    np.testing.assert_allclose(p.bind(x, w, scale=2.0), 2 * x @ w)
    np.testing.assert_allclose(jax.jit(lambda w: p.bind(x, w, scale=2.0))(w), 2 * x @ w)
    g = jax.grad(lambda w: p.bind(x, w, scale=2.0).sum())(w)
    np.testing.assert_allclose(g, jax.grad(lambda w: (2 * x @ w).sum())(w))
    # Only one operand carries a tangent: the other arrives as a symbolic zero.
    _, t = jax.jvp(lambda w: p.bind(x, w, scale=2.0), (w,), (jnp.ones_like(w),))
    np.testing.assert_allclose(t, 2 * x @ jnp.ones_like(w))
    jaxpr = jax.make_jaxpr(lambda x, w: p.bind(x, w, scale=2.0))(x, w)
    assert [e.primitive for e in jaxpr.eqns] == [p] and jaxpr.eqns[0].params == {"scale": 2.0}


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_grad_through_integer_and_boolean_inputs(dtype) -> None:  # type: ignore[no-untyped-def]
    x = (jnp.arange(6).reshape(2, 3) % 2).astype(dtype)
    w = jnp.linspace(-1, 1, 12).reshape(3, 4)
    got = jax.grad(lambda w: braintrace.matmul(x, w).sum())(w)
    want = jax.grad(lambda w: (x.astype(jnp.float32) @ w).sum())(w)
    np.testing.assert_allclose(got, want)


def test_batching_rebinds_counterpart_for_any_x_axis_and_keeps_params() -> None:
    w = jnp.ones((3, 4))
    hook = jnp.tanh
    xs = jnp.arange(6.0).reshape(3, 2)  # batch on axis 1
    f = jax.vmap(lambda x: braintrace.matmul(x, w, weight_fn=hook), in_axes=1)
    jaxpr = jax.make_jaxpr(f)(xs)
    (eqn,) = [e for e in jaxpr.eqns if reg.is_etp_primitive(e.primitive)]
    assert "dot_general" not in str(jaxpr)
    assert eqn.primitive is _op.etp_mm_p and eqn.params["weight_fn"] is hook
    np.testing.assert_allclose(f(xs), xs.T @ jnp.tanh(w), rtol=1e-6)
    g = jax.grad(lambda w: jax.vmap(lambda x: braintrace.matmul(x, w), in_axes=1)(xs).sum())(w)
    np.testing.assert_allclose(g, jax.grad(lambda w: (xs.T @ w).sum())(w))


def test_batching_falls_back_with_a_warning_when_the_weight_is_mapped() -> None:
    ws = jnp.ones((2, 3, 4))
    x = jnp.ones(3)
    with pytest.warns(UserWarning, match="decomposed"):
        out = jax.vmap(lambda w: braintrace.matmul(x, w))(ws)
    np.testing.assert_allclose(out, jnp.full((2, 4), 3.0))


def test_nested_vmap_falls_back_with_a_warning() -> None:
    w = jnp.ones((3, 4))
    xs = jnp.ones((2, 5, 3))
    with pytest.warns(UserWarning, match="decomposed"):
        out = jax.vmap(jax.vmap(lambda x: braintrace.matmul(x, w)))(xs)
    assert out.shape == (2, 5, 4)


def test_registries_are_shared_objects_across_import_paths() -> None:
    for name in ("ETP_PRIMITIVES", "BATCHED_PRIMITIVES", "GRADIENT_ENABLED_PRIMITIVES", "ETP_RULES_DT_TO_T",
                 "ETP_RULES_XY_TO_DW", "ETP_RULES_INIT_DRTRL", "ETP_RULES_INIT_PP", "ETP_FAST_PATH_RULES",
                 "ETP_RULES_PP_X_REPR", "ETP_TRAINABLE_INVARS_FNS", "ETP_X_INVAR_INDICES", "ETP_Y_OUTVAR_INDICES"):
        assert getattr(_op, name) is getattr(reg, name), name
