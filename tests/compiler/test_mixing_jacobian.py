"""Per-position Jacobian blocks of transitions with weight mixing (``include_recurrent_mixing``).

The structured extraction (:mod:`braintrace._compiler.mixing_jacobian`) must equal the diagonal
blocks of the dense Jacobian wherever it claims a plan, refuse (plan ``None``) where it would
be wrong, and the memory-bounded fallback must be exact everywhere.
"""

from __future__ import annotations

import math
from typing import Any

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
    "model, structured",
    [(models.LIF, True), (models.VanillaRNN, True), (models.LSTM, True), (models.LeakyRNN, True), (models.GRU, False)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_blocks_equal_the_dense_jacobian_blocks(model: Any, structured: bool, batch: int | None, quiet: list) -> None:
    for group, hidden, inputs in _group_case(model(), batch):
        assert not group.is_diagonal_recurrence
        # GRU mixes twice in series (r = σ([x, h] W_r), then [x, r h] W_h): the blocks of a
        # product are not products of blocks, so the structured path must refuse it.
        assert (group._mixing_plan() is not None) is structured
        # Only the unit axis mixes: the fallback probes the batch rows together.
        assert group._mixing_axes(group.concat_hidden(hidden)) == [0 if batch is None else 1]
        got = jax.jit(group.diagonal_jacobian)(hidden, inputs)
        ref = _dense_blocks(_fn(group, inputs), group.concat_hidden(hidden))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_a_permutation_after_the_mixing_is_refused_and_the_fallback_is_exact() -> None:
    w = jax.random.normal(jax.random.PRNGKey(0), (4, 4))
    closed = jax.make_jaxpr(lambda h: jnp.tanh(h @ w)[..., ::-1])(jnp.zeros((2, 4)))
    assert block_diagonal_plan(closed.jaxpr, [False], (2, 4)) is None

    def fn(s: jax.Array) -> jax.Array:
        return jnp.tanh(s[..., 0] @ w)[..., ::-1][..., None]

    h = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 1))
    got = jax.jit(lambda h: block_diagonal_last_dim(fn, h))(h)
    np.testing.assert_allclose(got, _dense_blocks(fn, h), rtol=1e-6, atol=1e-7)


def test_two_mixings_in_series_are_refused() -> None:
    w = jax.random.normal(jax.random.PRNGKey(0), (4, 4))
    closed = jax.make_jaxpr(lambda h: jnp.tanh(jnp.tanh(h @ w) @ w))(jnp.zeros(4))
    assert block_diagonal_plan(closed.jaxpr, [False], (4,)) is None


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
