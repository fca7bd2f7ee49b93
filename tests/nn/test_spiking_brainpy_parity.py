"""The native neurons and synapse filters follow ``brainpy.state`` step for step.

Each case builds ``brainpy.state.X`` and ``braintrace.nn.X`` with the same arguments, feeds both
the same 50-step input (float64) and compares every state (``V``, ``a``, ``g``, ``h``,
``g_rise``, ``g_decay``) and the returned spikes or conductances at every step. Skipped when
``brainpy.state`` is not importable (``pip install 'braintrace[brainpy]'``: brainpy 2.8.2 with
brainpy-state 0.1.0 on Python 3.11).
"""

from __future__ import annotations

from typing import Any

import brainstate
import brainunit as u
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import x64

bp_state = pytest.importorskip("brainpy.state", reason="brainpy.state is not installed")

pytestmark = pytest.mark.slow  # 3-8 s per case on a small CPU (eager steps of both libraries)

__all__ = ["x64"]  # the fixture is used by name

STEPS, BATCH, N = 50, 2, 5

NEURONS: dict[str, tuple[str, dict[str, Any]]] = {
    "IF-soft": ("IF", dict(tau=4.0 * u.ms, V_th=1.2 * u.mV)),
    "IF-hard": ("IF", dict(tau=4.0 * u.ms, V_th=1.2 * u.mV, R=2.0 * u.ohm, spk_reset="hard")),
    "LIF-soft": ("LIF", dict(tau=6.0 * u.ms, V_th=1.0 * u.mV, V_reset=-0.3 * u.mV, V_rest=0.2 * u.mV)),
    "LIF-hard": ("LIF", dict(tau=6.0 * u.ms, V_th=1.0 * u.mV, V_reset=-0.3 * u.mV, spk_reset="hard")),
    "LIF-per-neuron-tau": ("LIF", dict(tau=np.linspace(2.0, 9.0, N) * u.ms)),
    "ALIF-soft": ("ALIF", dict(tau=5.0 * u.ms, tau_a=30.0 * u.ms, beta=0.4 * u.mV, V_reset=-0.1 * u.mV)),
    "ALIF-hard": ("ALIF", dict(tau=5.0 * u.ms, tau_a=30.0 * u.ms, beta=0.4 * u.mV, spk_reset="hard")),
}

SYNAPSES: dict[str, tuple[str, dict[str, Any]]] = {
    "Expon": ("Expon", dict(tau=3.0 * u.ms)),
    "Alpha": ("Alpha", dict(tau=4.0 * u.ms)),
    "DualExpon": ("DualExpon", dict(tau_decay=6.0 * u.ms, tau_rise=1.5 * u.ms, amplitude=2.0)),
    "DualExpon-raw": ("DualExpon", dict(tau_decay=6.0 * u.ms, tau_rise=1.5 * u.ms, normalize=False)),
}

STATES = {"IF": ["V"], "LIF": ["V"], "ALIF": ["V", "a"], "Expon": ["g"], "Alpha": ["g", "h"],
          "DualExpon": ["g_rise", "g_decay"]}


def _currents(shape: tuple[int, ...]) -> np.ndarray:
    """A fixed input current (mA) per step, around 1.5 so the neurons fire now and then."""
    return 1.5 + np.random.default_rng(0).standard_normal((STEPS, *shape))


def _run(layer: Any, inputs: list[Any], names: list[str], batch_size: int | None) -> dict[str, np.ndarray]:
    # Eager steps: jit-compiling 50 unrolled brainpy steps (exp_euler_step's vector_grad each)
    # takes minutes, the eager loop seconds.
    layer.init_state(batch_size=batch_size)
    record: dict[str, list[Any]] = {"out": [], **{n: [] for n in names}}
    with brainstate.environ.context(dt=0.5 * u.ms):
        for x in inputs:
            record["out"].append(layer.update(x))
            for n in names:
                record[n].append(getattr(layer, n).value)
    return {k: np.stack([np.asarray(u.get_mantissa(v)) for v in vs]) for k, vs in record.items()}


def _assert_same_trajectories(cls: str, kwargs: dict[str, Any], inputs: list[Any], batch_size: int | None) -> None:
    names = STATES[cls]
    ours = _run(getattr(braintrace.nn, cls)(N, **kwargs), inputs, names, batch_size)
    theirs = _run(getattr(bp_state, cls)(N, **kwargs), inputs, names, batch_size)
    for key in ["out", *names]:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-10, atol=1e-12, err_msg=key)


@pytest.mark.parametrize("batch_size", [None, BATCH], ids=["unbatched", "batched"])
@pytest.mark.parametrize("case", sorted(NEURONS))
def test_neuron_trajectories_match_brainpy_state(x64: None, case: str, batch_size: int | None) -> None:
    cls, kwargs = NEURONS[case]
    shape = (N,) if batch_size is None else (batch_size, N)
    inputs = [jnp.asarray(c) * u.mA for c in _currents(shape)]
    _assert_same_trajectories(cls, kwargs, inputs, batch_size)


@pytest.mark.parametrize("case", sorted(NEURONS))
def test_neurons_spike_in_the_compared_runs(x64: None, case: str) -> None:
    # the comparison above is only meaningful if the runs cross the threshold
    cls, kwargs = NEURONS[case]
    inputs = [jnp.asarray(c) * u.mA for c in _currents((N,))]
    out = _run(getattr(braintrace.nn, cls)(N, **kwargs), inputs, [], None)["out"]
    assert 0 < out.sum() < out.size


@pytest.mark.parametrize("batch_size", [None, BATCH], ids=["unbatched", "batched"])
@pytest.mark.parametrize("case", sorted(SYNAPSES))
def test_synapse_trajectories_match_brainpy_state(x64: None, case: str, batch_size: int | None) -> None:
    cls, kwargs = SYNAPSES[case]
    shape = (N,) if batch_size is None else (batch_size, N)
    spikes = np.random.default_rng(1).random((STEPS, *shape)) < 0.2
    inputs = [jnp.asarray(s, dtype=float) * u.mS if t % 7 else None for t, s in enumerate(spikes)]
    _assert_same_trajectories(cls, kwargs, inputs, batch_size)
