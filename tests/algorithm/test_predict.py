"""``learner.predict``: the model run forward from fresh states, at any batch size, state untouched.

Reference: the model run step by step by hand from ``init_all_states(batch_size=n)`` with the
learner's weights. Checked for a D_RTRL and a BPTT learner compiled at batch 32 (at batch 5 and
37, and on one unbatched sequence), and for a vmapped learner; every state of the learner
(weights, hidden states, traces, counters) is the same before and after, bit for bit, and the
same state objects; a second call at the same shapes does not trace again.
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
from tests.algorithm.bptt import normal
from tests.algorithm.test_sequence_drivers import N_IN, T, VmapNet, assert_same_states, state_values

COMPILED_BATCH = 32


def build(algorithm: str, batch: int = COMPILED_BATCH, vmap: bool = False) -> Any:
    """A learner of :class:`VmapNet` (a ValinaRNNCell read out by a plain weight) at ``batch``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(VmapNet(), algorithm, jnp.zeros((batch, N_IN)), batch_size=batch, vmap=vmap)


def by_hand(learner: Any, xs: Any, batch: int | None) -> np.ndarray:
    """The model with ``learner``'s weights, from ``init_all_states(batch_size=batch)``, step by step."""
    model = VmapNet()
    brainstate.nn.init_all_states(model, batch_size=batch)
    for path, st in model.states(brainstate.ParamState).items():
        st.value = learner.param_states[path].value
    return np.stack([np.asarray(model(xs[t])) for t in range(xs.shape[0])])


def trained(algorithm: str, vmap: bool = False) -> Any:
    """A learner driven a few steps, so that its hidden states and traces are not at their start."""
    learner = build(algorithm, 2 if vmap else COMPILED_BATCH, vmap)
    batch = 2 if vmap else COMPILED_BATCH
    learner.etrace_grad(normal(40, (3, batch, N_IN)), step_fn=lambda x: jnp.sum(learner(x) ** 2))
    return learner


def objects(learner: Any) -> list[int]:
    return [id(st) for st in learner.states().values()]


@pytest.mark.parametrize("algorithm", ["d_rtrl", "bptt"])
@pytest.mark.parametrize("batch", [5, 37])
def test_predict_equals_the_model_run_by_hand_at_any_batch_size(algorithm: str, batch: int) -> None:
    learner = trained(algorithm)
    before, ids = state_values(learner), objects(learner)
    xs = normal(41, (T, batch, N_IN))
    outputs = learner.predict(xs)
    np.testing.assert_allclose(outputs, by_hand(learner, xs, batch), rtol=1e-5, atol=1e-6)
    assert outputs.shape == (T, batch, 2)
    assert_same_states(state_values(learner), before)
    assert objects(learner) == ids


def test_d_rtrl_and_bptt_predict_the_same_and_one_unbatched_sequence() -> None:
    online, bptt = build("d_rtrl"), build("bptt")
    xs = normal(42, (T, 5, N_IN))
    np.testing.assert_allclose(online.predict(xs), bptt.predict(xs), rtol=1e-6)
    single = online.predict(xs[:, 0])
    assert single.shape == (T, 2)
    np.testing.assert_allclose(single, by_hand(online, xs[:, 0], None), rtol=1e-5, atol=1e-6)


def test_a_learner_after_predict_trains_as_one_that_never_predicted() -> None:
    a, b = build("d_rtrl"), build("d_rtrl")
    a.predict(normal(43, (T, 7, N_IN)))
    xs = normal(44, (T, COMPILED_BATCH, N_IN))
    ga = a.etrace_grad(xs, step_fn=lambda x: jnp.sum(a(x) ** 2))
    gb = b.etrace_grad(xs, step_fn=lambda x: jnp.sum(b(x) ** 2))
    for path in ga:
        jax.tree.map(np.testing.assert_array_equal, ga[path], gb[path])
    assert_same_states(state_values(a), state_values(b))


def test_one_program_per_batch_size() -> None:
    learner = build("d_rtrl")
    traced = []

    def readout(x: Any) -> Any:
        traced.append(x.shape)
        return {"y": learner(x), "norm": jnp.sum(learner.hidden_states[("cell", "h")].value ** 2, axis=-1)}

    xs = normal(45, (T, 5, N_IN))
    first = learner.predict(xs, step_fn=readout)
    after_first = len(traced)
    second = learner.predict(xs + 1.0, step_fn=readout)
    assert len(traced) == after_first > 0  # the same shapes: no new trace
    assert first["y"].shape == (T, 5, 2) and first["norm"].shape == (T, 5)
    assert not np.allclose(first["y"], second["y"])
    learner.predict(normal(46, (T, 9, N_IN)), step_fn=readout)
    assert len(traced) > after_first  # a new batch size: one new program
    calls = learner.calls_traced  # without step_fn: the learner counts the calls traced
    learner.predict(xs)
    assert learner.calls_traced > calls
    calls = learner.calls_traced
    learner.predict(xs * 2.0)
    assert learner.calls_traced == calls


def test_step_fn_output_and_time_axis() -> None:
    learner = build("bptt")
    xs = normal(47, (5, T, N_IN))  # batch-major
    outputs = learner.predict(xs, step_fn=lambda x: (learner(x), x.sum(axis=-1)), time_axis=1)
    assert outputs[0].shape == (5, T, 2) and outputs[1].shape == (5, T)
    np.testing.assert_allclose(outputs[0], np.swapaxes(by_hand(learner, jnp.swapaxes(xs, 0, 1), 5), 0, 1),
                               rtol=1e-5, atol=1e-6)


def test_a_vmapped_learner_maps_the_model_over_any_batch() -> None:
    vmapped, batched = trained("d_rtrl", vmap=True), build("d_rtrl")
    before, ids = state_values(vmapped), objects(vmapped)
    for batch in (5, 37):
        xs = normal(48, (T, batch, N_IN))
        np.testing.assert_allclose(vmapped.predict(xs), batched.predict(xs), rtol=1e-5, atol=1e-6)
    one = normal(49, (T, N_IN))
    np.testing.assert_allclose(vmapped.predict(one), by_hand(vmapped, one, None), rtol=1e-5, atol=1e-6)
    assert_same_states(state_values(vmapped), before)
    assert objects(vmapped) == ids


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("time_axis", [2, -1, True, 1.0, "1"])
def test_a_bad_time_axis_is_named(time_axis: Any) -> None:
    with pytest.raises(ValueError, match=f"time_axis must be 0 .* got {time_axis!r}"):
        build("d_rtrl").predict(normal(50, (T, 5, N_IN)), time_axis=time_axis)


def test_bad_step_functions_and_shapes_are_refused_leaving_the_learner_as_it_was() -> None:
    learner = trained("d_rtrl")
    before = state_values(learner)
    xs = normal(51, (T, 5, N_IN))
    with pytest.raises(TypeError, match="step_fn must be a function"):
        learner.predict(xs, step_fn="readout")
    with pytest.raises(ValueError, match="step_fn did not call this learner"):
        learner.predict(xs, step_fn=lambda x: x)
    with pytest.raises(ValueError, match=r"a step of the first sequence has shape \(5, 4\)"):
        learner.predict(normal(52, (T, 5, N_IN + 1)))

    def failing(x: Any) -> Any:
        learner(x)
        raise RuntimeError("readout failed")

    with pytest.raises(RuntimeError, match="readout failed"):
        learner.predict(xs, step_fn=failing)
    assert_same_states(state_values(learner), before)
    np.testing.assert_allclose(learner.predict(xs), by_hand(learner, xs, 5), rtol=1e-5, atol=1e-6)
