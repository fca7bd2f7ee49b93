"""The learner of a group rule: :class:`GroupRuleLearner` runs any :class:`~braintrace.GroupRule`.

A :class:`~braintrace.GroupRule` holds pure functions over one carrier per hidden group, for
rules whose carrier spans the relations that drive a group (random projection's factors,
``braintrace.uoro_rule``). The learner owns everything else: it allocates, stores, resets,
checkpoints and exposes (``get_etrace_of``) the carriers, owns the PRNG key it splits for every
group each step, runs the model step inside its custom VJP and adds what ``solve`` returns to
the exact one-step gradient autodiff computes.

The graph is compiled with every path of a step inside each group's transition (recurrent
weights included: ``D`` is the whole ``∂h^t/∂h^{t-1}``), and with the relations whose output
reaches a group only through another trainable operation (a GRU's reset gate), whose pull-back
the tail's VJP crosses. Per hidden group with relations, at compile time and at every step:

* ``init(info) -> carrier``: the zero carrier (:class:`~braintrace.GroupInfo`);
* ``roll(carrier, step) -> carrier``: the carrier after this step (:class:`~braintrace.GroupStep`);
* ``solve(entering, signal, step) -> (per relation: {operand: gradient})``: what the rule adds to
  the step's exact one-step gradient, given ``∂L/∂h^t`` over the group's state.

Calls are single steps.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.GRUCell(3, 4), braintrace.uoro_rule(), jnp.ones(3), key=7)
>>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
>>> sorted(grads)  # the reset gate's weight too, which reaches h only through Wh
[('Wh', 'weight'), ('Wr', 'weight'), ('Wz', 'weight')]
>>> learner.reset_state()  # zero carriers, the key re-derived from the seed
"""

from __future__ import annotations

import functools
from typing import Any, Sequence, TypedDict

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.carriers.carrier_store import CarrierStore, TraceStore
from braintrace._algorithm.engine.base import EligibilityTrace, ETraceVjpAlgorithm
from braintrace._algorithm.engine.graph_executor import TailPoint, TransitionPoint, df_key
from braintrace._algorithm.engine.rule_contract import Carrier, GroupInfo, GroupRule, GroupStep, relation_info
from braintrace._algorithm.rules.projection_rule import key_data, tail_pullback, transition_jvp, transition_vjp
from braintrace._algorithm.rules.trace_rule import add_solved, carriers_of_weight, check_rule
from braintrace._compiler import ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.jaxpr_graph import contains_eqn
from braintrace._errors import internal_error
from braintrace._op._rule_helpers import dtype_of, shape_of
from braintrace._typing import Path, PyTree

__all__ = ["GroupRuleLearner"]


class GroupCarriers(TypedDict):
    """What a :class:`GroupRuleLearner` carries from step to step."""

    #: Per hidden group index, the rule's carrier.
    carriers: dict[int, Carrier]
    #: The PRNG key (raw ``uint32`` key data) the next step's keys are split from.
    key: jax.Array


class GroupRuleLearner(ETraceVjpAlgorithm[GroupCarriers, tuple[Any, ...]]):
    """The learner of a :class:`~braintrace.GroupRule`: one carrier per hidden group, single-step calls.

    ``braintrace.compile(model, rule, example_input, key=...)`` builds it.

    Parameters
    ----------
    model : brainstate.nn.Module
    rule : GroupRule
    name : str, optional
    vjp_method : {'single-step'}
    control_flow : ControlFlowPolicy, optional
    key : int or key array
        Seed (or key) of the keys handed to the rule: each step splits it into one key per
        hidden group and the next step's; :meth:`reset_state` re-derives it from the seed.

    Attributes
    ----------
    carriers : dict
        ``group index -> EligibilityTrace`` of the rule's carriers.
    rule_key : brainstate.ShortTermState
        The carried key.

    Raises
    ------
    TypeError
        For a ``rule`` that is not a ``GroupRule`` of callables, or a ``key`` that is neither an
        integer nor a key.
    ValueError
        For a ``vjp_method`` other than ``'single-step'``.
    NotImplementedError
        At compile time, for a group whose transition runs a ``while_loop``.
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        rule: GroupRule,
        name: str | None = None,
        vjp_method: str = "single-step",
        control_flow: ControlFlowPolicy | None = None,
        key: int | jax.Array = 0,
    ) -> None:
        check_rule(rule, GroupRule, "GroupRuleLearner", vjp_method, windows="UORO")
        data = key_data(key, "key")
        super().__init__(model, name=name, vjp_method=vjp_method, control_flow=control_flow)
        executor = self.vjp_executor
        executor.include_recurrent_mixing = True
        executor.include_weight_to_weight = True
        executor.transition_points = True
        self.rule = rule
        self._key_data = data
        self.carriers: TraceStore[int] = CarrierStore()
        self.rule_key = brainstate.ShortTermState(jnp.asarray(data))
        self._infos: dict[int, GroupInfo] = {}
        self._relations: dict[int, list[HiddenParamOpRelation]] = {}
        self._rolled_keys: jax.Array | None = None

    # --- the carriers ----------------------------------------------------------------------

    def init_etrace_state(self, *args: Any, **kwargs: Any) -> None:
        """Allocate every group's carrier with the rule's ``init``; the key from its seed."""
        for group in self.graph.hidden_groups:
            if contains_eqn(group.transition_jaxpr, lambda e: e.primitive.name == "while"):
                raise NotImplementedError(
                    f"GroupRuleLearner: the transition of hidden group {group.index} ({group.hidden_paths}) runs "
                    f"a while_loop, which reverse mode cannot cross for the step's Dᵀ g. Write the loop with a "
                    f"fixed trip count (lax.fori_loop with static bounds, or lax.scan), or use D_RTRL.")
        relations: dict[int, list[HiddenParamOpRelation]] = {}
        for rel in self.graph.hidden_param_op_relations:
            for group in rel.hidden_groups:
                relations.setdefault(group.index, []).append(rel)
        self._relations = dict(sorted(relations.items()))
        self._infos = {gi: self._group_info(gi, None) for gi in self._relations}
        carriers = {}
        for gi, info in self._infos.items():
            carrier = self.rule.init(info)
            leaves = jax.tree.leaves(carrier)
            if not leaves or not all(isinstance(v, jax.Array) for v in leaves):
                raise TypeError(
                    f"GroupRule.init must return a pytree of JAX arrays (a carrier) for hidden group {gi}, got "
                    f"{carrier!r}.")
            carriers[gi] = carrier
        self.carriers = CarrierStore.of_zeros(carriers, EligibilityTrace)
        self.rule_key.value = jnp.asarray(self._key_data)

    def _group_info(self, index: int, batch_size: int | None) -> GroupInfo:
        """The :class:`GroupInfo` of group ``index``; with ``batch_size``, its state leads with that size."""
        group = self.graph.hidden_groups[index]
        hidden = jax.eval_shape(lambda: group.concat_hidden(
            [jnp.zeros(shape_of(v), dtype_of(v)) for v in group.hidden_invars]))
        shape = tuple(hidden.shape)
        if batch_size is not None and self.batch_size is not None:
            shape = (batch_size, *shape[1:])
        infos = tuple(relation_info(rel, group) for rel in self._relations[index])
        return GroupInfo(jax.ShapeDtypeStruct(shape, hidden.dtype), infos, index)

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        """Zero every carrier and ``running_index``; re-derive the key from the seed.

        With ``batch_size``, on a learner compiled with a batch, each carrier is re-allocated at
        what the rule's ``init`` gives for a group state of that leading size.
        """
        self.carriers.reset()
        if batch_size is not None:
            self.carriers.reallocate({gi: self.rule.init(self._group_info(gi, batch_size)) for gi in self._infos})
        self.rule_key.value = jnp.asarray(self._key_data)
        self.running_index.value = jnp.zeros_like(self.running_index.value)

    def _get_etrace_data(self) -> GroupCarriers:
        return GroupCarriers(carriers=self.carriers.read(), key=self.rule_key.value)

    def _assign_etrace_data(self, etrace_vals: GroupCarriers) -> None:
        self.carriers.assign(etrace_vals["carriers"])
        self.rule_key.value = etrace_vals["key"]

    def get_etrace_of(self, weight: brainstate.ParamState | Path) -> dict[int, Carrier]:
        """The carriers of every hidden group a relation of ``weight`` (a ``ParamState`` or its path) drives.

        Raises
        ------
        ValueError
            If no relation learns ``weight``.
        """
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        return carriers_of_weight(
            self.carriers,
            (gi for gi, rels in self._relations.items() if any(path in rel.trainable_paths.values() for rel in rels)),
            weight, path)

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> Carrier:
        return self.carriers[group.index].value

    # --- one step --------------------------------------------------------------------------

    def _steps(self, jac: Any, weight_vals: dict[Path, PyTree], keys: jax.Array) -> dict[int, GroupStep]:
        """Every group's :class:`GroupStep` from the step's points; group ``i`` takes ``keys[i + 1]``."""
        (xs, tails), points = jac
        steps = {}
        for gi, rels in self._relations.items():
            group, point = self.graph.hidden_groups[gi], points[gi]
            if not isinstance(point, TransitionPoint):
                raise internal_error("a group rule received hidden Jacobians, though its executor sets transition_points")
            pulls = []
            for rel in rels:
                tail = tails[df_key(rel, group)]
                if not isinstance(tail, TailPoint):
                    raise internal_error(f"the tail of {rel.primitive.name} under control flow reached a group rule")
                pulls.append(tail_pullback(rel, group, tail))
            steps[gi] = GroupStep(
                xs=tuple(None if rel.x_var is None else xs[id(rel.x_var)] for rel in rels),
                weights=tuple(self._relation_operands(rel, weight_vals) for rel in rels),
                tail_vjps=tuple(pulls),
                transition_jvp=functools.partial(transition_jvp, group, point),
                transition_vjp=functools.partial(transition_vjp, group, point),
                key=keys[gi + 1], info=self._infos[gi])
        return steps

    def _update_etrace_data(
        self, running_index: Any, etrace_vals_util_t_1: GroupCarriers, hid2weight_jac_single_or_multi_times: Any,
        hid2hid_jac_single_or_multi_times: Any, weight_vals: dict[Path, PyTree], input_is_multi_step: bool,
    ) -> GroupCarriers:
        keys = jax.random.split(etrace_vals_util_t_1["key"], len(self.graph.hidden_groups) + 1)
        # The forward pass asks for the residual next, in the same trace: it reads these keys.
        self._rolled_keys = keys
        jac = (hid2weight_jac_single_or_multi_times, hid2hid_jac_single_or_multi_times)
        steps = self._steps(jac, weight_vals, keys)
        carriers = etrace_vals_util_t_1["carriers"]
        return GroupCarriers(carriers={gi: self.rule.roll(carriers[gi], steps[gi]) for gi in carriers}, key=keys[0])

    def _trace_for_backward(
        self, old_etrace: GroupCarriers, new_etrace: GroupCarriers, jac: Any, single_step: bool,
    ) -> tuple[Any, ...]:
        return old_etrace["carriers"], jac, self._rolled_keys

    def _solve_weight_gradients(
        self, running_index: Any, etrace_h2w_at_t: tuple[Any, ...], dl_to_hidden_groups: Sequence[jax.Array],
        weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        entering, jac, keys = etrace_h2w_at_t
        steps = self._steps(jac, weight_vals, keys)
        grads = dict(dl_to_etws_at_t)
        for gi, rels in self._relations.items():
            added = self.rule.solve(entering[gi], dl_to_hidden_groups[gi], steps[gi])
            if not isinstance(added, tuple) or len(added) != len(rels):
                raise ValueError(
                    f"GroupRule.solve must return a tuple of one dict per relation of hidden group {gi} "
                    f"({len(rels)}: {[rel.primitive.name for rel in rels]}), got {type(added).__name__} "
                    f"of length {len(added) if isinstance(added, tuple) else '-'}.")
            for rel, per_operand in zip(rels, added):
                grads = add_solved(self, grads, rel, per_operand, weight_vals, "GroupRule.solve")
        return grads


GroupRuleLearner.__module__ = "braintrace"
