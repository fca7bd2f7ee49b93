"""Rows for ``etp_mm`` / ``etp_mv``: with and without bias, with each transform hook (mixing ones too)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from braintrace._op.dense import _etp_matmul_impl, etp_mm_p, etp_mv_p
from tests.op.opcase import OpCase, jac_transformed, mix_all, rand

I, O, B = 3, 4, 2


def dense_trace(fn: Any, x: Any, ws: dict, params: dict) -> dict:
    """``ε_W[..., i, o] = ∂y[..., o]/∂V[i, o]``, ``ε_b[..., o] = ∂y[..., o]/∂c[o]``.

    ``V = weight_fn(W)`` and ``c = bias_fn(b)``: the trace lives in the transformed space.
    """
    j = jac_transformed(fn, x, ws, params)
    batched = x.ndim == 2
    out = {"weight": jnp.einsum("boio->bio" if batched else "oio->io", j["weight"])}
    if "bias" in ws:
        out["bias"] = jnp.einsum("boo->bo" if batched else "oo->o", j["bias"])
    return out


def _case(name: str, batched: bool, bias: bool, weight_fn: Any = None, bias_fn: Any = None) -> OpCase:
    x = rand(1, (B, I) if batched else (I,))
    weights = {"weight": rand(2, (I, O))}
    if bias:
        weights["bias"] = rand(3, (O,))
    lead = (B,) if batched else ()
    shapes = {"weight": (*lead, I, O)}
    if bias:
        shapes["bias"] = (*lead, O)
    return OpCase(
        id=name,
        prim=etp_mm_p if batched else etp_mv_p,
        impl=_etp_matmul_impl,
        x=x,
        weights=weights,
        params=dict(has_bias=bias, weight_fn=weight_fn, bias_fn=bias_fn),
        trace_of=dense_trace,
        drtrl_shapes=shapes,
        hooked=weight_fn is not None or bias_fn is not None,
    )


def _square(w: Any) -> Any:
    return w**2


CASES = [
    _case("mm", True, False),
    _case("mm-bias", True, True),
    _case("mv", False, False),
    _case("mv-bias", False, True),
    _case("mm-bias-square", True, True, weight_fn=_square),
    _case("mm-bias-tanh-tanh", True, True, weight_fn=jnp.tanh, bias_fn=jnp.tanh),
    _case("mm-abs", True, False, weight_fn=jnp.abs),
    _case("mv-bias-tanh", False, True, weight_fn=jnp.tanh, bias_fn=_square),
    # Hooks that mix entries across output columns: exact only with transformed-space traces.
    _case("mm-bias-mixing", True, True, weight_fn=mix_all, bias_fn=mix_all),
    _case("mv-mixing", False, False, weight_fn=mix_all),
]
