"""The optimizer contract of ``etrace_train``: whose weights it moves, and whose state goes on.

An optax transformation's state (Adam's count and moments) goes on from one call to the next
when the same transformation object is passed again: two calls equal one call over the joined
stream. An optimizer registered on another learner's weights (same paths, other ``ParamState``
objects) is refused and changes nothing. A failed call keeps no new state; a new transformation
object after a stateful one is warned, and so is a stateful one whose state would be made inside
``jit``; the kept optimizer is checkpointed like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import braintrace
from tests.algorithm.test_etrace_train import XS, YS, assert_same, make, mse, values


def optimizer_values(optimizer: Any) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(optimizer.opt_state.value)] + [
        np.asarray(optimizer.step_count.value)]


def test_adam_by_optax_goes_on_across_calls_as_over_the_joined_stream() -> None:
    whole = make()
    one = whole.etrace_train(XS, YS, step_fn=mse(whole), optimizer=optax.adam(0.05), update_every=3)

    halves, adam = make(), optax.adam(0.05)
    first = halves.etrace_train(XS[:6], YS[:6], step_fn=mse(halves), optimizer=adam, update_every=3)
    second = halves.etrace_train(XS[6:], YS[6:], step_fn=mse(halves), optimizer=adam, update_every=3)
    assert second.optimizer is first.optimizer
    assert int(second.optimizer.step_count.value) == 4 == int(one.optimizer.step_count.value)
    assert int(second.optimizer.opt_state.value[0].count) == 4  # Adam's own count, not restarted
    np.testing.assert_allclose(np.concatenate([first.losses, second.losses]), one.losses, rtol=1e-6)
    for p, v in values(whole).items():
        np.testing.assert_allclose(values(halves)[p], v, rtol=1e-6, atol=1e-7)
    for a, b in zip(optimizer_values(second.optimizer), optimizer_values(one.optimizer), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_adam_by_optax_matches_a_hand_written_optax_loop() -> None:
    driven, adam = make(), optax.adam(0.05)
    for a, b in [(0, 4), (4, 8), (8, 12)]:
        driven.etrace_train(XS[a:b], YS[a:b], step_fn=mse(driven), optimizer=adam)  # one update per call

    by_hand = make()
    params = {p: st.value for p, st in by_hand.param_states.items()}
    state = adam.init(params)
    for a, b in [(0, 4), (4, 8), (8, 12)]:
        grads = by_hand.etrace_grad(XS[a:b], YS[a:b], step_fn=mse(by_hand))
        updates, state = adam.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for p, st in by_hand.param_states.items():
            st.value = params[p]
    for p, v in values(by_hand).items():
        np.testing.assert_allclose(values(driven)[p], v, rtol=1e-6, atol=1e-7)


def test_an_optimizer_registered_on_another_learners_weights_is_refused_and_nothing_changes() -> None:
    mine, other = make(), make()  # two instances of one model class: the same weight paths
    trained = other.etrace_train(XS[:4], YS[:4], step_fn=mse(other), optimizer=braintools.optim.Adam(lr=0.05))
    assert set(trained.optimizer.param_states.to_pytree()) == set(mine.param_states)
    mine_before, other_before = values(mine), values(other)
    optimizer_before = optimizer_values(trained.optimizer)
    with pytest.raises(ValueError, match=r"registered on other weights.*have this learner's paths but are other "
                                         r"objects.*Pass a fresh optimizer"):
        mine.etrace_train(XS, YS, step_fn=mse(mine), optimizer=trained.optimizer)
    assert_same(values(mine), mine_before)
    assert_same(values(other), other_before)
    for a, b in zip(optimizer_values(trained.optimizer), optimizer_before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(mine.running_index.value) == 0


def test_a_failed_call_keeps_no_new_state_and_leaves_the_kept_one_as_it_was() -> None:
    def failing(learner: Any) -> Any:
        def step_fn(x: Any, y: Any) -> Any:
            learner(x)
            raise RuntimeError("planted")
        return step_fn

    learner, fresh, adam = make(), make(), optax.adam(0.05)
    with pytest.raises(RuntimeError, match="planted"):
        learner.etrace_train(XS, YS, step_fn=failing(learner), optimizer=adam)
    first = learner.etrace_train(XS[:6], YS[:6], step_fn=mse(learner), optimizer=adam, update_every=3)
    assert int(first.optimizer.step_count.value) == 2  # started afresh, as a learner that never failed
    fresh.etrace_train(XS[:6], YS[:6], step_fn=mse(fresh), optimizer=optax.adam(0.05), update_every=3)
    assert_same(values(learner), values(fresh))

    before = optimizer_values(first.optimizer)
    with pytest.raises(RuntimeError, match="planted"):
        learner.etrace_train(XS[6:], YS[6:], step_fn=failing(learner), optimizer=adam)
    for a, b in zip(optimizer_values(first.optimizer), before, strict=True):
        np.testing.assert_array_equal(a, b)
    again = learner.etrace_train(XS[6:], YS[6:], step_fn=mse(learner), optimizer=adam, update_every=3)
    assert again.optimizer is first.optimizer and int(again.optimizer.step_count.value) == 4


def test_a_new_transformation_after_a_stateful_one_is_warned() -> None:
    learner = make()
    learner.etrace_train(XS[:4], YS[:4], step_fn=mse(learner), optimizer=optax.adam(0.05))
    with pytest.warns(UserWarning, match=r"another object than the one that trained these weights before \(whose "
                                         r"state had taken 1 steps\).*build it once and pass the same object"):
        result = learner.etrace_train(XS[4:], YS[4:], step_fn=mse(learner), optimizer=optax.adam(0.05))
    assert int(result.optimizer.step_count.value) == 1
    # A stateless transformation loses nothing and replaces nothing: no warning (warnings are errors here).
    for tx in (optax.sgd(0.01), optax.sgd(0.01), optax.adam(0.05)):
        learner.etrace_train(XS[:4], YS[:4], step_fn=mse(learner), optimizer=tx)


def test_inside_jit_a_new_stateful_transformation_is_warned_and_a_kept_one_goes_on() -> None:
    learner, adam = make(), optax.adam(0.05)

    @brainstate.transform.jit
    def train(xs: Any, ys: Any) -> Any:
        return learner.etrace_train(xs, ys, step_fn=mse(learner), optimizer=adam).losses

    with pytest.warns(UserWarning, match=r"inside jit .* every call of the compiled function starts it afresh.*"
                                         r"Make the optimizer outside jit"):
        train(XS[:4], YS[:4])
    # Nothing was kept from the trace: outside jit the same transformation starts its state here.
    result = learner.etrace_train(XS[:4], YS[:4], step_fn=mse(learner), optimizer=adam)
    assert int(result.optimizer.step_count.value) == 1
    again = brainstate.transform.jit(lambda xs, ys: learner.etrace_train(
        xs, ys, step_fn=mse(learner), optimizer=adam).losses)
    again(XS[4:8], YS[4:8])
    again(XS[8:], YS[8:])
    assert int(result.optimizer.step_count.value) == 3  # the kept state went on inside jit
    # A stateless transformation, or a braintools optimizer made inside the trace, is not warned about.
    brainstate.transform.jit(lambda xs, ys: learner.etrace_train(
        xs, ys, step_fn=mse(learner), optimizer=optax.sgd(0.1)).losses)(XS[:4], YS[:4])
    brainstate.transform.jit(lambda xs, ys: learner.etrace_train(
        xs, ys, step_fn=mse(learner), optimizer=braintools.optim.SGD(lr=0.1)).losses)(XS[:4], YS[:4])


def test_the_kept_optimizer_checkpoints_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    learner, adam = make(), optax.adam(0.05)
    for a, b in [(0, 4), (4, 8)]:
        result = learner.etrace_train(XS[a:b], YS[a:b], step_fn=mse(learner), optimizer=adam, update_every=2)
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", learner, optimizer=result.optimizer)

    resumed = make()
    optimizer = braintools.optim.OptaxOptimizer(tx=adam)
    optimizer.register_trainable_weights(resumed.param_states)
    braintrace.load_checkpoint(path, resumed, optimizer=optimizer)
    assert int(optimizer.step_count.value) == 4
    learner.etrace_train(XS[8:], YS[8:], step_fn=mse(learner), optimizer=adam, update_every=2)
    resumed.etrace_train(XS[8:], YS[8:], step_fn=mse(resumed), optimizer=optimizer, update_every=2)
    assert_same(values(resumed), values(learner))
    for a, b in zip(optimizer_values(optimizer), optimizer_values(result.optimizer), strict=True):
        np.testing.assert_array_equal(a, b)
