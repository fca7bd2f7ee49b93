"""``LRUCell``: the linear recurrent unit (Orvieto et al., 2023) learned online.

The hidden state is complex, stored as two real states ``h_re`` and ``h_im`` rotated and
decayed every step by ``λ = exp(-exp(ν) + i·exp(θ))``. The per-unit parameters ``ν``, ``θ``
and ``γ`` pass through :func:`braintrace.element_wise` and the input maps ``B_re``, ``B_im``
through :func:`braintrace.matmul`, so all five carry eligibility traces; the output maps
``C_re``, ``C_im`` and the skip ``D`` are non-temporal.
"""

from __future__ import annotations

import math

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._op import element_wise
from braintrace._typing import Value
from braintrace.nn._arguments import positive_int
from braintrace.nn._initial import StatesFromInitState
from braintrace.nn._input_check import check_step_input
from braintrace.nn._linear import Linear

__all__ = ["LRUCell"]


def _glorot(shape: tuple[int, ...]) -> jax.Array:
    """``randn(*shape) / sqrt(shape[0])`` from ``brainstate.random``."""
    return brainstate.random.randn(*shape) / math.sqrt(shape[0])


def _check_init_ranges(r_min: float, r_max: float, max_phase: float) -> None:
    if not 0.0 <= r_min <= r_max <= 1.0:
        raise ValueError(
            f"LRUCell: the eigenvalue radii must satisfy 0 <= r_min <= r_max <= 1 for a stable "
            f"recurrence, got r_min={r_min!r}, r_max={r_max!r}."
        )
    if not max_phase > 0:
        raise ValueError(f"LRUCell: max_phase must be positive, got {max_phase!r}.")


class LRUCell(StatesFromInitState, brainstate.nn.Module):
    r"""Linear recurrent unit with a diagonal complex recurrence.

    .. math::

        a = e^{-e^{ν}},\ b = e^{θ},\ c = e^{γ},\quad
        h_{re} \leftarrow a\cos b\, h_{re} - a\sin b\, h_{im} + c\, B_{re} x,\quad
        h_{im} \leftarrow a\sin b\, h_{re} + a\cos b\, h_{im} + c\, B_{im} x,

        y = C_{re} h_{re} - C_{im} h_{im} + x \odot D

    Parameters
    ----------
    d_model : int
        Input and output size.
    d_hidden : int
        Number of complex hidden units.
    r_min, r_max : float
        Range of the eigenvalue radii ``|λ|`` at initialisation (``0 <= r_min <= r_max <= 1``).
    max_phase : float
        Upper bound of the eigenvalue phases at initialisation.

    Attributes
    ----------
    theta_log, nu_log, gamma_log : ParamState
        ``(d_hidden,)``: log phase, log-log decay and log input normalisation
        ``log sqrt(1 - |λ|²)``.
    B_re, B_im : braintrace.nn.Linear
        ``d_model -> d_hidden``, no bias.
    C_re, C_im : braintrace.nn.Linear
        ``d_hidden -> d_model``, no bias.
    D : ParamState
        ``(d_model,)`` skip weights.
    h_re, h_im : HiddenState
        ``(batch?, d_hidden)``, zeros; created by ``init_state``.

    Raises
    ------
    ValueError
        If a size is not a positive int, the radii are outside ``[0, 1]`` or out of order,
        or ``max_phase`` is not positive.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.LRUCell(3, 5)
    >>> cell.init_state(batch_size=2)
    >>> cell(jnp.ones((2, 3))).shape
    (2, 3)
    """

    __module__ = "braintrace.nn._rnn"
    state_names = ("h_re", "h_im")

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        r_min: float = 0.0,
        r_max: float = 1.0,
        max_phase: float = 6.28,
    ) -> None:
        super().__init__()
        d_model = positive_int("LRUCell", "d_model", d_model)
        d_hidden = positive_int("LRUCell", "d_hidden", d_hidden)
        _check_init_ranges(r_min, r_max, max_phase)
        self.d_model, self.d_hidden = d_model, d_hidden
        self.in_size, self.out_size = d_model, d_hidden
        self.r_min, self.r_max, self.max_phase = r_min, r_max, max_phase
        # parameter draws in a fixed order, so a seeded brainstate.random reproduces them
        theta = max_phase * brainstate.random.uniform(size=(d_hidden,))
        self.theta_log = brainstate.ParamState(jnp.log(theta))
        radius_sq = brainstate.random.uniform(size=(d_hidden,)) * (r_max**2 - r_min**2) + r_min**2
        nu_log = jnp.log(-0.5 * jnp.log(radius_sq))
        self.nu_log = brainstate.ParamState(nu_log)
        lam = jnp.exp(-jnp.exp(nu_log) + 1j * jnp.exp(jnp.log(theta)))
        self.gamma_log = brainstate.ParamState(jnp.log(jnp.sqrt(1 - jnp.abs(lam) ** 2)))
        self.B_re = Linear(d_model, d_hidden, w_init=_glorot, b_init=None)
        self.B_im = Linear(d_model, d_hidden, w_init=_glorot, b_init=None)
        self.C_re = Linear(d_hidden, d_model, w_init=_glorot, b_init=None)
        self.C_im = Linear(d_hidden, d_model, w_init=_glorot, b_init=None)
        self.D = brainstate.ParamState(brainstate.random.randn(d_model))

    def _zeros(self, batch_size: int | None) -> jax.Array:
        shape = (self.d_hidden,) if batch_size is None else (batch_size, self.d_hidden)
        return jnp.zeros(shape)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Create ``h_re`` and ``h_im`` as zeros, ``(batch_size, d_hidden)`` or ``(d_hidden,)``."""
        self.h_re = brainstate.HiddenState(self._zeros(batch_size))
        self.h_im = brainstate.HiddenState(self._zeros(batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Zero ``h_re`` and ``h_im``."""
        self.h_re.value = self._zeros(batch_size)
        self.h_im.value = self._zeros(batch_size)

    def update(self, x: Value) -> Value:
        state_shape = tuple(u.math.shape(self.h_re.value))
        check_step_input("LRUCell", x, state_shape[:-1] + (self.d_model,), "h_re", state_shape)
        a = u.math.exp(-u.math.exp(element_wise(self.nu_log.value)))
        b = u.math.exp(element_wise(self.theta_log.value))
        c = u.math.exp(element_wise(self.gamma_log.value))
        a_cos, a_sin = a * u.math.cos(b), a * u.math.sin(b)
        h_re, h_im = self.h_re.value, self.h_im.value
        new_re = a_cos * h_re - a_sin * h_im + c * self.B_re(x)
        new_im = a_sin * h_re + a_cos * h_im + c * self.B_im(x)
        self.h_re.value, self.h_im.value = new_re, new_im
        return self.C_re(new_re) - self.C_im(new_im) + x * element_wise(self.D.value)
