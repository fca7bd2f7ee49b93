"""Grouped ETP matmul: ``grouped_matmul`` and its primitives ``etp_gmm`` (batched) / ``etp_gmv``.

``G`` independent dense maps side by side: ``y[..., g, n] = Σ_k x[..., g, k] f_W(W)[g, k, n]
(+ f_b(b)[g, n])`` with ``x: (B, G, K)`` or ``(G, K)``, ``W: (G, K, N)``, ``b: (G, N)``.

Trace geometry. The trace lives in the space of the *transformed* parameters ``V = f_W(W)``
and ``c = f_b(b)``: entry ``V[g, k, n]`` reaches only output ``(g, n)``, so the D-RTRL trace
keeps one entry per weight, ``ε_W[..., g, k, n, s] = ∂h[..., g, n, s] / ∂V[g, k, n]`` (for
``etp_gmm`` one trace per batch row), and ``ε_b[..., g, n, s] = ∂h[..., g, n, s] / ∂c[g, n]``
for the bias. Propagating through a hidden Jacobian slice ``hd`` (shaped like ``y``) multiplies
the output position: ``ε_W[..., g, k, n] · hd[..., g, n]``. The instantaneous term
(``instant_drtrl``) is ``x[..., g, k] · df[..., g, n]`` (and ``df`` for the bias), with no hook
Jacobian; each hook's Jacobian is applied once, when the learning signal is pulled back to the
raw parameter (``solve_drtrl``, an exact VJP). This keeps D-RTRL exact for any
shape-preserving hook, including ones that mix entries across outputs or groups
(``w / norm(w)``, ``softmax``). Without hooks the closed-form kernels compute the same traces.
``xy_to_dw`` (the IO-dim pullback) is the exact VJP of the impl with respect to the raw
parameters.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> x, w, b = jnp.ones((2, 3, 4)), jnp.ones((3, 4, 5)), jnp.full((3, 5), 0.5)
>>> braintrace.grouped_matmul(x, w, b).shape
(2, 3, 5)
>>> braintrace.grouped_matmul(x[0], w, weight_fn=jnp.abs)[0]
Array([4., 4., 4., 4., 4.], dtype=float32)
"""

from __future__ import annotations

import brainunit as u
import jax.numpy as jnp

from braintrace._compatible_imports import Var
from braintrace._errors import OperandShapeError, internal_error
from braintrace._op._operands import (
    bias_mantissa,
    check_hook,
    check_rank,
    split_units,
    with_unit,
)
from braintrace._op._primitive import register_primitive
from braintrace._op._registries import FastPathRules, register_batched_counterpart, snap_anchored
from braintrace._op._rule_helpers import (
    apply_hook,
    bias_trainable_invars,
    drtrl_dtype,
    hooked_matmul_solve_drtrl,
    mix_states,
    no_hooks,
    pullback,
    shape_of,
    sum_over_states,
    sum_rows,
    zeros_pp,
)
from braintrace._typing import Array, ArrayLike, WeightFn

__all__ = ["etp_gmm_p", "etp_gmv_p", "grouped_matmul"]


def _etp_grouped_matmul_impl(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    has_bias: bool = False,
    weight_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array:
    y = jnp.einsum("...gk,gkn->...gn", x, apply_hook(weight_fn, weight))
    if has_bias:
        if bias is None:
            raise internal_error("has_bias=True without a bias operand")
        y = y + apply_hook(bias_fn, bias)
    return y


etp_gmm_p = register_primitive(
    "etp_gmm",
    _etp_grouped_matmul_impl,
    batched=True,
    trainable_invars_fn=bias_trainable_invars,
    x_invar_index=0,
)
etp_gmv_p = register_primitive(
    "etp_gmv",
    _etp_grouped_matmul_impl,
    batched=False,
    trainable_invars_fn=bias_trainable_invars,
    x_invar_index=0,
)
register_batched_counterpart(etp_gmv_p, etp_gmm_p)


# --- ETP rules --------------------------------------------------------------------------


def _grouped_dt_to_t(
    hidden_dim: Array, trace: dict[str, Array], **params: object
) -> dict[str, Array]:
    """``ε_W[..., g, k, n] · hd[..., g, n]`` and ``ε_b[..., g, n] · hd[..., g, n]``.

    The same contraction serves both ranks (the output position is the last two axes of
    ``hd`` either way); hooks play no part.
    """
    out = {"weight": trace["weight"] * jnp.expand_dims(hidden_dim, -2)}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hidden_dim
    return out


def _grouped_xy_to_dw(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """Pull ``hidden_dim`` back to the raw parameters in one fused VJP of the impl.

    ``∂/∂W = f_W'ᵀ(Σ_batch x[..., g, k] hd[..., g, n])`` and ``∂/∂b = f_b'ᵀ(Σ_batch hd)``.
    """
    return pullback(_etp_grouped_matmul_impl, x, hidden_dim, weights, params)


def _grouped_instant_drtrl(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """The instantaneous term in the transformed space: ``x[g, k] · hd[g, n]`` and ``hd``.

    ``x: (..., G, K)`` and ``hd: (..., G, N)`` with the same leading axes; no hook Jacobian.
    """
    out = {"weight": x[..., :, :, None] * hidden_dim[..., :, None, :]}
    if "bias" in weights:
        out["bias"] = hidden_dim
    return out


def _gmm_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    """``weight (B, G, K, N, S)``, ``bias (B, G, N, S)``."""
    return _grouped_init(shape_of(x_var)[:1], x_var, y_var, weight_vars, num_hidden_state)


def _gmv_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    """``weight (G, K, N, S)``, ``bias (G, N, S)``."""
    return _grouped_init((), x_var, y_var, weight_vars, num_hidden_state)


def _grouped_init(
    lead: tuple[int, ...],
    x_var: Var,
    y_var: Var,
    weight_vars: dict[str, Var],
    num_hidden_state: int,
) -> dict[str, Array]:
    dtype = drtrl_dtype(x_var, y_var, weight_vars)
    g, k, n = shape_of(weight_vars["weight"])
    out = {"weight": jnp.zeros((*lead, g, k, n, num_hidden_state), dtype)}
    if "bias" in weight_vars:
        out["bias"] = jnp.zeros((*lead, g, n, num_hidden_state), dtype)
    return out


# --- closed-form D-RTRL kernels -----------------------------------------------------------


def _grouped_fast_instant(x: Array, df: Array, has_bias: bool) -> dict[str, Array]:
    """``x ⊗ df`` per group: ``(..., G, K)`` and ``(..., G, N, S)`` give ``(..., G, K, N, S)``."""
    out = {"weight": jnp.einsum("...gk,...gna->...gkna", x, df)}
    if has_bias:
        out["bias"] = df
    return out


def _grouped_fast_recurrent(
    diag: Array, old: dict[str, Array], num_state: int
) -> dict[str, Array]:
    """``ε[..., g, k, n, a] ← Σ_b D[..., g, n, a, b] ε[..., g, k, n, b]``, ``D: (..., G, N, S, S)``."""
    if num_state == 1:
        d = diag[..., 0, 0]
        out = {"weight": old["weight"] * d[..., None, :, None]}
        if "bias" in old:
            out["bias"] = old["bias"] * d[..., None]
        return out
    out = {"weight": mix_states(diag[..., :, None, :, :, :], old["weight"])}
    if "bias" in old:
        out["bias"] = mix_states(diag, old["bias"])
    return out


def _grouped_fast_solve(
    signal: Array, trace: dict[str, Array], *, fold_batch: bool = False
) -> dict[str, Array]:
    """``∇W[g, k, n] = Σ_a s[..., g, n, a] ε_W[..., g, k, n, a]`` (and over the batch when folding)."""
    if fold_batch:
        return sum_rows(_grouped_solve_row, signal, trace)
    out = {"weight": sum_over_states(signal[..., :, None, :, :], trace["weight"])}
    if "bias" in trace:
        out["bias"] = sum_over_states(signal, trace["bias"])
    return out


def _grouped_solve_row(signal: Array, trace: dict[str, Array]) -> dict[str, Array]:
    """One batch row of the fast solve: ``signal (G, N, S)``, ``ε_W (G, K, N, S)``."""
    out = {"weight": sum_over_states(signal[:, None], trace["weight"])}
    if "bias" in trace:
        out["bias"] = sum_over_states(signal, trace["bias"])
    return out


# No chunk kernel: windowed D-RTRL steps the grouped trace one step at a time.
_GROUPED_FAST_PATH = FastPathRules(
    instant=_grouped_fast_instant,
    recurrent=_grouped_fast_recurrent,
    solve=_grouped_fast_solve,
    applicable=no_hooks,
)

for _p, _init in ((etp_gmm_p, _gmm_init_drtrl), (etp_gmv_p, _gmv_init_drtrl)):
    _p.register_etp_rules(
        dt_to_t=_grouped_dt_to_t,
        xy_to_dw=_grouped_xy_to_dw,
        init_drtrl=_init,
        init_pp=zeros_pp,
        fast_path=_GROUPED_FAST_PATH,
        instant_drtrl=_grouped_instant_drtrl,
        solve_drtrl=hooked_matmul_solve_drtrl,
        snap_anchor=snap_anchored,
    )


# --- user function ------------------------------------------------------------------------


def grouped_matmul(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    weight_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array | u.Quantity:
    """``G`` independent dense maps, ``y[..., g] = x[..., g] @ weight[g] (+ bias[g])``, learned online.

    Use it for block-diagonal connectivity (e.g. per-head or per-module projections): each
    group's weight only sees its own slice of the input, and its eligibility trace stays
    ``G``-times smaller than that of an equivalent dense block-diagonal matrix.

    Parameters
    ----------
    x : array or Quantity
        Input, ``(batch, groups, in)`` (binds ``etp_gmm``) or ``(groups, in)`` (binds
        ``etp_gmv``).
    weight : array or Quantity
        Weight, ``(groups, in, out)``.
    bias : array or Quantity, optional
        Bias, ``(groups, out)``, in the unit of ``x·weight``.
    weight_fn, bias_fn : callable, optional
        Shape-preserving transforms applied to the stored parameters inside the primitive.
        Gradients are with respect to the raw stored parameters and exact for any such
        transform, including ones that mix entries across outputs or groups.

    Returns
    -------
    array or Quantity
        ``(batch, groups, out)`` or ``(groups, out)``, in the unit of ``x·weight``.

    Raises
    ------
    TypeError
        If an operand is not an array or a hook is not callable.
    ValueError
        If ``weight`` is not rank 3, ``x`` is not rank 2 or 3, ``x.shape[-2:]`` differs from
        ``weight.shape[:2]``, ``bias`` is not ``(groups, out)``, or a hook changes the shape
        of its parameter.
    brainunit.UnitMismatchError
        If the unit of ``bias`` is incompatible with that of ``x·weight``.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> braintrace.grouped_matmul(jnp.ones((2, 3)), jnp.ones((2, 3, 4)), jnp.ones((2, 4)))
    Array([[4., 4., 4., 4.],
           [4., 4., 4., 4.]], dtype=float32)
    """
    op = "braintrace.grouped_matmul"
    x_m, x_unit = split_units(x, "x", op)
    w_m, w_unit = split_units(weight, "weight", op)
    check_rank(w_m, "weight", op, (3,), hint="weight is laid out as (groups, in, out).")
    check_rank(
        x_m, "x", op, (2, 3),
        hint="x is laid out as (groups, in) or (batch, groups, in); vmap over extra axes.",
    )
    if tuple(x_m.shape[-2:]) != tuple(w_m.shape[:2]):
        raise OperandShapeError(
            f"{op}: the last two axes of x {tuple(x_m.shape)} must equal the first two axes of "
            f"weight {tuple(w_m.shape)}; x is (..., groups, in) and weight (groups, in, out)."
        )
    check_hook(weight_fn, "weight_fn", op, w_m)
    check_hook(bias_fn, "bias_fn", op)
    unit = x_unit * w_unit
    operands = [x_m, w_m]
    if bias is not None:
        b_m = bias_mantissa(bias, unit, op)
        want = (w_m.shape[0], w_m.shape[2])
        if tuple(b_m.shape) != want:
            raise OperandShapeError(
                f"{op}: bias must have shape (groups, out) = {want}, got {tuple(b_m.shape)}."
            )
        check_hook(bias_fn, "bias_fn", op, b_m)
        operands.append(b_m)
    prim = etp_gmm_p if x_m.ndim == 3 else etp_gmv_p
    y = prim.bind(
        *operands, has_bias=bias is not None, weight_fn=weight_fn, bias_fn=bias_fn
    )
    return with_unit(y, unit)
