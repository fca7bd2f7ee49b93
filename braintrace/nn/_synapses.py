"""Synaptic filters ``Expon``, ``Alpha``, ``DualExpon``, built and updated like ``brainpy.state``'s.

Each filter keeps its conductance-like variables in ``brainstate.HiddenState``s, decays them by
one exponential-Euler step (``x ← x − (1 − e^{−dt/τ}) x``, exact for a pure decay), adds the
input ``x`` of the step, and returns the filtered signal. The step ``dt`` is read from
``brainstate.environ`` at every update, and every time constant may be given as a
``brainstate.ParamState`` to train it online (see :mod:`braintrace.nn._constants`).

Driven by an ETP operation (``Expon(matmul(spikes, W))``), a filter is an element-wise
recurrence, so ``W`` and the time constants are in D_RTRL's exact class.
"""

from __future__ import annotations

import brainstate
import braintools
import brainunit as u
import numpy as np

from braintrace._typing import Constant, Initializer, Size, Value
from braintrace.nn._constants import ConstantsDynamics
from braintrace.nn._initial import initial_state
from braintrace.nn._input_check import check_broadcast_input, check_input_unit

__all__ = ["Expon", "Alpha", "DualExpon"]


def _state(init: Initializer, varshape: tuple[int, ...], batch_size: int | None) -> Value:
    return initial_state(init, varshape, batch_size)


def _checked_input(layer: str, x: Value, name: str, state: Value) -> Value:
    """``x``, checked to broadcast onto ``state`` and to be in its unit (it is added to it).

    Raises
    ------
    ValueError
        If it does not broadcast (shape), or is not in ``state``'s unit (an ``InputUnitError``,
        also a brainunit ``UnitMismatchError``); a plain zero fits any unit.
    """
    check_broadcast_input(layer, x, name, u.math.shape(state))
    unit = u.get_unit(state)
    where = "unitless" if unit.is_unitless else f"in {unit}"
    return check_input_unit(layer, x, unit, f"it is added to the state {name} ({where})")


class Expon(ConstantsDynamics):
    r"""Exponential synapse, ``dg/dt = −g/τ``, plus the input of each step.

    ``g ← g e^{−dt/τ} + x``: a unit input at one step is read as ``e^{−k dt/τ}`` ``k`` steps
    later. As in ``brainpy.state.Expon``, the input is added after the decay and the new ``g``
    is returned.

    Parameters
    ----------
    in_size : int or tuple of int
        Population shape.
    name : str, optional
    tau : Quantity, array or ParamState
        Decay time constant (default ``8 ms``), in the unit of the environment's ``dt``; a
        ``ParamState`` of shape ``in_size`` makes it trainable.
    g_initializer : initializer or array
        Initial conductance (default ``braintools.init.Constant(0 mS)``).

    Attributes
    ----------
    g : HiddenState
        Conductance, ``(batch, *in_size)`` or ``in_size``; created by ``init_state``.

    Raises
    ------
    ValueError
        If ``in_size`` is not a positive int or a tuple of them, the time constant is not
        positive everywhere, or a ``ParamState`` one does not have shape ``in_size``; at the
        call, if the input does not broadcast onto the state or is not in its unit
        (``g_initializer``'s, ``mS`` by default: multiply a plain input by ``brainunit.mS``).

    Examples
    --------
    >>> import brainstate, brainunit as u, braintrace
    >>> syn = braintrace.nn.Expon(2, tau=4.0 * u.ms)
    >>> syn.init_state()
    >>> with brainstate.environ.context(dt=1.0 * u.ms):
    ...     g = [syn(1.0 * u.mS if t == 0 else None) for t in range(3)]
    >>> g[2]  # e^{-2/4}
    Quantity([0.6065... 0.6065...], "mS")
    """

    __module__ = "braintrace.nn"
    state_names = ("g",)

    def __init__(
        self,
        in_size: Size,
        name: str | None = None,
        tau: Constant = 8.0 * u.ms,
        g_initializer: Initializer = braintools.init.Constant(0.0 * u.mS),
    ) -> None:
        super().__init__(in_size, name=name)
        self.tau = self._constant("tau", tau, time_constant=True)
        self.g_initializer = g_initializer

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Create ``g`` from ``g_initializer``."""
        self.g = brainstate.HiddenState(_state(self.g_initializer, self.varshape, batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Re-initialise ``g`` in place (the state object is kept)."""
        self.g.value = _state(self.g_initializer, self.varshape, batch_size)

    def update(self, x: Value | None = None) -> Value:
        """Decay ``g`` by one step, add ``x`` (if given) and return the new ``g``."""
        if x is not None:
            x = _checked_input(type(self).__name__, x, "g", self.g.value)
        g = self.g.value
        g = g - self._step_fraction(self._read(self.tau)) * g
        if x is not None:
            g = g + x
        self.g.value = g
        return g


class Alpha(ConstantsDynamics):
    r"""Alpha-function synapse: ``dh/dt = −h/τ``, ``dg/dt = (h − g)/τ``; returns ``g``.

    The input enters ``h``; ``g`` follows ``h`` with the same time constant, so a unit input
    gives ``g(t) = (t/τ) e^{−t/τ}`` in continuous time, peaking at ``t = τ``. As in
    ``brainpy.state.Alpha``, ``g`` moves towards the ``h`` entering the step and the input of
    a step reaches ``g`` at the next one.

    Parameters
    ----------
    in_size : int or tuple of int
        Population shape.
    name : str, optional
    tau : Quantity, array or ParamState
        Time constant (default ``8 ms``); a ``ParamState`` of shape ``in_size`` makes it
        trainable.
    g_initializer : initializer or array
        Initial value of both ``g`` and ``h`` (default ``braintools.init.Constant(0 mS)``).

    Attributes
    ----------
    g, h : HiddenState
        Conductance and its driving variable, ``(batch, *in_size)`` or ``in_size``.

    Raises
    ------
    ValueError
        If ``in_size`` is not a positive int or a tuple of them, the time constant is not
        positive everywhere, or a ``ParamState`` one does not have shape ``in_size``; at the
        call, if the input does not broadcast onto the state or is not in its unit
        (``g_initializer``'s, ``mS`` by default: multiply a plain input by ``brainunit.mS``).

    Examples
    --------
    >>> import brainstate, brainunit as u, jax.numpy as jnp, braintrace
    >>> syn = braintrace.nn.Alpha(1, tau=5.0 * u.ms)
    >>> syn.init_state()
    >>> with brainstate.environ.context(dt=0.1 * u.ms):
    ...     g = [float(syn(1.0 * u.mS if t == 0 else None)[0].to_decimal(u.mS)) for t in range(200)]
    >>> round(0.1 * int(jnp.argmax(jnp.asarray(g))), 1)  # the peak, in ms: tau
    5.0
    """

    __module__ = "braintrace.nn"
    state_names = ("g", "h")

    def __init__(
        self,
        in_size: Size,
        name: str | None = None,
        tau: Constant = 8.0 * u.ms,
        g_initializer: Initializer = braintools.init.Constant(0.0 * u.mS),
    ) -> None:
        super().__init__(in_size, name=name)
        self.tau = self._constant("tau", tau, time_constant=True)
        self.g_initializer = g_initializer

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Create ``g`` and ``h`` from ``g_initializer``."""
        self.g = brainstate.HiddenState(_state(self.g_initializer, self.varshape, batch_size))
        self.h = brainstate.HiddenState(_state(self.g_initializer, self.varshape, batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Re-initialise ``g`` and ``h`` in place (the state objects are kept)."""
        self.g.value = _state(self.g_initializer, self.varshape, batch_size)
        self.h.value = _state(self.g_initializer, self.varshape, batch_size)

    def update(self, x: Value | None = None) -> Value:
        """Advance ``g`` towards ``h``, decay ``h`` and add ``x`` (if given) to it; return ``g``."""
        if x is not None:
            x = _checked_input(type(self).__name__, x, "h", self.h.value)
        k = self._step_fraction(self._read(self.tau))
        g, h = self.g.value, self.h.value
        self.g.value = g + k * (h - g)
        h = h - k * h
        self.h.value = h if x is None else h + x
        return self.g.value


class DualExpon(ConstantsDynamics):
    r"""Dual-exponential synapse: the difference of a slow and a fast exponential.

    ``g_rise`` and ``g_decay`` both receive the input and decay with ``tau_rise`` and
    ``tau_decay``; the output is ``A (g_decay − g_rise)``. With ``normalize=True`` (as in
    ``brainpy.state.DualExpon``) ``A = amplitude / peak``, where ``peak = r^{r/(1−r)} (1 − r)``,
    ``r = tau_rise / tau_decay``, is the continuous-time maximum of ``e^{−t/τ_d} − e^{−t/τ_r}``
    (reached at ``t* = τ_r τ_d ln(τ_d/τ_r) / (τ_d − τ_r)``), so a unit input peaks near
    ``amplitude``; otherwise ``A = amplitude``.

    Parameters
    ----------
    in_size : int or tuple of int
        Population shape.
    name : str, optional
    tau_decay : Quantity, array or ParamState
        Decay time constant (default ``10 ms``); a ``ParamState`` makes it trainable.
    tau_rise : Quantity, array or ParamState
        Rise time constant (default ``1 ms``); a ``ParamState`` makes it trainable.
    amplitude : float or array
        Output scale (default 1).
    normalize : bool
        Divide by the peak of the unit response (default ``True``).
    g_initializer : initializer or array
        Initial value of both components (default ``braintools.init.Constant(0 mS)``).

    Attributes
    ----------
    g_rise, g_decay : HiddenState
        The two components, ``(batch, *in_size)`` or ``in_size``.

    Raises
    ------
    ValueError
        If ``in_size`` is not a positive int or a tuple of them, a time constant is not
        positive everywhere, ``normalize`` and ``tau_rise == tau_decay`` somewhere (use
        :class:`Alpha`), or a ``ParamState`` time constant does not have shape ``in_size``; at
        the call, if the input does not broadcast onto the state or is not in its unit
        (``g_initializer``'s, ``mS`` by default: multiply a plain input by ``brainunit.mS``).

    Examples
    --------
    >>> import brainstate, brainunit as u, jax.numpy as jnp, braintrace
    >>> syn = braintrace.nn.DualExpon(1, tau_decay=5.0 * u.ms, tau_rise=0.5 * u.ms)
    >>> syn.init_state()
    >>> with brainstate.environ.context(dt=0.01 * u.ms):
    ...     g = jnp.asarray([syn(1.0 * u.mS if t == 0 else None)[0].to_decimal(u.mS) for t in range(500)])
    >>> round(float(g.max()), 2), round(0.01 * int(g.argmax()), 2)  # peak 1 at t* = 1.28 ms
    (1.0, 1.28)
    """

    __module__ = "braintrace.nn"
    state_names = ("g_rise", "g_decay")

    def __init__(
        self,
        in_size: Size,
        name: str | None = None,
        tau_decay: Constant = 10.0 * u.ms,
        tau_rise: Constant = 1.0 * u.ms,
        amplitude: Value = 1.0,
        normalize: bool = True,
        g_initializer: Initializer = braintools.init.Constant(0.0 * u.mS),
    ) -> None:
        super().__init__(in_size, name=name)
        self.tau_decay = self._constant("tau_decay", tau_decay, time_constant=True)
        self.tau_rise = self._constant("tau_rise", tau_rise, time_constant=True)
        self.amplitude = self._constant("amplitude", amplitude, trainable=False)
        self.normalize = normalize
        self.g_initializer = g_initializer
        if normalize:
            self._check_distinct()

    def _check_distinct(self) -> None:
        def value(stored: Constant) -> Value:
            return stored.value if isinstance(stored, brainstate.ParamState) else stored

        gap = u.get_magnitude(value(self.tau_decay) - value(self.tau_rise))
        if np.any(np.asarray(gap) == 0.0):
            raise ValueError(
                "DualExpon: tau_decay must differ from tau_rise when normalize=True (the peak "
                "normalisation divides by their difference); use Alpha for equal time constants."
            )

    def _peak_scale(self, tau_rise: Value, tau_decay: Value) -> Value:
        """``1 / peak`` of the continuous-time unit response ``e^{−t/τ_d} − e^{−t/τ_r}``."""
        r = u.maybe_decimal(tau_rise / tau_decay)
        return 1.0 / (u.math.power(r, r / (1.0 - r)) * (1.0 - r))

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Create ``g_rise`` and ``g_decay`` from ``g_initializer``."""
        self.g_rise = brainstate.HiddenState(_state(self.g_initializer, self.varshape, batch_size))
        self.g_decay = brainstate.HiddenState(_state(self.g_initializer, self.varshape, batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Re-initialise both components in place (the state objects are kept)."""
        self.g_rise.value = _state(self.g_initializer, self.varshape, batch_size)
        self.g_decay.value = _state(self.g_initializer, self.varshape, batch_size)

    def update(self, x: Value | None = None) -> Value:
        """Decay both components, add ``x`` (if given) to each, return ``A (g_decay − g_rise)``."""
        if x is not None:
            x = _checked_input(type(self).__name__, x, "g_rise", self.g_rise.value)
        tau_rise, tau_decay = self._read(self.tau_rise), self._read(self.tau_decay)
        g_rise, g_decay = self.g_rise.value, self.g_decay.value
        g_rise = g_rise - self._step_fraction(tau_rise, "tau_rise") * g_rise
        g_decay = g_decay - self._step_fraction(tau_decay, "tau_decay") * g_decay
        if x is not None:
            g_rise, g_decay = g_rise + x, g_decay + x
        self.g_rise.value, self.g_decay.value = g_rise, g_decay
        scale = self.amplitude
        if self.normalize:
            scale = scale * self._peak_scale(tau_rise, tau_decay)
        return scale * (g_decay - g_rise)
