"""``IF``, ``LIF``, ``ALIF`` without brainpy: closed forms, spikes and resets, units, shapes, resets.

Closed forms of one exponential-Euler step: ``V ← V + (1 − e^{−dt/τ}) (V_∞ − V)``, so from
``V_0`` under a constant input ``V_n = V_∞ + (V_0 − V_∞) e^{−n dt/τ}``.
"""

from __future__ import annotations

from typing import Any

import brainstate
import braintools
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace

nn = braintrace.nn
DT = 1.0 * u.ms


def mV(q: Any) -> np.ndarray:
    return np.asarray(u.get_mantissa(q.to(u.mV)))


def run(layer: Any, x: Any, steps: int) -> list[Any]:
    with brainstate.environ.context(dt=DT):
        return [layer(x) for _ in range(steps)]


def test_lif_relaxes_to_rest_plus_r_times_i_in_closed_form() -> None:
    lif = nn.LIF(3, R=2.0 * u.ohm, tau=5.0 * u.ms, V_th=100.0 * u.mV, V_rest=-1.0 * u.mV)
    lif.init_state()
    run(lif, 1.5 * u.mA, 10)
    v_inf = -1.0 + 2.0 * 1.5
    np.testing.assert_allclose(mV(lif.V.value), v_inf + (0.0 - v_inf) * np.exp(-10 / 5.0), rtol=1e-5)
    with brainstate.environ.context(dt=200.0 * u.ms):  # e^{-40}: one step reaches V_∞
        lif(1.5 * u.mA)
    np.testing.assert_allclose(mV(lif.V.value), v_inf, rtol=1e-5)


def test_if_relaxes_to_r_times_i_without_a_resting_potential() -> None:
    neuron = nn.IF(2, R=3.0 * u.ohm, tau=2.0 * u.ms, V_th=100.0 * u.mV)
    neuron.init_state()
    run(neuron, 1.0 * u.mA, 4)
    np.testing.assert_allclose(mV(neuron.V.value), 3.0 * (1 - np.exp(-4 / 2.0)), rtol=1e-5)


@pytest.mark.parametrize("reset, after", [("soft", 1.5 - (1.0 - (-0.5))), ("hard", -0.5)])
def test_lif_spike_and_reset_rule(reset: str, after: float) -> None:
    # V = 1.5 mV is above V_th = 1 mV: the update resets it first, then relaxes towards V_rest = 0
    lif = nn.LIF(1, tau=4.0 * u.ms, V_th=1.0 * u.mV, V_reset=-0.5 * u.mV, spk_reset=reset)
    lif.init_state()
    lif.V.value = jnp.array([1.5]) * u.mV
    assert float(lif.get_spike()[0]) == 1.0
    spike = run(lif, 0.0 * u.mA, 1)[0]
    np.testing.assert_allclose(mV(lif.V.value), after * np.exp(-1 / 4.0), rtol=1e-5)
    assert float(spike[0]) == 0.0


def test_if_soft_reset_subtracts_the_threshold_and_hard_reset_goes_to_zero() -> None:
    for reset, after in [("soft", 2.5 - 2.0), ("hard", 0.0)]:
        neuron = nn.IF(1, tau=1e9 * u.ms, V_th=2.0 * u.mV, spk_reset=reset)
        neuron.init_state()
        neuron.V.value = jnp.array([2.5]) * u.mV
        run(neuron, 0.0 * u.mA, 1)
        np.testing.assert_allclose(mV(neuron.V.value), [after], atol=1e-6)


def test_spike_function_fires_at_the_threshold_and_has_a_surrogate_gradient() -> None:
    lif = nn.LIF(3, V_th=1.0 * u.mV, V_reset=0.0 * u.mV)
    lif.init_state()
    v = jnp.array([0.5, 1.0, 1.2]) * u.mV
    np.testing.assert_array_equal(lif.get_spike(v), [0.0, 1.0, 1.0])
    grad = jax.grad(lambda m: lif.get_spike(m * u.mV).sum())(jnp.array([0.5, 1.0, 1.2]))
    np.testing.assert_allclose(grad, [0.15, 0.3, 0.24], rtol=1e-5)  # ReluGrad: 0.3 (1 − |x|)


def test_no_refractory_period_a_strong_input_fires_every_step() -> None:
    lif = nn.LIF(1, tau=1.0 * u.ms, V_th=1.0 * u.mV)
    lif.init_state()
    assert [float(s[0]) for s in run(lif, 10.0 * u.mA, 5)] == [1.0] * 5


def test_alif_adaptation_jumps_by_one_per_spike_and_decays_with_tau_a() -> None:
    alif = nn.ALIF(1, tau=1e9 * u.ms, tau_a=10.0 * u.ms, V_th=1.0 * u.mV, beta=0.5 * u.mV)
    alif.init_state()
    alif.V.value = jnp.array([1.2]) * u.mV
    alif.a.value = jnp.array([0.2])
    run(alif, 0.0 * u.mA, 1)
    np.testing.assert_allclose(alif.a.value, [(0.2 + 1.0) * np.exp(-0.1)], rtol=1e-5)
    np.testing.assert_allclose(mV(alif.V.value), [0.2], atol=1e-5)  # soft reset by V_th − V_reset


def test_alif_threshold_rises_by_beta_times_a() -> None:
    alif = nn.ALIF(1, V_th=1.0 * u.mV, beta=0.5 * u.mV)
    alif.init_state()
    v = jnp.array([1.3]) * u.mV
    assert float(alif.get_spike(v, jnp.array([0.0]))[0]) == 1.0
    assert float(alif.get_spike(v, jnp.array([1.0]))[0]) == 0.0  # threshold 1.5 mV


def test_alif_intervals_grow_under_constant_input() -> None:
    alif = nn.ALIF(1, tau=5.0 * u.ms, tau_a=50.0 * u.ms, beta=0.5 * u.mV)
    alif.init_state()
    spikes = np.array([float(s[0]) for s in run(alif, 5.0 * u.mA, 40)])
    intervals = np.diff(np.nonzero(spikes)[0])
    assert intervals[0] < intervals[-1] and np.all(np.diff(intervals) >= 0)


@pytest.mark.parametrize("cls", ["IF", "LIF", "ALIF"])
@pytest.mark.parametrize("batch_size, size, shape", [
    (None, 4, (4,)), (3, 4, (3, 4)), (None, (2, 3), (2, 3)), (2, (2, 3), (2, 2, 3)),
])
def test_state_and_spike_shapes(cls: str, batch_size: int | None, size: Any, shape: tuple[int, ...]) -> None:
    layer = getattr(nn, cls)(size)
    layer.init_state(batch_size=batch_size)
    assert layer.V.value.shape == shape and u.get_unit(layer.V.value) == u.mV
    out = run(layer, jnp.ones(shape) * u.mA, 1)[0]
    assert out.shape == shape
    if cls == "ALIF":
        assert layer.a.value.shape == shape


@pytest.mark.parametrize("cls", ["IF", "LIF", "ALIF"])
def test_reset_state_is_in_place_and_may_change_the_batch(cls: str) -> None:
    layer = getattr(nn, cls)(3, V_initializer=braintools.init.Constant(0.25 * u.mV))
    layer.init_state(batch_size=2)
    states = {name: getattr(layer, name) for name in ("V", "a") if hasattr(layer, name)}
    run(layer, 2.0 * u.mA, 3)
    layer.reset_state(batch_size=5)
    for name, st in states.items():
        assert getattr(layer, name) is st
        assert st.value.shape == (5, 3)
    np.testing.assert_allclose(mV(layer.V.value), 0.25)


def test_unitless_neurons_work_with_a_unitless_step() -> None:
    lif = nn.LIF(2, R=1.0, tau=4.0, V_th=1.0, V_reset=0.0, V_rest=0.0,
                 V_initializer=braintools.init.Constant(0.0))
    lif.init_state()
    with brainstate.environ.context(dt=1.0):
        lif(jnp.array([0.5, 0.5]))
    np.testing.assert_allclose(lif.V.value, 0.5 * (1 - np.exp(-0.25)), rtol=1e-5)


def test_units_are_enforced() -> None:
    lif = nn.LIF(2, tau=4.0)  # a plain-number tau with dt in ms
    lif.init_state()
    with pytest.raises(u.UnitMismatchError, match="tau and the step dt must be both times"):
        run(lif, 1.0 * u.mA, 1)
    lif = nn.LIF(2)
    lif.init_state()
    with pytest.raises(u.UnitMismatchError):
        run(lif, 1.0 * u.mV, 1)  # R · (1 mV) is not a potential


def build(cls: str, unitless: bool = False, **kwargs: Any) -> Any:
    """A neuron of 2 units with its states created; ``unitless``: every constant a plain number."""
    if unitless:
        kwargs.update(R=1.0, tau=4.0, V_th=1.0, V_initializer=braintools.init.Constant(0.0))
        if cls != "IF":
            kwargs.update(V_reset=0.0, V_rest=0.0)
        if cls == "ALIF":
            kwargs.update(beta=0.1, tau_a=100.0)
    neuron = getattr(nn, cls)(2, **kwargs)
    neuron.init_state()
    return neuron


@pytest.mark.parametrize("cls", ["IF", "LIF", "ALIF"])
@pytest.mark.parametrize(
    "unitless, kwargs, x, shown",
    [
        (False, {}, jnp.ones(2), ("a quantity in mA", "V (in mV)", "R is in ohm", "a plain number or array (no unit)",
                                  "x * brainunit.mA")),
        (False, {}, jnp.ones(2) * u.mV, ("a quantity in mA", "got a quantity in mV", "value * brainunit.mA")),
        (False, {"R": 2.0 * u.Mohm}, 1.0, ("a quantity in nA", "R is in Mohm", "x * brainunit.nA")),
        (True, {}, jnp.ones(2) * u.mA, ("a plain number or array (no unit)", "V (unitless)", "got a quantity in mA",
                                        "x.to_decimal(brainunit.mA)")),
    ],
    ids=["plain-for-mV", "mV-for-mA", "plain-for-Mohm", "mA-for-unitless"],
)
def test_an_input_in_the_wrong_unit_is_refused_at_the_call(
    cls: str, unitless: bool, kwargs: dict[str, Any], x: Any, shown: tuple[str, ...]
) -> None:
    neuron = build(cls, unitless, **kwargs)
    for step in (neuron, brainstate.transform.jit(neuron)):  # also under tracing, before the update
        with brainstate.environ.context(dt=1.0 if unitless else DT), pytest.raises(ValueError) as info:
            step(x)
        assert isinstance(info.value, u.UnitMismatchError)  # what the update itself raised before
        message = str(info.value)
        assert message.startswith(f"{cls}: ")
        for part in shown:
            assert part in message, f"{part!r} not in {message!r}"
    assert float(u.get_mantissa(neuron.V.value).max()) == 0.0  # nothing ran


@pytest.mark.parametrize("cls", ["IF", "LIF", "ALIF"])
@pytest.mark.parametrize(
    "unitless, kwargs, x",
    [(False, {}, 3.0 * u.mA), (False, {}, jnp.ones(2) * 3000.0 * u.uA), (False, {"R": 1.0 * u.kohm}, 3.0 * u.uA),
     (True, {}, jnp.full(2, 3.0))],
    ids=["mA", "uA", "kohm-uA", "unitless"],
)
def test_inputs_in_the_expected_unit_still_work(cls: str, unitless: bool, kwargs: dict[str, Any], x: Any) -> None:
    neuron = build(cls, unitless, **kwargs)  # control of the refusal above
    with brainstate.environ.context(dt=1.0 if unitless else DT):
        neuron(x)
    v, tau = (neuron.V.value, 4.0) if unitless else (mV(neuron.V.value), 5.0)  # R x = 3 (mV)
    np.testing.assert_allclose(v, 3 * (1 - np.exp(-1 / tau)), rtol=1e-5)


@pytest.mark.parametrize("unitless", [False, True], ids=["mV", "unitless"])
def test_no_input_or_a_plain_zero_is_a_zero_current(unitless: bool) -> None:
    lif = build("LIF", unitless)
    with brainstate.environ.context(dt=1.0 if unitless else DT):
        lif()
        lif(0.0)
        lif(jnp.zeros(2))
    assert float(u.get_mantissa(lif.V.value).max()) == 0.0


def test_missing_dt_names_how_to_set_it() -> None:
    lif = nn.LIF(2)
    lif.init_state()
    with pytest.raises(KeyError, match=r"LIF reads the simulation step.*environ"):
        lif(1.0 * u.mA)


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="spk_reset must be 'soft' or 'hard', got 'none'"):
        nn.LIF(2, spk_reset="none")
    with pytest.raises(TypeError, match="spk_fun must be callable"):
        nn.IF(2, spk_fun=1.0)
    shape_error = r"trainable tau must be a ParamState of the population's shape \(3,\), got one of shape \(\)"
    with pytest.raises(ValueError, match=shape_error):
        nn.LIF(3, tau=brainstate.ParamState(5.0 * u.ms))
    with pytest.raises(TypeError, match="V_reset is a ParamState; it is not trainable"):
        nn.LIF(3, V_reset=brainstate.ParamState(jnp.zeros(3) * u.mV))
    with pytest.raises(TypeError, match="tau is a ShortTermState; give a brainstate.ParamState"):
        nn.ALIF(3, tau=brainstate.ShortTermState(jnp.ones(3) * u.ms))


@pytest.mark.parametrize("cls, trainable", [
    ("IF", ("tau", "V_th")), ("LIF", ("tau", "V_th")), ("ALIF", ("tau", "tau_a", "V_th", "beta")),
])
def test_trainable_constants_give_the_same_trajectory(cls: str, trainable: tuple[str, ...]) -> None:
    values = {"tau": 4.0 * u.ms, "tau_a": 20.0 * u.ms, "V_th": 1.0 * u.mV, "beta": 0.3 * u.mV}
    fixed = getattr(nn, cls)(3, **{k: values[k] for k in trainable})
    learned = getattr(nn, cls)(3, **{k: brainstate.ParamState(u.math.full(3, values[k])) for k in trainable})
    assert fixed.trainable_constants == () and learned.trainable_constants == trainable
    assert set(learned.states(brainstate.ParamState)) == {(k,) for k in trainable}
    x = jnp.array([0.8, 1.6, 3.0]) * u.mA
    spikes = []
    for layer in (fixed, learned):
        layer.init_state()
        spikes.append(np.stack(run(layer, x, 6)))
    np.testing.assert_allclose(mV(fixed.V.value), mV(learned.V.value), rtol=1e-6)
    np.testing.assert_array_equal(spikes[0], spikes[1])
    assert spikes[0].any()


def test_trainable_constants_enter_the_update_through_element_wise() -> None:
    lif = nn.LIF(2, tau=brainstate.ParamState(u.math.full(2, 5.0 * u.ms)))
    lif.init_state()
    with brainstate.environ.context(dt=DT):
        jaxpr, _ = brainstate.transform.make_jaxpr(lambda x: lif(x * u.mA))(jnp.ones(2))
        peek, _ = brainstate.transform.make_jaxpr(lambda: lif.get_spike())()
    assert [e.primitive.name for e in jaxpr.eqns].count("etp_elemwise") == 1
    assert "etp_elemwise" not in [e.primitive.name for e in peek.eqns]


def test_update_runs_under_jit_and_dt_is_read_at_update_time() -> None:
    lif = nn.LIF(2, tau=2.0 * u.ms, V_th=100.0 * u.mV)
    lif.init_state()
    step = brainstate.transform.jit(lambda x: lif(x))
    with brainstate.environ.context(dt=0.5 * u.ms):
        step(jnp.ones(2) * u.mA)
    np.testing.assert_allclose(mV(lif.V.value), 1 - np.exp(-0.25), rtol=1e-5)
