"""Rows for ``etp_einsum``: dense-like, per-head, shared-axis and mixed equations, with hooks.

The trace keeps ``ε[b, *s, *w] = ∂y[b, y(d(w), s)] / ∂V[w]`` with ``V = f_W(W)``: one entry per
batch row, shared position and weight entry. ``einsum_trace`` reads it off the full Jacobian
by a diagonal extraction (a weight's diagonal letters repeated on the output side). With a
transform the Jacobian is taken with respect to ``V`` by the chain rule,
``∂y/∂V = ∂y/∂W · (∂V/∂W)⁻¹``, which needs an invertible transform (``tanh``, an
invertible linear mixing).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._op.einsum import _etp_einsum_impl, etp_einsum_p, parse_etp_einsum
from tests.op.opcase import OpCase, jac, rand

B, T, S2, C, H, K, N = 2, 2, 3, 2, 2, 3, 4
SIZES = {"b": B, "t": T, "s": S2, "c": C, "h": H, "k": K, "n": N}


def einsum_trace(fn: Any, x: Any, ws: dict, params: dict) -> dict:
    """``ε[b, *s, *w] = ∂y[b, y(d(w), s)] / ∂V[w]`` from the full Jacobian."""
    spec = parse_etp_einsum(params["equation"])
    j = jac(fn, x, ws)["weight"]
    hook = params.get("weight_fn")
    if hook is not None:
        w = ws["weight"]
        jf = np.asarray(jax.jacrev(hook)(w), np.float64).reshape(w.size, w.size)
        jw = np.asarray(j, np.float64).reshape(-1, w.size)
        j = jnp.asarray((jw @ np.linalg.inv(jf)).reshape(j.shape), dtype=j.dtype)
    batched = x.ndim == len(spec.x_spec)
    y_letters = spec.y_spec if batched else spec.y_spec[1:]
    out = (spec.batch if batched else "") + spec.shared + spec.w_spec
    return {"weight": jnp.einsum(f"{y_letters}{spec.w_spec}->{out}", j)}


def mix_last(w: Any) -> Any:
    """An invertible linear transform that couples neighbouring entries along the last axis."""
    return w + 0.5 * jnp.roll(w, 1, axis=-1)


def _case(name: str, equation: str, weight_fn: Any = None, pass_eqn_params: bool = True) -> OpCase:
    spec = parse_etp_einsum(equation)
    params = dict(equation=equation, weight_fn=weight_fn)
    trace_shape = tuple(SIZES[c] for c in spec.batch + spec.shared + spec.w_spec)
    return OpCase(
        id=name,
        prim=etp_einsum_p,
        impl=_etp_einsum_impl,
        x=rand(1, tuple(SIZES[c] for c in spec.x_spec)),
        weights={"weight": 0.5 * rand(2, tuple(SIZES[c] for c in spec.w_spec))},
        params=params,
        trace_of=einsum_trace,
        drtrl_shapes={"weight": trace_shape},
        hooked=weight_fn is not None,
        init_kwargs={"eqn_params": params} if pass_eqn_params else {},
    )


CASES = [
    # Without shared letters init_drtrl needs no eqn_params (upstream's four-argument call).
    _case("einsum-dense", "bk,kn->bn", pass_eqn_params=False),
    _case("einsum-per-head", "bhk,hkn->bhn"),
    _case("einsum-shared", "btk,kn->btn"),
    _case("einsum-two-shared", "btsk,kn->bstn"),
    _case("einsum-mixed", "bcthk,khn->bnht"),
    _case("einsum-shared-tanh", "btk,kn->btn", weight_fn=jnp.tanh),
    _case("einsum-mixed-coupled", "bcthk,khn->bnht", weight_fn=mix_last),
]
