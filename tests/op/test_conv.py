"""``braintrace.conv`` / ``etp_conv`` beyond the generic rule oracles.

The table rows in ``cases/conv.py`` check every rule against the full Jacobian. This module
covers the user function (signature, argument normalisation, errors, units, bias broadcast),
the patch extraction behind the instantaneous term, the layout helper, the D-RTRL guards
(batch groups, transforms the per-position trace cannot carry) and an end-to-end check that
the rules compose into an exact learner (D-RTRL equals BPTT).
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from braintrace._errors import OperandShapeError, OperandTypeError
from braintrace._op import _registries as reg
from braintrace._op.conv import (
    _conv_extract_patches,
    _conv_instant_drtrl,
    _conv_layout,
    _conv_solve_drtrl,
    _etp_conv_impl,
    _window_patches,
    conv,
    etp_conv_p,
)
from tests.op.cases.conv import NHWC, PERMUTED
from tests.op.opcase import close, rand


def _params(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        has_bias=False, strides=(1,), padding="SAME", lhs_dilation=None, rhs_dilation=None,
        feature_group_count=1, batch_group_count=1, dimension_numbers=None, kernel_fn=None,
        bias_fn=None,
    )
    base.update(kw)
    return base


def _eqn(fn: Any, *args: Any) -> Any:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is etp_conv_p]
    return eqn


def _lax_conv(x: Any, k: Any, **kw: Any) -> Any:
    return lax.conv_general_dilated(
        x, k, window_strides=kw.pop("strides", (1,) * (k.ndim - 2)), padding=kw.pop("padding", "SAME"),
        precision=lax.Precision.HIGHEST, **kw,
    )


# --- the user function ----------------------------------------------------------------------


def test_signature_is_exact() -> None:
    sig = inspect.signature(conv)
    kw_only = [
        ("strides", (1,)), ("padding", "SAME"), ("lhs_dilation", None), ("rhs_dilation", None),
        ("feature_group_count", 1), ("batch_group_count", 1), ("dimension_numbers", None),
        ("kernel_fn", None), ("bias_fn", None),
    ]
    names = [p.name for p in sig.parameters.values()]
    assert names == ["x", "kernel", "bias", *[n for n, _ in kw_only]]
    kinds = [p.kind for p in sig.parameters.values()]
    assert kinds[:3] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 3
    assert all(k is inspect.Parameter.KEYWORD_ONLY for k in kinds[3:])
    assert sig.parameters["bias"].default is None
    for name, default in kw_only:
        assert sig.parameters[name].default == default, name


def test_registration_and_static_params() -> None:
    assert etp_conv_p.name == "etp_conv"
    assert reg.is_batched_primitive(etp_conv_p)
    assert not reg.is_etp_enable_gradient_primitive(etp_conv_p)
    assert reg.get_x_invar_index(etp_conv_p) == 0
    assert reg.get_batched_counterpart(etp_conv_p) is None
    assert reg.get_fast_path_rules(etp_conv_p) is None
    assert reg.get_instant_drtrl_rule(etp_conv_p) is _conv_instant_drtrl
    assert reg.get_solve_drtrl_rule(etp_conv_p) is _conv_solve_drtrl
    x, k, b = rand(1, (2, 2, 5)), rand(2, (3, 2, 3)), rand(3, (3,))
    keys = {
        "has_bias", "strides", "padding", "lhs_dilation", "rhs_dilation", "feature_group_count",
        "batch_group_count", "dimension_numbers", "kernel_fn", "bias_fn",
    }
    plain = _eqn(lambda x, k: conv(x, k), x, k)
    assert set(plain.params) == keys and plain.params["has_bias"] is False
    assert len(plain.invars) == 2
    assert reg.get_trainable_invars(etp_conv_p, plain.params) == {"weight": 1}
    biased = _eqn(lambda x, k, b: conv(x, k, b, kernel_fn=jnp.tanh), x, k, b)
    assert biased.params["has_bias"] is True and biased.params["kernel_fn"] is jnp.tanh
    assert reg.get_trainable_invars(etp_conv_p, biased.params) == {"weight": 1, "bias": 2}


@pytest.mark.parametrize(
    "x_shape, k_shape, dn",
    [((2, 2, 5), (3, 2, 3), None), ((2, 4, 5, 2), (3, 3, 2, 3), NHWC), ((1, 2, 3, 3, 3), (2, 2, 2, 2, 2), None)],
    ids=["1d", "2d-nhwc", "3d"],
)
def test_matches_lax_with_and_without_hooks(x_shape: Any, k_shape: Any, dn: Any) -> None:
    x, k = rand(1, x_shape), rand(2, k_shape)
    close(conv(x, k, dimension_numbers=dn), _lax_conv(x, k, dimension_numbers=dn))
    close(
        conv(x, k, dimension_numbers=dn, kernel_fn=jnp.tanh),
        _lax_conv(x, jnp.tanh(k), dimension_numbers=dn),
    )


def test_gradients_are_exact_with_respect_to_the_raw_parameters() -> None:
    x, k, b = rand(1, (2, 4, 5, 2)), rand(2, (3, 3, 2, 3)), rand(3, (3,))
    ct = rand(4, (2, 4, 5, 3))

    def ours(k: Any, b: Any) -> Any:
        y = conv(x, k, b, dimension_numbers=NHWC, kernel_fn=jnp.tanh, bias_fn=jnp.square)
        return jnp.sum(ct * y)

    def reference(k: Any, b: Any) -> Any:
        return jnp.sum(ct * (_lax_conv(x, jnp.tanh(k), dimension_numbers=NHWC) + b**2))

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(k, b)
    want = jax.jit(jax.grad(reference, argnums=(0, 1)))(k, b)
    close(got[0], want[0], atol=1e-4)
    close(got[1], want[1], atol=1e-4)


def test_single_strides_and_dilations_apply_to_every_spatial_axis() -> None:
    x, k = rand(1, (2, 2, 6, 6)), rand(2, (3, 2, 3, 3))
    close(conv(x, k, strides=(2,)), _lax_conv(x, k, strides=(2, 2)))
    close(conv(x, k, strides=2, rhs_dilation=2), _lax_conv(x, k, strides=(2, 2), rhs_dilation=(2, 2)))
    close(conv(x, k, strides=np.array([2, 1])), _lax_conv(x, k, strides=(2, 1)))
    eqn = _eqn(lambda x: conv(x, k, rhs_dilation=[2], lhs_dilation=(1, 1)), x)
    assert eqn.params["strides"] == (1, 1)
    assert eqn.params["rhs_dilation"] == (2, 2)
    assert eqn.params["lhs_dilation"] == (1, 1)


def test_padding_and_layout_become_hashable_static_params() -> None:
    x, k = rand(1, (2, 4, 5, 2)), rand(2, (3, 3, 2, 3))
    eqn = _eqn(lambda x: conv(x, k, padding=[[1, 0], [0, 2]], dimension_numbers=list(NHWC)), x)
    assert eqn.params["padding"] == ((1, 0), (0, 2))
    assert eqn.params["dimension_numbers"] == NHWC
    hash(eqn.params["padding"]), hash(eqn.params["dimension_numbers"])
    close(
        conv(x, k, padding=[[1, 0], [0, 2]], dimension_numbers=list(NHWC)),
        _lax_conv(x, k, padding=((1, 0), (0, 2)), dimension_numbers=NHWC),
    )
    assert _eqn(lambda x: conv(x, k, padding="valid", dimension_numbers=NHWC), x).params["padding"] == "valid"
    assert _eqn(lambda x: conv(x, k, dimension_numbers=PERMUTED), x).params["dimension_numbers"] == PERMUTED


def test_rank1_bias_runs_along_the_channel_axis_even_when_a_spatial_axis_has_its_size() -> None:
    # Default layout, width 3 == out channels 3: NumPy broadcasting would add b along width.
    x, k, b = rand(1, (2, 2, 3)), rand(2, (3, 2, 3)), jnp.array([1.0, 10.0, 100.0])
    y = conv(x, k, b)
    close(y, _lax_conv(x, k) + b[None, :, None])
    assert not np.allclose(np.asarray(y), np.asarray(_lax_conv(x, k) + b))
    # Channel-last layout; and a bias with its own broadcast shape is added as it is.
    xh, kh = rand(4, (2, 4, 3, 2)), rand(5, (2, 2, 2, 3))
    close(conv(xh, kh, b, dimension_numbers=NHWC), _lax_conv(xh, kh, dimension_numbers=NHWC) + b)
    b2 = rand(6, (3, 3))
    close(conv(x, k, b2), _lax_conv(x, k) + b2)


def test_units_multiply_and_the_bias_is_converted() -> None:
    x, k = rand(1, (2, 2, 5)), rand(2, (3, 2, 3))
    plain = conv(x, k, jnp.ones(3))
    assert isinstance(plain, jax.Array)
    y = conv(x * u.mV, k * u.siemens, jnp.ones(3) * 1e3 * u.uA)
    assert isinstance(y, u.Quantity)
    close(y.to_decimal(u.mV * u.siemens), plain)
    with pytest.raises(u.UnitMismatchError):
        conv(x * u.mV, k, jnp.ones(3))


# --- errors ----------------------------------------------------------------------------------


X1, K1 = rand(1, (2, 2, 5)), rand(2, (3, 2, 3))
X2, K2 = rand(1, (2, 2, 4, 4)), rand(2, (3, 2, 3, 3))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: conv([[1.0]], K1), OperandTypeError, "x must be"),
        (lambda: conv(X1, "kernel"), OperandTypeError, "kernel must be"),
        (lambda: conv(X1, K1, kernel_fn=3), TypeError, "kernel_fn must be a callable"),
        (lambda: conv(X1, K1, jnp.ones(3), bias_fn="tanh"), TypeError, "bias_fn must be a callable"),
        (lambda: conv(X1[0], K1), ValueError, r"leading batch axis"),
        (lambda: conv(X1, K1[..., 0]), ValueError, "kernel must have rank 3 or more"),
        (lambda: conv(X2, K2, strides=(1, 1, 1)), ValueError, "strides must have one entry per spatial axis"),
        (lambda: conv(X2, K2, strides=(0, 1)), ValueError, "strides must hold positive ints"),
        (lambda: conv(X2, K2, strides="2"), TypeError, "strides must be an int or a sequence"),
        (lambda: conv(X2, K2, rhs_dilation=(1, 2, 3)), ValueError, "rhs_dilation must have one entry"),
        (lambda: conv(X2, K2, padding="FULL"), ValueError, "padding must be 'SAME'"),
        (lambda: conv(X2, K2, padding=((1, 1),)), ValueError, r"2 \(low, high\) int pairs"),
        (lambda: conv(X2, K2, dimension_numbers=("NCHW", "OIHW", "NCXW")), ValueError, "invalid dimension_numbers"),
        (lambda: conv(X2, K2, dimension_numbers=("CNHW", "OIHW", "NCHW")), ValueError, "batch axis must lead"),
        (lambda: conv(X2, K2, dimension_numbers="NCHW"), TypeError, "dimension_numbers must be None"),
        (lambda: conv(X2, rand(3, (3, 3, 3, 3))), OperandShapeError, r"do not form a convolution"),
        (lambda: conv(X2, K2, feature_group_count=0), ValueError, "feature_group_count must be a positive int"),
        (lambda: conv(X1, K1, jnp.ones(4)), OperandShapeError, r"pass \(3,\) for one bias per output channel"),
        (lambda: conv(X1, K1, jnp.ones((2, 3, 5))), OperandShapeError, "does not fit the output"),
        (lambda: conv(X1, K1, kernel_fn=lambda k: k[0]), ValueError, "kernel_fn must preserve"),
        (lambda: conv(X1, K1, jnp.ones(3), bias_fn=jnp.sum), ValueError, "bias_fn must preserve"),
    ],
)
def test_misuse_is_reported_before_binding(call: Any, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_vmap_decomposes_with_a_warning() -> None:
    xs = jnp.stack([X1, 2 * X1])
    with pytest.warns(UserWarning, match="decomposed"):
        got = jax.vmap(lambda x: conv(x, K1))(xs)
    close(got[1], _lax_conv(2 * X1, K1))


# --- layout and patches ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "strides, dn, want",
    [
        ((1,), None, (1, 1, 0, 0)),
        ((1, 1), None, (2, 1, 0, 0)),
        ((1,), ("NCH", "OIH", "NCH"), (1, 1, 0, 0)),
        ((1,), ("NWC", "WIO", "NWC"), (1, 2, 0, 2)),
        ((1, 1), NHWC, (2, 3, 0, 3)),
        ((1, 1), ("NHWC", "OIHW", "NCHW"), (2, 1, 0, 0)),
        ((1, 1), PERMUTED, (2, 3, 0, 3)),
    ],
)
def test_conv_layout(strides: Any, dn: Any, want: Any) -> None:
    assert _conv_layout(_params(strides=strides, dimension_numbers=dn)) == want


@pytest.mark.parametrize(
    "x_shape, k_shape, kw",
    [
        ((2, 2, 5), (3, 2, 3), {}),
        ((2, 2, 5), (3, 2, 2), dict(strides=(2,), padding="VALID", rhs_dilation=(2,))),
        ((2, 4, 5, 2), (3, 2, 2, 3), dict(dimension_numbers=NHWC, strides=(2, 1))),
        ((2, 4, 5, 2), (2, 3, 2, 3), dict(dimension_numbers=PERMUTED)),
        ((1, 2, 3, 3, 3), (2, 2, 2, 2, 2), dict(lhs_dilation=(1, 2, 1), padding=((1, 0),) * 3)),
    ],
    ids=["1d", "1d-stride-dilation", "2d-nhwc", "2d-permuted", "3d-lhs-dilation"],
)
def test_patches_times_kernel_reproduce_the_convolution(x_shape: Any, k_shape: Any, kw: Any) -> None:
    params = _params(**{"strides": (1,) * (len(k_shape) - 2), **kw})
    x, k = rand(1, x_shape), rand(2, k_shape)
    patches = _conv_extract_patches(x, k.shape, params)  # (B, *s, C_in, *k_spatial)
    dn = lax.conv_dimension_numbers(x.shape, k.shape, params["dimension_numbers"])
    spatial = [a for a in range(k.ndim) if a not in dn.rhs_spec[:2]]
    k_oiu = jnp.transpose(k, (dn.rhs_spec[0], dn.rhs_spec[1], *spatial))  # (O, I, *k_spatial)
    n_s = k.ndim - 2
    got = jnp.tensordot(patches, k_oiu, axes=(list(range(1 + n_s, patches.ndim)), list(range(1, k.ndim))))
    want = jnp.moveaxis(_etp_conv_impl(x, k, **params), dn.out_spec[1], -1)  # (B, *s, O)
    close(got, want, atol=1e-5)
    # Keyword form of the static parameters.
    close(_conv_extract_patches(x, k.shape, **params), patches)


@pytest.mark.parametrize(
    "x_shape, k_shape, kw",
    [
        ((2, 2, 5), (3, 2, 3), {}),
        ((2, 2, 7), (3, 2, 2), dict(strides=(3,), padding="SAME_LOWER", rhs_dilation=(2,))),
        ((2, 4, 5, 2), (3, 2, 2, 3), dict(dimension_numbers=NHWC, strides=(2, 1), padding="VALID")),
        ((2, 4, 5, 2), (2, 3, 2, 3), dict(dimension_numbers=PERMUTED, padding=((2, -1), (0, 1)))),
        ((3, 2, 4, 5), (2, 4, 2, 3), dict(dimension_numbers=("CNWH", "IWHO", "WHNC"))),
        ((1, 2, 3, 4, 3), (2, 2, 2, 3, 2), dict(lhs_dilation=(1, 2, 1), rhs_dilation=(2, 1, 1),
                                                strides=(1, 2, 1), padding=((1, 0), (2, 1), (0, 0)))),
    ],
    ids=["1d", "1d-stride-dilation-same-lower", "2d-nhwc-valid", "2d-permuted-negative-pad",
         "2d-odd-layouts", "3d-both-dilations"],
)
def test_patches_are_jaxs_patches_without_the_convolution(x_shape: Any, k_shape: Any, kw: Any) -> None:
    """The patches are read off by strided slices: the same array as JAX's, which runs a grouped
    convolution by a 0/1 kernel for it (on the CPU, about twice the layer's own convolution)."""
    params = _params(**{"strides": (1,) * (len(k_shape) - 2), **kw})
    x = rand(1, x_shape)
    dn = lax.conv_dimension_numbers(x.shape, k_shape, params["dimension_numbers"])
    filter_shape = tuple(n for a, n in enumerate(k_shape) if a not in dn.rhs_spec[:2])
    want = lax.conv_general_dilated_patches(
        x, filter_shape, params["strides"], params["padding"], lhs_dilation=params["lhs_dilation"],
        rhs_dilation=params["rhs_dilation"], dimension_numbers=dn, precision=lax.Precision.HIGHEST)
    got = _window_patches(x, filter_shape, dn, params)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jaxpr = jax.make_jaxpr(lambda x: _window_patches(x, filter_shape, dn, params))(x)
    assert not [e for e in jaxpr.jaxpr.eqns if e.primitive is lax.conv_general_dilated_p]


# --- D-RTRL guards and the IO-dim pullback ---------------------------------------------------


def _init_drtrl(x: Any, weights: dict[str, Any], **kw: Any) -> dict[str, Any]:
    params = _params(**{"strides": (1,) * (weights["weight"].ndim - 2), "has_bias": "bias" in weights, **kw})
    eqn = _eqn(lambda x, ws: etp_conv_p.bind(x, *[ws[k] for k in weights], **params), x, weights)
    layout = reg.get_trainable_invars(etp_conv_p, eqn.params)
    weight_vars = {key: eqn.invars[i] for key, i in layout.items()}
    rule = reg.ETP_RULES_INIT_DRTRL[etp_conv_p]
    return rule(eqn.invars[0], eqn.outvars[0], weight_vars, 1, eqn_params=eqn.params)  # type: ignore[no-any-return]


def test_init_drtrl_rejects_batch_groups_and_points_to_pp_prop() -> None:
    x = rand(1, (4, 2, 5))
    with pytest.raises(NotImplementedError, match=r"(?s)grouped convolution.*pp_prop"):
        _init_drtrl(x, {"weight": rand(2, (4, 2, 3))}, batch_group_count=2)


def test_init_drtrl_accepts_feature_groups() -> None:
    # Depthwise. Exactness of grouped traces: the grouped oracle rows and test_drtrl_equals_bptt.
    init = _init_drtrl(rand(1, (2, 3, 4)), {"weight": rand(2, (3, 1, 2))}, feature_group_count=3)
    assert init["weight"].shape == (2, 4, 3, 1, 2, 1)


def _softmax(b: Any) -> Any:
    return jax.nn.softmax(b)


def _global_norm(k: Any) -> Any:
    return k / jnp.sqrt(jnp.sum(k**2))


def _per_filter_norm(k: Any) -> Any:  # out axis 0 (OIH)
    return k / jnp.sqrt(jnp.sum(k**2, axis=(1, 2), keepdims=True))


def test_init_drtrl_rejects_transforms_the_per_position_trace_cannot_carry() -> None:
    x, k, b = rand(1, (2, 2, 5)), rand(2, (3, 2, 3)), rand(3, (3,))
    with pytest.raises(NotImplementedError, match=r"(?s)bias_fn must be element-wise.*pp_prop"):
        _init_drtrl(x, {"weight": k, "bias": b}, bias_fn=_softmax)
    with pytest.raises(NotImplementedError, match=r"(?s)kernel_fn.*mixes output channels.*pp_prop"):
        _init_drtrl(x, {"weight": k}, kernel_fn=_global_norm)
    # Element-wise and per-filter transforms are fine, also while tracing under jit.
    init = _init_drtrl(x, {"weight": k, "bias": b}, kernel_fn=_per_filter_norm, bias_fn=jnp.exp)
    assert init["weight"].shape == (2, 5, 3, 2, 3, 1) and init["bias"].shape == (2, 3, 5, 1)
    jax.jit(lambda x: _init_drtrl(x, {"weight": k, "bias": b}, kernel_fn=jnp.tanh)["weight"])(x)
    with pytest.raises(NotImplementedError, match="mixes output channels"):
        jax.jit(lambda x: _init_drtrl(x, {"weight": k}, kernel_fn=_global_norm)["weight"])(x)
    # The filter is found through the layout: HWIO filters are slices along the last axis.
    xh, kh = rand(4, (2, 4, 5, 2)), rand(5, (3, 3, 2, 3))
    nhwc = dict(strides=(1, 1), dimension_numbers=NHWC)

    def hwio_filter_norm(k: Any) -> Any:
        return k / jnp.sqrt(jnp.sum(k**2, axis=(0, 1, 2), keepdims=True))

    assert _init_drtrl(xh, {"weight": kh}, kernel_fn=hwio_filter_norm, **nhwc)["weight"].shape == (2, 4, 5, 3, 3, 2, 3, 1)
    def oihw_filter_norm(k: Any) -> Any:  # per filter for an O-first kernel: mixes HWIO outputs
        return k / jnp.sqrt(jnp.sum(k**2, axis=(1, 2, 3), keepdims=True))

    with pytest.raises(NotImplementedError, match="mixes output channels"):
        _init_drtrl(xh, {"weight": kh}, kernel_fn=oihw_filter_norm, **nhwc)


@pytest.mark.parametrize("kw", [dict(bias_fn=_softmax), dict(kernel_fn=_global_norm, bias_fn=jnp.tanh)])
def test_xy_to_dw_is_exact_and_param_shaped_for_any_transform(kw: Any) -> None:
    x, weights = rand(1, (2, 2, 5)), {"weight": rand(2, (3, 2, 3)), "bias": rand(3, (3,))}
    params = _params(has_bias=True, **kw)
    rule = reg.ETP_RULES_XY_TO_DW[etp_conv_p]
    hd = rand(4, (2, 3, 5))

    @jax.jit
    def reference(x: Any, hd: Any, ws: Any) -> Any:
        return jax.vjp(lambda w: _etp_conv_impl(x, w["weight"], w["bias"], **params), ws)[1](hd)[0]

    for xs, hs in ((x, hd), (x[0], hd[0])):  # batched (context P) and one sample
        got, want = rule(xs, hs, weights, **params), reference(xs, hs, weights)
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in weights.items()}
        for key in want:
            close(got[key], want[key])


def test_xy_to_dw_bias_is_summed_over_batch_and_positions() -> None:
    x, weights = rand(1, (2, 4, 5, 2)), {"weight": rand(2, (3, 3, 2, 3)), "bias": rand(3, (3,))}
    hd = rand(4, (2, 4, 5, 3))
    grads = reg.ETP_RULES_XY_TO_DW[etp_conv_p](x, hd, weights, **_params(has_bias=True, strides=(1, 1), dimension_numbers=NHWC))
    assert {k: v.shape for k, v in grads.items()} == {"weight": (3, 3, 2, 3), "bias": (3,)}
    close(grads["bias"], hd.sum(axis=(0, 1, 2)))


# --- D-RTRL equals BPTT ----------------------------------------------------------------------


T = 4


def _drtrl_and_bptt(x_seq: Any, weights: dict[str, Any], params: dict[str, Any]) -> tuple[Any, Any]:
    """``h_t = a ⊙ h_{t-1} + tanh(conv(x_t))``, loss ``Σ_t <c_t, h_t>``: rule-based D-RTRL and BPTT."""
    keys = [k for k in ("weight", "bias") if k in weights]  # invar order (pytrees sort dict keys)
    y_shape = _etp_conv_impl(x_seq[0], *[weights[k] for k in keys], **params).shape
    leak = jax.random.uniform(jax.random.PRNGKey(5), y_shape, minval=0.3, maxval=0.9)
    c_seq = rand(6, (T, *y_shape))

    def y_of(ws: Any, x: Any) -> Any:
        return etp_conv_p.bind(x, *[ws[k] for k in keys], **params)

    def loss(ws: Any) -> Any:
        def step(h: Any, xc: Any) -> Any:
            h = leak * h + jnp.tanh(y_of(ws, xc[0]))
            return h, jnp.sum(xc[1] * h)

        return lax.scan(step, jnp.zeros(y_shape), (x_seq, c_seq))[1].sum()

    dt_to_t = reg.ETP_RULES_DT_TO_T[etp_conv_p]
    instant = reg.get_instant_drtrl_rule(etp_conv_p)
    solve = reg.get_solve_drtrl_rule(etp_conv_p)
    assert instant is not None and solve is not None
    eqn = _eqn(y_of, weights, x_seq[0])
    weight_vars = {k: eqn.invars[i] for k, i in reg.get_trainable_invars(etp_conv_p, eqn.params).items()}
    init = reg.ETP_RULES_INIT_DRTRL[etp_conv_p](eqn.invars[0], eqn.outvars[0], weight_vars, 1, eqn_params=params)

    def drtrl_step(carry: Any, xc: Any) -> Any:
        trace, grads = carry
        x, c = xc
        df = 1 - jnp.tanh(y_of(weights, x)) ** 2
        new = jax.vmap(lambda x, d: instant(x, d, weights, **params))(x, df)
        trace = jax.tree.map(jnp.add, dt_to_t(leak, trace, **params), new)
        per_sample = jax.vmap(lambda g, tr: solve(g, tr, weights, **params))(c, trace)
        return (trace, jax.tree.map(lambda a, g: a + g.sum(axis=0), grads, per_sample)), None

    trace = {k: v[..., 0] for k, v in init.items()}  # S == 1
    zeros = {k: jnp.zeros_like(w) for k, w in weights.items()}
    (_, grads), _ = lax.scan(drtrl_step, (trace, zeros), (x_seq, c_seq))
    return grads, jax.grad(loss)(weights)


@pytest.mark.slow
@pytest.mark.parametrize(
    "x_shape, k_shape, kw",
    [
        ((2, 2, 5), (3, 2, 3), {}),
        ((2, 4, 5, 2), (3, 3, 2, 3), dict(dimension_numbers=NHWC, strides=(1, 1), kernel_fn=jnp.tanh, bias_fn=jnp.exp)),
        ((2, 4, 5), (4, 2, 3), dict(feature_group_count=2, strides=(2,), padding="VALID", kernel_fn=_per_filter_norm)),
    ],
    ids=["1d-nch-bias", "2d-nhwc-bias-kernel-tanh-bias-exp", "1d-groups-stride-per-filter-norm-bias"],
)
def test_drtrl_equals_bptt(x_shape: Any, k_shape: Any, kw: Any) -> None:
    x_seq = rand(1, (T, *x_shape))
    weights = {"weight": 0.5 * rand(2, k_shape), "bias": 0.1 * rand(3, (k_shape[-1] if kw.get("dimension_numbers") else k_shape[0],))}
    params = _params(has_bias=True, **kw)
    # Under jit: one compilation instead of one per eager op.
    got, want = jax.jit(lambda xs, ws: _drtrl_and_bptt(xs, ws, params))(x_seq, weights)
    # float32, T=4: element-wise to 1e-5 relative to each gradient's scale.
    for key in want:
        scale = float(jnp.abs(want[key]).max())
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-5, atol=1e-5 * scale, err_msg=key)


# --- why the kernel trace is per position ----------------------------------------------------


def _per_position_summed_and_bptt(x_seq: Any, kernel: Any, leak: Any, c_seq: Any) -> tuple[Any, Any, Any]:
    """``h_t = leak ⊙ h_{t-1} + tanh(conv(x_t, K))`` (NCH/OIH), loss ``Σ_t <c_t, h_t>``.

    Three kernel gradients: D-RTRL with the registered per-position trace ``(B, W, *K.shape)``;
    D-RTRL with the positions summed into one kernel-shaped trace per sample ``(B, *K.shape)``
    (0.2.4-era layouts, as small as the parameter); and BPTT (``jax.grad`` through the loop).
    A kernel-shaped trace can only scale each output channel by one factor, so it rolls with
    the leak averaged over positions and is read with the signal averaged over positions: exact
    when both are the same at every position, and the best such a trace can do otherwise.
    """
    params = _params()
    weights = {"weight": kernel}
    instant, solve = reg.get_instant_drtrl_rule(etp_conv_p), reg.get_solve_drtrl_rule(etp_conv_p)
    assert instant is not None and solve is not None
    dt_to_t = reg.ETP_RULES_DT_TO_T[etp_conv_p]
    y_of = partial(_etp_conv_impl, **params)
    per_channel = leak.mean(-1)[:, None, None]  # (O, 1, 1) on the kernel's out axis

    def step(carry: Any, xc: Any) -> Any:
        trace, summed, got, got_summed = carry
        x, c = xc
        df = 1 - jnp.tanh(y_of(x, kernel)) ** 2
        new = jax.vmap(lambda x, d: instant(x, d, weights, **params))(x, df)["weight"]  # (B, W, *K)
        trace = dt_to_t(leak, {"weight": trace}, **params)["weight"] + new
        summed = per_channel * summed + new.sum(axis=1)
        got = got + jax.vmap(lambda g, tr: solve(g, {"weight": tr}, weights, **params))(c, trace)["weight"].sum(0)
        got_summed = got_summed + (c.mean(-1)[:, :, None, None] * summed).sum(0)
        return (trace, summed, got, got_summed), None

    y_shape = y_of(x_seq[0], kernel).shape
    init = (jnp.zeros((y_shape[0], y_shape[2], *kernel.shape)), jnp.zeros((y_shape[0], *kernel.shape)),
            jnp.zeros_like(kernel), jnp.zeros_like(kernel))
    (_, _, got, got_summed), _ = lax.scan(step, init, (x_seq, c_seq))

    def loss(k: Any) -> Any:
        def body(h: Any, xc: Any) -> Any:
            h = leak * h + jnp.tanh(y_of(xc[0], k))
            return h, jnp.sum(xc[1] * h)

        return lax.scan(body, jnp.zeros(y_shape), (x_seq, c_seq))[1].sum()

    return got, got_summed, jax.grad(loss)(kernel)


def test_a_kernel_shaped_trace_is_wrong_where_the_per_position_trace_is_exact() -> None:
    """The per-position kernel trace is what makes conv D-RTRL exact (docs/compatibility.md).

    With the leak and the loss weights the same at every position, summing the positions into a
    kernel-shaped trace loses nothing, and both layouts equal BPTT. Let either vary along the
    positions (a per-position leak, as any element-wise hidden state has) and the summed trace
    is tens of percent off BPTT, while the per-position trace still equals it element-wise.
    """
    x_seq, kernel = rand(1, (T, 2, 2, 6)), 0.5 * rand(2, (3, 2, 3))
    y_shape = (2, 3, 6)
    uniform_leak = jnp.broadcast_to(jnp.array([0.3, 0.6, 0.9])[:, None], y_shape[1:])
    uniform_c = jnp.broadcast_to(rand(6, (T, 2, 3, 1)), (T, *y_shape))
    leak = jax.random.uniform(jax.random.PRNGKey(5), y_shape[1:], minval=0.2, maxval=0.95)
    c_seq = rand(7, (T, *y_shape))
    run = jax.jit(_per_position_summed_and_bptt)

    def rel_err(a: Any, b: Any) -> float:
        return float(jnp.abs(a - b).max() / jnp.abs(b).max())

    got, got_summed, want = run(x_seq, kernel, uniform_leak, uniform_c)
    assert rel_err(got, want) < 1e-5 and rel_err(got_summed, want) < 1e-5
    for case_leak, case_c in ((leak, uniform_c), (uniform_leak, c_seq), (leak, c_seq)):
        got, got_summed, want = run(x_seq, kernel, case_leak, case_c)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
        assert rel_err(got_summed, want) > 0.1, rel_err(got_summed, want)
