"""Sharding a learner over a device mesh: :class:`Sharding`, the one place a user states how.

JAX is the distributed engine. A :class:`Sharding` names a ``jax.sharding.Mesh`` and which of
its axes carry the batch (data parallel) and the hidden units (model parallel).
``braintrace.compile(..., sharding=...)`` derives a ``PartitionSpec`` for every state of the
learner, places each with ``jax.device_put(value, NamedSharding(mesh, spec))``, and from then
on every call of the learner constrains its inputs and the states it writes with
``jax.lax.with_sharding_constraint``. XLA's SPMD partitioner (GSPMD) keeps the arrays split and
inserts the collectives (the gradient's all-reduce over the batch, the gathers of a hidden-split
forward pass); braintrace builds none by hand. A sharding never changes a value, only where its
pieces live: gradients, losses and states equal those of one device up to the order of
floating-point sums.

How a state is split (the compiled graph tells the hidden sizes, the learner its batch size):

* **batch**: axis 0 of every learner state whose leading size is the batch size (hidden
  states, traces, filters; the lanes of a vmapped learner), and axis 0 of every input of a
  step (axis 1 of a :class:`~braintrace.MultiStepData` window, ``(time, batch, ...)``).
  Parameters are never split along the batch: they are replicated and their gradient is reduced.
* **hidden**: the last axis whose size is the unit count of a hidden group (the last axis of
  its hidden states). For a hidden state that is its unit axis; for a weight ``(in, units)``
  its output axis; for a D_RTRL trace ``(batch, in, units, states)`` the units, so each device
  holds the trace columns of its own units and rolls them without communication.

Every other axis, and every leaf without such an axis (scalars, counters), is replicated.

With the batch split, the rules sum batch rows as one reduction on every platform (see
``braintrace._op._rule_helpers.vectorised_rows``): their CPU-only loop indexes rows one by one,
which on a split batch would gather the whole trace onto every device.

Examples
--------
>>> import jax, jax.numpy as jnp, numpy as np, braintrace
>>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
>>> sharding = braintrace.Sharding(mesh, batch='data')
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones((2, 3)),
...                              batch_size=2, sharding=sharding)
>>> learner.sharding_plan.specs()[('h',)]
P('data', None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Concatenate, Hashable, Iterator, Mapping, NamedTuple, ParamSpec, Protocol, Sequence, TypeVar

import brainstate
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from braintrace._algorithm.engine.input_data import ETraceInputData, MultiStepData
from braintrace._compatible_imports import Tracer
from braintrace._compiler import ETraceGraph
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._op._rule_helpers import vectorised_rows
from braintrace._typing import HiddenGroupLike, Path, PyTree

__all__ = ["Sharding", "ShardingPlan", "plan_sharding", "sharded_call", "rows_follow_sharding"]

#: One mesh axis name, or several whose devices are taken together.
AxisNames = str | tuple[str, ...]


def _names(value: AxisNames | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How a learner is split over a device mesh: which mesh axes carry the batch and the hidden units.

    Give it to :func:`braintrace.compile` (``sharding=``); the module
    :mod:`braintrace._algorithm.engine.sharding` says which axis of each state is split.

    Parameters
    ----------
    mesh : jax.sharding.Mesh
        The devices, laid out on named axes (on several hosts: a mesh over ``jax.devices()``
        after ``jax.distributed.initialize``).
    batch : str or tuple of str, optional
        The mesh axis (or axes, taken together) the batch is split over: data parallelism.
        The batch size must be a multiple of its device count.
    hidden : str or tuple of str, optional
        The mesh axis (or axes) the hidden units are split over: model parallelism. Every hidden
        group's unit count must be a multiple of its device count.

    Raises
    ------
    TypeError
        For a ``mesh`` that is not a ``jax.sharding.Mesh``, or an axis that is not a string.
    ValueError
        For an axis name the mesh lacks (the message lists its axes), an axis named for both
        roles, or neither role given.

    Examples
    --------
    >>> import jax, numpy as np, braintrace
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
    >>> sharding = braintrace.Sharding(mesh, batch='data', hidden='model')
    >>> sharding.batch_devices, sharding.hidden_devices
    (1, 1)
    >>> braintrace.Sharding(mesh, batch='batch')
    Traceback (most recent call last):
    ...
    ValueError: Sharding: batch='batch' is not an axis of the mesh; its axes are ('data', 'model'). Name one of them.
    """

    mesh: Mesh
    batch: AxisNames | None = None
    hidden: AxisNames | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(
                f"Sharding: mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}. Build one "
                f"with jax.sharding.Mesh(np.array(jax.devices()).reshape(...), ('data', 'model')).")
        for role in ("batch", "hidden"):
            value = getattr(self, role)
            if isinstance(value, list):
                object.__setattr__(self, role, tuple(value))
            for name in _names(getattr(self, role)):
                if not isinstance(name, str):
                    raise TypeError(f"Sharding: {role} must be a mesh axis name or a tuple of names, got {value!r}.")
                if name not in self.mesh.axis_names:
                    raise ValueError(
                        f"Sharding: {role}={name!r} is not an axis of the mesh; its axes are "
                        f"{tuple(self.mesh.axis_names)}. Name one of them.")
        shared = set(_names(self.batch)) & set(_names(self.hidden))
        if shared:
            raise ValueError(
                f"Sharding: the mesh axis {sorted(shared)[0]!r} is named for both the batch and the hidden "
                f"units; give each role its own axis (a mesh with two axes, e.g. ('data', 'model')).")
        if not _names(self.batch) and not _names(self.hidden):
            raise ValueError(
                "Sharding: give batch= (data parallel), hidden= (model parallel) or both; with neither, "
                "nothing would be split.")

    @property
    def batch_devices(self) -> int:
        """How many devices the batch is split over (``1`` without ``batch``)."""
        return math.prod(self.mesh.shape[n] for n in _names(self.batch))

    @property
    def hidden_devices(self) -> int:
        """How many devices the hidden units are split over (``1`` without ``hidden``)."""
        return math.prod(self.mesh.shape[n] for n in _names(self.hidden))

    def _axis(self, role: str) -> AxisNames | None:
        names = _names(getattr(self, role))
        return None if not names else names[0] if len(names) == 1 else names

    def named(self, spec: PartitionSpec) -> NamedSharding:
        """``NamedSharding(mesh, spec)``."""
        return NamedSharding(self.mesh, spec)

    def put(self, tree: PyTree, batch_axis: int = 0) -> PyTree:
        """Place data on the mesh, each leaf split along ``batch_axis`` over the batch devices.

        A leaf without that axis, or of another size, is replicated. On several hosts every
        process passes the same global value (for per-process pieces, build the arrays with
        ``jax.make_array_from_process_local_data``).

        Parameters
        ----------
        tree : pytree of arrays
            E.g. input sequences ``(time, batch, ...)`` with ``batch_axis=1``.
        batch_axis : int
            The axis that holds the batch.

        Returns
        -------
        pytree of jax.Array

        Examples
        --------
        >>> import jax, jax.numpy as jnp, numpy as np, braintrace
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
        >>> xs = braintrace.Sharding(mesh, batch='data').put(jnp.ones((5, 2, 3)), batch_axis=1)
        >>> xs.sharding.spec
        P(None, 'data', None)
        """
        def place(leaf: ArrayLike) -> jax.Array:
            ndim = np.ndim(leaf)
            spec: list[AxisNames | None] = [None] * ndim
            if -ndim <= batch_axis < ndim and np.shape(leaf)[batch_axis] % self.batch_devices == 0:
                spec[batch_axis] = self._axis("batch")
            return jax.device_put(leaf, self.named(PartitionSpec(*spec)))

        return jax.tree.map(place, tree)


Sharding.__module__ = "braintrace"


class _Placed(NamedTuple):
    """One state and the ``NamedSharding`` of each leaf of its value."""

    path: Path
    state: brainstate.State
    shardings: PyTree  # of NamedSharding, one per leaf of the state's value


class ShardingPlan:
    """Where every state of a sharded learner lives, and the constraints each call applies.

    Built by :func:`plan_sharding` (``braintrace.compile(..., sharding=...)``); read it as
    ``learner.sharding_plan``.

    Attributes
    ----------
    sharding : Sharding
    batch_size : int or None
        The batch (or lane) count whose axis is split.
    hidden_sizes : frozenset of int
        The unit counts of the hidden groups.
    """

    def __init__(self, sharding: Sharding, batch_size: int | None, hidden_sizes: frozenset[int],
                 placed: list[_Placed]) -> None:
        self.sharding = sharding
        self.batch_size = batch_size
        self.hidden_sizes = hidden_sizes
        self._placed = placed

    def specs(self) -> dict[Path, PyTree]:
        """``path -> PartitionSpec`` (a pytree of them for a pytree-valued state) of every state."""
        return {p.path: jax.tree.map(lambda s: s.spec, p.shardings) for p in self._placed}

    def misplaced(self) -> list[Path]:
        """The paths of the states whose value does not sit on its planned sharding (normally none).

        Examples
        --------
        >>> import jax, jax.numpy as jnp, numpy as np, braintrace
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
        >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones((2, 3)),
        ...                              batch_size=2, sharding=braintrace.Sharding(mesh, batch='data'))
        >>> _ = learner(jnp.ones((2, 3)))
        >>> learner.sharding_plan.misplaced()
        []
        """
        def on_plan(leaf: object, sharding: NamedSharding) -> bool:
            return isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)

        return [placed.path for placed in self._placed
                if not all(jax.tree.leaves(jax.tree.map(on_plan, placed.state.value, placed.shardings)))]

    def place(self) -> None:
        """Put every state on its sharding (``device_put`` eagerly, a sharding constraint under ``jit``)."""
        for placed in self._placed:
            placed.state.value = _constrained(placed.state.value, placed.shardings)

    def constrain_states(self) -> None:
        """Constrain every state a call may write (all but the parameters) to its sharding."""
        for placed in self._placed:
            if not isinstance(placed.state, brainstate.ParamState):
                placed.state.value = _constrained(placed.state.value, placed.shardings)

    def constrain_inputs(self, args: tuple[PyTree, ...]) -> tuple[PyTree, ...]:
        """The inputs of one call, the batch axis of each leaf split (axis 1 inside a window)."""
        if not _names(self.sharding.batch) or self.batch_size is None:
            return args

        def split(axis: int) -> Callable[[ArrayLike], ArrayLike]:
            def one(leaf: ArrayLike) -> ArrayLike:
                shape = np.shape(leaf)
                if len(shape) <= axis or shape[axis] != self.batch_size:
                    return leaf
                spec: list[AxisNames | None] = [None] * len(shape)
                spec[axis] = self.sharding._axis("batch")
                return _constrained(leaf, self.sharding.named(PartitionSpec(*spec)))
            return one

        def marked(node: PyTree) -> PyTree:
            if isinstance(node, MultiStepData):
                return jax.tree.map(split(1), node)
            return jax.tree.map(split(0), node)

        return jax.tree.map(marked, args, is_leaf=lambda x: isinstance(x, ETraceInputData))

    def leaf_spec(self, shape: tuple[int, ...], is_param: bool) -> PartitionSpec:
        """The ``PartitionSpec`` of one state leaf of ``shape`` (see the module docstring)."""
        spec: list[AxisNames | None] = [None] * len(shape)
        first = 0
        if (not is_param and _names(self.sharding.batch) and self.batch_size is not None
                and len(shape) >= 1 and shape[0] == self.batch_size):
            spec[0] = self.sharding._axis("batch")
            first = 1
        if _names(self.sharding.hidden):
            devices = self.sharding.hidden_devices
            axes = [len(shape) - 1] if is_param else range(len(shape) - 1, first - 1, -1)
            for axis in axes:
                if axis >= first and shape[axis] in self.hidden_sizes and shape[axis] % devices == 0:
                    spec[axis] = self.sharding._axis("hidden")
                    break
        return PartitionSpec(*spec)


def _constrained(value: PyTree, shardings: PyTree) -> PyTree:
    """``value`` on ``shardings`` (leaf by leaf): a constraint when traced, a transfer when concrete."""
    def one(leaf: ArrayLike, sharding: NamedSharding) -> jax.Array:
        if isinstance(leaf, Tracer):
            return jax.lax.with_sharding_constraint(leaf, sharding)
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        return jax.device_put(leaf, sharding)

    return jax.tree.map(one, value, shardings)


def _check_hidden_sizes(groups: Sequence[HiddenGroupLike], sharding: Sharding, batched: bool) -> frozenset[int]:
    """The hidden groups' unit counts, each checked to be a multiple of the hidden devices."""
    sizes = set()
    axis, devices = sharding._axis("hidden"), sharding.hidden_devices
    for group in groups:
        varshape = tuple(group.varshape)
        if len(varshape) <= int(batched):
            if _names(sharding.hidden):
                raise ValueError(
                    f"compile: sharding hidden={axis!r} splits the hidden units, but the hidden group of "
                    f"{group.hidden_paths} has shape {varshape}, with no unit axis after the batch. Give "
                    f"the hidden states a unit axis, or leave hidden=None.")
            continue
        units = varshape[-1]
        if units % devices:
            raise ValueError(
                f"compile: the hidden state {group.hidden_paths[0]} has {units} units on its last axis, "
                f"which the {devices} devices of mesh axis {axis!r} do not divide. Use a layer whose unit "
                f"count is a multiple of {devices}, or a mesh whose {axis!r} axis has a size that divides "
                f"{units}.")
        sizes.add(units)
    return frozenset(sizes)


def check_batch_size(sharding: Sharding, batch_size: int | None) -> None:
    """Refuse a batch size the batch devices do not divide (before anything is built)."""
    if not _names(sharding.batch):
        return
    axis, devices = sharding._axis("batch"), sharding.batch_devices
    if batch_size is None:
        raise ValueError(
            f"compile: sharding batch={axis!r} splits the batch, but no batch_size was given, so the "
            f"learner is unbatched. Pass batch_size=B with B a multiple of {devices} (the devices of "
            f"mesh axis {axis!r}), or leave batch=None.")
    if batch_size % devices:
        raise ValueError(
            f"compile: batch_size={batch_size} is not a multiple of the {devices} devices of mesh axis "
            f"{axis!r}. Use a batch size that is a multiple of {devices}, or a mesh whose {axis!r} axis "
            f"has a size that divides {batch_size}.")


class _CompiledLearner(Protocol):
    """What :func:`plan_sharding` reads of a compiled learner."""

    @property
    def graph(self) -> ETraceGraph:
        """The learner's eligibility-trace graph."""

    @property
    def path_to_states(self) -> dict[Path, brainstate.State]:
        """The model's states by their path in the model."""


def plan_sharding(
    learner: brainstate.nn.Module, core: _CompiledLearner, sharding: Sharding, batch_size: int | None, vmapped: bool,
) -> ShardingPlan:
    """The placement of every state of ``learner`` (``core``: the compiled learner it is or wraps).

    Raises
    ------
    ValueError
        For a hidden unit count the hidden devices do not divide (see :func:`check_batch_size`
        for the batch, checked before compiling).
    """
    hidden_sizes = _check_hidden_sizes(core.graph.hidden_groups, sharding, batched=batch_size is not None and not vmapped)
    plan = ShardingPlan(sharding, batch_size, hidden_sizes, [])
    model_paths = {id(st): p for p, st in core.path_to_states.items()}
    labels = _relation_labels(core.graph.hidden_param_op_relations)
    seen: set[int] = set()
    for path, state in learner.states().items():
        if id(state) in seen:
            continue
        seen.add(id(state))
        is_param = isinstance(state, brainstate.ParamState)
        shardings = jax.tree.map(lambda leaf: sharding.named(plan.leaf_spec(tuple(np.shape(leaf)), is_param)),
                                 state.value)
        named = model_paths.get(id(state))
        plan._placed.append(_Placed(named if named is not None else _readable(tuple(path), labels), state, shardings))
    return plan


def _relation_labels(relations: Sequence[HiddenParamOpRelation]) -> dict[int, str]:
    """A name for the ``id`` of each relation's output and input variable (traces are keyed by them)."""
    labels = {}
    for rel in relations:
        name = ".".join(str(k) for k in next(iter(rel.trainable_paths.values())))
        labels[id(rel.y_var)] = name
        if rel.x_var is not None:
            labels.setdefault(id(rel.x_var), f"{name}:input")
    return labels


def _readable(path: tuple[Hashable, ...], labels: dict[int, str]) -> Path:
    """``path`` with every variable ``id`` in it replaced by its label (nested tuples flattened)."""
    out: list[Hashable] = []
    for key in path:
        if isinstance(key, tuple):
            out.extend(_readable(key, labels))
        else:
            out.append(labels.get(key, key) if isinstance(key, int) else key)
    return tuple(out)


@contextlib.contextmanager
def _rows_for(plan: ShardingPlan | None) -> Iterator[None]:
    """Batch-row sums as one reduction while ``plan`` splits the batch over several devices.

    On CPU the rules add batch rows in a loop that indexes them one by one; on a batch split
    over devices each index would gather the whole trace onto every device.
    """
    if plan is None or plan.batch_size is None or plan.sharding.batch_devices == 1:
        yield
    else:
        with vectorised_rows():
            yield


def sharded_call(plan: ShardingPlan | None, update: Callable[..., PyTree], args: tuple[PyTree, ...],
                 options: Mapping[str, object]) -> PyTree:
    """``update(*args, **options)``, its inputs and written states constrained by ``plan`` (if any)."""
    if plan is None:
        return update(*args, **options)
    with _rows_for(plan):
        out = update(*plan.constrain_inputs(args), **options)
    plan.constrain_states()
    return out


class _Sharded(Protocol):
    """A learner whose calls may be sharded."""

    @property
    def sharding_plan(self) -> ShardingPlan | None:
        """The placement of its states (``None``: not sharded)."""


#: The learner a method of :func:`rows_follow_sharding` is bound to.
Learner = TypeVar("Learner", bound=_Sharded)
#: The method's other parameters.
Arguments = ParamSpec("Arguments")
#: What the method returns.
Returns = TypeVar("Returns")


def rows_follow_sharding(
    method: Callable[Concatenate[Learner, Arguments], Returns],
) -> Callable[Concatenate[Learner, Arguments], Returns]:
    """A learner method (the backward pass, traced after the call returns) that sums batch rows
    as :func:`sharded_call` does for the learner's ``sharding_plan``."""
    @functools.wraps(method)
    def wrapped(self: Learner, *args: Arguments.args, **kwargs: Arguments.kwargs) -> Returns:
        with _rows_for(self.sharding_plan):
            return method(self, *args, **kwargs)

    return wrapped
