"""Markers for the time structure of a learner's input: ``SingleStepData`` and ``MultiStepData``.

A bare array (or pytree) is the input of one time step. ``MultiStepData(x)`` marks an input
whose leaves carry a leading time axis ``T``: the learner then runs ``T`` steps in one call
(a ``lax.scan``), reusing single-step inputs at every step.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> from braintrace._algorithm.engine.input_data import get_single_step_data, has_multistep_data
>>> xs = braintrace.MultiStepData(jnp.zeros((5, 3)))
>>> has_multistep_data(xs, jnp.ones(2)), get_single_step_data(xs)[0].shape
(True, (3,))
"""

from __future__ import annotations

from typing import Callable

import brainstate
import jax

from braintrace._typing import PyTree

__all__ = [
    "SingleStepData",
    "MultiStepData",
    "has_multistep_data",
    "get_single_step_data",
    "split_input_data_types",
    "merge_data",
    "sequence_length",
    "run_model",
]


class ETraceInputData:
    """Base of the input markers; ``data`` is the wrapped pytree."""

    def __init__(self, data: PyTree) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.data!r})"


class SingleStepData(ETraceInputData):
    """The input of one time step (the default for unmarked inputs).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> braintrace.SingleStepData(jnp.ones(3))
    SingleStepData(Array([1., 1., 1.], dtype=float32))
    >>> learner(braintrace.SingleStepData(jnp.ones(3))).shape  # the same as learner(jnp.ones(3))
    (4,)
    """


class MultiStepData(ETraceInputData):
    """Inputs of several time steps: every leaf has a leading time axis ``T``.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3),
    ...                              vjp_method='multi-step')
    >>> learner(braintrace.MultiStepData(jnp.ones((5, 3)))).shape  # 5 steps, one output per step
    (5, 4)
    """


def _register(cls: type[ETraceInputData]) -> None:
    jax.tree_util.register_pytree_node(cls, lambda d: ((d.data,), None), lambda _, children: cls(children[0]))
    cls.__module__ = "braintrace"


_register(SingleStepData)
_register(MultiStepData)


def _is_marker(x: object) -> bool:
    return isinstance(x, ETraceInputData)


def has_multistep_data(*args: PyTree) -> bool:
    """Whether any argument contains a :class:`MultiStepData` marker."""
    return any(isinstance(leaf, MultiStepData) for leaf in jax.tree.leaves(args, is_leaf=_is_marker))


def get_single_step_data(*args: PyTree) -> tuple[PyTree, ...]:
    """The arguments of the first step: markers unwrapped, multi-step leaves taken at ``t = 0``."""
    def first(x: PyTree) -> PyTree:
        if isinstance(x, MultiStepData):
            return jax.tree.map(lambda a: a[0], x.data)
        if isinstance(x, SingleStepData):
            return x.data
        return x

    return tuple(jax.tree.map(first, args, is_leaf=_is_marker))


def split_input_data_types(*args: PyTree) -> tuple[dict[int, PyTree], dict[int, PyTree], jax.tree_util.PyTreeDef]:
    """``(single {i: data}, multi {i: data}, treedef)`` over the marker-level leaves of ``args``."""
    leaves, treedef = jax.tree.flatten(args, is_leaf=_is_marker)
    single, multi = {}, {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, MultiStepData):
            multi[i] = leaf.data
        else:
            single[i] = leaf.data if isinstance(leaf, SingleStepData) else leaf
    return single, multi, treedef


def merge_data(tree_def: jax.tree_util.PyTreeDef, *parts: dict[int, PyTree]) -> tuple[PyTree, ...]:
    """Rebuild the arguments from :func:`split_input_data_types` parts (markers removed)."""
    merged: dict[int, PyTree] = {}
    for part in parts:
        merged.update(part)
    missing = [i for i in range(tree_def.num_leaves) if i not in merged]
    if missing:
        raise ValueError(f"merge_data: input leaves {missing} are missing.")
    return tuple(jax.tree.unflatten(tree_def, [merged[i] for i in range(tree_def.num_leaves)]))


def sequence_length(multi: dict[int, PyTree]) -> int:
    """The shared leading length ``T`` of every multi-step leaf."""
    lengths = {a.shape[0] for data in multi.values() for a in jax.tree.leaves(data)}
    if len(lengths) != 1:
        raise ValueError(
            f"The sequence size should be the same for every MultiStepData input, got lengths "
            f"{sorted(lengths)}."
        )
    return lengths.pop()


def run_model(model: Callable[..., PyTree], args: tuple[PyTree, ...]) -> PyTree:
    """``model(*args)`` for one step; over a :class:`MultiStepData` window, one call per step in a
    ``brainstate.transform.for_loop``, the outputs stacked (single-step inputs reused at every step).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> run_model(lambda x, b: x + b, (MultiStepData(jnp.ones((5, 3))), jnp.ones(3))).shape
    (5, 3)
    """
    single, multi, treedef = split_input_data_types(*args)
    if not multi:
        return model(*merge_data(treedef, single))
    return brainstate.transform.for_loop(lambda step: model(*merge_data(treedef, single, step)), multi)
