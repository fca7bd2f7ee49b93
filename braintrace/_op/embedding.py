"""ETP embedding lookup: ``embedding`` and its primitives ``etp_emb`` (batched) / ``etp_emb_v``.

``y = f_W(T)[idx]`` with integer ``idx: (B,)`` or ``()``, table ``T: (V, D)``, ``y: (B, D)``
or ``(D,)``.

Trace geometry. The trace lives in the space of the *transformed* table ``U = f_W(T)``. Entry
``U[v, d]`` reaches only feature ``d`` of the output, and only when row ``v`` is looked up, so
the D-RTRL trace is table-shaped with the vocabulary axis playing the role of a dense input
axis: ``ε[..., v, d, s] = ∂h[..., d, s] / ∂U[v, d]``. Propagating through a hidden Jacobian
slice ``hd`` multiplies the feature axis (``ε · hd[..., None, :]``); the instantaneous term
(``instant_drtrl``) scatters ``df`` into the looked-up row, with no hook Jacobian. The hook's
Jacobian is applied once, when the learning signal is pulled back to the raw table
(``solve_drtrl``, an exact VJP), so D-RTRL is exact for any shape-preserving hook, including
ones that mix entries (``softmax`` over features, ``T / norm(T)``). The trace costs ``V·D·S``
per batch row, like a dense layer fed a one-hot vector.

For the IO-dim algorithms the indices are represented one-hot (:func:`_emb_pp_x_repr`):
the low-pass-filtered x trace is then a float ``(..., V)`` array, and ``xy_to_dw`` accepts it
as well as raw integer indices.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> table = jnp.arange(6.0).reshape(3, 2)
>>> braintrace.embedding(jnp.array([2, 0]), table)
Array([[4., 5.],
       [0., 1.]], dtype=float32)
>>> braintrace.embedding(1, table, weight_fn=lambda t: 2 * t)
Array([4., 6.], dtype=float32)
"""

from __future__ import annotations

import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._compatible_imports import ShapedArray, Var
from braintrace._op._operands import check_hook, check_rank, split_units, with_unit
from braintrace._op._primitive import register_primitive
from braintrace._op._registries import register_batched_counterpart
from braintrace._op._rule_helpers import (
    apply_hook,
    drtrl_dtype,
    hook_pullback,
    pullback,
    shape_of,
    strip_hooks,
    zeros_pp,
)
from braintrace._typing import Array, ArrayLike, Params, WeightFn

__all__ = ["etp_emb_p", "etp_emb_v_p", "embedding"]


def _etp_embedding_impl(
    indices: Array, weight: Array, *, weight_fn: WeightFn | None = None
) -> Array:
    # JAX's default take mode: out-of-range rows read as the fill value (NaN for floats).
    return jnp.take(apply_hook(weight_fn, weight), indices, axis=0)


def _one_hot_lookup(
    one_hot: Array, weight: Array, *, weight_fn: WeightFn | None = None
) -> Array:
    """The lookup written as a matmul, for one-hot (or filtered one-hot) float inputs."""
    return one_hot @ apply_hook(weight_fn, weight)


def _emb_trainable_invars(eqn_params: Params) -> dict[str, int]:
    return {"weight": 1}


etp_emb_p = register_primitive(
    "etp_emb",
    _etp_embedding_impl,
    batched=True,
    trainable_invars_fn=_emb_trainable_invars,
    x_invar_index=0,
)
etp_emb_v_p = register_primitive(
    "etp_emb_v",
    _etp_embedding_impl,
    batched=False,
    trainable_invars_fn=_emb_trainable_invars,
    x_invar_index=0,
)
register_batched_counterpart(etp_emb_v_p, etp_emb_p)


# --- ETP rules --------------------------------------------------------------------------


def _emb_dt_to_t(hidden_dim: Array, trace: dict[str, Array], **params: object) -> dict[str, Array]:
    """``ε[..., v, d] · hd[..., d]``: every table row follows the output feature it feeds."""
    return {"weight": trace["weight"] * jnp.expand_dims(hidden_dim, -2)}


def _emb_xy_to_dw(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """Pull ``hidden_dim`` back to the raw table, through ``weight_fn``.

    Integer ``x`` (indices, D-RTRL and per-sample contexts): the VJP of the gather, a
    scatter-add of the rows of ``hidden_dim`` into ``(V, D)``. Float ``x`` (the one-hot x
    trace of the IO-dim algorithms, ``(..., V)``): the VJP of ``x @ f_W(T)``. Both reduce
    any leading batch axes inside the VJP.
    """
    if jnp.issubdtype(jnp.result_type(x), jnp.integer):
        return pullback(_etp_embedding_impl, x, hidden_dim, weights, params, order=("weight",))
    return pullback(_one_hot_lookup, x, hidden_dim, weights, params, order=("weight",))


def _emb_instant_drtrl(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """The instantaneous term in the transformed space: ``hd`` scattered into the looked-up row.

    The lookup is linear in the table, so the pullback of the hook-free impl (at any point)
    gives it without a hook Jacobian.
    """
    return _emb_xy_to_dw(x, hidden_dim, weights, **strip_hooks(params))


def _emb_solve_drtrl(
    signal: Array,
    trace: dict[str, Array],
    weights: dict[str, Array],
    *,
    weight_fn: WeightFn | None = None,
    **params: object,
) -> dict[str, Array]:
    """``∇T = f_W'(T)ᵀ (ε · g[..., None, :])``, leading axes summed before the VJP."""
    cotangent = trace["weight"] * jnp.expand_dims(signal, -2)
    return {"weight": hook_pullback(weight_fn, weights["weight"], cotangent)}


def _emb_pp_x_repr(x: Array, weight_avals: dict[str, ShapedArray]) -> Array:
    """``one_hot(x, V)`` in the table's dtype: the input the IO-dim x trace low-pass filters.

    Negative indices count from the end of the table, as they do in the lookup itself, so
    that ``one_hot(x) @ T`` equals ``T[x]`` for every in-range index.
    """
    aval = weight_avals["weight"]
    vocab = aval.shape[0]
    x = jnp.asarray(x)
    x = jnp.where(x < 0, x + vocab, x)
    return jax.nn.one_hot(x, vocab, dtype=aval.dtype)


def _emb_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    """``weight (B, V, D, S)``."""
    return _emb_init(shape_of(x_var)[:1], x_var, y_var, weight_vars, num_hidden_state)


def _emb_v_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    """``weight (V, D, S)``."""
    return _emb_init((), x_var, y_var, weight_vars, num_hidden_state)


def _emb_init(
    lead: tuple[int, ...],
    x_var: Var,
    y_var: Var,
    weight_vars: dict[str, Var],
    num_hidden_state: int,
) -> dict[str, Array]:
    # Integer indices promote with the float table and output to the float dtype.
    dtype = drtrl_dtype(x_var, y_var, weight_vars)
    shape = shape_of(weight_vars["weight"])
    return {"weight": jnp.zeros((*lead, *shape, num_hidden_state), dtype)}


for _p, _init in ((etp_emb_p, _emb_init_drtrl), (etp_emb_v_p, _emb_v_init_drtrl)):
    _p.register_etp_rules(
        dt_to_t=_emb_dt_to_t,
        xy_to_dw=_emb_xy_to_dw,
        init_drtrl=_init,
        init_pp=zeros_pp,
        pp_x_repr=_emb_pp_x_repr,
        instant_drtrl=_emb_instant_drtrl,
        solve_drtrl=_emb_solve_drtrl,
    )


# --- user function ------------------------------------------------------------------------


def _integer_indices(indices: object, op: str) -> Array:
    if isinstance(indices, u.Quantity):
        if not indices.is_unitless:
            raise TypeError(
                f"{op}: embedding indices must be plain integers without a unit, got a quantity "
                f"in {indices.unit}. Pass the integer array without its unit."
            )
        indices = indices.mantissa
    try:
        idx = jnp.asarray(indices)
    except TypeError as err:
        raise TypeError(
            f"{op}: embedding indices must be integers (an int array, list or scalar), got "
            f"{type(indices).__name__}."
        ) from err
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(
            f"{op}: embedding indices must be integers, got dtype {idx.dtype}. Cast them, e.g. "
            f"indices.astype(jnp.int32)."
        )
    return idx


def embedding(
    indices: ArrayLike, weight: ArrayLike, *, weight_fn: WeightFn | None = None
) -> Array | u.Quantity:
    """Look up rows of a table, ``weight[indices]``, so that the table learns online.

    Parameters
    ----------
    indices : int array, list or scalar
        Row indices, ``(batch,)`` (binds ``etp_emb``) or a scalar (binds ``etp_emb_v``).
        Out-of-range indices read as NaN rows (JAX's default ``take`` mode).
    weight : array or Quantity
        The table, ``(vocab, features)``.
    weight_fn : callable, optional
        Shape-preserving transform applied to the stored table inside the primitive,
        ``y = weight_fn(weight)[indices]``. Gradients are with respect to the raw table and
        exact for any such transform, including ones that mix entries.

    Returns
    -------
    array or Quantity
        ``(batch, features)`` or ``(features,)``, in the unit of ``weight``.

    Raises
    ------
    TypeError
        If ``indices`` are not integers, ``weight`` is not an array, or ``weight_fn`` is not
        callable.
    NotImplementedError
        If ``indices`` has rank 2 or more.
    ValueError
        If ``weight`` is not rank 2, or ``weight_fn`` changes its shape.

    Notes
    -----
    The D-RTRL trace of the table has shape ``(batch, vocab, features, S)``: memory grows
    with the vocabulary.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, braintrace
    >>> table = jnp.eye(4, 3)
    >>> braintrace.embedding([0, 2], table).shape
    (2, 3)
    >>> jax.vmap(lambda i: braintrace.embedding(i, table))(jnp.array([1, 3])).shape
    (2, 3)
    """
    op = "braintrace.embedding"
    idx = _integer_indices(indices, op)
    if idx.ndim > 1:
        raise NotImplementedError(
            f"{op}: indices must be a scalar or rank 1 (batch,), got shape {tuple(idx.shape)}. "
            f"Flatten them (indices.reshape(-1)) and reshape the result, or jax.vmap over the "
            f"leading axes."
        )
    w_m, w_unit = split_units(weight, "weight", op)
    check_rank(w_m, "weight", op, (2,), hint="The table is laid out as (vocab, features).")
    check_hook(weight_fn, "weight_fn", op, w_m)
    prim = etp_emb_p if idx.ndim == 1 else etp_emb_v_p
    y = prim.bind(idx, w_m, weight_fn=weight_fn)
    return with_unit(y, w_unit)
