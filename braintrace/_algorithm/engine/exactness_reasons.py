"""Why a relation is approximate: the rules behind the exactness labels, read from a compiled graph.

:func:`label_relations` and :func:`label_plain_weights` label the relations and the plain weights
of a compiled :class:`~braintrace._compiler.ETraceGraph` for a learner given by its coordinate
(:class:`~braintrace._algorithm.engine.config.ETraceConfig`, or ``None``) and the reasons its rule
declares (``rule_approximations``). The learners' ``report`` calls them; the public entry that
takes a learner is :mod:`braintrace._algorithm.engine.exactness`. This module knows no learner class.

A label is ``exact`` only when none of the rules below applies; each rule that applies adds its
reason.

The learner's rule, whatever the model:

* ``trace_factorization='io_factorized'`` (pp_prop, OSTLFeedforward): a factorised trace,
  ``x̄ ⊗ ε_f`` in place of the per-parameter trace;
* ``'random_projection'`` (UORO): a random rank-one estimate, unbiased but not exact;
* ``temporal_recursion`` ``'scalar_leak'`` or ``'none'``: ``decay·I`` or nothing in place of ``D``;
* ``learning_signal`` ``'random_feedback'`` or ``'modulatory'`` (ThreeFactor): not ``∂L/∂h``;
* ``trace_filter='kappa'`` (EProp's ``κ``): the gradient reads the filtered trace;
* a rule without an ETraceConfig coordinate (OSTTP, OTTT, OTPE) names its own reasons in its class attribute
  ``rule_approximations``: OSTTP's target projection replacing ``∂L/∂h``, OTTT's presynaptic
  trace, OTPE's fixed leak in place of ``D``.

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
>>> import jax.numpy as jnp, braintrace
>>> from braintrace._algorithm.engine.exactness_reasons import label_relations
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'pp_prop', jnp.ones(3), decay_or_rank=0.9)
>>> [label.exact for label in label_relations(learner.graph, learner.rule_approximations, learner.config)]
[False]
"""

from __future__ import annotations

from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._compiler import ETraceGraph
from braintrace._compiler.exactness_facts import GroupFacts, RelationFacts, plain_weight_facts, relation_facts
from braintrace._compiler.exactness_label import ExactnessLabel
from braintrace._compiler.snap_pattern import tail_within_neighbourhoods
from braintrace._typing import Path

__all__ = ["label_relations", "label_plain_weights", "rule_reasons_of", "structural_reasons"]


_SIGNAL_REASONS = {
    "random_feedback": "random feedback replaces ∂L/∂h (a fixed random projection, not the loss gradient)",
    "modulatory": "a modulator replaces ∂L/∂h (ThreeFactor's third factor, not the loss gradient)",
}

_RECURSION_REASONS = {
    "scalar_leak": "scalar-leak recursion (the trace rolls with decay·I in place of the hidden Jacobian)",
    "none": "no trace recursion (the trace keeps only the current step)",
}


def label_relations(graph: ETraceGraph, rule_approximations: tuple[str, ...],
                    config: ETraceConfig | None) -> list[ExactnessLabel]:
    """The :class:`ExactnessLabel` of every relation of ``graph``, in relation order.

    For a learner whose rule declares ``rule_approximations`` (its class attribute) and whose
    coordinate is ``config`` (``None``: a rule outside ETraceConfig's space).
    """
    rule = rule_reasons_of(rule_approximations, config)
    labels = []
    for facts in relation_facts(graph):
        reasons = (*rule, *structural_reasons(facts, config))
        labels.append(ExactnessLabel(facts.weight_path, facts.weight_paths, facts.hidden_paths, not reasons, reasons))
    return labels


def label_plain_weights(graph: ETraceGraph) -> list[ExactnessLabel]:
    """The :class:`ExactnessLabel` of every ``ParamState`` of ``graph`` outside its relations, in model order.

    ``hidden_paths`` holds the states the weight's value reaches; the learner does not matter.
    """
    labels = []
    for facts in plain_weight_facts(graph):
        reasons = () if not facts.reaches else (
            f"its value reaches the states {_paths(facts.reaches)}, where no trace follows it: only its gradient "
            f"within each step (or window) counts, not its influence on later steps",)
        labels.append(ExactnessLabel(facts.weight_path, (facts.weight_path,), facts.reaches, not reasons, reasons))
    return labels


def rule_reasons_of(rule_approximations: tuple[str, ...], config: ETraceConfig | None) -> tuple[str, ...]:
    """Why a rule declaring ``rule_approximations``, at coordinate ``config``, is approximate whatever the model.

    Empty: the rule follows the model.

    Examples
    --------
    >>> from braintrace._algorithm.engine.config import ETraceConfig
    >>> from braintrace._algorithm.engine.exactness_reasons import rule_reasons_of
    >>> rule_reasons_of((), ETraceConfig())
    ()
    >>> rule_reasons_of((), None)
    ('the rule has no ETraceConfig coordinate, so no exactness is established',)
    """
    if config is None:
        return rule_approximations or ("the rule has no ETraceConfig coordinate, so no exactness is established",)
    return (*rule_approximations, *_config_reasons(config))


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

