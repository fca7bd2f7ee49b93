"""Every exact learner against BPTT in float32, on whatever platform JAX runs (``make test-device``).

The float64 tests (``tests/algorithm``) pin the rules to ``1e-10``; an accelerator has no float64
and multiplies float32 in bfloat16 passes by default. Here each learner runs in float32 under
``jax.default_matmul_precision('highest')`` (full float32 products on a TPU; the default on CPU)
on a batch of four, and the sum of its online gradients over ``T`` steps must equal BPTT's
element-wise: ``max |g − g_BPTT| ≤ RTOL · max |g_BPTT|`` per parameter, ``RTOL = 2e-5`` (float32
rounding over a few steps; the rules measure 1e-7 to 1e-6 on CPU). Each case is one the float64
suite pins exact, on a model in the learner's exact regime: element-wise recurrences (a leaky
layer and a LIF layer with a learnable leak, a convolutional leaky map) for the per-position
learners, a GRU for SnAp saturated on it. The negative control: D_RTRL on the GRU, outside its
exact regime, measures far above ``RTOL``, so the comparison can fail.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.carriers import backward_roll
from braintrace._op import dense, fused_roll
from tests.algorithm.bptt import _to_numpy, bptt_grads, max_rel_err, normal, single_step_grads, target_loss, window_grads
from tests.compiler.models import spike

T, B, I, H = 6, 4, 3, 5
RTOL = 2e-5


class Leaky(brainstate.nn.Module):
    """``h = σ(τ) ⊙ h + matmul(x, W) + b``, read out through ``tanh``."""

    def __init__(self) -> None:
        super().__init__()
        self.tau = brainstate.ParamState(normal(1, (H,)))
        self.w = brainstate.ParamState(normal(2, (I, H), 0.6))
        self.b = brainstate.ParamState(normal(3, (H,), 0.1))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or B, H)))

    def update(self, x: jax.Array) -> jax.Array:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + braintrace.matmul(x, self.w.value, self.b.value)
        return jnp.tanh(self.h.value)


class LIF(brainstate.nn.Module):
    """``v = σ(τ) ⊙ v ⊙ (1 − s) + matmul(x, W)`` with a surrogate spike ``s``."""

    def __init__(self) -> None:
        super().__init__()
        self.tau = brainstate.ParamState(normal(4, (H,)))
        self.w = brainstate.ParamState(normal(5, (I, H), 1.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros((batch_size or B, H)))

    def update(self, x: jax.Array) -> jax.Array:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        s = spike(self.v.value - 1.0)
        self.v.value = leak * self.v.value * (1 - s) + braintrace.matmul(x, self.w.value)
        return spike(self.v.value - 1.0) + jnp.tanh(self.v.value)


class ConvLeaky(brainstate.nn.Module):
    """``h = 0.7 h + conv(x, K) + b`` on a 4×4 map with two channels."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = brainstate.ParamState(normal(6, (3, 3, 1, 2), 0.5))
        self.bias = brainstate.ParamState(normal(7, (2,), 0.1))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or B, 4, 4, 2)))

    def update(self, x: jax.Array) -> jax.Array:
        x_map = x[..., :1, None, None] * jnp.linspace(0.5, 1.5, 16).reshape(4, 4, 1)  # (B, 4, 4, 1)
        drive = braintrace.conv(x_map, self.kernel.value, self.bias.value, strides=(1, 1),
                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
        self.h.value = 0.7 * self.h.value + drive
        return jnp.tanh(self.h.value)


def gru() -> brainstate.nn.Module:
    brainstate.random.seed(0)
    return braintrace.nn.GRUCell(I, H)


MODELS: dict[str, Callable[[], brainstate.nn.Module]] = {"leaky": Leaky, "lif": LIF, "conv": ConvLeaky, "gru": gru}

#: ``(model, algorithm, options, windows)``: ``windows`` None runs one call per step.
CASES = [
    ("leaky", "d_rtrl", {}, None),
    ("leaky", "d_rtrl", {"vjp_method": "multi-step"}, (2, 3, 1)),
    ("leaky", "ostl_recurrent", {}, None),
    ("leaky", "eprop", {}, None),
    ("lif", "d_rtrl", {}, None),
    ("lif", "d_rtrl", {"vjp_method": "multi-step"}, (3, 3)),
    ("conv", "d_rtrl", {}, None),
    ("gru", "snap", {"n": H}, None),
]


def _online(model: str, algorithm: str, options: dict[str, Any], windows: Any) -> tuple[Any, Any]:
    """BPTT's gradient and the learner's, each on a fresh copy of ``model`` (the same parameters)."""
    xs = normal(11, (T, B, I))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(MODELS[model](), algorithm, xs[0], batch_size=B, **options)
    with jax.default_matmul_precision("highest"):
        got = single_step_grads(learner, xs) if windows is None else window_grads(learner, xs, windows)
        ref = bptt_grads(MODELS[model](), xs, batch_size=B)
    return ref, got


@pytest.mark.parametrize("model, algorithm, options, windows", CASES,
                         ids=[f"{m}-{a}{'-multi' if w else ''}" for m, a, _, w in CASES])
def test_exact_learner_matches_bptt_in_float32(model: str, algorithm: str, options: dict[str, Any], windows: Any) -> None:
    ref, got = _online(model, algorithm, options, windows)
    err = max_rel_err(ref, got)
    assert err <= RTOL, f"{algorithm} on {model} ({jax.default_backend()}): max rel. err {err:.2e} > {RTOL:.0e}"


def test_the_comparison_catches_an_approximate_rule() -> None:
    ref, got = _online("gru", "d_rtrl", {}, None)
    assert max_rel_err(ref, got) > 100 * RTOL


def test_check_gradients_reads_exact_at_float32_rounding() -> None:
    xs = normal(11, (T, B, I))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(Leaky(), "d_rtrl", xs[0], batch_size=B)
    audit = braintrace.check_gradients(learner, xs, step_fn=lambda x: jnp.sum(learner(x) ** 2), rtol=RTOL)
    assert audit.exact, audit


@pytest.mark.parametrize("calls_per_roll, elementwise_bytes", [
    (1, None), (backward_roll.MAX_CALLS_PER_ROLL, None), (backward_roll.MAX_CALLS_PER_ROLL, 0),
], ids=["per-call", "grouped", "grouped-elementwise"])
@pytest.mark.parametrize("model", ["leaky", "lif"])
def test_traces_rolled_in_the_backward_pass_match_bptt(
    model: str, calls_per_roll: int, elementwise_bytes: int | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a TPU the drivers roll dense traces in the backward pass
    (``braintrace._algorithm.carriers.backward_roll``): call by call with a Pallas kernel, or
    over groups of calls at once (here the loop's ``T`` calls are one group), the group's roll
    and its steps' own terms by products or, as for a large trace, element-wise; with the size
    thresholds at zero these small models take each path there. Elsewhere the traces roll in the
    forward pass, checked the same way."""
    monkeypatch.setattr(backward_roll, "ROLL_MIN_BYTES", 0)
    monkeypatch.setattr(backward_roll, "MAX_CALLS_PER_ROLL", calls_per_roll)
    if elementwise_bytes is not None:
        monkeypatch.setattr(dense, "ELEMENTWISE_TRACE_BYTES", elementwise_bytes)
    xs = normal(11, (T, B, I))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(MODELS[model](), "d_rtrl", xs[0], batch_size=B)
    with jax.default_matmul_precision("highest"):
        got = learner.etrace_grad(xs, jnp.arange(T), step_fn=lambda x, t: target_loss(t, learner(x)), reduction="sum")
        ref = bptt_grads(MODELS[model](), xs, batch_size=B)
    on_tpu = jax.default_backend() == "tpu"
    assert bool(learner._rolled_now) == on_tpu
    assert learner._seq_calls_per_roll(T) == (min(calls_per_roll, T) if on_tpu else 1)
    err = max_rel_err(ref, _to_numpy(got))
    assert err <= RTOL, f"D_RTRL rolled in the backward pass on {model}: max rel. err {err:.2e} > {RTOL:.0e}"


@pytest.mark.parametrize("model", ["leaky", "lif"])
def test_traces_stored_in_bfloat16_stay_within_their_rounding_of_bptt(model: str) -> None:
    """``trace_dtype=jnp.bfloat16`` under the drivers. On a TPU the loop's ``T`` calls are one
    group, rolled in float32 from fresh traces and rounded once at its end, so the gradient is the
    float32 learner's; elsewhere each call rounds its trace, and the gradient stays within 2 %
    of BPTT's."""
    xs = normal(11, (T, B, I))
    grads, rolled = {}, {}
    for name, dtype in (("float32", None), ("bfloat16", jnp.bfloat16)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            learner = braintrace.compile(MODELS[model](), "d_rtrl", xs[0], batch_size=B, trace_dtype=dtype)
        with jax.default_matmul_precision("highest"):
            grads[name] = _to_numpy(learner.etrace_grad(
                xs, jnp.arange(T), step_fn=lambda x, t, lr=learner: target_loss(t, lr(x)), reduction="sum"))
        rolled[name] = bool(learner._rolled_now)
    with jax.default_matmul_precision("highest"):
        ref = bptt_grads(MODELS[model](), xs, batch_size=B)
    on_tpu = jax.default_backend() == "tpu"
    assert rolled == {"float32": on_tpu, "bfloat16": on_tpu}
    if on_tpu:
        err = max_rel_err(grads["float32"], grads["bfloat16"])
        assert err <= RTOL, f"bfloat16 traces over one group on {model}: {err:.2e} from float32 > {RTOL:.0e}"
    err = max_rel_err(ref, grads["bfloat16"])
    assert err < 0.02, f"bfloat16 traces on {model} ({jax.default_backend()}): max rel. err {err:.2e} from BPTT"


def test_a_filtered_trace_rolled_in_the_backward_pass_gives_its_forward_roll(monkeypatch: pytest.MonkeyPatch) -> None:
    """EProp with a filter (approximate, so not against BPTT): the drivers' estimate, with the
    trace and its filter rolled in the backward pass on a TPU, equals the sum of the learner's
    one-step gradients taken outside the drivers, which roll in the forward pass everywhere."""
    monkeypatch.setattr(backward_roll, "ROLL_MIN_BYTES", 0)
    xs = normal(11, (T, B, I))
    learners = []
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            learners.append(braintrace.compile(LIF(), "eprop", xs[0], batch_size=B, kappa_filter_decay=0.9))
    driven, called = learners
    with jax.default_matmul_precision("highest"):
        got = driven.etrace_grad(xs, jnp.arange(T), step_fn=lambda x, t: target_loss(t, driven(x)), reduction="sum")
        want = single_step_grads(called, xs)
    assert bool(driven._rolled_now) == (jax.default_backend() == "tpu") and not called._rolled_now
    err = max_rel_err(want, _to_numpy(got))
    assert err <= RTOL, f"EProp(kappa) rolled in the backward pass: max rel. err {err:.2e} > {RTOL:.0e}"


def test_the_filtering_roll_kernel_agrees_with_its_xla_reference() -> None:
    """:func:`roll_filter_and_contract` (the Pallas kernel on a TPU) against its XLA reference."""
    keys = jax.random.split(jax.random.PRNGKey(1), 7)
    trace, filt = (jax.random.normal(k, (8, 272, 1024)) for k in keys[:2])
    x = jax.random.normal(keys[2], (8, 272))
    diag, df, signal, filt_signal = (jax.random.normal(k, (8, 1024)) for k in keys[3:])
    want = fused_roll.roll_filter_and_contract_xla(trace, filt, diag, x, df, signal, filt_signal, 0.9)
    got = jax.jit(fused_roll.roll_filter_and_contract, static_argnums=7)(
        trace, filt, diag, x, df, signal, filt_signal, 0.9)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_roll_kernel_agrees_with_its_xla_reference() -> None:
    """:func:`roll_and_contract` (the Pallas kernel on a TPU) against its XLA reference, on a
    trace of several blocks along both axes."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    trace = jax.random.normal(keys[0], (8, 272, 1024))
    x = jax.random.normal(keys[1], (8, 272))
    diag, df, signal = (jax.random.normal(k, (8, 1024)) for k in keys[2:])
    want_new, want_grad = fused_roll.roll_and_contract_xla(trace, diag, x, df, signal)
    new, grad = jax.jit(fused_roll.roll_and_contract)(trace, diag, x, df, signal)
    np.testing.assert_allclose(new, want_new, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)
