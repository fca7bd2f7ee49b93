"""``OTTT``: online training through time, a presynaptic-trace learning rule for dense layers.

For every dense relation ``y = x @ W (+ b)`` driving a one-state hidden group, OTTT keeps a
leaky trace of the presynaptic input, ``â^t = λ â^{t-1} + x^t`` (mode ``'A'``) or
``â^t = x^t`` (mode ``'O'``), and a scalar bias companion ``ĉ^t = λ ĉ^{t-1} + 1`` (or ``1``).
Its gradient estimate at step ``t`` is ``â^t ⊗ L^t`` with the learning signal
``L = Σ_a ∂L/∂h[..., a]``; ``D`` and ``df`` are not used.

What a call adds to the engine's gradient (see :mod:`braintrace._algorithm.engine.base`; the one-step gradient is exact
and holds the same-step term ``x^t ⊗ df ⊙ L``): the history of the estimate,
``λ â^{t-1} ⊗ L`` and ``λ ĉ^{t-1} L`` for the bias (nothing in mode ``'O'``). Where ``y`` enters
the hidden state unscaled (``df ≡ 1``, see :func:`~braintrace._compiler.unit_tail.enters_unscaled`)
and reaches the outputs only through it, the same-step term is ``x^t ⊗ L``: the engine then
leaves the weight out of the one-step VJP and its whole gradient is ``â^t ⊗ L`` (``ĉ^t L``), one
product of the weight's size per step instead of two.

Exactness: equal to backpropagation through time on ``h ← λ h + matmul(x, W) (+ b)`` with
the same ``λ`` (there ``D ≡ λ`` and ``df ≡ 1``). Elsewhere the history ignores ``df`` (an
input scaling, a ``tanh'``) and the true ``D``.

The per-relation math is one record, :func:`ottt_rule` (a :class:`~braintrace.TraceRule` over a
:class:`PresynapticCarrier`), made of this module's building blocks (``roll_input_trace``,
``roll_bias_trace``, ``trace_history``, ``bias_estimate``) and the dense fixed-leak ones of
:mod:`~braintrace._algorithm.rules.dense_leak` (``outer_sum``, ``through_hook``). The engine
keeps its shared storage (one trace per input variable, one scalar bias trace) and rolls and
solves with the same blocks.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.9 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> learner = braintrace.compile(Leaky(), braintrace.OTTT, jnp.ones(3), leak=0.9)
>>> grad = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)
>>> [round(float(grad(jnp.ones(3))[('w',)][0, 0]), 4) for _ in range(2)]  # x, then x + λ·x
[1.0, 1.9]
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.carriers.carrier_store import CarrierStore
from braintrace._algorithm.engine.rule_contract import RelationInfo, RelationStep, TraceRule, step_info
from braintrace._algorithm.rules.dense_leak import (
    DenseLeakRule,
    check_dense_one_state,
    check_mode,
    checked_leak,
    leads_with_batch,
    outer_sum,
    through_hook,
)
from braintrace._algorithm.rules.snn_helpers import PresynapticTrace
from braintrace._compiler import ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.unit_tail import enters_unscaled
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import dtype_of, shape_of
from braintrace._algorithm.engine.graph_executor import CallHiddenJacobians, CallJacobians, CallWeightJacobians
from braintrace._typing import Path, PyTree

__all__ = ["OTTT", "PresynapticCarrier", "ottt_rule"]

#: Per ``id(x_var)``, the presynaptic trace ``â`` of a relation's input (key ``-1``: its bias's).
PresynapticTraces = dict[int, jax.Array]
#: ``(entering, new)`` traces by key: the entering ones the estimate reads, the new ones of the
#: weights the engine left out of the one-step VJP.
PresynapticResidual = tuple[PresynapticTraces, PresynapticTraces]


def roll_input_trace(old: jax.Array, x: jax.Array, leak: float, mode: str) -> jax.Array:
    """OTTT's presynaptic trace of an input after this step: ``λ â + x`` (mode ``'A'``) or ``x``."""
    return (leak * old + x if mode == "A" else x).astype(old.dtype)


def roll_bias_trace(old: jax.Array, leak: float, mode: str) -> jax.Array:
    """OTTT's bias companion after this step (the trace of a constant input 1): ``λ ĉ + 1`` or ``1``."""
    return (leak * old + 1.0 if mode == "A" else jnp.ones_like(old)).astype(old.dtype)


def trace_history(entering: jax.Array, leak: float, dtype: jax.typing.DTypeLike) -> jax.Array:
    """The part of the new trace that the step's input did not add: ``λ â^{t-1}`` (or ``λ ĉ^{t-1}``)."""
    return leak * entering.astype(dtype)


def bias_estimate(count: jax.Array, signal: jax.Array, batched: bool) -> jax.Array:
    """OTTT's bias gradient read off its companion ``ĉ`` (a scalar, the same for every sample):
    ``ĉ Σ_b L[b, o]`` (batched) or ``ĉ L[o]``."""
    return count * (signal.sum(axis=0) if batched else signal)


class OTTT(DenseLeakRule[PresynapticTraces, PresynapticResidual]):
    """Online training through time (see the module docstring).

    Parameters
    ----------
    model : brainstate.nn.Module
    mode : {'A', 'O'}
        ``'A'``: accumulated presynaptic trace. ``'O'``: the current input only (no history).
    leak : float
        ``λ``, keyword-only, ``0 < λ < 1``: the leak of the hidden state the rule assumes.
    name : str, optional
    vjp_method : {'single-step'}
    control_flow : ControlFlowPolicy, optional

    Raises
    ------
    ValueError
        For a bad ``mode``, ``leak`` or ``vjp_method``; at compilation, for groups with more
        than one state.
    NotImplementedError
        At compilation, for relations that are not dense matmuls; at a call, for
        ``MultiStepData`` input.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.OTTT, jnp.ones(3),
    ...                              leak=0.9)
    >>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    """

    rule_approximations = ("presynaptic trace (OTTT's leaky input trace ignores the hidden Jacobian and df)",)
    _modes = ("A", "O")
    # Mode A's new trace â^t = λ â^{t-1} + x^t holds x^t ⊗ L, the same-step term where df ≡ 1
    # (see _same_step_in_history).
    _history_holds_same_step = True

    def __init__(
        self,
        model: brainstate.nn.Module,
        mode: str = "A",
        *,
        leak: float,
        name: str | None = None,
        vjp_method: str = "single-step",
        control_flow: ControlFlowPolicy | None = None,
    ) -> None:
        super().__init__(model, mode, leak, name=name, vjp_method=vjp_method, control_flow=control_flow)
        self._pre_traces: CarrierStore[int, PresynapticTrace] = CarrierStore()
        self._bias_trace: brainstate.ShortTermState | None = None

    def init_etrace_state(self, *args: PyTree, **kwargs: object) -> None:
        """One presynaptic trace per distinct input, one scalar bias trace if any bias learns."""
        self._check_relations()
        pre: dict[int, jax.Array] = {}
        bias_dtype = None
        for rel in self.graph.hidden_param_op_relations:
            x_var = rel.x_var
            if x_var is None:
                raise internal_error("a dense relation without an input passed _check_relations")
            pre.setdefault(id(x_var), jnp.zeros(shape_of(x_var), dtype_of(x_var)))
            if "bias" in rel.trainable_paths:
                bias_dtype = dtype_of(rel.y_var)
        self._pre_traces = CarrierStore.of_zeros(pre, lambda zeros: PresynapticTrace(zeros, self.leak))
        # The bias trace counts steps; it lives in the outputs' precision (float64 under x64).
        self._bias_trace = None if bias_dtype is None else brainstate.ShortTermState(jnp.zeros((), bias_dtype))

    def _get_etrace_data(self) -> dict[int, jax.Array]:
        data: dict[int, jax.Array] = self._pre_traces.read()
        if self._bias_trace is not None:
            data[-1] = self._bias_trace.value
        return data

    def _assign_etrace_data(self, etrace_vals: dict[int, jax.Array]) -> None:
        if -1 in etrace_vals and self._bias_trace is None:
            raise internal_error("a bias trace value for a learner without a bias trace")
        self._pre_traces.assign({k: v for k, v in etrace_vals.items() if k != -1})
        if self._bias_trace is not None and -1 in etrace_vals:
            self._bias_trace.value = etrace_vals[-1]

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Zero the traces and the step counter; ``batch_size`` resizes the inputs of batched
        (``etp_mm``) relations only."""
        batched = {id(r.x_var) for r in self.graph.hidden_param_op_relations if reg.is_batched_primitive(r.primitive)}
        self._pre_traces.reset(batch_size, batched.__contains__)
        self.running_index.value = jnp.zeros_like(self.running_index.value)
        if self._bias_trace is not None:
            self._bias_trace.value = jnp.zeros((), self._bias_trace.value.dtype)

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> dict[str, jax.Array]:
        """``{'x': presynaptic trace}``, plus ``'bias'`` for a relation with a bias."""
        out = {"x": self._pre_traces[id(rel.x_var)].value}
        if self._bias_trace is not None and "bias" in rel.trainable_paths:
            out["bias"] = self._bias_trace.value
        return out

    def get_etrace_of(self, weight: brainstate.ParamState | Path) -> PresynapticTraces:
        """The presynaptic traces (and the bias trace, key ``-1``) of the relations of ``weight``."""
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        found: dict[int, jax.Array] = {}
        for rel in self.graph.hidden_param_op_relations:
            if path in rel.trainable_paths.values():
                found.update(self._pre_traces.select([id(rel.x_var)]))
                if self._bias_trace is not None and "bias" in rel.trainable_paths:
                    found[-1] = self._bias_trace.value
        if not found:
            raise ValueError(f"OTTT: no relation learns {weight if path is None else path}.")
        return found

    def _update_etrace_data(
        self, running_index: jax.Array, etrace_vals_util_t_1: PresynapticTraces,
        hid2weight_jac_single_or_multi_times: CallWeightJacobians,
        hid2hid_jac_single_or_multi_times: CallHiddenJacobians, weight_vals: dict[Path, PyTree],
        input_is_multi_step: bool,
    ) -> PresynapticTraces:
        xs, _ = hid2weight_jac_single_or_multi_times
        return {key: roll_bias_trace(old, self.leak, self.mode) if key == -1
                else roll_input_trace(old, xs[key], self.leak, self.mode)
                for key, old in etrace_vals_util_t_1.items()}

    def _same_step_in_history(self, rel: HiddenParamOpRelation) -> bool:
        # â^t ⊗ L holds x^t ⊗ L, which is the same-step term x^t ⊗ (df ⊙ L) only where df ≡ 1;
        # mode O keeps no history to hold it.
        return self.mode == "A" and enters_unscaled(rel)

    def _trace_for_backward(
        self, old_etrace: PresynapticTraces, new_etrace: PresynapticTraces, jac: CallJacobians | None,
        single_step: bool,
    ) -> PresynapticResidual:
        """``(entering, new)`` traces by key: the new one for the weights the engine left out of
        the one-step VJP (their gradient is the whole estimate ``â^t ⊗ L``), the entering one for
        the others (the estimate minus its same-step term, ``λ â^{t-1} ⊗ L``).

        Where no relation reads a key's entering trace, its only reader is the update, which then
        runs in place. The barrier keeps XLA from recomputing ``â^t`` from ``â^{t-1}`` inside the
        products, which would give the entering trace a second reader and cost a copy of it.
        """
        covered = self._local_relation_weights().keys
        entering, new = {}, {}
        for i, rel in enumerate(self.graph.hidden_param_op_relations):
            for name, key in (("weight", id(rel.x_var)), ("bias", -1)):
                if name not in rel.trainable_paths:
                    continue
                if name in covered.get(i, ()):
                    new[key] = new_etrace[key]
                else:
                    entering[key] = old_etrace[key]
        return entering, jax.lax.optimization_barrier(new) if new else new

    def _solve_weight_gradients(
        self, running_index: jax.Array, etrace_h2w_at_t: PresynapticResidual, dl_to_hidden_groups: Sequence[jax.Array],
        weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        grads = dict(dl_to_etws_at_t)
        if self.mode == "O":
            return grads
        entering, new = etrace_h2w_at_t
        covered = self._local_relation_weights().keys
        lam = self.leak

        def estimate(name: str, key: int, i: int, dtype: jax.typing.DTypeLike) -> jax.Array:
            if name in covered.get(i, ()):
                return new[key].astype(dtype)
            return trace_history(entering[key], lam, dtype)

        for i, rel in enumerate(self.graph.hidden_param_op_relations):
            signal = self._relation_signal(rel, dl_to_hidden_groups)
            batched = reg.is_batched_primitive(rel.primitive)
            effective = {}
            if "weight" in rel.trainable_paths:
                effective["weight"] = outer_sum(estimate("weight", id(rel.x_var), i, signal.dtype), signal, batched)
            if "bias" in rel.trainable_paths:
                effective["bias"] = bias_estimate(estimate("bias", -1, i, signal.dtype), signal, batched)
            grads = self._add_grads(rel, effective, weight_vals, grads)
        return grads


OTTT.__module__ = "braintrace"


# --- the record -----------------------------------------------------------------------------


class PresynapticCarrier(NamedTuple):
    """OTTT's carrier for one dense relation (see :func:`ottt_rule`)."""

    #: ``â``, the presynaptic trace of the relation's input: ``(batch, in)`` or ``(in,)``.
    x: jax.Array
    #: ``ĉ``, the bias companion (the trace of a constant input 1), a scalar shared by every
    #: sample; ``None`` where the relation has no trainable bias.
    bias: jax.Array | None


def ottt_rule(leak: float, mode: str = "A") -> TraceRule:
    """OTTT as a :class:`~braintrace.TraceRule`: a presynaptic trace per dense relation.

    Per relation ``y = x @ W (+ b)``, the carrier (:class:`PresynapticCarrier`) holds the
    presynaptic trace of the input, ``â^t = λ â^{t-1} + x^t`` (mode ``'A'``; ``â^t = x^t`` in mode
    ``'O'``), and the bias companion ``ĉ^t = λ ĉ^{t-1} + 1`` (``1``). OTTT's estimate at step
    ``t`` is ``â^t ⊗ L`` (``ĉ^t L`` for the bias), with ``L = Σ_a ∂L/∂h[..., a]``; ``D`` and ``df``
    are not read. The learner adds ``solve`` to the exact one-step gradient, which holds the
    same-step term ``x^t ⊗ (df ⊙ L)``, so ``solve`` is the rest of the estimate, its history:
    ``λ â^{t-1} ⊗ L`` and ``λ ĉ^{t-1} L`` (nothing in mode ``'O'``). The engine
    :class:`~braintrace.OTTT` rolls and solves with the same functions; where it leaves a weight
    out of the one-step VJP, it reads that weight's whole estimate off the new trace instead.

    Exact (equal to backpropagation through time) on a fixed-leak ``h ← λ h + matmul(x, W) (+ b)``
    with the same ``λ``, hidden groups of one state, dense relations: there ``D ≡ λ`` and
    ``df ≡ 1``. Elsewhere the history ignores ``df`` (an input scaling, a ``tanh'``) and the true
    ``D``. Single-step calls only (as every :class:`~braintrace.TraceRule`).

    Parameters
    ----------
    leak : float
        ``λ``, ``0 < λ < 1``: the leak of the hidden state the rule assumes.
    mode : {'A', 'O'}
        ``'A'``: accumulated presynaptic trace. ``'O'``: the current input only (no history: the
        one-step gradient).

    Returns
    -------
    TraceRule
        Its ``init`` refuses a relation that is not a dense matmul (``NotImplementedError``) or
        drives a group of more than one state (``ValueError``), and its ``solve`` reads the
        relation's ``weight_fn`` / ``bias_fn`` off ``step.info``.

    Raises
    ------
    ValueError
        For a ``mode`` outside ``{'A', 'O'}`` or a ``leak`` outside ``(0, 1)``.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> class Leaky(brainstate.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
    ...         self.h = brainstate.HiddenState(jnp.zeros(2))
    ...     def update(self, x):
    ...         self.h.value = 0.9 * self.h.value + braintrace.matmul(x, self.w.value)
    ...         return self.h.value
    >>> learner = braintrace.compile(Leaky(), braintrace.ottt_rule(0.9), jnp.ones(3))
    >>> grad = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)
    >>> [round(float(grad(jnp.ones(3))[('w',)][0, 0]), 4) for _ in range(2)]  # x, then x + λ·x
    [1.0, 1.9]
    """
    caller = "ottt_rule"
    check_mode(mode, OTTT._modes, caller)
    lam = checked_leak(leak, caller)

    def init(info: RelationInfo) -> PresynapticCarrier:
        check_dense_one_state(info, caller)
        if info.x is None:
            raise internal_error("a dense relation without an input")
        bias = jnp.zeros((), info.y.dtype) if "bias" in info.weights else None
        return PresynapticCarrier(jnp.zeros(info.x.shape, info.x.dtype), bias)

    def roll(carrier: PresynapticCarrier, step: RelationStep) -> PresynapticCarrier:
        if step.x is None:
            raise internal_error("a dense relation's step without an input")
        bias = None if carrier.bias is None else roll_bias_trace(carrier.bias, lam, mode)
        return PresynapticCarrier(roll_input_trace(carrier.x, step.x, lam, mode), bias)

    def solve(entering: PresynapticCarrier, signal: jax.Array, step: RelationStep) -> dict[str, jax.Array]:
        if mode == "O":
            return {}
        params = step_info(step, caller).params
        L = signal.sum(axis=-1)
        batched = leads_with_batch(entering.x)
        history = {}
        if "weight" in step.weights:
            history["weight"] = outer_sum(trace_history(entering.x, lam, L.dtype), L, batched)
        if entering.bias is not None:
            history["bias"] = bias_estimate(trace_history(entering.bias, lam, L.dtype), L, batched)
        return {k: through_hook(k, g, step.weights, params) for k, g in history.items()}

    return TraceRule(init, roll, solve)


ottt_rule.__module__ = "braintrace"
