"""D_RTRL written by hand in plain JAX for the leaky RNN: the floor a learner's compile and step
are measured against.

The leaky RNN (:class:`~benchmarks.models.LeakyRNN`) is ``h' = σ(τ) h + tanh(x W_in + h W_rec)``
with the readout ``y = h' W_out``. Its D_RTRL holds the two matmuls' outputs fixed in the
hidden-to-hidden Jacobian, so ``D = σ(τ)`` and the traces roll as

* ``ε_in[b, i, j] ← σ(τ_j) ε_in[b, i, j] + x[b, i] (1 − tanh²)[b, j]`` (``W_rec`` the same, ``h``
  in place of ``x``),
* ``ε_τ[b, j] ← σ(τ_j) ε_τ[b, j] + σ'(τ_j) h[b, j]``;

each step's gradient is ``Σ_b δ[b, j] ε[b, i, j]`` with ``δ = ∂L_t/∂h'`` (``W_out``'s is the
readout's own). This is what a JAX user who knows the model would write: one ``lax.scan``, no
custom VJP, no graph. ``tests/test_benchmarks.py`` checks that it computes the learner's
gradient, so its compile and step times are those of the same computation.

``python -m benchmarks`` times it as the row ``D_RTRL by hand`` on ``leaky64``.
"""

from __future__ import annotations

from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp

from benchmarks.models import LeakyRNN

__all__ = ["leaky_d_rtrl_grads", "leaky_d_rtrl_step"]


def leaky_d_rtrl_grads(params: dict[str, jax.Array], xs: jax.Array, ys: jax.Array,
                       loss: Callable[[jax.Array, jax.Array], jax.Array]) -> dict[str, jax.Array]:
    """The single-step D_RTRL gradients of the leaky RNN, summed over the sequence ``xs`` (``(T, B,
    n_in)``) from zero states, each step's loss ``loss(h' W_out, ys[t])``.

    ``params`` holds ``tau``, ``w_in``, ``w_rec`` and ``w_out`` (the model's parameter values).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> p = {"tau": jnp.zeros(2), "w_in": jnp.ones((1, 2)), "w_rec": jnp.zeros((2, 2)),
    ...      "w_out": jnp.ones((2, 1))}
    >>> g = leaky_d_rtrl_grads(p, jnp.ones((3, 1, 1)), jnp.zeros((3, 1, 1)), lambda o, y: jnp.sum((o - y) ** 2))
    >>> sorted(g), g["w_in"].shape
    (['tau', 'w_in', 'w_out', 'w_rec'], (1, 2))
    """
    batch, hidden = xs.shape[1], params["w_rec"].shape[0]
    leak = jax.nn.sigmoid(params["tau"])
    leak_slope = leak * (1 - leak)

    def step(carry: tuple[Any, Any], data: tuple[jax.Array, jax.Array]) -> tuple[tuple[Any, Any], None]:
        (h, e_in, e_rec, e_tau), total = carry
        x, y = data
        drive = jnp.tanh(x @ params["w_in"] + h @ params["w_rec"])
        new_h = leak * h + drive
        df = 1 - drive * drive
        e_in = leak * e_in + x[:, :, None] * df[:, None, :]
        e_rec = leak * e_rec + h[:, :, None] * df[:, None, :]
        e_tau = leak * e_tau + leak_slope * h
        delta, g_out = jax.grad(lambda hh, w: loss(hh @ w, y), argnums=(0, 1))(new_h, params["w_out"])
        grads = {"w_in": jnp.einsum("bj,bij->ij", delta, e_in), "w_rec": jnp.einsum("bj,bij->ij", delta, e_rec),
                 "tau": jnp.sum(delta * e_tau, axis=0), "w_out": g_out}
        return ((new_h, e_in, e_rec, e_tau), jax.tree.map(jnp.add, total, grads)), None

    zeros = jnp.zeros
    start = (zeros((batch, hidden)), zeros((batch, xs.shape[-1], hidden)), zeros((batch, hidden, hidden)),
             zeros((batch, hidden)))
    (_, total), _ = jax.lax.scan(step, (start, jax.tree.map(jnp.zeros_like, params)), (xs, ys))
    return total


def leaky_d_rtrl_step(model: LeakyRNN, loss: Callable[[jax.Array, jax.Array], jax.Array],
                      update: Callable[[Any, Any], Any]) -> Callable[[jax.Array, jax.Array], Any]:
    """A jitted training step over ``model``'s parameters: :func:`leaky_d_rtrl_grads` of the
    sequence averaged over its steps (as ``etrace_grad``'s default ``reduction='mean'``), then
    ``update(param_states, grads)`` (the benchmark's SGD; its result is returned)."""
    if not isinstance(model, LeakyRNN):
        raise TypeError(f"leaky_d_rtrl_step needs a LeakyRNN (its D_RTRL is written out for that "
                        f"model's equations), got a {type(model).__name__}.")
    states = {"tau": model.tau, "w_in": model.w_in, "w_rec": model.w_rec, "w_out": model.w_out}

    @brainstate.transform.jit
    def step(xs: jax.Array, ys: jax.Array) -> Any:
        grads = leaky_d_rtrl_grads({k: st.value for k, st in states.items()}, xs, ys, loss)
        return update(states, {k: g / xs.shape[0] for k, g in grads.items()})

    return step
