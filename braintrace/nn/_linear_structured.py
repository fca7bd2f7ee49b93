"""Structured linear layers whose parameters learn online: ``SparseLinear``, ``LoRA``, ``GroupedLinear``.

Each trades the dense ``(in, out)`` weight for a structure with a smaller eligibility trace:
a fixed sparsity pattern (:func:`braintrace.sparse_matmul`), a low-rank product
(:func:`braintrace.lora_matmul`) or independent groups (:func:`braintrace.grouped_matmul`).
"""

from __future__ import annotations

import inspect
import brainstate
import braintools
import brainunit as u

from braintrace._op import grouped_matmul, lora_matmul
from braintrace._op.sparse import sparse_matmul
from braintrace._typing import Initializer, Value
from braintrace.nn._arguments import ArgumentCheck, check_constructor_arguments, positive_int
from braintrace.nn._linear import _fold_leading_axes

__all__ = ["SparseLinear", "LoRA", "GroupedLinear"]

#: The adapter's sizes, checked before brainstate's constructor runs.
_LORA_SIZES: dict[str, ArgumentCheck] = {
    "in_features": positive_int,
    "lora_rank": positive_int,
    "out_features": positive_int,
}


class SparseLinear(brainstate.nn.SparseLinear):
    """Sparse layer ``y = x @ M + b`` whose non-zero values learn online.

    The constructor is that of ``brainstate.nn.SparseLinear``: the sparsity pattern of
    ``spar_mat`` is fixed and its non-zero values become the trainable ``'weight'`` vector.
    The forward pass runs through :func:`braintrace.sparse_matmul`, which needs a
    ``brainevent`` sparse type (e.g. ``brainevent.CSR``); a plain ``brainunit`` sparse matrix
    is rejected with a ``TypeError`` at the first call.

    Parameters
    ----------
    spar_mat : brainevent.CSR or another brainevent sparse matrix
        The ``(in, out)`` connectivity and the initial non-zero values.
    b_init : initializer, array or None
        Bias initialiser for the ``(out,)`` bias (default ``None``: no bias).
    in_size : int or tuple of int, optional
    name : str, optional
    param_type : type
        State class of the parameters (default ``brainstate.ParamState``).

    Attributes
    ----------
    weight : ParamState
        ``{'weight': (nnz,), 'bias': (out,)}``.

    Notes
    -----
    Inputs must be ``(in,)`` or ``(batch, in)``; the layer does not fold extra leading axes.

    Examples
    --------
    >>> import jax.numpy as jnp, brainevent, braintrace
    >>> csr = brainevent.CSR.fromdense(jnp.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]]))
    >>> layer = braintrace.nn.SparseLinear(csr)
    >>> layer(jnp.ones(3))
    Array([4., 2.], dtype=float32)
    """

    __module__ = "braintrace.nn"

    def update(self, x: Value) -> Value:
        params = self.weight.value
        return sparse_matmul(x, params["weight"], sparse_mat=self.spar_mat, bias=params.get("bias"))


class LoRA(brainstate.nn.LoRA):
    """Low-rank adapter ``y = (1 / r) · x @ lora_a @ lora_b (+ base_module(x))``, learned online.

    The constructor is that of ``brainstate.nn.LoRA``. Both factors go through
    :func:`braintrace.lora_matmul`, so the eligibility trace costs ``in·r + r·out`` entries
    per hidden unit instead of ``in·out``.

    Parameters
    ----------
    in_features, lora_rank, out_features : int
        Input size, rank ``r`` and output size.
    base_module : callable, optional
        A frozen base layer whose output is added.
    kernel_init : initializer
        Initialiser of both factors (default ``LecunNormal()``).
    param_type : type
        State class of the parameters (default ``brainstate.ParamState``).
    in_size : int or tuple of int, optional
        Overrides the input size; the output size becomes ``in_size[:-1] + (out_features,)``.

    Attributes
    ----------
    weight : ParamState
        ``{'lora_a': (in, r), 'lora_b': (r, out)}``.

    Notes
    -----
    The product is scaled by ``1 / r`` (as upstream braintrace does), so the output is
    ``1 / r`` times that of ``brainstate.nn.LoRA``. The layer's ``lora_a`` (in × r) is the
    primitive's input-facing factor, whose trainable key is ``'lora_b'``, and its ``lora_b``
    is the key ``'lora_a'``: relation keys are swapped relative to the layer's leaf names,
    while gradients land on the right leaves.

    Raises
    ------
    ValueError
        If ``in_features``, ``lora_rank`` or ``out_features`` is not a positive int; at call
        time, if ``base_module`` is not callable.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> layer = braintrace.nn.LoRA(3, 2, 4, kernel_init=jnp.ones)
    >>> layer(jnp.ones(3))
    Array([3., 3., 3., 3.], dtype=float32)
    """

    __module__ = "braintrace.nn"

    def __init__(self, *args: object, **kwargs: object) -> None:
        check_constructor_arguments(type(self).__name__, super().__init__, args, kwargs, _LORA_SIZES)
        super().__init__(*args, **kwargs)

    def update(self, x: Value) -> Value:
        params = self.weight.value
        in_factor, out_factor = params["lora_a"], params["lora_b"]
        x2, unfold = _fold_leading_axes(x)
        y = unfold(lora_matmul(x2, in_factor, out_factor, alpha=1.0 / out_factor.shape[0]))
        if self.base_module is not None:
            if not callable(self.base_module):
                raise ValueError(
                    f"LoRA: base_module must be callable (a layer or function), got "
                    f"{type(self.base_module).__name__}."
                )
            y = y + self.base_module(x)
        return y

    # brainstate's LoRA.__call__ computes the product itself; route calls through update
    def __call__(self, x: Value) -> Value:
        return self.update(x)


# the constructor keeps brainstate's signature (it only checks the sizes first)
setattr(LoRA.__init__, "__signature__", inspect.signature(brainstate.nn.LoRA.__init__))


class GroupedLinear(brainstate.nn.Module):
    """``G`` independent dense maps, ``y[..., g, :] = x[..., g, :] @ W[g] + b[g]``, learned online.

    Equivalent to a dense layer with a block-diagonal weight, with a ``G``-times smaller
    eligibility trace. The forward pass runs through :func:`braintrace.grouped_matmul`.

    Parameters
    ----------
    num_groups, in_features, out_features : int
        ``G``, and the per-group input and output sizes ``K`` and ``N``.
    w_init : initializer or array
        Initialiser of the ``(G, K, N)`` weight (default ``braintools.init.KaimingNormal()``).
    b_init : initializer, array or None
        Initialiser of the ``(G, N)`` bias (default ``braintools.init.ZeroInit()``); ``None``
        drops the bias.
    name : str, optional
    param_type : type
        State class of the parameters (default ``brainstate.ParamState``).

    Attributes
    ----------
    weight : ParamState
        ``{'weight': (G, K, N), 'bias': (G, N)}``.
    in_size, out_size : tuple of int
        ``(G, K)`` and ``(G, N)``.

    Raises
    ------
    ValueError
        If a size is not a positive int.

    Notes
    -----
    ``(G, K)`` and ``(B, G, K)`` inputs bind the primitive directly; more leading axes are
    folded into one batch axis, ``(..., G, K) -> (..., G, N)``.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> layer = braintrace.nn.GroupedLinear(2, 3, 4)
    >>> layer(jnp.ones((6, 5, 2, 3))).shape
    (6, 5, 2, 4)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        w_init: Initializer = braintools.init.KaimingNormal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        name: str | None = None,
        param_type: type = brainstate.ParamState,
    ) -> None:
        super().__init__(name=name)
        self.num_groups = positive_int("GroupedLinear", "num_groups", num_groups)
        self.in_features = positive_int("GroupedLinear", "in_features", in_features)
        self.out_features = positive_int("GroupedLinear", "out_features", out_features)
        self.in_size = (self.num_groups, self.in_features)
        self.out_size = (self.num_groups, self.out_features)
        params = {
            "weight": braintools.init.param(
                w_init, (self.num_groups, self.in_features, self.out_features), allow_none=False
            )
        }
        if b_init is not None:
            params["bias"] = braintools.init.param(
                b_init, (self.num_groups, self.out_features), allow_none=False
            )
        self.weight = param_type(params)

    def update(self, x: Value) -> Value:
        params = self.weight.value
        if u.math.ndim(x) <= 3:
            return grouped_matmul(x, params["weight"], params.get("bias"))
        shape = u.math.shape(x)
        lead = tuple(shape[:-2])
        x3 = u.math.reshape(x, (-1, *shape[-2:]))
        y = grouped_matmul(x3, params["weight"], params.get("bias"))
        return u.math.reshape(y, (*lead, *y.shape[-2:]))
