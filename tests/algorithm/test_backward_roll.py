"""Traces rolled in the backward pass (``braintrace._algorithm.carriers.backward_roll``), exercised on CPU.

On a TPU the drivers have a single-step learner roll its large dense traces in the backward pass,
with the gradient's history term, in one pass (a Pallas kernel). Here the learners are compiled
as if on a TPU (the trace storage of ``test_tpu_trace_storage.py``) with the size threshold
lowered to zero, so that the path runs on these small models: the kernel in Pallas's
interpreter agrees with its XLA reference, and a learner rolling in the backward pass gives
BPTT's gradient, the same gradient and traces as rolling in the forward pass, under
``etrace_grad``, ``etrace_train`` and ``check_finite``. A learner called outside the drivers,
and traces below the threshold, roll in the forward pass.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import braintrace
from benchmarks.models import LIF as ReadPastLIF
from braintrace._algorithm.carriers import backward_roll
from braintrace._op import dense, fused_roll
from tests.algorithm.bptt import _to_numpy, bptt_grads, max_rel_err, normal, target_loss
from tests.device.test_exactness_on_device import MODELS, RTOL, B, I, T

pytestmark = pytest.mark.skipif(jax.default_backend() == "tpu", reason="compiles as if on a TPU on another platform")


def _random(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


# --- the kernel ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 24, 256), (2, 13, 200), (2, 40, 1024), (1, 8, 128)],
                         ids=["tiled", "whole-axes", "two-out-blocks", "one-row"])
def test_the_pallas_kernel_agrees_with_its_xla_reference(shape: tuple[int, int, int]) -> None:
    batch, n_in, n_out = shape
    trace, x = _random(shape, 0), _random((batch, n_in), 1)
    diag, df, signal = (_random((batch, n_out), s) for s in (2, 3, 4))
    want_new, want_grad = fused_roll.roll_and_contract_xla(trace, diag, x, df, signal)
    new, grad = fused_roll.roll_and_contract_pallas(trace, diag, x, df, signal, interpret=True)
    np.testing.assert_allclose(new, want_new, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 24, 256), (2, 13, 200)], ids=["tiled", "whole-axes"])
def test_the_filtering_kernel_agrees_with_its_xla_reference(shape: tuple[int, int, int]) -> None:
    batch, n_in, n_out = shape
    trace, filt, x = _random(shape, 0), _random(shape, 5), _random((batch, n_in), 1)
    diag, df, signal, filt_signal = (_random((batch, n_out), s) for s in (2, 3, 4, 6))
    want = fused_roll.roll_filter_and_contract_xla(trace, filt, diag, x, df, signal, filt_signal, 0.9)
    got = fused_roll.roll_filter_and_contract_pallas(trace, filt, diag, x, df, signal, filt_signal, 0.9, interpret=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_filtering_reference_rolls_filters_and_contracts_both() -> None:
    trace, filt, x = _random((2, 3, 4), 0), _random((2, 3, 4), 5), _random((2, 3), 1)
    diag, df, signal, filt_signal = (_random((2, 4), s) for s in (2, 3, 4, 6))
    new, new_filt, grad = fused_roll.roll_filter_and_contract_xla(trace, filt, diag, x, df, signal, filt_signal, 0.9)
    rolled = np.einsum("bo,bio->bio", diag, trace) + np.einsum("bi,bo->bio", x, df)
    np.testing.assert_allclose(new, rolled, rtol=1e-6)
    np.testing.assert_allclose(new_filt, 0.9 * np.asarray(filt) + rolled, rtol=1e-6)
    want = np.einsum("bio,bo->io", trace, signal) + np.einsum("bio,bo->io", filt, filt_signal)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)


def test_the_xla_reference_is_the_roll_and_the_contraction() -> None:
    trace, x = _random((2, 3, 4), 0), _random((2, 3), 1)
    diag, df, signal = (_random((2, 4), s) for s in (2, 3, 4))
    new, grad = fused_roll.roll_and_contract_xla(trace, diag, x, df, signal)
    np.testing.assert_allclose(new, np.einsum("bo,bio->bio", diag, trace) + np.einsum("bi,bo->bio", x, df), rtol=1e-6)
    np.testing.assert_allclose(grad, np.einsum("bio,bo->io", trace, signal), rtol=1e-6)


# --- the learners -------------------------------------------------------------------------


#: The learners as compiled here: EProp with a filter is ``eprop-kappa``.
ALGORITHMS: dict[str, tuple[str, dict[str, Any]]] = {
    "d_rtrl": ("d_rtrl", {}), "eprop": ("eprop", {}), "eprop-kappa": ("eprop", {"kappa_filter_decay": 0.9}),
    "ostl_recurrent": ("ostl_recurrent", {}),
}


def _compile(model: Any, algorithm: str, monkeypatch: pytest.MonkeyPatch, as_on_tpu: bool = True) -> Any:
    x0 = normal(11, (T, B, I))[0]
    name, options = ALGORITHMS[algorithm]
    with monkeypatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if as_on_tpu:
            patch.setattr(jax, "default_backend", lambda: "tpu")
        return braintrace.compile(model, name, x0, batch_size=B, **options)


@pytest.fixture
def rolls_every_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backward_roll, "ROLL_MIN_BYTES", 0)


def _read_past_lif() -> brainstate.nn.Module:
    """The benchmarks' LIF network, whose readout reads the spikes past their update."""
    brainstate.random.seed(0)
    return ReadPastLIF(I, 8, 2)


MODEL_CASES = {"leaky": MODELS["leaky"], "lif": MODELS["lif"], "gru": MODELS["gru"], "read-past-lif": _read_past_lif}
CASES = [(m, a) for m in MODEL_CASES for a in ALGORITHMS]


def _etrace_grad(learner: Any) -> tuple[Any, list[Any]]:
    """The summed estimate and the final traces and filters (keyed by compiled variables: listed in order)."""
    xs = normal(11, (T, B, I))
    grads = learner.etrace_grad(xs, jnp.arange(T), step_fn=lambda x, t: target_loss(t, learner(x)), reduction="sum")
    states = [*learner.etrace_bwg.values(), *learner._trace_filters.values()]
    return _to_numpy(grads), [jax.tree.map(np.asarray, st.value) for st in states]


@pytest.mark.parametrize("model, algorithm", CASES, ids=[f"{m}-{a}" for m, a in CASES])
def test_rolled_in_the_backward_pass_the_learner_computes_what_it_does_in_the_forward_pass(
    model: str, algorithm: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    backward = _compile(MODEL_CASES[model](), algorithm, monkeypatch)
    forward = _compile(MODEL_CASES[model](), algorithm, monkeypatch)
    monkeypatch.setattr(forward, "_seq_roll_sink", lambda: None)
    got, got_traces = _etrace_grad(backward)
    want, want_traces = _etrace_grad(forward)
    assert backward._rolled_now and not forward._rolled_now
    assert max_rel_err(want, got) < 1e-6
    for got_trace, want_trace in zip(got_traces, want_traces, strict=True):
        for name, value in want_trace.items():
            np.testing.assert_allclose(got_trace[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("model", ["lif", "leaky"])
def test_rolled_by_the_pallas_kernel_the_gradient_matches_bptt(
    model: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    monkeypatch.setattr(dense, "roll_and_contract",
                        lambda *a: fused_roll.roll_and_contract_pallas(*a, interpret=True))
    learner = _compile(MODELS[model](), "d_rtrl", monkeypatch)
    got, _ = _etrace_grad(learner)
    assert learner._rolled_now
    ref = bptt_grads(MODELS[model](), normal(11, (T, B, I)), batch_size=B)
    assert max_rel_err(ref, got) <= RTOL


def test_a_filtered_trace_rolled_by_the_pallas_kernel_gives_what_the_forward_roll_gives(
    monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    monkeypatch.setattr(dense, "roll_filter_and_contract",
                        lambda *a: fused_roll.roll_filter_and_contract_pallas(*a, interpret=True))
    backward = _compile(MODELS["lif"](), "eprop-kappa", monkeypatch)
    forward = _compile(MODELS["lif"](), "eprop-kappa", monkeypatch)
    monkeypatch.setattr(forward, "_seq_roll_sink", lambda: None)
    (got, got_traces), (want, want_traces) = _etrace_grad(backward), _etrace_grad(forward)
    assert backward._rolled_now
    assert max_rel_err(want, got) < 1e-6
    for got_trace, want_trace in zip(got_traces, want_traces, strict=True):
        for name, value in want_trace.items():
            np.testing.assert_allclose(got_trace[name], value, rtol=1e-6, atol=1e-7)


def test_etrace_train_and_check_finite_roll_in_the_backward_pass_too(
    monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    xs, ts = normal(11, (T, B, I)), jnp.arange(T)
    weights = []
    for rolls in (True, False):
        learner = _compile(MODELS["gru"](), "d_rtrl", monkeypatch)
        if not rolls:
            monkeypatch.setattr(learner, "_seq_roll_sink", lambda: None)
        learner.etrace_train(xs, ts, step_fn=lambda x, t, lr=learner: target_loss(t, lr(x)),
                             optimizer=optax.adam(1e-2), check_finite=True)
        assert bool(learner._rolled_now) == rolls
        weights.append(_to_numpy({k: st.value for k, st in learner.param_states.items()}))
    assert max_rel_err(weights[1], weights[0]) < 1e-5


def test_below_the_size_threshold_and_outside_the_drivers_traces_roll_in_the_forward_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    learner = _compile(MODELS["lif"](), "d_rtrl", monkeypatch)
    assert learner._rolled_relations  # it could, but its trace is below ROLL_MIN_BYTES
    _etrace_grad(learner)
    assert not learner._rolled_now
    monkeypatch.setattr(backward_roll, "ROLL_MIN_BYTES", 0)
    learner = _compile(MODELS["lif"](), "d_rtrl", monkeypatch)
    x = normal(11, (T, B, I))[0]
    brainstate.transform.grad(lambda: jnp.sum(learner(x) ** 2), learner.param_states)()
    assert not learner._rolled_now


def test_on_cpu_storage_no_trace_is_rolled_in_the_backward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    learner = _compile(MODELS["lif"](), "d_rtrl", monkeypatch, as_on_tpu=False)
    assert not learner._rolled_relations
