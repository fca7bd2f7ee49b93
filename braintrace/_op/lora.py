"""Low-rank adapter ETP matmul: ``lora_matmul`` and its primitives ``etp_lora_mm`` / ``etp_lora_mv``.

``y = α · (x @ f_B(B) @ f_A(A)) (+ f_b(b))`` with ``x: (batch, in)`` or ``(in,)``,
``B: (in, rank)`` (the input-facing factor), ``A: (rank, out)`` and ``b: (out,)``.

Trace geometry. ``B`` and ``A`` reach ``y`` only through the effective weight
``W_eff = α f_B(B) f_A(A)``, and ``W_eff[i, o]`` reaches only output ``o``. The D-RTRL trace kept
under ``'lora_b'`` is therefore that of the effective weight,
``ε_B[..., i, o, s] = ∂h[..., o, s] / ∂W_eff[i, o]`` (a ``B``-shaped trace could not be
discounted on the output axis); the gradient solve pulls ``g · ε_B`` back through
``W_eff(B)`` once. Likewise the ``'lora_a'`` and ``'bias'`` traces live in the space of the
transformed operands: ``ε_A[..., r, o, s] = ∂h[..., o, s] / ∂f_A(A)[r, o]`` and
``ε_b[..., o, s] = ∂h[..., o, s] / ∂f_b(b)[o]``, where every entry reaches a single output.
Each transform's Jacobian is applied once, in the solve, as an exact VJP, so D-RTRL stays exact
for any shape-preserving ``b_fn`` / ``a_fn`` / ``bias_fn``, including ones that couple entries
across outputs. Propagating through a hidden Jacobian slice ``hd`` (shaped like ``y``)
multiplies the output axis of every trace. The IO-dim rule ``xy_to_dw`` is the exact pullback
to the raw parameters.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> x, B, A = jnp.ones((2, 3)), jnp.ones((3, 1)), jnp.ones((1, 4))
>>> braintrace.lora_matmul(x, B, A, alpha=0.5, bias=jnp.full((4,), 0.5))[0]
Array([2., 2., 2., 2.], dtype=float32)
>>> braintrace.lora_matmul(x[0], B, A, b_fn=jnp.tanh).shape
(4,)
"""

from __future__ import annotations

import math

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

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
from braintrace._op._registries import register_batched_counterpart, snap_anchored
from braintrace._op._rule_helpers import (
    apply_hook,
    drtrl_dtype,
    pullback,
    shape_of,
    zeros_pp,
)
from braintrace._typing import Array, ArrayLike, Params, WeightFn

__all__ = ["etp_lora_mm_p", "etp_lora_mv_p", "lora_matmul"]

#: Trainable operands in invar order (after ``x``).
_ORDER = ("lora_b", "lora_a", "bias")


def _etp_lora_impl(
    x: Array,
    lora_b: Array,
    lora_a: Array,
    bias: Array | None = None,
    *,
    alpha: float = 1.0,
    has_bias: bool = False,
    b_fn: WeightFn | None = None,
    a_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array:
    # (x @ B) @ A: the rank-R intermediate keeps the cost at O(I·R + R·O) per row.
    y = alpha * ((x @ apply_hook(b_fn, lora_b)) @ apply_hook(a_fn, lora_a))
    if has_bias:
        if bias is None:
            raise internal_error("has_bias=True without a bias operand")
        y = y + apply_hook(bias_fn, bias)
    return y


def _lora_trainable_invars(eqn_params: Params) -> dict[str, int]:
    layout = {"lora_b": 1, "lora_a": 2}
    if eqn_params.get("has_bias", False):
        layout["bias"] = 3
    return layout


etp_lora_mm_p = register_primitive(
    "etp_lora_mm",
    _etp_lora_impl,
    batched=True,
    trainable_invars_fn=_lora_trainable_invars,
    x_invar_index=0,
)
etp_lora_mv_p = register_primitive(
    "etp_lora_mv",
    _etp_lora_impl,
    batched=False,
    trainable_invars_fn=_lora_trainable_invars,
    x_invar_index=0,
)
register_batched_counterpart(etp_lora_mv_p, etp_lora_mm_p)


# --- ETP rules --------------------------------------------------------------------------


def _lora_dt_to_t(hidden_dim: Array, trace: dict[str, Array], **params: object) -> dict[str, Array]:
    """Every trace entry follows one output: multiply the output axis by ``hd``."""
    g = jnp.expand_dims(hidden_dim, -2)
    out = {"lora_b": trace["lora_b"] * g, "lora_a": trace["lora_a"] * g}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hidden_dim
    return out


def _lora_xy_to_dw(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """The exact pullback of ``hidden_dim`` to the raw ``B``, ``A`` (and ``b``), hooks included.

    ``∂/∂B = f_B'ᵀ(α xᵀ (hd f_A(A)ᵀ))``, ``∂/∂A = f_A'ᵀ(α (x f_B(B))ᵀ hd)``,
    ``∂/∂b = f_b'ᵀ(Σ hd)``; a batch axis of ``x`` and ``hd`` is reduced inside the VJP.
    """
    return pullback(_etp_lora_impl, x, hidden_dim, weights, params, order=_ORDER)


def _lora_instant_drtrl(
    x: Array,
    hidden_dim: Array,
    weights: dict[str, Array],
    *,
    alpha: float = 1.0,
    has_bias: bool = False,
    b_fn: WeightFn | None = None,
    a_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> dict[str, Array]:
    """The instantaneous trace term in the effective-operand spaces.

    With ``x: (in,)`` and ``hd: (out,)``: ``∂(hd·y)/∂W_eff = x ⊗ hd`` (no ``α``, no hooks),
    ``∂(hd·y)/∂f_A(A) = α (x f_B(B)) ⊗ hd`` and ``∂(hd·y)/∂f_b(b) = hd``. Leading axes shared by
    ``x`` and ``hd`` (a batch) are kept.
    """
    z = x @ apply_hook(b_fn, weights["lora_b"])
    out = {
        "lora_b": jnp.einsum("...i,...o->...io", x, hidden_dim),
        "lora_a": alpha * jnp.einsum("...r,...o->...ro", z, hidden_dim),
    }
    if "bias" in weights:
        out["bias"] = hidden_dim
    return out


def _sum_leading(value: Array, ndim: int) -> Array:
    """Sum the axes in front of the trailing ``ndim`` ones (e.g. a batch the caller left in)."""
    extra = value.ndim - ndim
    return value.sum(axis=tuple(range(extra))) if extra > 0 else value


def _lora_solve_drtrl(
    dg_hidden: Array,
    trace: dict[str, Array],
    weights: dict[str, Array],
    *,
    alpha: float = 1.0,
    has_bias: bool = False,
    b_fn: WeightFn | None = None,
    a_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> dict[str, Array]:
    """Contract the learning signal ``g: (out,)`` with the traces and pull back to raw operands.

    ``G = Σ ε_B · g`` over any leading axes, giving ``∂L/∂W_eff: (in, out)``;
    ``∇B = VJP_{f_B}(B)(α G f_A(A)ᵀ)``; ``∇A = VJP_{f_A}(A)(ε_A · g)``;
    ``∇b = VJP_{f_b}(b)(ε_b · g)``. Results are parameter-shaped.
    """
    g = jnp.expand_dims(dg_hidden, -2)
    hooks = {"lora_b": b_fn, "lora_a": a_fn, "bias": bias_fn}
    keys = [k for k in _ORDER if k in trace]
    raw = {k: weights[k] for k in keys}

    def effective(ws: dict[str, Array]) -> dict[str, Array]:
        return {k: apply_hook(hooks[k], ws[k]) for k in keys}

    eff, vjp = jax.vjp(effective, raw)
    g_weff = _sum_leading(trace["lora_b"] * g, 2)
    cotangent = {
        "lora_b": alpha * (g_weff @ eff["lora_a"].T),
        "lora_a": _sum_leading(trace["lora_a"] * g, 2),
    }
    if "bias" in keys:
        cotangent["bias"] = _sum_leading(trace["bias"] * dg_hidden, 1)
    cotangent = {k: v.astype(eff[k].dtype) for k, v in cotangent.items()}
    grads: dict[str, Array] = vjp(cotangent)[0]
    return grads


def _trace_leaves(
    lead: tuple[int, ...], weight_vars: dict[str, Var], num_hidden_state: int, dtype: DTypeLike
) -> dict[str, Array]:
    in_size, rank = shape_of(weight_vars["lora_b"])
    out_size = shape_of(weight_vars["lora_a"])[1]
    out = {
        "lora_b": jnp.zeros((*lead, in_size, out_size, num_hidden_state), dtype),
        "lora_a": jnp.zeros((*lead, rank, out_size, num_hidden_state), dtype),
    }
    if "bias" in weight_vars:
        out["bias"] = jnp.zeros((*lead, out_size, num_hidden_state), dtype)
    return out


def _lora_mm_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    dtype = drtrl_dtype(x_var, y_var, weight_vars)
    return _trace_leaves(shape_of(x_var)[:1], weight_vars, num_hidden_state, dtype)


def _lora_mv_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    dtype = drtrl_dtype(x_var, y_var, weight_vars)
    return _trace_leaves((), weight_vars, num_hidden_state, dtype)


for _p, _init in ((etp_lora_mm_p, _lora_mm_init_drtrl), (etp_lora_mv_p, _lora_mv_init_drtrl)):
    _p.register_etp_rules(
        dt_to_t=_lora_dt_to_t,
        xy_to_dw=_lora_xy_to_dw,
        init_drtrl=_init,
        init_pp=zeros_pp,
        instant_drtrl=_lora_instant_drtrl,
        solve_drtrl=_lora_solve_drtrl,
        snap_anchor=snap_anchored,
    )


# --- user function ------------------------------------------------------------------------


def _static_alpha(alpha: object, op: str) -> float:
    """``alpha`` as a Python float: it is a static parameter of the primitive."""
    is_array = not isinstance(alpha, (int, float))
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.ndarray, np.generic, jax.Array))
            or (is_array and np.ndim(alpha) != 0)):  # an array only as a scalar
        raise TypeError(
            f"{op}: alpha must be a real number, got {type(alpha).__name__}: {alpha!r}."
        )
    try:
        value = float(alpha)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise TypeError(
            f"{op}: alpha must be a concrete number (it is a static parameter of the primitive), "
            f"got a traced value {alpha!r}. To learn a scale, fold it into A."
        ) from err
    if not math.isfinite(value):
        raise ValueError(f"{op}: alpha must be finite, got {value!r}.")
    return value


def _check_shape_preserving(hook: WeightFn | None, arg: str, value: Array, op: str) -> None:
    if hook is None:
        return
    out = jax.eval_shape(hook, jax.ShapeDtypeStruct(value.shape, value.dtype))
    if getattr(out, "shape", None) != tuple(value.shape):
        raise ValueError(
            f"{op}: {arg} must preserve the shape {tuple(value.shape)} of the parameter it "
            f"transforms, but it returns {getattr(out, 'shape', type(out).__name__)}."
        )


def _check_factor_shapes(x: Array, b: Array, a: Array, op: str) -> None:
    check_rank(
        x, "x", op, (1, 2),
        hint="Flatten the leading axes into one batch axis: x.reshape(-1, x.shape[-1]).",
    )
    check_rank(b, "B", op, (2,), hint="B is the input-facing factor, laid out as (in, rank).")
    check_rank(a, "A", op, (2,), hint="A is the output-facing factor, laid out as (rank, out).")
    if x.shape[-1] != b.shape[0]:
        raise OperandShapeError(
            f"{op}: the last axis of x {tuple(x.shape)} must equal the first axis of B "
            f"{tuple(b.shape)}; B is laid out as (in, rank)."
        )
    if b.shape[1] != a.shape[0]:
        raise OperandShapeError(
            f"{op}: the rank of B {tuple(b.shape)} (its second axis) must equal the first axis "
            f"of A {tuple(a.shape)}; A is laid out as (rank, out)."
        )


def lora_matmul(
    x: ArrayLike,
    B: ArrayLike,
    A: ArrayLike,
    *,
    alpha: float = 1.0,
    bias: ArrayLike | None = None,
    b_fn: WeightFn | None = None,
    a_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array | u.Quantity:
    """Low-rank ``alpha · x @ B @ A (+ bias)`` whose factors learn online with eligibility traces.

    Parameters
    ----------
    x : array or Quantity
        Input, ``(batch, in)`` (binds ``etp_lora_mm``) or ``(in,)`` (binds ``etp_lora_mv``).
    B : array or Quantity
        Input-facing factor, ``(in, rank)``; its trainable key is ``'lora_b'``.
    A : array or Quantity
        Output-facing factor, ``(rank, out)``; its trainable key is ``'lora_a'``.
    alpha : float
        Concrete scale of the low-rank product (a static parameter, e.g. ``1 / rank``).
    bias : array or Quantity, optional
        Bias, ``(out,)``, in the unit of ``x·B·A``.
    b_fn, a_fn, bias_fn : callable, optional
        Shape-preserving transforms applied to the stored parameters' mantissas inside the
        primitive, ``y = alpha · x @ b_fn(B) @ a_fn(A) + bias_fn(bias)``. Traces and gradients
        stay with respect to the raw stored parameters and are exact for any such transform.

    Returns
    -------
    array or Quantity
        ``(batch, out)`` or ``(out,)``, in the unit of ``x·B·A``.

    Raises
    ------
    TypeError
        If an operand is not an array, a hook is not callable, or ``alpha`` is not a concrete
        real number.
    ValueError
        If ``x`` has rank 0 or above 2, a factor is not rank 2, the shapes do not chain, the
        bias is not ``(out,)``, a hook changes its parameter's shape, or ``alpha`` is not finite.
    brainunit.UnitMismatchError
        If the bias unit is incompatible with the unit of ``x·B·A``.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> x, B, A = jnp.ones((2, 3)), jnp.ones((3, 2)), jnp.ones((2, 4))
    >>> braintrace.lora_matmul(x, B, A, alpha=0.5)
    Array([[3., 3., 3., 3.],
           [3., 3., 3., 3.]], dtype=float32)
    """
    op = "braintrace.lora_matmul"
    x_m, x_unit = split_units(x, "x", op)
    b_m, b_unit = split_units(B, "B", op)
    a_m, a_unit = split_units(A, "A", op)
    _check_factor_shapes(x_m, b_m, a_m, op)
    alpha = _static_alpha(alpha, op)
    for hook, name, value in ((b_fn, "b_fn", b_m), (a_fn, "a_fn", a_m)):
        check_hook(hook, name, op)
        _check_shape_preserving(hook, name, value, op)
    check_hook(bias_fn, "bias_fn", op)
    unit = x_unit * b_unit * a_unit
    operands = [x_m, b_m, a_m]
    if bias is not None:
        bias_m = bias_mantissa(bias, unit, op)
        if tuple(bias_m.shape) != (a_m.shape[1],):
            raise OperandShapeError(
                f"{op}: bias must have shape ({a_m.shape[1]},) (the out axis of A "
                f"{tuple(a_m.shape)}), got {tuple(bias_m.shape)}."
            )
        _check_shape_preserving(bias_fn, "bias_fn", bias_m, op)
        operands.append(bias_m)
    prim = etp_lora_mm_p if x_m.ndim == 2 else etp_lora_mv_p
    y = prim.bind(
        *operands, alpha=alpha, has_bias=bias is not None, b_fn=b_fn, a_fn=a_fn, bias_fn=bias_fn
    )
    return with_unit(y, unit)
