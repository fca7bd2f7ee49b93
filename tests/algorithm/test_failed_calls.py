"""A failed driver call leaves every state as it was, whatever failed and wherever.

Failures are injected at each stage of ``etrace_grad`` and ``etrace_train``: the user's
``step_fn`` raising after the learner's call, a JAX tracer error in ``step_fn`` (Python control
flow on a traced value), the learner's own post-gradient hook, and (``etrace_train``) the
optimizer's update. After each, the weights, hidden states, traces and counters are those of
before the call, bit for bit, and the learner goes on as a fresh one would.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.algorithm.test_sequence_drivers import assert_same_states, data, make, plain_fn, state_values


class Injected(Exception):
    """The failure a test plants."""


def _raising_step_fn(learner: Any) -> Callable[..., Any]:
    def step_fn(x: Any, y: Any) -> Any:
        learner(x)
        raise Injected("step_fn failed")
    return step_fn


def _tracer_error_step_fn(learner: Any) -> Callable[..., Any]:
    def step_fn(x: Any, y: Any) -> Any:
        out = learner(x)
        if jnp.sum(out) > 0:  # a traced value in Python control flow
            return jnp.sum(out ** 2)
        return jnp.sum(out)
    return step_fn


def _raising_optimizer() -> optax.GradientTransformation:
    def update(updates: Any, state: Any, params: Any = None) -> Any:
        raise Injected("optimizer update failed")
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


#: ``(driver, stage)``: only etrace_train runs an optimizer.
CASES = [(call, stage) for call in ("etrace_grad", "etrace_train") for stage in ("step_fn", "tracer", "after_gradient")]
CASES.append(("etrace_train", "optimizer"))


def _weights(learner: Any) -> dict[Any, np.ndarray]:
    return {path: np.asarray(leaf) for path, st in learner.param_states.items() for leaf in jax.tree.leaves(st.value)}


@pytest.mark.parametrize("call, stage", CASES, ids=[f"{c}-{s}" for c, s in CASES])
def test_a_failure_at_any_stage_leaves_every_state_as_it_was(
    call: str, stage: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    xs, ys = data()
    learner, fresh = make(), make()
    for each in (learner, fresh):
        each.etrace_evolve(xs[:2])
    for path, st in learner.param_states.items():  # the two start from the same weights
        st.value = fresh.param_states[path].value
    before, weights = state_values(learner), _weights(learner)
    step_fn = plain_fn(learner)
    optimizer: Any = optax.sgd(0.1)
    expected: type[BaseException] = Injected
    if stage == "step_fn":
        step_fn = _raising_step_fn(learner)
    elif stage == "tracer":
        step_fn, expected = _tracer_error_step_fn(learner), jax.errors.TracerBoolConversionError
    elif stage == "after_gradient":
        def fail(grads: Any) -> None:
            raise Injected("after the gradient")
        monkeypatch.setattr(learner, "_seq_after_gradient", fail)
    else:
        optimizer = _raising_optimizer()
    options = {"optimizer": optimizer} if call == "etrace_train" else {}
    with pytest.raises(expected):
        getattr(learner, call)(xs, ys, step_fn=step_fn, **options)
    assert_same_states(before, state_values(learner))
    assert all(np.array_equal(v, weights[k]) for k, v in _weights(learner).items())
    monkeypatch.undo()
    # Still usable: the same call on clean terms gives what a learner that never failed gives.
    got = learner.etrace_grad(xs[2:], ys[2:], step_fn=plain_fn(learner))
    want = fresh.etrace_grad(xs[2:], ys[2:], step_fn=plain_fn(fresh))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
