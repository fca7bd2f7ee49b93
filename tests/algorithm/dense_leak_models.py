"""Test models and a step-by-step comparison for the dense fixed-leak rules (OTTT, OTPE) and their records.

* :class:`LeakyLinear` — ``h = λ h + matmul(x, W, b)`` (optionally ``W -> tanh(W)`` inside the op):
  OTTT's and OTPE's exact regime;
* :class:`LeakyTanh` — ``h = λ h + tanh(matmul(x, W, b))``: ``D ≡ λ`` but ``df = tanh'`` (OTPE
  exact, OTTT approximate);
* :class:`TwoState` — one hidden group of two states (outside both rules' scope);
* :class:`ElementWiseLeak` — a trainable element-wise leak (a relation that is not dense);
* :func:`vanilla_cell` — a vanilla recurrent cell (dense, outside the fixed-leak regime);
* :func:`assert_same_steps` — two such runs equal element-wise, step by step.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

import braintrace
from tests.algorithm.bptt import normal

#: The leak of the models, which the rules assume.
LAM = 0.9
N_IN, N_HID = 3, 4


class _Layer(brainstate.nn.Module):
    def __init__(self, lam: float = LAM) -> None:
        super().__init__()
        self.lam = lam
        self.w = brainstate.ParamState(normal(0, (N_IN, N_HID), 0.5))
        self.b = brainstate.ParamState(normal(1, (N_HID,), 0.1))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((N_HID,) if batch_size is None else (batch_size, N_HID)))


class LeakyLinear(_Layer):
    """``h = λ h + matmul(x, W, b)`` (with ``hook``, ``W -> tanh(W)`` inside the op)."""

    def __init__(self, lam: float = LAM, hook: bool = False) -> None:
        super().__init__(lam)
        self.hook = hook

    def update(self, x: jax.Array) -> jax.Array:
        fn = jnp.tanh if self.hook else None
        self.h.value = self.lam * self.h.value + braintrace.matmul(x, self.w.value, self.b.value, weight_fn=fn)
        return self.h.value


class LeakyTanh(_Layer):
    """``h = λ h + tanh(matmul(x, W, b))``."""

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = self.lam * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value, self.b.value))
        return self.h.value


class TwoState(brainstate.nn.Module):
    """``v = .9 v + matmul(x, W) − .1 a``, ``a = .95 a + v``: one group with two states."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (N_IN, N_HID), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros((batch_size or 1, N_HID)))
        self.a = brainstate.HiddenState(jnp.zeros((batch_size or 1, N_HID)))

    def update(self, x: jax.Array) -> jax.Array:
        v = 0.9 * self.v.value + braintrace.matmul(x, self.w.value) - 0.1 * self.a.value
        self.a.value = 0.95 * self.a.value + v
        self.v.value = v
        return v


class ElementWiseLeak(_Layer):
    """``h = τ ⊙ h + matmul(x, W, b)`` with a trainable element-wise ``τ``."""

    def __init__(self) -> None:
        super().__init__()
        self.tau = brainstate.ParamState(normal(2, (N_HID,), 0.5))

    def update(self, x: jax.Array) -> jax.Array:
        leak = braintrace.element_wise(self.tau.value)
        self.h.value = leak * self.h.value + braintrace.matmul(x, self.w.value, self.b.value)
        return self.h.value


def vanilla_cell() -> braintrace.nn.ValinaRNNCell:
    """A vanilla recurrent cell ``h = relu(W [x, h] + b)``, its weights drawn from a fixed seed."""
    brainstate.random.seed(0)
    return braintrace.nn.ValinaRNNCell(N_IN, N_HID)


def inputs(n_steps: int, batch: int | None) -> jax.Array:
    """``(T, batch, in)`` or ``(T, in)`` inputs."""
    return normal(7, (n_steps, N_IN) if batch is None else (n_steps, batch, N_IN))


def compile_(model: brainstate.nn.Module, algorithm: Any, x0: jax.Array, batch: int | None, **options: Any) -> Any:
    """``braintrace.compile`` without the compile-time notices (a vanilla cell's untraced weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, x0, batch_size=batch, **options)


def assert_same_steps(want: dict[tuple[Any, ...], np.ndarray], got: dict[tuple[Any, ...], np.ndarray],
                      rtol: float, atol: float) -> None:
    """Equal element-wise at every step, with a history that matters (every parameter's gradient
    moves after the first step)."""
    assert set(want) == set(got), (sorted(want), sorted(got))
    for path in want:
        assert np.any(want[path][1:] != 0), path
        np.testing.assert_allclose(got[path], want[path], rtol=rtol, atol=atol, err_msg=str(path))
