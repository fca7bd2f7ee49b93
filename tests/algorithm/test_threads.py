"""A learner shared by threads: its calls, drivers and resets run one after another.

Three threads each drive one learner with ``etrace_train`` (or call it step by step) a few
times. No call may fail, no update may be lost (``running_index`` counts every step), and as
every call gets the same data, the weights must equal those of the same calls made one after
another in one thread. Without the learner's lock, the threads' traces interleave: JAX raised
``UnexpectedTracerError`` and left tracers in the states.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import braintrace
from tests.algorithm.bptt import normal

T, B, I, H = 5, 2, 3, 4
THREADS, CALLS = 3, 2


def _learner() -> Any:
    brainstate.random.seed(0)  # the same initial weights every time
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(braintrace.nn.ValinaRNNCell(I, H), "d_rtrl", jnp.ones((B, I)), batch_size=B)


def _in_threads(work: Callable[[], None], calls: int = CALLS) -> list[BaseException]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(calls):
                work()
        except BaseException as err:  # reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _weights(learner: Any) -> list[np.ndarray]:
    return [np.asarray(leaf) for st in learner.param_states.values() for leaf in jax.tree.leaves(st.value)]


def test_threads_driving_one_learner_run_one_after_another() -> None:
    xs, ys = normal(1, (T, B, I)), normal(2, (T, B, H))

    def train(learner: Any) -> Callable[[], None]:
        return lambda: learner.etrace_train(xs, ys, step_fn=lambda x, y: jnp.mean((learner(x) - y) ** 2),
                                            optimizer=optax.sgd(0.05))

    shared = _learner()
    assert _in_threads(train(shared)) == []
    assert int(shared.running_index.value) == THREADS * CALLS * T
    alone = _learner()
    for _ in range(THREADS * CALLS):
        train(alone)()
    for got, want in zip(_weights(shared), _weights(alone), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_threads_calling_one_learner_step_by_step_lose_no_step() -> None:
    learner = _learner()
    x = normal(3, (B, I))
    with pytest.warns(braintrace.EagerCallWarning):  # eager calls, step by step: warned once
        assert _in_threads(lambda: learner(x)) == []
    assert int(learner.running_index.value) == THREADS * CALLS


def _hidden(learner: Any) -> list[np.ndarray]:
    return [np.asarray(st.value) for st in learner.hidden_states.values()]


def _jitted_step(learner: Any) -> Callable[[Any], Any]:
    return brainstate.transform.jit(lambda x: learner(x))


def test_a_jitted_step_whose_states_changed_during_the_call_is_refused_and_writes_nothing() -> None:
    # Another call's write lands between this call's read of the states and its write-back: a
    # one-shot read hook on the step counter writes it right after the call has read it.
    learner = _learner()
    x = normal(3, (B, I))
    step = _jitted_step(learner)
    step(x)  # compiled; the step counter is now 1
    counter = learner.running_index

    def other_call(_: Any) -> None:
        handle.remove()
        counter.value = jnp.asarray(100, counter.value.dtype)

    handle = counter.register_hook("read", other_call)
    before = _weights(learner) + _hidden(learner)
    with pytest.raises(braintrace.ConcurrentCallError, match=r"one thread at a time.*learner\.lock"):
        step(x)
    assert int(counter.value) == 100  # the other call's write stands
    for got, want in zip(_weights(learner) + _hidden(learner), before, strict=True):
        np.testing.assert_array_equal(got, want)  # nothing of the refused call was written
    step(x)  # the learner stays usable
    assert int(counter.value) == 101


def test_threads_calling_one_jitted_step_lose_no_update() -> None:
    learner = _learner()
    step, x = _jitted_step(learner), normal(3, (B, I))
    step(x)  # compiled before the threads start
    landed: list[int] = []

    def call() -> None:
        step(x)
        landed.append(1)

    errors = _in_threads(call, calls=50)
    assert all(isinstance(err, braintrace.ConcurrentCallError) for err in errors), errors
    assert int(learner.running_index.value) == 1 + len(landed)  # every call that returned counted once


def test_threads_holding_the_learner_lock_around_a_jitted_step_run_one_after_another() -> None:
    shared, alone = _learner(), _learner()
    x = normal(3, (B, I))
    step = _jitted_step(shared)

    def call() -> None:
        with shared.lock:
            step(x)

    assert _in_threads(call, calls=20) == []
    assert int(shared.running_index.value) == THREADS * 20
    step_alone = _jitted_step(alone)
    for _ in range(THREADS * 20):
        step_alone(x)
    for got, want in zip(_hidden(shared), _hidden(alone), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
