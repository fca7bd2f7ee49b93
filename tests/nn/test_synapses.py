"""``Expon``, ``Alpha``, ``DualExpon`` without brainpy: impulse responses in closed form, units, resets.

With ``d = e^{−dt/τ}`` and ``k = 1 − d``, a unit input at step 0 gives after step ``n``:
``Expon``: ``g_n = d^n``; ``Alpha``: ``h_n = d^n``, ``g_n = n k d^{n−1}`` (the input reaches ``g``
one step later); ``DualExpon``: ``A (d_decay^n − d_rise^n)``.
"""

from __future__ import annotations

from typing import Any

import brainstate
import braintools
import brainunit as u
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace

nn = braintrace.nn


def impulse(layer: Any, steps: int, dt: Any = 1.0 * u.ms, batch_size: int | None = None) -> np.ndarray:
    """The outputs (in mS) of ``steps`` updates after a unit input at the first one."""
    layer.init_state(batch_size=batch_size)
    shape = tuple(layer.varshape) if batch_size is None else (batch_size, *layer.varshape)
    with brainstate.environ.context(dt=dt):
        outs = [layer(jnp.ones(shape) * u.mS if t == 0 else None) for t in range(steps)]
    return np.stack([np.asarray(u.get_mantissa(o.to(u.mS))) for o in outs])


def test_expon_impulse_response_decays_as_exp_minus_t_over_tau() -> None:
    out = impulse(nn.Expon(2, tau=4.0 * u.ms), 6)
    np.testing.assert_allclose(out[:, 0], np.exp(-np.arange(6) / 4.0), rtol=1e-5)


def test_expon_adds_each_input_after_the_decay() -> None:
    syn = nn.Expon(1, tau=2.0 * u.ms)
    syn.init_state()
    with brainstate.environ.context(dt=1.0 * u.ms):
        syn(1.0 * u.mS)
        g = syn(0.5 * u.mS)
    np.testing.assert_allclose(u.get_mantissa(g), [np.exp(-0.5) + 0.5], rtol=1e-5)


def test_alpha_impulse_response_closed_form() -> None:
    tau = 3.0
    out = impulse(nn.Alpha(1, tau=tau * u.ms), 12)[:, 0]
    d = np.exp(-1.0 / tau)
    n = np.arange(12)
    np.testing.assert_allclose(out, n * (1 - d) * d ** np.maximum(n - 1, 0), rtol=1e-5, atol=1e-7)


def test_alpha_peaks_at_tau() -> None:
    out = impulse(nn.Alpha(1, tau=5.0 * u.ms), 120, dt=0.1 * u.ms)[:, 0]
    assert int(np.argmax(out)) in (50, 51)  # t = tau, to within one step


def test_dual_expon_impulse_response_and_peak_normalisation() -> None:
    tau_r, tau_d = 0.5, 5.0
    out = impulse(nn.DualExpon(1, tau_decay=tau_d * u.ms, tau_rise=tau_r * u.ms, amplitude=2.0), 500,
                  dt=0.01 * u.ms)[:, 0]
    t_peak = tau_r * tau_d * np.log(tau_d / tau_r) / (tau_d - tau_r)
    assert abs(0.01 * int(np.argmax(out)) - t_peak) < 0.011
    np.testing.assert_allclose(out.max(), 2.0, rtol=1e-3)
    raw = impulse(nn.DualExpon(1, tau_decay=tau_d * u.ms, tau_rise=tau_r * u.ms, normalize=False), 5)[:, 0]
    n = np.arange(5)
    np.testing.assert_allclose(raw, np.exp(-n / tau_d) - np.exp(-n / tau_r), rtol=1e-5, atol=1e-7)


def test_dual_expon_normalisation_needs_distinct_time_constants() -> None:
    with pytest.raises(ValueError, match="tau_decay must differ from tau_rise when normalize=True"):
        nn.DualExpon(2, tau_decay=2.0 * u.ms, tau_rise=2.0 * u.ms)
    with pytest.raises(ValueError, match="tau_decay must differ"):
        nn.DualExpon(2, tau_decay=brainstate.ParamState(jnp.array([2.0, 3.0]) * u.ms),
                     tau_rise=jnp.array([1.0, 3.0]) * u.ms)
    nn.DualExpon(2, tau_decay=2.0 * u.ms, tau_rise=2.0 * u.ms, normalize=False)


@pytest.mark.parametrize("cls, states", [
    ("Expon", ("g",)), ("Alpha", ("g", "h")), ("DualExpon", ("g_rise", "g_decay")),
])
@pytest.mark.parametrize("batch_size, size, shape", [(None, 3, (3,)), (2, 3, (2, 3)), (4, (2, 3), (4, 2, 3))])
def test_shapes_and_in_place_reset(cls: str, states: tuple[str, ...], batch_size: int | None, size: Any,
                                   shape: tuple[int, ...]) -> None:
    layer = getattr(nn, cls)(size, g_initializer=braintools.init.Constant(0.5 * u.mS))
    out = impulse(layer, 2, batch_size=batch_size)
    assert out.shape == (2, *shape)
    objects = {name: getattr(layer, name) for name in states}
    layer.reset_state(batch_size=7)
    for name, st in objects.items():
        assert getattr(layer, name) is st
        assert st.value.shape == (7, *np.atleast_1d(size))
        np.testing.assert_allclose(u.get_mantissa(st.value.to(u.mS)), 0.5)


def test_units_are_enforced_and_unitless_filters_work() -> None:
    syn = nn.Expon(2, tau=3.0)
    syn.init_state()
    with pytest.raises(u.UnitMismatchError, match="tau and the step dt must be both times"):
        with brainstate.environ.context(dt=1.0 * u.ms):
            syn(None)
    syn = nn.Expon(2, tau=4.0, g_initializer=braintools.init.Constant(0.0))
    syn.init_state()
    with brainstate.environ.context(dt=1.0):
        syn(jnp.ones(2))
        g = syn(None)
    np.testing.assert_allclose(g, np.exp(-0.25), rtol=1e-5)
    with pytest.raises(u.UnitMismatchError, match="tau_rise"):
        layer = nn.DualExpon(1, tau_rise=1.0, tau_decay=5.0)
        layer.init_state()
        with brainstate.environ.context(dt=1.0 * u.ms):
            layer(None)


@pytest.mark.parametrize("cls, kwargs", [
    ("Expon", {"tau": 3.0 * u.ms}),
    ("Alpha", {"tau": 3.0 * u.ms}),
    ("DualExpon", {"tau_decay": 4.0 * u.ms, "tau_rise": 1.0 * u.ms}),
])
def test_trainable_time_constants_give_the_same_response(cls: str, kwargs: dict[str, Any]) -> None:
    fixed = getattr(nn, cls)(2, **kwargs)
    learned = getattr(nn, cls)(2, **{k: brainstate.ParamState(u.math.full(2, v)) for k, v in kwargs.items()})
    assert learned.trainable_constants == tuple(kwargs)
    np.testing.assert_allclose(impulse(fixed, 5), impulse(learned, 5), rtol=1e-6)


def test_a_trainable_time_constant_must_have_the_population_shape() -> None:
    with pytest.raises(ValueError, match=r"Expon: a trainable tau must be a ParamState of the .* shape \(2, 3\)"):
        nn.Expon((2, 3), tau=brainstate.ParamState(jnp.ones(3) * u.ms))
    with pytest.raises(TypeError, match="amplitude is a ParamState; it is not trainable"):
        nn.DualExpon(3, amplitude=brainstate.ParamState(jnp.ones(3)))


@pytest.mark.parametrize("cls, state", [("Expon", "g"), ("Alpha", "h"), ("DualExpon", "g_rise")])
@pytest.mark.parametrize(
    "g_init, x, shown",
    [
        (None, jnp.ones(2), ("a quantity in mS", "(in mS)", "a plain number or array (no unit)",
                             "x * brainunit.mS")),
        (None, jnp.ones(2) * u.mA, ("a quantity in mS", "got a quantity in mA", "value * brainunit.mS")),
        (0.0, jnp.ones(2) * u.mS, ("a plain number or array (no unit)", "(unitless)", "got a quantity in mS",
                                   "x.to_decimal(brainunit.mS)")),
    ],
    ids=["plain-for-mS", "mA-for-mS", "mS-for-unitless"],
)
def test_an_input_in_the_wrong_unit_is_refused_at_the_call(
    cls: str, state: str, g_init: Any, x: Any, shown: tuple[str, ...]
) -> None:
    kwargs = {} if g_init is None else {"g_initializer": braintools.init.Constant(g_init)}
    syn = getattr(nn, cls)(2, **kwargs)
    syn.init_state()
    for step in (syn, brainstate.transform.jit(syn)):  # also under tracing
        with brainstate.environ.context(dt=1.0 * u.ms), pytest.raises(ValueError) as info:
            step(x)
        assert isinstance(info.value, u.UnitMismatchError)
        message = str(info.value)
        assert message.startswith(f"{cls}: ") and f"added to the state {state}" in message
        for part in shown:
            assert part in message, f"{part!r} not in {message!r}"
    # a unitless state is not silently turned into one in mS
    assert u.get_unit(getattr(syn, state).value) == (u.mS if g_init is None else u.get_unit(1.0))


@pytest.mark.parametrize("cls", ["Expon", "Alpha", "DualExpon"])
@pytest.mark.parametrize("x", [jnp.ones(2) * u.mS, 1000.0 * u.uS, 0.0, jnp.zeros(2), None], ids=str)
def test_inputs_in_the_state_unit_still_work(cls: str, x: Any) -> None:  # control
    syn = getattr(nn, cls)(2)
    syn.init_state()
    with brainstate.environ.context(dt=1.0 * u.ms):
        out = syn(x)
    assert u.get_unit(out) == u.mS and out.shape == (2,)
