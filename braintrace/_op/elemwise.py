"""Element-wise ETP parameter: ``element_wise`` and its primitive ``etp_elemwise``.

``y = f_W(w)``: the parameter itself (or a shape-preserving transform of it) used directly
by the model, e.g. a per-neuron leak, gain or threshold. It is the only gradient-enabled
built-in primitive: the compiler may walk through it on the ``y -> h`` tail.

Trace geometry. ``y`` has the hidden group's shape and position ``i`` of the hidden state
depends on ``y`` only through ``y[i]``, so the D-RTRL trace is one entry per position:
``ε[..., i, s] = ∂h[..., i, s] / ∂y[i]``. The trace lives in the space of the *transformed*
value ``y``; the transform's Jacobian is applied once, when the learning signal is pulled
back to the raw parameter (``solve_drtrl`` and ``xy_to_dw`` are exact VJPs of ``f_W``).
This keeps D-RTRL exact for any shape-preserving transform, including ones that couple
entries (``w / norm(w)``, ``softmax``), where a per-entry Jacobian diagonal would be wrong.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> braintrace.element_wise(jnp.array([1.0, -2.0]), weight_fn=jnp.abs)
Array([1., 2.], dtype=float32)
"""

from __future__ import annotations

import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._compatible_imports import Var
from braintrace._op._operands import check_hook, split_units, with_unit
from braintrace._op._primitive import register_primitive
from braintrace._op._registries import FastPathRules, snap_anchored
from braintrace._op._rule_helpers import (
    apply_hook,
    drtrl_dtype,
    dtype_of,
    mix_states,
    no_hooks,
    propagate_df,
    shape_of,
    sum_over_states,
)
from braintrace._typing import Array, ArrayLike, HiddenGroupLike, Params, WeightFn

__all__ = ["etp_elemwise_p", "element_wise"]


def _etp_elemwise_impl(weight: Array, *, weight_fn: WeightFn | None = None) -> Array:
    return apply_hook(weight_fn, weight)


def _elemwise_trainable_invars(eqn_params: Params) -> dict[str, int]:
    return {"weight": 0}


etp_elemwise_p = register_primitive(
    "etp_elemwise",
    _etp_elemwise_impl,
    batched=False,
    gradient_enabled=True,
    trainable_invars_fn=_elemwise_trainable_invars,
    x_invar_index=None,
)


# --- ETP rules --------------------------------------------------------------------------


def _elemwise_dt_to_t(hidden_dim: Array, trace: dict[str, Array], **params: object) -> dict[str, Array]:
    """``ε · hd``: position ``i`` of the trace follows position ``i`` of the hidden state."""
    return {"weight": trace["weight"] * hidden_dim}


def _elemwise_xy_to_dw(
    x: Array | None,
    hidden_dim: Array,
    weights: dict[str, Array],
    *,
    weight_fn: WeightFn | None = None,
) -> dict[str, Array]:
    """The exact pullback ``f_W'(w)ᵀ hd``; ``x`` is unused (the op has no input).

    ``hidden_dim`` may carry extra leading axes (a batch axis under
    ``brainstate.mixin.Batching``); the pullback is taken per leading index, giving
    ``(*leading, *w.shape)``, and the caller sums the leading axes.
    """
    if weight_fn is None:
        return {"weight": hidden_dim}
    w = weights["weight"]
    lead = hidden_dim.shape[: hidden_dim.ndim - w.ndim]
    _, vjp = jax.vjp(weight_fn, w)
    cotangents = jnp.reshape(hidden_dim, (-1, *w.shape)).astype(w.dtype)
    grads = jax.vmap(lambda c: vjp(c)[0])(cotangents)
    return {"weight": jnp.reshape(grads, (*lead, *w.shape))}


def _elemwise_instant_drtrl(
    x: Array | None, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """The instantaneous trace term in ``y`` space: ``∂h/∂y = df`` (no transform Jacobian)."""
    return {"weight": hidden_dim}


def _elemwise_solve_drtrl(
    signal: Array,
    trace: dict[str, Array],
    weights: dict[str, Array],
    *,
    weight_fn: WeightFn | None = None,
) -> dict[str, Array]:
    """``f_W'(w)ᵀ (g · ε)``: the learning signal meets the ``y``-space trace, then the transform."""
    return _elemwise_xy_to_dw(None, signal * trace["weight"], weights, weight_fn=weight_fn)


def _elemwise_init_drtrl(
    x_var: Var | None,
    y_var: Var,
    weight_vars: dict[str, Var] | None,
    num_hidden_state: int,
    group: HiddenGroupLike | None = None,
) -> dict[str, Array]:
    shape = tuple(group.varshape) if group is not None else shape_of(y_var)
    dtype = drtrl_dtype(None, y_var, weight_vars)
    return {"weight": jnp.zeros((*shape, num_hidden_state), dtype)}


def _elemwise_init_pp(
    x_var: Var | None,
    y_var: Var,
    weight_vars: dict[str, Var] | None,
    num_hidden_state: int,
    group: HiddenGroupLike | None = None,
) -> Array:
    shape = tuple(group.varshape) if group is not None else shape_of(y_var)
    return jnp.zeros((*shape, num_hidden_state), dtype_of(y_var))


# --- closed-form D-RTRL kernels -----------------------------------------------------------


def _elemwise_fast_instant(x: Array | None, df: Array, has_bias: bool) -> dict[str, Array]:
    return {"weight": df}


def _elemwise_fast_recurrent(diag: Array, old: dict[str, Array], num_state: int) -> dict[str, Array]:
    """``ε[..., a] ← Σ_b D[..., a, b] ε[..., b]``."""
    return {"weight": mix_states(diag, old["weight"])}


def _elemwise_fast_solve(
    signal: Array, trace: dict[str, Array], *, fold_batch: bool = False
) -> dict[str, Array]:
    if fold_batch:
        return {"weight": jnp.einsum("b...a,b...a->...", signal, trace["weight"])}
    return {"weight": sum_over_states(signal, trace["weight"])}


def _elemwise_fast_chunk(
    x_seq: Array | None,
    df_seq: Array,
    p_seq: Array,
    m_full: Array,
    old: dict[str, Array],
    num_state: int,
) -> dict[str, Array]:
    """``M ε + Σ_s P_s df_s`` over a window; ``x_seq`` is unused."""
    out = _elemwise_fast_recurrent(m_full, old, num_state)
    return {"weight": out["weight"] + propagate_df(p_seq, df_seq, num_state).sum(axis=0)}


_ELEMWISE_FAST_PATH = FastPathRules(
    instant=_elemwise_fast_instant,
    recurrent=_elemwise_fast_recurrent,
    solve=_elemwise_fast_solve,
    applicable=no_hooks,
    chunk=_elemwise_fast_chunk,
)

etp_elemwise_p.register_etp_rules(
    dt_to_t=_elemwise_dt_to_t,
    xy_to_dw=_elemwise_xy_to_dw,
    init_drtrl=_elemwise_init_drtrl,
    init_pp=_elemwise_init_pp,
    fast_path=_ELEMWISE_FAST_PATH,
    instant_drtrl=_elemwise_instant_drtrl,
    solve_drtrl=_elemwise_solve_drtrl,
    snap_anchor=snap_anchored,
)


# --- user function ------------------------------------------------------------------------


def element_wise(weight: ArrayLike, *, weight_fn: WeightFn | None = None) -> Array | u.Quantity:
    """Use a parameter directly (e.g. a leak or a gain) so that it learns online.

    Parameters
    ----------
    weight : array or Quantity
        The stored parameter, shaped like the hidden state it acts on (or broadcastable to
        it along leading batch axes).
    weight_fn : callable, optional
        Shape-preserving transform applied inside the primitive, ``y = weight_fn(weight)``,
        e.g. ``jax.nn.sigmoid`` to keep a leak in ``(0, 1)``. Gradients are with respect to the
        raw stored parameter and exact for any such transform.

    Returns
    -------
    array or Quantity
        ``weight_fn(weight)`` (or ``weight``), in the unit of ``weight``.

    Raises
    ------
    TypeError
        If ``weight`` is not an array or ``weight_fn`` is not callable.
    ValueError
        If ``weight_fn`` changes the shape of the parameter.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, braintrace
    >>> braintrace.element_wise(jnp.zeros(3), weight_fn=jax.nn.sigmoid)
    Array([0.5, 0.5, 0.5], dtype=float32)
    """
    op = "braintrace.element_wise"
    w_m, w_unit = split_units(weight, "weight", op)
    check_hook(weight_fn, "weight_fn", op)
    if weight_fn is not None:
        out = jax.eval_shape(weight_fn, jax.ShapeDtypeStruct(w_m.shape, w_m.dtype))
        if getattr(out, "shape", None) != tuple(w_m.shape):
            raise ValueError(
                f"{op}: weight_fn must preserve the parameter's shape {tuple(w_m.shape)}, but "
                f"it returns {getattr(out, 'shape', type(out).__name__)}. Reshape outside "
                f"element_wise, or use braintrace.matmul for a mixing transform."
            )
    y = etp_elemwise_p.bind(w_m, weight_fn=weight_fn)
    return with_unit(y, w_unit)
