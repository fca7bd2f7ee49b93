"""The types braintrace's modules share: arrays, parameter transforms and the domain's names.

The domain's names are the ones every layer passes around: a state's :data:`Path`, a relation's
per-group :data:`TraceKey` and the :data:`Trace` stored under it, and the structural views
:class:`HiddenGroupLike` and :class:`RelationLike` of the compiler's hidden groups and relations,
and :class:`LearnerLike` of a learner. The views let a module read a group, a relation or
a learner without importing the module that builds it (the ``_op`` rules sit below the compiler;
the compiler's own analyses sit below the classes; the memory measurement sits below the
learners), so no module imports another that imports it back. The layers of :mod:`braintrace.nn`
share the names of their physical values (:data:`Value`, :data:`Constant`, :data:`Initializer`,
:data:`Size`, :data:`ValueFn`). This module imports nothing from braintrace but the JAX adapter,
which imports nothing from braintrace.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Protocol, Sequence, Union, runtime_checkable

import brainstate
import brainunit as u
import jax
import numpy as np

from braintrace._compatible_imports import Jaxpr, Primitive, Var

__all__ = [
    "Array", "ArrayLike", "WeightFn", "PyTree", "Params",
    "Path", "TraceKey", "Trace", "HiddenGroupLike", "RelationLike", "LearnerLike",
    "Value", "Constant", "Initializer", "Size", "ValueFn",
]

#: A JAX array (or a tracer standing for one).
Array = jax.Array
#: Anything an ETP operator accepts as an operand: arrays, NumPy arrays, ``brainunit`` quantities.
ArrayLike = Union[jax.Array, np.ndarray, u.Quantity]
#: A shape-preserving parameter transform applied inside an ETP primitive (``weight_fn`` & co).
WeightFn = Callable[[jax.Array], jax.Array]
#: Any JAX pytree.
PyTree = Any
#: The static parameters of a primitive equation (``eqn.params``).
Params = dict[str, Any]

#: A state's path in the model (``brainstate`` attribute names and indices), e.g. ``('layer', 'w')``.
Path = tuple[Hashable, ...]
#: The key of a relation's trace for one of its hidden groups: ``(id(relation.y_var), group.index)``.
TraceKey = tuple[int, int]
#: One relation's stored trace for one group: the rule's named trace arrays (``'x'``, ``'df'``, ...).
Trace = dict[str, jax.Array]

#: A physical value of a layer: an array, a number, or a ``brainunit`` quantity (``5.0 * u.ms``).
Value = Union[jax.Array, float, u.Quantity]
#: A constant of a layer: a value, or a ``brainstate.ParamState`` holding one to train it online.
Constant = Union[Value, brainstate.ParamState]
#: An initial value: a ``braintools.init`` initializer (called with a shape), or the value itself.
Initializer = Union[Callable[..., Value], Value]
#: A population's shape: one int or a tuple of them.
Size = Union[int, Sequence[int]]
#: An element-wise function of a value: an activation, or a spike function with a surrogate gradient.
ValueFn = Callable[[Value], Value]


class HiddenGroupLike(Protocol):
    """What other modules read of a hidden group (:class:`~braintrace.HiddenGroup`)."""

    @property
    def index(self) -> int:
        """Position of the group in the graph."""

    @property
    def hidden_paths(self) -> Sequence[Path]:
        """Member paths, in compiled-state order."""

    @property
    def hidden_invars(self) -> Sequence[Var]:
        """``h^{t-1}`` variables of the members."""

    @property
    def transition_jaxpr(self) -> Jaxpr:
        """``h^{t-1} -> h^t`` of the members."""

    @property
    def varshape(self) -> tuple[int, ...]:
        """Shape of one member (without the trailing state axis of a group state)."""

    @property
    def num_state(self) -> int:
        """``S``: the number of stacked member states."""


class RelationLike(Protocol):
    """What other modules read of a relation (:class:`~braintrace.HiddenParamOpRelation`)."""

    @property
    def primitive(self) -> Primitive:
        """The ETP primitive of the relation's equation."""

    @property
    def eqn_params(self) -> Params:
        """The equation's static parameters."""

    @property
    def y_var(self) -> Var:
        """The equation's output ``y``."""

    @property
    def path(self) -> Path | None:
        """The path of the relation's weight."""

    @property
    def hidden_groups(self) -> Sequence[HiddenGroupLike]:
        """The hidden groups ``y`` reaches."""

    @property
    def y_to_hidden_group_jaxprs(self) -> Sequence[Jaxpr]:
        """Per group, the ``y -> h`` tail."""


@runtime_checkable
class LearnerLike(Protocol):
    """What other modules read of a learner (:class:`~braintrace.ETraceAlgorithm`).

    ``isinstance(obj, LearnerLike)`` tells a learner, compiled or not, from any other module: it
    checks that these attributes are present (every ``ETraceAlgorithm`` sets them in ``__init__``).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> from braintrace._typing import LearnerLike
    >>> cell = braintrace.nn.ValinaRNNCell(3, 4)
    >>> isinstance(braintrace.compile(cell, 'd_rtrl', jnp.ones(3)), LearnerLike), isinstance(cell, LearnerLike)
    (True, False)
    """

    #: The model the learner trains.
    model4compile: brainstate.nn.Module
    #: Whether ``braintrace.compile`` has traced the model into the learner's graph.
    is_compiled: bool
    #: The batch size it was compiled for (``None``: unbatched).
    batch_size: int | None
