"""``LeakyRateReadout``: a leaky-integrator readout whose weight learns through its own trace.

A plain ``Linear`` on the model output is non-temporal (its output reaches no hidden state).
This readout keeps its output ``r`` in a ``HiddenState`` that integrates the projected input,
so its weight forms a relation with ``r`` and is trained by the eligibility trace.
"""

from __future__ import annotations

import brainstate
import braintools
import brainunit as u

from braintrace._op import matmul
from braintrace._typing import Initializer, Value
from braintrace.nn._arguments import check_time_constant, size_tuple
from braintrace.nn._initial import StatesFromInitState, initial_state
from braintrace.nn._input_check import check_step_input
from braintrace.nn._linear import _fold_leading_axes

__all__ = ["LeakyRateReadout"]


def _decay(tau: Value) -> Value:
    """``exp(-dt / tau)``; the step ``dt`` comes from the brainstate environment."""
    try:
        dt = brainstate.environ.get_dt()
    except KeyError as err:
        raise KeyError(
            "LeakyRateReadout needs the simulation step at construction: set it with "
            "brainstate.environ.set(dt=1.0 * brainunit.ms) or build the layer inside "
            "brainstate.environ.context(dt=...)."
        ) from err
    return u.math.exp(-1.0 / u.maybe_decimal(tau / dt))


class LeakyRateReadout(StatesFromInitState, brainstate.nn.Module):
    """Leaky rate readout ``r ← decay · r + x @ W``, ``decay = exp(-dt / tau)``.

    Parameters
    ----------
    in_size, out_size : int or tuple of int
        Input and output sizes; only their first entries size the weight.
    tau : Quantity or array
        Time constant, positive, broadcast to ``out_size`` (default ``5 ms``); it must have the
        unit of the environment's ``dt``.
    w_init : initializer or array
        Initialiser of the ``(in, out)`` weight (default ``braintools.init.KaimingNormal()``).
    r_init : initializer or array
        Initialiser of the readout state (default ``braintools.init.ZeroInit()``).
    name : str, optional

    Attributes
    ----------
    W : ParamState
        The bare ``(in, out)`` weight (no bias).
    r : HiddenState
        The readout, ``(batch, *out_size)`` or ``out_size``; created by ``init_state``.
    decay : array
        ``exp(-dt / tau)``, computed at construction.

    Raises
    ------
    KeyError
        If no ``dt`` is set in the brainstate environment at construction.
    ValueError
        If a size is not a positive int or tuple of them, or ``tau`` is not positive.

    Examples
    --------
    >>> import brainstate, brainunit as u, jax.numpy as jnp, braintrace
    >>> with brainstate.environ.context(dt=1.0 * u.ms):
    ...     readout = braintrace.nn.LeakyRateReadout(3, 2, tau=5.0 * u.ms, w_init=jnp.ones((3, 2)))
    >>> readout.init_state()
    >>> readout(jnp.ones(3))
    Array([3., 3.], dtype=float32)
    >>> float(readout.decay)  # exp(-1 / 5)
    0.8187...
    >>> bool(jnp.allclose(readout(jnp.ones(3)), 3.0 * readout.decay + 3.0))
    True
    """

    __module__ = "braintrace.nn"
    state_names = ("r",)

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        tau: Value = 5.0 * u.ms,
        w_init: Initializer = braintools.init.KaimingNormal(),
        r_init: Initializer = braintools.init.ZeroInit(),
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        self.in_size = size_tuple("LeakyRateReadout", "in_size", in_size)
        self.out_size = size_tuple("LeakyRateReadout", "out_size", out_size)
        self._r_initializer = r_init
        self.tau = braintools.init.param(tau, self.out_size)
        check_time_constant("LeakyRateReadout", "tau", self.tau)
        self.decay = _decay(self.tau)
        self.W = brainstate.ParamState(
            braintools.init.param(w_init, (self.in_size[0], self.out_size[0]), allow_none=False)
        )

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.r = brainstate.HiddenState(
            initial_state(self._r_initializer, self.out_size, batch_size)
        )

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.r.value = initial_state(self._r_initializer, self.out_size, batch_size)

    def update(self, x: Value) -> Value:
        state_shape = tuple(u.math.shape(self.r.value))
        leading = state_shape[: len(state_shape) - len(self.out_size)]
        check_step_input("LeakyRateReadout", x, leading + (self.in_size[0],), "r", state_shape)
        x2, unfold = _fold_leading_axes(x)
        self.r.value = self.decay * self.r.value + unfold(matmul(x2, self.W.value))
        return self.r.value
