"""SnAp-n patterns: the boolean closure, the neighbour tables, the widening, the adjacency walk.

The pure functions of :mod:`braintrace._compiler.snap_pattern` are checked on hand-written
adjacencies (a ring ``h_q ← h_q, h_(q-1)``, a chain, random sparse graphs); the adjacency walk of
:mod:`braintrace._compiler.position_dependence` and the checks of
``compile_etrace_graph(..., sparse_n=n)`` on tiny compiled models.
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
from braintrace import DiagnosticKind, NotSupportedError
from braintrace._compiler.position_dependence import tail_keeps_positions, tail_relabels_positions
from braintrace._compiler.snap_pattern import (
    axis_closure,
    check_snap_arguments,
    gather_signal,
    pad_states,
    snap_pattern,
    widened_jacobian,
)
from tests.compiler import control_flow_models as cf

N = 6


def ring(n: int) -> np.ndarray:
    """``A[q, p]``: ``h_q`` reads ``h_q`` and ``h_(q-1)`` (a self-edge and one forward edge)."""
    eye = np.eye(n, dtype=bool)
    return eye | np.roll(eye, 1, axis=0)


def neighbour_sets(pattern: Any) -> list[set[int]]:
    return [set(row[ok].tolist()) for row, ok in zip(pattern.neighbours, pattern.valid)]


# --- closure and neighbour tables ----------------------------------------------------------


def test_closure_of_a_chain_grows_one_step_per_order() -> None:
    chain = np.eye(4, k=-1, dtype=bool)  # h_q reads h_(q-1)
    assert axis_closure(chain, 1).tolist() == np.eye(4, dtype=bool).tolist()
    for n in range(1, 6):
        closed = axis_closure(chain, n)
        assert closed.dtype == bool
        expected = np.tril(np.ones((4, 4), bool)) & ~np.tril(np.ones((4, 4), bool), k=-n)
        assert closed.tolist() == expected.tolist(), n


def test_closure_is_boolean_and_stops_at_the_fixed_point() -> None:
    # Path counts of an all-to-all graph reach 64**k: integer powers wrap around long before
    # n = 10**9, booleans cannot, and the loop stops once the closure no longer grows.
    dense = np.ones((64, 64), bool)
    closed = axis_closure(dense, 10**9)
    assert closed.dtype == bool and closed.all()
    assert axis_closure(ring(N), 10**9).all()


def test_ring_neighbourhoods_follow_the_columns() -> None:
    # K = 1..6 then stays: position p reaches p, p+1, ..., p+n-1 (its column, not its row).
    assert [snap_pattern(n, (N,), (ring(N),)).num_neighbour for n in range(1, 8)] == [1, 2, 3, 4, 5, 6, 6]
    pattern = snap_pattern(3, (N,), (ring(N),))
    assert pattern.neighbours[0].tolist() == [0, 1, 2]
    assert pattern.neighbours[5].tolist() == [5, 0, 1]
    assert pattern.valid.all()


def test_short_rows_repeat_the_position_and_are_not_valid() -> None:
    pattern = snap_pattern(4, (4,), (np.eye(4, k=-1, dtype=bool),))  # the chain, not closed
    assert pattern.num_neighbour == 4
    assert pattern.neighbours.tolist() == [[0, 1, 2, 3], [1, 2, 3, 1], [2, 3, 2, 2], [3, 3, 3, 3]]
    assert pattern.valid.tolist() == [[True] * 4, [True] * 3 + [False], [True] * 2 + [False] * 2,
                                      [True] + [False] * 3]
    assert pattern.is_saturated and not pattern.is_degenerate


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_neighbourhoods_nest_self_first_and_saturation_is_a_fixed_point(seed: int) -> None:
    rng = np.random.default_rng(seed)
    adjacency = rng.random((7, 7)) < 0.2
    previous: list[set[int]] | None = None
    saturated_at = None
    for n in range(1, 10):
        pattern = snap_pattern(n, (7,), (adjacency,))
        assert (pattern.neighbours[:, 0] == np.arange(7)).all() and pattern.valid[:, 0].all()
        sets = neighbour_sets(pattern)
        if previous is not None:
            assert all(a <= b for a, b in zip(previous, sets))
            if sets == previous and saturated_at is None:
                saturated_at = n - 1
        if saturated_at is not None:
            assert pattern.is_saturated
            np.testing.assert_array_equal(pattern.neighbours, snap_pattern(saturated_at, (7,), (adjacency,)).neighbours)
        else:
            assert pattern.is_saturated == (neighbour_sets(snap_pattern(n + 1, (7,), (adjacency,))) == sets)
        previous = sets
    assert saturated_at is not None


def test_an_identity_axis_stays_the_identity() -> None:
    # A batch-like axis: K counts the mixing axis only (3), not batch · width (6).
    pattern = snap_pattern(2, (2, 3), (np.eye(2, dtype=bool), np.ones((3, 3), bool)))
    assert (pattern.num_position, pattern.num_neighbour) == (6, 3)
    assert pattern.neighbours[4].tolist() == [4, 3, 5]
    assert pattern.identity_axes() == (True, False)


def test_two_mixing_axes_take_the_product_of_their_closures() -> None:
    pattern = snap_pattern(2, (2, 3), (np.ones((2, 2), bool), ring(3)))
    assert pattern.num_neighbour == 2 * 2
    assert neighbour_sets(pattern)[0] == {0, 1, 3, 4}  # (0, 0) reaches (i, j), i in {0, 1}, j in {0, 1}


def test_a_mis_shaped_adjacency_is_refused() -> None:
    with pytest.raises(ValueError, match=r"one square boolean matrix per axis of varshape \(4,\)"):
        snap_pattern(2, (4,), (np.ones((3, 3), bool),))


def test_repr_names_the_order_and_sizes() -> None:
    assert repr(snap_pattern(2, (N,), (ring(N),))) == "SnapPattern(n=2, varshape=(6,), P=6, K=2)"


# --- widening ------------------------------------------------------------------------------


def _dense_gather(fn: Any, stacked: jax.Array, pattern: Any) -> np.ndarray:
    """``Dg`` gathered from the dense ``(P·S)²`` Jacobian by hand."""
    num_state = stacked.shape[-1]
    positions, size = pattern.num_position, pattern.num_neighbour
    full = np.asarray(jax.jit(jax.jacfwd(fn))(stacked)).reshape(positions, num_state, positions, num_state)
    out = np.zeros((positions, size, num_state, size, num_state))
    for p in range(positions):
        for k in range(size):
            for k2 in range(size):
                if pattern.valid[p, k] and pattern.valid[p, k2]:
                    out[p, k, :, k2, :] = full[pattern.neighbours[p, k], :, pattern.neighbours[p, k2], :]
    return out.reshape(*pattern.varshape, size * num_state, size * num_state)


def test_widened_jacobian_gathers_the_dense_jacobian() -> None:
    # Two states, a ring coupling plus an in-position state mix; order 3 leaves padding-free
    # rows of 3 out of 5 positions, so slots outside the neighbourhood must be dropped.
    rng = np.random.default_rng(0)
    mix = jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)

    def fn(h: jax.Array) -> jax.Array:
        return jnp.tanh(h @ mix + 0.7 * jnp.roll(h, 1, axis=0)[:, ::-1])

    stacked = jnp.asarray(rng.normal(size=(5, 2)), jnp.float32)
    pattern = snap_pattern(3, (5,), (ring(5),))
    got = np.asarray(jax.jit(lambda h: widened_jacobian(fn, h, pattern))(stacked))
    assert got.shape == (5, 6, 6)
    np.testing.assert_allclose(got, _dense_gather(fn, stacked, pattern), rtol=1e-6, atol=1e-7)


def test_widened_jacobian_shares_probes_along_an_identity_axis() -> None:
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)

    def fn(h: jax.Array) -> jax.Array:  # rows never mix: a batch axis
        return jnp.tanh(h[..., 0] @ w)[..., None]

    stacked = jnp.asarray(rng.normal(size=(3, 4, 1)), jnp.float32)
    pattern = snap_pattern(2, (3, 4), (np.eye(3, dtype=bool), np.ones((4, 4), bool)))
    got = np.asarray(jax.jit(lambda h: widened_jacobian(fn, h, pattern))(stacked))
    assert got.shape == (3, 4, 4, 4)
    np.testing.assert_allclose(got, _dense_gather(fn, stacked, pattern), rtol=1e-6, atol=1e-7)


def test_padding_slots_are_zero_in_the_widened_jacobian() -> None:
    pattern = snap_pattern(4, (4,), (np.eye(4, k=-1, dtype=bool),))
    fn = lambda h: jnp.sin(h + jnp.roll(h, 1, axis=0))  # noqa: E731
    got = np.asarray(jax.jit(lambda h: widened_jacobian(fn, h, pattern))(jnp.ones((4, 1))))
    mask = pattern.valid[:, :, None] & pattern.valid[:, None, :]
    assert np.all(got[~mask] == 0)


def test_signal_is_gathered_onto_the_slots_and_df_padded_into_slot_zero() -> None:
    pattern = snap_pattern(4, (4,), (np.eye(4, k=-1, dtype=bool),))
    signal = jnp.arange(8.0).reshape(4, 2)  # g[q, a] = 2q + a
    gathered = np.asarray(gather_signal(signal, pattern)).reshape(4, 4, 2)
    expected = np.asarray(signal)[pattern.neighbours] * pattern.valid[..., None]
    np.testing.assert_array_equal(gathered, expected)
    padded = np.asarray(pad_states(jnp.ones((3, 4, 2)), 3))
    assert padded.shape == (3, 4, 6)
    np.testing.assert_array_equal(padded[..., :2], 1.0)
    np.testing.assert_array_equal(padded[..., 2:], 0.0)
    assert pad_states(signal, 1) is signal


# --- the adjacency walk on compiled transitions -------------------------------------------


class Cell(brainstate.nn.Module):
    """``h = tanh(x @ W_in + mix(h))`` for a chosen ``mix``; ``(batch, N)`` or ``(N,)``."""

    def __init__(self, mix: str, tail: str = "plain") -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.mix, self.tail = mix, tail
        self.w_in = brainstate.ParamState(jnp.asarray(rng.normal(size=(3, N)), jnp.float32))
        if mix.startswith("sparse"):
            self.w = brainstate.ParamState(jnp.asarray(rng.normal(size=(2 * N,)), jnp.float32))
            self.csr = brainevent.CSR.fromdense(jnp.asarray(ring(N).T, jnp.float32))  # stored (i, o): o reads i
        if mix == "plain-dot":
            self.w_dense = brainstate.ParamState(jnp.asarray(rng.normal(size=(N, N)), jnp.float32))
        self.init_state()

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((N,) if batch_size is None else (batch_size, N)))

    def mixed(self, h: jax.Array) -> jax.Array:
        if self.mix == "sparse":
            return braintrace.sparse_matmul(h, self.w.value, sparse_mat=self.csr)
        if self.mix == "sparse-twice":
            once = braintrace.sparse_matmul(h, self.w.value, sparse_mat=self.csr)
            return braintrace.sparse_matmul(once, self.w.value, sparse_mat=self.csr)
        if self.mix == "plain-dot":
            return h @ self.w_dense.value
        if self.mix == "roll":
            return 0.5 * jnp.roll(h, 1, axis=-1)
        if self.mix == "cumsum":
            return jnp.cumsum(h, axis=-1)
        return 0.5 * h

    def update(self, x: jax.Array) -> jax.Array:
        y = braintrace.matmul(x, self.w_in.value)
        if self.tail == "roll":
            y = jnp.roll(y, 1, axis=-1)
        self.h.value = jnp.tanh(y + self.mixed(self.h.value))
        return self.h.value


def snap_graph(model: brainstate.nn.Module, n: int, batch: int | None = None, **options: Any) -> Any:
    brainstate.nn.init_all_states(model, batch_size=batch)
    x = jnp.ones(3) if batch is None else jnp.ones((batch, 3))
    return braintrace.compile_etrace_graph(model, x, include_recurrent_mixing=True, sparse_n=n, **options)


def kinds(graph: Any) -> list[DiagnosticKind]:
    return [r.kind for r in graph.diagnostics]


@pytest.mark.parametrize(
    "mix, adjacency",
    [
        ("sparse", ring(N)),
        ("sparse-twice", ring(N).astype(int) @ ring(N).astype(int) > 0),  # composed, not all-to-all
        ("plain-dot", np.ones((N, N), bool)),
        ("roll", np.roll(np.eye(N, dtype=bool), 1, axis=0)),  # no self-edge
        ("none", np.eye(N, dtype=bool)),
    ],
)
def test_the_walk_reads_the_adjacency_precisely(mix: str, adjacency: np.ndarray, quiet: list) -> None:
    graph = snap_graph(Cell(mix), 2)
    pattern = graph.hidden_groups[0].snap
    assert not pattern.conservative and pattern.reason is None
    np.testing.assert_array_equal(pattern.adjacency[0], adjacency)
    assert DiagnosticKind.SNAP_PATTERN_CONSERVATIVE not in kinds(graph)


def test_a_batch_axis_is_read_as_the_identity() -> None:
    pattern = snap_graph(Cell("sparse"), 3, batch=2).hidden_groups[0].snap
    assert pattern.varshape == (2, N) and pattern.num_neighbour == 3
    np.testing.assert_array_equal(pattern.adjacency[0], np.eye(2, dtype=bool))
    np.testing.assert_array_equal(pattern.adjacency[1], ring(N))


def test_an_unregistered_mixing_primitive_widens_to_all_to_all(quiet: list) -> None:
    graph = snap_graph(Cell("cumsum"), 2)
    pattern = graph.hidden_groups[0].snap
    assert pattern.conservative and "cumsum" in pattern.reason
    assert pattern.num_neighbour == N and pattern.adjacency[0].all()
    record, = [r for r in graph.diagnostics if r.kind is DiagnosticKind.SNAP_PATTERN_CONSERVATIVE]
    assert record.level.name == "WARNING" and "cumsum" in record.message and record.context["num_neighbour"] == N


def test_no_mixing_is_degenerate_at_every_order() -> None:
    for n in (2, 5):
        graph = snap_graph(Cell("none"), n)
        pattern = graph.hidden_groups[0].snap
        assert pattern.is_degenerate and pattern.num_neighbour == 1 and graph.hidden_groups[0].trace_state_width == 1
        record, = [r for r in graph.diagnostics if r.kind is DiagnosticKind.SNAP_PATTERN_DEGENERATE]
        assert record.level.name == "INFO" and "K = 1" in record.message


def test_order_one_checks_only() -> None:
    graph = snap_graph(Cell("sparse"), 1)
    assert graph.hidden_groups[0].snap is None and graph.hidden_groups[0].trace_state_width == 1


# --- relabelling tails (F-31) --------------------------------------------------------------


@pytest.mark.parametrize(
    "tail, relabels",
    [
        (lambda y: jnp.tanh(jnp.roll(y, 1)), True),
        (lambda y: y[::-1] * 2.0, True),
        (lambda y: jnp.tanh(y) * y + 1.0, False),
        (lambda y: jnp.cumsum(y), False),  # unreadable: nothing proven
    ],
    ids=["roll", "reverse", "elementwise", "unreadable"],
)
def test_tail_relabels_positions(tail: Any, relabels: bool) -> None:
    jaxpr = jax.make_jaxpr(tail)(jnp.zeros(4)).jaxpr
    assert tail_relabels_positions(jaxpr, (4,)) is relabels


@pytest.mark.parametrize(
    "tail, keeps",
    [
        (lambda y: jnp.tanh(y) * y + 1.0, True),
        (lambda y: jnp.concatenate([y[:2], y[2:]]) * 2.0, True),  # read, not element-wise
        (lambda y: jnp.tanh(jnp.roll(y, 1)), False),
        (lambda y: jnp.cumsum(y), False),  # unreadable: nothing proven
    ],
    ids=["elementwise", "split-and-join", "roll", "unreadable"],
)
def test_tail_keeps_positions(tail: Any, keeps: bool) -> None:
    jaxpr = jax.make_jaxpr(tail)(jnp.zeros(4)).jaxpr
    assert tail_keeps_positions(jaxpr, (4,)) is keeps


def test_an_element_wise_tail_builds_no_position_pattern(monkeypatch: Any) -> None:
    """A connectome's tail over 139,255 neurons would need a (V, V) pattern per axis (19 GB):
    an element-wise tail (calls included) is answered without one. Negative control: a roll needs
    the patterns."""
    from braintrace._compiler import position_dependence

    def refuse(varshape: Any) -> Any:
        raise AssertionError("a dense position pattern was built")

    monkeypatch.setattr(position_dependence, "_identity", refuse)
    spike = jax.jit(lambda v: (v > 0).astype(v.dtype))
    jaxpr = jax.make_jaxpr(lambda y: 0.9 * y + spike(jnp.tanh(y)))(jnp.zeros((2, 139_255))).jaxpr
    assert tail_relabels_positions(jaxpr, (2, 139_255)) is False
    with pytest.raises(AssertionError, match="dense position pattern"):
        tail_relabels_positions(jax.make_jaxpr(lambda y: jnp.roll(y, 1))(jnp.zeros(4)).jaxpr, (4,))


def test_a_tail_over_other_positions_proves_nothing() -> None:
    jaxpr = jax.make_jaxpr(lambda y: jnp.roll(y, 1)[:4])(jnp.zeros(5)).jaxpr
    assert tail_relabels_positions(jaxpr, (4,)) is False


@pytest.mark.parametrize("sparse_n", [None, 1, 3])
def test_a_relabelling_tail_is_reported_under_every_non_diagonal_scope(sparse_n: int | None, quiet: list) -> None:
    model = Cell("sparse", tail="roll")
    brainstate.nn.init_all_states(model)
    graph = braintrace.compile_etrace_graph(model, jnp.ones(3), include_recurrent_mixing=True, sparse_n=sparse_n)
    record, = [r for r in graph.diagnostics if r.kind is DiagnosticKind.TAIL_RELABELS_POSITIONS]
    assert record.level.name == "WARNING" and record.weight_path == ("w_in",)
    assert "does not reach BPTT" in record.message
    assert any("does not reach BPTT" in str(w.message) for w in quiet)


def test_no_relabelling_report_on_the_diagonal_scope_or_an_elementwise_tail() -> None:
    rolled = Cell("sparse", tail="roll")
    brainstate.nn.init_all_states(rolled)
    diagonal = braintrace.compile_etrace_graph(rolled, jnp.ones(3))
    assert DiagnosticKind.TAIL_RELABELS_POSITIONS not in kinds(diagonal)
    plain = snap_graph(Cell("sparse"), 3)
    assert DiagnosticKind.TAIL_RELABELS_POSITIONS not in kinds(plain)


# --- what compile_etrace_graph refuses -----------------------------------------------------


@pytest.mark.parametrize(
    "sparse_n, mixing, ceiling, error, match",
    [
        (True, True, 2**24, TypeError, "sparse_n must be an int, got True"),
        (2.5, True, 2**24, TypeError, "sparse_n must be an int, got 2.5"),
        (0, True, 2**24, ValueError, "sparse_n must be >= 1"),
        (2, False, 2**24, ValueError, "needs include_recurrent_mixing=True"),
        (2, True, True, TypeError, "snap_max_jacobian_elements must be an int"),
        (2, True, 0, ValueError, "snap_max_jacobian_elements must be positive"),
    ],
)
def test_bad_snap_arguments_are_refused(sparse_n: Any, mixing: bool, ceiling: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        check_snap_arguments(sparse_n, mixing, ceiling)
    model = Cell("sparse")
    with pytest.raises(error, match=match):
        braintrace.compile_etrace_graph(model, jnp.ones(3), include_recurrent_mixing=mixing, sparse_n=sparse_n,
                                        snap_max_jacobian_elements=ceiling)


def test_the_jacobian_budget_is_enforced_with_the_computed_count() -> None:
    count = N * (N * 1) ** 2  # P·(K·S)² at saturation
    assert snap_graph(Cell("sparse"), 6, snap_max_jacobian_elements=count).hidden_groups[0].snap.num_neighbour == N
    with pytest.raises(NotSupportedError, match=rf"P·\(K·S\)² = 6·\(6·1\)² = {count} elements") as info:
        snap_graph(Cell("sparse"), 6, snap_max_jacobian_elements=count - 1)
    assert "smaller n" in str(info.value) and "snap_max_jacobian_elements" in str(info.value)


class Embedded(brainstate.nn.Module):
    """``h = tanh(table[token] + h @ W)``: an embedding drives the recurrence."""

    def __init__(self) -> None:
        super().__init__()
        self.table = brainstate.ParamState(jnp.ones((5, 4)))
        self.w = brainstate.ParamState(0.3 * jnp.eye(4))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, token: jax.Array) -> jax.Array:
        drive = braintrace.embedding(token, self.table.value) + braintrace.matmul(self.h.value, self.w.value)
        self.h.value = jnp.tanh(drive)
        return self.h.value


class SharedEinsum(brainstate.nn.Module):
    """``h = tanh(einsum('btk,kn->btn', x, W) + h @ R)``: one weight reused along ``t``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.ones((3, 4)))
        self.r = brainstate.ParamState(0.3 * jnp.eye(4))
        self.h = brainstate.HiddenState(jnp.zeros((2, 2, 4)))

    def update(self, x: jax.Array) -> jax.Array:
        drive = braintrace.einsum("btk,kn->btn", x, self.w.value) + self.h.value @ self.r.value
        self.h.value = jnp.tanh(drive)
        return self.h.value


@pytest.mark.parametrize(
    "model, x, primitive",
    [(Embedded, jnp.asarray(2), "etp_emb_v"), (SharedEinsum, jnp.ones((2, 2, 3)), "etp_einsum")],
    ids=["embedding", "shared-einsum"],
)
def test_unanchored_relations_are_refused_at_every_order(model: Any, x: jax.Array, primitive: str, quiet: list) -> None:
    for n in (1, 2):
        with pytest.raises(NotImplementedError, match=rf"cannot widen the trace of `{primitive}`"):
            braintrace.compile_etrace_graph(model(), x, include_recurrent_mixing=True, sparse_n=n)
    for mixing in (False, True):
        graph = braintrace.compile_etrace_graph(model(), x, include_recurrent_mixing=mixing)
        assert any(r.primitive.name == primitive for r in graph.hidden_param_op_relations)


def test_a_descended_scan_is_refused(quiet: list) -> None:
    with pytest.raises(NotImplementedError, match=r"descended scan.*scan_descent='off'"):
        braintrace.compile_etrace_graph(cf.SubstepModel(length=20), jnp.ones(3), include_recurrent_mixing=True,
                                        sparse_n=2)


def test_sizes_are_consistent() -> None:
    pattern = snap_graph(Cell("sparse"), 4).hidden_groups[0].snap
    assert pattern.neighbours.shape == pattern.valid.shape == (N, 4)
    assert math.prod(pattern.varshape) == pattern.num_position
