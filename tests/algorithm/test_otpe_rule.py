"""OTPE as a rule record: ``otpe_rule`` run by the RuleLearner equals the OTPE engine.

Pinned (float64, element-wise at every step to 1e-10 unless noted):

* the record on the RuleLearner equals the engine in every mode (``'full'``, ``'full'`` with a
  clip that binds, ``'approx'``), in its exact regime and outside it (a vanilla recurrent cell),
  with a ``weight_fn``, batched and not; in float32 to 1e-5;
* in the exact regime (``D ≡ λ``) the full record equals BPTT; one with another leak (the
  negative control) does not;
* the carriers hold what the engine's stores hold, and a reset keeps them at the compiled batch size;
* a relation outside the scope (not dense, a group of two states) is refused at init.
"""

from __future__ import annotations

from typing import Any

import brainstate
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.rules.otpe import FactoredTrace, PostsynapticTrace, otpe_rule
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
    "tanh": (LeakyTanh, B),
    "tanh unbatched": (LeakyTanh, None),
    "leaky weight_fn": (lambda: LeakyLinear(hook=True), B),
    "vanilla cell": (vanilla_cell, B),
}
#: A clip that binds on these models from the second step on.
CLIP = 0.3
MODES: dict[str, dict[str, Any]] = {"full": {}, "clipped": {"trace_clip_abs": CLIP}, "approx": {"mode": "approx"}}


def _engine_and_record(model: str, options: dict[str, Any]) -> tuple[dict, dict]:
    make, batch = MODELS[model]
    xs = inputs(T, batch)
    engine = per_step_grads(compile_(make(), braintrace.OTPE, xs[0], batch, leak=LAM, **options), xs)
    return engine, per_step_grads(compile_(make(), otpe_rule(LAM, **options), xs[0], batch), xs)


# The vanilla cell's float64 case is heavier (its float32 run is the default suite's check).
@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m == "vanilla cell" else m for m in MODELS])
def test_the_full_record_equals_the_engine_step_by_step(x64: None, model: str) -> None:
    engine, record = _engine_and_record(model, {})
    assert_same_steps(engine, record, **EXACT)


@pytest.mark.parametrize("mode", ["clipped", "approx"])
def test_the_other_modes_equal_the_engine(x64: None, mode: str) -> None:
    engine, record = _engine_and_record("tanh", MODES[mode])
    assert_same_steps(engine, record, **EXACT)


def test_the_clip_binds() -> None:
    xs = inputs(T, B)
    learner = compile_(LeakyTanh(), otpe_rule(LAM), xs[0], B)
    brainstate.transform.jit(lambda: [learner(xs[t]) for t in range(T)])()
    (carrier,) = learner.get_etrace_of(("w",)).values()
    assert np.max(np.abs(carrier.R)) > CLIP


def test_the_record_equals_the_engine_in_float32() -> None:
    engine, record = _engine_and_record("vanilla cell", {})
    assert_same_steps(engine, record, rtol=1e-5, atol=1e-6)


def test_where_d_is_the_leak_the_record_equals_bptt_and_another_leak_does_not(x64: None) -> None:
    xs = inputs(T, B)
    ref = bptt_grads(LeakyTanh(), xs, batch_size=B)
    assert max_rel_err(ref, single_step_grads(compile_(LeakyTanh(), otpe_rule(LAM), xs[0], B), xs)) < 1e-10
    other = single_step_grads(compile_(LeakyTanh(), otpe_rule(0.5), xs[0], B), xs)
    assert max_rel_err(ref, other) > 1e-2


def test_the_carriers_and_a_reset() -> None:
    xs = inputs(T, B)
    full = compile_(LeakyLinear(), otpe_rule(LAM), xs[0], B)
    (carrier,) = full.get_etrace_of(("w",)).values()
    assert isinstance(carrier, PostsynapticTrace) and carrier.R.shape == (B, N_IN, N_HID)
    assert carrier.R_b is not None and carrier.R_b.shape == (B, N_HID)
    approx = compile_(LeakyLinear(), otpe_rule(LAM, "approx"), xs[0], B)
    brainstate.transform.jit(lambda: [approx(xs[t]) for t in range(2)])()
    (carrier,) = approx.get_etrace_of(("w",)).values()
    assert isinstance(carrier, FactoredTrace)
    np.testing.assert_allclose(carrier.Rx, LAM * xs[0] + xs[1], rtol=1e-6)
    np.testing.assert_allclose(carrier.Rg, np.full((B, N_HID), LAM + 1), rtol=1e-6)  # df ≡ 1
    approx.reset()
    (carrier,) = approx.get_etrace_of(("w",)).values()
    assert carrier.Rx.shape == (B, N_IN) and not np.any(carrier.Rx)
    assert approx(xs[0]).shape == (B, N_HID)


def test_a_relation_outside_the_scope_is_refused_at_init() -> None:
    x0 = inputs(1, B)[0]
    with pytest.raises(NotImplementedError, match="otpe_rule supports dense matmul.*etp_elemwise.*D_RTRL"):
        compile_(ElementWiseLeak(), otpe_rule(LAM), x0, B)
    with pytest.raises(ValueError, match="otpe_rule requires hidden groups with one state.*num_state == 2"):
        compile_(TwoState(), otpe_rule(LAM), x0, B)


@pytest.mark.parametrize("args, options, match", [
    ((0.0,), {}, "leak must be a number with 0 < leak < 1"),
    ((LAM, "exact"), {}, r"mode must be one of \['full', 'approx'\], got 'exact'"),
    ((LAM,), {"trace_clip_abs": -1.0}, "trace_clip_abs must be a positive number or None"),
    ((LAM,), {"trace_clip_abs": True}, "trace_clip_abs must be a positive number"),
])
def test_bad_arguments_are_refused(args: tuple, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"otpe_rule: {match}"):
        otpe_rule(*args, **options)
