"""The deprecated v0.1 operator classes (``ETraceOp`` and its five subclasses).

Each class binds an ETP operator's static options and calls it: ``op(x, weights)`` is
``xw_to_y`` (the ETP path, seen by the compiler) and ``raw_xw_to_y`` is the same computation
in plain JAX (invisible to it). Transforms and masks run inside the primitive as its
``weight_fn``/``kernel_fn`` hook, so online gradients stay exact with respect to the raw
weight; the hook receives the weight's mantissa.

Migration: ``ETraceParam({'weight': W}, MatMulOp())`` + ``p.execute(x)`` becomes
``brainstate.ParamState({'weight': W})`` + ``braintrace.matmul(x, p.value['weight'])``.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar, Union

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._op import element_wise, lora_matmul, matmul
from braintrace._op._operands import split_units, with_unit
from braintrace._op.conv import conv
from braintrace._op.sparse import sparse_matmul

__all__ = ["identity", "ETraceOp", "MatMulOp", "ElemWiseOp", "ConvOp", "SpMatMulOp", "LoraOp"]

Hook = Callable[[jax.Array], jax.Array]
#: An operand of an operator: an array or a ``brainunit`` quantity.
Operand = Union[jax.Array, u.Quantity]
#: An operator's weights: ``{'weight': ..., 'bias'?: ...}`` (``{'B', 'A'}`` for LoRA), or
#: the weight itself for :class:`ElemWiseOp`.
Weights = Union[Operand, dict[str, Operand]]

_T = TypeVar("_T")


def identity(x: _T) -> _T:
    """The default transform: return ``x`` unchanged."""
    return x


def _dict_weight(weights: Weights, keys: tuple[str, ...], op: str) -> dict[str, Operand]:
    if not isinstance(weights, dict):
        raise TypeError(
            f"{op}: the weights must be a dict with keys {list(keys)} (plus an optional 'bias'), "
            f"got {type(weights).__name__}."
        )
    missing = [k for k in keys if k not in weights]
    if missing:
        raise ValueError(
            f"{op}: the weight dict is missing {missing}; it has {sorted(weights)} and needs "
            f"{list(keys)} (plus an optional 'bias')."
        )
    return weights


def _check_mask(mask: object, op: str) -> jax.Array | None:
    if mask is None:
        return None
    if not isinstance(mask, (np.ndarray, jax.Array, u.Quantity)):
        raise TypeError(
            f"{op}: weight_mask must be a NumPy/JAX array or a brainunit Quantity, got "
            f"{type(mask).__name__}."
        )
    if isinstance(mask, u.Quantity) and not mask.unit.is_unitless:
        raise ValueError(f"{op}: weight_mask must be unitless, got a mask in {mask.unit}.")
    return jnp.asarray(u.get_mantissa(mask))


def _check_fn(fn: Hook, arg: str, op: str) -> Hook:
    if not callable(fn):
        raise TypeError(f"{op}: {arg} must be callable, got {type(fn).__name__}.")
    return fn


def _hook(fn: Hook, mask: jax.Array | None, fn_before_mask: bool = False) -> Hook | None:
    """``w -> fn(w * mask)`` (or ``fn(w) * mask``); ``None`` when it is the identity."""
    if mask is None:
        return None if fn is identity else fn

    def masked(w: jax.Array) -> jax.Array:
        return fn(w) * mask if fn_before_mask else fn(w * mask)

    return masked


def _apply(hook: Hook | None, value: Operand) -> Operand:
    """The hook applied to ``value``'s mantissa, in ``value``'s unit (the raw-path twin)."""
    if hook is None:
        return value
    mantissa, unit = split_units(value, "weight", "legacy op")
    return with_unit(hook(mantissa), unit)


class ETraceOp:
    """Base of the deprecated operator classes: ``op(x, weights) = xw_to_y(x, weights)``.

    Parameters
    ----------
    is_diagonal : bool
        Whether the operator acts element-wise on its weight.
    name : str, optional

    Examples
    --------
    >>> from braintrace._legacy import MatMulOp
    >>> MatMulOp().is_diagonal
    False
    """

    __module__ = "braintrace"

    def __init__(self, is_diagonal: bool = False, name: str | None = None) -> None:
        self.is_diagonal = is_diagonal
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(is_diagonal={self.is_diagonal})"

    def __call__(self, inputs: Operand, weights: Weights) -> Operand:
        return self.xw_to_y(inputs, weights)

    def xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        """The output through the ETP operator (seen by the compiler)."""
        raise NotImplementedError(f"{type(self).__name__} does not define xw_to_y.")

    def raw_xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        """The same output through plain JAX (invisible to the compiler)."""
        return self.xw_to_y(inputs, weights)

    def dt_to_t(self, hidden_dim_arr: Operand, weight_dim_tree: Weights) -> Weights:
        """Not available: trace propagation belongs to the ETP primitives' rules now."""
        raise NotImplementedError(
            f"{type(self).__name__}.dt_to_t is not available; the ETP primitives' registered "
            f"rules propagate traces (see braintrace._op.ETP_RULES_DT_TO_T)."
        )

    def xy_to_dw(self, input_dim_arr: Operand, hidden_dim_arr: Operand, weights: Weights) -> Weights:
        """The VJP of ``xw_to_y(input_dim_arr, ·)`` at ``weights`` with cotangent ``hidden_dim_arr``.

        Raises
        ------
        ValueError
            If ``hidden_dim_arr`` does not have the output's shape.
        """
        out, pullback = jax.vjp(lambda w: u.get_mantissa(self.xw_to_y(input_dim_arr, w)), weights)
        cotangent = u.get_mantissa(hidden_dim_arr)
        if jnp.shape(cotangent) != jnp.shape(out):
            raise ValueError(
                f"{type(self).__name__}.xy_to_dw: hidden_dim_arr has shape {jnp.shape(cotangent)}, "
                f"but the operator's output has shape {jnp.shape(out)}."
            )
        return pullback(cotangent)[0]


class MatMulOp(ETraceOp):
    """Deprecated dense operator: ``x @ W' + bias`` via :func:`braintrace.matmul`.

    ``W' = weight_fn(W * mask)``, or ``weight_fn(W) * mask`` with
    ``apply_weight_fn_before_mask=True``. Weights are ``{'weight': (in, out), 'bias'?: (out,)}``.

    Parameters
    ----------
    weight_mask : array or Quantity, optional
        Unitless connectivity mask.
    weight_fn : callable
        Shape-preserving transform of the weight's mantissa.
    apply_weight_fn_before_mask : bool

    Raises
    ------
    TypeError
        For a mask that is not an array, a non-callable ``weight_fn`` or a non-bool flag.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import MatMulOp
    >>> MatMulOp(weight_mask=jnp.eye(2))(jnp.ones(2), {'weight': jnp.ones((2, 2))})
    Array([1., 1.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(
        self,
        weight_mask: jax.Array | np.ndarray | u.Quantity | None = None,
        weight_fn: Hook = identity,
        apply_weight_fn_before_mask: bool = False,
    ) -> None:
        super().__init__(is_diagonal=False)
        self.weight_mask = _check_mask(weight_mask, "MatMulOp")
        self.weight_fn = _check_fn(weight_fn, "weight_fn", "MatMulOp")
        if not isinstance(apply_weight_fn_before_mask, bool):
            raise TypeError(
                f"MatMulOp: apply_weight_fn_before_mask must be a bool, got "
                f"{apply_weight_fn_before_mask!r}."
            )
        self.apply_weight_fn_before_mask = apply_weight_fn_before_mask

    def _hook(self) -> Hook | None:
        return _hook(self.weight_fn, self.weight_mask, self.apply_weight_fn_before_mask)

    def xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        w = _dict_weight(weights, ("weight",), "MatMulOp")
        return matmul(inputs, w["weight"], w.get("bias"), weight_fn=self._hook())

    def raw_xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        w = _dict_weight(weights, ("weight",), "MatMulOp")
        y = u.math.matmul(inputs, _apply(self._hook(), w["weight"]))
        return y if w.get("bias") is None else y + w["bias"]


class ElemWiseOp(ETraceOp):
    """Deprecated element-wise operator: ``fn(w)`` via :func:`braintrace.element_wise`.

    Called with the weight alone, ``op(w)``; the input of ``xw_to_y(x, w)`` is ignored.

    Parameters
    ----------
    fn : callable
        Shape-preserving transform of the weight's mantissa.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import ElemWiseOp
    >>> ElemWiseOp(jnp.abs)(jnp.array([-1.0, 2.0]))
    Array([1., 2.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(self, fn: Hook = identity) -> None:
        super().__init__(is_diagonal=True)
        self.fn = _check_fn(fn, "fn", "ElemWiseOp")

    def __call__(self, weights: Weights) -> Operand:  # type: ignore[override]
        return self.xw_to_y(None, weights)

    def xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        return element_wise(weights, weight_fn=_hook(self.fn, None))

    def raw_xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        return _apply(_hook(self.fn, None), weights)


def _bias_on_channels(y: Operand, bias: Operand, out_feature_axis: int) -> Operand:
    """Add ``bias`` as :func:`braintrace.conv` does: a ``(C_out,)`` bias on the channel axis."""
    if u.math.ndim(bias) == 1 and bias.shape[0] == y.shape[out_feature_axis]:
        shape = [1] * y.ndim
        shape[out_feature_axis] = bias.shape[0]
        bias = u.math.reshape(bias, tuple(shape))
    return y + bias


def _per_axis(value: int | Sequence[int] | None, n_spatial: int) -> tuple[int, ...] | None:
    """An int or a length-1 sequence replicated to every spatial axis (as braintrace.conv does)."""
    if value is None:
        return None
    values = (value,) if isinstance(value, int) else tuple(value)
    return values * n_spatial if len(values) == 1 else values


class ConvOp(ETraceOp):
    """Deprecated convolution operator via :func:`braintrace.conv`.

    Weights are ``{'weight': kernel, 'bias'?: ...}``; the kernel becomes
    ``weight_fn(kernel * mask)`` inside the primitive.

    Parameters
    ----------
    xinfo : jax.ShapeDtypeStruct or None
        The input's abstract value (kept for reference).
    window_strides, padding, lhs_dilation, rhs_dilation, feature_group_count,
    batch_group_count, dimension_numbers
        As in ``jax.lax.conv_general_dilated``.
    weight_mask : array or Quantity, optional
    weight_fn : callable

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import ConvOp
    >>> op = ConvOp(None, (1,), 'VALID')
    >>> op(jnp.ones((1, 1, 5)), {'weight': jnp.ones((2, 1, 3))}).shape
    (1, 2, 3)
    """

    __module__ = "braintrace"

    def __init__(
        self,
        xinfo: jax.ShapeDtypeStruct | None,
        window_strides: int | Sequence[int],
        padding: str | Sequence[tuple[int, int]],
        lhs_dilation: int | Sequence[int] | None = None,
        rhs_dilation: int | Sequence[int] | None = None,
        feature_group_count: int = 1,
        batch_group_count: int = 1,
        dimension_numbers: jax.lax.ConvGeneralDilatedDimensionNumbers = None,
        weight_mask: jax.Array | np.ndarray | u.Quantity | None = None,
        weight_fn: Hook = identity,
    ) -> None:
        super().__init__(is_diagonal=False)
        self.xinfo = xinfo
        self.window_strides = window_strides
        self.padding = padding
        self.lhs_dilation = lhs_dilation
        self.rhs_dilation = rhs_dilation
        self.feature_group_count = feature_group_count
        self.batch_group_count = batch_group_count
        self.dimension_numbers = dimension_numbers
        self.weight_mask = _check_mask(weight_mask, "ConvOp")
        self.weight_fn = _check_fn(weight_fn, "weight_fn", "ConvOp")

    def xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        w = _dict_weight(weights, ("weight",), "ConvOp")
        return conv(
            inputs,
            w["weight"],
            w.get("bias"),
            strides=self.window_strides,
            padding=self.padding,
            lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.rhs_dilation,
            feature_group_count=self.feature_group_count,
            batch_group_count=self.batch_group_count,
            dimension_numbers=self.dimension_numbers,
            kernel_fn=_hook(self.weight_fn, self.weight_mask),
        )

    def raw_xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        w = _dict_weight(weights, ("weight",), "ConvOp")
        x_m, x_unit = split_units(inputs, "inputs", "ConvOp")
        kernel = _apply(_hook(self.weight_fn, self.weight_mask), w["weight"])
        k_m, k_unit = split_units(kernel, "weight", "ConvOp")
        dn = jax.lax.conv_dimension_numbers(x_m.shape, k_m.shape, self.dimension_numbers)
        n_spatial = x_m.ndim - 2
        y_m = jax.lax.conv_general_dilated(
            x_m,
            k_m,
            window_strides=_per_axis(self.window_strides, n_spatial) or (1,) * n_spatial,
            padding=self.padding,
            lhs_dilation=_per_axis(self.lhs_dilation, n_spatial),
            rhs_dilation=_per_axis(self.rhs_dilation, n_spatial),
            dimension_numbers=dn,
            feature_group_count=self.feature_group_count,
            batch_group_count=self.batch_group_count,
        )
        y = with_unit(y_m, x_unit * k_unit)
        return y if w.get("bias") is None else _bias_on_channels(y, w["bias"], dn.out_spec[1])


class SpMatMulOp(ETraceOp):
    """Deprecated sparse operator: ``x @ M(weight_fn(w['weight'])) + bias`` via
    :func:`braintrace.sparse_matmul`.

    Parameters
    ----------
    sparse_mat : brainunit.sparse.SparseMatrix
        The connectivity; the ETP path needs a ``brainevent`` type (e.g. ``brainevent.CSR``).
    weight_fn : callable

    Raises
    ------
    TypeError
        If ``sparse_mat`` is not a ``brainunit.sparse.SparseMatrix``.

    Examples
    --------
    >>> import jax.numpy as jnp, brainevent
    >>> from braintrace._legacy import SpMatMulOp
    >>> csr = brainevent.CSR.fromdense(jnp.array([[1.0, 0.0], [0.0, 2.0]]))
    >>> SpMatMulOp(csr)(jnp.ones(2), {'weight': csr.data})
    Array([1., 2.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(self, sparse_mat: u.sparse.SparseMatrix, weight_fn: Hook = identity) -> None:
        super().__init__(is_diagonal=False)
        if not isinstance(sparse_mat, u.sparse.SparseMatrix):
            raise TypeError(
                f"SpMatMulOp: sparse_mat must be a brainunit.sparse.SparseMatrix (e.g. "
                f"brainevent.CSR.fromdense(mask)), got {type(sparse_mat).__name__}."
            )
        self.sparse_mat = sparse_mat
        self.weight_fn = _check_fn(weight_fn, "weight_fn", "SpMatMulOp")

    def xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        w = _dict_weight(weights, ("weight",), "SpMatMulOp")
        return sparse_matmul(
            inputs,
            w["weight"],
            sparse_mat=self.sparse_mat,
            bias=w.get("bias"),
            weight_fn=_hook(self.weight_fn, None),
        )

    def raw_xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        w = _dict_weight(weights, ("weight",), "SpMatMulOp")
        data = _apply(_hook(self.weight_fn, None), w["weight"])
        # a dense product: plain JAX on every backend (brainevent's CPU kernels need numba)
        y = u.math.matmul(inputs, self.sparse_mat.with_data(data).todense())
        return y if w.get("bias") is None else y + w["bias"]


class LoraOp(ETraceOp):
    """Deprecated low-rank operator: ``alpha · x @ B @ A + bias`` via :func:`braintrace.lora_matmul`.

    Weights are ``{'B': (in, r), 'A': (r, out), 'bias'?: (out,)}``.

    Parameters
    ----------
    alpha : float, optional
        Scale of the product (``None`` means 1).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._legacy import LoraOp
    >>> LoraOp(alpha=0.5)(jnp.ones(3), {'B': jnp.ones((3, 2)), 'A': jnp.ones((2, 1))})
    Array([3.], dtype=float32)
    """

    __module__ = "braintrace"

    def __init__(self, alpha: float | jax.Array | None = None) -> None:
        super().__init__(is_diagonal=False)
        self.alpha = None if alpha is None else jnp.asarray(alpha)

    def _alpha(self) -> float:
        return 1.0 if self.alpha is None else float(self.alpha)

    def xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        w = _dict_weight(weights, ("B", "A"), "LoraOp")
        return lora_matmul(inputs, w["B"], w["A"], alpha=self._alpha(), bias=w.get("bias"))

    def raw_xw_to_y(self, inputs: Operand, weights: Weights) -> Operand:
        w = _dict_weight(weights, ("B", "A"), "LoraOp")
        y = u.math.matmul(u.math.matmul(self._alpha() * inputs, w["B"]), w["A"])
        return y if w.get("bias") is None else y + w["bias"]
