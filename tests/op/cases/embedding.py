"""Rows for ``etp_emb`` / ``etp_emb_v``: plain lookups and lookups through a table transform.

Indices stay below ``V // 2`` so that the vmap oracle's ``2 * x`` is still a valid row.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from braintrace._op.embedding import _etp_embedding_impl, etp_emb_p, etp_emb_v_p
from tests.op.opcase import OpCase, jac_transformed, mix_all

V, D = 10, 4


def rand(seed: int, shape: tuple[int, ...]) -> Any:
    """A deterministic normal sample drawn by NumPy (no per-shape XLA compile at import)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def embedding_trace(fn: Any, x: Any, ws: dict, params: dict) -> dict:
    """``ε[..., v, d] = ∂y[..., d]/∂U[v, d]`` with ``U = weight_fn(T)`` (zero off the looked-up row)."""
    j = jac_transformed(fn, x, ws, params)["weight"]
    return {"weight": jnp.einsum("bdvd->bvd" if x.ndim == 1 else "dvd->vd", j)}


def _case(name: str, indices: Any, weight_fn: Any = None) -> OpCase:
    x = jnp.asarray(indices, jnp.int32)
    lead = tuple(x.shape)
    return OpCase(
        id=name,
        prim=etp_emb_p if x.ndim == 1 else etp_emb_v_p,
        impl=_etp_embedding_impl,
        x=x,
        weights={"weight": rand(41, (V, D))},
        params=dict(weight_fn=weight_fn),
        trace_of=embedding_trace,
        drtrl_shapes={"weight": (*lead, V, D)},
        hooked=weight_fn is not None,
    )


CASES = [
    _case("emb", [1, 4, 1]),  # a repeated row: the per-sample traces stay separate
    _case("emb_v", 3),
    _case("emb-tanh", [0, 2, 4], weight_fn=jnp.tanh),
    _case("emb_v-square", 2, weight_fn=lambda t: t**2),
    # A hook that mixes entries across features and rows.
    _case("emb-mixing", [1, 3, 1], weight_fn=mix_all),
    _case("emb_v-mixing", 4, weight_fn=mix_all),
]
