"""Dense layers whose weights learn online: ``Linear``, ``SignedWLinear``, ``ScaledWSLinear``.

Each class subclasses the ``brainstate.nn`` layer of the same name and keeps its constructor,
parameter pytree and initialisation; only the forward pass changes, so that the weight reaches
the model through :func:`braintrace.matmul`. Masks, signs and weight standardisation run
inside the primitive as its ``weight_fn``: gradients are with respect to the raw stored weight
(exactly zero at masked entries), and D-RTRL stays exact even for standardisation, which mixes
entries, because the trace lives in the space of the transformed weight.

The module also owns the leading-axis folding shared by the dense and low-rank layers: the
dense ETP primitives take ``(in,)`` or ``(batch, in)`` inputs, so ``(..., in)`` inputs are
folded into one batch axis and the result is unfolded afterwards.
"""

from __future__ import annotations

import inspect
from typing import Callable

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._op import matmul
from braintrace._typing import Value
from braintrace.nn._arguments import ArgumentCheck, check_constructor_arguments, size_tuple

__all__ = ["Linear", "SignedWLinear", "ScaledWSLinear"]

Unfold = Callable[[Value], Value]

#: The dense layers' sizes, checked before brainstate's constructor runs.
_DENSE_SIZES: dict[str, ArgumentCheck] = {"in_size": size_tuple, "out_size": size_tuple}


def _identity(y: Value) -> Value:
    return y


def _fold_leading_axes(x: Value) -> tuple[Value, Unfold]:
    """Fold every axis but the last into one batch axis; return the input and its inverse.

    Parameters
    ----------
    x : array or Quantity
        Input of shape ``(..., in)``.

    Returns
    -------
    x2 : array or Quantity
        ``x`` itself when ``x.ndim <= 2``, else ``x`` reshaped to ``(prod(...), in)``.
    unfold : callable
        Maps an output ``(prod(...), out)`` back to ``(..., out)`` (identity when nothing was
        folded). Reshapes go through ``brainunit`` so quantities keep their units.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> x2, unfold = _fold_leading_axes(jnp.ones((2, 5, 3)))
    >>> x2.shape, unfold(jnp.ones((10, 4))).shape
    ((10, 3), (2, 5, 4))
    """
    if u.math.ndim(x) <= 2:
        return x, _identity
    shape = u.math.shape(x)
    lead = tuple(shape[:-1])
    x2 = u.math.reshape(x, (-1, shape[-1]))

    def unfold(y: Value) -> Value:
        return u.math.reshape(y, (*lead, u.math.shape(y)[-1]))

    return x2, unfold


def _mask_fn(mask: Value) -> Callable[[jax.Array], jax.Array]:
    """``w -> w * mask`` on the weight's mantissa (the mask is a plain array)."""
    mask_m = jnp.asarray(u.get_mantissa(mask))

    def apply(w: jax.Array) -> jax.Array:
        return w * mask_m

    return apply


class Linear(brainstate.nn.Linear):
    """Dense layer ``y = x @ W + b`` whose weight and bias learn online.

    The constructor, parameters and initialisation are those of ``brainstate.nn.Linear``;
    the forward pass runs through :func:`braintrace.matmul`, so the layer's parameters get
    eligibility traces when its output drives a hidden state.

    Parameters
    ----------
    in_size, out_size : int or tuple of int
        Input and output sizes; the feature counts are the last entries and the leading
        entries must agree.
    w_init : initializer or array
        Weight initialiser for the ``(in, out)`` weight (default ``KaimingNormal()``).
    b_init : initializer, array or None
        Bias initialiser for the ``(out,)`` bias (default ``ZeroInit()``); ``None`` drops it.
    w_mask : array, initializer or None
        Fixed connectivity mask multiplied into the weight. It is applied inside the
        primitive, so masked entries get exactly zero gradient.
    name : str, optional
    param_type : type
        State class of the parameters (default ``brainstate.ParamState``).

    Attributes
    ----------
    weight : ParamState
        ``{'weight': (in, out), 'bias': (out,)}`` (no ``'bias'`` when ``b_init`` is None).

    Raises
    ------
    ValueError
        If ``in_size`` or ``out_size`` is not a positive int or a tuple of them.

    Notes
    -----
    Inputs ``(in,)`` and ``(batch, in)`` bind the primitive directly; ``(..., in)`` inputs are
    folded into one batch axis and the output is unfolded to ``(..., out)``. Used as a pure
    feed-forward readout (its output reaches no hidden state), the layer is non-temporal: it
    gets its exact one-step gradient, but no eligibility trace.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> layer = braintrace.nn.Linear(3, 4, w_init=jnp.ones((3, 4)))
    >>> layer(jnp.ones((2, 5, 3))).shape
    (2, 5, 4)
    >>> masked = braintrace.nn.Linear(2, 2, w_init=jnp.ones((2, 2)), w_mask=jnp.eye(2))
    >>> masked(jnp.array([1.0, 2.0]))
    Array([1., 2.], dtype=float32)
    """

    __module__ = "braintrace.nn"

    def __init__(self, *args: object, **kwargs: object) -> None:
        check_constructor_arguments(type(self).__name__, super().__init__, args, kwargs, _DENSE_SIZES)
        super().__init__(*args, **kwargs)

    def update(self, x: Value) -> Value:
        params = self.weight.value
        weight_fn = None if self.w_mask is None else _mask_fn(self.w_mask)
        x2, unfold = _fold_leading_axes(x)
        return unfold(matmul(x2, params["weight"], params.get("bias"), weight_fn=weight_fn))


class SignedWLinear(brainstate.nn.SignedWLinear):
    """Dense layer with sign-constrained weights, ``y = x @ (|W| * sign)``, learned online.

    The constructor is that of ``brainstate.nn.SignedWLinear``; ``|W| * sign`` is computed
    inside :func:`braintrace.matmul`, so traces and gradients are with respect to the raw
    ``W`` (useful for Dale's law: excitatory and inhibitory rows keep their sign).

    Parameters
    ----------
    in_size, out_size : int or tuple of int
        Input and output sizes; the weight has shape ``in_size + out_size``.
    w_init : initializer or array
        Weight initialiser (default ``KaimingNormal()``).
    w_sign : array or None
        Fixed sign (or scale) of each weight; ``None`` keeps every weight positive.
    name : str, optional
    param_type : type
        State class of the parameter (default ``brainstate.ParamState``).

    Attributes
    ----------
    weight : ParamState
        The bare ``(in, out)`` weight array (no bias).

    Raises
    ------
    ValueError
        If ``in_size`` or ``out_size`` is not a positive int or a tuple of them.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> sign = jnp.array([[1.0], [-1.0]])
    >>> layer = braintrace.nn.SignedWLinear(2, 1, w_init=-jnp.ones((2, 1)), w_sign=sign)
    >>> layer(jnp.array([3.0, 1.0]))
    Array([2.], dtype=float32)
    """

    __module__ = "braintrace.nn"

    def __init__(self, *args: object, **kwargs: object) -> None:
        check_constructor_arguments(type(self).__name__, super().__init__, args, kwargs, _DENSE_SIZES)
        super().__init__(*args, **kwargs)

    def update(self, x: Value) -> Value:
        sign = None if self.w_sign is None else jnp.asarray(u.get_mantissa(self.w_sign))

        def signed(w: jax.Array) -> jax.Array:
            return jnp.abs(w) if sign is None else jnp.abs(w) * sign

        x2, unfold = _fold_leading_axes(x)
        return unfold(matmul(x2, self.weight.value, weight_fn=signed))


def _standardize(w: jax.Array, eps: float) -> jax.Array:
    """Weight standardisation over every axis but the last (no gain)."""
    axes = tuple(range(w.ndim - 1))
    fan_in = 1
    for axis in axes:
        fan_in *= w.shape[axis]
    mean = jnp.mean(w, axis=axes, keepdims=True)
    var = jnp.var(w, axis=axes, keepdims=True)
    return (w - mean) * jax.lax.rsqrt(jnp.maximum(var * fan_in, eps))


class ScaledWSLinear(brainstate.nn.ScaledWSLinear):
    """Dense layer with scaled weight standardisation whose weight learns online.

    The constructor is that of ``brainstate.nn.ScaledWSLinear``. The forward pass is
    ``(x @ (ws(W) * mask)) * gain + bias`` with
    ``ws(W) = (W - mean) * rsqrt(max(var * fan_in, eps))`` over the input axis, computed
    inside :func:`braintrace.matmul`; this equals the parent's output because the gain is one
    scale per output column.

    Parameters
    ----------
    in_size, out_size : int or tuple of int
        Input and output sizes.
    w_init : initializer or array
        Weight initialiser (default ``KaimingNormal()``).
    b_init : initializer, array or None
        Bias initialiser (default ``ZeroInit()``).
    w_mask : array, initializer or None
        Mask of shape ``(in, 1)`` applied to the standardised weight.
    ws_gain : bool
        Learn a gain of shape ``(1, out)`` (initialised to ones).
    eps : float
        Lower bound of ``var * fan_in``.
    name : str, optional
    param_type : type
        State class of the parameters (default ``brainstate.ParamState``).

    Attributes
    ----------
    weight : ParamState
        ``{'weight': (in, out), 'bias': (out,), 'gain': (1, out)}``.

    Raises
    ------
    ValueError
        If ``in_size`` or ``out_size`` is not a positive int or a tuple of them.

    Notes
    -----
    Only ``'weight'`` passes through the primitive. ``gain`` and ``bias`` act after it, so they
    never carry an eligibility trace: under single-step learning they receive their exact
    one-step gradient only.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> layer = braintrace.nn.ScaledWSLinear(4, 3)
    >>> layer(jnp.ones((2, 4))).shape
    (2, 3)
    """

    __module__ = "braintrace.nn"

    def __init__(self, *args: object, **kwargs: object) -> None:
        check_constructor_arguments(type(self).__name__, super().__init__, args, kwargs, _DENSE_SIZES)
        super().__init__(*args, **kwargs)

    def update(self, x: Value) -> Value:
        params = self.weight.value
        mask = None if self.w_mask is None else jnp.asarray(u.get_mantissa(self.w_mask))
        eps = self.eps

        def standardized(w: jax.Array) -> jax.Array:
            ws = _standardize(w, eps)
            return ws if mask is None else ws * mask

        x2, unfold = _fold_leading_axes(x)
        y = matmul(x2, params["weight"], weight_fn=standardized)
        if "gain" in params:
            # the gain is stored as (1, out); flatten it so an unbatched (out,) output keeps its rank
            y = y * u.math.reshape(params["gain"], (-1,))
        if "bias" in params:
            y = y + params["bias"]
        return unfold(y)


# the constructors keep brainstate's signatures (they only check the sizes first)
setattr(Linear.__init__, "__signature__", inspect.signature(brainstate.nn.Linear.__init__))
setattr(SignedWLinear.__init__, "__signature__", inspect.signature(brainstate.nn.SignedWLinear.__init__))
setattr(ScaledWSLinear.__init__, "__signature__", inspect.signature(brainstate.nn.ScaledWSLinear.__init__))
