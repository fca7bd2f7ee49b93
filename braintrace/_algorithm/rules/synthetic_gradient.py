"""``SyntheticGradient``: a per-group affine estimate of the future loss gradient.

:class:`~braintrace.DNI` injects, at every window exit, an estimate ``g ≈ ∂(future loss)/∂h`` of
each hidden group's gradient, read off the group's exit value ``h`` of shape ``(*varshape, S)``
(the group's members stacked on a trailing state axis). :class:`SyntheticGradient` is the
default estimator: per group, an affine map on the last varshape axis and the state axis
flattened together (width ``w = varshape[-1]·S``), the leading axes (a batch, ...) mapped with
the same weights::

    g[..., :] = (h[..., :].reshape(..., w) @ W + b).reshape(h.shape)

``W`` ``(w, w)`` is drawn ``scale · N(0, 1)``, ``b`` is zero, both float32 ``ParamState`` s
outside the model: no relation reads them and the online loss gives them no gradient. With the
default ``scale=0`` it predicts exactly zero, so an untrained DNI is plain multi-step D_RTRL.
Fit it with :func:`~braintrace.train_synthetic_gradient`, which records the window length
it used (:attr:`SyntheticGradient.fitted_chunk_size`).

:meth:`SyntheticGradient.param_values` and :meth:`SyntheticGradient.apply` are the override
seam: a subclass may return any pytree of values from the first (they reach the learner's
update as an explicit argument) and compute any estimate from them in the second.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> synth = braintrace.SyntheticGradient({0: (2, 4, 1)}, scale=0.1, seed=3)
>>> {k: v[0].shape for k, v in synth.param_values().items()}  # width 4 · 1
{'w': (4, 4), 'b': (4,)}
>>> synth.apply(synth.param_values(), {0: jnp.ones((2, 4, 1))})[0].shape
(2, 4, 1)
>>> zero = braintrace.SyntheticGradient({0: (2, 4, 1)})
>>> float(jnp.abs(zero.apply(zero.param_values(), {0: jnp.ones((2, 4, 1))})[0]).max())
0.0
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Mapping

import brainstate
import jax
import jax.numpy as jnp

__all__ = ["SyntheticGradient", "group_width"]

Shape = tuple[int, ...]
#: The synthesiser's parameter values, ``{'w': {gi: W}, 'b': {gi: b}}``.
SynthParams = dict[str, dict[int, jax.Array]]


def group_width(shape: Shape) -> int:
    """``varshape[-1] · S`` of a group signal shape ``(*varshape, S)`` (``S`` for a scalar varshape)."""
    return shape[-1] if len(shape) == 1 else shape[-2] * shape[-1]


def _trailing(shape: Shape) -> Shape:
    """The axes the affine map mixes: ``(varshape[-1], S)`` (``(S,)`` for a scalar varshape)."""
    return tuple(shape[-2:]) if len(shape) >= 2 else tuple(shape)


def _check_group_shapes(group_shapes: object) -> dict[int, Shape]:
    """``{group index: (*varshape, S)}`` with int indices and positive int axes."""
    if not isinstance(group_shapes, Mapping) or not group_shapes:
        raise TypeError(
            f"SyntheticGradient: group_shapes must be a non-empty dict {{group index: (*varshape, S)}}, "
            f"e.g. learner.group_signal_shapes(), got {type(group_shapes).__name__} {group_shapes!r}.")
    out: dict[int, Shape] = {}
    for index, shape in group_shapes.items():
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"SyntheticGradient: group indices must be ints, got {index!r} "
                            f"(use learner.group_signal_shapes()).")
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise TypeError(f"SyntheticGradient: the shape of group {index} must be a tuple of ints "
                            f"(*varshape, S), got {shape!r}.") from None
        if not dims or any(isinstance(d, bool) or d < 1 for d in dims):
            raise ValueError(f"SyntheticGradient: the shape of group {index} must be a non-empty tuple of "
                             f"positive ints (*varshape, S), got {shape!r}.")
        out[int(index)] = dims
    return out


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"SyntheticGradient: scale must be a float (the std of W's draws), got {scale!r}.")
    if not math.isfinite(float(scale)) or scale < 0:
        raise ValueError(f"SyntheticGradient: scale must be a finite float >= 0, got {scale!r}; "
                         f"scale=0 (the default) predicts exactly zero.")
    return float(scale)


def _check_optional_width(hidden_width: object) -> int | None:
    if hidden_width is None:
        return None
    if isinstance(hidden_width, bool) or not isinstance(hidden_width, numbers.Integral) or hidden_width < 1:
        raise ValueError(f"SyntheticGradient: hidden_width must be None or a positive int, got {hidden_width!r}.")
    return int(hidden_width)


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"SyntheticGradient: seed must be an int, got {seed!r}.")
    return int(seed)


class SyntheticGradient:
    """A per-group affine estimate of the future gradient at a hidden state (see the module docstring).

    Parameters
    ----------
    group_shapes : dict
        ``{group index: (*varshape, S)}``, the learner's :meth:`DNI.group_signal_shapes`.
    hidden_width : int, optional
        Accepted for upstream's signature and unused: the map is affine, without a hidden layer.
    scale : float
        Standard deviation of ``W``'s draws (default ``0``: the estimate is exactly zero).
    seed : int
        Seed of the draws (``brainstate.random.seed_context``).

    Attributes
    ----------
    group_shapes : dict
        ``{group index: (*varshape, S)}``.
    fitted_chunk_size : int or None
        The window length :func:`~braintrace.train_synthetic_gradient` fitted it at (``None``:
        never fitted). A DNI learner refuses windows of another length: the estimate predicts
        the gradient of the loss beyond a window of that length.

    Raises
    ------
    TypeError
        For a ``group_shapes`` that is not a dict of int indices to int tuples, or a
        non-number ``scale`` / non-int ``seed``.
    ValueError
        For an empty or non-positive shape, a negative or infinite ``scale``, or a
        ``hidden_width`` that is not a positive int.

    Examples
    --------
    >>> import braintrace
    >>> synth = braintrace.SyntheticGradient({0: (4, 1), 1: (3, 2)}, scale=0.01)
    >>> {k: st.value.shape for k, st in synth.states_dict().items()}
    {('synth_w', 0): (4, 4), ('synth_b', 0): (4,), ('synth_w', 1): (6, 6), ('synth_b', 1): (6,)}
    >>> synth.fitted_chunk_size is None
    True
    """

    def __init__(self, group_shapes: Mapping[int, Shape], hidden_width: int | None = None,
                 scale: float = 0.0, seed: int = 0) -> None:
        self.group_shapes = _check_group_shapes(group_shapes)
        self.hidden_width = _check_optional_width(hidden_width)
        self.scale = _check_scale(scale)
        self.seed = _check_seed(seed)
        self.fitted_chunk_size: int | None = None
        self._weights: dict[int, brainstate.ParamState] = {}
        self._biases: dict[int, brainstate.ParamState] = {}
        with brainstate.random.seed_context(self.seed):
            for index, shape in self.group_shapes.items():
                width = group_width(shape)
                draw = brainstate.random.randn(width, width).astype(jnp.float32)
                self._weights[index] = brainstate.ParamState(self.scale * draw)
                self._biases[index] = brainstate.ParamState(jnp.zeros((width,), jnp.float32))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(group_shapes={self.group_shapes}, scale={self.scale}, "
                f"fitted_chunk_size={self.fitted_chunk_size})")

    def states_dict(self) -> dict[tuple[str, int], brainstate.ParamState]:
        """``{('synth_w', gi): W, ('synth_b', gi): b}``: the states an optimizer trains."""
        out: dict[tuple[str, int], brainstate.ParamState] = {}
        for index in self.group_shapes:
            out[("synth_w", index)] = self._weights[index]
            out[("synth_b", index)] = self._biases[index]
        return out

    def param_values(self) -> SynthParams:
        """The current parameter values, ``{'w': {gi: W}, 'b': {gi: b}}`` (what :meth:`apply` reads)."""
        return {"w": {i: st.value for i, st in self._weights.items()},
                "b": {i: st.value for i, st in self._biases.items()}}

    def apply(self, param_values: SynthParams, group_hiddens: Mapping[int, jax.Array]) -> dict[int, jax.Array]:
        """The estimate of every group in ``group_hiddens`` (``{gi: (*varshape, S)}``), in its dtype.

        Raises
        ------
        ValueError
            For a group it has no map for, or a value whose trailing ``(varshape[-1], S)`` axes
            differ from the group's.
        """
        out = {}
        for index, hidden in group_hiddens.items():
            if index not in self.group_shapes:
                raise ValueError(f"SyntheticGradient has no map for hidden group {index}; it was built for "
                                 f"groups {sorted(self.group_shapes)}.")
            mixed = _trailing(self.group_shapes[index])
            shape = tuple(jnp.shape(hidden))
            if shape[len(shape) - len(mixed):] != mixed:
                raise ValueError(
                    f"SyntheticGradient: hidden group {index} has shape {shape}, but its map was built for "
                    f"{self.group_shapes[index]} (trailing axes {mixed}). Build it from "
                    f"learner.group_signal_shapes().")
            flat = jnp.reshape(hidden, (*shape[:len(shape) - len(mixed)], group_width(mixed)))
            estimate = flat @ param_values["w"][index] + param_values["b"][index]
            out[index] = jnp.reshape(estimate, shape).astype(jnp.result_type(hidden))
        return out


SyntheticGradient.__module__ = "braintrace"
