"""Rows for ``etp_elemwise``: identity and element-wise transforms.

The trace of ``etp_elemwise`` lives in the space of the transformed value ``y = f(w)``; the
geometry oracle therefore applies to the untransformed rows, and the transformed rows are
checked by the dedicated tests in ``test_elemwise.py``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from braintrace._op.elemwise import _etp_elemwise_impl, etp_elemwise_p
from tests.op.opcase import OpCase, jac, rand

N = 5


def elemwise_trace(fn: Any, x: Any, ws: dict, params: dict) -> dict:
    """``ε[i] = ∂y[i]/∂w[i]``: the Jacobian diagonal (``y = w`` for the untransformed op)."""
    return {"weight": jnp.diagonal(jac(fn, x, ws)["weight"])}


def _case(name: str, weight_fn: Any = None) -> OpCase:
    return OpCase(
        id=name,
        prim=etp_elemwise_p,
        impl=_etp_elemwise_impl,
        x=None,
        weights={"weight": rand(4, (N,))},
        params=dict(weight_fn=weight_fn),
        trace_of=elemwise_trace if weight_fn is None else None,
        drtrl_shapes={"weight": (N,)},
        hooked=weight_fn is not None,
    )


CASES = [
    _case("elemwise"),
    _case("elemwise-tanh", jnp.tanh),
    _case("elemwise-sigmoid-of-square", lambda w: 1 / (1 + jnp.exp(-(w**2)))),
]
