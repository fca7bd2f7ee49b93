"""Rows for ``etp_conv``: 1-, 2- and 3-D, default / channel-last / explicit layouts, strides,
dilations, feature groups, bias shapes and transform hooks.

The trace geometry is read off the full Jacobian with JAX's own layout resolution
(``lax.conv_dimension_numbers``): the kernel trace keeps, at every output position, the
derivative of that position's output channel ``o`` with respect to each kernel entry whose
out-axis index is ``o``; the bias trace keeps, at every output entry, the derivative with
respect to the one bias entry broadcast onto it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from braintrace._op.conv import _etp_conv_impl, etp_conv_p
from tests.op.opcase import OpCase, jac, rand

B = 2


def _bias_index(bias_shape: tuple[int, ...], y_shape: tuple[int, ...], channel: int) -> np.ndarray:
    """For every output entry, the flat index of the bias entry added to it."""
    if len(bias_shape) == 1:
        on_output = [1] * len(y_shape)
        on_output[channel] = bias_shape[0]
    else:
        on_output = list(bias_shape)
    flat = np.arange(int(np.prod(bias_shape))).reshape(on_output)
    return np.broadcast_to(flat, y_shape)


def conv_trace(fn: Any, x: Any, ws: dict, params: dict) -> dict:
    """``ε_K[b, *s, κ] = ∂y[b, s, o(κ)]/∂K[κ]``; ``ε_b[b, pos] = ∂y[b, pos]/∂b[β(pos)]``."""
    # The Jacobian in one compilation; the selection in NumPy (XLA on CPU, jaxlib 0.10.2, corrupts
    # memory when it fuses this masked reduction with the Jacobian).
    j = jax.tree.map(np.asarray, jax.jit(partial(jac, fn))(x, ws))
    kernel = ws["weight"]
    dn = lax.conv_dimension_numbers(x.shape, kernel.shape, params["dimension_numbers"])
    channel, k_out = dn.out_spec[1], dn.rhs_spec[0]
    jk = j["weight"]
    y_ndim = jk.ndim - kernel.ndim
    jk = np.moveaxis(jk, channel, y_ndim - 1)  # (B, *s, C_out, *K)
    c_out = jk.shape[y_ndim - 1]
    own = np.arange(c_out).reshape([c_out] + [1] * kernel.ndim) == np.arange(
        kernel.shape[k_out]
    ).reshape([1] + [kernel.shape[k_out] if a == k_out else 1 for a in range(kernel.ndim)])
    out = {"weight": jnp.asarray((jk * own).sum(axis=y_ndim - 1))}
    if "bias" in ws:
        jb = j["bias"]
        y_shape = jb.shape[:y_ndim]
        idx = _bias_index(ws["bias"].shape, y_shape, channel)
        flat = jb.reshape(*y_shape, -1)
        out["bias"] = jnp.asarray(np.take_along_axis(flat, idx[..., None], axis=-1)[..., 0])
    return out


def _case(
    name: str,
    x_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    bias_shape: tuple[int, ...] | None = None,
    **kw: Any,
) -> OpCase:
    x = rand(1, x_shape)
    weights = {"weight": 0.5 * rand(2, k_shape)}
    if bias_shape is not None:
        weights["bias"] = rand(3, bias_shape)
    params = dict(
        has_bias=bias_shape is not None,
        strides=kw.get("strides", (1,) * (len(k_shape) - 2)),
        padding=kw.get("padding", "SAME"),
        lhs_dilation=kw.get("lhs_dilation"),
        rhs_dilation=kw.get("rhs_dilation"),
        feature_group_count=kw.get("feature_group_count", 1),
        batch_group_count=1,
        dimension_numbers=kw.get("dimension_numbers"),
        kernel_fn=kw.get("kernel_fn"),
        bias_fn=kw.get("bias_fn"),
    )
    y_shape = _etp_conv_impl(x, *weights.values(), **params).shape
    dn = lax.conv_dimension_numbers(x_shape, k_shape, params["dimension_numbers"])
    spatial = tuple(n for a, n in enumerate(y_shape) if a not in (dn.out_spec[0], dn.out_spec[1]))
    shapes = {"weight": (B, *spatial, *k_shape)}
    if bias_shape is not None:
        shapes["bias"] = (B, *y_shape[1:])
    return OpCase(
        id=name,
        prim=etp_conv_p,
        impl=_etp_conv_impl,
        x=x,
        weights=weights,
        params=params,
        trace_of=conv_trace,
        drtrl_shapes=shapes,
        hooked=params["kernel_fn"] is not None or params["bias_fn"] is not None,
        init_kwargs={"eqn_params": params},
    )


def _square(w: Any) -> Any:
    return w**2


NHWC = ("NHWC", "HWIO", "NHWC")
# Batch 0, channel last, and the two spatial axes of the output swapped ("NWHC").
PERMUTED = lax.ConvDimensionNumbers(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 2, 1))

CASES = [
    _case("conv1d", (B, 2, 5), (3, 2, 3)),
    # Spatial size == out channels: a rank-1 bias must still run along the channel axis.
    _case("conv1d-bias", (B, 2, 3), (3, 2, 3), (3,)),
    _case("conv2d-nchw-bias", (B, 2, 4, 4), (3, 2, 3, 3), (3,)),
    _case("conv2d-nhwc-bias", (B, 4, 5, 2), (3, 3, 2, 3), (3,), dimension_numbers=NHWC),
    _case("conv2d-permuted-dimnums-bias", (B, 4, 5, 2), (2, 3, 2, 3), (3,), dimension_numbers=PERMUTED),
    _case("conv1d-stride2-valid-bias", (B, 2, 5), (3, 2, 2), (3,), strides=(2,), padding="VALID"),
    _case("conv1d-rhs-dilation", (B, 2, 5), (3, 2, 2), (3,), rhs_dilation=(2,)),
    _case("conv2d-lhs-dilation-stride-pairs", (B, 2, 3, 4), (2, 2, 2, 3), strides=(2, 1),
          padding=((1, 0), (1, 1)), lhs_dilation=(2, 1)),
    _case("conv1d-groups2-bias", (B, 4, 5), (4, 2, 3), (4,), feature_group_count=2),
    _case("conv1d-kernel-tanh-bias", (B, 2, 5), (3, 2, 3), (3,), kernel_fn=jnp.tanh),
    _case("conv1d-bias-fn", (B, 2, 5), (3, 2, 3), (3,), bias_fn=jnp.tanh),
    _case("conv1d-bias-per-position-square", (B, 2, 4), (3, 2, 3), (3, 4), bias_fn=_square),
    _case("conv2d-nhwc-bias-per-row", (B, 3, 4, 2), (2, 2, 2, 3), (3, 1, 3), dimension_numbers=NHWC),
    _case("conv3d-bias", (B, 2, 3, 3, 3), (2, 2, 2, 2, 2), (2,)),
]
