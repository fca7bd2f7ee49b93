"""A learner called step by step outside ``jit`` warns once, with the measured cost per call.

The third eager call of a learner (or of a vmapped learner) issues one ``EagerCallWarning``
naming ``brainstate.transform.jit`` and the sequence drivers and the measured milliseconds per
call; later calls do not warn again. Calls under ``jit``, ``grad``, ``vmap`` and the drivers run
on tracers and are not counted, however many there are.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable

import brainstate
import jax.numpy as jnp
import pytest

import braintrace
from braintrace._algorithm.engine.eager_calls import WARN_AT

X = jnp.ones((2, 3))


def build(**options: Any) -> Any:
    return braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, X, batch_size=2, **options)


def eager_warnings(run: Callable[[], Any]) -> list[str]:
    """The messages of the ``EagerCallWarning``s ``run()`` issues."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, braintrace.EagerCallWarning)]


@pytest.mark.parametrize("vmap", [False, True], ids=["learner", "vmapped"])
def test_the_third_eager_call_warns_once_with_the_measured_cost(vmap: bool) -> None:
    learner = build(vmap=vmap)
    for _ in range(WARN_AT - 1):
        learner(X)  # no warning yet: warnings are errors in this suite
    with pytest.warns(braintrace.EagerCallWarning) as record:
        learner(X)
    (message,) = [str(w.message) for w in record]
    name = "ETraceVmap" if vmap else "D_RTRL"
    assert message.startswith(f"{name} learner: called eagerly (outside jit) {WARN_AT} times")
    measured = re.search(r"measured (\d+\.\d) ms per call", message)
    assert measured is not None and float(measured.group(1)) > 0
    assert "brainstate.transform.jit" in message and "etrace_grad" in message
    assert eager_warnings(lambda: [learner(X) for _ in range(3)]) == []  # once per learner
    other = build(vmap=vmap)
    assert len(eager_warnings(lambda: [other(X) for _ in range(WARN_AT)])) == 1  # per learner, not per class


def test_calls_under_transforms_and_drivers_are_not_counted() -> None:
    learner = build()
    step = brainstate.transform.jit(lambda x: learner(x))
    grad = brainstate.transform.grad(lambda: jnp.sum(learner(X)), learner.param_states)
    ys = jnp.zeros((4, 2, 4))

    def run() -> None:
        for _ in range(WARN_AT + 1):
            step(X)
            grad()
            learner.etrace_evolve(jnp.ones((4, 2, 3)))
            learner.etrace_grad(jnp.ones((4, 2, 3)), ys, step_fn=lambda x, y: jnp.mean((learner(x) - y) ** 2))

    assert eager_warnings(run) == []
    vmapped = build(vmap=True)
    mapped_step = brainstate.transform.jit(lambda x: vmapped(x))
    assert eager_warnings(lambda: [mapped_step(X) for _ in range(WARN_AT + 1)]) == []


def test_jit_over_constant_inputs_is_not_counted() -> None:
    learner = build()
    # A new jitted function traces at each call; its input is a constant, the states are traced.
    assert eager_warnings(lambda: [brainstate.transform.jit(lambda: learner(X))() for _ in range(WARN_AT + 1)]) == []
