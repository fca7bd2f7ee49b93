"""A relation's trainable operands as a learner reads them, and the credit of their gradients to the parameters.

An ETP operation may read its weight through ordinary operations on parameters (``W * mask``,
``jnp.abs(W)``, ``W.T``, a concatenation): its operand is then not a parameter leaf but is
computed from some (:class:`~braintrace._compiler.operand_chain.OperandChain`). A learner keeps
its traces with respect to the operand; this module gives the operand's current value
(:func:`relation_operands`) and hands a gradient with respect to it back to the parameter leaves
it is computed from (:func:`add_operand_gradient`). :func:`build_operand_chains` finds the chains
once, at compile time, and refuses an operand whose trace cannot be credited to a parameter.
"""

from __future__ import annotations

from typing import Protocol

import jax

from braintrace._compiler import ETraceGraph, LocalRelationWeights
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.operand_chain import OperandChain, operand_chain
from braintrace._errors import NotSupportedError
from braintrace._op._rule_helpers import shape_of, sum_leading
from braintrace._typing import Path, PyTree

__all__ = ["CreditHost", "OperandChains", "build_operand_chains", "relation_parameter_paths", "relation_operands",
           "add_operand_gradient", "add_to_leaf"]

#: ``id(operand var) -> chain``: how each trainable operand that is not a parameter leaf is computed.
OperandChains = dict[int, OperandChain]


class CreditHost(Protocol):
    """A learner as its gradient functions read it to credit a relation's operands to parameters.

    What the trace engines' solve functions (:mod:`braintrace._algorithm.param_trace.solve`,
    :mod:`braintrace._algorithm.io_trace.solve`) share of the learner: every
    :class:`~braintrace.ETraceVjpAlgorithm` has these members.
    """

    @property
    def graph(self) -> ETraceGraph:
        """The compiled graph of the model step."""

    @property
    def _modulated(self) -> bool:
        """Whether the coordinate is ``learning_signal='modulatory'``."""

    def _relation_operands(self, rel: HiddenParamOpRelation, weight_vals: dict[Path, PyTree]) -> dict[str, jax.Array]:
        """The current values of ``rel``'s trainable operands."""

    def _relation_parameter_paths(self) -> frozenset[Path]:
        """The parameters some relation reads."""

    def _add_operand_gradient(
        self, grads: dict[Path, PyTree], rel: HiddenParamOpRelation, key: str, g: PyTree,
        weight_vals: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        """``grads`` plus ``g``, credited from ``rel``'s operand ``key`` to its parameters."""

    def _local_relation_weights(self) -> LocalRelationWeights:
        """Single step: the weights left out of the one-step VJP."""


def build_operand_chains(graph: ETraceGraph) -> OperandChains:
    """The chain of every trainable operand that is not a parameter leaf itself.

    Raises
    ------
    NotSupportedError
        For an operand computed inside a descended scan, or from values that change from step
        to step.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> build_operand_chains(learner.graph)  # the cell's operand is its weight itself
    {}
    """
    minfo = graph.module_info
    chains: OperandChains = {}
    for rel in graph.hidden_param_op_relations:
        for key, processing in rel.trainable_processing_chains.items():
            if not processing:
                continue
            operand = rel.trainable_vars[key]
            where = (f"The {key!r} operand of {rel.primitive.name} (parameter {rel.trainable_paths[key]}) "
                     f"is computed through {[p.name for p in processing]}")
            if rel.control_flow_context is not None:
                raise NotSupportedError(
                    f"{where} inside a descended scan, where its eligibility trace cannot be "
                    f"credited back through that computation. Pass the parameter to the operation "
                    f"as it is (a transform can go in weight_fn), or unroll the scan."
                )
            chain = operand_chain(minfo.closed_jaxpr, operand, minfo.invar_to_weight_path,
                                  minfo.weight_path_to_invars)
            if chain is None:
                raise NotSupportedError(
                    f"{where} from values that change from step to step, so its eligibility "
                    f"trace cannot be credited to the parameter. Compute the operand from "
                    f"parameters and constants only, or move the step-dependent part into "
                    f"weight_fn or out of the operand."
                )
            chains[id(operand)] = chain
    return chains


def relation_parameter_paths(graph: ETraceGraph, chains: OperandChains) -> frozenset[Path]:
    """The parameters some relation reads, as an operand or through its operand chain (the
    ETP parameters, whose gradient is the rule's; every other parameter is plain).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> relation_parameter_paths(learner.graph, {})
    frozenset({('W', 'weight')})
    """
    direct = {path for rel in graph.hidden_param_op_relations for path in rel.trainable_paths.values()}
    chained = {path for chain in chains.values() for path, _ in chain.leaves}
    return frozenset(direct | chained)


def relation_operands(
    chains: OperandChains, rel: HiddenParamOpRelation, weight_vals: dict[Path, PyTree]
) -> dict[str, jax.Array]:
    """The current values of a relation's trainable operands (mantissas).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> rel = learner.graph.hidden_param_op_relations[0]
    >>> weights = {p: st.value for p, st in learner.param_states.items()}
    >>> {k: v.shape for k, v in relation_operands({}, rel, weights).items()}
    {'weight': (7, 4), 'bias': (4,)}
    """
    out = {}
    for key, path in rel.trainable_paths.items():
        chain = chains.get(id(rel.trainable_vars[key]))
        out[key] = (chain.value(weight_vals) if chain is not None
                    else jax.tree.leaves(weight_vals[path])[rel.trainable_leaf_indices[key]])
    return out


def add_operand_gradient(
    chains: OperandChains, grads: dict[Path, PyTree], rel: HiddenParamOpRelation, key: str, g: jax.Array,
    weight_vals: dict[Path, PyTree],
) -> dict[Path, PyTree]:
    """``grads`` plus ``g``, a gradient with respect to the relation's operand ``key``, credited
    to the parameter leaves the operand is computed from.

    Leading axes of ``g`` beyond the operand's (the batch an element-wise weight broadcasts
    over) are summed first.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> rel = learner.graph.hidden_param_op_relations[0]
    >>> weights = {p: st.value for p, st in learner.param_states.items()}
    >>> zeros = {p: {k: jnp.zeros_like(v) for k, v in w.items()} for p, w in weights.items()}
    >>> grads = add_operand_gradient({}, zeros, rel, 'bias', jnp.ones(4), weights)
    >>> grads[('W', 'weight')]['bias']
    Array([1., 1., 1., 1.], dtype=float32)
    """
    extra = g.ndim - len(shape_of(rel.trainable_vars[key]))
    if extra > 0:
        g = sum_leading(g, extra)
    chain = chains.get(id(rel.trainable_vars[key]))
    if chain is None:
        credits = [(rel.trainable_paths[key], rel.trainable_leaf_indices[key], g)]
    else:
        credits = chain.pullback(weight_vals, g)
    grads = dict(grads)
    for path, leaf, dg in credits:
        grads[path] = add_to_leaf(grads[path], leaf, dg)
    return grads


def add_to_leaf(tree: PyTree, leaf_index: int, value: jax.Array) -> PyTree:
    """``tree`` with ``value`` added to its ``leaf_index``-th leaf.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> add_to_leaf({'a': jnp.zeros(2), 'b': jnp.ones(2)}, 1, jnp.ones(2))
    {'a': Array([0., 0.], dtype=float32), 'b': Array([2., 2.], dtype=float32)}
    """
    leaves, treedef = jax.tree.flatten(tree)
    leaves[leaf_index] = leaves[leaf_index] + value.astype(leaves[leaf_index].dtype)
    return jax.tree.unflatten(treedef, leaves)
