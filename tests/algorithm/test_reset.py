"""``learner.reset()``: the model's states re-initialised in place, traces and counters zero."""

from __future__ import annotations

from typing import Any

import brainstate
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import normal

B, I, H = 3, 2, 4


class InitOnly(brainstate.nn.Module):
    """Hidden states created by ``init_state`` only (no ``reset_state``): the usual trap."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (I, H), 0.5))
        self.cells = [braintrace.nn.ValinaRNNCell(H, H)]

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(normal(1, (batch_size or 1, H), 0.3))

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
        return self.cells[0](self.h.value)


def _compiled() -> tuple[Any, InitOnly]:
    model = InitOnly()
    learner = braintrace.compile(model, braintrace.D_RTRL, normal(2, (B, I)), batch_size=B)
    return learner, model


def _snapshot(learner: Any) -> dict[Any, np.ndarray]:
    return {p: np.asarray(st.value) for p, st in learner.hidden_states.items()}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_reset_restores_the_initial_states_into_the_compiled_state_objects(jit: bool) -> None:
    learner, model = _compiled()
    initial, objects = _snapshot(learner), dict(learner.hidden_states)
    xs = normal(3, (4, B, I))
    step = brainstate.transform.jit(lambda x: learner(x))
    fresh = [np.asarray(step(x)) for x in xs]
    assert int(learner.running_index.value) == 4

    def reset() -> None:
        learner.reset()

    brainstate.transform.jit(reset)() if jit else reset()
    assert all(model.states()[p] is st for p, st in objects.items()), "the compiled state objects stay in the model"
    for p, v in _snapshot(learner).items():
        np.testing.assert_array_equal(v, initial[p])
    assert int(learner.running_index.value) == 0
    assert all(not np.any(np.asarray(t)) for st in learner.etrace_bwg.values() for t in st.value.values())
    again = [np.asarray(step(x)) for x in xs]  # the same run from the same start
    for a, b in zip(fresh, again):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_reset_keeps_the_parameters() -> None:
    learner, _ = _compiled()
    learner(normal(3, (B, I)))
    before = {p: np.asarray(st.value) for p, st in learner.param_states.items()}
    learner.reset()
    for p, st in learner.param_states.items():
        np.testing.assert_array_equal(np.asarray(st.value), before[p])


def test_reset_to_another_batch_size_is_refused_with_the_fix() -> None:
    learner, _ = _compiled()
    learner(normal(1, (B, I)))
    before = _snapshot(learner)
    with pytest.raises(ValueError, match="learner.reset"):
        learner.reset(batch_size=5)
    after = _snapshot(learner)  # the refused reset changed nothing, and the learner still runs
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    learner(normal(2, (B, I)))


def test_a_vmapped_learner_resets_every_lane_in_place() -> None:
    vmapped = braintrace.compile(braintrace.nn.ValinaRNNCell(I, H), braintrace.D_RTRL, normal(2, (B, I)),
                                 batch_size=B, vmap=True)
    xs = normal(3, (2, B, I))
    step = brainstate.transform.jit(lambda x: vmapped(x))
    first = [np.asarray(step(x)) for x in xs]
    objects = dict(vmapped.hidden_states)
    brainstate.transform.jit(vmapped.reset)()
    assert all(vmapped.hidden_states[p] is st for p, st in objects.items())
    assert not np.any(np.asarray(vmapped.hidden_states[("h",)].value))
    assert vmapped.hidden_states[("h",)].value.shape == (B, H)
    for a, x in zip(first, xs):  # the same run again from the reset states
        np.testing.assert_allclose(np.asarray(step(x)), a, rtol=1e-6)
