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
from typing import Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.carriers.carrier_store import CarrierStore
from braintrace._algorithm.rules.ottt import DenseLeakRule, outer_sum
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

__all__ = ["OTPE"]

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
        if trace_clip_abs is not None and (
            isinstance(trace_clip_abs, bool) or not isinstance(trace_clip_abs, (int, float)) or trace_clip_abs <= 0
        ):
            raise ValueError(f"OTPE: trace_clip_abs must be a positive number or None, got {trace_clip_abs!r}.")
        self.trace_clip_abs = None if trace_clip_abs is None else float(trace_clip_abs)
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
        dtype = drtrl_dtype(rel.x_var, rel.y_var, None)
        x_shape, y_shape = shape_of(rel.x_var), shape_of(rel.y_var)
        has_bias = "bias" in rel.trainable_paths
        if self.mode == "full":
            shapes = {"R": (*x_shape, y_shape[-1])}
            if has_bias:
                shapes["R_b"] = y_shape
        else:
            shapes = {"Rx": x_shape, "Rg": y_shape}
        return CarrierStore.of_zeros({k: jnp.zeros(s, dtype) for k, s in shapes.items()}, brainstate.ShortTermState)

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
        lam = self.leak
        new = {}
        for rel in self.graph.hidden_param_op_relations:
            old = etrace_vals_util_t_1[id(rel.y_var)]
            x, df = xs[id(rel.x_var)], dfs[df_key(rel, rel.hidden_groups[0])].sum(axis=-1)
            if self.mode == "full":
                R = lam * old["R"] + x[..., :, None] * df[..., None, :]
                if self.trace_clip_abs is not None:
                    R = jnp.clip(R, -self.trace_clip_abs, self.trace_clip_abs)
                store = {"R": R}
                if "R_b" in old:
                    store["R_b"] = lam * old["R_b"] + df
            else:
                store = {"Rx": lam * old["Rx"] + x, "Rg": lam * old["Rg"] + df}
            new[id(rel.y_var)] = {k: v.astype(old[k].dtype) for k, v in store.items()}
        return new

    @property
    def _plain_history(self) -> bool:
        """Full mode without clipping: the history is ``λ R^{t-1}`` (no cancellation needed)."""
        return self.mode == "full" and self.trace_clip_abs is None

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
            store = {k: v.astype(signal.dtype) for k, v in stores[id(rel.y_var)].items()}
            if self._plain_history:
                # λ on the estimate, not on the stores: a scaled trace would be a trace-sized temporary.
                effective = {k: self.leak * v for k, v in self._estimate(rel, store, signal).items()}
            else:
                if xs is None or dfs is None:
                    raise internal_error("OTPE's residual lacks the step's x and df its same-step term needs")
                x = xs[id(rel.x_var)].astype(signal.dtype)
                df = dfs[df_key(rel, rel.hidden_groups[0])].sum(axis=-1).astype(signal.dtype)
                estimate = self._estimate(rel, store, signal)
                same = self._same_step_estimate(rel, x, df, signal)
                effective = {k: estimate[k] - same[k] for k in estimate}
            grads = self._add_grads(rel, effective, weight_vals, grads)
        return grads

    def _same_step_estimate(self, rel: HiddenParamOpRelation, x: jax.Array, df: jax.Array, signal: jax.Array) -> Store:
        """The estimate read from the stores of one step from zero, ``x ⊗ (L ⊙ df)`` in either
        mode: one product over the batch, without the trace-shaped ``x ⊗ df``."""
        batched = reg.is_batched_primitive(rel.primitive)
        weighted = signal * df
        out = {"weight": outer_sum(x, weighted, batched)}
        if "bias" in rel.trainable_paths:
            out["bias"] = weighted.sum(axis=0) if batched else weighted
        return out

    def _estimate(self, rel: HiddenParamOpRelation, store: Store, signal: jax.Array) -> Store:
        """The estimate read from ``store``, w.r.t. the effective weights ``weight_fn(W)``, ``bias_fn(b)``."""
        batched = reg.is_batched_primitive(rel.primitive)
        has_bias = "bias" in rel.trainable_paths
        if self.mode == "full":
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
