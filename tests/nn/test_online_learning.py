"""Every cell, and GRU / LSTM / LIF networks built from ``braintrace.nn`` alone, learn online.

Training is D-RTRL with single-step gradients accumulated over a short sequence and plain
SGD; a few dozen epochs must clearly lower the loss. Each case compiles one XLA program
(several seconds on a small CPU), so the whole module is marked slow.
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
from tests.nn.helpers import normal, train_online

pytestmark = pytest.mark.slow

nn = braintrace.nn
T = 6

# per-cell step sizes: the ungated minimal cells and the LRU need smaller steps to stay stable
LEARNING_RATES = {"MinimalRNNCell": 0.02, "MiniLSTM": 0.02, "MiniGRU": 0.02, "LRUCell": 0.005}
CELLS = ["ValinaRNNCell", "GRUCell", "MGUCell", "LSTMCell", "URLSTMCell", "MinimalRNNCell",
         "MiniGRU", "MiniLSTM", "CFNCell", "LRUCell"]


def sine_targets(n_out: int) -> jax.Array:
    return 0.5 * jnp.sin(jnp.arange(T)[:, None] * 0.7 + jnp.arange(n_out))


def assert_learns(losses: list[float], factor: float = 0.7) -> None:
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < factor * losses[0], (losses[0], losses[-1])


@pytest.mark.parametrize("name", CELLS)
def test_cell_learns_online(name: str) -> None:
    brainstate.random.seed(0)
    cell = getattr(nn, name)(3, 4)
    n_out = 3 if name == "LRUCell" else 4  # the LRU maps back to d_model
    xs = normal(0, (T, 3))
    losses = train_online(cell, xs, sine_targets(n_out), lr=LEARNING_RATES.get(name, 0.1), epochs=20)
    assert_learns(losses)


class RateNet(brainstate.nn.Module):
    """A recurrent cell followed by a leaky readout, batched."""

    def __init__(self, cell: Any) -> None:
        super().__init__()
        self.cell = cell
        with brainstate.environ.context(dt=1.0 * u.ms):
            self.readout = nn.LeakyRateReadout(8, 2, tau=2.0 * u.ms)

    def update(self, x: Any) -> Any:
        return self.readout(self.cell(x))


@pytest.mark.parametrize("cell", ["GRUCell", "LSTMCell"])
def test_rate_network_learns_online(cell: str) -> None:
    brainstate.random.seed(1)
    net = RateNet(getattr(nn, cell)(3, 8))
    xs = normal(1, (T, 4, 3))
    ys = jnp.broadcast_to(sine_targets(2)[:, None], (T, 4, 2))
    losses = train_online(net, xs, ys, lr=0.02, epochs=25, batch_size=4)
    assert_learns(losses)


class LIFNet(brainstate.nn.Module):
    """Recurrent LIF spiking layer (surrogate gradient) and a leaky rate readout."""

    def __init__(self, n_in: int, n_rec: int, n_out: int) -> None:
        super().__init__()
        self.n_rec = n_rec
        self.inp = nn.Linear(n_in, n_rec, w_init=braintools.init.KaimingNormal(scale=3.0))
        self.rec = nn.Linear(n_rec, n_rec, w_init=braintools.init.KaimingNormal(scale=0.5), b_init=None)
        self.spike_fn = braintools.surrogate.ReluGrad()
        with brainstate.environ.context(dt=1.0 * u.ms):
            self.readout = nn.LeakyRateReadout(n_rec, n_out, tau=5.0 * u.ms)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_rec,) if batch_size is None else (batch_size, self.n_rec)
        self.v = brainstate.HiddenState(jnp.zeros(shape))
        self.z = brainstate.HiddenState(jnp.zeros(shape))

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v.value = jnp.zeros_like(self.v.value)
        self.z.value = jnp.zeros_like(self.z.value)

    def update(self, x: Any) -> Any:
        v = 0.9 * self.v.value + self.inp(x) + self.rec(self.z.value)
        z = self.spike_fn(v - 1.0)
        self.v.value = v - jax.lax.stop_gradient(z)  # soft reset
        self.z.value = z
        return self.readout(z)


def test_lif_network_learns_online() -> None:
    brainstate.random.seed(2)
    net = LIFNet(5, 16, 2)
    xs = (normal(2, (12, 4, 5)) > 0.0).astype(float)
    ys = jnp.ones((12, 4, 2)) * jnp.array([1.0, -1.0])

    def loss(out: Any, y: Any) -> jax.Array:
        return jnp.sum((out - y) ** 2)

    losses = train_online(net, xs, ys, lr=0.005, epochs=25, loss=loss, batch_size=4)
    assert_learns(losses)
