"""``OTPE``: online training with postsynaptic estimates, for dense layers.

Per dense relation ``y = x @ W (+ b)`` driving one one-state hidden group, with a fixed leak
``λ`` standing in for the hidden Jacobian ``D``:

* mode ``'full'``: ``R^t = λ R^{t-1} + x^t ⊗ df^t`` (``(B, I, O)`` batched, ``(I, O)``
  unbatched; optionally clipped to ``±trace_clip_abs``) and ``R_b^t = λ R_b^{t-1} + df^t``.
  The estimate is ``Σ_b L[b, o] R[b, i, o]``: D-RTRL with ``D ≡ λ``.
* mode ``'approx'``: the factored ``Rx^t = λ Rx^{t-1} + x^t`` and ``Rg^t = λ Rg^{t-1} + df^t``,
  estimate ``Σ_b Rx[b, i] (L ⊙ Rg)[b, o]`` (memory ``O(|x| + |y|)``; inflates magnitudes).

with ``L = Σ_a ∂L/∂h[..., a]``. What a call adds to the engine's gradient (see :mod:`braintrace._algorithm.engine.base`;
the one-step gradient is exact): the estimate at the new trace minus its same-step term
``x^t ⊗ (L ⊙ df^t)`` (in mode ``'full'`` without clipping, ``⟨L, λ R^{t-1}⟩``).

Exactness (mode ``'full'``): equal to D-RTRL, and so to backpropagation through time,
whenever the hidden Jacobian of the group is ``λ`` (``h ← λ h + f(matmul(x, W))``, any
element-wise ``f``); at the first step after a reset the history is zero and the gradient is
exact for every model.

The per-relation math is one record, :func:`otpe_rule` (a :class:`~braintrace.TraceRule` over a
:class:`PostsynapticTrace` or :class:`FactoredTrace`), made of this module's building blocks
(``zero_store``, ``roll_store``, ``store_history``); the engine keeps its stores (per relation, a
dict of states) and rolls and solves with the same blocks.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> learner = braintrace.compile(Leaky(), braintrace.OTPE, jnp.ones(3), leak=0.5)
>>> loss = lambda x: learner(x).sum()
>>> [float(brainstate.transform.grad(loss, learner.param_states)(jnp.ones(3))[('w',)][0, 0]) for _ in range(2)]
[1.0, 1.5]
"""

from __future__ import annotations

import warnings
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
from braintrace._algorithm.engine.graph_executor import (
    CallHiddenJacobians,
    CallJacobians,
    CallWeightJacobians,
    df_key,
)
from braintrace._algorithm.param_trace.types import Inputs, Tails, step_jacobians
from braintrace._compiler import ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._errors import internal_error
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import drtrl_dtype, shape_of, sum_rows
from braintrace._typing import Path, PyTree

__all__ = ["OTPE", "PostsynapticTrace", "FactoredTrace", "otpe_rule"]

Store = dict[str, jax.Array]
#: One relation's stores (``'R'``, ``'R_b'`` or ``'Rx'``, ``'Rg'``) as states.
StoreStates = CarrierStore[str, brainstate.ShortTermState]
#: What the backward pass reads: per relation's ``id(y_var)``, the stores the estimate is read off,
#: and (``None`` under a plain history) this step's ``xs`` and ``dfs``, for its same-step term.
StoreResidual = tuple[dict[int, Store], Inputs | None, Tails | None]


class OTPE(DenseLeakRule[dict[int, Store], StoreResidual]):
    """Online training with postsynaptic estimates (see the module docstring).

    Parameters
    ----------
    model : brainstate.nn.Module
    mode : {'full', 'approx'}
    leak : float
        ``λ``, keyword-only, ``0 < λ < 1``.
    name : str, optional
    vjp_method : {'single-step'}
    trace_clip_abs : float, optional
        Clip the full-mode trace ``R`` to ``[-c, c]`` after every step.
    control_flow : ControlFlowPolicy, optional

    Raises
    ------
    ValueError
        For a bad ``mode``, ``leak``, ``vjp_method`` or ``trace_clip_abs``; at compilation, for
        a relation driving more than one hidden group or a group with more than one state.
    NotImplementedError
        At compilation, for relations that are not dense matmuls; at a call, for
        ``MultiStepData`` input.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.OTPE, jnp.ones(3),
    ...                              mode='approx', leak=0.9)
    >>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    """

    rule_approximations = ("fixed leak (OTPE's λ stands in for the hidden Jacobian)",)
    _modes = ("full", "approx")

    def __init__(
        self,
        model: brainstate.nn.Module,
        mode: str = "full",
        *,
        leak: float,
        name: str | None = None,
        vjp_method: str = "single-step",
        trace_clip_abs: float | None = None,
        control_flow: ControlFlowPolicy | None = None,
    ) -> None:
        super().__init__(model, mode, leak, name=name, vjp_method=vjp_method, control_flow=control_flow)
        self.trace_clip_abs = checked_clip(trace_clip_abs, "OTPE")
        self._stores: dict[int, StoreStates] = {}

    def init_etrace_state(self, *args: PyTree, **kwargs: object) -> None:
        """Allocate the zero stores of every relation (after checking the graph fits OTPE)."""
        relations = self.graph.hidden_param_op_relations
        for rel in relations:
            if len(rel.hidden_groups) != 1:
                raise ValueError(
                    f"OTPE: every weight must drive exactly one hidden group, but "
                    f"{sorted(map(str, rel.trainable_paths.values()))} drives {len(rel.hidden_groups)}; "
                    f"use D_RTRL."
                )
        self._check_relations()
        if self.mode == "approx" and len(self.graph.hidden_groups) > 1:
            warnings.warn(
                "OTPE(mode='approx') factors each layer's trace on its own; with several hidden groups "
                "no coupling between layers is estimated.",
                UserWarning,
                stacklevel=3,
            )
        self._stores = {id(rel.y_var): self._init_store(rel) for rel in relations}

    def _init_store(self, rel: HiddenParamOpRelation) -> StoreStates:
        # The stores live in the relation's precision (float64 under x64).
        if rel.x_var is None:
            raise internal_error(f"OTPE's dense relation {rel.path} has no input variable")
        zeros = zero_store(shape_of(rel.x_var), shape_of(rel.y_var), drtrl_dtype(rel.x_var, rel.y_var, None),
                           self.mode, "bias" in rel.trainable_paths)
        return CarrierStore.of_zeros(zeros, brainstate.ShortTermState)

    def _get_etrace_data(self) -> dict[int, Store]:
        return {k: store.read() for k, store in self._stores.items()}

    def _assign_etrace_data(self, etrace_vals: dict[int, Store]) -> None:
        for k, store in etrace_vals.items():
            self._stores[k].assign(store)

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Zero the stores and the step counter; ``batch_size`` resizes batched relations only."""
        for rel in self.graph.hidden_param_op_relations:
            batched = reg.is_batched_primitive(rel.primitive)
            self._stores[id(rel.y_var)].reset(batch_size, lambda name: batched)
        self.running_index.value = jnp.zeros_like(self.running_index.value)

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> Store:
        return self._stores[id(rel.y_var)].read()

    def get_etrace_of(self, weight: brainstate.ParamState | Path) -> dict[int, Store]:
        """The stores of the relations of ``weight`` (by ``id(y_var)``)."""
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        found = {
            id(rel.y_var): self._stores[id(rel.y_var)].read()
            for rel in self.graph.hidden_param_op_relations if path in rel.trainable_paths.values()
        }
        if not found:
            raise ValueError(f"OTPE: no relation learns {weight if path is None else path}.")
        return found

    # --- one step -------------------------------------------------------------------------

    def _update_etrace_data(
        self, running_index: jax.Array, etrace_vals_util_t_1: dict[int, Store],
        hid2weight_jac_single_or_multi_times: CallWeightJacobians,
        hid2hid_jac_single_or_multi_times: CallHiddenJacobians, weight_vals: dict[Path, PyTree],
        input_is_multi_step: bool,
    ) -> dict[int, Store]:
        (xs, dfs), _ = step_jacobians(hid2weight_jac_single_or_multi_times, hid2hid_jac_single_or_multi_times,
                                      type(self).__name__)
        new = {}
        for rel in self.graph.hidden_param_op_relations:
            x, df = xs[id(rel.x_var)], dfs[df_key(rel, rel.hidden_groups[0])].sum(axis=-1)
            new[id(rel.y_var)] = roll_store(etrace_vals_util_t_1[id(rel.y_var)], x, df, self.leak, self.mode,
                                            self.trace_clip_abs)
        return new

    @property
    def _plain_history(self) -> bool:
        """Full mode without clipping: the history is ``λ R^{t-1}`` (no cancellation needed)."""
        return plain_history(self.mode, self.trace_clip_abs)

    def _trace_for_backward(
        self, old_etrace: dict[int, Store], new_etrace: dict[int, Store], jac: CallJacobians | None,
        single_step: bool,
    ) -> StoreResidual:
        if self._plain_history:
            return old_etrace, None, None
        # The estimate at the new stores minus its same-step term, which needs this step's x, df.
        if jac is None:
            raise internal_error("OTPE's single step came without its Jacobians")
        (xs, dfs), _ = step_jacobians(jac[0], jac[1], type(self).__name__)
        return new_etrace, xs, dfs

    # --- the gradient ---------------------------------------------------------------------

    def _solve_weight_gradients(
        self, running_index: jax.Array, etrace_h2w_at_t: StoreResidual, dl_to_hidden_groups: Sequence[jax.Array],
        weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        stores, xs, dfs = etrace_h2w_at_t
        grads = dict(dl_to_etws_at_t)
        for rel in self.graph.hidden_param_op_relations:
            signal = self._relation_signal(rel, dl_to_hidden_groups)
            this_step = None
            if not self._plain_history:
                if xs is None or dfs is None:
                    raise internal_error("OTPE's residual lacks the step's x and df its same-step term needs")
                this_step = xs[id(rel.x_var)], dfs[df_key(rel, rel.hidden_groups[0])].sum(axis=-1)
            effective = store_history(stores[id(rel.y_var)], signal, self.leak, self.mode,
                                      reg.is_batched_primitive(rel.primitive), "bias" in rel.trainable_paths,
                                      this_step)
            grads = self._add_grads(rel, effective, weight_vals, grads)
        return grads


# --- the building blocks (the record's functions and the engine's steps) -------------------


def checked_clip(trace_clip_abs: float | None, caller: str) -> float | None:
    """``trace_clip_abs`` as a float (or ``None``), refused unless it is a positive number."""
    if trace_clip_abs is not None and (
        isinstance(trace_clip_abs, bool) or not isinstance(trace_clip_abs, (int, float)) or trace_clip_abs <= 0
    ):
        raise ValueError(f"{caller}: trace_clip_abs must be a positive number or None, got {trace_clip_abs!r}.")
    return None if trace_clip_abs is None else float(trace_clip_abs)


def plain_history(mode: str, clip: float | None) -> bool:
    """Whether the history is ``λ`` times the estimate of the entering stores (mode ``'full'``
    without a clip); otherwise it is read off the new stores, less their same-step term."""
    return mode == "full" and clip is None


def zero_store(x_shape: tuple[int, ...], y_shape: tuple[int, ...], dtype: jax.typing.DTypeLike, mode: str,
               has_bias: bool) -> Store:
    """The zero stores of one relation: ``R`` ``(*x, out)`` and ``R_b`` ``y`` (mode ``'full'``,
    ``R_b`` only with a trainable bias), or ``Rx`` ``x`` and ``Rg`` ``y`` (mode ``'approx'``)."""
    if mode == "full":
        shapes = {"R": (*x_shape, y_shape[-1])}
        if has_bias:
            shapes["R_b"] = y_shape
    else:
        shapes = {"Rx": x_shape, "Rg": y_shape}
    return {k: jnp.zeros(s, dtype) for k, s in shapes.items()}


def roll_store(old: Store, x: jax.Array, df: jax.Array, leak: float, mode: str, clip: float | None) -> Store:
    """One relation's stores after this step, given its input ``x`` and ``df`` (shaped like ``y``).

    Mode ``'full'``: ``R ← λ R + x ⊗ df`` (clipped to ``±clip``) and ``R_b ← λ R_b + df``; mode
    ``'approx'``: ``Rx ← λ Rx + x`` and ``Rg ← λ Rg + df``.
    """
    if mode == "full":
        R = leak * old["R"] + x[..., :, None] * df[..., None, :]
        if clip is not None:
            R = jnp.clip(R, -clip, clip)
        store = {"R": R}
        if "R_b" in old:
            store["R_b"] = leak * old["R_b"] + df
    else:
        store = {"Rx": leak * old["Rx"] + x, "Rg": leak * old["Rg"] + df}
    return {k: v.astype(old[k].dtype) for k, v in store.items()}


def store_history(
    stores: Store, signal: jax.Array, leak: float, mode: str, batched: bool, has_bias: bool,
    this_step: tuple[jax.Array, jax.Array] | None,
) -> Store:
    """What OTPE adds to the exact one-step gradient, w.r.t. ``weight_fn(W)`` and ``bias_fn(b)``.

    With ``this_step=None`` (mode ``'full'`` without a clip) ``stores`` are the ones entering the
    step and the history is ``λ`` times their estimate; otherwise they are the new ones and the
    history is their estimate less its same-step term, read from this step's ``(x, df)``.
    """
    store = {k: v.astype(signal.dtype) for k, v in stores.items()}
    if this_step is None:
        # λ on the estimate, not on the stores: a scaled trace would be a trace-sized temporary.
        return {k: leak * v for k, v in store_estimate(store, signal, mode, batched, has_bias).items()}
    x, df = this_step[0].astype(signal.dtype), this_step[1].astype(signal.dtype)
    estimate = store_estimate(store, signal, mode, batched, has_bias)
    same = same_step_estimate(x, df, signal, batched, has_bias)
    return {k: estimate[k] - same[k] for k in estimate}


def same_step_estimate(x: jax.Array, df: jax.Array, signal: jax.Array, batched: bool, has_bias: bool) -> Store:
    """The estimate read from the stores of one step from zero, ``x ⊗ (L ⊙ df)`` in either
    mode: one product over the batch, without the trace-shaped ``x ⊗ df``."""
    weighted = signal * df
    out = {"weight": outer_sum(x, weighted, batched)}
    if has_bias:
        out["bias"] = weighted.sum(axis=0) if batched else weighted
    return out


def store_estimate(store: Store, signal: jax.Array, mode: str, batched: bool, has_bias: bool) -> Store:
    """The estimate read from ``store``, w.r.t. the effective weights ``weight_fn(W)``, ``bias_fn(b)``."""
    if mode == "full":
        # Batched, the rows are added by the shared row sum (a contraction over the leading
        # batch axis is a strided pass over the trace on CPU).
        out = sum_rows(_weighted_row, signal, {"weight": store["R"]}) if batched else _weighted_row(
            signal, {"weight": store["R"]})
        if has_bias:
            est_b = store["R_b"] * signal
            out["bias"] = est_b.sum(axis=0) if batched else est_b
        return out
    weighted = signal * store["Rg"]
    out = {"weight": outer_sum(store["Rx"], weighted, batched)}
    if has_bias:
        out["bias"] = weighted.sum(axis=0) if batched else weighted
    return out


def _weighted_row(signal: jax.Array, store: Store) -> Store:
    """Mode ``'full'``'s estimate of one batch row: ``R[i, o] L[o]``."""
    return {"weight": store["weight"] * signal[..., None, :]}


OTPE.__module__ = "braintrace"


# --- the record -----------------------------------------------------------------------------


class PostsynapticTrace(NamedTuple):
    """OTPE's carrier for one dense relation in mode ``'full'`` (see :func:`otpe_rule`)."""

    #: ``R``, the trace of the effective weight: ``(batch, in, out)`` or ``(in, out)``.
    R: jax.Array
    #: ``R_b``, the bias's: shaped like ``y``; ``None`` where the relation has no trainable bias.
    R_b: jax.Array | None


class FactoredTrace(NamedTuple):
    """OTPE's carrier for one dense relation in mode ``'approx'`` (see :func:`otpe_rule`)."""

    #: ``Rx``, the filtered input: shaped like ``x``.
    Rx: jax.Array
    #: ``Rg``, the filtered ``df``: shaped like ``y``.
    Rg: jax.Array


OTPECarrier = PostsynapticTrace | FactoredTrace


def _as_store(carrier: OTPECarrier) -> Store:
    return {k: v for k, v in carrier._asdict().items() if v is not None}


def _as_carrier(store: Store, mode: str) -> OTPECarrier:
    if mode == "full":
        return PostsynapticTrace(store["R"], store.get("R_b"))
    return FactoredTrace(store["Rx"], store["Rg"])


def otpe_rule(leak: float, mode: str = "full", trace_clip_abs: float | None = None) -> TraceRule:
    """OTPE as a :class:`~braintrace.TraceRule`: D-RTRL of dense relations with a fixed leak ``λ`` for ``D``.

    Per relation ``y = x @ W (+ b)``, the carrier holds what the engine :class:`~braintrace.OTPE`
    stores: in mode ``'full'`` (:class:`PostsynapticTrace`) ``R ← λ R + x ⊗ df`` (optionally clipped
    to ``±trace_clip_abs``) and ``R_b ← λ R_b + df``, estimate ``Σ_b L[b, o] R[b, i, o]``; in mode
    ``'approx'`` (:class:`FactoredTrace`) ``Rx ← λ Rx + x`` and ``Rg ← λ Rg + df``, estimate
    ``Σ_b Rx[b, i] (L ⊙ Rg)[b, o]``; ``L = Σ_a ∂L/∂h[..., a]``. The learner adds ``solve`` to the
    exact one-step gradient, so ``solve`` is the estimate's history: ``λ`` times the estimate of
    the entering carrier in mode ``'full'`` without a clip, and otherwise the estimate of the new
    carrier (the record's ``residual`` keeps it) less its same-step term ``x ⊗ (L ⊙ df)``. The
    engine rolls and solves with the same functions.

    Exact (mode ``'full'``, equal to backpropagation through time) where the hidden Jacobian of a
    one-state group is the fixed leak, ``h ← λ h + f(matmul(x, W) (+ b))`` for any element-wise
    ``f`` (``h ← λ h + x W`` among them), on dense relations; the first step after a reset is
    exact for every model. A relation that drives several groups gets a carrier per group (the
    engine refuses it). Single-step calls only (as every :class:`~braintrace.TraceRule`).

    Parameters
    ----------
    leak : float
        ``λ``, ``0 < λ < 1``: the hidden Jacobian the rule assumes.
    mode : {'full', 'approx'}
    trace_clip_abs : float, optional
        Clip the full-mode trace ``R`` to ``[-c, c]`` after every step.

    Returns
    -------
    TraceRule
        Its ``init`` refuses a relation that is not a dense matmul (``NotImplementedError``) or
        drives a group of more than one state (``ValueError``), and its ``solve`` reads the
        relation's ``weight_fn`` / ``bias_fn`` off ``step.info``.

    Raises
    ------
    ValueError
        For a ``mode`` outside ``{'full', 'approx'}``, a ``leak`` outside ``(0, 1)`` or a
        ``trace_clip_abs`` that is not a positive number.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> class Leaky(brainstate.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
    ...         self.h = brainstate.HiddenState(jnp.zeros(2))
    ...     def update(self, x):
    ...         self.h.value = 0.5 * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value))
    ...         return self.h.value
    >>> learner = braintrace.compile(Leaky(), braintrace.otpe_rule(0.5), jnp.ones(3))
    >>> grad = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)
    >>> [round(float(grad(jnp.full(3, 0.1))[('w',)][0, 0]), 4) for _ in range(2)]  # x·tanh', then 1.5 times
    [0.0915, 0.1373]
    """
    caller = "otpe_rule"
    check_mode(mode, OTPE._modes, caller)
    lam = checked_leak(leak, caller)
    clip = checked_clip(trace_clip_abs, caller)
    plain = plain_history(mode, clip)

    def init(info: RelationInfo) -> OTPECarrier:
        check_dense_one_state(info, caller)
        if info.x is None:
            raise internal_error("a dense relation without an input")
        zeros = zero_store(info.x.shape, info.y.shape, jnp.result_type(info.y.dtype, info.x.dtype), mode,
                           "bias" in info.weights)
        return _as_carrier(zeros, mode)

    def roll(carrier: OTPECarrier, step: RelationStep) -> OTPECarrier:
        if step.x is None:
            raise internal_error("a dense relation's step without an input")
        return _as_carrier(roll_store(_as_store(carrier), step.x, step.df.sum(axis=-1), lam, mode, clip), mode)

    def keep_new(entering: OTPECarrier, new: OTPECarrier, step: RelationStep) -> OTPECarrier:
        return new

    def solve(kept: OTPECarrier, signal: jax.Array, step: RelationStep) -> dict[str, jax.Array]:
        params = step_info(step, caller).params
        if step.x is None:
            raise internal_error("a dense relation's step without an input")
        this_step = None if plain else (step.x, step.df.sum(axis=-1))
        history = store_history(_as_store(kept), signal.sum(axis=-1), lam, mode, leads_with_batch(step.x),
                                "bias" in step.weights, this_step)
        return {k: through_hook(k, g, step.weights, params) for k, g in history.items() if k in step.weights}

    return TraceRule(init, roll, solve, None if plain else keep_new)


otpe_rule.__module__ = "braintrace"
