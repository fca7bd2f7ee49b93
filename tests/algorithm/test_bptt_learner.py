"""``braintrace.BPTT``: backpropagation through time behind the online learners' interface.

References: the suite's BPTT oracle (:func:`tests.algorithm.bptt.bptt_grads`, a Python loop under
one ``grad``) on a recurrence where the online rules are approximate, and D_RTRL's driver on a
leaky model where D_RTRL is exact (mask, reduction and window variants). ``etrace_train`` is
checked against ``etrace_grad`` plus a hand-written SGD step, span by span; bad input, failed
calls, ``check_finite``, vmap and checkpoints against what the online learners do.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import Grads, _to_numpy, bptt_grads, max_rel_err, normal, target_loss
from tests.algorithm.test_sequence_drivers import (
    N_IN, N_REC, T, LeakyReadout, TanhRNN, VmapNet, assert_same_states, data, state_values,
)

#: float32 agreement of two exact gradients computed in different orders.
RTOL = 1e-5
MASKS = {"none": None, "binary": [1.0, 0.0, 1.0, 1.0, 0.0, 1.0], "weighted": [1.0, 0.5, 0.0, 2.0, 0.25, 1.0]}


def build(model: Callable[[], brainstate.nn.Module], algorithm: Any = "bptt", **options: Any) -> Any:
    """A freshly compiled unbatched learner (the compiler's notes about plain weights silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model(), algorithm, jnp.zeros(N_IN), **options)


def assert_close(ref: Grads, got: Any) -> None:
    """Element-wise ``rtol`` 1e-5 (an entry near zero: within 1e-6 of its parameter's largest)."""
    got = _to_numpy(got)
    assert set(ref) == set(got)
    for path in ref:
        np.testing.assert_allclose(got[path], ref[path], rtol=RTOL, atol=1e-6 * np.max(np.abs(ref[path])),
                                   err_msg=str(path))


def sq_fn(learner: Any, window: int | None = None) -> Callable[[Any, Any], jax.Array]:
    """One squared error per step (``(k,)`` per window of ``k`` steps)."""
    if window is None:
        return lambda x, y: jnp.sum((learner(x) - y) ** 2)
    return lambda x, y: jnp.sum((learner(braintrace.MultiStepData(x)) - y.reshape(window, -1)) ** 2, axis=-1)


# --- construction and interface ---------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["bptt", "BPTT", " Bptt ", braintrace.BPTT])
def test_compiled_by_name_or_class(algorithm: Any) -> None:
    learner = build(TanhRNN, algorithm)
    assert type(learner) is braintrace.BPTT and isinstance(learner, braintrace.ETraceAlgorithm)
    assert list(learner.param_states) == [("b",), ("w_in",), ("w_rec",)]
    assert list(learner.hidden_states) == [("h",)]
    assert learner.vjp_method == "multi-step" and learner.is_compiled


def test_a_call_is_one_model_step_and_counts() -> None:
    learner, model = build(TanhRNN), TanhRNN()
    brainstate.nn.init_all_states(model)
    x = normal(3, (N_IN,))
    np.testing.assert_array_equal(learner(x), model(x))
    window = learner(braintrace.MultiStepData(jnp.stack([x, x])))  # the hidden state carries over
    np.testing.assert_allclose(window, jnp.stack([model(x), model(x)]), rtol=1e-6)
    assert window.shape == (2, 1, N_REC) and int(learner.running_index.value) == 2
    learner.reset()
    assert int(learner.running_index.value) == 0
    assert float(jnp.abs(learner.hidden_states[("h",)].value).sum()) == 0.0


def test_no_weight_needs_an_etp_operation() -> None:
    class Plain(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = brainstate.ParamState(normal(0, (N_IN, N_REC)))

        def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
            self.h = brainstate.HiddenState(jnp.zeros(N_REC))

        def update(self, x: Any) -> Any:
            self.h.value = jnp.tanh(0.5 * self.h.value + x @ self.w.value)
            return self.h.value

    with pytest.raises(braintrace.CompilationError):
        build(Plain, "d_rtrl")
    learner = build(Plain)
    xs = data()[0]
    grads = learner.etrace_grad(xs, jnp.arange(T), step_fn=lambda x, t: target_loss(t, learner(x)), reduction="sum")
    assert_close(bptt_grads(Plain(), xs), grads)


def test_refuses_options_and_has_no_traces() -> None:
    with pytest.raises(TypeError, match="BPTT has no option 'vjp_method'"):
        build(TanhRNN, vjp_method="multi-step")
    learner = build(TanhRNN)
    with pytest.raises(TypeError, match="modulator="):
        learner(jnp.zeros(N_IN), modulator=1.0)
    with pytest.raises(ValueError, match="keeps no eligibility traces"):
        learner.get_etrace_of(learner.param_states[("w_in",)])
    assert learner.named_etraces() == {}


# --- the exact gradient -----------------------------------------------------------------------


def test_etrace_grad_equals_the_bptt_oracle_on_a_recurrent_model() -> None:
    xs = data()[0]
    learner = build(TanhRNN)
    grads, losses = learner.etrace_grad(xs, jnp.arange(T), step_fn=lambda x, t: target_loss(t, learner(x)),
                                        reduction="sum", return_value=True)
    reference = bptt_grads(TanhRNN(), xs)
    assert_close(reference, grads)
    assert losses.shape == (T,) and int(learner.running_index.value) == T
    # D_RTRL is approximate on this recurrence: the comparison can fail.
    online = build(TanhRNN, "d_rtrl")
    approx = online.etrace_grad(xs, jnp.arange(T), step_fn=lambda x, t: target_loss(t, online(x)), reduction="sum")
    assert max_rel_err(reference, _to_numpy(approx)) > 1e-2


EXACT_CASES = [(mask, reduction, None) for mask in MASKS for reduction in ("mean", "sum")]
EXACT_CASES += [("binary", "mean", 2), ("weighted", "sum", 2)]


@pytest.mark.parametrize("mask, reduction, window", EXACT_CASES, ids=[f"{m}-{r}-{w}" for m, r, w in EXACT_CASES])
def test_etrace_grad_equals_d_rtrl_where_d_rtrl_is_exact(mask: str, reduction: str, window: int | None) -> None:
    xs, ys = data()
    bptt = build(LeakyReadout)
    online = build(LeakyReadout, "d_rtrl", vjp_method="multi-step" if window else "single-step")
    kwargs: dict[str, Any] = dict(mask=MASKS[mask], reduction=reduction, chunk_size=window, return_value=True,
                                  loss_output="scalar")
    g_bptt, j_bptt = bptt.etrace_grad(xs, ys, step_fn=sq_fn(bptt, window), **kwargs)
    g_online, j_online = online.etrace_grad(xs, ys, step_fn=sq_fn(online, window), **kwargs)
    assert_close(_to_numpy(g_online), g_bptt)
    np.testing.assert_allclose(j_bptt, j_online, rtol=1e-6)
    after, online_after = state_values(bptt), state_values(online)  # the same run: the same states
    assert_same_states(after, {key: online_after[key] for key in after}, exact=False)


def test_return_arities_aux_and_a_weight_subset_are_the_online_drivers() -> None:
    xs, ys = data()
    bptt, online = build(LeakyReadout), build(LeakyReadout, "d_rtrl")

    def aux_fn(learner: Any) -> Callable[[Any, Any], Any]:
        def step_fn(x: Any, y: Any) -> Any:
            out = learner(x)
            return jnp.sum((out - y) ** 2), {"out": out}
        return step_fn

    subset = {("w",): bptt.param_states[("w",)]}
    grads, losses, aux = bptt.etrace_grad(xs, ys, step_fn=aux_fn(bptt), has_aux=True, return_value=True,
                                          loss_output="masked", mask=MASKS["binary"], weights=subset)
    _, ref_losses, ref_aux = online.etrace_grad(xs, ys, step_fn=aux_fn(online), has_aux=True, return_value=True,
                                                loss_output="masked", mask=MASKS["binary"])
    assert list(grads) == [("w",)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    np.testing.assert_allclose(aux["out"], ref_aux["out"], rtol=1e-6)
    assert aux["out"].shape == (T, N_REC)


def test_the_gradient_starts_at_the_call_from_the_current_states() -> None:
    xs, ys = data()
    learner = build(LeakyReadout)
    learner.etrace_evolve(xs[:2])
    grads = learner.etrace_grad(xs[2:], ys[2:], step_fn=sq_fn(learner), reduction="sum")
    model = LeakyReadout()  # by hand: two steps run, then BPTT of the rest from the state they left
    brainstate.nn.init_all_states(model)
    for t in range(2):
        model(xs[t])
    params = model.states(brainstate.ParamState)

    def rest() -> jax.Array:
        return sum(jnp.sum((model(xs[t]) - ys[t]) ** 2) for t in range(2, T))

    assert_close(_to_numpy(brainstate.transform.grad(rest, params)()), grads)
    # Unlike an exact online learner's trace, nothing reaches back into the steps of earlier calls.
    online = build(LeakyReadout, "d_rtrl")
    online.etrace_evolve(xs[:2])
    carried = online.etrace_grad(xs[2:], ys[2:], step_fn=sq_fn(online), reduction="sum")
    assert max_rel_err(_to_numpy(carried), _to_numpy(grads)) > 1e-2


# --- etrace_train: truncated BPTT -------------------------------------------------------------


def _sgd(learner: Any, grads: Any, lr: float) -> None:
    for path, st in learner.param_states.items():
        st.value = jax.tree.map(lambda w, g: w - lr * g, st.value, grads[path])


@pytest.mark.parametrize("update_every", [None, 2, 4], ids=["once", "every2", "every4-with-tail"])
def test_etrace_train_is_etrace_grad_and_sgd_span_by_span(update_every: int | None) -> None:
    xs, ys = data()
    trained, by_hand = build(TanhRNN), build(TanhRNN)
    result = trained.etrace_train(xs, ys, step_fn=sq_fn(trained), optimizer=braintools.optim.SGD(lr=0.05),
                                  update_every=update_every)
    span = update_every or T
    losses = []
    for start in range(0, T, span):
        grads, part = by_hand.etrace_grad(xs[start:start + span], ys[start:start + span], step_fn=sq_fn(by_hand),
                                          return_value=True)
        _sgd(by_hand, grads, 0.05)
        losses.append(part)
    np.testing.assert_allclose(result.losses, jnp.concatenate(losses), rtol=1e-6)
    assert_same_states(state_values(trained), state_values(by_hand), exact=False)


# --- errors, failures, non-finite values ------------------------------------------------------


BAD_CALLS: dict[str, tuple[Callable[[Any], Any], type[Exception]]] = {
    "reduction": (lambda l: l.etrace_grad(*data(), step_fn=sq_fn(l), reduction="avg"), ValueError),
    "chunk_size": (lambda l: l.etrace_grad(*data(), step_fn=sq_fn(l), chunk_size=0), ValueError),
    "ragged": (lambda l: l.etrace_grad(data()[0], data(5)[1], step_fn=sq_fn(l)), ValueError),
    "mask": (lambda l: l.etrace_grad(*data(), step_fn=sq_fn(l), mask=jnp.ones(3)), ValueError),
    "no-call": (lambda l: l.etrace_grad(*data(), step_fn=lambda x, y: jnp.sum(x)), ValueError),
    "two-calls": (lambda l: l.etrace_grad(*data(), step_fn=lambda x, y: jnp.sum(l(x) + l(x))), ValueError),
    "loss-shape": (lambda l: l.etrace_grad(*data(), step_fn=lambda x, y: l(x) - y), ValueError),
    "window-ragged": (lambda l: l.etrace_grad(*data(), step_fn=sq_fn(l, 4), chunk_size=4), ValueError),
    "update_every": (lambda l: l.etrace_train(*data(), step_fn=sq_fn(l), optimizer=braintools.optim.SGD(0.1),
                                              update_every=0), ValueError),
    "marker": (lambda l: l.etrace_evolve(braintrace.MultiStepData(data()[0])), TypeError),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_refused_as_the_online_drivers_refuse_it(case: str) -> None:
    call, error = BAD_CALLS[case]
    bptt, online = build(TanhRNN), build(TanhRNN, "d_rtrl", vjp_method="multi-step")
    before = state_values(bptt)
    with pytest.raises(error) as got:
        call(bptt)
    with pytest.raises(error) as expected:
        call(online)
    assert str(got.value) == str(expected.value)
    assert_same_states(state_values(bptt), before)


@pytest.mark.parametrize("call", ["etrace_grad", "etrace_train"])
def test_a_failed_call_leaves_every_state_as_it_was(call: str) -> None:
    xs, ys = data()
    learner = build(TanhRNN)
    learner.etrace_evolve(xs[:2])
    before = state_values(learner)

    def failing(x: Any, y: Any) -> Any:
        learner(x)
        raise RuntimeError("step_fn failed")

    options: dict[str, Any] = {"optimizer": braintools.optim.SGD(lr=0.1)} if call == "etrace_train" else {}
    with pytest.raises(RuntimeError, match="step_fn failed"):
        getattr(learner, call)(xs, ys, step_fn=failing, **options)
    assert_same_states(state_values(learner), before)
    fresh = build(TanhRNN)
    fresh.etrace_evolve(xs[:2])
    expected = fresh.etrace_grad(xs, ys, step_fn=sq_fn(fresh))
    assert max_rel_err(_to_numpy(expected), _to_numpy(learner.etrace_grad(xs, ys, step_fn=sq_fn(learner)))) == 0.0


def test_check_finite_stops_at_the_first_bad_step() -> None:
    xs, ys = data()
    bad = xs.at[3].set(jnp.nan)
    learner, reference = build(TanhRNN), build(TanhRNN)
    with pytest.raises(braintrace.NonFiniteError) as err:
        learner.etrace_grad(bad, ys, step_fn=sq_fn(learner), check_finite=True)
    assert (err.value.step, err.value.what) == (3, "input")
    reference.etrace_evolve(xs[:3])
    assert_same_states(state_values(learner), state_values(reference))
    grads = learner.etrace_grad(xs, ys, step_fn=sq_fn(learner), check_finite=True)  # finite: no error
    assert all(np.isfinite(v).all() for v in _to_numpy(grads).values())


# --- vmap, checkpoints ------------------------------------------------------------------------


def test_vmapped_bptt_equals_the_batched_learner() -> None:
    batch = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        vmapped = braintrace.compile(VmapNet(), "bptt", jnp.zeros((batch, N_IN)), batch_size=batch, vmap=True)
        batched = braintrace.compile(VmapNet(), "bptt", jnp.zeros((batch, N_IN)), batch_size=batch)
    xs, ys = normal(30, (T, batch, N_IN)), normal(31, (T, batch, 2))
    g_vmap = vmapped.etrace_grad(xs, ys, step_fn=lambda x, y: jnp.sum((vmapped(x) - y) ** 2), reduction="sum")
    g_batch = batched.etrace_grad(xs, ys, step_fn=lambda x, y: jnp.sum((batched(x) - y) ** 2), reduction="sum")
    assert isinstance(vmapped, braintrace.ETraceVmap) and isinstance(vmapped.module, braintrace.BPTT)
    assert_close(_to_numpy(g_batch), g_vmap)


def test_checkpoints_resume_a_bptt_learner(tmp_path: Any) -> None:
    xs, ys = data()
    learner = build(TanhRNN)
    result = learner.etrace_train(xs[:3], ys[:3], step_fn=sq_fn(learner), optimizer=braintools.optim.Adam(lr=0.01))
    path = braintrace.save_checkpoint(os.path.join(tmp_path, "bptt.ckpt"), learner, optimizer=result.optimizer)
    resumed = build(TanhRNN)
    optimizer = braintools.optim.Adam(lr=0.01)
    optimizer.register_trainable_weights(resumed.param_states)
    braintrace.load_checkpoint(path, resumed, optimizer=optimizer)
    assert_same_states(state_values(resumed), state_values(learner))
    a = learner.etrace_train(xs[3:], ys[3:], step_fn=sq_fn(learner), optimizer=result.optimizer)
    b = resumed.etrace_train(xs[3:], ys[3:], step_fn=sq_fn(resumed), optimizer=optimizer)
    np.testing.assert_array_equal(a.losses, b.losses)
    assert_same_states(state_values(resumed), state_values(learner))
