"""The public rule contract: a trace rule as a few pure functions over one carrier per relation.

A learning rule in the spirit of optax's ``GradientTransformation``: :class:`TraceRule` holds
pure functions, and :class:`RuleLearner` (what ``braintrace.compile(model, rule, x0)`` builds)
runs them for every relation of the compiled graph and a hidden group it drives. The learner
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

from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import EligibilityTrace, ETraceVjpAlgorithm
from braintrace._algorithm.carriers.carrier_store import CarrierStore, TraceStore
from braintrace._algorithm.engine.graph_executor import df_key, trace_key
from braintrace._compiler import ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._op._rule_helpers import dtype_of, shape_of
from braintrace._typing import Path, PyTree, TraceKey

__all__ = ["RelationInfo", "RelationStep", "TraceRule", "RuleLearner"]


class RelationInfo(NamedTuple):
    """What a rule knows of one relation and a hidden group it drives, to allocate its carrier.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, braintrace
    >>> info = braintrace.RelationInfo(
    ...     x=jax.ShapeDtypeStruct((4, 3), jnp.float32), y=jax.ShapeDtypeStruct((4, 2), jnp.float32),
    ...     weights={'weight': jax.ShapeDtypeStruct((3, 2), jnp.float32)}, num_state=1, primitive='etp_mm',
    ...     params={})
    >>> (*info.x.shape, info.y.shape[-1])  # a per-sample trace of the weight
    (4, 3, 2)
    """

    #: The operation's input (``None``: it has none, such as ``element_wise``).
    x: jax.ShapeDtypeStruct | None
    #: The operation's output.
    y: jax.ShapeDtypeStruct
    #: The trainable operands, by key (``'weight'``, ``'bias'``, ...).
    weights: dict[str, jax.ShapeDtypeStruct]
    #: The hidden group's states per position (``S``).
    num_state: int
    #: The operation's primitive name (``'etp_mm'``, ``'etp_conv'``, ...).
    primitive: str
    #: The equation's static parameters (``has_bias``, a transform hook ``weight_fn`` ...), which
    #: a rule that does not handle one of them should refuse.
    params: Mapping[str, Any]


class RelationStep(NamedTuple):
    """What one step hands a rule for one relation and a hidden group it drives.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> step = braintrace.RelationStep(x=jnp.ones((4, 3)), df=jnp.ones((4, 2, 1)),
    ...                                diag=jnp.full((4, 2, 1, 1), 0.5), weights={'weight': jnp.ones((3, 2))})
    >>> float(step.diag[0, 0, 0, 0]), step.df[..., 0].shape  # D and df of one state per unit
    (0.5, (4, 2))
    """

    #: The operation's input this step (``None``: it has none).
    x: jax.Array | None
    #: ``∂h/∂y`` over ``y``'s positions: ``(*y.shape, S)``.
    df: jax.Array
    #: The group's hidden Jacobian ``D = ∂h^t/∂h^{t-1}`` over ``y``'s positions: ``(*y.shape, S, S)``.
    diag: jax.Array
    #: The trainable operands' current values, by key.
    weights: dict[str, jax.Array]


Carrier = PyTree


class TraceRule(NamedTuple):
    """A learning rule as pure functions of one relation's carrier (see the module docstring).

    Parameters
    ----------
    init : callable
        ``init(info: RelationInfo) -> carrier``, a pytree of zero arrays.
    roll : callable
        ``roll(carrier, step: RelationStep) -> carrier``, of the same structure, shapes and dtypes.
    solve : callable
        ``solve(residual, signal, step: RelationStep) -> dict``: per trainable operand key, what
        the rule adds to the step's exact one-step gradient (shaped like the operand, or with
        leading axes more, summed); ``signal`` is ``∂L/∂h^t`` over ``y``'s positions,
        ``(*y.shape, S)``. Keys left out add nothing.
    residual : callable, optional
        ``residual(entering, new, step) -> residual``, what ``solve`` receives (default: the
        carrier entering the step).

    Examples
    --------
    A rule that keeps no carrier history: the one-step gradient alone (truncated BPTT of one step).

    >>> import jax.numpy as jnp, braintrace
    >>> one_step = braintrace.TraceRule(init=lambda info: jnp.zeros(()), roll=lambda c, step: c,
    ...                                 solve=lambda c, g, step: {})
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), one_step, jnp.ones(3))
    >>> type(learner).__name__, learner(jnp.ones(3)).shape
    ('RuleLearner', (4,))
    """

    init: Callable[[RelationInfo], Carrier]
    roll: Callable[[Carrier, RelationStep], Carrier]
    solve: Callable[[Carrier, jax.Array, RelationStep], dict[str, jax.Array]]
    residual: Callable[[Carrier, Carrier, RelationStep], Carrier] | None = None


def _struct(var: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape_of(var), dtype_of(var))


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
        if not isinstance(rule, TraceRule):
            raise TypeError(f"RuleLearner: rule must be a braintrace.TraceRule(init, roll, solve), got "
                            f"{type(rule).__name__}.")
        for field in ("init", "roll", "solve"):
            if not callable(getattr(rule, field)):
                raise TypeError(f"RuleLearner: the rule's {field} must be callable, got {getattr(rule, field)!r}.")
        if rule.residual is not None and not callable(rule.residual):
            raise TypeError(f"RuleLearner: the rule's residual must be callable or None, got {rule.residual!r}.")
        if vjp_method != "single-step":
            raise ValueError(
                f"RuleLearner: a TraceRule runs single-step calls, got vjp_method={vjp_method!r}; drive the "
                f"learner one step per call (learner.etrace_grad without chunk_size), or use D_RTRL for "
                f"multi-step windows.")
        super().__init__(model, name=name, vjp_method=vjp_method, control_flow=control_flow)
        self.rule = rule
        self.carriers: TraceStore[TraceKey] = CarrierStore()
        self._rolled_steps: dict[TraceKey, RelationStep] = {}

    # --- the carriers: allocated, stored, reset and read here, for every rule ----------------

    def _pairs(self) -> list[tuple[HiddenParamOpRelation, HiddenGroup]]:
        return [(rel, group) for rel in self.graph.hidden_param_op_relations for group in rel.hidden_groups]

    def _info(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> RelationInfo:
        x = None if rel.x_var is None else _struct(rel.x_var)
        weights = {k: _struct(v) for k, v in rel.trainable_vars.items()}
        return RelationInfo(x, _struct(rel.y_var), weights, group.num_state, rel.primitive.name,
                            MappingProxyType(dict(rel.eqn_params)))

    def init_etrace_state(self, *args: Any, **kwargs: Any) -> None:
        """Allocate every carrier with the rule's ``init``, at the shape one step rolls it to.

        A carrier that one step broadcasts to a larger shape (an element-wise weight's, under a
        batched hidden group) starts at that shape, so that a scan can carry it.
        """
        carriers = {}
        for rel, group in self._pairs():
            carrier = self.rule.init(self._info(rel, group))
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
        found = self.carriers.select(
            trace_key(rel, g) for rel, g in self._pairs() if path in rel.trainable_paths.values())
        if not found:
            shown = f"a {type(weight).__name__} that is not a state of this model" if path is None else path
            raise ValueError(
                f"get_etrace_of: there is no carrier of the given weight ({shown}). Only the weights of "
                f"compiled relations (ETP operations that drive hidden states) have one; learner.report "
                f"lists them.")
        return found

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> Carrier:
        return self.carriers[trace_key(rel, group)].value

    # --- one step --------------------------------------------------------------------------

    def _steps(self, jac: Any, weight_vals: dict[Path, PyTree]) -> dict[TraceKey, RelationStep]:
        (xs, dfs), Ds = jac
        out = {}
        for rel, group in self._pairs():
            x = None if rel.x_var is None else xs[id(rel.x_var)]
            df = rel.output_layout(group, dfs[df_key(rel, group)])
            diag = rel.output_layout(group, Ds[group.index])
            out[trace_key(rel, group)] = RelationStep(x, df, diag, self._relation_operands(rel, weight_vals))
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
            unknown = sorted(set(added) - set(rel.trainable_paths))
            if unknown:
                raise ValueError(
                    f"TraceRule.solve returned gradients for {unknown}, which are not trainable operands of "
                    f"{rel.primitive.name} (its operands: {sorted(rel.trainable_paths)}).")
            for operand, g in added.items():
                grads = self._add_operand_gradient(grads, rel, operand, g, weight_vals)
        return grads


for _public in (RelationInfo, RelationStep, TraceRule):
    _public.__module__ = "braintrace"
