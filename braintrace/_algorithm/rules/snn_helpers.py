"""Small building blocks of the spiking-network learning rules.

* :class:`PresynapticTrace` — a leaky sum of presynaptic activity, ``v ← λ v + x`` (OTTT);
* :class:`KappaFilter` — a low-pass filter, ``v ← (1 − κ) x + κ v``;
* :class:`FixedRandomFeedback` — a fixed random matrix ``B`` projecting targets or errors
  (EProp's random feedback, OSTTP-style target projection);
* ``_ZeroResetState`` — the short-term state base the traces share, resettable to zeros with
  an optional batch size;
* ``extract_y_target`` — the target a learner threads through its call arguments.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.rules.snn_helpers import PresynapticTrace, KappaFilter
>>> trace = PresynapticTrace(jnp.zeros(3), leak=0.5)
>>> trace.update(jnp.ones(3)), trace.update(jnp.ones(3))
(Array([1., 1., 1.], dtype=float32), Array([1.5, 1.5, 1.5], dtype=float32))
>>> filt = KappaFilter(jnp.zeros(()), kappa=0.5)
>>> filt.update(jnp.ones(())), filt.update(jnp.ones(()))
(Array(0.5, dtype=float32), Array(0.75, dtype=float32))
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PresynapticTrace", "KappaFilter", "FixedRandomFeedback", "extract_y_target"]

#: A call's argument.
Argument = TypeVar("Argument")


class _ZeroResetState(brainstate.ShortTermState):
    """A ``ShortTermState`` that resets to zeros of its initial shape and dtype.

    Parameters
    ----------
    init_value : array
        The initial value; its shape and dtype are remembered for :meth:`reset_state`.
    """

    def __init__(self, init_value: jax.typing.ArrayLike) -> None:
        value = jnp.asarray(init_value)
        super().__init__(value)
        self._init_shape: tuple[int, ...] = tuple(value.shape)
        self._init_dtype: np.dtype = value.dtype

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Zeros of the initial shape; with ``batch_size`` the leading axis becomes that size
        (a scalar initial value becomes ``(batch_size,)``)."""
        shape = self._init_shape
        if batch_size is not None:
            shape = (batch_size,) if not shape else (batch_size, *shape[1:])
        self.value = jnp.zeros(shape, self._init_dtype)


class PresynapticTrace(_ZeroResetState):
    """A leaky presynaptic trace ``v ← leak · v + x``.

    Parameters
    ----------
    init_value : array
        The initial trace (usually zeros shaped like the presynaptic input).
    leak : float
        The decay per step, ``0 < leak < 1``.

    Raises
    ------
    ValueError
        If ``leak`` is outside ``(0, 1)``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> t = PresynapticTrace(jnp.zeros(2), leak=0.9)
    >>> t.update(jnp.ones(2))
    Array([1., 1.], dtype=float32)
    """

    def __init__(self, init_value: jax.typing.ArrayLike, leak: float) -> None:
        if not 0.0 < float(leak) < 1.0:
            raise ValueError(f"PresynapticTrace: leak must satisfy 0 < leak < 1, got {leak!r}.")
        super().__init__(init_value)
        self.leak = float(leak)

    def update(self, x: jax.Array) -> jax.Array:
        """Advance the trace by one step and return it."""
        self.value = self.leak * self.value + x
        return self.value


class KappaFilter(_ZeroResetState):
    """A low-pass filter ``v ← (1 − κ) · x + κ · v``.

    Parameters
    ----------
    init_value : array
        The initial filter value.
    kappa : float
        The filter constant, ``0 ≤ κ < 1`` (``κ = 0`` passes ``x`` through).

    Raises
    ------
    ValueError
        If ``kappa`` is outside ``[0, 1)``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> KappaFilter(jnp.zeros(()), kappa=0.0).update(jnp.ones(()))
    Array(1., dtype=float32)
    """

    def __init__(self, init_value: jax.typing.ArrayLike, kappa: float) -> None:
        if not 0.0 <= float(kappa) < 1.0:
            raise ValueError(f"KappaFilter: kappa must satisfy 0 <= kappa < 1, got {kappa!r}.")
        super().__init__(init_value)
        self.kappa = float(kappa)

    def update(self, x: jax.Array) -> jax.Array:
        """Filter one more input and return the filtered value."""
        self.value = (1.0 - self.kappa) * x + self.kappa * self.value
        return self.value


class FixedRandomFeedback:
    """A fixed random matrix ``B`` of shape ``(n_target, n_layer)`` (no gradient flows into it).

    Parameters
    ----------
    n_target, n_layer : int
        The shape of ``B``.
    key : int or PRNG key
        The seed or key ``B`` is drawn from.
    init_scale : float
        The standard deviation of the entries.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> fb = FixedRandomFeedback(2, 3, key=0)
    >>> fb.B.shape, fb.project(jnp.ones(2)).shape
    ((2, 3), (3,))
    """

    def __init__(self, n_target: int, n_layer: int, key: int | jax.Array, init_scale: float = 0.1) -> None:
        for name, n in (("n_target", n_target), ("n_layer", n_layer)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"FixedRandomFeedback: {name} must be a positive int, got {n!r}.")
        self.n_target = int(n_target)
        self.n_layer = int(n_layer)
        if isinstance(key, int):
            key = jax.random.PRNGKey(key)
        draw = brainstate.random.normal(size=(self.n_target, self.n_layer), key=key)
        self.B = jax.lax.stop_gradient(init_scale * jnp.asarray(draw))

    def project(self, y_target: jax.typing.ArrayLike) -> jax.Array:
        """``y_target @ B``: ``(..., n_target)`` to ``(..., n_layer)``."""
        return jnp.asarray(y_target) @ self.B


def extract_y_target(args: Sequence[Argument], *, index: int = -1) -> Argument | None:
    """The target among a call's arguments: ``args[index]``, or ``None`` when there are none."""
    if len(args) == 0:
        return None
    return args[index]


PresynapticTrace.__module__ = "braintrace"
KappaFilter.__module__ = "braintrace"
FixedRandomFeedback.__module__ = "braintrace"
