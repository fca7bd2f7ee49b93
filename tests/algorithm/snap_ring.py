"""The sparse ring RNN of the SnAp tests, its variants, and the drivers that compare them with BPTT.

The ring is upstream's reference model, ``h ← tanh(x @ W_in + sparse_matmul(h, w))`` with a
self-edge and one forward edge per unit (``h_q`` reads ``h_q`` and ``h_(q-1)``), six units:
position ``p`` reaches ``p, ..., p + n - 1`` within ``n - 1`` steps, so SnAp-n has
``K = min(n, 6)`` slots and saturates at ``n = 6``. Sequences have ``T = 12`` steps, so windows of
2, 3 and 4 divide them.

* :func:`bptt` — the oracle: ``grad`` of ``Σ_t |model(x_t) - y_t|²`` through the whole sequence;
* :func:`online` — a learner's ``etrace_grad`` of the same loss, plain (one call per step) or in
  windows of ``chunk`` steps;
* the module-scoped, autouse ``float64`` fixture (import it by name): the models are built inside
  the tests, after it has switched float64 on.
"""

from __future__ import annotations

from typing import Any, Iterator

import brainevent
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import normal

__all__ = ["float64"]

N, I, T, B = 6, 3, 12, 2
#: The "equals BPTT" tolerance (relative, float64).
EXACT = 1e-6
Grads = dict[Any, np.ndarray]


@pytest.fixture(autouse=True, scope="module")
def float64() -> Iterator[None]:
    """Every test of the importing module runs in float64 (models are built inside the tests)."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


# --- models --------------------------------------------------------------------------------


def ring_adjacency() -> np.ndarray:
    """``A[q, p]``: ``h_q`` reads ``h_p`` (itself and its predecessor)."""
    eye = np.eye(N, dtype=bool)
    return eye | np.roll(eye, 1, axis=0)


def ring_csr(backward: bool = False) -> Any:
    """The ``(in, out)`` structure: stored ``(i, o)`` where ``h_o`` reads ``h_i``."""
    adjacency = ring_adjacency()
    stored = adjacency if backward else adjacency.T
    return brainevent.CSR.fromdense(jnp.asarray(stored, dtype=jnp.result_type(float)))


class Ring(brainstate.nn.Module):
    """``h ← tanh(x @ W_in + sparse_matmul(h, w))`` (``roll=True``: the drive rolled first).

    ``both_ways`` adds a second sparse recurrence along the backward edges (two mixing
    equations on one group); ``cumsum`` adds an unregistered mixing operation.
    """

    def __init__(self, roll: bool = False, both_ways: bool = False, cumsum: bool = False) -> None:
        super().__init__()
        self.roll, self.both_ways, self.cumsum = roll, both_ways, cumsum
        self.csr = ring_csr()
        self.w_in = brainstate.ParamState(normal(1, (I, N), 0.6))
        self.w = brainstate.ParamState(normal(2, (2 * N,), 0.8))
        if both_ways:
            self.csr_back = ring_csr(backward=True)
            self.w_back = brainstate.ParamState(normal(3, (2 * N,), 0.4))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((N,) if batch_size is None else (batch_size, N)))

    def update(self, x: jax.Array) -> jax.Array:
        h = self.h.value
        y = braintrace.matmul(x, self.w_in.value)
        if self.roll:
            y = jnp.roll(y, 1, axis=-1)
        drive = y + braintrace.sparse_matmul(h, self.w.value, sparse_mat=self.csr)
        if self.both_ways:
            drive = drive + braintrace.sparse_matmul(h, self.w_back.value, sparse_mat=self.csr_back)
        if self.cumsum:
            drive = drive + 0.3 * jnp.cumsum(h, axis=-1)
        self.h.value = jnp.tanh(drive)
        return self.h.value


class TwoStateRing(Ring):
    """Two states per unit: ``v ← 0.8 v + 0.2 (x @ W_in + sparse_matmul(h, w))``, ``h ← tanh(v)``."""

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros(N))
        self.h = brainstate.HiddenState(jnp.zeros(N))

    def update(self, x: jax.Array) -> jax.Array:
        drive = braintrace.matmul(x, self.w_in.value) + braintrace.sparse_matmul(self.h.value, self.w.value,
                                                                                 sparse_mat=self.csr)
        self.v.value = 0.8 * self.v.value + 0.2 * drive
        self.h.value = jnp.tanh(self.v.value)
        return self.h.value


class Leaky(brainstate.nn.Module):
    """``h ← tanh(x @ W_in + 0.5 h)``: no operation mixes positions."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = brainstate.ParamState(normal(4, (I, N), 0.6))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(N))

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = jnp.tanh(braintrace.matmul(x, self.w_in.value) + 0.5 * self.h.value)
        return self.h.value


# --- drivers -------------------------------------------------------------------------------


def inputs(batch: int | None = None, steps: int = T, n_in: int = I, width: int = N) -> tuple[jax.Array, jax.Array]:
    """``(xs, ys)``: fixed inputs ``(T, [batch,] n_in)`` and targets ``(T, [batch,] width)``."""
    lead = (steps,) if batch is None else (steps, batch)
    return normal(10, (*lead, n_in)), normal(11, (*lead, width))


def bptt(model: brainstate.nn.Module, xs: Any, ys: Any, batch: int | None = None) -> Grads:
    """``grad`` of ``Σ_t |model(x_t) - y_t|²`` through the whole sequence."""
    brainstate.nn.init_all_states(model, batch_size=batch)
    params = model.states(brainstate.ParamState)

    def total() -> jax.Array:
        def body(acc: jax.Array, xy: Any) -> tuple[jax.Array, None]:
            return acc + jnp.sum((model(xy[0]) - xy[1]) ** 2), None

        return brainstate.transform.scan(body, jnp.zeros(()), (xs, ys))[0]

    grads = brainstate.transform.jit(lambda: brainstate.transform.grad(total, params)())()
    return {path: np.asarray(g) for path, g in grads.items()}


def online(learner: Any, xs: Any, ys: Any, chunk: int | None = None) -> Grads:
    """The learner's ``etrace_grad`` of the same summed loss (plain mode, or windows of ``chunk``)."""
    if chunk is None:
        step = lambda x, y: jnp.sum((learner(x) - y) ** 2)  # noqa: E731
    else:
        step = lambda x, y: jnp.sum((learner(braintrace.MultiStepData(x)) - y) ** 2, axis=-1)  # noqa: E731
    grads = learner.etrace_grad(xs, ys, step_fn=step, chunk_size=chunk, reduction="sum")
    return {path: np.asarray(g) for path, g in grads.items()}


def snap(model: brainstate.nn.Module, n: int, x0: Any, **options: Any) -> Any:
    """``braintrace.compile(model, SnAp, x0, n=n, **options)``."""
    return braintrace.compile(model, braintrace.SnAp, x0, n=n, **options)


def trace_sizes(learner: Any) -> int:
    """The number of trace elements the learner holds."""
    return sum(leaf.size for leaf in jax.tree.leaves(learner.named_etraces()))


def assert_same(a: Grads, b: Grads) -> None:
    """Two gradients equal element-wise (up to float64 round-off)."""
    assert set(a) == set(b)
    for path in a:
        np.testing.assert_allclose(a[path], b[path], rtol=1e-12, atol=1e-14, err_msg=str(path))


