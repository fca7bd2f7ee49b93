"""Rows for ``etp_gmm`` / ``etp_gmv``: with and without bias, with each transform hook."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from braintrace._op.grouped import _etp_grouped_matmul_impl, etp_gmm_p, etp_gmv_p
from tests.op.opcase import OpCase, jac_transformed, mix_all

B, G, K, N = 2, 3, 4, 5


def rand(seed: int, shape: tuple[int, ...]) -> Any:
    """A deterministic normal sample drawn by NumPy (no per-shape XLA compile at import)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def grouped_trace(fn: Any, x: Any, ws: dict, params: dict) -> dict:
    """``ε_W[..., g, k, n] = ∂y[..., g, n]/∂V[g, k, n]``, ``ε_b[..., g, n] = ∂y[..., g, n]/∂c[g, n]``.

    ``V = weight_fn(W)`` and ``c = bias_fn(b)``: the trace lives in the transformed space.
    """
    j = jac_transformed(fn, x, ws, params)
    batched = x.ndim == 3
    out = {"weight": jnp.einsum("bgngkn->bgkn" if batched else "gngkn->gkn", j["weight"])}
    if "bias" in ws:
        out["bias"] = jnp.einsum("bgngn->bgn" if batched else "gngn->gn", j["bias"])
    return out


def _case(name: str, batched: bool, bias: bool, weight_fn: Any = None, bias_fn: Any = None) -> OpCase:
    weights = {"weight": rand(32, (G, K, N))}
    if bias:
        weights["bias"] = rand(33, (G, N))
    lead = (B,) if batched else ()
    shapes = {"weight": (*lead, G, K, N)}
    if bias:
        shapes["bias"] = (*lead, G, N)
    return OpCase(
        id=name,
        prim=etp_gmm_p if batched else etp_gmv_p,
        impl=_etp_grouped_matmul_impl,
        x=rand(31, (*lead, G, K)),
        weights=weights,
        params=dict(has_bias=bias, weight_fn=weight_fn, bias_fn=bias_fn),
        trace_of=grouped_trace,
        drtrl_shapes=shapes,
        hooked=weight_fn is not None or bias_fn is not None,
    )


def _square(w: Any) -> Any:
    return w**2


CASES = [
    _case("gmm", True, False),
    _case("gmm-bias", True, True),
    _case("gmv", False, False),
    _case("gmv-bias", False, True),
    _case("gmm-bias-square-tanh", True, True, weight_fn=_square, bias_fn=jnp.tanh),
    _case("gmm-abs", True, False, weight_fn=jnp.abs),
    _case("gmv-bias-tanh", False, True, weight_fn=jnp.tanh, bias_fn=_square),
    # Hooks that mix entries across outputs and groups.
    _case("gmm-bias-mixing", True, True, weight_fn=mix_all, bias_fn=mix_all),
    _case("gmv-mixing", False, False, weight_fn=mix_all),
]
