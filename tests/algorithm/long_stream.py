"""The model, stream and float64 reference of ``tests/algorithm/test_long_stream.py``.

A leaky tanh network ``h <- sigmoid(leak) * h + tanh(x W + b)`` (4 units, batch 1) trained online
by D_RTRL and SGD on a teacher's targets. Its recurrence is diagonal, so D_RTRL's trace is the
exact gradient for frozen weights, and contractive (``sigmoid(leak) <= 0.73``), so the hidden
state and the traces stay bounded however long the stream runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np

import braintrace

N_IN, N_HIDDEN = 3, 4
LR = 0.01


@contextmanager
def precision(dtype: Any) -> Iterator[None]:
    """JAX's x64 mode on for a float64 run, off for float32; restored afterwards."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", np.dtype(dtype) == np.float64)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


class LeakyTanh(brainstate.nn.Module):
    def __init__(self, dtype: Any) -> None:
        super().__init__()
        rng = np.random.RandomState(3)
        self.dtype = dtype
        self.W = brainstate.ParamState({"weight": jnp.asarray(rng.randn(N_IN, N_HIDDEN) * 0.5, dtype),
                                        "bias": jnp.asarray(rng.randn(N_HIDDEN) * 0.1, dtype)})
        self.leak = brainstate.ParamState(jnp.asarray(rng.uniform(-1.0, 1.0, N_HIDDEN), dtype))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((1, N_HIDDEN), self.dtype))

    def update(self, x: jax.Array) -> jax.Array:
        decay = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid)
        self.h.value = decay * self.h.value + jnp.tanh(braintrace.matmul(x, self.W.value["weight"], self.W.value["bias"]))
        return self.h.value


def stream(n: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Inputs ``(n, 1, in)`` and a teacher's targets ``(n, 1, hidden)``, the same in any dtype."""
    rng = np.random.RandomState(11)
    xs = rng.randn(n, 1, N_IN)
    teacher = rng.randn(N_IN, N_HIDDEN) * 0.3
    ys = np.tanh(xs @ teacher)
    return jnp.asarray(xs, dtype), jnp.asarray(ys, dtype)


def learner(dtype: Any) -> Any:
    return braintrace.compile(LeakyTanh(dtype), braintrace.D_RTRL, jnp.zeros((1, N_IN), dtype))


def train(net: Any, xs: jax.Array, ys: jax.Array) -> jax.Array:
    """Online SGD, one update per step, in one ``etrace_train`` scan: the per-step losses."""

    def step_fn(x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((net(x) - y) ** 2)

    return net.etrace_train(xs, ys, step_fn=step_fn, optimizer=braintools.optim.SGD(lr=LR), update_every=1).losses


def window_grads(net: Any, xs: jax.Array, ys: jax.Array, burn_in: int) -> dict[Any, Any]:
    """``etrace_grad`` over ``xs`` with the first ``burn_in`` steps' losses masked out (weights frozen)."""
    mask = jnp.asarray(np.arange(len(xs)) >= burn_in, xs.dtype)

    def step_fn(x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((net(x) - y) ** 2)

    grads: dict[Any, Any] = net.etrace_grad(xs, ys, step_fn=step_fn, mask=mask, reduction="sum")
    return grads


def bptt_window_grads(params: dict[str, np.ndarray], h0: np.ndarray, xs: np.ndarray, ys: np.ndarray,
                      burn_in: int) -> dict[str, np.ndarray]:
    """The same masked sum's gradient by ``jax.grad`` through the time loop, in float64, from ``h0``
    (a constant: what came before the window is cut off)."""
    with precision(np.float64):

        def loss(p: dict[str, jax.Array]) -> jax.Array:
            def step(h: jax.Array, xy: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
                x, y, m = xy
                h = jax.nn.sigmoid(p["leak"]) * h + jnp.tanh(x @ p["weight"] + p["bias"])
                return h, m * jnp.mean((h - y) ** 2)

            mask = jnp.asarray(np.arange(len(xs)) >= burn_in, jnp.float64)
            return jnp.sum(jax.lax.scan(step, jnp.asarray(h0, jnp.float64), (jnp.asarray(xs, jnp.float64),
                                                                              jnp.asarray(ys, jnp.float64), mask))[1])

        grads = jax.grad(loss)({k: jnp.asarray(v, jnp.float64) for k, v in params.items()})
        return {k: np.asarray(v) for k, v in grads.items()}
