"""Rows for the seed tutorial's custom ``etp_scaled_mm`` primitive, registered verbatim.

The tutorial's ``dt_to_t`` multiplies the propagated trace by ``scale``; the trace geometry
says the ``y -> W`` link of the recurrence is ``hd`` alone (``scale`` already sits in the
instantaneous term). The rows therefore use ``scale=1``, where the tutorial's rule is exact;
``test_seed_rules.py`` pins the factor-``scale`` deviation for other scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from braintrace import register_primitive
from tests.op.cases.dense import dense_trace
from tests.op.opcase import OpCase, rand


def _scaled_matmul_impl(*args, scale=1.0, has_bias=False):  # type: ignore[no-untyped-def]
    x, w = args[0], args[1]
    y = scale * (x @ w)
    if has_bias:
        y = y + args[2]
    return y


def _scaled_trainable_invars(params):  # type: ignore[no-untyped-def]
    base = {"weight": 1}
    if params.get("has_bias", False):
        base["bias"] = 2
    return base


scaled_mm_p = register_primitive(
    "etp_scaled_mm",
    _scaled_matmul_impl,
    batched=True,
    trainable_invars_fn=_scaled_trainable_invars,
    x_invar_index=0,
)


def _scaled_dt_to_t(hidden_dim, trace, *, scale=1.0, has_bias=False):  # type: ignore[no-untyped-def]
    out = {"weight": trace["weight"] * jnp.expand_dims(hidden_dim, axis=-2) * scale}
    if has_bias:
        out["bias"] = trace["bias"] * hidden_dim
    return out


def _scaled_xy_to_dw(x, hidden_dim, weights, *, scale=1.0, has_bias=False):  # type: ignore[no-untyped-def]
    def _fwd(w_dict):  # type: ignore[no-untyped-def]
        y = scale * (x @ w_dict["weight"])
        if has_bias:
            y = y + w_dict["bias"]
        return y

    _, vjp_fn = jax.vjp(_fwd, weights)
    return vjp_fn(hidden_dim)[0]


def _scaled_init_drtrl(x_var, y_var, weight_vars, num_hidden_state):  # type: ignore[no-untyped-def]
    batch = x_var.aval.shape[0]
    out = {"weight": jnp.zeros((batch, *weight_vars["weight"].aval.shape, num_hidden_state))}
    if "bias" in weight_vars:
        out["bias"] = jnp.zeros((batch, *weight_vars["bias"].aval.shape, num_hidden_state))
    return out


def _scaled_init_pp(x_var, y_var, weight_vars, num_hidden_state):  # type: ignore[no-untyped-def]
    return jnp.zeros((*y_var.aval.shape, num_hidden_state), dtype=y_var.aval.dtype)


scaled_mm_p.register_etp_rules(
    dt_to_t=_scaled_dt_to_t,
    xy_to_dw=_scaled_xy_to_dw,
    init_drtrl=_scaled_init_drtrl,
    init_pp=_scaled_init_pp,
)


def _case(name: str, bias: bool, scale: float) -> OpCase:
    weights = {"weight": rand(2, (3, 4))}
    if bias:
        weights["bias"] = rand(3, (4,))
    shapes = {"weight": (2, 3, 4)}
    if bias:
        shapes["bias"] = (2, 4)
    return OpCase(
        id=name,
        prim=scaled_mm_p,
        impl=_scaled_matmul_impl,
        x=rand(1, (2, 3)),
        weights=weights,
        params=dict(scale=scale, has_bias=bias),
        trace_of=dense_trace,
        drtrl_shapes=shapes,
    )


CASES = [_case("seed-scaled-mm", False, 1.0), _case("seed-scaled-mm-bias", True, 1.0)]
