"""Exactness labels: which relations a learner trains with exactly BPTT's gradient, and why not.

:func:`relation_labels` gives every relation of a compiled learner an
:class:`~braintrace._compiler.exactness_label.ExactnessLabel`: ``exact`` when the math
guarantees that the learner's online gradient of the relation's weights equals the BPTT
gradient of the same objective, ``approximate`` with the reasons otherwise. The regime is
``vjp_method='single-step'`` (one call per step, from a fresh start), or windows of
``'multi-step'`` with the trace entering each window; one window covering the whole sequence is
exact for every rule, which is a usage, not a label. :func:`plain_weight_labels` labels the
weights outside every relation.

The rules that make a label approximate, and the labelling itself, live in
:mod:`braintrace._algorithm.engine.exactness_reasons`, which reads only the compiled graph, the
learner's coordinate (``learner.config``) and the reasons its rule declares
(``learner.rule_approximations``); this module checks the learner and hands them over.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._algorithm.engine.exactness import relation_labels
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> [label.describe() for label in relation_labels(braintrace.compile(Leaky(), 'd_rtrl', jnp.ones(3)))]
['exact']
>>> dense = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones(3))
>>> print(relation_labels(dense)[0].describe())
approximate: hidden group 0's recurrence passes through a weight operation (a recurrent weight
mixing hidden units), which the diagonal scope leaves out of D: it keeps only each unit's own
element-wise dependence
"""

from __future__ import annotations

from braintrace._algorithm.engine.base import ETraceAlgorithm
from braintrace._algorithm.engine.exactness_reasons import (
    label_plain_weights,
    label_relations,
    rule_reasons_of,
    structural_reasons,
)
from braintrace._compiler.exactness_label import ExactnessLabel

__all__ = ["relation_labels", "plain_weight_labels", "rule_reasons", "structural_reasons"]


def relation_labels(learner: ETraceAlgorithm) -> list[ExactnessLabel]:
    """The :class:`ExactnessLabel` of every relation of a compiled ``learner``, in relation order.

    Raises
    ------
    TypeError
        If ``learner`` is not an :class:`~braintrace.ETraceAlgorithm`.
    RuntimeError
        If it is not compiled.
    """
    _check_compiled("relation_labels", learner)
    return label_relations(learner.graph, learner.rule_approximations, learner.config)


def plain_weight_labels(learner: ETraceAlgorithm) -> list[ExactnessLabel]:
    """The :class:`ExactnessLabel` of every ``ParamState`` outside the relations of a compiled ``learner``.

    In model order (``learner.report.excluded_weights``); ``hidden_paths`` holds the states the
    weight's value reaches.

    Raises
    ------
    TypeError
        If ``learner`` is not an :class:`~braintrace.ETraceAlgorithm`.
    RuntimeError
        If it is not compiled.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._algorithm.engine.exactness import plain_weight_labels
    >>> class Net(brainstate.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.cell = braintrace.nn.ValinaRNNCell(3, 4)
    ...         self.readout = brainstate.ParamState(jnp.ones((4, 2)))
    ...     def update(self, x):
    ...         return self.cell(x) @ self.readout.value
    >>> [label.describe() for label in plain_weight_labels(braintrace.compile(Net(), 'd_rtrl', jnp.ones(3)))]
    ['exact']
    """
    _check_compiled("plain_weight_labels", learner)
    return label_plain_weights(learner.graph)


def _check_compiled(caller: str, learner: object) -> None:
    if not isinstance(learner, ETraceAlgorithm):
        raise TypeError(f"{caller}: expected a compiled braintrace learner, got {type(learner).__name__}.")
    if not learner.is_compiled:
        raise RuntimeError(f"{caller}: the learner is not compiled yet: call compile_graph(example_input) first.")


def rule_reasons(learner: ETraceAlgorithm) -> tuple[str, ...]:
    """Why ``learner``'s rule is approximate whatever the model (empty: it follows the model).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> from braintrace._algorithm.engine.exactness import rule_reasons
    >>> rule_reasons(braintrace.D_RTRL(braintrace.nn.ValinaRNNCell(3, 4)))
    ()
    >>> rule_reasons(braintrace.OTTT(braintrace.nn.ValinaRNNCell(3, 4), leak=0.9))
    ("presynaptic trace (OTTT's leaky input trace ignores the hidden Jacobian and df)",)
    """
    return rule_reasons_of(learner.rule_approximations, learner.config)
