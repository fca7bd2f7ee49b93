"""Spiking neurons ``IF``, ``LIF`` and ``ALIF`` with the constructors and updates of ``brainpy.state``.

Each neuron keeps its membrane potential ``V`` (and, for ``ALIF``, the adaptation ``a``) in a
``brainstate.HiddenState`` and returns the spikes of the new potential. One update, with
``s(V) = spk_fun(scaled distance of V above threshold)``:

1. reset with the spikes of the potential entering the step: ``V ← V − (V_th − V_reset) s(V)``
   (``spk_reset='soft'``), or ``V ← V − (sg(V) − V_reset) s(V)`` (``'hard'``, ``sg`` = stop
   gradient, so a spiking unit lands on ``V_reset``);
2. relax towards ``V_∞ = V_rest + R x`` by one exponential-Euler step,
   ``V ← V + (1 − e^{−dt/τ}) (V_∞ − V)``;
3. return ``s(V)`` of the new potential.

The step ``dt`` is read from ``brainstate.environ`` at every update. ``tau``, ``V_th`` (and for
``ALIF`` ``tau_a`` and ``beta``) may be given as a ``brainstate.ParamState`` to train them
online (see :mod:`braintrace.nn._constants`). The reset reads only the state entering the step
and every coupling is per neuron, so a layer driven by ETP operations (e.g.
:func:`braintrace.matmul`) without recurrent weights is in D_RTRL's exact class.
"""

from __future__ import annotations

import brainstate
import braintools
import brainunit as u
import jax

from braintrace._typing import Constant, Initializer, Size, Value, ValueFn
from braintrace.nn._constants import ConstantsDynamics
from braintrace.nn._initial import initial_state
from braintrace.nn._input_check import check_broadcast_input, check_input_unit

__all__ = ["IF", "LIF", "ALIF"]

_RESETS = ("soft", "hard")

#: The default step input: no current. Recognised by identity, so that a layer built in other
#: units (or none) gets a zero in its own input unit rather than a mismatch.
_NO_INPUT = 0.0 * u.mA


class _SpikingNeuron(ConstantsDynamics):
    """Spike function, reset mode and the membrane-potential state shared by the neurons."""

    state_names: tuple[str, ...] = ("V",)

    def __init__(
        self, in_size: Size, spk_fun: ValueFn, spk_reset: str, name: str | None
    ) -> None:
        super().__init__(in_size, name=name)
        if spk_reset not in _RESETS:
            raise ValueError(
                f"{type(self).__name__}: spk_reset must be 'soft' or 'hard', got {spk_reset!r}."
            )
        if not callable(spk_fun):
            raise TypeError(
                f"{type(self).__name__}: spk_fun must be callable (e.g. "
                f"braintools.surrogate.ReluGrad()), got {spk_fun!r}."
            )
        self.spk_fun = spk_fun
        self.spk_reset = spk_reset

    def _init_V(self, batch_size: int | None) -> Value:
        return initial_state(self.V_initializer, self.varshape, batch_size)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Create ``V`` from ``V_initializer``: ``(batch_size, *in_size)`` or ``in_size``."""
        self.V = brainstate.HiddenState(self._init_V(batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Re-initialise ``V`` in place (the state object is kept)."""
        self.V.value = self._init_V(batch_size)

    def _reset_level(self, v: Value, threshold: Value) -> Value:
        """The potential a spike subtracts from: the threshold (soft) or ``V`` itself (hard)."""
        return threshold if self.spk_reset == "soft" else jax.lax.stop_gradient(v)

    def _relax(self, v: Value, v_inf: Value, tau: Value) -> Value:
        return v + self._step_fraction(tau) * (v_inf - v)

    def _input(self, x: Value) -> Value:
        """The step input, checked: it broadcasts onto ``V`` and ``R · x`` is in ``V``'s unit.

        Raises
        ------
        ValueError
            If ``x`` does not broadcast onto ``V``.
        InputUnitError
            (a ``ValueError``) If ``x`` is not in ``V``'s unit divided by ``R``'s (``mA`` with
            the default ``mV`` and ``ohm``).
        """
        layer = type(self).__name__
        v_unit, r_unit = u.get_unit(self.V.value), u.get_unit(self.R)
        expected = v_unit / r_unit
        if x is _NO_INPUT and u.get_unit(x).dim != expected.dim:
            x = 0.0 if expected.is_unitless else 0.0 * expected
        check_broadcast_input(layer, x, "V", u.math.shape(self.V.value))
        r_desc = "unitless" if r_unit.is_unitless else f"in {r_unit}"
        v_desc = "unitless" if v_unit.is_unitless else f"in {v_unit}"
        enters = f"R · x joins the membrane potential V ({v_desc}) and R is {r_desc}"
        return check_input_unit(layer, x, expected, enters)


class IF(_SpikingNeuron):
    r"""Integrate-and-fire neuron, ``τ dV/dt = −V + R I``, with a soft or hard reset.

    As in ``brainpy.state.IF``, the potential relaxes to ``R I`` (there is no separate resting
    potential) and the spike function sees ``(V − V_th) / V_th``; a spike subtracts ``V_th``
    (``'soft'``) or sets ``V`` to 0 (``'hard'``).

    Parameters
    ----------
    in_size : int or tuple of int
        Population shape.
    R : Quantity or array
        Membrane resistance (default ``1 ohm``; ``R · I`` must have the unit of ``V``).
    tau : Quantity, array or ParamState
        Membrane time constant (default ``5 ms``), in the unit of the environment's ``dt``.
        A ``ParamState`` of shape ``in_size`` makes it trainable.
    V_th : Quantity, array or ParamState
        Firing threshold, positive (default ``1 mV``); a ``ParamState`` makes it trainable.
    V_initializer : initializer or array
        Initial potential (default ``braintools.init.Constant(0 mV)``).
    spk_fun : callable
        Spike function with a surrogate gradient (default ``braintools.surrogate.ReluGrad()``:
        1 where its argument is ``>= 0``).
    spk_reset : {'soft', 'hard'}
        Subtract the threshold, or reset to 0 through a stop-gradient.
    name : str, optional

    Attributes
    ----------
    V : HiddenState
        Membrane potential, ``(batch, *in_size)`` or ``in_size``; created by ``init_state``.

    Raises
    ------
    ValueError
        If ``in_size`` is not a positive int or a tuple of them, a time constant is not positive
        everywhere, ``spk_reset`` is not ``'soft'`` or ``'hard'``, or a ``ParamState`` constant
        does not have shape ``in_size``; at the call, if the input does not broadcast onto ``V``
        or is not in ``V``'s unit divided by ``R``'s (e.g. a plain number for the default ``mV``
        layer: multiply it by ``brainunit.mA``).
    TypeError
        If ``spk_fun`` is not callable.

    Examples
    --------
    >>> import brainstate, brainunit as u, braintrace
    >>> neuron = braintrace.nn.IF(2, tau=5.0 * u.ms, V_th=1.0 * u.mV)
    >>> neuron.init_state()
    >>> with brainstate.environ.context(dt=1.0 * u.ms):
    ...     spikes = [neuron(3.0 * u.mA) for _ in range(3)]
    >>> [float(s[0]) for s in spikes]
    [0.0, 0.0, 1.0]
    >>> neuron.V.value  # 3 (1 − e^{−0.6}), the reset comes at the next update
    Quantity([1.353... 1.353...], "mV")
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: Size,
        R: Value = 1.0 * u.ohm,
        tau: Constant = 5.0 * u.ms,
        V_th: Constant = 1.0 * u.mV,
        V_initializer: Initializer = braintools.init.Constant(0.0 * u.mV),
        spk_fun: ValueFn = braintools.surrogate.ReluGrad(),
        spk_reset: str = "soft",
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, spk_fun, spk_reset, name)
        self.R = self._constant("R", R, trainable=False)
        self.tau = self._constant("tau", tau, time_constant=True)
        self.V_th = self._constant("V_th", V_th)
        self.V_initializer = V_initializer

    def _spike(self, v: Value, threshold: Value) -> Value:
        return self.spk_fun((v - threshold) / threshold)

    def get_spike(self, V: Value | None = None) -> Value:
        """The spikes of ``V`` (default: the current potential), e.g. to feed them back.

        Outside ``update`` the threshold is read as it is, not through ``element_wise``: that
        path acts within one step, where learners differentiate it exactly.
        """
        return self._spike(self.V.value if V is None else V, self._peek(self.V_th))

    def update(self, x: Value = _NO_INPUT) -> Value:
        """Advance one step with input current ``x``; return the spikes of the new potential.

        ``x`` broadcasts onto ``V`` and is in ``V``'s unit divided by ``R``'s (``mA`` with the
        defaults; unitless for a unitless layer); a plain zero fits any unit. Called without
        ``x``, the step has no input. Otherwise a ``ValueError`` names the expected shape or
        unit and the fix (for units an ``InputUnitError``, also a brainunit
        ``UnitMismatchError``).
        """
        x = self._input(x)
        threshold = self._read(self.V_th)
        last_v = self.V.value
        v = last_v - self._reset_level(last_v, threshold) * self._spike(last_v, threshold)
        v = self._relax(v, self.R * x, self._read(self.tau))
        self.V.value = v
        return self._spike(v, threshold)


class LIF(_SpikingNeuron):
    r"""Leaky integrate-and-fire neuron, ``τ dV/dt = −(V − V_rest) + R I``.

    As in ``brainpy.state.LIF``: the spike function sees ``(V − V_th) / (V_th − V_reset)``; a
    spike subtracts ``V_th − V_reset`` (``'soft'``) or sets ``V`` to ``V_reset`` (``'hard'``),
    at the start of the next update. With a constant input the potential approaches
    ``V_rest + R I``.

    Parameters
    ----------
    in_size : int or tuple of int
        Population shape.
    R : Quantity or array
        Membrane resistance (default ``1 ohm``; ``R · I`` must have the unit of ``V``).
    tau : Quantity, array or ParamState
        Membrane time constant (default ``5 ms``), in the unit of the environment's ``dt``.
        A ``ParamState`` of shape ``in_size`` makes it trainable.
    V_th : Quantity, array or ParamState
        Firing threshold (default ``1 mV``); a ``ParamState`` makes it trainable.
    V_reset : Quantity or array
        Potential after a hard reset (default ``0 mV``).
    V_rest : Quantity or array
        Resting potential (default ``0 mV``).
    V_initializer : initializer or array
        Initial potential (default ``braintools.init.Constant(0 mV)``).
    spk_fun : callable
        Spike function with a surrogate gradient (default ``braintools.surrogate.ReluGrad()``).
    spk_reset : {'soft', 'hard'}
        Subtract ``V_th − V_reset``, or reset to ``V_reset`` through a stop-gradient.
    name : str, optional

    Attributes
    ----------
    V : HiddenState
        Membrane potential, ``(batch, *in_size)`` or ``in_size``; created by ``init_state``.

    Raises
    ------
    ValueError
        If ``in_size`` is not a positive int or a tuple of them, a time constant is not positive
        everywhere, ``spk_reset`` is not ``'soft'`` or ``'hard'``, or a ``ParamState`` constant
        does not have shape ``in_size``; at the call, if the input does not broadcast onto ``V``
        or is not in ``V``'s unit divided by ``R``'s (e.g. a plain number for the default ``mV``
        layer: multiply it by ``brainunit.mA``).
    TypeError
        If ``spk_fun`` is not callable.

    Examples
    --------
    >>> import brainstate, brainunit as u, jax.numpy as jnp, braintrace
    >>> lif = braintrace.nn.LIF(3, tau=10.0 * u.ms, V_th=1.0 * u.mV)
    >>> lif.init_state(batch_size=2)
    >>> with brainstate.environ.context(dt=1.0 * u.ms):
    ...     spikes = lif(jnp.full((2, 3), 0.5) * u.mA)
    >>> spikes.shape, lif.V.value[0, 0]  # 0.5 (1 − e^{−0.1})
    ((2, 3), Quantity(0.0475..., "mV"))

    A ``ParamState`` time constant is trained online, through :func:`braintrace.element_wise`:

    >>> import brainstate, braintrace
    >>> tau = brainstate.ParamState(u.math.full(3, 10.0 * u.ms))
    >>> lif = braintrace.nn.LIF(3, tau=tau, V_th=1.0 * u.mV)
    >>> lif.trainable_constants
    ('tau',)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: Size,
        R: Value = 1.0 * u.ohm,
        tau: Constant = 5.0 * u.ms,
        V_th: Constant = 1.0 * u.mV,
        V_reset: Constant = 0.0 * u.mV,
        V_rest: Constant = 0.0 * u.mV,
        V_initializer: Initializer = braintools.init.Constant(0.0 * u.mV),
        spk_fun: ValueFn = braintools.surrogate.ReluGrad(),
        spk_reset: str = "soft",
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, spk_fun, spk_reset, name)
        self.R = self._constant("R", R, trainable=False)
        self.tau = self._constant("tau", tau, time_constant=True)
        self.V_th = self._constant("V_th", V_th)
        self.V_rest = self._constant("V_rest", V_rest, trainable=False)
        self.V_reset = self._constant("V_reset", V_reset, trainable=False)
        self.V_initializer = V_initializer

    def _spike(self, v: Value, threshold: Value) -> Value:
        return self.spk_fun((v - threshold) / (threshold - self.V_reset))

    def get_spike(self, V: Value | None = None) -> Value:
        """The spikes of ``V`` (default: the current potential), e.g. to feed them back.

        Outside ``update`` the threshold is read as it is, not through ``element_wise``: that
        path acts within one step, where learners differentiate it exactly.
        """
        return self._spike(self.V.value if V is None else V, self._peek(self.V_th))

    def update(self, x: Value = _NO_INPUT) -> Value:
        """Advance one step with input current ``x``; return the spikes of the new potential.

        ``x`` broadcasts onto ``V`` and is in ``V``'s unit divided by ``R``'s (``mA`` with the
        defaults; unitless for a unitless layer); a plain zero fits any unit. Called without
        ``x``, the step has no input. Otherwise a ``ValueError`` names the expected shape or
        unit and the fix (for units an ``InputUnitError``, also a brainunit
        ``UnitMismatchError``).
        """
        x = self._input(x)
        threshold = self._read(self.V_th)
        last_v = self.V.value
        spike = self._spike(last_v, threshold)
        v = last_v - (self._reset_level(last_v, threshold) - self.V_reset) * spike
        v = self._relax(v, self.V_rest + self.R * x, self._read(self.tau))
        self.V.value = v
        return self._spike(v, threshold)


class ALIF(_SpikingNeuron):
    r"""Adaptive LIF neuron: each spike raises the threshold by ``beta``, decaying with ``tau_a``.

    ``τ dV/dt = −(V − V_rest) + R I``, ``τ_a da/dt = −a``. As in ``brainpy.state.ALIF``: the
    spike function sees ``(V − V_th − beta · a) / (V_th − V_reset)``; the spikes of the state
    entering the step reset ``V`` like :class:`LIF` (by ``V_th − V_reset``, without the
    adaptation) and add 1 to ``a`` before both decay by one exponential-Euler step.

    Parameters
    ----------
    in_size : int or tuple of int
        Population shape.
    R : Quantity or array
        Membrane resistance (default ``1 ohm``).
    tau : Quantity, array or ParamState
        Membrane time constant (default ``5 ms``); a ``ParamState`` makes it trainable.
    tau_a : Quantity, array or ParamState
        Adaptation time constant (default ``100 ms``); a ``ParamState`` makes it trainable.
    V_th : Quantity, array or ParamState
        Base threshold (default ``1 mV``); a ``ParamState`` makes it trainable.
    V_reset, V_rest : Quantity or array
        Reset and resting potentials (default ``0 mV``).
    beta : Quantity, array or ParamState
        Threshold increase per unit of adaptation (default ``0.1 mV``); a ``ParamState`` makes
        it trainable.
    spk_fun : callable
        Spike function with a surrogate gradient (default ``braintools.surrogate.ReluGrad()``).
    spk_reset : {'soft', 'hard'}
        Subtract ``V_th − V_reset``, or reset to ``V_reset`` through a stop-gradient.
    V_initializer : initializer or array
        Initial potential (default ``braintools.init.Constant(0 mV)``).
    a_initializer : initializer or array
        Initial adaptation (default ``braintools.init.Constant(0.)``, unitless).
    name : str, optional

    Attributes
    ----------
    V : HiddenState
        Membrane potential, ``(batch, *in_size)`` or ``in_size``.
    a : HiddenState
        Adaptation, same shape; both created by ``init_state``.

    Raises
    ------
    ValueError
        If ``in_size`` is not a positive int or a tuple of them, a time constant is not positive
        everywhere, ``spk_reset`` is not ``'soft'`` or ``'hard'``, or a ``ParamState`` constant
        does not have shape ``in_size``; at the call, if the input does not broadcast onto ``V``
        or is not in ``V``'s unit divided by ``R``'s (e.g. a plain number for the default ``mV``
        layer: multiply it by ``brainunit.mA``).
    TypeError
        If ``spk_fun`` is not callable.

    Examples
    --------
    >>> import brainstate, brainunit as u, braintrace
    >>> import numpy as np
    >>> alif = braintrace.nn.ALIF(1, tau=5.0 * u.ms, tau_a=50.0 * u.ms, beta=0.5 * u.mV)
    >>> alif.init_state()
    >>> with brainstate.environ.context(dt=1.0 * u.ms):
    ...     spikes = [float(alif(5.0 * u.mA)[0]) for _ in range(40)]
    >>> np.diff(np.nonzero(spikes)[0]).tolist()  # the intervals grow as ``a`` accumulates
    [2, 2, 2, 3, 3, 3, 4, 4, 5, 5]
    """

    __module__ = "braintrace.nn"
    state_names = ("V", "a")

    def __init__(
        self,
        in_size: Size,
        R: Value = 1.0 * u.ohm,
        tau: Constant = 5.0 * u.ms,
        tau_a: Constant = 100.0 * u.ms,
        V_th: Constant = 1.0 * u.mV,
        V_reset: Constant = 0.0 * u.mV,
        V_rest: Constant = 0.0 * u.mV,
        beta: Constant = 0.1 * u.mV,
        spk_fun: ValueFn = braintools.surrogate.ReluGrad(),
        spk_reset: str = "soft",
        V_initializer: Initializer = braintools.init.Constant(0.0 * u.mV),
        a_initializer: Initializer = braintools.init.Constant(0.0),
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, spk_fun, spk_reset, name)
        self.R = self._constant("R", R, trainable=False)
        self.tau = self._constant("tau", tau, time_constant=True)
        self.tau_a = self._constant("tau_a", tau_a, time_constant=True)
        self.V_th = self._constant("V_th", V_th)
        self.V_reset = self._constant("V_reset", V_reset, trainable=False)
        self.V_rest = self._constant("V_rest", V_rest, trainable=False)
        self.beta = self._constant("beta", beta)
        self.V_initializer = V_initializer
        self.a_initializer = a_initializer

    def _init_a(self, batch_size: int | None) -> Value:
        return initial_state(self.a_initializer, self.varshape, batch_size)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Create ``V`` and ``a`` from their initialisers."""
        super().init_state(batch_size)
        self.a = brainstate.HiddenState(self._init_a(batch_size))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Re-initialise ``V`` and ``a`` in place (the state objects are kept)."""
        super().reset_state(batch_size)
        self.a.value = self._init_a(batch_size)

    def _spike(self, v: Value, a: Value, threshold: Value, beta: Value) -> Value:
        return self.spk_fun((v - threshold - beta * a) / (threshold - self.V_reset))

    def get_spike(self, V: Value | None = None, a: Value | None = None) -> Value:
        """The spikes of ``(V, a)`` (default: the current state), e.g. to feed them back.

        Outside ``update`` the thresholds are read as they are, not through ``element_wise``.
        """
        V = self.V.value if V is None else V
        a = self.a.value if a is None else a
        return self._spike(V, a, self._peek(self.V_th), self._peek(self.beta))

    def update(self, x: Value = _NO_INPUT) -> Value:
        """Advance one step with input current ``x``; return the spikes of the new state.

        ``x`` broadcasts onto ``V`` and is in ``V``'s unit divided by ``R``'s (``mA`` with the
        defaults; unitless for a unitless layer); a plain zero fits any unit. Called without
        ``x``, the step has no input. Otherwise a ``ValueError`` names the expected shape or
        unit and the fix (for units an ``InputUnitError``, also a brainunit
        ``UnitMismatchError``).
        """
        x = self._input(x)
        threshold, beta = self._read(self.V_th), self._read(self.beta)
        last_v, last_a = self.V.value, self.a.value
        spike = self._spike(last_v, last_a, threshold, beta)
        v = last_v - (self._reset_level(last_v, threshold) - self.V_reset) * spike
        a = last_a + spike
        v = self._relax(v, self.V_rest + self.R * x, self._read(self.tau))
        a = a - self._step_fraction(self._read(self.tau_a), "tau_a") * a
        self.V.value = v
        self.a.value = a
        return self._spike(v, a, threshold, beta)
