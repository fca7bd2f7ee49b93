"""The benchmark models: a leaky RNN, a GRU with a readout, recurrent LIF networks (with a
trainable leak and with a fixed one) and a convolutional RNN over a small feature map."""

from __future__ import annotations

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

import braintrace


def _normal(key: int, shape: tuple[int, ...], scale: float) -> jax.Array:
    return scale * jax.random.normal(jax.random.PRNGKey(key), shape)


class _Recurrent(brainstate.nn.Module):
    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__()
        self.n_in, self.n_hidden, self.n_out = n_in, n_hidden, n_out
        self.w_out = brainstate.ParamState(_normal(9, (n_hidden, n_out), 1 / np.sqrt(n_hidden)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hidden,) if batch_size is None else (batch_size, self.n_hidden)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        # Reset in place: a compiled learner holds these very state objects.
        self.h.value = jnp.zeros_like(self.h.value)


class LeakyRNN(_Recurrent):
    """``h = σ(τ) h + tanh(x W_in + h W_rec)`` with a plain readout."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__(n_in, n_hidden, n_out)
        self.tau = brainstate.ParamState(jnp.ones(n_hidden, dtype=jnp.float32))
        self.w_in = brainstate.ParamState(_normal(1, (n_in, n_hidden), 1 / np.sqrt(n_in)))
        self.w_rec = brainstate.ParamState(_normal(2, (n_hidden, n_hidden), 0.5 / np.sqrt(n_hidden)))

    def update(self, x: jax.Array) -> jax.Array:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        drive = braintrace.matmul(x, self.w_in.value) + braintrace.matmul(self.h.value, self.w_rec.value)
        self.h.value = leak * self.h.value + jnp.tanh(drive)
        return self.h.value @ self.w_out.value


class VanillaRNN(_Recurrent):
    """``h = tanh([x, h] W + b)`` with a plain readout (upstream's "vanilla" benchmark cell)."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__(n_in, n_hidden, n_out)
        self.w = brainstate.ParamState(_normal(10, (n_in + n_hidden, n_hidden), 1 / np.sqrt(n_in + n_hidden)))
        self.b = brainstate.ParamState(jnp.zeros(n_hidden, dtype=jnp.float32))

    def update(self, x: jax.Array) -> jax.Array:
        xh = jnp.concatenate([x, self.h.value], axis=-1)
        self.h.value = jnp.tanh(braintrace.matmul(xh, self.w.value, self.b.value))
        return self.h.value @ self.w_out.value


class GRU(_Recurrent):
    """A GRU cell (three ETP linears on ``[x, h]``) with a plain readout."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__(n_in, n_hidden, n_out)
        scale = 1 / np.sqrt(n_in + n_hidden)
        self.wz = brainstate.ParamState(_normal(3, (n_in + n_hidden, n_hidden), scale))
        self.wr = brainstate.ParamState(_normal(4, (n_in + n_hidden, n_hidden), scale))
        self.wh = brainstate.ParamState(_normal(5, (n_in + n_hidden, n_hidden), scale))

    def update(self, x: jax.Array) -> jax.Array:
        h = self.h.value
        xh = jnp.concatenate([x, h], axis=-1)
        z = jax.nn.sigmoid(braintrace.matmul(xh, self.wz.value))
        r = jax.nn.sigmoid(braintrace.matmul(xh, self.wr.value))
        cand = jnp.tanh(braintrace.matmul(jnp.concatenate([x, r * h], axis=-1), self.wh.value))
        self.h.value = (1 - z) * h + z * cand
        return self.h.value @ self.w_out.value


@jax.custom_jvp
def spike(v: jax.Array) -> jax.Array:
    """Heaviside with a sigmoid-derivative surrogate gradient."""
    return (v > 0).astype(v.dtype)


@spike.defjvp
def _spike_jvp(primals: Any, tangents: Any) -> Any:
    (v,), (dv,) = primals, tangents
    s = jax.nn.sigmoid(4 * v)
    return spike(v), 4 * s * (1 - s) * dv


class LIF(_Recurrent):
    """Recurrent LIF: trainable element-wise leak and one dense ETP matmul on ``[x, spikes]``."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__(n_in, n_hidden, n_out)
        self.tau = brainstate.ParamState(jnp.full((n_hidden,), 2.0, dtype=jnp.float32))
        self.w = brainstate.ParamState(_normal(6, (n_in + n_hidden, n_hidden), 1 / np.sqrt(n_in + n_hidden)))

    def update(self, x: jax.Array) -> jax.Array:
        v = self.h.value
        s = spike(v - 1.0)
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        current = braintrace.matmul(jnp.concatenate([x, s], axis=-1), self.w.value)
        self.h.value = leak * v * (1 - s) + current
        return s @ self.w_out.value


class FixedLeakLIF(_Recurrent):
    """Recurrent LIF with a fixed leak, inside OTTT's class: ``v = λ (v - s) + [x, s] W``.

    ``s`` are the previous step's spikes (the reset by subtraction and the recurrent input); the
    readout reads the spikes of the new potential. ``λ`` (:attr:`leak`) is a constant, not a
    parameter, and the drive enters ``v`` unscaled.
    """

    leak = 0.9

    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__(n_in, n_hidden, n_out)
        self.w = brainstate.ParamState(_normal(6, (n_in + n_hidden, n_hidden), 1 / np.sqrt(n_in + n_hidden)))

    def update(self, x: jax.Array) -> jax.Array:
        v = self.h.value
        s = spike(v - 1.0)
        self.h.value = self.leak * (v - s) + braintrace.matmul(jnp.concatenate([x, s], axis=-1), self.w.value)
        return spike(self.h.value - 1.0) @ self.w_out.value


class ConvRNN(brainstate.nn.Module):
    """``h = σ(τ) ⊙ h + tanh(conv([x, h], K) + b)`` on a ``(side, side, C)`` map, with a plain readout.

    ``n_in`` is the input map's size (``side²``, one channel), ``n_hidden`` the hidden channels
    ``C``; the 3×3 kernel (``HWIO``, channel-last like ``brainstate.nn.Conv2d``) reads the input
    and the previous hidden map, so D_RTRL keeps one kernel per output position:
    ``(B, side, side, 3, 3, 1 + C, C, 1)``.
    """

    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__()
        side = int(np.sqrt(n_in))
        if side * side != n_in:
            raise ValueError(f"ConvRNN: n_in must be a square (side² input pixels), got {n_in}.")
        self.n_in, self.n_hidden, self.n_out, self.side = n_in, n_hidden, n_out, side
        fan_in = 9 * (1 + n_hidden)
        self.kernel = brainstate.ParamState(_normal(7, (3, 3, 1 + n_hidden, n_hidden), 1 / np.sqrt(fan_in)))
        self.bias = brainstate.ParamState(jnp.zeros(n_hidden, dtype=jnp.float32))
        self.tau = brainstate.ParamState(jnp.ones((side, side, n_hidden), dtype=jnp.float32))
        n_map = side * side * n_hidden
        self.w_out = brainstate.ParamState(_normal(8, (n_map, n_out), 1 / np.sqrt(n_map)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.side, self.side, self.n_hidden)
        self.h = brainstate.HiddenState(jnp.zeros(shape if batch_size is None else (batch_size, *shape)))

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h.value = jnp.zeros_like(self.h.value)

    def update(self, x: jax.Array) -> jax.Array:
        h = self.h.value
        x_map = x.reshape(*x.shape[:-1], self.side, self.side, 1)
        drive = braintrace.conv(jnp.concatenate([x_map, h], axis=-1), self.kernel.value, self.bias.value,
                                strides=(1, 1), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * h + jnp.tanh(drive)
        return self.h.value.reshape(*h.shape[:-3], -1) @ self.w_out.value
