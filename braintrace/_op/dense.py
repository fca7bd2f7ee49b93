"""Dense ETP matmul: ``matmul`` and its primitives ``etp_mm`` (batched) / ``etp_mv``.

``y = x @ f_W(W) (+ f_b(b))`` with ``x: (B, I)`` or ``(I,)``, ``W: (I, O)``, ``b: (O,)``.

Trace geometry. The trace lives in the space of the *transformed* parameters
``V = f_W(W)`` and ``c = f_b(b)``: entry ``V[i, o]`` reaches only output ``o``, so the D-RTRL
trace keeps one entry per weight, ``ε_W[..., i, o, s] = ∂h[..., o, s] / ∂V[i, o]`` (for
``etp_mm`` one trace per batch row), and ``ε_b[..., o, s] = ∂h[..., o, s] / ∂c[o]`` for the
bias. Propagating through a hidden Jacobian slice ``hd`` (shaped like ``y``) multiplies the
output axis: ``ε_W[..., i, o] · hd[..., o]``. The instantaneous term (``instant_drtrl``) is
``x[..., i] · df[..., o]`` (and ``df`` for the bias), with no hook Jacobian; each hook's
Jacobian is applied once, when the learning signal is pulled back to the raw parameter
(``solve_drtrl``: ``f_W'(W)ᵀ (Σ g · ε_W)``, an exact VJP). This keeps D-RTRL exact for any
shape-preserving hook, including ones that mix entries across output columns
(``w / norm(w)``, ``softmax``), where a trace kept per raw entry would be wrong. Without
hooks the closed-form kernels of :class:`FastPathRules` compute the same traces.
``xy_to_dw`` (the IO-dim pullback) is the exact VJP of the impl with respect to the raw
parameters.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> x, w, b = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.full((4,), 0.5)
>>> braintrace.matmul(x, w, b)[0]
Array([3.5, 3.5, 3.5, 3.5], dtype=float32)
>>> braintrace.matmul(x[0], w, weight_fn=jnp.abs).shape
(4,)
"""

from __future__ import annotations

import math

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compatible_imports import Var
from braintrace._errors import OperandShapeError, internal_error
from braintrace._op._operands import (
    bias_mantissa,
    check_bias_shape,
    check_hook,
    check_rank,
    split_units,
    with_unit,
)
from braintrace._op._primitive import register_primitive
from braintrace._op._registries import FastPathRules, register_batched_counterpart, snap_anchored
from braintrace._op.fused_roll import roll_and_contract, roll_filter_and_contract
from braintrace._op import split_float32
from braintrace._op._rule_helpers import (
    apply_hook,
    bias_trainable_invars,
    drtrl_dtype,
    hook_pullback,
    hooked_matmul_solve_drtrl,
    mix_states,
    no_hooks,
    propagate_df,
    pullback,
    shape_of,
    sum_over_states,
    sum_rows,
    zeros_pp,
)
from braintrace._typing import Array, ArrayLike, WeightFn

__all__ = ["etp_mm_p", "etp_mv_p", "matmul"]

_HIGHEST = jax.lax.Precision.HIGHEST

#: From this many bytes of a weight's trace (``B·I·O``) up, a TPU rolls a group of steps' trace
#: (and a multi-step window's) and sums their own gradient terms element-wise
#: (:func:`_steps_outer_sums`, :func:`_steps_own_terms`); smaller traces, which the chip keeps
#: in its on-chip memory and whose element-wise roll is bound by its vector unit, take products
#: (the roll as a bfloat16 product of float32 parts). Measured on a v5e
#: (``benchmarks/README.md``): as products GRU-256's D_RTRL step took 1.24x BPTT's instead of
#: 1.65x and LIF-256's 1.23x instead of 1.50x, compiling in 0.9x and 1.4-1.8x the time;
#: LIF-1024's 130 MiB trace, bound by memory traffic, stepped 10 % faster as products but
#: compiled 4-5x slower.
ELEMENTWISE_TRACE_BYTES = 64 << 20


def _etp_matmul_impl(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    has_bias: bool = False,
    weight_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array:
    y = x @ apply_hook(weight_fn, weight)
    if has_bias:
        if bias is None:
            raise internal_error("has_bias=True without a bias operand")
        y = y + apply_hook(bias_fn, bias)
    return y


etp_mm_p = register_primitive(
    "etp_mm",
    _etp_matmul_impl,
    batched=True,
    trainable_invars_fn=bias_trainable_invars,
    x_invar_index=0,
)
etp_mv_p = register_primitive(
    "etp_mv",
    _etp_matmul_impl,
    batched=False,
    trainable_invars_fn=bias_trainable_invars,
    x_invar_index=0,
)
register_batched_counterpart(etp_mv_p, etp_mm_p)


# --- ETP rules --------------------------------------------------------------------------


def _mm_dt_to_t(hidden_dim: Array, trace: dict[str, Array], **params: object) -> dict[str, Array]:
    """``ε_W[..., i, o] · hd[..., o]`` and ``ε_b[..., o] · hd[..., o]``; hooks play no part."""
    out = {"weight": trace["weight"] * jnp.expand_dims(hidden_dim, -2)}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hidden_dim
    return out


# The unbatched rule is the same contraction: the output axis is the last one of hd either way.
_mv_dt_to_t = _mm_dt_to_t


def _matmul_xy_to_dw(
    x: Array, hidden_dim: Array, weights: dict[str, Array], *, bias_fn: WeightFn | None = None,
    **params: object,
) -> dict[str, Array]:
    """Pull ``hidden_dim`` back to the raw parameters: ``f_W'ᵀ(xᵀ hd)`` and ``f_b'ᵀ(Σ hd)``."""
    out = pullback(_etp_matmul_impl, x, hidden_dim, {"weight": weights["weight"]}, {**params, "has_bias": False})
    if "bias" in weights:
        out["bias"] = hook_pullback(bias_fn, weights["bias"], hidden_dim)
    return out


def _matmul_instant_drtrl(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """The instantaneous term in the transformed space: ``x ⊗ hd`` and ``hd``, no hook Jacobian.

    ``x: (..., I)`` and ``hd: (..., O)`` with the same leading axes (one sample in D-RTRL).
    """
    out = {"weight": x[..., :, None] * hidden_dim[..., None, :]}
    if "bias" in weights:
        out["bias"] = hidden_dim
    return out


def _mm_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    """``weight (B, I, O, S)``, ``bias (B, O, S)``: one trace per batch row."""
    return _dense_init(shape_of(x_var)[:1], x_var, y_var, weight_vars, num_hidden_state)


def _mv_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    """``weight (I, O, S)``, ``bias (O, S)``."""
    return _dense_init((), x_var, y_var, weight_vars, num_hidden_state)


def _dense_init(
    lead: tuple[int, ...], x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    dtype = drtrl_dtype(x_var, y_var, weight_vars)
    w_shape = shape_of(weight_vars["weight"])
    out = {"weight": jnp.zeros((*lead, *w_shape, num_hidden_state), dtype)}
    if "bias" in weight_vars:
        b_shape = shape_of(weight_vars["bias"])
        if b_shape != w_shape[-1:]:
            raise ValueError(
                f"matmul: a bias of shape {b_shape} broadcasts over several outputs, which a "
                f"per-output eligibility trace cannot represent. To learn it online, pass a bias "
                f"of shape {w_shape[-1:]}."
            )
        out["bias"] = jnp.zeros((*lead, w_shape[-1], num_hidden_state), dtype)
    return out


# --- closed-form D-RTRL kernels -----------------------------------------------------------


def _dense_fast_instant(x: Array, df: Array, has_bias: bool) -> dict[str, Array]:
    """``x ⊗ df``: ``(..., I)`` and ``(..., O, S)`` give ``(..., I, O, S)``."""
    # A broadcast product (not an einsum) so that XLA fuses it with the recurrent term into one
    # pass over the trace.
    out = {"weight": x[..., :, None, None] * df[..., None, :, :]}
    if has_bias:
        out["bias"] = df
    return out


def _dense_fast_recurrent(
    diag: Array, old: dict[str, Array], num_state: int
) -> dict[str, Array]:
    """``ε[..., i, o, a] ← Σ_b D[..., o, a, b] ε[..., i, o, b]`` with ``D: (..., O, S, S)``."""
    if num_state == 1:
        d = diag[..., 0, 0]
        out = {"weight": old["weight"] * d[..., None, :, None]}
        if "bias" in old:
            out["bias"] = old["bias"] * d[..., None]
        return out
    out = {"weight": mix_states(diag[..., None, :, :, :], old["weight"])}
    if "bias" in old:
        out["bias"] = mix_states(diag, old["bias"])
    return out


def _dense_fast_solve(
    signal: Array, trace: dict[str, Array], *, fold_batch: bool = False
) -> dict[str, Array]:
    """``∇W[i, o] = Σ_a g[..., o, a] ε_W[..., i, o, a]`` (also over the batch when folding)."""
    if fold_batch:
        return sum_rows(_dense_solve_row, signal, trace)
    out = {"weight": sum_over_states(signal[..., None, :, :], trace["weight"])}
    if "bias" in trace:
        out["bias"] = sum_over_states(signal, trace["bias"])
    return out


def _dense_solve_row(signal: Array, trace: dict[str, Array]) -> dict[str, Array]:
    """One batch row of the fast solve: ``signal (O, S)``, ``ε_W (I, O, S)``."""
    return {k: sum_over_states(signal, v) for k, v in trace.items()}


def _dense_fast_solve_instant(
    signal: Array, x: Array, df: Array, has_bias: bool, *, fold_batch: bool = False
) -> dict[str, Array]:
    """``solve(signal, instant(x, df))`` as ``x[..., i] · Σ_a g[..., o, a] df[..., o, a]``: one
    matrix product over the batch when folding, never the ``(..., I, O, S)`` product."""
    gdf = sum_over_states(signal, df)
    if fold_batch:
        out = {"weight": jnp.einsum("bi,bo->io", x, gdf, precision=_HIGHEST)}
        if has_bias:
            out["bias"] = gdf.sum(axis=0)
        return out
    out = {"weight": x[..., :, None] * gdf[..., None, :]}
    if has_bias:
        out["bias"] = gdf
    return out


def _outer_sums(start: Array, x: Array, y: Array) -> Array:
    """``start + Σ_s x_s ⊗ y_s``, element-wise: ``x`` ``(K, ..., I)``, ``y`` ``(K, ..., O, ...)``
    and ``start`` ``(..., I, O, ...)``."""
    trailing = y.ndim - x.ndim  # y's axes after O
    for x_s, y_s in zip(x, y):
        start = start + jnp.reshape(x_s, x_s.shape + (1,) * (trailing + 1)) * jnp.expand_dims(y_s, x_s.ndim - 1)
    return start


def _dense_fast_chunk(
    x_seq: Array,
    df_seq: Array,
    p_seq: Array,
    m_full: Array,
    old: dict[str, Array],
    num_state: int,
) -> dict[str, Array]:
    """A window of ``T`` steps at once: ``M ε + Σ_s x_s ⊗ (P_s df_s)``.

    ``x_seq: (T, ..., I)``, ``df_seq: (T, ..., O, S)``, ``p_seq: (T, ..., O, S, S)``,
    ``m_full: (..., O, S, S)``. The sum over the steps is one product at ``HIGHEST`` on the
    CPU and :func:`_steps_outer_sums` on a TPU.
    """
    pdf = propagate_df(p_seq, df_seq, num_state)
    out = _dense_fast_recurrent(m_full, old, num_state)
    if jax.default_backend() == "tpu":
        out["weight"] = _steps_outer_sums(out["weight"], x_seq, pdf)
    else:
        out["weight"] = out["weight"] + jnp.einsum("t...i,t...ka->...ika", x_seq, pdf, precision=_HIGHEST)
    if "bias" in old:
        out["bias"] = out["bias"] + pdf.sum(axis=0)
    return out


def _dense_fast_roll_and_solve(
    old: dict[str, Array], diag: Array, x: Array, df: Array, signal: Array, has_bias: bool
) -> tuple[dict[str, Array], dict[str, Array]]:
    """``old``: ``weight (B, I, O)`` (and ``bias (B, O)``); ``diag``, ``df``, ``signal``:
    ``(B, O)``; ``x``: ``(B, I)``. The weight's trace in one pass (:mod:`~braintrace._op.fused_roll`)."""
    weight, grad = roll_and_contract(old["weight"], diag, x, df, signal)
    new, grads = {"weight": weight}, {"weight": grad}
    if "bias" in old:
        new["bias"] = diag * old["bias"] + (df if has_bias else 0.0)
        grads["bias"] = jnp.sum(signal * old["bias"], axis=0)
    return new, grads


def _elementwise_on_tpu(x: Array, y: Array) -> bool:
    """Whether steps' outer products (``x``: ``(K, ..., I)``, ``y``: ``(K, ..., O, ...)``) are
    summed into their trace element-wise: on a TPU, from :data:`ELEMENTWISE_TRACE_BYTES` of trace up."""
    trace_bytes = math.prod(x.shape[1:]) * math.prod(y.shape[x.ndim - 1:]) * y.dtype.itemsize
    return jax.default_backend() == "tpu" and trace_bytes >= ELEMENTWISE_TRACE_BYTES


def _steps_outer_sums(start: Array, x: Array, y: Array) -> Array:
    """``start + Σ_s x_s ⊗ y_s`` for the steps of a group or a window (``x``: ``(K, ..., I)``,
    ``y``: ``(K, ..., O, ...)``, ``start``: ``(..., I, O, ...)``): on a TPU below
    :data:`ELEMENTWISE_TRACE_BYTES`, one bfloat16 product of the float32 parts
    (:func:`braintrace._op.split_float32.outer_sums`); elsewhere element-wise, one fusion with
    the roll (on the CPU, and on a TPU where a large trace's memory traffic bounds the step)."""
    if jax.default_backend() == "tpu" and not _elementwise_on_tpu(x, y):
        rows = jnp.reshape(y, (*y.shape[:x.ndim - 1], -1))  # the axes after I as one
        return start + jnp.reshape(split_float32.outer_sums(x, rows), start.shape)
    return _outer_sums(start, x, y)


def _steps_own_terms(lam: Array, x: Array, df: Array, has_bias: bool) -> dict[str, Array]:
    """``Σ_{s,b} x_s ⊗ (λ_s df_s)``, the group's steps' own gradient terms (``λ``, ``df``:
    ``(K, B, O)``; ``x``: ``(K, B, I)``): one product over the steps and rows, or, on a TPU from
    :data:`ELEMENTWISE_TRACE_BYTES` of trace up, ``K`` outer products summed element-wise and
    reduced over the batch.

    On a TPU v5e (``benchmarks/README.md``), a LIF-1024 group of 10 steps (320 rows) compiled
    the driver's loop in 6.6-6.8 s as one product and in 1.1-1.2 s element-wise (call by call:
    1.4 s), its step 6-15 % slower.
    """
    if _elementwise_on_tpu(x, df):
        gdf = lam * df
        start = jnp.zeros((*x.shape[1:], df.shape[-1]), jnp.result_type(x, gdf))
        out = {"weight": jnp.sum(_outer_sums(start, x, gdf), axis=0)}
        if has_bias:
            out["bias"] = jnp.sum(gdf, axis=(0, 1))
        return out
    folded = x.shape[0] * x.shape[1]
    return _dense_fast_solve_instant(jnp.reshape(lam, (folded, -1, 1)), jnp.reshape(x, (folded, -1)),
                                     jnp.reshape(df, (folded, -1, 1)), has_bias, fold_batch=True)


def _dense_fast_roll_and_solve_steps(
    old: dict[str, Array], diag: Array, x: Array, df: Array, signal: Array, has_bias: bool,
    own: Array | None = None,
) -> tuple[dict[str, Array], dict[str, Array]]:
    """:func:`_dense_fast_roll_and_solve` over ``K`` steps at once: their last trace and summed gradients.

    ``diag``, ``df``, ``signal`` (and ``own``): ``(K, B, O)``; ``x``: ``(K, B, I)``. Step ``s``
    rolls ``ε_s = d_s ε_{s-1} + x_s ⊗ df_s`` and contracts the trace it entered with,
    ``Σ_b q_s ⊙ ε_{s-1}`` (with ``own``, also its own term ``Σ_b x_s ⊗ (g_s df_s)``). In closed
    form, with ``p_s = d_{K-1} ⋯ d_{s+1}`` and ``λ_s = Σ_{t>s} d_{t-1} ⋯ d_{s+1} q_t``
    (``λ_{s-1} = q_s + d_s λ_s``): ``ε_{K-1} = p_{-1} ε_{-1} + Σ_s x_s ⊗ (p_s df_s)`` and the
    gradient ``Σ_b λ_{-1} ⊙ ε_{-1} + Σ_{s,b} x_s ⊗ ((λ_s + g_s) df_s)``: one read of the
    entering trace and one write of the new one for ``K`` steps (``K`` is small: the driver's
    groups), and one product for the steps' own terms.
    """

    def back(carry: tuple[Array, Array], step: tuple[Array, Array]) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
        lam, prod = carry  # λ_s and p_s
        d, q = step
        return (q + d * lam, d * prod), (lam, prod)

    start = (jnp.zeros_like(signal[0]), jnp.ones_like(diag[0]))
    (lam_first, prod_all), (lam, prod) = jax.lax.scan(back, start, (diag, signal), reverse=True)
    weight = _steps_outer_sums(prod_all[:, None, :] * old["weight"], x, prod * df)
    history = jnp.sum(old["weight"] * lam_first[:, None, :], axis=0)
    steps = _steps_own_terms(lam if own is None else lam + own, x, df, has_bias)
    new = {"weight": weight}
    grads = {"weight": history + steps["weight"]}
    if "bias" in old:
        new["bias"] = prod_all * old["bias"] + (jnp.sum(prod * df, axis=0) if has_bias else 0.0)
        grads["bias"] = jnp.sum(lam_first * old["bias"], axis=0) + steps.get("bias", 0.0)
    return new, grads


def _dense_fast_roll_filter_and_solve(
    old: dict[str, Array], filt: dict[str, Array], diag: Array, x: Array, df: Array, signal: Array,
    filt_signal: Array, kappa: float, has_bias: bool,
) -> tuple[dict[str, Array], dict[str, Array], dict[str, Array]]:
    """:func:`_dense_fast_roll_and_solve` of a trace and its filter ``filt`` (shaped as ``old``)."""
    weight, weight_filt, grad = roll_filter_and_contract(
        old["weight"], filt["weight"], diag, x, df, signal, filt_signal, kappa)
    new, new_filt, grads = {"weight": weight}, {"weight": weight_filt}, {"weight": grad}
    if "bias" in old:
        new["bias"] = diag * old["bias"] + (df if has_bias else 0.0)
        new_filt["bias"] = kappa * filt["bias"] + new["bias"]
        grads["bias"] = jnp.sum(signal * old["bias"] + filt_signal * filt["bias"], axis=0)
    return new, new_filt, grads


def _dense_fast_roll_filter_and_solve_steps(
    old: dict[str, Array], filt: dict[str, Array], diag: Array, x: Array, df: Array, signal: Array,
    filt_signal: Array, kappa: float, has_bias: bool, own: Array | None = None,
) -> tuple[dict[str, Array], dict[str, Array], dict[str, Array]]:
    """:func:`_dense_fast_roll_filter_and_solve` over ``K`` steps at once (shaped as in
    :func:`_dense_fast_roll_and_solve_steps`, ``own`` too; ``filt_signal`` ``(K, B, O)``).

    Step ``s`` rolls ``z_s = M_s z_{s-1} + (u_s, u_s)`` for ``z = (ε, ē)``, ``u_s = x_s ⊗ df_s``
    and ``M_s = [[d_s, 0], [d_s, κ]]``, and contracts ``(q_s, r_s)`` with ``z_{s-1}``. With
    ``Φ_s = M_{K-1} ⋯ M_{s+1} = [[a_s, 0], [c_s, κ^{K-1-s}]]`` and the adjoint
    ``λ_{s-1} = (q_s, r_s) + M_sᵀ λ_s``: ``z_{K-1} = Φ_{-1} z_{-1} + Σ_s Φ_s (u_s, u_s)`` and the
    gradient ``Σ_b λ_{-1} · z_{-1} + Σ_{s,b} x_s ⊗ ((λ^ε_s + λ^ē_s) df_s)``.
    """

    Carry = tuple[Array, Array, Array, Array, Array]  # λ_s and Φ_s

    def back(carry: Carry, step: tuple[Array, Array, Array]) -> tuple[Carry, tuple[Array, Array, Array]]:
        lam, lam_filt, a, c, e = carry
        d, q, r = step
        into = lam + lam_filt  # what the step's own u_s meets, through ε_s and ē_s
        # and what u_s adds to the group's last trace and filter: Φ_s (1, 1) = (a_s, c_s + e_s)
        return (q + d * into, r + kappa * lam_filt, a * d, (c + e) * d, kappa * e), (into, a, c + e)

    zeros, ones = jnp.zeros_like(signal[0]), jnp.ones_like(diag[0])
    (lam_first, lam_filt_first, a_all, c_all, _), (lam, into_trace, into_filter) = jax.lax.scan(
        back, (zeros, zeros, ones, zeros, ones), (diag, signal, filt_signal), reverse=True)
    filt_decay = kappa ** x.shape[0]
    weight = _steps_outer_sums(a_all[:, None, :] * old["weight"], x, into_trace * df)
    weight_filt = _steps_outer_sums(filt_decay * filt["weight"] + c_all[:, None, :] * old["weight"], x, into_filter * df)
    history = jnp.sum(old["weight"] * lam_first[:, None, :] + filt["weight"] * lam_filt_first[:, None, :], axis=0)
    steps = _steps_own_terms(lam if own is None else lam + own, x, df, has_bias)
    new, new_filt = {"weight": weight}, {"weight": weight_filt}
    grads = {"weight": history + steps["weight"]}
    if "bias" in old:
        new["bias"] = a_all * old["bias"] + (jnp.sum(into_trace * df, axis=0) if has_bias else 0.0)
        new_filt["bias"] = (filt_decay * filt["bias"] + c_all * old["bias"]
                            + (jnp.sum(into_filter * df, axis=0) if has_bias else 0.0))
        grads["bias"] = (jnp.sum(lam_first * old["bias"] + lam_filt_first * filt["bias"], axis=0)
                         + steps.get("bias", 0.0))
    return new, new_filt, grads


_DENSE_FAST_PATH = FastPathRules(
    instant=_dense_fast_instant,
    recurrent=_dense_fast_recurrent,
    solve=_dense_fast_solve,
    applicable=no_hooks,
    chunk=_dense_fast_chunk,
    solve_instant=_dense_fast_solve_instant,
    roll_and_solve=_dense_fast_roll_and_solve,
    roll_and_solve_steps=_dense_fast_roll_and_solve_steps,
    roll_filter_and_solve=_dense_fast_roll_filter_and_solve,
    roll_filter_and_solve_steps=_dense_fast_roll_filter_and_solve_steps,
)

def _dense_snap_adjacency(
    x_shape: tuple[int, ...], y_shape: tuple[int, ...], **params: object
) -> tuple[np.ndarray | None, ...] | None:
    """Every output reads every input on the last axis; the leading (batch) axes are the identity."""
    if len(x_shape) != len(y_shape) or x_shape[:-1] != y_shape[:-1]:
        return None
    return (*[None] * (len(y_shape) - 1), np.ones((y_shape[-1], x_shape[-1]), dtype=bool))


for _p, _init in ((etp_mm_p, _mm_init_drtrl), (etp_mv_p, _mv_init_drtrl)):
    _p.register_etp_rules(
        dt_to_t=_mm_dt_to_t,
        xy_to_dw=_matmul_xy_to_dw,
        init_drtrl=_init,
        init_pp=zeros_pp,
        fast_path=_DENSE_FAST_PATH,
        instant_drtrl=_matmul_instant_drtrl,
        solve_drtrl=hooked_matmul_solve_drtrl,
        snap_anchor=snap_anchored,
        snap_adjacency=_dense_snap_adjacency,
    )


# --- user function ------------------------------------------------------------------------


def matmul(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    weight_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array | u.Quantity:
    """Dense ``x @ weight (+ bias)`` whose parameters learn online with eligibility traces.

    Use it in place of ``x @ W`` for a weight that should take part in online learning; a
    plain ``x @ W`` keeps the weight out of the eligibility-trace graph.

    Parameters
    ----------
    x : array or Quantity
        Input, ``(batch, in)`` (binds ``etp_mm``) or ``(in,)`` (binds ``etp_mv``).
    weight : array or Quantity
        Weight, ``(in, out)``.
    bias : array or Quantity, optional
        Bias, ``(out,)``, in the unit of ``x·weight``.
    weight_fn, bias_fn : callable, optional
        Shape-preserving transforms applied to the stored parameters inside the primitive,
        ``y = x @ weight_fn(weight) + bias_fn(bias)``. Gradients are with respect to the raw
        stored parameters and exact for any such transform, including ones that mix entries
        across output columns (D-RTRL keeps its traces in the transformed space).

    Returns
    -------
    array or Quantity
        ``(batch, out)`` or ``(out,)``, in the unit of ``x·weight``.

    Raises
    ------
    TypeError
        If an operand is not an array or a hook is not callable.
    ValueError
        If ``x`` has rank 0 or above 2, ``weight`` is not rank 2, the shapes do not fit, or a
        hook changes the shape of its parameter.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> braintrace.matmul(jnp.ones((2, 3)), jnp.ones((3, 4)), weight_fn=lambda w: 2 * w)
    Array([[6., 6., 6., 6.],
           [6., 6., 6., 6.]], dtype=float32)
    """
    op = "braintrace.matmul"
    x_m, x_unit = split_units(x, "x", op)
    w_m, w_unit = split_units(weight, "weight", op)
    check_rank(
        x_m, "x", op, (1, 2),
        hint="Use braintrace.einsum for genuine tensor contractions over more axes.",
    )
    check_rank(w_m, "weight", op, (2,))
    if x_m.shape[-1] != w_m.shape[0]:
        raise OperandShapeError(
            f"{op}: the last axis of x {tuple(x_m.shape)} must equal the first axis of weight "
            f"{tuple(w_m.shape)}; weight is laid out as (in, out)."
        )
    check_hook(weight_fn, "weight_fn", op, w_m)
    check_hook(bias_fn, "bias_fn", op)
    unit = x_unit * w_unit
    operands = [x_m, w_m]
    if bias is not None:
        b_m = bias_mantissa(bias, unit, op)
        check_bias_shape(b_m, (*x_m.shape[:-1], w_m.shape[1]), op)
        check_hook(bias_fn, "bias_fn", op, b_m)
        operands.append(b_m)
    prim = etp_mm_p if x_m.ndim == 2 else etp_mv_p
    y = prim.bind(
        *operands, has_bias=bias is not None, weight_fn=weight_fn, bias_fn=bias_fn
    )
    return with_unit(y, unit)
