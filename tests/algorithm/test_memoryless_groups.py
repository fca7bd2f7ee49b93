"""Groups whose new state reads their past only through the relations (``h = tanh([x, h] W + b)``).

Their hidden Jacobian ``D`` is identically zero, so a trace holds no history: ``ε^t = x ⊗ df``.
The per-parameter learners then write the trace without reading the one that entered the step
(XLA does not fold ``0 · ε``, and would read it every step), and add no history term to the
one-step gradient. The gradient is the sum of the exact one-step gradients (truncated BPTT),
checked in float64, and that of the same learner told that every group reads its past, checked
in float64 and in float32 (on every platform). A trace that entered as NaN shows that it is not
read (not on a TPU, where the roll still reads it: ``roll_relation``); where the group reads its
past (the negative control) the NaN goes through. A multi-step window ends such a trace at its
last step's roll: its gradients and traces equal the closed form's over the whole window.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.engine.rule_contract import relation_infos
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, window_grads, x64  # noqa: F401
from tests.algorithm.test_trace_rule import Leaky

T, B, I, H = 5, 3, 4, 6
EXACT = 1e-10


class Plain(brainstate.nn.Module):
    """``h = tanh([x, h] W + b)``: the past reaches ``h^t`` only through the relation."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(2, (I + H, H), 0.5))
        self.b = brainstate.ParamState(normal(3, (H,), 0.1))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or B, H)))

    def update(self, x: jax.Array) -> jax.Array:
        xh = jnp.concatenate([x, self.h.value], axis=-1)
        self.h.value = jnp.tanh(braintrace.matmul(xh, self.w.value, self.b.value))
        return self.h.value


class Detached(Plain):
    """``h = tanh(x W + stop_gradient(h))``: the past is read, but no derivative flows from it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(2, (I, H), 0.5))

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = jnp.tanh(braintrace.matmul(x, self.w.value, self.b.value) + jax.lax.stop_gradient(self.h.value))
        return self.h.value


def _compile(model: brainstate.nn.Module, algorithm: Any, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, normal(11, (T, B, I))[0], batch_size=B, **options)


@pytest.mark.parametrize(("model", "reads"), [(Plain, False), (Detached, False), (Leaky, True)])
def test_a_group_reads_its_past_where_a_derivative_flows_from_it(model: type, reads: bool) -> None:
    learner = _compile(model(), braintrace.D_RTRL)
    (group,) = learner.graph.hidden_groups
    assert group.reads_its_past() is reads
    infos = relation_infos(learner.graph.hidden_param_op_relations)
    assert infos and all(info.has_history is reads for info in infos.values())


@pytest.mark.parametrize(
    ("algorithm", "options"),
    [(braintrace.D_RTRL, {}), (braintrace.D_RTRL, {"fast_solve": False}), (braintrace.EProp, {}),
     (braintrace.d_rtrl_rule(), {}), (braintrace.d_rtrl_rule(False), {})],
)
def test_without_history_the_gradient_is_the_sum_of_one_step_gradients(x64: None, algorithm: Any, options: Any) -> None:
    xs = normal(11, (T, B, I))
    got = single_step_grads(_compile(Plain(), algorithm, **options), xs)
    ref = bptt_grads(Plain(), xs, batch_size=B, truncated=True)
    assert set(got) == set(ref) and all(np.any(ref[p] != 0) for p in ref)
    assert max_rel_err(ref, got) < EXACT


def _step_from_nan_traces(model: brainstate.nn.Module, algorithm: Any, **options: Any) -> tuple[Any, Any]:
    """One call and its gradient from traces that entered as NaN: the new traces and the gradient."""
    learner = _compile(model, algorithm, **options)
    traces = learner.etrace_bwg if hasattr(learner, "etrace_bwg") else learner.carriers
    for st in traces.values():
        st.value = jax.tree.map(lambda v: jnp.full_like(v, jnp.nan), st.value)
    x = normal(12, (B, I))
    grads = brainstate.transform.grad(lambda: jnp.sum(learner(x) ** 2), learner.param_states)()
    return [st.value for st in traces.values()], grads


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="on a TPU the roll reads the trace (roll_relation)")
@pytest.mark.parametrize("algorithm", [braintrace.D_RTRL, braintrace.d_rtrl_rule()])
@pytest.mark.parametrize("fast_solve", [True, False])
def test_without_history_the_entering_trace_is_not_read(algorithm: Any, fast_solve: bool) -> None:
    options = {"fast_solve": fast_solve} if algorithm is braintrace.D_RTRL else {}
    rule = algorithm if algorithm is braintrace.D_RTRL else braintrace.d_rtrl_rule(fast_solve)
    traces, grads = _step_from_nan_traces(Plain(), rule, **options)
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves((traces, grads)))
    # The negative control: a group that reads its past rolls the NaN into its new trace.
    traces, _ = _step_from_nan_traces(Leaky(), rule, **options)
    assert any(bool(jnp.any(jnp.isnan(leaf))) for leaf in jax.tree.leaves(traces))


@pytest.mark.parametrize(
    ("algorithm", "options"),
    [(braintrace.D_RTRL, {}), (braintrace.EProp, {"kappa_filter_decay": 0.8}),
     (braintrace.EProp, {"feedback": "random", "random_feedback_key": 0}), (braintrace.OSTLRecurrent, {}),
     (braintrace.D_RTRL, {"vjp_method": "multi-step"})],
)
@pytest.mark.parametrize(("precision", "tolerance"), [("float32", 1e-5), ("float64", EXACT)])
def test_skipping_the_history_changes_no_gradient(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, algorithm: Any, options: Any, precision: str,
    tolerance: float,
) -> None:
    """Against the same learner told that every group reads its past (the full roll and history),
    the sums in another order: float32 on every platform, float64 where there is float64."""
    if precision == "float64":
        request.getfixturevalue("x64")
    xs = normal(11, (T, B, I))
    got = single_step_grads(_compile(Plain(), algorithm, **options), xs)
    monkeypatch.setattr(braintrace.HiddenGroup, "reads_its_past", lambda self: True)
    want = single_step_grads(_compile(Plain(), algorithm, **options), xs)
    assert set(got) == set(want) and all(np.any(want[p] != 0) for p in want)
    assert max_rel_err(want, got) < tolerance


@pytest.mark.parametrize(("precision", "tolerance"), [("float32", 1e-5), ("float64", EXACT)])
def test_a_window_without_history_ends_at_its_last_steps_trace(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, precision: str, tolerance: float,
) -> None:
    """Multi-step windows (``window.chunk_roll``): the trace after each window, read by the next
    window's gradient, is the last step's roll; against the closed form over the whole window."""
    if precision == "float64":
        request.getfixturevalue("x64")
    xs = normal(11, (2 * T, B, I))

    def run() -> tuple[Any, list[Any]]:
        learner = _compile(Plain(), braintrace.D_RTRL, vjp_method="multi-step")
        grads = window_grads(learner, xs, [T, T])
        return grads, [np.asarray(leaf) for leaf in jax.tree.leaves(learner.etrace_bwg.read())]

    got, got_traces = run()
    monkeypatch.setattr(braintrace.HiddenGroup, "reads_its_past", lambda self: True)
    want, want_traces = run()
    assert set(got) == set(want) and all(np.any(want[p] != 0) for p in want)
    assert max_rel_err(want, got) < tolerance
    assert all(np.allclose(a, b, rtol=tolerance, atol=tolerance) for a, b in zip(got_traces, want_traces))
