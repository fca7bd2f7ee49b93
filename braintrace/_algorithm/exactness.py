"""Exactness labels: which relations a learner trains with exactly BPTT's gradient, and why not.

:func:`relation_labels` gives every relation of a compiled learner an
:class:`~braintrace._compiler.exactness_label.ExactnessLabel`: ``exact`` when the math
guarantees that the learner's online gradient of the relation's weights equals the BPTT
gradient of the same objective, ``approximate`` with the reasons otherwise. The regime is
``vjp_method='single-step'`` (one call per step, from a fresh start), or windows of
``'multi-step'`` with the trace entering each window; one window covering the whole sequence is
exact for every rule, which is a usage, not a label.

A label is ``exact`` only when none of the rules below applies; each rule that applies adds its
reason.

The learner's rule, whatever the model:

* ``trace_factorization='io_factorized'`` (pp_prop, OSTLFeedforward): a factorised trace,
  ``x̄ ⊗ ε_f`` in place of the per-parameter trace;
* ``'random_projection'`` (UORO): a random rank-one estimate, unbiased but not exact;
* ``temporal_recursion`` ``'scalar_leak'`` or ``'none'``: ``decay·I`` or nothing in place of ``D``;
* ``learning_signal`` ``'random_feedback'`` or ``'modulatory'`` (ThreeFactor): not ``∂L/∂h``;
* ``trace_filter='kappa'`` (EProp's ``κ``): the gradient reads the filtered trace;
* OSTTP: the target projection replaces ``∂L/∂h``; OTTT and OTPE (no coordinate): a
  presynaptic trace, a fixed leak in place of ``D``.

``learning_signal='bootstrapped'`` (DNI) adds no reason: its synthetic gradient reaches only
parameters outside every relation; relation weights get multi-step D_RTRL's gradient.

The compiled step (:mod:`braintrace._compiler.exactness_facts`), per driven hidden group, under
the learner's ``recurrence_scope``:

* the recurrence passes through a weight operation the diagonal scope cuts out of ``D`` (D_RTRL
  keeps each unit's own element-wise dependence);
* the recurrence mixes positions: the ``diagonal`` and ``coupled`` scopes keep each position's
  own block of ``D``; ``sparse_n`` only when its neighbourhoods are not saturated (a saturated
  SnAp is full within-group RTRL); a recurrence the position walk cannot read counts as mixing
  for the first two (SnAp then follows every position);
* the ``y -> h`` tail delivers ``y`` at other positions (a roll, a mix after the operation):
  outside the SnAp neighbourhoods, or anywhere for the other scopes; a tail the walk cannot read
  counts as moving;
* the group feeds states outside it (a layer stacked on it, an accumulator): cross-group
  coupling is traced by no scope;

and per relation, for every scope: ``y`` reaching states outside its groups other than through
them, the weight reaching states other than through its traced operations, ``y`` reaching a group
also through another trainable operation the tail stops at, and a relation inside a descended
scan (not analysed). UORO's projection follows the whole within-group Jacobian and every tail,
so only the per-relation rules and cross-group feeding add to its own reason.

A weight outside every relation (:func:`plain_weight_labels`) has no trace, whatever the
learner: it is ``exact`` when its value reaches no state the step writes (a readout), since then
its BPTT gradient is the sum of its gradients within each step, which every learner computes;
otherwise it is ``approximate``, its influence on later steps being followed by nothing.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._algorithm.exactness import relation_labels
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

from braintrace._algorithm.base import ETraceAlgorithm
from braintrace._algorithm.config import ETraceConfig
from braintrace._algorithm.osttp import OSTTP
from braintrace._algorithm.otpe import OTPE
from braintrace._algorithm.ottt import OTTT
from braintrace._compiler.exactness_facts import GroupFacts, RelationFacts, plain_weight_facts, relation_facts
from braintrace._compiler.exactness_label import ExactnessLabel
from braintrace._compiler.snap_pattern import tail_within_neighbourhoods
from braintrace._typing import Path

__all__ = ["relation_labels", "plain_weight_labels", "rule_reasons", "structural_reasons"]


#: Rules outside (or beside) the coordinate space, and why none of them is exact.
_RULE_REASONS: tuple[tuple[type, str], ...] = (
    (OSTTP, "the target projection replaces ∂L/∂h (OSTTP's y_target @ B, not the loss gradient)"),
    (OTTT, "presynaptic trace (OTTT's leaky input trace ignores the hidden Jacobian and df)"),
    (OTPE, "fixed leak (OTPE's λ stands in for the hidden Jacobian)"),
)

_SIGNAL_REASONS = {
    "random_feedback": "random feedback replaces ∂L/∂h (a fixed random projection, not the loss gradient)",
    "modulatory": "a modulator replaces ∂L/∂h (ThreeFactor's third factor, not the loss gradient)",
}

_RECURSION_REASONS = {
    "scalar_leak": "scalar-leak recursion (the trace rolls with decay·I in place of the hidden Jacobian)",
    "none": "no trace recursion (the trace keeps only the current step)",
}


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
    rule = rule_reasons(learner)
    labels = []
    for facts in relation_facts(learner.graph):
        reasons = (*rule, *structural_reasons(facts, learner.config))
        labels.append(ExactnessLabel(facts.weight_path, facts.weight_paths, facts.hidden_paths, not reasons, reasons))
    return labels


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
    >>> from braintrace._algorithm.exactness import plain_weight_labels
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
    labels = []
    for facts in plain_weight_facts(learner.graph):
        reasons = () if not facts.reaches else (
            f"its value reaches the states {_paths(facts.reaches)}, where no trace follows it: only its gradient "
            f"within each step (or window) counts, not its influence on later steps",)
        labels.append(ExactnessLabel(facts.weight_path, (facts.weight_path,), facts.reaches, not reasons, reasons))
    return labels


def _check_compiled(caller: str, learner: object) -> None:
    if not isinstance(learner, ETraceAlgorithm):
        raise TypeError(f"{caller}: expected a compiled braintrace learner, got {type(learner).__name__}.")
    if not learner.is_compiled:
        raise RuntimeError(f"{caller}: the learner is not compiled yet: call compile_graph(example_input) first.")


def rule_reasons(learner: ETraceAlgorithm) -> tuple[str, ...]:
    """Why ``learner``'s rule is approximate whatever the model (empty: it follows the model)."""
    reasons = [reason for cls, reason in _RULE_REASONS if isinstance(learner, cls)]
    config = learner.config
    if config is None:
        return tuple(reasons) or ("the rule has no ETraceConfig coordinate, so no exactness is established",)
    return (*reasons, *_config_reasons(config))


def _config_reasons(config: ETraceConfig) -> list[str]:
    reasons = []
    if config.trace_factorization == "io_factorized":
        reasons.append("factorised trace (pp_prop keeps x̄ ⊗ ε_f, a rank-one summary of the per-parameter trace)")
    elif config.trace_factorization == "random_projection":
        reasons.append("random projection (UORO is unbiased, not exact)")
    elif config.temporal_recursion in _RECURSION_REASONS:
        reasons.append(_RECURSION_REASONS[str(config.temporal_recursion)])
    if config.learning_signal in _SIGNAL_REASONS:
        reasons.append(_SIGNAL_REASONS[config.learning_signal])
    if config.trace_filter == "kappa":
        reasons.append("filtered trace (EProp's κ: the gradient reads ē ← κ ē + ε, not ε)")
    return reasons


def _paths(paths: tuple[Path, ...]) -> str:
    return ", ".join(str(p) for p in paths)


def structural_reasons(facts: RelationFacts, config: ETraceConfig | None) -> tuple[str, ...]:
    """Why the compiled step keeps a learner of coordinate ``config`` from BPTT on this relation.

    ``None`` (a rule without a coordinate): nothing is read, its rule reason stands alone.
    """
    if config is None:
        return ()
    if facts.descended:
        return ("the relation lives in a descended scan, whose exactness this analysis does not establish",)
    scope = "projected" if config.trace_factorization == "random_projection" else config.recurrence_scope
    reasons = []
    if facts.untraced_uses:
        reasons.append(f"the weight also reaches the states {_paths(facts.untraced_uses)} outside its traced "
                       f"operations (a plain use, not traced)")
    if facts.output_feeds:
        reasons.append(f"the operation's output reaches the states {_paths(facts.output_feeds)} outside its hidden "
                       f"groups, which no trace of it follows")
    if facts.indirect:
        reasons.append("the operation's output also reaches its hidden states through another trainable "
                       "operation, whose credit the trace does not carry")
    for group in facts.groups:
        if group.feeds:
            reasons.append(f"hidden group {group.group_index} feeds the states {_paths(group.feeds)} outside it "
                           f"(cross-group coupling is not traced)")
        if scope != "projected":
            reasons += _recurrence_reasons(group, scope, config.sparse_n)
            reasons += _tail_reasons(group, config.sparse_n)
    return tuple(reasons)


def _recurrence_reasons(group: GroupFacts, scope: str, order: int | None) -> list[str]:
    """Why ``D`` of this scope differs from the group's true hidden Jacobian."""
    i = group.group_index
    reasons = []
    if group.cut_recurrence:
        reasons.append(f"hidden group {i}'s recurrence passes through a weight operation (a recurrent weight "
                       f"mixing hidden units), which the {scope} scope leaves out of D: it keeps only each "
                       f"unit's own element-wise dependence")
    if group.snap is not None:
        if not group.snap.is_saturated:
            reasons.append(f"SnAp-{order}'s neighbourhoods do not cover hidden group {i}'s whole dependence "
                           f"(not saturated at n = {order})")
    elif group.adjacency_unreadable is not None:
        reasons.append(f"hidden group {i}'s recurrence could not be read position by position "
                       f"({group.adjacency_unreadable})")
    elif group.mixes_positions:
        reasons.append(f"hidden group {i}'s recurrence mixes positions (hidden units) and the {scope} scope "
                       f"keeps only each position's own block of D")
    return reasons


def _tail_reasons(group: GroupFacts, order: int | None) -> list[str]:
    """Why ``df`` of a per-position (or SnAp-widened) trace misses where the tail delivers ``y``."""
    i = group.group_index
    if group.tail_reach is None:
        return [f"the y→h tail into hidden group {i} could not be read position by position "
                f"({group.tail_unreadable})"]
    if group.snap is not None:
        if not tail_within_neighbourhoods(group.tail_reach, group.snap):
            return [f"the y→h tail moves values outside SnAp-{order}'s neighbourhoods of hidden group {i}"]
        return []
    if group.tail_moves_positions:
        return [f"the y→h tail moves values between positions of hidden group {i}"]
    return []

