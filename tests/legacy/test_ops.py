"""The deprecated operator classes give the same numbers as the ETP functions and plain JAX."""

from __future__ import annotations

from typing import Any

import brainevent
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._legacy import (
    ConvOp,
    ElemWiseOp,
    ETraceOp,
    LoraOp,
    MatMulOp,
    SpMatMulOp,
    general_y2w,
    stop_param_gradients,
)
from braintrace._op.conv import conv
from tests.nn.helpers import normal

X = normal(0, (2, 3))
W = normal(1, (3, 4))
B = normal(2, (4,))
MASK = (jnp.arange(12).reshape(3, 4) % 3 > 0).astype(float)


def shift(w: jax.Array) -> jax.Array:
    return w + 1.0


def close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# --- MatMulOp -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, effective",
    [
        ({}, W),
        ({"weight_mask": MASK}, W * MASK),
        ({"weight_fn": shift}, W + 1.0),
        ({"weight_mask": MASK, "weight_fn": shift}, W * MASK + 1.0),
        ({"weight_mask": MASK, "weight_fn": shift, "apply_weight_fn_before_mask": True}, (W + 1.0) * MASK),
    ],
)
@pytest.mark.parametrize("bias", [None, B])
def test_matmul_op(kwargs: dict, effective: jax.Array, bias: Any) -> None:
    op = MatMulOp(**kwargs)
    weights = {"weight": W} if bias is None else {"weight": W, "bias": B}
    expected = X @ effective + (0.0 if bias is None else B)
    close(op(X, weights), expected)
    close(op.raw_xw_to_y(X, weights), expected)
    close(op(X[0], weights), expected[0])
    new_api = braintrace.matmul(X, effective, bias)
    close(op(X, weights), new_api)


def test_matmul_op_runs_the_transform_inside_the_primitive() -> None:
    op = MatMulOp(weight_mask=MASK, weight_fn=shift)
    eqns = jax.make_jaxpr(lambda w: op(X, {"weight": w}))(W).jaxpr.eqns
    assert [e.primitive.name for e in eqns] == ["etp_mm"]
    # gradients are with respect to the raw weight: zero where masked
    g = jax.grad(lambda w: op(X, {"weight": w}).sum())(W)
    assert np.all(np.asarray(g)[np.asarray(MASK) == 0] == 0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"weight_mask": [[1.0]]}, TypeError, "weight_mask must be a NumPy/JAX array"),
        ({"weight_mask": jnp.ones((3, 4)) * u.mV}, ValueError, "weight_mask must be unitless"),
        ({"weight_fn": 3}, TypeError, "weight_fn must be callable"),
        ({"apply_weight_fn_before_mask": 1}, TypeError, "apply_weight_fn_before_mask must be a bool"),
    ],
)
def test_matmul_op_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        MatMulOp(**kwargs)


def test_dict_weights_are_checked() -> None:
    with pytest.raises(TypeError, match="MatMulOp: the weights must be a dict"):
        MatMulOp()(X, W)
    with pytest.raises(ValueError, match=r"MatMulOp: the weight dict is missing \['weight'\]"):
        MatMulOp()(X, {"w": W})
    with pytest.raises(ValueError, match=r"LoraOp: the weight dict is missing \['A'\]"):
        LoraOp()(X, {"B": W})


def test_matmul_op_keeps_units() -> None:
    y = MatMulOp()(X * u.mV, {"weight": W})
    assert u.get_unit(y) == u.mV
    close(u.get_mantissa(y), X @ W)
    close(u.get_mantissa(MatMulOp().raw_xw_to_y(X * u.mV, {"weight": W})), X @ W)


# --- ElemWiseOp -----------------------------------------------------------------------------


def test_elemwise_op() -> None:
    w = normal(3, (4,))
    op = ElemWiseOp(jnp.tanh)
    assert op.is_diagonal and not MatMulOp().is_diagonal
    close(op(w), jnp.tanh(w))
    close(op.xw_to_y(None, w), braintrace.element_wise(w, weight_fn=jnp.tanh))
    close(op.raw_xw_to_y(X, w), jnp.tanh(w))
    assert [e.primitive.name for e in jax.make_jaxpr(op)(w).jaxpr.eqns] == ["etp_elemwise"]
    close(ElemWiseOp()(w), w)
    with pytest.raises(TypeError, match="ElemWiseOp: fn must be callable"):
        ElemWiseOp("tanh")


# --- ConvOp ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dn, x_shape, k_shape",
    [(None, (2, 2, 7), (3, 2, 3)), (("NWC", "WIO", "NWC"), (2, 7, 2), (3, 2, 3))],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_op(dn: Any, x_shape: tuple, k_shape: tuple, with_bias: bool) -> None:
    x, k, b = normal(4, x_shape), normal(5, k_shape), normal(6, (3,))
    mask = (jnp.arange(np.prod(k_shape)).reshape(k_shape) % 2).astype(float)
    op = ConvOp(None, (2,), "SAME", dimension_numbers=dn, weight_mask=mask, weight_fn=jnp.tanh)
    weights = {"weight": k, "bias": b} if with_bias else {"weight": k}
    expected = conv(x, jnp.tanh(k * mask), b if with_bias else None, strides=(2,), padding="SAME", dimension_numbers=dn)
    close(op(x, weights), expected)
    close(op.raw_xw_to_y(x, weights), expected)


def test_conv_op_raw_path_is_plain_jax() -> None:
    op = ConvOp(None, 1, "VALID", rhs_dilation=2)
    x, k = normal(7, (1, 1, 9)), normal(8, (2, 1, 3))
    close(op.raw_xw_to_y(x, {"weight": k}), jax.lax.conv_general_dilated(x, k, (1,), "VALID", rhs_dilation=(2,)))
    names = [e.primitive.name for e in jax.make_jaxpr(lambda k: op.raw_xw_to_y(x, {"weight": k}))(k).jaxpr.eqns]
    assert "etp_conv" not in names and "conv_general_dilated" in names


# --- SpMatMulOp -----------------------------------------------------------------------------


def test_sparse_op() -> None:
    csr = brainevent.CSR.fromdense(W * MASK)
    op = SpMatMulOp(csr, weight_fn=jnp.abs)
    weights = {"weight": csr.data, "bias": B}
    expected = X @ jnp.abs(W * MASK) + B
    close(op(X, weights), expected)
    close(op.raw_xw_to_y(X, weights), expected)
    close(op(X, weights), braintrace.sparse_matmul(X, jnp.abs(csr.data), sparse_mat=csr, bias=B))
    with pytest.raises(TypeError, match="SpMatMulOp: sparse_mat must be a brainunit.sparse.SparseMatrix"):
        SpMatMulOp(W)


# --- LoraOp ---------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [None, 2.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_lora_op(alpha: Any, with_bias: bool) -> None:
    b_fac, a_fac = normal(9, (3, 2)), normal(10, (2, 4))
    op = LoraOp(alpha)
    weights = {"B": b_fac, "A": a_fac, **({"bias": B} if with_bias else {})}
    scale = 1.0 if alpha is None else alpha
    expected = scale * X @ b_fac @ a_fac + (B if with_bias else 0.0)
    close(op(X, weights), expected)
    close(op.raw_xw_to_y(X, weights), expected)
    close(op(X, weights), braintrace.lora_matmul(X, b_fac, a_fac, alpha=scale, bias=B if with_bias else None))
    assert (op.alpha is None) == (alpha is None)


# --- shared methods and helpers -------------------------------------------------------------


def test_base_op() -> None:
    class Twice(ETraceOp):
        def xw_to_y(self, inputs: Any, weights: Any) -> Any:
            return 2 * inputs * weights

    op = Twice()
    close(op(X, 3.0), 6 * X)
    close(op.raw_xw_to_y(X, 3.0), 6 * X)
    with pytest.raises(NotImplementedError):
        ETraceOp()(X, W)
    with pytest.raises(NotImplementedError, match="dt_to_t is not available"):
        MatMulOp().dt_to_t(X, {"weight": W})


def test_xy_to_dw_is_the_vjp() -> None:
    op = MatMulOp(weight_fn=jnp.tanh)
    weights = {"weight": W, "bias": B}
    cot = normal(11, (2, 4))
    _, pullback = jax.vjp(lambda w: op(X, w), weights)
    expected = pullback(cot)[0]
    got = op.xy_to_dw(X, cot, weights)
    close(got["weight"], expected["weight"])
    close(got["bias"], expected["bias"])
    with pytest.raises(ValueError, match=r"hidden_dim_arr has shape \(4,\)"):
        op.xy_to_dw(X, cot[0], weights)


def test_general_y2w() -> None:
    y = normal(12, (2, 4))
    got = general_y2w(lambda x, w: x @ w, X, y, W)
    close(got, jnp.ones((2, 3)).T @ y)
    with pytest.raises(ValueError, match=r"general_y2w: y has shape \(4,\)"):
        general_y2w(lambda x, w: x @ w, X, y[0], W)


def test_stop_param_gradients_has_no_effect() -> None:
    def grad() -> jax.Array:
        return jax.grad(lambda w: MatMulOp()(X, {"weight": w}).sum())(W)

    outside = grad()
    with stop_param_gradients():
        inside = grad()
        with stop_param_gradients(False):
            nested = grad()
    close(inside, outside)
    close(nested, outside)
