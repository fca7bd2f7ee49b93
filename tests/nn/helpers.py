"""Drivers for the nn tests: quiet compilation, BPTT and online gradients, online training.

Every driver runs its whole loop under one ``brainstate.transform.jit`` (one XLA compilation
per case). Inputs and targets come from NumPy generators so building them compiles nothing.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

import braintrace

Grads = dict[tuple[Any, ...], Any]  # path -> pytree of NumPy arrays


def normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    """A fixed standard-normal array in the default float dtype."""
    value = scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(value, dtype=jnp.result_type(float))


def compile_quiet(model: Any, *example: Any, **kwargs: Any) -> Any:
    """``braintrace.compile`` with the compiler's exclusion warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, braintrace.D_RTRL, *example, **kwargs)


def graph_quiet(model: Any, *example: Any) -> Any:
    """``braintrace.compile_etrace_graph`` with the compiler's warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile_etrace_graph(model, *example)


def squared_error(out: Any, target: Any) -> jax.Array:
    return jnp.sum((out - target) ** 2)


def bptt_grads(model: Any, xs: jax.Array, ys: jax.Array, batch_size: int | None = None) -> Grads:
    """The BPTT gradient of ``Σ_t |model(x_t) - y_t|²`` w.r.t. every ``ParamState``."""
    brainstate.nn.init_all_states(model, batch_size=batch_size)
    params = model.states(brainstate.ParamState)

    def total() -> jax.Array:
        acc = jnp.zeros(())
        for t in range(xs.shape[0]):
            acc = acc + squared_error(model(xs[t]), ys[t])
        return acc

    grads = brainstate.transform.jit(lambda: brainstate.transform.grad(total, params)())()
    return {tuple(p): jax.tree.map(np.asarray, g) for p, g in grads.items()}


def online_grads(learner: Any, xs: jax.Array, ys: jax.Array) -> Grads:
    """Sum over steps of the gradient of ``|learner(x_t) - y_t|²`` (one ``grad`` per step)."""
    params = learner.param_states

    def run() -> Any:
        total = None
        for t in range(xs.shape[0]):
            g = brainstate.transform.grad(
                lambda t=t: squared_error(learner(xs[t]), ys[t]), params
            )()
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        return total

    grads = brainstate.transform.jit(run)()
    return {tuple(p): jax.tree.map(np.asarray, g) for p, g in grads.items()}


def max_rel_err(ref: Grads, got: Grads) -> float:
    """``max |ref - got| / max |ref|``, each parameter normalised by itself."""
    assert set(ref) == set(got), (sorted(ref, key=str), sorted(got, key=str))
    worst = 0.0
    for path in ref:
        for a, b in zip(jax.tree.leaves(ref[path]), jax.tree.leaves(got[path])):
            scale = max(float(np.max(np.abs(a))), 1e-30)
            worst = max(worst, float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / scale)
    return worst


def train_online(
    model: Any, xs: jax.Array, ys: jax.Array, lr: float, epochs: int,
    loss: Callable[[Any, Any], jax.Array] = squared_error, batch_size: int | None = None,
) -> list[float]:
    """Online D-RTRL training with SGD; returns the summed sequence loss of every epoch.

    Each epoch resets the model's states and the traces, runs the sequence one step at a
    time (one ``grad`` per step, accumulated) and then applies ``p -= lr * Σ_t grad_t``.
    """
    learner = compile_quiet(model, xs[0], batch_size=batch_size)
    params = learner.param_states

    def step(x: Any, y: Any) -> Any:
        return brainstate.transform.grad(lambda: loss(learner(x), y), params, return_value=True)()

    @brainstate.transform.jit
    def epoch() -> jax.Array:
        brainstate.nn.reset_all_states(learner, batch_size=batch_size)
        grads, losses = brainstate.transform.for_loop(step, xs, ys)
        for path, state in params.items():
            state.value = jax.tree.map(lambda v, g: v - lr * g.sum(0), state.value, grads[path])
        return losses.sum()

    return [float(epoch()) for _ in range(epochs)]
