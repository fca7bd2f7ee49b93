"""Embedding, convolutions and the leaky readout: forwards, errors and exact online gradients."""

from __future__ import annotations

from typing import Any

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.nn.helpers import bptt_grads, compile_quiet, max_rel_err, normal, online_grads

# --- Embedding ------------------------------------------------------------------------------

TABLE = normal(0, (5, 3))


@pytest.mark.parametrize("indices", [2, [0, 4, 1], [[1, 2], [3, 3], [0, 4]]])
def test_embedding_looks_up_rows(indices: Any) -> None:
    layer = braintrace.nn.Embedding(5, 3, embedding_init=TABLE)
    idx = jnp.asarray(indices)
    y = layer(indices)
    assert y.shape == (*idx.shape, 3)
    np.testing.assert_array_equal(y, TABLE[idx])


@pytest.mark.parametrize(
    "option, value",
    [("padding_idx", 0), ("max_norm", 1.0), ("scale_grad_by_freq", True), ("freeze", True)],
)
def test_embedding_options_are_refused_at_construction(option: str, value: Any) -> None:
    with pytest.raises(NotImplementedError, match=option):
        braintrace.nn.Embedding(5, 3, **{option: value})


def test_embedding_keeps_brainstate_validation() -> None:
    with pytest.raises(ValueError, match="num_embeddings"):
        braintrace.nn.Embedding(-1, 3)


@pytest.mark.parametrize(
    "indices, value, fix",
    [
        ([0, 5, 1], "index 5 at position (1,)", "num_embeddings > 5"),
        (7, "index 7 is", "num_embeddings > 7"),
        ([[1, 2], [3, -1]], "index -1 at position (1, 1)", "indices % 5"),
    ],
)
def test_embedding_refuses_concrete_out_of_range_indices(indices: Any, value: str, fix: str) -> None:
    layer = braintrace.nn.Embedding(5, 3, embedding_init=TABLE)
    with pytest.raises(ValueError) as info:
        layer(jnp.asarray(indices))
    message = str(info.value)
    assert "braintrace.nn.Embedding" in message and value in message
    assert "[0, 5)" in message and fix in message


def test_embedding_in_range_indices_still_work() -> None:  # control of the refusal above
    layer = braintrace.nn.Embedding(5, 3, embedding_init=TABLE)
    np.testing.assert_array_equal(layer(jnp.array([0, 4])), TABLE[jnp.array([0, 4])])


@pytest.mark.parametrize(
    "indices, shown",
    [(jnp.array([1.0, 2.0]), ("integers", "float32", "astype(jnp.int32)")),
     (jnp.array([1, 2]) * u.mV, ("plain integers", "mV", "without its unit"))],
)
def test_embedding_refuses_indices_that_are_not_integers(indices: Any, shown: tuple[str, ...]) -> None:
    with pytest.raises(TypeError) as info:
        braintrace.nn.Embedding(5, 3)(indices)
    assert "braintrace.nn.Embedding" in str(info.value)
    assert all(part in str(info.value) for part in shown)


def test_embedding_under_jit_reads_out_of_range_indices_as_nan_rows() -> None:
    layer = braintrace.nn.Embedding(5, 3, embedding_init=TABLE)
    y = np.asarray(jax.jit(layer)(jnp.array([[4, 5], [-1, 0]])))
    np.testing.assert_array_equal(y[0, 0], TABLE[4])
    np.testing.assert_array_equal(y[1, 1], TABLE[0])
    assert np.isnan(y[0, 1]).all() and np.isnan(y[1, 0]).all()  # not clamped, not wrapped


def test_embedding_gradient_of_in_range_rows_is_unchanged_under_jit() -> None:
    layer = braintrace.nn.Embedding(5, 3, embedding_init=TABLE)
    params = layer.states(brainstate.ParamState)
    idx = jnp.array([[0, 4], [4, 2]])
    grads = brainstate.transform.jit(
        lambda i: brainstate.transform.grad(lambda: jnp.sum(layer(i) * jnp.arange(3.0)), params)()
    )(idx)
    (g,) = grads.values()
    expected = jnp.zeros((5, 3)).at[idx.reshape(-1)].add(jnp.arange(3.0))
    np.testing.assert_allclose(np.asarray(g), expected)


def test_check_finite_reports_an_out_of_range_index_seen_under_tracing() -> None:
    brainstate.random.seed(0)
    learner = compile_quiet(LeakyEmbedding(), jnp.array([0, 1]))
    with pytest.raises(braintrace.NonFiniteError, match="step 1"):
        learner.etrace_evolve(jnp.array([[0, 1], [4, 5], [2, 2]]), check_finite=True)
    brainstate.nn.reset_all_states(learner)  # control: the same sequence within the table runs
    assert learner.etrace_evolve(jnp.array([[0, 1], [4, 3], [2, 2]]), check_finite=True) is None


# --- Convolutions ---------------------------------------------------------------------------


def _reference(layer: Any, x: jax.Array) -> jax.Array:
    params = layer.weight.value
    kernel = params["weight"] if layer.w_mask is None else params["weight"] * layer.w_mask
    batched = x if x.ndim == layer.num_spatial_dims + 2 else x[None]
    y = jax.lax.conv_general_dilated(
        batched, kernel, window_strides=layer.stride, padding=layer.padding,
        lhs_dilation=layer.lhs_dilation, rhs_dilation=layer.rhs_dilation,
        feature_group_count=layer.groups, dimension_numbers=layer.dimension_numbers,
    )
    if "bias" in params:
        y = y + params["bias"]
    return y if x.ndim == layer.num_spatial_dims + 2 else y[0]


CONV_CASES = {
    "1d": (braintrace.nn.Conv1d, dict(in_size=(7, 2), out_channels=4, kernel_size=3), (3, 7, 2)),
    "1d-stride-valid-bias": (
        braintrace.nn.Conv1d,
        dict(in_size=(8, 2), out_channels=3, kernel_size=3, stride=2, padding="VALID",
             b_init=brainstate.nn.init.Normal()),
        (2, 8, 2),
    ),
    "2d-channel-first-bias": (
        braintrace.nn.Conv2d,
        dict(in_size=(2, 5, 5), out_channels=3, kernel_size=3, channel_first=True, b_init=brainstate.nn.init.Normal()),
        (2, 2, 5, 5),
    ),
    "2d-unbatched-groups": (
        braintrace.nn.Conv2d, dict(in_size=(5, 5, 4), out_channels=2, kernel_size=(3, 2), groups=2), (5, 5, 4)
    ),
    "3d-dilated": (
        braintrace.nn.Conv3d, dict(in_size=(4, 4, 4, 1), out_channels=2, kernel_size=2, rhs_dilation=2), (1, 4, 4, 4, 1)
    ),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_matches_lax(case: str) -> None:
    cls, kwargs, x_shape = CONV_CASES[case]
    brainstate.random.seed(1)
    layer = cls(**kwargs)
    x = normal(2, x_shape)
    y = layer(x)
    np.testing.assert_allclose(y, _reference(layer, x), rtol=1e-5, atol=1e-5)
    assert y.shape[-len(layer.out_size):] == layer.out_size


def test_conv_mask_runs_inside_the_primitive() -> None:
    mask = (jnp.arange(3 * 2 * 4).reshape(3, 2, 4) % 2) * 1.0
    layer = braintrace.nn.Conv1d((6, 2), 4, 3, w_mask=mask)
    x = normal(3, (2, 6, 2))
    np.testing.assert_allclose(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-5)
    eqns = jax.make_jaxpr(layer)(x).jaxpr.eqns
    assert [e.primitive.name for e in eqns if e.primitive.name.startswith("etp_")] == ["etp_conv"]
    assert eqns[-1].params["kernel_fn"] is not None
    grads = brainstate.transform.grad(lambda: layer(x).sum(), layer.states(brainstate.ParamState))()
    (g,) = grads.values()
    assert np.all(np.asarray(g["weight"])[np.asarray(mask) == 0] == 0)


def test_conv_keeps_brainstate_checks() -> None:
    with pytest.raises(ValueError, match="divisible"):
        braintrace.nn.Conv1d((6, 3), 4, 3, groups=2)
    layer = braintrace.nn.Conv1d((6, 2), 4, 3)
    with pytest.raises(ValueError, match="expected input shape"):
        layer(jnp.ones((1, 5, 2)))


CONV_BAD_INPUTS = {
    # case: (layer, input shape, what the message must name besides the layer and the shapes)
    "channels": (lambda: braintrace.nn.Conv2d((4, 4, 3), 2, 3), (2, 4, 4, 5),
                 ("(batch, H, W, C_in)", "in_size=(4, 4, 3)", "(2, 4, 4, 5)", "(4, 4, 5)", "5 channels",
                  "in_size=(4, 4, 5)")),
    "channels-first map": (lambda: braintrace.nn.Conv2d((4, 4, 3), 2, 3), (3, 4, 4),
                           ("(H, W, C_in)", "(3, 4, 4)", "jnp.moveaxis(x, -3, -1)", "channel_first=True")),
    "channels-last map": (lambda: braintrace.nn.Conv1d((3, 6), 2, 3, channel_first=True), (2, 6, 3),
                          ("(batch, C_in, L)", "(2, 6, 3)", "jnp.moveaxis(x, -1, -2)", "channel_first=False")),
    "spatial": (lambda: braintrace.nn.Conv1d((6, 2), 4, 3), (1, 5, 2),
                ("expected input shape", "(1, 5, 2)", "(5, 2)", "spatial size", "in_size=(5, 2)")),
    "extra axis": (lambda: braintrace.nn.Conv3d((2, 2, 2, 1), 2, 1), (3, 2, 2, 2, 2, 1),
                   ("(batch, H, W, D, C_in)", "5D", "(3, 2, 2, 2, 2, 1) (6D)", "x.reshape(-1, 2, 2, 2, 1)")),
    "too few axes": (lambda: braintrace.nn.Conv1d((6, 2), 4, 3), (6,),
                     ("(L, C_in)", "(6,) (1D)", "Reshape the input to (batch, 6, 2) or (6, 2)")),
}


@pytest.mark.parametrize("case", sorted(CONV_BAD_INPUTS))
def test_conv_refuses_a_wrong_input_shape_at_the_call(case: str) -> None:
    factory, shape, shown = CONV_BAD_INPUTS[case]
    layer = factory()
    with pytest.raises(ValueError) as info:
        layer(jnp.ones(shape))
    message = str(info.value)
    assert message.startswith(f"{type(layer).__name__}: ")
    for part in shown:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.parametrize("shape", [(6, 6, 2), (1, 6, 6, 2), (3, 6, 6, 2)])
def test_conv_still_takes_one_sample_or_a_batch(shape: tuple[int, ...]) -> None:  # control
    layer = braintrace.nn.Conv2d((6, 6, 2), 3, 3)  # an unbatched map gets a batch of one inside
    assert layer(jnp.ones(shape)).shape == (*shape[:-3], 6, 6, 3)


# --- LeakyRateReadout -----------------------------------------------------------------------


def test_readout_decay_from_tau_and_dt() -> None:
    with brainstate.environ.context(dt=1.0 * u.ms):
        readout = braintrace.nn.LeakyRateReadout(3, 2, tau=5.0 * u.ms)
    np.testing.assert_allclose(readout.decay, np.exp(-1 / 5), rtol=1e-6)
    assert readout.W.value.shape == (3, 2)
    assert readout.in_size == (3,) and readout.out_size == (2,)


def test_readout_without_dt_says_how_to_set_it() -> None:
    with pytest.raises(KeyError, match=r"brainstate\.environ\.set\(dt="):
        braintrace.nn.LeakyRateReadout(3, 2)


@pytest.mark.parametrize("bad", [0, (3, -1), "3"])
def test_readout_rejects_bad_sizes(bad: Any) -> None:
    with brainstate.environ.context(dt=1.0 * u.ms), pytest.raises(ValueError, match="in_size"):
        braintrace.nn.LeakyRateReadout(bad, 2)


def test_readout_integrates_its_input() -> None:
    w = normal(4, (3, 2))
    with brainstate.environ.context(dt=1.0 * u.ms):
        readout = braintrace.nn.LeakyRateReadout(3, 2, tau=2.0 * u.ms, w_init=w)
    readout.init_state(batch_size=4)
    assert readout.r.value.shape == (4, 2)
    xs = normal(5, (3, 4, 3))
    r = jnp.zeros((4, 2))
    for x in xs:
        r = np.exp(-0.5) * r + x @ w
        np.testing.assert_allclose(readout(x), r, rtol=1e-5, atol=1e-6)
    readout.reset_state(batch_size=4)
    np.testing.assert_array_equal(readout.r.value, jnp.zeros((4, 2)))


def test_readout_weight_is_a_temporal_relation() -> None:
    with brainstate.environ.context(dt=1.0 * u.ms):
        readout = braintrace.nn.LeakyRateReadout(3, 2)
    readout.init_state()
    graph = braintrace.compile_etrace_graph(readout, jnp.ones(3))
    (rel,) = graph.hidden_param_op_relations
    assert rel.trainable_paths == {"weight": ("W",)}
    assert rel.connected_hidden_paths == [("r",)]


# --- exact online gradients -----------------------------------------------------------------


class LeakyConv(brainstate.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.conv = braintrace.nn.Conv1d((5, 2), 2, 3, groups=groups, b_init=brainstate.nn.init.Normal())

    def init_state(self, batch_size: int | None = None, **kw: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((2, 5, 2)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.6 * self.h.value + jnp.tanh(self.conv(x))
        return self.h.value


class LeakyEmbedding(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = braintrace.nn.Embedding(5, 3)

    def init_state(self, batch_size: int | None = None, **kw: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((2, 3)))

    def update(self, idx: Any) -> Any:
        self.h.value = 0.6 * self.h.value + jnp.tanh(self.emb(idx))
        return self.h.value


def _readout() -> Any:
    with brainstate.environ.context(dt=1.0 * u.ms):
        return braintrace.nn.LeakyRateReadout(3, 2, tau=4.0 * u.ms)


ONLINE_CASES = {
    "conv": (lambda: LeakyConv(1), normal(6, (4, 2, 5, 2)), normal(7, (4, 2, 5, 2))),
    "conv-groups": (lambda: LeakyConv(2), normal(6, (4, 2, 5, 2)), normal(7, (4, 2, 5, 2))),
    "embedding": (LeakyEmbedding, jnp.array([[0, 1], [4, 1], [2, 2], [3, 0]]), normal(8, (4, 2, 3))),
    "readout": (_readout, normal(9, (4, 3)), normal(10, (4, 2))),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(ONLINE_CASES))
def test_single_step_d_rtrl_equals_bptt(case: str) -> None:
    factory, xs, ys = ONLINE_CASES[case]
    brainstate.random.seed(3)
    model = factory()
    ref = bptt_grads(model, xs, ys)
    got = online_grads(compile_quiet(model, xs[0]), xs, ys)
    assert max_rel_err(ref, got) < 1e-4
