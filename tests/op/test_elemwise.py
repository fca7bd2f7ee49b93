"""``braintrace.element_wise``: signature, transforms, units, and exactness of the ``y``-space trace."""

from __future__ import annotations

import inspect

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._op import _registries as reg
from braintrace._op import etp_elemwise_p
from tests.op.opcase import rand


def _normalise(w):  # type: ignore[no-untyped-def]
    """A transform that couples every entry: the Jacobian is dense."""
    return w / jnp.linalg.norm(w)


def test_signature_and_the_removed_fn_keyword() -> None:
    sig = inspect.signature(braintrace.element_wise)
    assert list(sig.parameters) == ["weight", "weight_fn"]
    assert sig.parameters["weight_fn"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError):
        braintrace.element_wise(jnp.ones(3), fn=jnp.tanh)  # type: ignore[call-arg]


def test_identity_output_and_the_equation() -> None:
    w = rand(1, (4,))
    assert np.array_equal(braintrace.element_wise(w), w)
    (eqn,) = jax.make_jaxpr(lambda w: braintrace.element_wise(w, weight_fn=jnp.tanh))(w).eqns
    assert eqn.primitive is etp_elemwise_p and eqn.params["weight_fn"] is jnp.tanh
    assert reg.get_trainable_invars(etp_elemwise_p, eqn.params) == {"weight": 0}
    assert reg.get_x_invar_index(etp_elemwise_p) is None
    assert reg.GRADIENT_ENABLED_PRIMITIVES >= {etp_elemwise_p}


def test_units() -> None:
    y = braintrace.element_wise(jnp.ones(3) * u.mV)
    assert isinstance(y, u.Quantity) and y.unit == u.mV


def test_shape_changing_transform_is_rejected() -> None:
    with pytest.raises(ValueError, match="preserve the parameter's shape"):
        braintrace.element_wise(jnp.ones(3), weight_fn=jnp.sum)


def test_xy_to_dw_keeps_extra_leading_axes() -> None:
    w, hd = rand(1, (4,)), rand(2, (3, 4))
    plain = reg.ETP_RULES_XY_TO_DW[etp_elemwise_p](None, hd, {"weight": w}, weight_fn=None)
    assert np.array_equal(plain["weight"], hd)
    tanh = reg.ETP_RULES_XY_TO_DW[etp_elemwise_p](None, hd, {"weight": w}, weight_fn=jnp.tanh)
    np.testing.assert_allclose(tanh["weight"], hd * (1 - jnp.tanh(w) ** 2), rtol=1e-6)


def test_xy_to_dw_is_the_exact_vjp_for_a_coupling_transform() -> None:
    w, hd = rand(1, (4,)), rand(2, (4,))
    got = reg.ETP_RULES_XY_TO_DW[etp_elemwise_p](None, hd, {"weight": w}, weight_fn=_normalise)
    want = jax.vjp(_normalise, w)[1](hd)[0]
    np.testing.assert_allclose(got["weight"], want, rtol=1e-6)


@pytest.mark.parametrize("weight_fn", [None, jnp.tanh, _normalise, jax.nn.softmax], ids=["id", "tanh", "normalise", "softmax"])
@pytest.mark.parametrize("lead", [(), (2,)], ids=["unbatched", "batched-hidden"])
def test_drtrl_roll_with_the_y_space_trace_equals_bptt(weight_fn, lead) -> None:  # type: ignore[no-untyped-def]
    """``h_t = a ⊙ h_{t-1} + x_t ⊙ f(w)``: exact for any transform, coupling ones included (1e-5)."""
    steps, n = 4, 5
    xs, cs = rand(1, (steps, *lead, n)), rand(2, (steps, *lead, n))
    a = jax.nn.sigmoid(rand(3, (*lead, n)))
    w = rand(4, (n,))

    def loss(w):  # type: ignore[no-untyped-def]
        h, total = jnp.zeros((*lead, n)), 0.0
        for t in range(steps):
            h = a * h + xs[t] * braintrace.element_wise(w, weight_fn=weight_fn)
            total = total + jnp.sum(cs[t] * h)
        return total

    params = dict(weight_fn=weight_fn)
    dt_to_t = reg.ETP_RULES_DT_TO_T[etp_elemwise_p]
    instant = reg.ETP_RULES_INSTANT_DRTRL[etp_elemwise_p]
    solve = reg.ETP_RULES_SOLVE_DRTRL[etp_elemwise_p]
    trace, grad = {"weight": jnp.zeros((*lead, n))}, jnp.zeros(n)
    for t in range(steps):
        # df = ∂h_t/∂y = x_t: the y -> h tail of this model.
        trace = jax.tree.map(jnp.add, dt_to_t(a, trace, **params), instant(None, xs[t], {"weight": w}, **params))
        step = solve(cs[t], trace, {"weight": w}, **params)["weight"]
        grad = grad + step.reshape(-1, n).sum(0)
    np.testing.assert_allclose(grad, jax.grad(loss)(w), rtol=1e-5, atol=1e-5)
