"""What the recurrent cells share: sizes, hidden-state creation and activation lookup.

Every cell's sub-layers are :class:`braintrace.nn.Linear` instances, so all gate weights go
through :func:`braintrace.matmul` and the compiler links them to the cell's hidden states.
"""

from __future__ import annotations

import brainstate
import braintools
import brainunit as u

from braintrace._typing import Initializer, Value, ValueFn
from braintrace.nn._arguments import size_tuple
from braintrace.nn._initial import StatesFromInitState, initial_state
from braintrace.nn._input_check import check_step_input

__all__ = ["CellBase", "resolve_activation", "concat"]



def resolve_activation(activation: str | ValueFn, cell: str, arg: str = "activation") -> ValueFn:
    """A callable activation: a ``brainstate.nn`` function name (``'tanh'``) or a callable.

    Raises
    ------
    ValueError
        If a name is not a ``brainstate.nn`` function.
    TypeError
        If the value is neither a string nor callable.
    """
    if isinstance(activation, str):
        fn = getattr(brainstate.nn, activation, None)
        if fn is None or not callable(fn) or isinstance(fn, type):
            raise ValueError(
                f"{cell}: {arg}={activation!r} is not a brainstate.nn activation function; use a "
                f"name such as 'tanh', 'relu' or 'sigmoid', or pass a callable."
            )
        return fn
    if not callable(activation):
        raise TypeError(
            f"{cell}: {arg} must be a brainstate.nn function name or a callable, got "
            f"{type(activation).__name__}."
        )
    return activation


def concat(*parts: Value) -> Value:
    """Concatenate on the feature (last) axis, keeping units."""
    return u.math.concatenate(parts, axis=-1)


class CellBase(StatesFromInitState, brainstate.nn.RNNCell):
    """A cell with hidden states of shape ``(batch?, *out_size)`` named in ``state_names``.

    Parameters
    ----------
    in_size, out_size : int or tuple of int
        Input and hidden sizes; the feature counts are the last entries.
    state_init : initializer or array
        Initial value of every hidden state (``braintools.init.param`` semantics).
    name : str, optional

    Raises
    ------
    ValueError
        If ``in_size`` or ``out_size`` is not a positive int or a tuple of them.
    """

    #: Names of the HiddenState attributes, in creation order.
    state_names: tuple[str, ...] = ("h",)

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        state_init: Initializer,
        name: str | None,
    ) -> None:
        super().__init__(name=name)
        layer = type(self).__name__
        self.in_size: tuple[int, ...] = size_tuple(layer, "in_size", in_size)
        self.out_size: tuple[int, ...] = size_tuple(layer, "out_size", out_size)
        self._state_initializer = state_init

    @property
    def num_in(self) -> int:
        """The input feature count (last entry of ``in_size``)."""
        return int(self.in_size[-1])

    @property
    def num_out(self) -> int:
        """The hidden feature count (last entry of ``out_size``)."""
        return int(self.out_size[-1])

    def _initial(self, batch_size: int | None) -> Value:
        return initial_state(self._state_initializer, self.out_size, batch_size)

    def _check_input(self, x: Value) -> None:
        """``x`` must be ``(*leading axes of the hidden state, num_in)``, checked before any gate runs."""
        name = self.state_names[0]
        state_shape = tuple(u.math.shape(getattr(self, name).value))
        check_step_input(type(self).__name__, x, state_shape[:-1] + (self.num_in,), name, state_shape)

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Create the hidden states, ``(batch_size, *out_size)`` or ``out_size``."""
        for state in self.state_names:
            setattr(self, state, brainstate.HiddenState(self._initial(batch_size)))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Re-assign every hidden state its initial value."""
        for state in self.state_names:
            getattr(self, state).value = self._initial(batch_size)
