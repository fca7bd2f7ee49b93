"""Learning signals that replace ``g = ∂L/∂h``: ``learning_signal='random_feedback'``.

Per hidden group a fixed square matrix ``B`` (``n × n``, ``n`` the last axis of the group's
shape), all drawn inside one ``seed_context(random_feedback_key)``; the group's signal
``g`` (``(*varshape, S)``) is normalised over its hidden axis per state and projected,
``L[..., k, a] = Σ_l ĝ[..., l, a] B[l, k]`` with ``ĝ = g / (‖g‖₂ + 1e-8)``. An engine keeps ``g``
next to ``L`` (:class:`SignalPair`) where its same-step term must be swapped out.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.engine.learning_signal import project_feedback
>>> project_feedback(jnp.array([[3.0], [4.0]]), jnp.eye(2))  # ĝ = g / ‖g‖ through B = I
Array([[0.6],
       [0.8]], dtype=float32)
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.rules.snn_helpers import FixedRandomFeedback
from braintrace._compiler import ETraceGraph

__all__ = ["SignalPair", "draw_feedback", "feedback_signals", "project_feedback"]


class SignalPair(NamedTuple):
    """A group's autodiff signal ``g = ∂L/∂h`` next to the learning signal that replaces it."""

    autodiff: jax.Array
    learning: jax.Array


def draw_feedback(graph: ETraceGraph, key: int | jax.Array) -> dict[int, FixedRandomFeedback]:
    """One ``(n, n)`` matrix per hidden group that a relation trains, drawn from ``key``.

    The draws follow the relations' order (then their groups'), so every engine given the same
    key and model gets the same matrices.
    """
    matrices: dict[int, FixedRandomFeedback] = {}
    with brainstate.random.seed_context(key):
        for rel in graph.hidden_param_op_relations:
            for group in rel.hidden_groups:
                if group.index not in matrices:
                    n = group.varshape[-1] if group.varshape else 1
                    matrices[group.index] = FixedRandomFeedback(n, n, key=brainstate.random.split_key(), init_scale=0.1)
    return matrices


def feedback_signals(
    signals: Sequence[jax.Array], matrices: dict[int, FixedRandomFeedback], graph: ETraceGraph, learner: str
) -> list[jax.Array]:
    """The random-feedback learning signal of every group a relation trains (others unchanged).

    Raises
    ------
    RuntimeError
        If a trained group has no matrix (they are drawn when the learner compiles).
    """
    out = list(signals)
    for group in {g.index: g for rel in graph.hidden_param_op_relations for g in rel.hidden_groups}.values():
        fb = matrices.get(group.index)
        if fb is None:
            raise RuntimeError(
                f"{learner}: learning_signal='random_feedback' but hidden group {group.index} "
                f"({group.hidden_paths}) has no feedback matrix; they are drawn by compile_graph. Build "
                f"the learner with braintrace.compile(...) (the symmetric signal is never substituted).")
        out[group.index] = project_feedback(out[group.index], fb.B)
    return out


def project_feedback(signal: jax.Array, B: jax.Array) -> jax.Array:
    """``L[..., k, a] = Σ_l ŝ[..., l, a] B[l, k]`` with ``ŝ`` normalised over the hidden axis.

    Raises
    ------
    ValueError
        If ``B`` is not square of the signal's hidden width (its second-to-last axis).
    """
    if signal.ndim < 2:  # a scalar group has one hidden unit
        return project_feedback(signal[None], B)[0]
    width = signal.shape[-2]
    if tuple(B.shape) != (width, width):
        raise ValueError(
            f"random feedback: the matrix B has shape {tuple(B.shape)}, but the learning signal "
            f"{tuple(signal.shape)} has {width} units on its hidden axis; B must be ({width}, {width}), "
            f"hidden to hidden (a readout-sized matrix does not apply).")
    norm = jnp.linalg.norm(signal, axis=-2, keepdims=True)
    unit = signal / (norm + 1e-8)
    return jnp.einsum("...la,lk->...ka", unit, B.astype(signal.dtype))
