"""``GradExpon``: a leaky accumulator of gradients, ``g ← decay · g + grads``.

Online learners produce one gradient per step; accumulating them with a leak lets an
optimiser apply updates less often than the model steps while older contributions fade.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> acc = braintrace.GradExpon({'w': jnp.zeros(2)}, 0.9)
>>> acc.update({'w': jnp.ones(2)}); acc.update({'w': jnp.ones(2)})
>>> acc.gradients.value['w']
Array([1.9, 1.9], dtype=float32)
"""

from __future__ import annotations

import brainstate
import brainunit as u
import jax
import numpy as np

from braintrace._typing import PyTree

__all__ = ["GradExpon"]


def _decay_of(tau_or_decay: u.Quantity | float) -> float:
    """The per-step decay from a time constant (a Quantity) or a decay (a float in (0, 1))."""
    if isinstance(tau_or_decay, u.Quantity):
        dt = brainstate.environ.get_dt()
        return float(np.exp(-1.0 / u.maybe_decimal(tau_or_decay / dt)))
    # bool is an int and np.float32 is not a float: both are refused like any other type.
    if isinstance(tau_or_decay, float):
        if not 0.0 < tau_or_decay < 1.0:
            raise ValueError(
                f"GradExpon: a float tau_or_decay is the decay and must satisfy 0 < decay < 1, got "
                f"{tau_or_decay!r}. Pass e.g. 0.9, or a time constant such as 10. * u.ms."
            )
        return float(tau_or_decay)
    raise TypeError(
        f"GradExpon: tau_or_decay must be a brainunit Quantity time constant (e.g. 10. * u.ms) or "
        f"a float decay in (0, 1), got {tau_or_decay!r} of type {type(tau_or_decay).__name__}."
    )


class GradExpon(brainstate.nn.Module):
    """Leaky gradient accumulator: ``gradients ← decay · gradients + grads`` on each update.

    Parameters
    ----------
    grad_shape : pytree
        A pytree of arrays (or quantities) shaped like the gradients; the accumulator starts
        at zeros of the same shapes, dtypes and units.
    tau_or_decay : brainunit.Quantity or float
        A time constant ``τ`` (the decay is ``exp(−dt / τ)`` with ``dt`` from
        ``brainstate.environ.get_dt()`` read at construction), or the decay itself, a float
        in the open interval ``(0, 1)``.

    Attributes
    ----------
    gradients : brainstate.LongTermState
        The accumulated gradients.
    decay : float

    Raises
    ------
    ValueError
        If a float ``tau_or_decay`` is outside ``(0, 1)``.
    TypeError
        If ``tau_or_decay`` is neither a Quantity nor a float.

    Examples
    --------
    >>> import brainstate, brainunit as u, jax.numpy as jnp, braintrace
    >>> with brainstate.environ.context(dt=0.1 * u.ms):
    ...     acc = braintrace.GradExpon(jnp.zeros(3), 1. * u.ms)
    >>> round(acc.decay, 4)
    0.9048
    """

    def __init__(self, grad_shape: PyTree, tau_or_decay: u.Quantity | float) -> None:
        super().__init__()
        self.decay = _decay_of(tau_or_decay)
        zeros = jax.tree.map(u.math.zeros_like, grad_shape, is_leaf=u.math.is_quantity)
        self.gradients = brainstate.LongTermState(zeros)

    def update(self, grads: PyTree) -> None:
        """Accumulate one gradient pytree (same structure as ``grad_shape``)."""
        self.gradients.value = jax.tree.map(
            lambda g, new: self.decay * g + new, self.gradients.value, grads, is_leaf=u.math.is_quantity
        )

