"""The layers' hidden states as ``init_state`` creates them: strongly typed, and missing before.

``braintools.init.param`` gives weakly typed arrays for Python-number initialisers
(``Constant(0.0 * u.mV)``). A state that starts weakly typed and is written strongly typed by the
first step changes its abstract type, so a jitted training step compiles twice. Every layer
creates and resets its states through :func:`initial_state` instead.

A layer's hidden states exist only once ``init_state`` has run. A layer built on
:class:`StatesFromInitState` names that, and the fix, when a state is read before, instead of
Python's bare ``'LIF' object has no attribute 'V'``.

Examples
--------
>>> import braintools, brainunit as u
>>> v = initial_state(braintools.init.Constant(0.0 * u.mV), (3,), batch_size=2)
>>> v.shape, u.get_mantissa(v).weak_type
((2, 3), False)
>>> import braintrace
>>> lif = braintrace.nn.LIF(3)
>>> hasattr(lif, "V")
False
>>> lif.V
Traceback (most recent call last):
    ...
AttributeError: LIF: the hidden state V does not exist yet: init_state creates it. ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import braintools
import brainunit as u
import jax

from braintrace._typing import Initializer, Size, Value

__all__ = ["initial_state", "StatesFromInitState"]


def initial_state(init: Initializer, shape: Size, batch_size: int | None = None) -> Value:
    """``braintools.init.param(init, shape, batch_size)`` with every leaf strongly typed."""
    value = braintools.init.param(init, shape, batch_size)
    return jax.tree.map(_strong, value, is_leaf=lambda x: isinstance(x, u.Quantity))


def _strong(leaf: Value) -> Value:
    if isinstance(leaf, u.Quantity):
        return u.Quantity(_strong(leaf.mantissa), unit=leaf.unit)
    if isinstance(leaf, jax.Array) and leaf.weak_type:
        return jax.lax.convert_element_type(leaf, leaf.dtype)
    return leaf


class StatesFromInitState:
    """A layer whose hidden states, named in ``state_names``, are created by ``init_state``.

    Reading one of them before ``init_state`` ran raises an ``AttributeError`` (so ``hasattr``
    stays ``False``) that names the state and how to create it. Any other missing attribute
    raises Python's usual ``AttributeError``.
    """

    #: Names of the HiddenState attributes ``init_state`` creates.
    state_names: tuple[str, ...] = ()

    # Hidden from mypy: a class with ``__getattr__`` would make every unknown attribute type-check.
    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> NoReturn:
            # only called when ordinary lookup fails; reads nothing from the instance, so it is
            # safe on a half-built or unpickled object
            layer = type(self).__name__
            if name in type(self).state_names:
                raise AttributeError(
                    f"{layer}: the hidden state {name} does not exist yet: init_state creates it. "
                    f"Call brainstate.nn.init_all_states(model) (or layer.init_state(batch_size=...)) "
                    f"before stepping the model by hand, or build a learner with "
                    f"braintrace.compile(model, algorithm, example_input), which creates the states.",
                    name=name,
                    obj=self,
                )
            raise AttributeError(f"{layer!r} object has no attribute {name!r}", name=name, obj=self)
