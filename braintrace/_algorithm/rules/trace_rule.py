"""The learner of a rule of the contract: :class:`RuleLearner` runs any :class:`TraceRule`.

A learning rule in the spirit of optax's ``GradientTransformation``: :class:`TraceRule`
(:mod:`~braintrace._algorithm.engine.rule_contract`) holds pure functions, and
:class:`RuleLearner` (what ``braintrace.compile(model, rule, x0)`` builds) runs them for every
relation of the compiled graph and a hidden group it drives. The learner
owns everything else, once for every rule: it allocates, stores, resets, checkpoints and
exposes (``get_etrace_of``, ``named_etraces``) the carriers, runs the model step inside its
custom VJP, and adds what ``solve`` returns to the exact one-step gradient autodiff computes.

Per (relation, hidden group), at compile time and at every step:

* ``init(info) -> carrier``: the zero carrier, from the relation's shapes (:class:`RelationInfo`);
* ``roll(carrier, step) -> carrier``: the carrier after this step (:class:`RelationStep`: the
  operation's input ``x``, ``df = ∂h/∂y``, the group's hidden Jacobian ``D``, the weights);
* ``residual(entering, new, step) -> residual`` (optional): what the backward pass keeps,
  by default the carrier entering the step;
* ``solve(residual, signal, step) -> {operand: gradient}``: what the rule adds to the step's
  exact one-step gradient of the relation's trainable operands (``'weight'``, ``'bias'``, ...),
  given the learning signal ``∂L/∂h^t`` laid over ``y``'s positions.

A carrier is any pytree of arrays (a NamedTuple reads best). Calls are single steps.

Examples
--------
D-RTRL of a dense layer, exact where the recurrence is element-wise (``h ← d ⊙ h + x W``): the
trace ``ε[b, i, o] = ∂h[b, o]/∂W[i, o]`` rolls as ``d ε + x ⊗ df`` and adds the history
``⟨Dᵀ g, ε^{t-1}⟩`` to the one-step gradient.

>>> import brainstate, jax, jax.numpy as jnp, braintrace
>>> def init(info):
...     return jnp.zeros((*info.x.shape, info.y.shape[-1]), info.y.dtype)
>>> def roll(eps, step):
...     d, df = step.diag[..., 0, 0], step.df[..., 0]
...     return d[..., None, :] * eps + step.x[..., :, None] * df[..., None, :]
>>> def solve(eps, g, step):
...     return {'weight': eps * (g[..., 0] * step.diag[..., 0, 0])[..., None, :]}
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> learner = braintrace.compile(Leaky(), braintrace.TraceRule(init, roll, solve), jnp.ones(3))
>>> grad = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)
>>> [float(grad(jnp.ones(3))[('w',)][0, 0]) for _ in range(2)]  # 1, then 1 + 0.5
[1.0, 1.5]
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Sequence, TypeVar

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import EligibilityTrace, ETraceVjpAlgorithm
from braintrace._algorithm.carriers.carrier_store import CarrierStore, TraceStore
from braintrace._algorithm.engine.graph_executor import df_key, trace_key
from braintrace._algorithm.engine.rule_contract import (
    Carrier,
    RelationInfo,
    RelationStep,
    TraceRule,
    relation_infos,
    relation_step,
)
from braintrace._compiler import ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._typing import Path, PyTree, TraceKey

__all__ = ["RelationInfo", "RelationStep", "TraceRule", "RuleLearner", "check_rule", "carriers_of_weight", "add_solved"]

K = TypeVar("K", bound=Hashable)


class RuleLearner(ETraceVjpAlgorithm):
    """The learner of a :class:`TraceRule`: one carrier per (relation, hidden group), single-step calls.

    ``braintrace.compile(model, rule, example_input)`` builds it.

    Parameters
    ----------
    model : brainstate.nn.Module
    rule : TraceRule
    name : str, optional
    control_flow : ControlFlowPolicy, optional
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        rule: TraceRule,
        name: str | None = None,
        vjp_method: str = "single-step",
        control_flow: ControlFlowPolicy | None = None,
    ) -> None:
        check_rule(rule, TraceRule, "RuleLearner", vjp_method, windows="D_RTRL")
        if rule.residual is not None and not callable(rule.residual):
            raise TypeError(f"RuleLearner: the rule's residual must be callable or None, got {rule.residual!r}.")
        super().__init__(model, name=name, vjp_method=vjp_method, control_flow=control_flow)
        self.rule = rule
        self.carriers: TraceStore[TraceKey] = CarrierStore()
        self._rolled_steps: dict[TraceKey, RelationStep] = {}
        self._infos: dict[TraceKey, RelationInfo] = {}

    # --- the carriers: allocated, stored, reset and read here, for every rule ----------------

    def _pairs(self) -> list[tuple[HiddenParamOpRelation, HiddenGroup]]:
        return [(rel, group) for rel in self.graph.hidden_param_op_relations for group in rel.hidden_groups]

    def init_etrace_state(self, *args: Any, **kwargs: Any) -> None:
        """Allocate every carrier with the rule's ``init``, at the shape one step rolls it to.

        A carrier that one step broadcasts to a larger shape (an element-wise weight's, under a
        batched hidden group) starts at that shape, so that a scan can carry it.
        """
        carriers = {}
        self._infos = relation_infos(self.graph.hidden_param_op_relations)
        for rel, group in self._pairs():
            carrier = self.rule.init(self._infos[trace_key(rel, group)])
            leaves = jax.tree.leaves(carrier)
            if not leaves or not all(isinstance(v, jax.Array) for v in leaves):
                raise TypeError(
                    f"TraceRule.init must return a pytree of JAX arrays (a carrier) for the relation "
                    f"{rel.primitive.name} -> hidden group {group.index}, got {carrier!r}.")
            carriers[trace_key(rel, group)] = carrier
        self.carriers = CarrierStore.of_zeros(carriers, EligibilityTrace)
        if args:
            self._allocate_final_shapes(*args)

    def _allocate_final_shapes(self, *args: Any) -> None:
        def roll(jac: Any, weight_vals: dict[Path, PyTree]) -> dict[TraceKey, Carrier]:
            steps = self._steps(jac, weight_vals)
            return {key: self.rule.roll(st.value, steps[key]) for key, st in self.carriers.items()}

        stepped = self._shapes_after_one_step(roll, *args)
        for key, st in self.carriers.items():
            rolled, entering = jax.tree.structure(stepped[key]), jax.tree.structure(st.value)
            if rolled != entering:  # type: ignore[operator]  # PyTreeDef has no stub
                raise TypeError(
                    f"TraceRule.roll must return a carrier of the structure init gave, got {rolled} for {entering}.")
        self.carriers.reallocate(stepped)

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        """Zero every carrier and the step counter.

        With ``batch_size``, every carrier array of a relation whose traces lead with its
        group's batch axis (:meth:`HiddenParamOpRelation.traces_lead_with_batch`) gets that
        leading size; the others keep their shape.
        """
        batched = {trace_key(rel, group) for rel, group in self._pairs() if rel.traces_lead_with_batch(group)}
        self.carriers.reset(batch_size, batched.__contains__)
        self.running_index.value = jnp.zeros_like(self.running_index.value)

    def _get_etrace_data(self) -> dict[TraceKey, Carrier]:
        return self.carriers.read()

    def _assign_etrace_data(self, etrace_vals: dict[TraceKey, Carrier]) -> None:
        self.carriers.assign(etrace_vals)

    def get_etrace_of(self, weight: Any) -> dict[TraceKey, Carrier]:
        """The carriers of every relation that has ``weight`` (a ``ParamState`` or its path) as an operand.

        Raises
        ------
        ValueError
            If no relation learns ``weight``.
        """
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        return carriers_of_weight(
            self.carriers, (trace_key(rel, g) for rel, g in self._pairs() if path in rel.trainable_paths.values()),
            weight, path)

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> Carrier:
        return self.carriers[trace_key(rel, group)].value

    # --- one step --------------------------------------------------------------------------

    def _steps(self, jac: Any, weight_vals: dict[Path, PyTree]) -> dict[TraceKey, RelationStep]:
        (xs, dfs), Ds = jac
        out = {}
        for rel, group in self._pairs():
            x = None if rel.x_var is None else xs[id(rel.x_var)]
            out[trace_key(rel, group)] = relation_step(
                rel, group, x, dfs[df_key(rel, group)], Ds[group.index], self._relation_operands(rel, weight_vals),
                self._infos[trace_key(rel, group)])
        return out

    def _update_etrace_data(
        self, running_index: Any, etrace_vals_util_t_1: dict[TraceKey, Carrier], hid2weight_jac_single_or_multi_times: Any,
        hid2hid_jac_single_or_multi_times: Any, weight_vals: dict[Path, PyTree], input_is_multi_step: bool,
    ) -> dict[TraceKey, Carrier]:
        jac = (hid2weight_jac_single_or_multi_times, hid2hid_jac_single_or_multi_times)
        steps = self._steps(jac, weight_vals)
        # The forward pass asks for the residual next, in the same trace: it reads these steps.
        self._rolled_steps = steps
        return {key: self.rule.roll(etrace_vals_util_t_1[key], steps[key]) for key in etrace_vals_util_t_1}

    def _trace_for_backward(
        self, old_etrace: dict[TraceKey, Carrier], new_etrace: dict[TraceKey, Carrier], jac: Any, single_step: bool,
    ) -> tuple[dict[TraceKey, Carrier], Any]:
        keep, steps = self.rule.residual, self._rolled_steps
        residual = {key: old_etrace[key] if keep is None else keep(old_etrace[key], new_etrace[key], steps[key])
                    for key in old_etrace}
        return residual, jac

    def _solve_weight_gradients(
        self, running_index: Any, etrace_h2w_at_t: tuple[dict[TraceKey, Carrier], Any],
        dl_to_hidden_groups: Sequence[jax.Array], weight_vals: dict[Path, PyTree],
        dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        residual, jac = etrace_h2w_at_t
        steps = self._steps(jac, weight_vals)
        grads = dict(dl_to_etws_at_t)
        for rel, group in self._pairs():
            key = trace_key(rel, group)
            signal = rel.output_layout(group, dl_to_hidden_groups[group.index])
            added = self.rule.solve(residual[key], signal, steps[key])
            grads = add_solved(self, grads, rel, added, weight_vals, "TraceRule.solve")
        return grads


def check_rule(rule: object, kind: type, learner: str, vjp_method: str, windows: str) -> None:
    """Refuse a ``rule`` that is not a ``kind`` of callable ``init``, ``roll`` and ``solve``, and
    calls other than single steps (``windows`` names the learner to use for those).

    Raises
    ------
    TypeError
        For another type, or a function that is not callable.
    ValueError
        For a ``vjp_method`` other than ``'single-step'``.
    """
    if not isinstance(rule, kind):
        raise TypeError(f"{learner}: rule must be a braintrace.{kind.__name__}(init, roll, solve), got "
                        f"{type(rule).__name__}.")
    for field in ("init", "roll", "solve"):
        if not callable(getattr(rule, field)):
            raise TypeError(f"{learner}: the rule's {field} must be callable, got {getattr(rule, field)!r}.")
    if vjp_method != "single-step":
        raise ValueError(
            f"{learner}: a {kind.__name__} runs single-step calls, got vjp_method={vjp_method!r}; drive the "
            f"learner one step per call (learner.etrace_grad without chunk_size), or use {windows} for "
            f"multi-step windows.")


def carriers_of_weight(store: TraceStore[K], keys: Iterable[K], weight: object, path: Path | None) -> dict[K, Carrier]:
    """The carriers of ``store`` at ``keys``, those of ``weight`` (its ``path``, ``None`` where it is
    not a state of the model).

    Raises
    ------
    ValueError
        If there are none.
    """
    found = store.select(keys)
    if not found:
        shown = f"a {type(weight).__name__} that is not a state of this model" if path is None else path
        raise ValueError(
            f"get_etrace_of: there is no carrier of the given weight ({shown}). Only the weights of "
            f"compiled relations (ETP operations that drive hidden states) have one; learner.report "
            f"lists them.")
    return found


def add_solved(
    learner: ETraceVjpAlgorithm, grads: dict[Path, PyTree], rel: HiddenParamOpRelation, added: dict[str, Any],
    weight_vals: dict[Path, PyTree], solve: str,
) -> dict[Path, PyTree]:
    """``grads`` plus what a rule's ``solve`` returned for ``rel``'s operands.

    Raises
    ------
    ValueError
        For a key that is not a trainable operand of ``rel``.
    """
    unknown = sorted(set(added) - set(rel.trainable_paths))
    if unknown:
        raise ValueError(
            f"{solve} returned gradients for {unknown}, which are not trainable operands of "
            f"{rel.primitive.name} (its operands: {sorted(rel.trainable_paths)}).")
    for operand, g in added.items():
        grads = learner._add_operand_gradient(grads, rel, operand, g, weight_vals)
    return grads
