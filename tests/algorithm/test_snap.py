"""SnAp-n on the sparse ring RNN: coordinates, neighbourhoods, BPTT at saturation, the trace itself.

The model and the drivers are in :mod:`tests.algorithm.snap_ring`. Every comparison runs in
float64, on ETP keys (every parameter of the ring is one), through single steps or finite
windows; each "equals" is paired with a negative control that the same fixture can see. The
trace itself is checked against a hand-written float64 masked-RTRL recursion after every step.

Measured on the ring (relative error against BPTT, n = 1..6; only the endpoints are asserted):
windows of 3: 5.4e-1, 3.1e-1, 9.6e-2, 2.8e-2, 1.6e-2, 4e-16; single steps: 3.9e-1, 2.1e-1,
1.1e-1, 3.4e-2, 1.7e-2, 4e-16.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Iterator

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import DiagnosticKind, NotSupportedError
from tests.algorithm.bptt import max_rel_err
from tests.algorithm.snap_ring import (
    EXACT,
    Grads,
    I,
    N,
    Ring,
    assert_same,
    bptt,
    float64,
    inputs,
    online,
    snap,
    trace_sizes,
)
from tests.compiler import control_flow_models as cf

__all__ = ["float64"]  # the module-scoped fixture is used by name


@functools.cache
def ring_reference() -> Grads:
    """BPTT of the ring on the shared sequence."""
    return bptt(Ring(), *inputs())


@functools.cache
def ring_online(n: int, chunk: int | None, chunked_trace: bool) -> Grads:
    """SnAp-n on the ring, driven in plain mode (``chunk=None``) or in windows of ``chunk``."""
    learner = snap(Ring(), n, inputs()[0][0], vjp_method="multi-step", chunked_trace=chunked_trace)
    return online(learner, *inputs(), chunk=chunk)


# --- coordinates and attributes ------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5])
def test_coordinates_and_attributes(n: int) -> None:
    learner = braintrace.SnAp(Ring(), n=n)
    assert type(learner).__module__ == "braintrace" and learner.n == n
    config = learner.config
    assert config.trace_factorization == "per_param" and config.temporal_recursion == "jacobian"
    assert config.learning_signal == "symmetric" and config.trace_filter == "none"
    assert config.include_recurrent_mixing
    if n == 1:  # OSTLRecurrent's coordinate
        assert config == braintrace.ETraceConfig(recurrence_scope="coupled")
        assert config == braintrace.OSTLRecurrent(Ring()).config
    else:
        assert (config.recurrence_scope, config.sparse_n) == ("sparse_n", n)
    parsed = dict(item.split("=", 1) for item in config.describe().split(", "))
    parsed = {k: int(v) if v.isdigit() else v.strip("'") for k, v in parsed.items()}
    assert braintrace.ETraceConfig(**parsed) == config


def test_snap_is_a_compile_name_with_order_two() -> None:
    learner = braintrace.compile(Ring(), "snap", jnp.ones(I))
    assert isinstance(learner, braintrace.SnAp) and learner.n == 2
    assert learner.graph.hidden_groups[0].snap.num_neighbour == 2


def test_neighbourhood_sizes_and_trace_widths_on_the_ring() -> None:
    widths, sizes = [], []
    for n in range(1, 8):
        learner = snap(Ring(), n, jnp.ones(I))
        group, = learner.graph.hidden_groups
        widths.append(group.trace_state_width)
        sizes.append(trace_sizes(learner))
        traces = {path: trace for (path, _), trace in learner.named_etraces().items()}
        # Both relations of the group widen: (in, out, K·S) and (nnz, K·S).
        assert traces[("w_in",)]["weight"].shape == (I, N, group.trace_state_width)
        assert traces[("w",)]["weight"].shape == (2 * N, group.trace_state_width)
        if n >= 2:
            assert group.trace_state_width == group.snap.num_neighbour * group.num_state
            assert group.snap.is_saturated is (n >= N)
    assert widths == [1, 2, 3, 4, 5, 6, 6]
    assert all(a <= b for a, b in zip(sizes, sizes[1:])) and sizes[-1] == N * sizes[0]


def test_the_neighbourhoods_nest_and_saturate() -> None:
    tables = [snap(Ring(), n, jnp.ones(I)).graph.hidden_groups[0].snap for n in range(2, 9)]
    for small, large in zip(tables, tables[1:]):
        assert (small.neighbours[:, 0] == np.arange(N)).all()
        for p in range(N):
            assert set(small.neighbours[p][small.valid[p]]) <= set(large.neighbours[p][large.valid[p]])
    np.testing.assert_array_equal(tables[4].neighbours, tables[-1].neighbours)  # n = 6 is a fixed point
    assert tables[4].neighbours[0].tolist() == list(range(N))  # column 0: the positions 0 reaches


# --- SnAp-1, saturation, and the error curve -----------------------------------------------


def test_order_one_is_ostl_recurrent_element_wise_and_unwidened() -> None:
    xs, ys = inputs()
    ostl = braintrace.compile(Ring(), braintrace.OSTLRecurrent, xs[0], vjp_method="multi-step")
    learner = snap(Ring(), 1, xs[0], vjp_method="multi-step")
    assert learner.graph.hidden_groups[0].snap is None
    shapes = lambda lr: jax.tree.map(jnp.shape, lr.named_etraces())  # noqa: E731
    assert shapes(learner) == shapes(ostl) and trace_sizes(learner) == I * N + 2 * N
    assert_same(online(ostl, xs, ys, chunk=3), ring_online(1, 3, True))


@pytest.mark.parametrize(
    "chunk, chunked_trace",
    [(None, True), (3, True), (4, False)],
    ids=["single-step", "chunk3", "chunk4-stepper"],
)
def test_saturation_equals_bptt(chunk: int | None, chunked_trace: bool) -> None:
    learner = snap(Ring(), N, jnp.ones(I))
    group, = learner.graph.hidden_groups
    assert group.snap.is_saturated and group.snap.num_neighbour == N and not group.snap.conservative
    assert {r.primitive.name for r in learner.graph.hidden_param_op_relations} == {"etp_mv", "etp_sp_mv"}
    assert max_rel_err(ring_reference(), ring_online(N, chunk, chunked_trace)) < EXACT


def test_order_one_misses_bptt_and_the_error_falls_to_saturation() -> None:
    # The negative control of the saturation tests; the orders between are reported, not ordered.
    ref = ring_reference()
    assert max_rel_err(ref, ring_online(1, 3, True)) > 1e-3
    assert max_rel_err(ref, ring_online(N, 3, True)) < EXACT


# --- the trace itself -----------------------------------------------------------------------


def run_traces(learner: Any, xs: Any, chunk: int | None = None) -> Iterator[dict[Any, np.ndarray]]:
    """The traces ``{parameter path: weight trace}`` after each call of the learner."""
    step = brainstate.transform.jit(lambda x: learner(x if chunk is None else braintrace.MultiStepData(x)))
    calls = [xs[t] for t in range(len(xs))] if chunk is None else [xs[t:t + chunk] for t in range(0, len(xs), chunk)]
    for x in calls:
        step(x)
        yield {path: np.asarray(trace["weight"]) for (path, _), trace in learner.named_etraces().items()}


def test_the_three_trace_paths_agree() -> None:
    # Single steps, stacked windows rolled in closed form, and windows rolled step by step.
    xs = inputs()[0]
    *_, single = run_traces(snap(Ring(), 3, xs[0]), xs)
    for chunked_trace in (True, False):
        learner = snap(Ring(), 3, xs[0], vjp_method="multi-step", chunked_trace=chunked_trace)
        *_, window = run_traces(learner, xs, chunk=4)
        for path in single:
            np.testing.assert_allclose(window[path], single[path], rtol=1e-10, atol=1e-12)


def masked_rtrl(xs: np.ndarray, w_in: np.ndarray, w_dense: np.ndarray, order: int) -> Iterator[tuple[np.ndarray, ...]]:
    """Float64 RTRL of the ring with the influence masked to the order's closure, step by step.

    Yields ``(closure, J_in, J_w)`` after each step: ``J_in[q, i, o] = ∂h_q/∂W_in[i, o]`` and
    ``J_w[q, i, o] = ∂h_q/∂W[i, o]`` (dense, zero off the structure), both kept only where
    ``closure[q, o]``: the positions ``o`` reaches within ``order - 1`` steps.
    """
    reads = w_dense.T != 0  # reads[q, p]: h_q reads h_p
    closure = np.linalg.matrix_power(np.eye(N, dtype=int) + reads, order - 1) > 0
    h = np.zeros(N)
    j_in, j_w = np.zeros((N, I, N)), np.zeros((N, N, N))
    eye = np.eye(N)
    for x in xs:
        h_new = np.tanh(x @ w_in + h @ w_dense)
        df = 1.0 - h_new**2
        jac = df[:, None] * w_dense.T  # ∂h_new[q] / ∂h[r]
        instant_in = np.einsum("qo,o,i->qio", eye, df, x)
        instant_w = np.einsum("qo,o,i->qio", eye, df, h) * (w_dense != 0)[None]
        j_in = closure[:, None, :] * (np.einsum("qr,rio->qio", jac, j_in) + instant_in)
        j_w = closure[:, None, :] * (np.einsum("qr,rio->qio", jac, j_w) + instant_w)
        h = h_new
        yield closure, j_in, j_w


def csr_coordinates(csr: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, cols)`` of every stored value, in storage order."""
    rows = np.repeat(np.arange(N), np.diff(np.asarray(csr.indptr)))
    return rows, np.asarray(csr.indices)


def slots(influence: np.ndarray, pattern: Any) -> np.ndarray:
    """``influence (N, *θ, o)`` read at each anchor ``o``'s neighbour slots: ``(*θ, o, K)``."""
    moved = np.moveaxis(influence, 0, -1)  # (*θ, o, q)
    index = np.broadcast_to(pattern.neighbours, moved.shape[:-2] + pattern.neighbours.shape)
    return np.take_along_axis(moved, index, -1) * pattern.valid


@pytest.mark.parametrize("n", [2, 3, 4])
def test_interior_orders_follow_the_masked_rtrl_recursion(n: int) -> None:
    xs = np.asarray(inputs()[0])
    model = Ring()
    learner = snap(model, n, xs[0])
    pattern = learner.graph.hidden_groups[0].snap
    rows, cols = csr_coordinates(model.csr)
    w_dense = np.zeros((N, N))
    w_dense[rows, cols] = np.asarray(model.w.value)
    w_in = np.asarray(model.w_in.value)
    exact = masked_rtrl(xs, w_in, w_dense, n)
    narrow = masked_rtrl(xs, w_in, w_dense, n - 1)
    scale = miss = 0.0
    for traces, (closure, j_in, j_w), (_, k_in, k_w) in zip(run_traces(learner, xs), exact, narrow):
        for p in range(N):
            assert set(pattern.neighbours[p][pattern.valid[p]]) == set(np.flatnonzero(closure[:, p]))
        got = (traces[("w_in",)], traces[("w",)])
        ref = (slots(j_in, pattern), slots(j_w, pattern)[rows, cols])
        too_narrow = (slots(k_in, pattern), slots(k_w, pattern)[rows, cols])
        for g, r, t in zip(got, ref, too_narrow):
            assert np.max(np.abs(g - r)) <= EXACT * np.max(np.abs(r))
            scale, miss = max(scale, np.max(np.abs(r))), max(miss, np.max(np.abs(g - t)))
    assert miss > 1e-3 * scale
    assert np.max(np.abs(got[0][..., 1:])) > 1e-3 * np.max(np.abs(got[0]))  # the neighbour slots carry mass


# --- illegal arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"n": 0}, ValueError, "n must be >= 1"),
        ({"n": True}, TypeError, "n must be an int, got the bool True"),
        ({"n": 2.5}, TypeError, "n must be an int, got float 2.5"),
        ({"n": 2, "config": braintrace.ETraceConfig()}, TypeError, "takes no config"),
        ({"n": 2, "snap_max_jacobian_elements": 0}, ValueError, "snap_max_jacobian_elements must be >= 1"),
    ],
)
def test_illegal_arguments_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        braintrace.SnAp(Ring(), **kwargs)


def test_the_jacobian_budget_is_checked_at_compile_time() -> None:
    model = brainstate.nn.init_all_states(Ring())
    learner = braintrace.SnAp(model, n=N, snap_max_jacobian_elements=N**3 - 1)
    with pytest.raises(NotSupportedError, match=f"= {N**3} elements"):
        learner.compile_graph(jnp.ones(I))


def test_a_descended_scan_is_refused_at_compile_time() -> None:
    learner = braintrace.SnAp(cf.SubstepModel(length=20), n=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(NotImplementedError, match="descended scan"):
            learner.compile_graph(jnp.ones(3))


# --- relabelling tails (F-31) ----------------------------------------------------------------


class RollTwo(Ring):
    """:class:`Ring` whose drive is rolled by two units: beyond SnAp-2's neighbourhoods ``{p, p + 1}``."""

    def update(self, x: jax.Array) -> jax.Array:
        y = jnp.roll(braintrace.matmul(x, self.w_in.value), 2, axis=-1)
        self.h.value = jnp.tanh(y + braintrace.sparse_matmul(self.h.value, self.w.value, sparse_mat=self.csr))
        return self.h.value


def relabelling_reports(model: brainstate.nn.Module, algorithm: Any, **options: Any) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(model, algorithm, jnp.ones(I), **options)
    return [r for r in learner.graph.diagnostics if r.kind is DiagnosticKind.TAIL_RELABELS_POSITIONS]


@pytest.mark.parametrize(
    "model, algorithm, options",
    [(Ring(roll=True), braintrace.OSTLRecurrent, {}), (Ring(roll=True), braintrace.SnAp, {"n": 1}),
     (RollTwo(), braintrace.SnAp, {"n": 2})],
    ids=["ostl-recurrent", "snap-1", "snap-2-roll-2"],
)
def test_a_relabelling_tail_is_reported_where_the_trace_cannot_follow_it(
    model: Any, algorithm: Any, options: dict[str, Any]
) -> None:
    with pytest.warns(UserWarning, match="does not reach BPTT"):
        braintrace.compile(model, algorithm, jnp.ones(I), **options)
    record, = relabelling_reports(model, algorithm, **options)
    assert record.weight_path == ("w_in",)


@pytest.mark.parametrize(
    "model, algorithm, options",
    [(Ring(roll=True), braintrace.SnAp, {"n": 2}), (Ring(roll=True), braintrace.SnAp, {"n": N}),
     (RollTwo(), braintrace.SnAp, {"n": 3}), (Ring(roll=True), braintrace.UORO, {})],
    ids=["snap-2", "snap-6", "snap-3-roll-2", "uoro"],
)
def test_no_relabelling_report_where_the_trace_follows_the_tail(model: Any, algorithm: Any, options: dict[str, Any]) -> None:
    assert relabelling_reports(model, algorithm, **options) == []


def test_no_relabelling_report_under_d_rtrl_or_an_elementwise_tail() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for model, algorithm in ((Ring(roll=True), braintrace.D_RTRL), (Ring(), braintrace.OSTLRecurrent)):
            learner = braintrace.compile(model, algorithm, jnp.ones(I))
            assert DiagnosticKind.TAIL_RELABELS_POSITIONS not in [r.kind for r in learner.graph.diagnostics]


def test_saturated_snap_follows_a_relabelling_tail_where_the_coupled_scope_cannot() -> None:
    # The tail's Jacobian is gathered onto the neighbourhoods: at saturation the rolled drive's
    # influence is inside them, so SnAp is exact RTRL again (upstream's F-31 left it approximate).
    xs, ys = inputs()
    reference = bptt(Ring(roll=True), xs, ys)
    learner = snap(Ring(roll=True), N, xs[0], vjp_method="multi-step")
    assert learner.graph.hidden_groups[0].snap.is_saturated
    assert max_rel_err(reference, online(learner, xs, ys, chunk=3)) < 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        coupled = braintrace.compile(Ring(roll=True), braintrace.OSTLRecurrent, xs[0], vjp_method="multi-step")
    assert max_rel_err(reference, online(coupled, xs, ys, chunk=3)) > 1e-3
