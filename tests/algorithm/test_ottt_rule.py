"""OTTT as a rule record: ``ottt_rule`` run by the RuleLearner equals the OTTT engine.

Pinned (float64, element-wise at every step to 1e-10 unless noted):

* the record on the RuleLearner equals the engine, in its exact regime (where the engine leaves
  the weight out of the one-step VJP and reads its whole estimate off the new trace) and outside
  it (a ``tanh`` layer, a vanilla recurrent cell), with a ``weight_fn``, batched and not, both
  modes; in float32 to 1e-5;
* in the exact regime both equal BPTT; a record with another leak (the negative control) does not;
* the carriers are the presynaptic trace and the scalar bias companion (as the engine keeps
  it), and a reset with a batch size resizes the trace and keeps the companion a scalar;
* a relation outside the scope (not dense, a group of two states) is refused at init.
"""

from __future__ import annotations

import brainstate
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.rules.ottt import PresynapticCarrier, ottt_rule
from tests.algorithm.bptt import bptt_grads, max_rel_err, per_step_grads, single_step_grads, x64
from tests.algorithm.dense_leak_models import (
    LAM,
    N_HID,
    N_IN,
    ElementWiseLeak,
    LeakyLinear,
    LeakyTanh,
    TwoState,
    assert_same_steps,
    compile_,
    inputs,
    vanilla_cell,
)

__all__ = ["x64"]  # the fixture is used by name

T, B = 4, 2
EXACT = dict(rtol=1e-10, atol=1e-12)

MODELS = {
    "leaky": (LeakyLinear, B),
    "leaky unbatched": (LeakyLinear, None),
    "leaky weight_fn": (lambda: LeakyLinear(hook=True), B),
    "tanh": (LeakyTanh, B),
    "vanilla cell": (vanilla_cell, B),
}


def _engine_and_record(model: str, mode: str) -> tuple[dict, dict]:
    make, batch = MODELS[model]
    xs = inputs(T, batch)
    engine = per_step_grads(compile_(make(), braintrace.OTTT, xs[0], batch, mode=mode, leak=LAM), xs)
    return engine, per_step_grads(compile_(make(), ottt_rule(LAM, mode), xs[0], batch), xs)


# The vanilla cell's float64 case is heavier (its float32 run is the default suite's check).
@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m == "vanilla cell" else m for m in MODELS])
def test_the_record_equals_the_engine_step_by_step(x64: None, model: str) -> None:
    engine, record = _engine_and_record(model, "A")
    assert_same_steps(engine, record, **EXACT)


def test_mode_o_the_record_equals_the_engine(x64: None) -> None:
    engine, record = _engine_and_record("tanh", "O")
    assert_same_steps(engine, record, **EXACT)


def test_the_record_equals_the_engine_in_float32() -> None:
    engine, record = _engine_and_record("vanilla cell", "A")
    assert_same_steps(engine, record, rtol=1e-5, atol=1e-6)


def test_in_the_exact_regime_both_equal_bptt_and_another_leak_does_not(x64: None) -> None:
    xs = inputs(T, B)
    engine = compile_(LeakyLinear(), braintrace.OTTT, xs[0], B, leak=LAM)
    # The engine's covered branch: the weight is left out of the one-step VJP.
    assert engine._local_relation_weights().paths == {("w",), ("b",)}
    ref = bptt_grads(LeakyLinear(), xs, batch_size=B)
    assert max_rel_err(ref, single_step_grads(engine, xs)) < 1e-10
    record = single_step_grads(compile_(LeakyLinear(), ottt_rule(LAM), xs[0], B), xs)
    assert max_rel_err(ref, record) < 1e-10
    other = single_step_grads(compile_(LeakyLinear(), ottt_rule(0.5), xs[0], B), xs)
    assert max_rel_err(ref, other) > 1e-2


def test_the_carriers_and_a_reset() -> None:
    xs = inputs(T, B)
    learner = compile_(LeakyLinear(), ottt_rule(0.5), xs[0], B)
    brainstate.transform.jit(lambda: [learner(xs[t]) for t in range(2)])()
    (carrier,) = learner.get_etrace_of(("w",)).values()
    assert isinstance(carrier, PresynapticCarrier) and carrier.bias is not None
    np.testing.assert_allclose(carrier.x, 0.5 * xs[0] + xs[1], rtol=1e-6)
    np.testing.assert_allclose(carrier.bias, 1.5)
    learner.reset()
    (carrier,) = learner.get_etrace_of(("w",)).values()
    assert carrier.x.shape == (B, N_IN) and carrier.bias.shape == () and not np.any(carrier.x)
    assert learner(xs[0]).shape == (B, N_HID)  # the reset traces are the compiled ones
    learner.reset_state(batch_size=B + 1)
    (carrier,) = learner.get_etrace_of(("w",)).values()
    assert carrier.x.shape == (B + 1, N_IN) and carrier.bias.shape == ()
    learner.reset_state(batch_size=B)  # back at the compiled size, the learner runs again
    assert learner(xs[0]).shape == (B, N_HID)


def test_a_relation_outside_the_scope_is_refused_at_init() -> None:
    x0 = inputs(1, B)[0]
    with pytest.raises(NotImplementedError, match="ottt_rule supports dense matmul.*etp_elemwise.*D_RTRL"):
        compile_(ElementWiseLeak(), ottt_rule(LAM), x0, B)
    with pytest.raises(ValueError, match="ottt_rule requires hidden groups with one state.*num_state == 2"):
        compile_(TwoState(), ottt_rule(LAM), x0, B)


@pytest.mark.parametrize("args, match", [
    ((1.0,), "leak must be a number with 0 < leak < 1"),
    ((True,), "leak must be a number"),
    ((LAM, "B"), r"mode must be one of \['A', 'O'\], got 'B'"),
])
def test_bad_arguments_are_refused(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=f"ottt_rule: {match}"):
        ottt_rule(*args)


def test_solve_needs_the_relation_of_its_step() -> None:
    rule = ottt_rule(LAM)
    carrier = PresynapticCarrier(jnp.ones((B, N_IN)), None)
    step = braintrace.RelationStep(x=jnp.ones((B, N_IN)), df=jnp.ones((B, N_HID, 1)),
                                   diag=jnp.ones((B, N_HID, 1, 1)), weights={"weight": jnp.ones((N_IN, N_HID))})
    with pytest.raises(ValueError, match="names no relation"):
        rule.solve(carrier, jnp.ones((B, N_HID, 1)), step)
