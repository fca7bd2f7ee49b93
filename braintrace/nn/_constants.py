"""Per-unit constants of the spiking neurons and synapse filters: fixed, or trainable online.

A constant such as a time constant ``tau`` or a threshold ``V_th`` is given either as a value
(a number, an array or a ``brainunit`` quantity, stored through ``braintools.init.param`` like
``brainpy.state`` does) or as a ``brainstate.ParamState`` of the population's shape, which makes
it trainable. A trainable constant is read through :func:`braintrace.element_wise` at every
update, so the eligibility-trace compiler links it to the hidden states it drives and online
learners (``D_RTRL``, ``EProp``, ``pp_prop``, ...) train it like a weight. Everything computed
from it afterwards (a decay ``exp(-dt / tau)``, a normalisation) is ordinary element-wise
arithmetic on the primitive's output, which the compiler differentiates as part of the step.

Integration is exponential Euler, as in ``brainstate.nn.exp_euler_step``: one step of the linear
relaxation ``τ dx/dt = x_∞ − x`` is exact, ``x ← x + (1 − e^{−dt/τ}) (x_∞ − x)``, with ``dt``
read from the brainstate environment at every update.
"""

from __future__ import annotations

import brainstate
import braintools
import brainunit as u

from braintrace._op import element_wise
from braintrace._typing import Constant, Size, Value
from braintrace.nn._arguments import check_time_constant, size_tuple
from braintrace.nn._initial import StatesFromInitState

__all__ = ["ConstantsDynamics"]


class ConstantsDynamics(StatesFromInitState, brainstate.nn.Dynamics):
    """A ``brainstate.nn.Dynamics`` whose per-unit constants may be ``ParamState``s.

    Subclasses register each constant with :meth:`_constant` in ``__init__`` and read it with
    :meth:`_read` inside ``update``; :meth:`_step_fraction` turns a time constant into the
    exponential-Euler factor ``1 − e^{−dt/τ}``. They name their hidden states in
    ``state_names``.

    Raises
    ------
    ValueError
        If ``in_size`` is not a positive int or a tuple of them.
    """

    def __init__(self, in_size: Size, name: str | None = None) -> None:
        super().__init__(size_tuple(type(self).__name__, "in_size", in_size), name=name)
        self._trainable: tuple[str, ...] = ()

    @property
    def trainable_constants(self) -> tuple[str, ...]:
        """The names of the constants given as ``brainstate.ParamState`` (trained online)."""
        return self._trainable

    def _constant(self, arg: str, value: Constant, trainable: bool = True, time_constant: bool = False) -> Constant:
        """Store ``value`` for the constant ``arg``: a checked ``ParamState`` or a fixed value.

        A ``time_constant`` must be positive everywhere (checked on the stored value, so an
        initialiser is checked by what it produced).
        """
        kind = type(self).__name__
        if isinstance(value, brainstate.ParamState) and trainable:
            shape = tuple(u.math.shape(value.value))
            if shape != tuple(self.varshape):
                raise ValueError(
                    f"{kind}: a trainable {arg} must be a ParamState of the population's shape "
                    f"{tuple(self.varshape)}, got one of shape {shape}. Broadcast its value "
                    f"first, e.g. brainstate.ParamState(brainunit.math.full("
                    f"{tuple(self.varshape)}, 10.0 * brainunit.ms))."
                )
            self._trainable = (*self._trainable, arg)
            stored = value
        elif isinstance(value, brainstate.State):
            hint = (
                "give a brainstate.ParamState to train it online, or a number, array or quantity "
                "to keep it fixed" if trainable else "it is not trainable: give a number, array or quantity"
            )
            raise TypeError(f"{kind}: {arg} is a {type(value).__name__}; {hint}.")
        else:
            stored = braintools.init.param(value, self.varshape)
        if time_constant:
            check_time_constant(kind, arg, stored)
        return stored

    @staticmethod
    def _read(stored: Constant) -> Value:
        """The constant's value in this step; a ``ParamState`` goes through ``element_wise``."""
        if isinstance(stored, brainstate.ParamState):
            return element_wise(stored.value)
        return stored

    @staticmethod
    def _peek(stored: Constant) -> Value:
        """The constant's current value without a relation, for reads outside ``update``.

        A read outside the update (``get_spike()`` feeding recurrent weights, a readout) acts
        within one step, which the learners' one-step gradient covers; the trace through the
        hidden states is carried by the ``element_wise`` read inside ``update``. Reading it
        through ``element_wise`` here would add a relation that reaches the hidden states only
        through another weight, which the compiler excludes with a warning.
        """
        return stored.value if isinstance(stored, brainstate.ParamState) else stored

    def _dt(self) -> Value:
        try:
            return brainstate.environ.get_dt()
        except KeyError as err:
            raise KeyError(
                f"{type(self).__name__} reads the simulation step at every update: set it with "
                f"brainstate.environ.set(dt=0.1 * brainunit.ms) or run inside "
                f"brainstate.environ.context(dt=...)."
            ) from err

    def _step_fraction(self, tau: Value, arg: str = "tau") -> Value:
        """``1 − e^{−dt/τ}``: the fraction of the way to ``x_∞`` covered in one step."""
        dt = self._dt()
        ratio = u.maybe_decimal(dt / tau)
        if isinstance(ratio, u.Quantity):
            raise u.UnitMismatchError(
                f"{type(self).__name__}: {arg} and the step dt must be both times or both plain "
                f"numbers, got dt={dt!r} and {arg} in unit {u.get_unit(tau)!r}."
            )
        return -u.math.expm1(-ratio)
