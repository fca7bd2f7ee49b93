"""SnAp-n over a convolutional recurrence: the kernel's footprint is the neighbourhood.

``etp_conv``'s ``snap_adjacency`` rule says which input positions each output position reads
(the taps the strides, padding and dilations place, every channel of the group, the sample
itself). It is checked against the dependence pattern of the convolution's own Jacobian, and a
1-D convolutional RNN is trained with SnAp-n: its neighbourhoods grow with ``n`` from the
kernel's footprint, and the saturated order equals BPTT.
"""

from __future__ import annotations

import importlib
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.snap_ring import EXACT, bptt, float64, inputs, online  # noqa: F401 (fixture)

conv_module = importlib.import_module("braintrace._op.conv")

# --- the rule against the convolution's Jacobian -------------------------------------------

LAYOUTS = [
    # (x shape, kernel shape, params)
    ((2, 6, 3), (3, 3, 4), dict(strides=(1,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC"))),
    ((2, 3, 7), (4, 3, 2), dict(strides=(1,), padding="SAME_LOWER", dimension_numbers=("NCW", "OIW", "NCW"))),
    ((1, 5, 6, 2), (3, 2, 2, 2), dict(strides=(1, 1), padding=((2, 1), (0, 3)), rhs_dilation=(2, 1),
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    ((2, 9, 2), (3, 2, 2), dict(strides=(2,), padding="VALID", dimension_numbers=("NWC", "WIO", "NWC"))),
    ((2, 4, 2), (3, 2, 2), dict(strides=(1,), padding=((1, 2),), lhs_dilation=(2,),
                                dimension_numbers=("NWC", "WIO", "NWC"))),
    ((2, 6, 4), (3, 2, 6), dict(strides=(1,), padding="SAME", feature_group_count=2,
                                dimension_numbers=("NWC", "WIO", "NWC"))),
]


def _params(params: dict[str, Any]) -> dict[str, Any]:
    return dict(dict(lhs_dilation=None, rhs_dilation=None, feature_group_count=1, batch_group_count=1), **params)


def _dependence(x_shape: tuple[int, ...], k_shape: tuple[int, ...], params: dict[str, Any]) -> np.ndarray:
    """``dep[y index, x index]``: where the convolution's Jacobian is not zero (random kernel)."""
    kernel = jax.random.uniform(jax.random.PRNGKey(0), k_shape, minval=0.5, maxval=1.0)
    p = _params(params)

    def fn(x: jax.Array) -> jax.Array:
        return jax.lax.conv_general_dilated(
            x, kernel, p["strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"],
            p["dimension_numbers"], p["feature_group_count"], p["batch_group_count"])

    jac = jax.jacfwd(fn)(jnp.ones(x_shape))
    y_size = int(np.prod(jac.shape[: jac.ndim - len(x_shape)]))
    return np.asarray(jac).reshape(y_size, -1) != 0


def _product(patterns: tuple[Any, ...], x_shape: tuple[int, ...]) -> np.ndarray:
    """The dependence the per-axis patterns describe: their Kronecker product (``None``: identity)."""
    full = np.ones((1, 1), bool)
    for pattern, size in zip(patterns, x_shape):
        full = np.kron(full, np.eye(size, dtype=bool) if pattern is None else pattern)
    return full


@pytest.mark.parametrize("x_shape, k_shape, params", LAYOUTS)
def test_the_conv_adjacency_is_the_jacobians_pattern(x_shape: Any, k_shape: Any, params: Any) -> None:
    dependence = _dependence(x_shape, k_shape, params)
    y_shape = jax.eval_shape(
        lambda x, k: conv_module.conv(x, k, **params), jnp.ones(x_shape), jnp.ones(k_shape)).shape
    patterns = conv_module._conv_snap_adjacency(
        tuple(x_shape), tuple(y_shape), operand_shapes=[x_shape, k_shape], **_params(params))
    assert patterns is not None
    np.testing.assert_array_equal(_product(patterns, x_shape), dependence)
    assert not dependence.all()  # the footprint is narrower than all-to-all


def test_a_wrong_padding_misses_the_jacobians_pattern() -> None:
    """Negative control: the footprint of SAME read as VALID's is not the convolution's."""
    x_shape, k_shape, params = LAYOUTS[0]
    patterns = conv_module._conv_snap_adjacency(
        x_shape, x_shape[:-1] + (4,), operand_shapes=[x_shape, k_shape], **_params(dict(params, padding=((0, 2),))))
    assert patterns is not None
    assert not np.array_equal(_product(patterns, x_shape), _dependence(x_shape, k_shape, params))


@pytest.mark.parametrize("params", [
    dict(strides=(1,), padding="SAME", dimension_numbers=("NCW", "OIW", "NWC")),  # moved channels
    dict(strides=(1,), padding="SAME", batch_group_count=2, dimension_numbers=("NWC", "WIO", "NWC")),
    dict(strides=(1,), padding="SAME", lhs_dilation=(2,), dimension_numbers=("NWC", "WIO", "NWC")),
])
def test_layouts_the_rule_cannot_describe_read_as_none(params: dict[str, Any]) -> None:
    assert conv_module._conv_snap_adjacency(
        (2, 4, 4), (2, 4, 4), operand_shapes=[(2, 4, 4), (3, 4, 4)], **_params(params)) is None


def test_a_kernel_of_another_rank_reads_as_none() -> None:
    params = _params(dict(strides=(1,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC")))
    assert conv_module._conv_snap_adjacency(
        (2, 4, 4), (2, 4, 4), operand_shapes=[(2, 4, 4), (3, 3, 4, 4)], **params) is None


# --- SnAp-n on a convolutional RNN ----------------------------------------------------------

W, C, I, B = 5, 2, 3, 2
LAYOUT = dict(padding="SAME", dimension_numbers=("NWC", "WIO", "NWC"))


class ConvRNN(brainstate.nn.Module):
    """``h ← tanh(conv(x, K_in) + conv(h, K))``: ``h (B, 5, 2)``, a width-3 recurrent kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.k = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(1), (3, C, C)))
        self.k_in = brainstate.ParamState(0.5 * jax.random.normal(jax.random.PRNGKey(2), (1, I, C)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, W, C)))

    def update(self, x: jax.Array) -> jax.Array:
        drive = braintrace.conv(x, self.k_in.value, **LAYOUT)
        self.h.value = jnp.tanh(drive + braintrace.conv(self.h.value, self.k.value, **LAYOUT))
        return self.h.value.reshape(-1, W * C)


def _sequence() -> tuple[jax.Array, jax.Array]:
    xs, ys = inputs(batch=B, n_in=W * I, width=W * C)
    return xs.reshape(xs.shape[0], B, W, I), ys


def _snap(n: int, xs: jax.Array) -> Any:
    model = ConvRNN()
    brainstate.nn.init_all_states(model, batch_size=B)
    return braintrace.compile(model, braintrace.SnAp, xs[0], n=n, batch_size=B)


def _relative_error(grads: dict[Any, np.ndarray], reference: dict[Any, np.ndarray]) -> float:
    return max(float(np.max(np.abs(grads[p] - reference[p])) / np.max(np.abs(reference[p]))) for p in reference)


def test_snap_2_widens_onto_the_kernels_footprint() -> None:
    xs, _ = _sequence()
    pattern = _snap(2, xs).graph.hidden_groups[0].snap
    assert pattern is not None and not pattern.conservative, pattern.reason
    batch, width, channels = pattern.adjacency
    np.testing.assert_array_equal(batch, np.eye(B, dtype=bool))
    np.testing.assert_array_equal(width, np.abs(np.subtract.outer(np.arange(W), np.arange(W))) <= 1)
    assert channels.all()
    assert pattern.num_neighbour == 3 * C  # an interior unit: three positions, both channels


def test_the_saturated_order_equals_bptt_and_a_narrower_one_does_not() -> None:
    xs, ys = _sequence()
    reference = bptt(ConvRNN(), xs, ys, batch=B)
    saturated = _snap(5, xs)  # an edge unit reaches the far edge in four steps
    assert saturated.graph.hidden_groups[0].snap.is_saturated
    assert _relative_error(online(saturated, xs, ys), reference) < EXACT
    narrow = _snap(2, xs)
    assert not narrow.graph.hidden_groups[0].snap.is_saturated
    assert _relative_error(online(narrow, xs, ys), reference) > 1e-3
