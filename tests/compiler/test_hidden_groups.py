"""Hidden groups: discovery, merging, fallback, and the per-position Jacobians."""

from __future__ import annotations

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import DiagnosticKind, NotSupportedError
from braintrace._compiler.hidden_group import (
    block_diagonal_last_dim,
    group_merging,
    jacfwd_last_dim,
    jacrev_last_dim,
)
from tests.compiler import models


def _groups(model: Any, x: Any, **kw: Any) -> list:
    groups, mapping = braintrace.find_hidden_groups_from_module(model, x, **kw)
    assert all(mapping[p] is g for g in groups for p in g.hidden_paths)
    return groups


@pytest.mark.parametrize(
    "model, paths, n_eqns",
    [
        (models.VanillaRNN, [[("h",)]], 0),  # zero-recurrence fallback: h depends on h only through W
        (models.LeakyRNN, [[("h",)]], None),
        (models.GRU, [[("h",)]], None),
        (models.LSTM, [[("h",), ("c",)]], None),  # compiled-state order: h is read first
        (models.LIF, [[("v",)]], None),
        (models.Independent, [[("h1",)], [("h2",)]], None),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_group_structure(model: Any, paths: list, n_eqns: Any, quiet: list) -> None:
    m = model()
    groups = _groups(m, jnp.ones(m.n_in))
    assert [g.hidden_paths for g in groups] == paths
    assert [g.index for g in groups] == list(range(len(groups)))
    if n_eqns is not None:
        assert len(groups[0].transition_jaxpr.eqns) == n_eqns


def test_default_transitions_hold_no_mixing_equations(quiet: list) -> None:
    for model in (models.LeakyRNN(), models.GRU(), models.LSTM(), models.LIF()):
        for g in _groups(model, jnp.ones(3)):
            names = {e.primitive.name for e in g.transition_jaxpr.eqns}
            assert not names & {"dot_general", "conv_general_dilated", "etp_mm", "etp_mv"}


def test_merged_groups_are_recorded(quiet: list) -> None:
    graph = braintrace.compile_etrace_graph(models.LSTM(), jnp.ones(3))
    (rec,) = graph.explain(kind=DiagnosticKind.HIDDEN_GROUP_MERGED)
    assert rec.hidden_paths == (("h",), ("c",))
    single = braintrace.compile_etrace_graph(models.LeakyRNN(), jnp.ones(3))
    assert not single.explain(kind=DiagnosticKind.HIDDEN_GROUP_MERGED)


def _brute_force_blocks(group: Any, hidden: list, inputs: list) -> Any:
    def fn(stacked: Any) -> Any:
        return group.concat_hidden(group.transition(group.split_hidden(stacked), inputs))

    return block_diagonal_last_dim(fn, group.concat_hidden(hidden))


def _group_point(graph: Any, group: Any) -> tuple[list, list]:
    """Concrete transition inputs: run the extended step once on the model's current states."""
    minfo = graph.module_info
    _, _, _, temps = minfo.jaxpr_call(jnp.linspace(-1, 1, 3))
    rng = np.random.default_rng(0)
    hidden = [jnp.asarray(rng.normal(size=st.value.shape), jnp.float32) for st in group.hidden_states]
    return hidden, [temps[v] for v in group.transition_jaxpr_constvars]


@pytest.mark.parametrize("model", [models.LSTM, models.GRU, models.LIF, models.LeakyRNN], ids=lambda m: m.__name__)
def test_diagonal_jacobian_equals_the_brute_force_blocks(model: Any, quiet: list) -> None:
    graph = braintrace.compile_etrace_graph(model(), jnp.ones(3))
    for group in graph.hidden_groups:
        hidden, inputs = _group_point(graph, group)
        got = group.diagonal_jacobian(hidden, inputs)
        assert got.shape == (*group.varshape, group.num_state, group.num_state)
        np.testing.assert_allclose(got, _brute_force_blocks(group, hidden, inputs), rtol=1e-5, atol=1e-6)


def test_recurrent_mixing_mode_keeps_the_mixing_and_block_diagonal(quiet: list) -> None:
    graph = braintrace.compile_etrace_graph(models.LeakyRNN(), jnp.ones(3), include_recurrent_mixing=True)
    (group,) = graph.hidden_groups
    assert not group.is_diagonal_recurrence
    assert "dot_general" in {e.primitive.name for e in group.transition_jaxpr.eqns}
    hidden, inputs = _group_point(graph, group)
    np.testing.assert_allclose(group.diagonal_jacobian(hidden, inputs), _brute_force_blocks(group, hidden, inputs), rtol=1e-5)


def test_forward_and_reverse_last_dim_jacobians_agree() -> None:
    def fn(h: Any) -> Any:
        return jnp.stack([jnp.tanh(h[..., 0]) * h[..., 1], 0.3 * h[..., 1] + h[..., 0] ** 2], axis=-1)

    h = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 2))
    rev, fwd = jacrev_last_dim(fn, h), jacfwd_last_dim(fn, h)
    np.testing.assert_allclose(rev, fwd, rtol=1e-6)
    np.testing.assert_allclose(rev, block_diagonal_last_dim(fn, h), rtol=1e-6)
    np.testing.assert_allclose(block_diagonal_last_dim(fn, h, forward=True), rev, rtol=1e-6)


class _CustomVjpLeaky(models._Base):
    """``h = 0.8 h + 0.3 spike(h) + x @ W`` with ``spike`` a ``custom_vjp`` function."""

    def __init__(self) -> None:
        super().__init__(3, 4)
        self.W = models._w(5, (3, 4))
        self.init_state()

    def update(self, x: Any) -> Any:
        self.h.value = 0.8 * self.h.value + 0.3 * models.soft_spike(self.h.value) + braintrace.matmul(x, self.W.value)
        return self.h.value


def test_a_transition_calling_a_custom_vjp_function_is_differentiated_in_reverse(quiet: list) -> None:
    """Forward mode has no rule for a ``custom_vjp`` function: ``D`` is then taken by its VJP,
    the user's surrogate slope."""
    graph = braintrace.compile_etrace_graph(_CustomVjpLeaky(), jnp.ones(3))
    (group,) = graph.hidden_groups
    assert group.is_diagonal_recurrence and not group._forward_mode()
    hidden, inputs = _group_point(graph, group)
    d = group.diagonal_jacobian(hidden, inputs)
    np.testing.assert_allclose(d[..., 0, 0], 0.8 + 0.3 / (1.0 + jnp.abs(hidden[0])) ** 2, rtol=1e-6)
    # The negative control: forward mode cannot differentiate the transition.
    fn = lambda s: group.concat_hidden(group.transition(group.split_hidden(s), inputs))  # noqa: E731
    with pytest.raises(TypeError, match="custom_vjp"):
        jacfwd_last_dim(fn, group.concat_hidden(hidden))


class _CustomVjpSettling(_CustomVjpLeaky):
    """:class:`_CustomVjpLeaky` whose leak settles in a weight-free ``while_loop``."""

    def update(self, x: Any) -> Any:
        settled, _ = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (0.9 * c[0], c[1] + 1), (self.h.value, 0))
        self.h.value = settled + 0.3 * models.soft_spike(self.h.value) + braintrace.matmul(x, self.W.value)
        return self.h.value


def test_a_transition_with_a_while_and_a_custom_vjp_function_is_refused_with_the_fix(quiet: list) -> None:
    (group,) = _groups(_CustomVjpSettling(), jnp.ones(3))
    with pytest.raises(NotSupportedError, match="jax.custom_jvp"):
        group._forward_mode()
    assert not _groups(_CustomVjpLeaky(), jnp.ones(3))[0]._forward_mode()  # no while: reverse mode


def test_self_product_is_supported(quiet: list) -> None:
    m = models.SelfProduct()
    (group,) = _groups(m, jnp.ones(3))
    graph = braintrace.compile_etrace_graph(m, jnp.ones(3))
    hidden, inputs = _group_point(graph, graph.hidden_groups[0])
    d = group.diagonal_jacobian(hidden, inputs)
    np.testing.assert_allclose(d[..., 0, 0], hidden[0], rtol=1e-6)  # ∂(0.5 h²)/∂h = h


def test_inconsistent_varshape_raises(quiet: list) -> None:
    (group,) = _groups(models.LeakyRNN(), jnp.ones(3))
    odd = group._replace(
        hidden_paths=[("h",), ("b",)],
        hidden_states=[*group.hidden_states, brainstate.HiddenState(jnp.zeros(()))],
    )
    with pytest.raises(NotSupportedError, match="different shapes"):
        odd.check_consistent_varshape()


def test_group_state_concat_and_split_round_trip(quiet: list) -> None:
    class TwoState(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.W = models._w(51, (3, 4))
            self.s = brainstate.HiddenGroupState(jnp.zeros((4, 2)))

        def update(self, x: Any) -> Any:
            v = self.s.value
            y = braintrace.matmul(x, self.W.value)
            self.s.value = jnp.stack([0.5 * v[..., 0] + y, 0.9 * v[..., 1] + v[..., 0]], axis=-1)
            return self.s.value[..., 0]

    (group,) = _groups(TwoState(), jnp.ones(3))
    assert group.varshape == (4,) and group.num_state == 2
    vals = [jnp.arange(8.0).reshape(4, 2)]
    assert np.array_equal(group.split_hidden(group.concat_hidden(vals))[0], vals[0])


def test_group_merging_helper() -> None:
    assert sorted(map(sorted, group_merging([[1, 2], [3], [2, 4], [5, 3]]))) == [[1, 2, 4], [3, 5]]
    with pytest.raises(ValueError):
        group_merging([[1]], version=3)


def test_full_jacobian_is_the_dense_within_group_jacobian() -> None:
    """Its block diagonal is the per-position ``D``; off the diagonal it holds the weight mixing."""
    brainstate.random.seed(0)
    cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4, activation="tanh"), batch_size=2)
    brainstate.nn.reset_all_states(cell, batch_size=2)
    cell.h.value = 0.3 * jnp.ones((2, 4))
    executor = braintrace.ETraceGraphExecutor(cell, include_recurrent_mixing=True)
    executor.compile_graph(jnp.ones((2, 3)))
    _, _, env = executor.run_step((jnp.ones((2, 3)),), {p: st.value for p, st in executor.states.items()})
    (group,) = executor.graph.hidden_groups
    hidden = [env[v] for v in group.hidden_invars]
    inputs = [env[v] for v in group.transition_jaxpr_constvars]
    full = group.full_jacobian(hidden, inputs)
    assert full.shape == (2, 4, 1, 2, 4, 1)
    diag = group.diagonal_jacobian(hidden, inputs)
    blocks = jnp.stack([jnp.stack([full[b, p, :, b, p, :] for p in range(4)]) for b in range(2)])
    np.testing.assert_allclose(blocks, diag, rtol=1e-6)
    assert float(jnp.abs(full[0, 0, 0, 0, 1, 0])) > 0  # mixing across positions
    assert not np.any(np.asarray(full[0, :, :, 1]))  # no mixing across the batch
