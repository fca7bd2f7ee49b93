"""Rows for ``etp_sp_mm`` / ``etp_sp_mv``: CSR with and without bias, each hook, and a CSC and
a fixed-number-per-row structure (other nnz orders and a 2-D ``data``)."""

from __future__ import annotations

from typing import Any

import brainevent
import jax.numpy as jnp
import numpy as np

from braintrace._op.sparse import _etp_sp_matmul_impl, _HashableSparseMat, etp_sp_mm_p, etp_sp_mv_p
from tests.op.opcase import OpCase, jac_transformed, mix_all, rand

I, O, B = 4, 5, 2

#: A fixed (in, out) pattern with 8 non-zeros: column 3 receives nothing, row 1 sends to three
#: columns, so a row/column mix-up or an off-by-one gather shows.
MASK = np.array(
    [
        [1, 0, 1, 0, 0],
        [0, 1, 1, 0, 1],
        [1, 0, 0, 0, 0],
        [0, 1, 0, 0, 1],
    ],
    dtype=bool,
)
DENSE = np.where(MASK, np.asarray(rand(40, (I, O))), 0.0).astype(np.float32)
CSR = brainevent.CSR.fromdense(jnp.asarray(DENSE))
CSC = brainevent.CSC.fromdense(jnp.asarray(DENSE))
#: Two connections per input row; ``data`` is ``(I, 2)``.
FCN_DENSE = np.array(
    [[0.5, 0, -1.0, 0, 0], [0, 2.0, 0, 0, 1.5], [0.3, 0, 0, 0.7, 0], [0, 0, 1.1, 0, -0.4]],
    dtype=np.float32,
)
FCN = brainevent.FixedNumPerPre.fromdense(jnp.asarray(FCN_DENSE))


def columns(mat: Any) -> np.ndarray:
    """``col(p)`` for every stored entry, shaped like ``mat.data``.

    Read off ``todense`` of the structure holding ``p + 1`` at entry ``p``, so it does not
    depend on how the structure stores its indices.
    """
    key = id(mat)
    if key not in _COLUMNS:
        shape = tuple(mat.data.shape)
        size = int(np.prod(shape))
        tags = jnp.arange(1, size + 1, dtype=mat.data.dtype).reshape(shape)
        dense = np.asarray(mat.with_data(tags).todense())
        rows, cols = np.nonzero(dense)
        assert rows.size == size, "every stored entry sits at its own (row, col)"
        out = np.empty(size, np.int32)
        out[dense[rows, cols].astype(np.int64) - 1] = cols
        _COLUMNS[key] = out.reshape(shape)
    return _COLUMNS[key]


_COLUMNS: dict[int, np.ndarray] = {}


def sparse_trace(fn: Any, x: Any, ws: dict, params: dict) -> dict:
    """``ε_w[..., p] = ∂y[..., col(p)]/∂V[p]``, ``ε_b[..., o] = ∂y[..., o]/∂c[o]``.

    ``V = weight_fn(data)`` and ``c = bias_fn(b)``: the trace lives in the transformed space.
    """
    j = jac_transformed(fn, x, ws, params)
    cols = columns(params["sparse_mat"].mat).reshape(-1)
    batched = x.ndim == 2
    jw = j["weight"]  # (*y, *nnz)
    lead = jw.shape[: 2 if batched else 1]
    jw = jw.reshape(*lead, cols.size)
    p = np.arange(cols.size)
    picked = jw[:, cols, p] if batched else jw[cols, p]
    out = {"weight": picked.reshape(*lead[:-1], *ws["weight"].shape)}
    if "bias" in ws:
        out["bias"] = jnp.einsum("boo->bo" if batched else "oo->o", j["bias"])
    return out


def _case(
    name: str,
    batched: bool,
    bias: bool,
    weight_fn: Any = None,
    bias_fn: Any = None,
    mat: Any = CSR,
) -> OpCase:
    x = rand(1, (B, I) if batched else (I,))
    weights = {"weight": rand(2, tuple(mat.data.shape))}
    if bias:
        weights["bias"] = rand(3, (O,))
    lead = (B,) if batched else ()
    shapes = {"weight": (*lead, *mat.data.shape)}
    if bias:
        shapes["bias"] = (*lead, O)
    return OpCase(
        id=name,
        prim=etp_sp_mm_p if batched else etp_sp_mv_p,
        impl=_etp_sp_matmul_impl,
        x=x,
        weights=weights,
        params=dict(
            sparse_mat=_HashableSparseMat(mat), has_bias=bias, weight_fn=weight_fn, bias_fn=bias_fn
        ),
        trace_of=sparse_trace,
        drtrl_shapes=shapes,
        hooked=weight_fn is not None or bias_fn is not None,
    )


def _square(w: Any) -> Any:
    return w**2


CASES = [
    _case("sp_mm", True, False),
    _case("sp_mm-bias", True, True),
    _case("sp_mv", False, False),
    _case("sp_mv-bias", False, True),
    _case("sp_mm-tanh", True, False, weight_fn=jnp.tanh),
    _case("sp_mv-bias-tanh-square", False, True, weight_fn=jnp.tanh, bias_fn=_square),
    _case("sp_mm-bias-square-csc", True, True, bias_fn=_square, mat=CSC),
    _case("sp_mv-fixed-num-per-pre", False, False, mat=FCN),
    _case("sp_mm-fixed-num-per-pre-tanh", True, True, weight_fn=jnp.tanh, mat=FCN),
    # Hooks that mix the non-zero values (which feed different output columns).
    _case("sp_mm-bias-mixing", True, True, weight_fn=mix_all, bias_fn=mix_all),
    _case("sp_mv-mixing-fixed-num-per-pre", False, False, weight_fn=mix_all, mat=FCN),
]
