"""Convolution with an online-learned kernel: ``conv`` and its primitive ``etp_conv`` (batched).

``y = conv_general_dilated(x, f_K(K)) (+ f_b(b))`` for 1-, 2- or 3-D (any N-D) convolutions,
in the default ``NC…/OI…/NC…`` layout, string layouts such as ``('NHWC', 'HWIO', 'NHWC')``,
or a ``jax.lax.ConvDimensionNumbers``. The batch axis leads ``x`` and ``y``.

Trace geometry. A kernel entry ``K[o, i, u]`` reaches output channel ``o`` at every output
position ``s``, through a different input patch each time, so the D-RTRL trace keeps one
kernel per output position: ``ε_K[b, s, κ] = ∂h[b, s, o(κ)] / ∂K[κ]`` with ``o(κ)`` the
entry's own output channel, shaped ``(B, *spatial_out, *K.shape, S)``; the bias trace is
``ε_b[b, *y[1:], S]``. Propagating through a hidden Jacobian slice ``hd`` multiplies each
position's kernel by ``hd[b, s, o]`` along the kernel's out axis. The instantaneous term is
the input patch at ``s`` times ``df[b, s, o]``, pulled back through ``kernel_fn``; the solve
contracts the learning signal with the trace over positions.

Transforms. ``kernel_fn`` / ``bias_fn`` enter the trace (per-position VJPs). This is exact
when ``kernel_fn`` keeps output channels apart (element-wise or per-filter transforms) and
``bias_fn`` is element-wise; D-RTRL refuses other transforms at trace initialisation, while
``xy_to_dw`` (IO-dim algorithms) is an exact VJP for any transform.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._op.conv import conv
>>> x, k = jnp.ones((2, 3, 5)), jnp.ones((4, 3, 3))
>>> conv(x, k, jnp.full((4,), 0.5), padding='VALID')[0, 0]
Array([9.5, 9.5, 9.5], dtype=float32)
>>> conv(jnp.ones((1, 6, 6, 2)), jnp.ones((3, 3, 2, 4)), strides=2,
...      dimension_numbers=('NHWC', 'HWIO', 'NHWC')).shape
(1, 3, 3, 4)
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Sequence, TypeVar

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from braintrace._compatible_imports import Var
from braintrace._errors import OperandShapeError, internal_error
from braintrace._op._conv_arguments import (
    check_bias,
    check_hook_shape,
    check_ranks,
    group_count,
    layout_argument,
    padding_argument,
    per_axis,
)
from braintrace._op._operands import bias_mantissa, check_hook, split_units, with_unit
from braintrace._op._primitive import register_primitive
from braintrace._op._registries import snap_anchored
from braintrace._op._rule_helpers import (
    apply_hook,
    bias_trainable_invars,
    drtrl_dtype,
    dtype_of,
    pullback,
    shape_of,
    zeros_pp,
)
from braintrace._typing import Array, ArrayLike, Params, WeightFn

__all__ = ["etp_conv_p", "conv", "resolved_padding"]


# --- layout helpers -----------------------------------------------------------------------


def _conv_layout(params: Params) -> tuple[int, int, int, int]:
    """``(n_spatial, channel_axis, batch_axis, kernel_out_axis)`` of an equation's output.

    ``channel_axis`` and ``batch_axis`` index the (batched) output ``y``; ``kernel_out_axis``
    indexes the kernel. ``n_spatial`` is ``len(strides)``.
    """
    n_spatial = len(params["strides"])
    dn = params.get("dimension_numbers")
    if dn is None:
        return n_spatial, 1, 0, 0
    if isinstance(dn, lax.ConvDimensionNumbers):
        return n_spatial, dn.out_spec[1], dn.out_spec[0], dn.rhs_spec[0]
    _, rhs, out = dn
    return n_spatial, out.index("C"), out.index("N"), rhs.index("O")


def _dimension_numbers(
    x_shape: Sequence[int], k_shape: Sequence[int], params: Params
) -> lax.ConvDimensionNumbers:
    return lax.conv_dimension_numbers(
        tuple(x_shape), tuple(k_shape), params.get("dimension_numbers")
    )


def resolved_padding(
    x_shape: Sequence[int], k_shape: Sequence[int], params: Params
) -> tuple[tuple[int, int], ...]:
    """``(low, high)`` per spatial dimension, in the convolution's order (``lhs_spec[2:]``): the
    pairs as given, or a named padding resolved for the kernel's dilated extent, as
    ``lax.conv_general_dilated`` resolves it (over the undilated input).

    Examples
    --------
    >>> resolved_padding((2, 5, 3), (3, 3, 4), dict(strides=(1,), padding="SAME", rhs_dilation=(2,),
    ...                  dimension_numbers=("NWC", "WIO", "NWC")))
    ((2, 2),)
    """
    padding = params.get("padding", "SAME")
    if not isinstance(padding, str):
        return tuple((int(lo), int(hi)) for lo, hi in padding)
    dn = _dimension_numbers(x_shape, k_shape, params)
    rhs_dilation = params.get("rhs_dilation") or (1,) * (len(dn.lhs_spec) - 2)
    extents = [(k_shape[a] - 1) * d + 1 for a, d in zip(dn.rhs_spec[2:], rhs_dilation)]
    pads = lax.padtype_to_pads([x_shape[a] for a in dn.lhs_spec[2:]], extents, params["strides"], padding)
    return tuple((int(lo), int(hi)) for lo, hi in pads)


def _channel_last(hidden: Array, params: Params) -> Array:
    """A ``y``-shaped array (batched, or one sample) with the output channel moved last."""
    n_spatial, channel, _, _ = _conv_layout(params)
    if hidden.ndim == n_spatial + 2:
        return jnp.moveaxis(hidden, channel, -1)
    if hidden.ndim == n_spatial + 1:  # one sample: the leading batch axis is gone
        return jnp.moveaxis(hidden, channel - 1, -1)
    raise ValueError(
        f"etp_conv: expected an output-shaped array of rank {n_spatial + 2} (or {n_spatial + 1} "
        f"for one sample), got shape {tuple(hidden.shape)}."
    )


def _align_to_kernel(channel_last: Array, kernel_ndim: int, kernel_out: int) -> Array:
    """``(..., C_out)`` -> ``(..., 1, …, C_out, …, 1)`` with ``C_out`` on the kernel's out axis."""
    tail = [1] * kernel_ndim
    tail[kernel_out] = channel_last.shape[-1]
    return channel_last.reshape(*channel_last.shape[:-1], *tail)


def _bias_on_output(bias: Array, y_ndim: int, channel_axis: int) -> Array:
    """A rank-1 bias runs along the output-channel axis; other ranks broadcast as they are."""
    if bias.ndim != 1:
        return bias
    shape = [1] * y_ndim
    shape[channel_axis] = bias.shape[0]
    return bias.reshape(shape)


def _sum_to_bias(per_position: Array, bias_shape: tuple[int, ...], channel_axis: int) -> Array:
    """Sum a batched ``y``-shaped array over the axes the bias broadcasts along."""
    ndim = per_position.ndim
    if len(bias_shape) == 1:
        on_output = [1] * ndim
        on_output[channel_axis] = bias_shape[0]
    else:
        on_output = [1] * (ndim - len(bias_shape)) + list(bias_shape)
    axes = tuple(a for a in range(ndim) if on_output[a] == 1)
    return per_position.sum(axis=axes, keepdims=True).reshape(bias_shape)


# --- primitive ----------------------------------------------------------------------------


def _etp_conv_impl(
    x: Array,
    kernel: Array,
    bias: Array | None = None,
    *,
    has_bias: bool = False,
    strides: tuple[int, ...] = (1,),
    padding: str | tuple[tuple[int, int], ...] = "SAME",
    lhs_dilation: tuple[int, ...] | None = None,
    rhs_dilation: tuple[int, ...] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    dimension_numbers: lax.ConvGeneralDilatedDimensionNumbers = None,
    kernel_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array:
    # One sample (rank of the kernel minus one) is convolved as a batch of one, so that the
    # per-sample contexts of the ETP rules can differentiate the impl directly.
    single = x.ndim == kernel.ndim - 1
    if single:
        x = x[None]
    k = apply_hook(kernel_fn, kernel)
    dtype = jnp.result_type(x, k)
    y = lax.conv_general_dilated(
        x.astype(dtype),
        k.astype(dtype),
        window_strides=strides,
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
    )
    if has_bias:
        if bias is None:
            raise internal_error("has_bias=True without a bias operand")
        layout = dict(strides=strides, dimension_numbers=dimension_numbers)
        y = y + _bias_on_output(apply_hook(bias_fn, bias), y.ndim, _conv_layout(layout)[1])
    return y[0] if single else y


etp_conv_p = register_primitive(
    "etp_conv",
    _etp_conv_impl,
    batched=True,
    trainable_invars_fn=bias_trainable_invars,
    x_invar_index=0,
)


# --- ETP rules --------------------------------------------------------------------------

#: Every static parameter of ``etp_conv`` and its default.
_DEFAULT_PARAMS: Params = dict(
    has_bias=False, strides=(1,), padding="SAME", lhs_dilation=None, rhs_dilation=None,
    feature_group_count=1, batch_group_count=1, dimension_numbers=None, kernel_fn=None,
    bias_fn=None,
)
#: The second operand of a rule body: the hidden cotangent (``xy_to_dw``, ``instant_drtrl``) or the
#: trace (``solve_drtrl``).
_B = TypeVar("_B")
_RuleBody = Callable[[Array, _B, dict[str, Array], Params], dict[str, Array]]


def _compiled(body: _RuleBody[_B]) -> _RuleBody[_B]:
    """``body(a, b, weights, params)`` under one ``jax.jit`` keyed on the static params.

    Eager callers then compile each rule once per shape rather than once per operation;
    inside an outer trace the inner ``jit`` is simply inlined.
    """

    @partial(jax.jit, static_argnums=3)
    def run(
        a: Array, b: _B, weights: dict[str, Array], frozen: tuple[tuple[str, object], ...]
    ) -> dict[str, Array]:
        return body(a, b, weights, dict(frozen))

    def call(a: Array, b: _B, weights: dict[str, Array], params: Params) -> dict[str, Array]:
        frozen = tuple((k, params.get(k, d)) for k, d in _DEFAULT_PARAMS.items())
        return run(a, b, weights, frozen)

    return call


def _conv_dt_to_t(hidden_dim: Array, trace: dict[str, Array], **params: object) -> dict[str, Array]:
    """``ε_K[b, s, …, o, …] · hd[b, s, o]`` and ``ε_b · hd``; hooks play no part."""
    n_spatial, _, _, kernel_out = _conv_layout(params)
    factor = _align_to_kernel(_channel_last(hidden_dim, params), n_spatial + 2, kernel_out)
    out = {"weight": trace["weight"] * factor}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hidden_dim
    return out


def _conv_xy_to_dw(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """The exact VJP of the convolution w.r.t. the raw kernel and bias, parameter-shaped.

    Batch and positions are reduced inside the VJP (the bias gradient is summed to the bias's
    own shape); a single sample ``x`` is treated as a batch of one.
    """
    return _xy_to_dw_compiled(x, hidden_dim, weights, params)


_xy_to_dw_compiled = _compiled(partial(pullback, _etp_conv_impl))


def _conv_init_drtrl(
    x_var: Var,
    y_var: Var,
    weight_vars: dict[str, Var],
    num_hidden_state: int,
    *,
    eqn_params: Params,
) -> dict[str, Array]:
    """Per-output-position traces: ``weight (B, *spatial_out, *K.shape, S)``, ``bias (B, *y[1:], S)``.

    Raises
    ------
    NotImplementedError
        For ``batch_group_count != 1``, or a transform the per-position trace cannot carry
        exactly; both suggest the IO-dim algorithm ``pp_prop``.
    """
    _check_drtrl_support(eqn_params, weight_vars)
    y_shape = shape_of(y_var)
    _, channel, batch_axis, _ = _conv_layout(eqn_params)
    spatial_out = tuple(n for a, n in enumerate(y_shape) if a not in (batch_axis, channel))
    batch = shape_of(x_var)[0]
    dtype = drtrl_dtype(x_var, y_var, weight_vars)
    k_shape = shape_of(weight_vars["weight"])
    out = {"weight": jnp.zeros((batch, *spatial_out, *k_shape, num_hidden_state), dtype)}
    if "bias" in weight_vars:
        out["bias"] = jnp.zeros((batch, *y_shape[1:], num_hidden_state), dtype)
    return out


def _conv_init_pp(
    x_var: Var,
    y_var: Var,
    weight_vars: dict[str, Var],
    num_hidden_state: int,
    *,
    eqn_params: Params | None = None,
) -> Array:
    return zeros_pp(x_var, y_var, weight_vars, num_hidden_state)


def _check_drtrl_support(params: Params, weight_vars: dict[str, Var]) -> None:
    batch_groups = params.get("batch_group_count", 1)
    if batch_groups != 1:
        raise NotImplementedError(
            f"etp_conv: D-RTRL per-position traces do not support grouped convolution over the "
            f"batch (batch_group_count={batch_groups}): its output batch is not "
            f"the input batch. Train this layer with the IO-dim algorithm pp_prop instead."
        )
    kernel_fn, bias_fn = params.get("kernel_fn"), params.get("bias_fn")
    k_var = weight_vars["weight"]
    if kernel_fn is not None and _mixes_blocks(kernel_fn, k_var, _conv_layout(params)[3]):
        raise NotImplementedError(
            f"etp_conv: D-RTRL keeps one trace entry per kernel element and output channel, so "
            f"kernel_fn must act on each output channel's filter separately (element-wise or "
            f"per-filter); {kernel_fn!r} mixes output channels. Train this layer with the IO-dim "
            f"algorithm pp_prop, or move the transform out of kernel_fn."
        )
    if bias_fn is not None and "bias" in weight_vars and _mixes_blocks(
        bias_fn, weight_vars["bias"], None
    ):
        raise NotImplementedError(
            f"etp_conv: D-RTRL keeps one trace entry per bias element and position, so bias_fn "
            f"must be element-wise; {bias_fn!r} couples bias entries. Train this layer with the "
            f"IO-dim algorithm pp_prop, or move the transform out of bias_fn."
        )


def _mixes_blocks(hook: WeightFn, var: Var, block_axis: int | None) -> bool:
    """Whether ``hook``'s Jacobian, probed at a fixed point, couples distinct blocks.

    Blocks are the slices along ``block_axis`` (single entries when ``None``). A Jacobian
    ``J`` is block-diagonal iff ``Jᵀ(r ⊙ v) = r ⊙ Jᵀv`` for ``r`` constant on each block; one
    random ``r``, ``v`` decides it almost surely. Inconclusive probes (non-finite values,
    non-float parameters) count as not mixing.
    """
    shape, dtype = shape_of(var), dtype_of(var)
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    dtype = jnp.promote_types(dtype, jnp.float32)  # low-precision rounding is not coupling
    r_shape = shape if block_axis is None else tuple(
        n if a == block_axis else 1 for a, n in enumerate(shape)
    )
    rng = np.random.default_rng(0)
    point = rng.uniform(0.5, 1.5, shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    r = rng.uniform(0.5, 1.5, r_shape).astype(dtype)
    # Evaluated now even when the caller is being traced (the probe is a constant).
    with jax.ensure_compile_time_eval():
        lhs, rhs = (np.asarray(a) for a in _probe_pullbacks(hook, point, r, v))
    if not (np.all(np.isfinite(lhs)) and np.all(np.isfinite(rhs))):
        return False
    scale = max(float(np.abs(lhs).max(initial=0.0)), float(np.abs(rhs).max(initial=0.0)))
    return bool(np.abs(lhs - rhs).max(initial=0.0) > 1e-4 * scale + 1e-30)


@partial(jax.jit, static_argnums=0)
def _probe_pullbacks(hook: WeightFn, point: Array, r: Array, v: Array) -> tuple[Array, Array]:
    """``(Jᵀ(r ⊙ v), r ⊙ Jᵀv)`` for the Jacobian ``J`` of ``hook`` at ``point``."""
    out, vjp = jax.vjp(hook, point)
    return vjp((r * v).astype(out.dtype))[0], r * vjp(v.astype(out.dtype))[0]


def _conv_extract_patches(
    x: Array, kernel_shape: Sequence[int], params: Params | None = None, **kwargs: object
) -> Array:
    """The input patch behind every output position: ``(B, *s, C_in, *k_spatial)``.

    ``s`` are the output's non-batch, non-channel axes in output order; ``k_spatial`` are the
    kernel's spatial axes in kernel order, so ``Σ_{c,u} patches[b, s, c, u] · K[o, c, u]``
    (kernel entries laid out the same way) is the convolution at ``(b, s, o)`` for an
    ungrouped convolution. Static parameters come as a mapping or as keywords.
    """
    p = {**(params or {}), **kwargs}
    dn = _dimension_numbers(x.shape, kernel_shape, p)
    rhs_oi = (dn.rhs_spec[0], dn.rhs_spec[1])
    filter_shape = tuple(n for a, n in enumerate(kernel_shape) if a not in rhs_oi)
    packed = _window_patches(x, filter_shape, dn, p)
    # The packed channel is c·Π(filter) + flat(u), channel-major.
    packed = jnp.moveaxis(packed, dn.out_spec[1], -1)
    return packed.reshape(*packed.shape[:-1], x.shape[dn.lhs_spec[1]], *filter_shape)


def _window_patches(
    x: Array, filter_shape: tuple[int, ...], dn: lax.ConvDimensionNumbers, p: Params
) -> Array:
    """``lax.conv_general_dilated_patches(x, filter_shape, …)``, read off by strided slices.

    The same array (patch channel ``c·Π(filter) + flat(u)``, ``u`` over ``filter_shape`` in the
    kernel's axis order, laid out by ``dn``'s output spec), without the grouped convolution by
    a 0/1 kernel that JAX uses for it: ``Π(filter)`` multiply-adds per patch entry, as many as
    the layer's own convolution when ``Π(filter) ≈ C_out``, which XLA's CPU backend runs at about
    twice the layer's time (a 3×3 kernel, 9 → 8 channels, batch 32 on an 8×8 map), while the
    slices only move the data.
    """
    n = len(p["strides"])
    strides = tuple(p["strides"])
    lhs_dilation = p.get("lhs_dilation") or (1,) * n
    rhs_dilation = p.get("rhs_dilation") or (1,) * n
    lhs = jnp.transpose(x, dn.lhs_spec)  # (N, C, *spatial) in the convolution's dimension order
    spatial_axes = sorted(dn.rhs_spec[2:])  # the kernel's spatial axes, in the order of filter_shape
    where = [spatial_axes.index(a) for a in dn.rhs_spec[2:]]  # dimension i -> its filter_shape entry
    reach = [(filter_shape[w] - 1) * r + 1 for w, r in zip(where, rhs_dilation)]
    padding = p.get("padding", "SAME")
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[2:], reach, strides, padding)
    config = [(0, 0, 0), (0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)]
    padded = lax.pad(lhs, jnp.zeros((), lhs.dtype), config)
    out = [max((padded.shape[2 + i] - reach[i]) // strides[i] + 1, 0) for i in range(n)]
    size = (padded.shape[0], padded.shape[1] * math.prod(filter_shape), *out)
    if 0 in out:
        logical = jnp.zeros(size, lhs.dtype)
    else:
        windows = []
        for u in np.ndindex(*filter_shape):
            start = [u[w] * r for w, r in zip(where, rhs_dilation)]
            limit = [s + (o - 1) * st + 1 for s, o, st in zip(start, out, strides)]
            windows.append(lax.slice(padded, (0, 0, *start), (*padded.shape[:2], *limit), (1, 1, *strides)))
        logical = jnp.stack(windows, axis=2).reshape(size)  # (N, C, U, *out), channel-major
    return jnp.transpose(logical, tuple(int(a) for a in np.argsort(dn.out_spec)))


def _kernel_slabs(x: Array, hidden: Array, kernel: Array, params: Params) -> Array:
    """``patch[b, s, g·C_g + c, u] · hd[b, s, o]`` laid out as ``(B, *s, *K.shape)``."""
    dn = _dimension_numbers(x.shape, kernel.shape, params)
    groups = params.get("feature_group_count", 1)
    patches = _conv_extract_patches(x.astype(jnp.result_type(x, kernel)), kernel.shape, params)
    hd = _channel_last(hidden, params)
    lead = hd.shape[:-1]
    n_lead, n_u = len(lead), patches.ndim - len(lead) - 1
    c_out, c_in = hd.shape[-1], patches.shape[n_lead]
    # Output channel o belongs to group o // (C_out/G) and sees input channels of that group.
    p = patches.reshape(*lead, groups, 1, c_in // groups, *patches.shape[n_lead + 1 :])
    h = hd.reshape(*lead, groups, c_out // groups, *([1] * (n_u + 1)))
    slab = (p * h).reshape(*lead, c_out, c_in // groups, *patches.shape[n_lead + 1 :])
    # Trailing axes are (o, c, *u); the kernel's are laid out by its rhs spec.
    o_axis, i_axis = dn.rhs_spec[0], dn.rhs_spec[1]
    spatial = iter(range(2, kernel.ndim))
    source = [0 if a == o_axis else 1 if a == i_axis else next(spatial) for a in range(kernel.ndim)]
    return jnp.transpose(slab, (*range(n_lead), *(n_lead + s for s in source)))


def _conv_instant_drtrl(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """The instantaneous per-position trace term: patch ⊗ ``hd``, pulled back through the hooks.

    ``x`` is one sample (``n_spatial + 1`` axes) or a batch; ``hidden_dim`` matches ``y``.
    Kernel: each position's kernel-shaped slab goes through ``VJP_{kernel_fn}(K)``. Bias:
    ``hd`` times ``bias_fn'(b)`` placed on the output (``bias_fn`` is element-wise here, see
    :func:`_conv_init_drtrl`).
    """
    return _instant_compiled(x, hidden_dim, weights, params)


def _instant_body(
    x: Array, hidden_dim: Array, weights: dict[str, Array], params: Params
) -> dict[str, Array]:
    kernel = weights["weight"]
    single = x.ndim == kernel.ndim - 1
    if single:
        x, hidden_dim = x[None], hidden_dim[None]
    slabs = _kernel_slabs(x, hidden_dim, kernel, params)
    kernel_fn = params.get("kernel_fn")
    if kernel_fn is not None:
        k_out, vjp = jax.vjp(kernel_fn, kernel)
        flat = slabs.reshape(-1, *kernel.shape).astype(k_out.dtype)
        slabs = jax.vmap(lambda c: vjp(c)[0])(flat).reshape(*slabs.shape[: -kernel.ndim], *kernel.shape)
    out = {"weight": slabs}
    if "bias" in weights:
        out["bias"] = _bias_instant(hidden_dim, weights["bias"], params)
    return {k: v[0] for k, v in out.items()} if single else out


_instant_compiled = _compiled(_instant_body)


def _bias_instant(hidden: Array, bias: Array, params: Params) -> Array:
    bias_fn = params.get("bias_fn")
    if bias_fn is None:
        slope = jnp.ones_like(bias)
    else:
        b_out, vjp = jax.vjp(bias_fn, bias)
        slope = vjp(jnp.ones_like(b_out))[0]
    on_output = _bias_on_output(slope, hidden.ndim, _conv_layout(params)[1])
    return hidden * on_output


def _conv_solve_drtrl(
    dg_hidden: Array, trace: dict[str, Array], weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """``∇K[…, o, …] = Σ_s g[s, o] ε_K[s, …, o, …]``, ``∇b = Σ_s g[s] ε_b[s]`` summed to ``b``.

    Works on one sample (the D-RTRL solve context) or a batch (also summed). The transforms
    are already in the trace and are not applied again.
    """
    return _solve_compiled(dg_hidden, trace, weights, params)


def _solve_body(
    dg_hidden: Array, trace: dict[str, Array], weights: dict[str, Array], params: Params
) -> dict[str, Array]:
    n_spatial, channel, _, kernel_out = _conv_layout(params)
    trace = dict(trace)
    if dg_hidden.ndim == n_spatial + 1:
        dg_hidden = dg_hidden[None]
        trace = {k: v[None] for k, v in trace.items()}
    factor = _align_to_kernel(_channel_last(dg_hidden, params), n_spatial + 2, kernel_out)
    out = {"weight": (trace["weight"] * factor).sum(axis=tuple(range(n_spatial + 1)))}
    if "bias" in trace:
        out["bias"] = _sum_to_bias(dg_hidden * trace["bias"], weights["bias"].shape, channel)
    return out


_solve_compiled = _compiled(_solve_body)


def _conv_snap_adjacency(
    x_shape: tuple[int, ...],
    y_shape: tuple[int, ...],
    *,
    operand_shapes: Sequence[tuple[int, ...]],
    strides: tuple[int, ...],
    padding: str | tuple[tuple[int, int], ...] = "SAME",
    lhs_dilation: tuple[int, ...] | None = None,
    rhs_dilation: tuple[int, ...] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    dimension_numbers: lax.ConvGeneralDilatedDimensionNumbers = None,
    **params: object,
) -> tuple[np.ndarray | None, ...] | None:
    """Output position ``o`` reads input ``i`` where a kernel tap lands on it.

    Per spatial axis, the taps the strides, padding and dilations place over ``i``; along the
    channel axis every input channel of the output channel's group; the batch axis is the
    identity. ``None`` when the input and output are laid out differently, for batch groups,
    and for a named padding over an input dilation (which has no kernel placement).

    Examples
    --------
    >>> patterns = _conv_snap_adjacency(
    ...     (2, 4, 3), (2, 4, 3), operand_shapes=[(2, 4, 3), (3, 3, 3)], strides=(1,), padding="SAME",
    ...     dimension_numbers=("NWC", "WIO", "NWC"))
    >>> patterns[0] is None, patterns[1].astype(int).tolist(), bool(patterns[2].all())
    (True, [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]], True)
    """
    k_shape = tuple(operand_shapes[1])
    if not len(x_shape) == len(y_shape) == len(k_shape) or batch_group_count != 1:
        return None
    lhs_spec, rhs_spec, out_spec = lax.conv_dimension_numbers(x_shape, k_shape, dimension_numbers)
    if tuple(lhs_spec) != tuple(out_spec):
        return None
    n_spatial = len(lhs_spec) - 2
    strides = tuple(strides)
    lhs_dilation = tuple(lhs_dilation or (1,) * n_spatial)
    rhs_dilation = tuple(rhs_dilation or (1,) * n_spatial)
    if isinstance(padding, str) and any(d != 1 for d in lhs_dilation):
        return None
    kernel = [k_shape[a] for a in rhs_spec[2:]]
    pads = resolved_padding(x_shape, k_shape, dict(
        strides=strides, padding=padding, rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers))
    patterns: list[np.ndarray | None] = [None] * len(y_shape)
    for d, axis in enumerate(lhs_spec[2:]):
        patterns[axis] = _taps(y_shape[axis], x_shape[axis], kernel[d], strides[d], pads[d][0],
                               lhs_dilation[d], rhs_dilation[d])
    groups = int(feature_group_count)
    c_in, c_out = x_shape[lhs_spec[1]], y_shape[out_spec[1]]
    patterns[out_spec[1]] = np.equal.outer(np.arange(c_out) // (c_out // groups), np.arange(c_in) // (c_in // groups))
    return tuple(patterns)


def _taps(n_out: int, n_in: int, size: int, stride: int, low: int, lhs_dilation: int, rhs_dilation: int) -> np.ndarray:
    """``(n_out, n_in)``: whether output ``o`` reads input ``i`` along one spatial axis (tap ``j``
    of output ``o`` sits at ``o·stride + j·rhs_dilation - low`` of the input dilated by
    ``lhs_dilation``; only its multiples of ``lhs_dilation`` are input elements)."""
    at = np.arange(n_out)[:, None] * stride + np.arange(size)[None, :] * rhs_dilation - low
    hit = (at >= 0) & (at % lhs_dilation == 0) & (at // lhs_dilation < n_in)
    reads = np.zeros((n_out, n_in), bool)
    rows, taps = np.nonzero(hit)
    reads[rows, at[rows, taps] // lhs_dilation] = True
    return reads


etp_conv_p.register_etp_rules(
    dt_to_t=_conv_dt_to_t,
    xy_to_dw=_conv_xy_to_dw,
    init_drtrl=_conv_init_drtrl,
    init_pp=_conv_init_pp,
    instant_drtrl=_conv_instant_drtrl,
    solve_drtrl=_conv_solve_drtrl,
    snap_anchor=snap_anchored,
    snap_adjacency=_conv_snap_adjacency,
)


# --- user function ------------------------------------------------------------------------


def conv(
    x: ArrayLike,
    kernel: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    strides: int | Sequence[int] = (1,),
    padding: str | Sequence[tuple[int, int]] = "SAME",
    lhs_dilation: int | Sequence[int] | None = None,
    rhs_dilation: int | Sequence[int] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    dimension_numbers: lax.ConvGeneralDilatedDimensionNumbers = None,
    kernel_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array | u.Quantity:
    """N-D convolution whose kernel (and bias) learn online with eligibility traces.

    Use it in place of ``jax.lax.conv_general_dilated`` for a kernel that should take part
    in online learning.

    Parameters
    ----------
    x : array or Quantity
        Input with a leading batch axis, e.g. ``(batch, in_channels, width)`` in the default
        layout; the same rank as ``kernel``.
    kernel : array or Quantity
        Kernel, e.g. ``(out_channels, in_channels / feature_group_count, k_width)``.
    bias : array or Quantity, optional
        ``(out_channels,)`` (added along the output-channel axis of the layout) or any shape
        that broadcasts onto one sample of the output; in the unit of ``x·kernel``.
    strides : int or sequence of int
        Window strides, one per spatial axis; a single value applies to every axis.
    padding : str or sequence of (low, high)
        ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` or one pair per spatial axis.
    lhs_dilation, rhs_dilation : int or sequence of int, optional
        Input (transposed convolution) and kernel (atrous) dilation, as ``strides``.
    feature_group_count, batch_group_count : int
        Grouped convolution, as in ``jax.lax.conv_general_dilated``.
    dimension_numbers : None, (str, str, str) or jax.lax.ConvDimensionNumbers
        Layout, e.g. ``('NHWC', 'HWIO', 'NHWC')``; ``None`` is ``NC…/OI…/NC…``. The batch
        axis must lead the input and the output.
    kernel_fn, bias_fn : callable, optional
        Shape-preserving transforms applied inside the primitive. Traces and gradients stay
        with respect to the raw stored parameters.

    Returns
    -------
    array or Quantity
        The output in the layout's output spec, in the unit of ``x·kernel``.

    Raises
    ------
    TypeError
        If an operand is not an array, a hook is not callable, or an argument has the wrong
        type.
    ValueError
        For mismatched ranks, spatial arguments of the wrong length, an unknown padding, a
        layout without a leading batch axis, a hook that changes shapes, or shapes that do
        not form a convolution (channels) or do not take the bias.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._op.conv import conv
    >>> conv(jnp.ones((1, 1, 4, 4)), jnp.ones((2, 1, 3, 3)), padding='VALID',
    ...      kernel_fn=lambda k: 0.5 * k)[0, :, 0, 0]
    Array([4.5, 4.5], dtype=float32)
    """
    op = "braintrace.conv"
    x_m, x_unit = split_units(x, "x", op)
    k_m, k_unit = split_units(kernel, "kernel", op)
    check_hook(kernel_fn, "kernel_fn", op)
    check_hook(bias_fn, "bias_fn", op)
    n_spatial = check_ranks(x_m, k_m, op)
    params: Params = dict(
        strides=per_axis(strides, "strides", n_spatial, op),
        padding=padding_argument(padding, n_spatial, op),
        lhs_dilation=per_axis(lhs_dilation, "lhs_dilation", n_spatial, op, optional=True),
        rhs_dilation=per_axis(rhs_dilation, "rhs_dilation", n_spatial, op, optional=True),
        feature_group_count=group_count(feature_group_count, "feature_group_count", op),
        batch_group_count=group_count(batch_group_count, "batch_group_count", op),
        dimension_numbers=layout_argument(dimension_numbers, x_m.shape, k_m.shape, op),
        kernel_fn=kernel_fn,
        bias_fn=bias_fn,
    )
    check_hook_shape(kernel_fn, k_m, "kernel_fn", op)
    y_shape = _output_shape(x_m, k_m, params, op)
    unit = x_unit * k_unit
    operands = [x_m, k_m]
    if bias is not None:
        b_m = bias_mantissa(bias, unit, op)
        check_hook_shape(bias_fn, b_m, "bias_fn", op)
        check_bias(b_m, y_shape, _conv_layout(params)[1], op)
        operands.append(b_m)
    y = etp_conv_p.bind(*operands, has_bias=bias is not None, **params)
    return with_unit(y, unit)


def _output_shape(x: Array, kernel: Array, params: Params, op: str) -> tuple[int, ...]:
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, kernel)]
    try:
        out = jax.eval_shape(partial(_etp_conv_impl, has_bias=False, **params), *structs)
    except (TypeError, ValueError) as err:
        raise OperandShapeError(
            f"{op}: x of shape {tuple(x.shape)} and kernel of shape {tuple(kernel.shape)} do not "
            f"form a convolution with dimension_numbers={params['dimension_numbers']!r}, "
            f"feature_group_count={params['feature_group_count']}, batch_group_count="
            f"{params['batch_group_count']}: {err}"
        ) from err
    return tuple(out.shape)
