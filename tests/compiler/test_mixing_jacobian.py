"""Per-position Jacobian blocks of transitions with weight mixing (``include_recurrent_mixing``).

The structured extraction (:mod:`braintrace._compiler.mixing_jacobian`) must equal the diagonal
blocks of the dense Jacobian wherever it claims a plan, refuse (plan ``None``) where it would
be wrong, and the memory-bounded fallback must be exact everywhere.
"""

from __future__ import annotations

import math
from typing import Any

import brainevent
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._compiler.hidden_group import block_diagonal_last_dim
from braintrace._compiler.mixing_jacobian import block_diagonal_plan, structured_block_diagonal
from tests.compiler import models


def _dense_blocks(fn: Any, stacked: jax.Array) -> np.ndarray:
    full = jax.jit(jax.jacrev(fn))(stacked)
    positions, num_state = math.prod(stacked.shape[:-1]), stacked.shape[-1]
    full = np.asarray(full).reshape(positions, num_state, positions, num_state)
    idx = np.arange(positions)
    return full[idx, :, idx, :].reshape(*stacked.shape[:-1], num_state, num_state)


def _group_case(model: brainstate.nn.Module, batch: int | None) -> list[tuple[Any, list, list]]:
    brainstate.nn.init_all_states(model, batch_size=batch)
    x = jnp.linspace(-1.0, 1.0, 3) if batch is None else jnp.tile(jnp.linspace(-1.0, 1.0, 3), (batch, 1))
    graph = braintrace.compile_etrace_graph(model, x, include_recurrent_mixing=True)
    _, _, _, temps = graph.module_info.jaxpr_call(x)
    rng = np.random.default_rng(0)
    cases = []
    for group in graph.hidden_groups:
        hidden = [jnp.asarray(rng.normal(size=st.value.shape), jnp.float32) for st in group.hidden_states]
        cases.append((group, hidden, [temps[v] for v in group.transition_jaxpr_constvars]))
    return cases


def _fn(group: Any, inputs: list) -> Any:
    return lambda stacked: group.concat_hidden(group.transition(group.split_hidden(stacked), inputs))


@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize(
    "model, in_series",
    [(models.LIF, False), (models.VanillaRNN, False), (models.LSTM, False), (models.LeakyRNN, False),
     (models.GRU, True)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_blocks_equal_the_dense_jacobian_blocks(model: Any, in_series: bool, batch: int | None, quiet: list) -> None:
    for group, hidden, inputs in _group_case(model(), batch):
        assert not group.is_diagonal_recurrence
        # GRU mixes twice in series (r = σ([x, h] W_r), then [x, r h] W_h).
        plan = group._mixing_plan()
        assert plan is not None and bool(plan.series) is in_series
        # Only the unit axis mixes: the fallback probes the batch rows together.
        assert group._mixing_axes(group.concat_hidden(hidden)) == [0 if batch is None else 1]
        got = jax.jit(group.diagonal_jacobian)(hidden, inputs)
        ref = _dense_blocks(_fn(group, inputs), group.concat_hidden(hidden))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", [models.VanillaRNN, models.LeakyRNN, models.GRU], ids=lambda m: m.__name__)
def test_the_blocks_of_dense_mixings_are_taken_by_slices_not_gathers(model: Any, quiet: list) -> None:
    # A gather of single elements is slow on a TPU: one per step took OSTLRecurrent on a GRU-256 to
    # 44x BPTT there (2.40 ms → 73.7 ms). The columns these layouts select are runs of one slice.
    for group, hidden, inputs in _group_case(model(), 3):
        hlo = jax.jit(group.diagonal_jacobian).lower(hidden, inputs).as_text()
        assert "gather" not in hlo


def test_a_static_take_gathers_an_index_that_is_not_one_run() -> None:
    from braintrace._compiler.mixing_jacobian import _static_take

    a = jnp.arange(12.0).reshape(3, 4)
    for index, gathers in [(np.array([-1, 1, 2, 3]), False), (np.array([2, 1, -1]), True), (np.array([0, -1, 2]), True)]:
        got = jax.jit(lambda a, i=index: _static_take(a, i, axis=1))
        ref = np.where(index >= 0, np.asarray(a)[:, np.maximum(index, 0)], 0)
        np.testing.assert_array_equal(got(a), ref)
        assert ("gather" in got.lower(a).as_text()) is gathers


def test_a_permutation_after_the_mixing_is_refused_and_the_fallback_is_exact() -> None:
    w = jax.random.normal(jax.random.PRNGKey(0), (4, 4))
    closed = jax.make_jaxpr(lambda h: jnp.tanh(h @ w)[..., ::-1])(jnp.zeros((2, 4)))
    assert block_diagonal_plan(closed.jaxpr, [False], (2, 4)) is None

    def fn(s: jax.Array) -> jax.Array:
        return jnp.tanh(s[..., 0] @ w)[..., ::-1][..., None]

    h = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 1))
    got = jax.jit(lambda h: block_diagonal_last_dim(fn, h))(h)
    np.testing.assert_allclose(got, _dense_blocks(fn, h), rtol=1e-6, atol=1e-7)


def test_three_mixings_in_series_are_refused() -> None:
    w = jax.random.normal(jax.random.PRNGKey(0), (4, 4))
    closed = jax.make_jaxpr(lambda h: jnp.tanh(jnp.tanh(jnp.tanh(h @ w) @ w) @ w))(jnp.zeros(4))
    assert block_diagonal_plan(closed.jaxpr, [False], (4,)) is None


def _structured(step: Any, h: jax.Array, num_state: int | None = None) -> tuple[Any, Any, Any]:
    """The plan, the structured blocks and the dense blocks of ``step`` (one member)."""
    closed = jax.make_jaxpr(step)(h)
    has_axis = num_state is not None
    plan = block_diagonal_plan(closed.jaxpr, [has_axis], h.shape[:-1] if has_axis else h.shape)
    assert plan is not None
    kw = dict(concat=lambda v: v[0], split=lambda s: [s]) if has_axis else {}
    got = jax.jit(lambda h: structured_block_diagonal(plan, closed.jaxpr, closed.consts, [h], **kw))(h)
    ref = _dense_blocks(step, h) if has_axis else _dense_blocks(lambda s: step(s[..., 0])[..., None], h[..., None])
    return plan, got, ref


@pytest.mark.parametrize("batch", [(), (3,)])
def test_two_mixings_in_series_with_stacked_gates(batch: tuple[int, ...]) -> None:
    """Two gates from one first mixing (two slots), one read directly and one through a second
    mixing that also reads ``h`` unmixed; a second first mixing feeds the second as well."""
    x = jax.random.normal(jax.random.PRNGKey(13), (*batch, 2))
    u = jax.random.normal(jax.random.PRNGKey(14), (2 + 5, 10))
    v = jax.random.normal(jax.random.PRNGKey(15), (5, 5))
    w = jax.random.normal(jax.random.PRNGKey(16), (2 + 5, 5))

    def step(h: jax.Array) -> jax.Array:
        a, r = jnp.split(jax.nn.sigmoid(jnp.concatenate([x, h], axis=-1) @ u), 2, axis=-1)
        q = jnp.sin(h @ v)
        cand = jnp.tanh(jnp.concatenate([x, r * h + q * q], axis=-1) @ w)
        return (1 - a) * h + a * cand

    h = jax.random.normal(jax.random.PRNGKey(17), (*batch, 5))
    plan, got, ref = _structured(step, h)
    ((second, rules),) = plan.series.items()
    assert len(rules) == 2 and sorted(int(s.max()) + 1 for s in plan.slots.values()) == [1, 2]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # The negative control: without the series terms, the second mixing's blocks are those of
    # its unmixed input alone.
    no_series = plan._replace(series={second: ()})
    closed = jax.make_jaxpr(step)(h)
    wrong = structured_block_diagonal(no_series, closed.jaxpr, closed.consts, [h])
    assert not np.allclose(wrong, ref, rtol=1e-3, atol=1e-3)


def test_two_mixings_in_series_on_a_state_axis() -> None:
    """A two-state member: the first mixing reads state 0, the second reads state 1 gated by it."""
    u = jax.random.normal(jax.random.PRNGKey(18), (4, 4))
    w = jax.random.normal(jax.random.PRNGKey(19), (4, 4))

    def step(h: jax.Array) -> jax.Array:
        gate = jax.nn.sigmoid(h[..., 0] @ u)
        new1 = jnp.tanh((gate * h[..., 1]) @ w) + 0.5 * h[..., 1]
        return jnp.stack([0.9 * h[..., 0] + new1, new1 * h[..., 0]], axis=-1)

    h = jax.random.normal(jax.random.PRNGKey(20), (2, 4, 2))
    plan, got, ref = _structured(step, h, num_state=2)
    assert plan.series
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_a_first_mixing_reading_a_position_twice_is_refused_in_series() -> None:
    """``[h, h²] @ U`` read by a second mixing: the pre-factor is no longer one column per
    position, so the plan is refused and the fallback is exact."""
    u = jax.random.normal(jax.random.PRNGKey(21), (8, 4))
    w = jax.random.normal(jax.random.PRNGKey(22), (4, 4))

    def step(h: jax.Array) -> jax.Array:
        return jnp.tanh((jax.nn.sigmoid(jnp.concatenate([h, h * h], axis=-1) @ u) * h) @ w)

    h = jax.random.normal(jax.random.PRNGKey(23), (2, 4))
    closed = jax.make_jaxpr(step)(h)
    assert block_diagonal_plan(closed.jaxpr, [False], (2, 4)) is None

    def fn(s: jax.Array) -> jax.Array:
        return step(s[..., 0])[..., None]

    got = jax.jit(lambda s: block_diagonal_last_dim(fn, s))(h[..., None])
    np.testing.assert_allclose(got, _dense_blocks(fn, h[..., None]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [(), (3,)])
def test_concatenated_input_and_duplicate_columns(batch: tuple[int, ...]) -> None:
    """``[x, h, h] @ W``: column ``n`` meets two input columns (the masked-matmul branch)."""
    x = jax.random.normal(jax.random.PRNGKey(2), (*batch, 2))
    w = jax.random.normal(jax.random.PRNGKey(3), (2 + 4 + 4, 4))

    def step(h: jax.Array) -> jax.Array:
        return 0.5 * h + jnp.sin(jnp.concatenate([x, h, jnp.exp(h)], axis=-1) @ w)

    h = jax.random.normal(jax.random.PRNGKey(4), (*batch, 4))
    closed = jax.make_jaxpr(step)(h)
    plan = block_diagonal_plan(closed.jaxpr, [False], h.shape)
    assert plan is not None
    (rule,) = plan.rules.values()
    assert rule.select is None  # two input columns per output column
    got = jax.jit(lambda h: structured_block_diagonal(plan, closed.jaxpr, closed.consts, [h]))(h)
    ref = _dense_blocks(lambda s: step(s[..., 0])[..., None], h[..., None])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_group_state_with_a_state_axis_and_within_position_reduction() -> None:
    """A two-state member (trailing axis) mixed through ``sum(h, -1) @ W``."""
    w = jax.random.normal(jax.random.PRNGKey(5), (3, 3))

    def step(h: jax.Array) -> jax.Array:
        drive = jnp.tanh(h.sum(axis=-1) @ w)
        return jnp.stack([0.9 * h[..., 0] + drive, 0.5 * h[..., 1] * h[..., 0]], axis=-1)

    h = jax.random.normal(jax.random.PRNGKey(6), (2, 3, 2))
    closed = jax.make_jaxpr(step)(h)
    plan = block_diagonal_plan(closed.jaxpr, [True], (2, 3))
    assert plan is not None
    got = jax.jit(lambda h: structured_block_diagonal(
        plan, closed.jaxpr, closed.consts, [h], concat=lambda v: v[0], split=lambda s: [s]))(h)
    np.testing.assert_allclose(got, _dense_blocks(step, h), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("forward", [False, True])
def test_fallback_probes_in_chunks_without_the_dense_jacobian(forward: bool) -> None:
    w = jax.random.normal(jax.random.PRNGKey(7), (5, 5))

    def fn(s: jax.Array) -> jax.Array:
        return jnp.stack([jnp.tanh(s[..., 0] @ w) * s[..., 1], s[..., 0] ** 2 + jnp.roll(s[..., 1], 1)], axis=-1)

    h = jax.random.normal(jax.random.PRNGKey(8), (2, 5, 2))
    got = jax.jit(lambda h: block_diagonal_last_dim(fn, h, forward=forward, chunk_size=3))(h)
    np.testing.assert_allclose(got, _dense_blocks(fn, h), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("forward", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_fallback_probes_the_mixing_axes_only(forward: bool, chunk_size: int | None) -> None:
    """Units (axis 1) mix twice in series; the leading and trailing position axes never do, so
    one probe per unit and state sets every other position at once: the same blocks."""
    w, u = jax.random.normal(jax.random.PRNGKey(9), (4, 4)), jax.random.normal(jax.random.PRNGKey(10), (4, 4))
    m = jax.random.normal(jax.random.PRNGKey(11), (2, 2))

    def fn(s: jax.Array) -> jax.Array:  # (3, 4, 2, S=2)
        gate = jax.nn.sigmoid(jnp.einsum("bnps,nm->bmps", s, u))
        return jnp.tanh(jnp.einsum("bnps,nm->bmps", gate * s, w)) @ m + 0.3 * s

    h = jax.random.normal(jax.random.PRNGKey(12), (3, 4, 2, 2))
    got = jax.jit(lambda h: block_diagonal_last_dim(fn, h, forward=forward, chunk_size=chunk_size,
                                                    mixing_axes=[1]))(h)
    np.testing.assert_allclose(got, _dense_blocks(fn, h), rtol=1e-5, atol=1e-6)
    # The negative control: a mixing axis probed as if it did not mix sums its positions' columns.
    wrong = block_diagonal_last_dim(fn, h, forward=forward, mixing_axes=[])
    assert not np.allclose(wrong, _dense_blocks(fn, h), rtol=1e-3, atol=1e-3)


class _ConvRNN(brainstate.nn.Module):
    """``h = σ(τ) h + tanh(conv([x, h], K))`` on a 4×3 map with two channels."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = brainstate.ParamState(jax.random.normal(jax.random.PRNGKey(29), (3, 3, 3, 2)) / 3)
        self.tau = brainstate.ParamState(jnp.ones((4, 3, 2)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, 4, 3, 2)))

    def update(self, x: jax.Array) -> jax.Array:
        xh = jnp.concatenate([x.reshape(-1, 4, 3, 1), self.h.value], axis=-1)
        drive = braintrace.conv(xh, self.kernel.value, dimension_numbers=("NHWC", "HWIO", "NHWC"))
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(drive)
        return self.h.value.reshape(x.shape[0], -1)


def _online_gradients(model: brainstate.nn.Module, n_in: int, learner_of: Any, check: Any) -> list[np.ndarray]:
    brainstate.nn.init_all_states(model, batch_size=2)
    xs = jax.random.normal(jax.random.PRNGKey(24), (6, 2, n_in))
    learner = learner_of(model, xs[0])
    assert check(learner)
    grads = learner.etrace_grad(xs, step_fn=lambda x: jnp.sum(learner(x) ** 2))
    return [np.asarray(g) for g in jax.tree.leaves(grads)]


def _ring_with_self_connections(n: int) -> Any:
    """A CSR over ``n`` neurons: each reads itself (half of them) and its two neighbours."""
    rows, cols = [], []
    for i in range(n):
        for j in sorted({(i - 1) % n, (i + 1) % n} | ({i} if i % 2 == 0 else set())):
            rows.append(i)
            cols.append(j)
    indptr = np.searchsorted(np.asarray(rows), np.arange(n + 1))
    data = jnp.ones(len(cols))
    return brainevent.CSR((data, jnp.asarray(cols, jnp.int32), jnp.asarray(indptr, jnp.int32)), shape=(n, n))


def _tiny_connectome() -> brainstate.nn.Module:
    """The benchmark's connectome model on a ring whose even neurons also connect to themselves."""
    from benchmarks import connectome

    ring = _ring_with_self_connections(30)
    return connectome.ConnectomeLIF(np.asarray(ring.indptr), np.asarray(ring.indices), n_in=4, n_sensory=6,
                                    n_readout=5)


@pytest.mark.parametrize("model, n_in", [(models.GRU, 3), (_ConvRNN, 12), (_tiny_connectome, 4)],
                         ids=["GRU", "conv", "connectome"])
@pytest.mark.parametrize("algorithm, options", [(braintrace.OSTLRecurrent, {}), (braintrace.SnAp, {"n": 1})],
                         ids=["OSTLRecurrent", "SnAp-1"])
def test_a_learner_reads_the_same_blocks_structured_or_probed(
    model: Any, n_in: int, algorithm: Any, options: dict, monkeypatch: Any, quiet: list
) -> None:
    """The learners that keep recurrent mixing in ``D`` give the same gradients through the
    structured extraction (two mixings in series; a convolution; a sparse connectome) as through
    the probing fallback (plan refused)."""
    def learner_of(model: Any, x: jax.Array) -> Any:
        return braintrace.compile(model, algorithm, x, batch_size=2, **options)

    def plans(learner: Any) -> list[Any]:
        return [g._mixing_plan() for g in learner.graph.hidden_groups]

    structured = _online_gradients(model(), n_in, learner_of, lambda lrn: all(p is not None for p in plans(lrn)))
    monkeypatch.setattr(braintrace._compiler.hidden_group.HiddenGroup, "_mixing_plan", lambda self: None)
    probed = _online_gradients(model(), n_in, learner_of, lambda lrn: all(p is None for p in plans(lrn)))
    assert len(structured) == len(probed) > 0
    for got, ref in zip(structured, probed):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


CONV_CASES = {
    "NHWC SAME": dict(dimension_numbers=("NHWC", "HWIO", "NHWC"), padding="SAME"),
    "NCHW SAME_LOWER": dict(dimension_numbers=("NCHW", "OIHW", "NCHW"), padding="SAME_LOWER"),
    "dilated kernel": dict(dimension_numbers=("NHWC", "HWIO", "NHWC"), padding="SAME", rhs_dilation=(2, 1)),
    "explicit padding": dict(dimension_numbers=("NHWC", "HWIO", "NHWC"), padding=((2, 0), (1, 1))),
    "no same-location tap": dict(dimension_numbers=("NHWC", "HWIO", "NHWC"), padding=((3, -1), (1, 1))),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_a_convolution_keeps_the_tap_at_each_location(case: str) -> None:
    """``braintrace.conv`` mixing the hidden map: the same-position part is the convolution
    masked to the tap that reads the output's own location (none with the last padding)."""
    options = CONV_CASES[case]
    channel_last = options["dimension_numbers"][0] == "NHWC"
    x = jax.random.normal(jax.random.PRNGKey(25), (2, 5, 4, 1) if channel_last else (2, 1, 5, 4))
    kernel = jax.random.normal(jax.random.PRNGKey(26), (3, 3, 4, 3) if channel_last else (3, 4, 3, 3))
    axis = -1 if channel_last else 1

    def step(h: jax.Array) -> jax.Array:
        drive = braintrace.conv(jnp.concatenate([x, h], axis=axis), kernel, **options)
        return 0.8 * h + jnp.tanh(drive)

    h = jax.random.normal(jax.random.PRNGKey(27), (2, 5, 4, 3) if channel_last else (2, 3, 5, 4))
    plan, got, ref = _structured(step, h)
    ((rule,),) = [plan.rules.values()]
    assert bool(rule.mask.any()) is (case != "no same-location tap")
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # The negative control: the kernel's centre tap taken whatever the padding.
    if case == "explicit padding":
        closed = jax.make_jaxpr(step)(h)
        shifted = np.zeros_like(rule.mask)
        shifted[1, 1] = rule.mask[2, 1]
        wrong_plan = plan._replace(rules={k: rule._replace(mask=shifted) for k in plan.rules})
        wrong = structured_block_diagonal(wrong_plan, closed.jaxpr, closed.consts, [h])
        assert not np.allclose(wrong, ref, rtol=1e-3, atol=1e-3)


def test_a_strided_convolution_is_refused() -> None:
    kernel = jax.random.normal(jax.random.PRNGKey(28), (3, 3, 3, 3))

    def step(h: jax.Array) -> jax.Array:
        return jnp.tanh(braintrace.conv(h, kernel, strides=(2, 1), padding=((1, 2), (1, 1)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")))

    closed = jax.make_jaxpr(step)(jnp.zeros((2, 4, 4, 3)))
    assert block_diagonal_plan(closed.jaxpr, [False], (2, 4, 4, 3)) is None


class _DepthwiseConvRNN(brainstate.nn.Module):
    """``h = tanh(x + depthwise_conv(h, K))`` on a 4×3 map with two channels, each its own group."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = brainstate.ParamState(jax.random.normal(jax.random.PRNGKey(32), (3, 3, 1, 2)) / 3)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, 4, 3, 2)))

    def update(self, x: jax.Array) -> jax.Array:
        recurrent = braintrace.conv(self.h.value, self.kernel.value, feature_group_count=2,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))
        self.h.value = jnp.tanh(x[:, None, :, None] + recurrent)
        return self.h.value.reshape(x.shape[0], -1)


def test_a_grouped_convolution_is_probed_along_its_spatial_axes_only(quiet: list) -> None:
    """The structured extraction refuses a grouped convolution; the fallback reads the kernel's
    adjacency and probes the map's positions only (the batch rows and the channels, one group
    each, never read each other)."""
    ((group, hidden, inputs),) = _group_case(_DepthwiseConvRNN(), 2)
    assert group._mixing_plan() is None
    stacked = group.concat_hidden(hidden)
    assert group._mixing_axes(stacked) == [1, 2]
    ref = _dense_blocks(_fn(group, inputs), stacked)
    np.testing.assert_allclose(jax.jit(group.diagonal_jacobian)(hidden, inputs), ref, rtol=1e-5, atol=1e-6)
    # The negative control: the map's columns probed as if they did not mix.
    wrong = block_diagonal_last_dim(_fn(group, inputs), stacked, forward=True, mixing_axes=[1])
    assert not np.allclose(wrong, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("batch", [(), (3,)])
def test_a_sparse_product_keeps_its_self_connections(batch: tuple[int, ...]) -> None:
    """``braintrace.sparse_matmul`` mixing the hidden state: the same-position part is the stored
    entries that join a neuron to itself (through the weight hook)."""
    mat = _ring_with_self_connections(6)
    values = jax.random.normal(jax.random.PRNGKey(30), (mat.data.shape[0],))

    def step(h: jax.Array) -> jax.Array:
        drive = braintrace.sparse_matmul(jnp.tanh(h), values, sparse_mat=mat, weight_fn=jnp.sin)
        return 0.7 * h + drive * h

    h = jax.random.normal(jax.random.PRNGKey(31), (*batch, 6))
    plan, got, ref = _structured(step, h)
    ((rule,),) = [plan.rules.values()]
    assert int(rule.mask.sum()) == 3  # the three self-connections
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # The negative control: the neighbours' entries kept as if they joined a position to itself.
    closed = jax.make_jaxpr(step)(h)
    wrong_plan = plan._replace(rules={k: rule._replace(mask=~rule.mask) for k in plan.rules})
    wrong = structured_block_diagonal(wrong_plan, closed.jaxpr, closed.consts, [h])
    assert not np.allclose(wrong, ref, rtol=1e-3, atol=1e-3)
