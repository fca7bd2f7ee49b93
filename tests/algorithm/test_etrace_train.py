"""``etrace_train``: online learning while a stream runs.

The three contracts: ``update_every=None`` equals ``etrace_grad`` followed by one optimizer
step; ``update_every=1`` with SGD equals the hand-written per-step loop (call, gradient, update)
bit for bit; a stream of thousands of steps with a drifting target is learned with per-step
updates and not with the weights frozen. Plus the spans in between, window mode, continuation,
``ETraceVmap`` and the argument errors.
"""

from __future__ import annotations

from typing import Any, Callable

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import braintrace
from tests.algorithm.bptt import normal

T, B, I, H = 12, 3, 2, 4


class Leaky(brainstate.nn.Module):
    """``h = 0.6 h + tanh(x W + b)``, read out by a plain ``h R``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (I, H), 0.5))
        self.b = brainstate.ParamState(normal(1, (H,), 0.1))
        self.r = brainstate.ParamState(normal(2, (H, 1), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((H,) if batch_size is None else (batch_size, H)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.6 * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value, self.b.value))
        return self.h.value @ self.r.value


LEARNERS = {
    "d_rtrl": (braintrace.D_RTRL, {}),
    "pp_prop": (braintrace.pp_prop, {"decay_or_rank": 0.8}),
}


def make(learner: str = "d_rtrl", **options: Any) -> Any:
    cls, defaults = LEARNERS[learner]
    return braintrace.compile(Leaky(), cls, normal(3, (B, I)), batch_size=B, **defaults, **options)


XS, YS = normal(4, (T, B, I)), normal(5, (T, B, 1))


def mse(learner: Any) -> Callable[[Any, Any], Any]:
    return lambda x, y: jnp.mean((learner(x) - y) ** 2)


def values(learner: Any) -> dict[Any, np.ndarray]:
    return {p: np.asarray(st.value) for p, st in learner.param_states.items()}


def assert_same(a: dict[Any, np.ndarray], b: dict[Any, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for p in a:
        np.testing.assert_array_equal(a[p], b[p])


@pytest.mark.parametrize("learner", sorted(LEARNERS))
def test_update_every_step_with_sgd_is_the_hand_written_loop_bit_for_bit(learner: str) -> None:
    driven = make(learner)
    result = driven.etrace_train(XS, YS, step_fn=mse(driven), optimizer=braintools.optim.SGD(lr=0.1), update_every=1)

    by_hand = make(learner)
    sgd = braintools.optim.SGD(lr=0.1)
    sgd.register_trainable_weights(by_hand.param_states)

    def step(_: None, inputs: Any) -> tuple[None, Any]:
        x, y = inputs
        loss = lambda: jnp.mean((by_hand(x) - y) ** 2)  # noqa: E731
        grads, value = brainstate.transform.grad(loss, by_hand.param_states, return_value=True)()
        sgd.update(grads)
        return None, value

    losses = brainstate.transform.scan(step, None, (XS, YS))[1]
    np.testing.assert_array_equal(result.losses, losses)
    assert_same(values(driven), values(by_hand))
    assert float(result.losses[-3:].mean()) < float(result.losses[:3].mean())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_update_at_the_end_is_etrace_grad_then_one_step(reduction: str) -> None:
    mask = jnp.asarray(np.random.default_rng(6).uniform(0, 2, T), jnp.float32)
    driven = make()
    result = driven.etrace_train(XS, YS, step_fn=mse(driven), optimizer=optax.adam(0.05), mask=mask,
                                 reduction=reduction)
    assert int(result.optimizer.step_count.value) == 1

    reference = make()
    grads, losses = reference.etrace_grad(XS, YS, step_fn=mse(reference), mask=mask, reduction=reduction,
                                          return_value=True)
    adam = braintools.optim.OptaxOptimizer(tx=optax.adam(0.05))
    adam.register_trainable_weights(reference.param_states)
    adam.update(grads)
    np.testing.assert_array_equal(result.losses, losses)
    # etrace_train compiles the mean's division and Adam's arithmetic into its own program, where
    # XLA may fuse them differently: float32 agrees to an ulp or two (measured 2.4e-7), not bitwise
    for p, value in values(reference).items():
        np.testing.assert_allclose(values(driven)[p], value, rtol=1e-6, atol=0)


def _span_by_span(learner: Any, spans: list[tuple[int, int]], windows: int | None = None) -> tuple[Any, np.ndarray]:
    """``etrace_grad`` over each span, then one Adam step: the reference of ``update_every``."""
    adam = braintools.optim.Adam(lr=0.05)
    adam.register_trainable_weights(learner.param_states)
    step_fn = mse(learner) if windows is None else window_mse(learner)
    losses = []
    for a, b in spans:
        grads, value = learner.etrace_grad(XS[a:b], YS[a:b], step_fn=step_fn, chunk_size=windows, return_value=True)
        adam.update(grads)
        losses.append(np.asarray(value))
    return adam, np.concatenate(losses)


def window_mse(learner: Any) -> Callable[[Any, Any], Any]:
    return lambda x, y: jnp.mean((learner(braintrace.MultiStepData(x)) - y) ** 2, axis=(1, 2))


def test_updates_every_five_steps_with_a_short_last_span() -> None:
    driven = make()
    result = driven.etrace_train(XS, YS, step_fn=mse(driven), optimizer=braintools.optim.Adam(lr=0.05), update_every=5)
    assert int(result.optimizer.step_count.value) == 3  # 5 + 5 + 2 steps

    reference = make()
    adam, losses = _span_by_span(reference, [(0, 5), (5, 10), (10, 12)])
    np.testing.assert_allclose(result.losses, losses, rtol=1e-6)
    for p, v in values(reference).items():
        np.testing.assert_allclose(values(driven)[p], v, rtol=1e-5, atol=1e-7)
    assert int(driven.running_index.value) == T  # traces and states ran on, never reset


def test_window_mode_updates_between_windows() -> None:
    driven = make(vjp_method="multi-step")
    result = driven.etrace_train(XS, YS, step_fn=window_mse(driven), optimizer=braintools.optim.Adam(lr=0.05),
                                 chunk_size=2, update_every=4)
    assert result.losses.shape == (T,) and int(driven.running_index.value) == T // 2

    reference = make(vjp_method="multi-step")
    _, losses = _span_by_span(reference, [(0, 4), (4, 8), (8, 12)], windows=2)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-6)
    for p, v in values(reference).items():
        np.testing.assert_allclose(values(driven)[p], v, rtol=1e-5, atol=1e-7)


def test_the_returned_optimizer_continues_the_same_state() -> None:
    whole = make()
    one = whole.etrace_train(XS, YS, step_fn=mse(whole), optimizer=braintools.optim.Adam(lr=0.05), update_every=3)
    halves = make()
    first = halves.etrace_train(XS[:6], YS[:6], step_fn=mse(halves), optimizer=braintools.optim.Adam(lr=0.05),
                                update_every=3)
    second = halves.etrace_train(XS[6:], YS[6:], step_fn=mse(halves), optimizer=first.optimizer, update_every=3)
    assert second.optimizer is first.optimizer and int(second.optimizer.step_count.value) == 4
    np.testing.assert_allclose(np.concatenate([first.losses, second.losses]), one.losses, rtol=1e-6)
    for p, v in values(whole).items():
        np.testing.assert_allclose(values(halves)[p], v, rtol=1e-5, atol=1e-7)


def test_aux_is_stacked_over_calls_and_a_weight_subset_trains_alone() -> None:
    driven = make()
    frozen = {("r",): driven.param_states[("r",)]}
    readout_before = values(driven)[("w",)]

    def step_fn(x: Any, y: Any) -> Any:
        out = driven(x)
        return jnp.mean((out - y) ** 2), out

    result = driven.etrace_train(XS, YS, step_fn=step_fn, optimizer=braintools.optim.SGD(lr=0.1),
                                 weights=frozen, update_every=5, has_aux=True)
    assert result.aux.shape == (T, B, 1)
    np.testing.assert_array_equal(values(driven)[("w",)], readout_before)


def test_a_vmapped_learner_trains_its_shared_parameters() -> None:
    vmapped = braintrace.compile(Leaky(), braintrace.D_RTRL, normal(3, (B, I)), batch_size=B, vmap=True)
    before = {p: np.asarray(st.value) for p, st in vmapped.param_states.items()}
    step_fn = lambda x, y: jnp.sum((vmapped(x) - y) ** 2)  # noqa: E731
    result = vmapped.etrace_train(XS, YS, step_fn=step_fn, optimizer=braintools.optim.SGD(lr=0.01), update_every=4)
    assert result.losses.shape == (T,)
    assert all(np.any(np.asarray(st.value) != before[p]) for p, st in vmapped.param_states.items())


# --- a drifting stream ------------------------------------------------------------------------


class Tracker(brainstate.nn.Module):
    """A leaky layer and a plain readout that must follow a gain that drifts over the stream."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(7, (2, 8), 0.5))
        self.r = brainstate.ParamState(jnp.zeros((8, 1)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, 8)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.3 * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value))
        return self.h.value @ self.r.value


def _drifting_stream(steps: int = 3000, batch: int = 8) -> tuple[jax.Array, jax.Array]:
    """``y_t = g(t) x_t`` with ``g(t) = sin(2π t / 1500)``: one period of drift every 1500 steps."""
    x = np.random.default_rng(8).normal(size=(steps, batch, 1)).astype(np.float32)
    gain = np.sin(2 * np.pi * np.arange(steps) / 1500.0).astype(np.float32)
    inputs = np.concatenate([x, np.ones_like(x)], axis=-1)  # the input and a constant
    return jnp.asarray(inputs), jnp.asarray(gain[:, None, None] * x)


@pytest.mark.slow
def test_a_drifting_stream_is_tracked_with_per_step_updates_and_not_with_frozen_weights() -> None:
    xs, ys = _drifting_stream()

    def run(update_every: int | None, lr: float) -> np.ndarray:
        learner = braintrace.compile(Tracker(), braintrace.D_RTRL, xs[0], batch_size=xs.shape[1])
        step_fn = lambda x, y: jnp.mean((learner(x) - y) ** 2)  # noqa: E731
        result = learner.etrace_train(xs, ys, step_fn=step_fn, optimizer=braintools.optim.SGD(lr=lr),
                                      update_every=update_every)
        return np.asarray(result.losses)

    online = run(update_every=1, lr=0.2)
    frozen = run(update_every=None, lr=0.2)  # the same optimizer, applied only after the stream
    assert online[-1000:].mean() < 0.2 * frozen[-1000:].mean()
    np.testing.assert_array_equal(frozen, run(update_every=1, lr=0.0))  # frozen all along


# --- argument errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"update_every": 0}, ValueError, "update_every must be >= 1"),
        ({"update_every": 2.0}, TypeError, "update_every must be None or a Python int"),
        ({"update_every": True}, TypeError, "update_every"),
        ({"optimizer": "sgd"}, TypeError, "braintools.optim optimizer"),
        ({"reduction": "max"}, ValueError, "reduction must be one of"),
        ({"mask": jnp.ones(3)}, ValueError, r"etrace_train: mask must have shape \(T,\)"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    learner = make()
    options = {"optimizer": braintools.optim.SGD(lr=0.1), **kwargs}
    with pytest.raises(error, match=match):
        learner.etrace_train(XS, YS, step_fn=mse(learner), **options)
    assert int(learner.running_index.value) == 0


def test_window_updates_must_fall_between_windows() -> None:
    learner = make(vjp_method="multi-step")
    with pytest.raises(ValueError, match="update_every=3 is not a multiple of chunk_size=2"):
        learner.etrace_train(XS, YS, step_fn=window_mse(learner), optimizer=braintools.optim.SGD(lr=0.1),
                             chunk_size=2, update_every=3)


def test_an_optimizer_registered_on_other_weights_is_refused() -> None:
    learner = make()
    sgd = braintools.optim.SGD(lr=0.1)
    sgd.register_trainable_weights({("r",): learner.param_states[("r",)]})
    with pytest.raises(ValueError, match="registered on other weights"):
        learner.etrace_train(XS, YS, step_fn=mse(learner), optimizer=sgd)
