"""``braintrace.matmul``: signature, dispatch, units, errors, and an exact D-RTRL roll."""

from __future__ import annotations

import inspect
from typing import Any

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._op import _registries as reg
from braintrace._op import etp_mm_p, etp_mv_p
from tests.op.opcase import rand


def test_signature() -> None:
    sig = inspect.signature(braintrace.matmul)
    assert list(sig.parameters) == ["x", "weight", "bias", "weight_fn", "bias_fn"]
    assert [p.kind for p in sig.parameters.values()][-2:] == [inspect.Parameter.KEYWORD_ONLY] * 2
    assert sig.parameters["bias"].default is None


@pytest.mark.parametrize("x_shape, prim", [((2, 3), etp_mm_p), ((3,), etp_mv_p)])
@pytest.mark.parametrize("bias", [False, True])
def test_dispatch_by_rank_and_bias_flag(x_shape, prim, bias) -> None:  # type: ignore[no-untyped-def]
    args = (jnp.ones(x_shape), jnp.ones((3, 4))) + ((jnp.ones(4),) if bias else ())
    (eqn,) = jax.make_jaxpr(braintrace.matmul)(*args).eqns
    assert eqn.primitive is prim
    assert eqn.params == dict(has_bias=bias, weight_fn=None, bias_fn=None)
    assert reg.get_trainable_invars(prim, eqn.params) == ({"weight": 1, "bias": 2} if bias else {"weight": 1})


def test_hooks_are_static_params_by_identity() -> None:
    hook = jnp.tanh
    (eqn,) = jax.make_jaxpr(lambda x, w: braintrace.matmul(x, w, weight_fn=hook))(jnp.ones(3), jnp.ones((3, 2))).eqns
    assert eqn.params["weight_fn"] is hook


def test_values_with_hooks_and_bias() -> None:
    x, w, b = rand(1, (2, 3)), rand(2, (3, 4)), rand(3, (4,))
    got = braintrace.matmul(x, w, b, weight_fn=jnp.tanh, bias_fn=jnp.abs)
    np.testing.assert_allclose(got, x @ jnp.tanh(w) + jnp.abs(b), rtol=1e-6)


def test_units_are_carried_and_stripped() -> None:
    x = jnp.ones((2, 3)) * u.mV
    w = jnp.ones((3, 4)) * u.siemens
    y = braintrace.matmul(x, w, jnp.ones(4) * u.mV * u.siemens)
    assert isinstance(y, u.Quantity) and y.unit == u.mV * u.siemens
    np.testing.assert_allclose(y.to_decimal(u.mV * u.siemens), 4.0)
    plain = braintrace.matmul(jnp.ones((2, 3)), jnp.ones((3, 4)))
    assert not isinstance(plain, u.Quantity)
    with pytest.raises(u.UnitMismatchError):
        braintrace.matmul(x, jnp.ones((3, 4)), jnp.ones(4))


@pytest.mark.parametrize(
    "x, w, b, exc, match",
    [
        (jnp.ones((2, 2, 3)), jnp.ones((3, 4)), None, ValueError, "einsum"),
        (jnp.ones(()), jnp.ones((3, 4)), None, ValueError, "rank"),
        (jnp.ones((2, 3)), jnp.ones(3), None, ValueError, "weight must have rank 2"),
        (jnp.ones((2, 3)), jnp.ones((4, 5)), None, ValueError, r"\(in, out\)"),
        (jnp.ones((2, 3)), jnp.ones((4, 5)), None, TypeError, "last axis of x"),
        (jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones(5), ValueError, "bias of shape"),
        ([[1.0, 2.0, 3.0]], jnp.ones((3, 4)), None, TypeError, "x must be"),
        ([[1.0, 2.0, 3.0]], jnp.ones((3, 4)), None, AttributeError, "x must be"),
    ],
)
def test_bad_input_is_rejected_before_binding(x, w, b, exc, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=match):
        braintrace.matmul(x, w, b)


def test_a_state_object_instead_of_its_value_gets_a_hint() -> None:
    state = brainstate.ParamState(jnp.ones((3, 4)))
    with pytest.raises(TypeError, match=r"weight\.value"):
        braintrace.matmul(jnp.ones(3), state)


def test_non_callable_hook_is_rejected() -> None:
    with pytest.raises(TypeError, match="weight_fn"):
        braintrace.matmul(jnp.ones(3), jnp.ones((3, 4)), weight_fn=2.0)  # type: ignore[arg-type]


def _normalised(w):  # type: ignore[no-untyped-def]
    return w / jnp.linalg.norm(w)


def _softmax(b):  # type: ignore[no-untyped-def]
    return jax.nn.softmax(b, axis=-1)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize(
    "weight_fn, bias_fn",
    [(None, None), (jnp.tanh, None), (_normalised, _softmax)],
    ids=["no-hooks", "tanh", "mixing"],
)
def test_rules_compose_into_an_exact_drtrl_roll(batched: bool, weight_fn, bias_fn) -> None:  # type: ignore[no-untyped-def]
    """``h_t = a ⊙ h_{t-1} + matmul(x_t, W, b)``: D-RTRL with the rules equals BPTT (float32, 1e-5).

    The traces live in the space of the transformed parameters (``instant_drtrl``), and the
    solve (``solve_drtrl``) applies each hook's VJP once, so column-mixing hooks are exact too.
    """
    steps, i_dim, o_dim = 4, 3, 5
    lead = (2,) if batched else ()
    prim = etp_mm_p if batched else etp_mv_p
    params = dict(has_bias=True, weight_fn=weight_fn, bias_fn=bias_fn)
    xs, cs = rand(1, (steps, *lead, i_dim)), rand(2, (steps, *lead, o_dim))
    a = jax.nn.sigmoid(rand(3, (*lead, o_dim)))
    weights = {"weight": rand(4, (i_dim, o_dim)), "bias": rand(5, (o_dim,))}

    def loss(ws):  # type: ignore[no-untyped-def]
        h, total = jnp.zeros((*lead, o_dim)), 0.0
        for t in range(steps):
            h = a * h + braintrace.matmul(
                xs[t], ws["weight"], ws["bias"], weight_fn=weight_fn, bias_fn=bias_fn
            )
            total = total + jnp.sum(cs[t] * h)
        return total

    dt_to_t = reg.ETP_RULES_DT_TO_T[prim]
    inst_rule, solve_rule = reg.get_instant_drtrl_rule(prim), reg.get_solve_drtrl_rule(prim)
    assert inst_rule is not None and solve_rule is not None
    instant = jax.vmap(lambda x, d: inst_rule(x, d, weights, **params)) if batched else (
        lambda x, d: inst_rule(x, d, weights, **params))
    solve = jax.vmap(lambda g, e: solve_rule(g, e, weights, **params)) if batched else (
        lambda g, e: solve_rule(g, e, weights, **params))
    trace = {"weight": jnp.zeros((*lead, i_dim, o_dim)), "bias": jnp.zeros((*lead, o_dim))}
    grad = {k: jnp.zeros_like(v) for k, v in weights.items()}
    for t in range(steps):
        trace = jax.tree.map(jnp.add, dt_to_t(a, trace, **params), instant(xs[t], jnp.ones((*lead, o_dim))))
        step = solve(cs[t], trace)
        grad = jax.tree.map(lambda g, s: g + (s.sum(0) if batched else s), grad, step)
    want = jax.grad(loss)(weights)
    for k in weights:
        np.testing.assert_allclose(grad[k], want[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias_shape", [(1,), (2, 4)], ids=["broadcast", "per-row"])
def test_drtrl_refuses_a_bias_that_is_not_per_output(bias_shape: tuple[int, ...]) -> None:
    class Layer(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = brainstate.ParamState(jnp.ones((3, 4)))
            self.b = brainstate.ParamState(jnp.zeros(bias_shape))

        def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
            self.h = brainstate.HiddenState(jnp.zeros((2, 4)))

        def update(self, x: jax.Array) -> jax.Array:
            self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value, self.b.value)
            return self.h.value

    with pytest.raises(ValueError, match=r"bias of shape .* pass a bias of shape \(4,\)"):
        braintrace.compile(Layer(), braintrace.D_RTRL, jnp.ones((2, 3)), batch_size=2)
