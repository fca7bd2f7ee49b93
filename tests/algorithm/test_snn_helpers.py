"""The SNN learners' helper states and ``GradExpon``: semantics, resets and argument errors."""

from __future__ import annotations

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.rules.snn_helpers import _ZeroResetState, extract_y_target


def test_presynaptic_trace_leaks_and_accumulates() -> None:
    trace = braintrace.PresynapticTrace(jnp.zeros(3), leak=0.5)
    np.testing.assert_allclose(trace.update(jnp.ones(3)), [1.0, 1.0, 1.0])
    np.testing.assert_allclose(trace.update(jnp.ones(3)), [1.5, 1.5, 1.5])
    assert isinstance(trace, brainstate.ShortTermState)


@pytest.mark.parametrize("leak", [0.0, 1.0, -0.5, 2.0])
def test_presynaptic_trace_rejects_leak_outside_the_open_unit_interval(leak: float) -> None:
    with pytest.raises(ValueError, match="0 < leak < 1"):
        braintrace.PresynapticTrace(jnp.zeros(2), leak=leak)


def test_kappa_filter_is_a_low_pass() -> None:
    filt = braintrace.KappaFilter(jnp.zeros(()), kappa=0.5)
    assert float(filt.update(jnp.ones(()))) == 0.5
    assert float(filt.update(jnp.ones(()))) == 0.75
    assert float(braintrace.KappaFilter(jnp.zeros(()), kappa=0.0).update(jnp.full((), 3.0))) == 3.0


@pytest.mark.parametrize("kappa", [1.0, -0.1, 1.5])
def test_kappa_filter_rejects_kappa_outside_zero_to_one(kappa: float) -> None:
    with pytest.raises(ValueError, match="0 <= kappa < 1"):
        braintrace.KappaFilter(jnp.zeros(()), kappa=kappa)


def test_zero_reset_state_keeps_dtype_and_replaces_the_leading_axis() -> None:
    st = _ZeroResetState(jnp.ones((2, 3), jnp.int32))
    st.reset_state()
    assert st.value.shape == (2, 3) and st.value.dtype == jnp.int32 and not st.value.any()
    st.reset_state(batch_size=5)
    assert st.value.shape == (5, 3)
    scalar = _ZeroResetState(jnp.ones(()))
    scalar.reset_state(batch_size=4)
    assert scalar.value.shape == (4,)
    scalar.reset_state()
    assert scalar.value.shape == ()


def test_fixed_random_feedback_is_fixed_per_key() -> None:
    a = braintrace.FixedRandomFeedback(3, 4, key=0)
    b = braintrace.FixedRandomFeedback(3, 4, key=jax.random.PRNGKey(0))
    c = braintrace.FixedRandomFeedback(3, 4, key=1, init_scale=1.0)
    assert (a.n_target, a.n_layer) == (3, 4) and a.B.shape == (3, 4)
    np.testing.assert_array_equal(a.B, b.B)
    assert not np.allclose(a.B, c.B)
    assert 0.01 < float(jnp.std(a.B)) < 0.3  # init_scale 0.1
    y = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(a.project(y), y @ a.B, rtol=1e-6)
    assert not isinstance(a, brainstate.State)


@pytest.mark.parametrize("shape", [(0, 3), (3, -1), (2.0, 3), (True, 3)])
def test_fixed_random_feedback_rejects_bad_shapes(shape: tuple) -> None:
    with pytest.raises(ValueError, match="positive int"):
        braintrace.FixedRandomFeedback(shape[0], shape[1], key=0)


def test_extract_y_target() -> None:
    assert extract_y_target(()) is None
    assert extract_y_target((1, 2, 3)) == 3
    assert extract_y_target((1, 2, 3), index=0) == 1


def test_grad_expon_leaky_accumulation_over_a_pytree() -> None:
    acc = braintrace.GradExpon({"w": jnp.zeros(2), "q": jnp.zeros(2) * u.mV}, 0.9)
    assert isinstance(acc, brainstate.nn.Module) and isinstance(acc.gradients, brainstate.LongTermState)
    for _ in range(2):
        assert acc.update({"w": jnp.ones(2), "q": jnp.ones(2) * u.mV}) is None
    np.testing.assert_allclose(acc.gradients.value["w"], [1.9, 1.9], rtol=1e-6)
    q = acc.gradients.value["q"]
    assert u.get_unit(q) == u.mV
    np.testing.assert_allclose(u.get_mantissa(q), [1.9, 1.9], rtol=1e-6)
    assert acc.decay == 0.9


def test_grad_expon_time_constant_reads_dt_at_construction() -> None:
    with brainstate.environ.context(dt=0.1 * u.ms):
        acc = braintrace.GradExpon(jnp.zeros(3), 1.0 * u.ms)
    assert acc.decay == pytest.approx(np.exp(-0.1))


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -0.1])
def test_grad_expon_rejects_a_decay_outside_zero_one(bad: float) -> None:
    with pytest.raises(ValueError, match=r"0 < decay < 1.*got " + repr(bad)):
        braintrace.GradExpon(jnp.zeros(1), bad)


@pytest.mark.parametrize("bad", [1, "0.9", None, True, np.float32(0.5)])
def test_grad_expon_rejects_other_types(bad: object) -> None:
    with pytest.raises(TypeError, match="Quantity time constant"):
        braintrace.GradExpon(jnp.zeros(1), bad)
