"""The bytes a learner keeps between steps: its eligibility traces, its parameters, its other states.

Every state reachable from the learner (the model's and the learner's own, each counted once)
falls in exactly one of three parts, leaf by leaf:

* **traces**: the floating-point leaves of the short-term states the learner adds to the model
  (eligibility traces and their filters, presynaptic traces, the hidden and parameter factors
  of UORO ...);
* **params**: every ``brainstate.ParamState`` (the model's weights, and a learner's own, such as
  a synthetic-gradient module's);
* **states**: everything else: the model's hidden and other states, and the learner's counters
  and random keys (integer leaves, ``LongTermState``).

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> from braintrace._footprint.inventory import state_bytes
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
>>> state_bytes(learner)  # traces 2·(7·4 + 4)·4 B, params (7·4 + 4)·4 B, states h (2·4·4 B) and a counter
StateBytes(traces=256, params=128, states=36)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from braintrace._typing import LearnerLike, PyTree

__all__ = ["StateBytes", "state_bytes", "model_state_bytes", "tree_bytes", "algorithm_of"]


class StateBytes(NamedTuple):
    """Bytes of the three parts of a learner's states (see the module docstring).

    Examples
    --------
    >>> from braintrace._footprint.inventory import StateBytes
    >>> StateBytes(traces=256, params=128, states=36).total
    420
    """

    traces: int
    params: int
    states: int

    @property
    def total(self) -> int:
        """All three parts together: what the learner holds between steps."""
        return self.traces + self.params + self.states


def leaf_bytes(leaf: ArrayLike | jax.ShapeDtypeStruct) -> int:
    """The bytes of one array leaf (an array, a ``ShapeDtypeStruct`` or a Python number).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from braintrace._footprint.inventory import leaf_bytes
    >>> leaf_bytes(jnp.zeros((3, 4))), leaf_bytes(jax.ShapeDtypeStruct((2,), jnp.int8))
    (48, 2)
    """
    dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
    return math.prod(jnp.shape(leaf)) * np.dtype(dtype).itemsize


def tree_bytes(tree: PyTree) -> int:
    """The bytes of every array leaf of ``tree``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._footprint.inventory import tree_bytes
    >>> tree_bytes({'w': jnp.zeros((3, 4)), 'b': jnp.zeros(4, jnp.int32)})
    64
    """
    return sum(leaf_bytes(leaf) for leaf in jax.tree.leaves(tree))


def algorithm_of(learner: object) -> LearnerLike:
    """The learner inside ``learner``: the learner itself, or the one an ``ETraceVmap`` maps.

    A learner is told by its attributes (:class:`~braintrace._typing.LearnerLike`); a wrapper is a
    ``brainstate.nn.Vmap`` of one that, as ``ETraceVmap`` does, forwards its ``param_states`` (the
    training step differentiates with respect to them).

    Raises
    ------
    TypeError
        For anything else, naming what was given.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> from braintrace._footprint.inventory import algorithm_of
    >>> vmapped = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones((2, 3)),
    ...                              batch_size=2, vmap=True)
    >>> type(algorithm_of(vmapped)).__name__
    'D_RTRL'
    """
    if isinstance(learner, LearnerLike):
        return learner
    if (isinstance(learner, brainstate.nn.Vmap) and isinstance(learner.module, LearnerLike)
            and hasattr(type(learner), "param_states")):
        return learner.module
    raise TypeError(
        f"expected a compiled learner (braintrace.compile(model, algorithm, x), or with vmap=True for a "
        f"vmapped one), got {type(learner).__name__}."
    )


def _unique_states(module: brainstate.nn.Module) -> list[brainstate.State]:
    seen: dict[int, brainstate.State] = {}
    for state in module.states().values():
        seen.setdefault(id(state), state)
    return list(seen.values())


def _is_floating(leaf: ArrayLike) -> bool:
    dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
    return bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating))


def state_bytes(learner: object) -> StateBytes:
    """Split the bytes of every state of a compiled learner into traces, params and states.

    Parameters
    ----------
    learner : ETraceAlgorithm or ETraceVmap
        A learner built by :func:`braintrace.compile`.

    Returns
    -------
    StateBytes

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> from braintrace._footprint.inventory import state_bytes
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'pp_prop', jnp.ones((2, 3)),
    ...                              batch_size=2, decay_or_rank=0.9)
    >>> state_bytes(learner).traces  # x trace (2, 7) and output trace (2, 4, 1), float32
    88
    """
    algorithm = algorithm_of(learner)
    model_ids = {id(state) for state in _unique_states(algorithm.model4compile)}
    traces = params = others = 0
    for state in _unique_states(algorithm):
        if isinstance(state, brainstate.ParamState):
            params += tree_bytes(state.value)
            continue
        own_short_term = id(state) not in model_ids and not isinstance(state, brainstate.LongTermState)
        for leaf in jax.tree.leaves(state.value):
            if own_short_term and _is_floating(leaf):
                traces += leaf_bytes(leaf)
            else:
                others += leaf_bytes(leaf)
    return StateBytes(traces=traces, params=params, states=others)


def model_state_bytes(model: brainstate.nn.Module) -> StateBytes:
    """The parameters and the other states of a plain model (no traces: what BPTT keeps).

    Examples
    --------
    >>> import brainstate, braintrace
    >>> from braintrace._footprint.inventory import model_state_bytes
    >>> cell = braintrace.nn.ValinaRNNCell(3, 4)
    >>> _ = brainstate.nn.init_all_states(cell, batch_size=2)
    >>> model_state_bytes(cell)
    StateBytes(traces=0, params=128, states=32)
    """
    params = others = 0
    for state in _unique_states(model):
        if isinstance(state, brainstate.ParamState):
            params += tree_bytes(state.value)
        else:
            others += tree_bytes(state.value)
    return StateBytes(traces=0, params=params, states=others)
