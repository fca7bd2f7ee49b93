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


def _in_threads(work: Callable[[], None]) -> list[BaseException]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(CALLS):
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
