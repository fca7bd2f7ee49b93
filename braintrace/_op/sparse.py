"""Sparse ETP matmul: ``sparse_matmul`` and its primitives ``etp_sp_mm`` (batched) / ``etp_sp_mv``.

``y = x @ M(f_W(data)) (+ f_b(b))`` with ``x: (B, I)`` or ``(I,)`` and ``M`` a ``brainevent``
sparse structure of shape ``(I, O)`` (``brainevent.CSR``, ``CSC``, ``FixedNumPerPre``, ...)
whose stored values are replaced by the trainable ``data`` (``(P,)`` for ``P`` non-zeros in
CSR/CSC; in general shaped like the structure's own ``data``). Only the structure's sparsity
pattern is used: its stored values, dtype and unit are ignored.

Trace geometry. ``weight_fn`` acts on the vector of non-zero values, ``V = f_W(data)``, and
the trace lives in the space of ``V`` (and of ``c = f_b(b)`` for the bias). Non-zero ``p`` sits
at ``(row(p), col(p))`` and reaches only output ``col(p)``, so the D-RTRL trace keeps one entry
per non-zero: ``ε[..., p, s] = ∂h[..., col(p), s] / ∂V[p]``. Propagating through a hidden
Jacobian slice ``hd`` (shaped like ``y``) gathers the output axis: ``ε[..., p] ·
hd[..., col(p)]``, which is the structure's own ``dt2t_transposed`` protocol. The instantaneous
term (``instant_drtrl``) is ``x[..., row(p)] · df[..., col(p)]`` (and ``df`` for the bias), with
no hook Jacobian; each hook's Jacobian is applied once, when the learning signal is pulled back
to the raw values (``solve_drtrl``, an exact VJP). This keeps D-RTRL exact for any
shape-preserving hook, including ones that mix the non-zero values (``data / norm(data)``,
``softmax``). ``xy_to_dw`` (the IO-dim pullback) is the exact VJP of the impl with respect to
the raw parameters.

Kernels. On CPU brainevent's default kernels for sparse products are numba kernels, and
numba is an optional dependency of brainevent: on an install without it, every CSR product
raises ``KernelCompilationError``. When numba is absent, the structure does not name a
backend and no global brainevent backend is set, the products here run on brainevent's
pure-JAX kernels (``backend='jax_raw'``, chosen per call on a copy of the structure; the
user's structure and brainevent's global configuration are left untouched).

Gradient with respect to the values. brainevent differentiates a CSR/CSC product with respect
to its values by rebuilding every entry's row from ``indptr`` with a cumulative sum inside the
program: on CPU that costs O(nnz) per gradient at run time, or O(nnz²) at compile time when XLA
folds it over the constant pattern. For a CSR or CSC structure with concrete indices the
product here carries its own JVP instead, with each entry's ``(row, col)`` computed once on the
host: the tangent of the values is ``Σ_p x[..., row(p)] · dV[p]`` scattered to ``col(p)``, whose
transpose (reverse mode) is the gather ``x[..., row(p)] · ct[..., col(p)]``. With brainevent's
numba kernels, such a product takes a batch of inputs one row at a time through the vector
kernel, which is many times faster than its matrix kernel.

Examples
--------
>>> import jax.numpy as jnp, brainevent, braintrace
>>> csr = brainevent.CSR.fromdense(jnp.array([[1., 0., 2.], [0., 3., 0.]]))
>>> braintrace.sparse_matmul(jnp.ones(2), csr.data, sparse_mat=csr)
Array([1., 3., 2.], dtype=float32)
>>> braintrace.sparse_matmul(jnp.ones((4, 2)), csr.data, sparse_mat=csr).shape
(4, 3)
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Union

import brainevent
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compatible_imports import SymbolicZero, Var
from braintrace._errors import OperandShapeError, internal_error
from braintrace._op._operands import (
    bias_mantissa,
    check_bias_shape,
    check_hook,
    check_rank,
    split_units,
    with_unit,
)
from braintrace._op._primitive import register_primitive
from braintrace._op._registries import register_batched_counterpart, snap_anchored
from braintrace._op._rule_helpers import (
    apply_hook,
    bias_trainable_invars,
    drtrl_dtype,
    hook_pullback,
    materialised,
    pullback,
    shape_of,
    strip_hooks,
    zeros_pp,
)
from braintrace._typing import Array, ArrayLike, WeightFn

__all__ = ["etp_sp_mm_p", "etp_sp_mv_p", "sparse_matmul"]

#: Whether brainevent's default CPU kernels (numba) can be built in this environment.
_NUMBA_AVAILABLE = importlib.util.find_spec("numba") is not None
#: brainevent's pure-JAX kernels: registered on every platform for CSR, CSC and fixed-number
#: connectivity, differentiable and vmappable through brainevent's own rules.
_PURE_JAX_BACKEND = "jax_raw"
_UNITLESS = u.get_unit(1.0)


class _HashableSparseMat:
    """Holds a sparse structure as a static primitive parameter, hashed by identity.

    ``brainevent`` structures define ``__eq__`` without ``__hash__``, so they cannot be
    equation parameters themselves. ``sparse_matmul`` wraps its structure freshly per call.
    """

    __slots__ = ("mat", "coordinates")

    def __init__(self, mat: brainevent.DataRepresentation) -> None:
        self.mat = mat
        #: ``(row(p), col(p))`` of every stored entry, when the structure has them (computed once).
        self.coordinates = _entry_coordinates(mat)

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"_HashableSparseMat({type(self.mat).__name__}, shape={tuple(self.mat.shape)})"


#: The ``sparse_mat`` parameter of an ``etp_sp_mm`` equation (wrapped) or a structure itself.
_SparseParam = Union[_HashableSparseMat, brainevent.DataRepresentation]


def _needs_pure_jax_kernels(mat: brainevent.DataRepresentation) -> bool:
    """Whether brainevent would pick its numba CPU kernels for ``mat`` while numba is missing.

    An explicit choice is always respected: a backend named on the structure, or a global
    ``brainevent.config.set_backend('cpu', ...)``. Just-in-time connectivity has numba
    kernels only, so there is nothing to switch to.
    """
    if _NUMBA_AVAILABLE or isinstance(mat, brainevent.JITCMatrix):
        return False
    if getattr(mat, "backend", _PURE_JAX_BACKEND) is not None:
        return False
    return jax.default_backend() == "cpu" and brainevent.config.get_backend("cpu") is None


def _structure(sparse_mat: _SparseParam) -> brainevent.DataRepresentation:
    """The structure a rule or the impl computes with: unwrapped, with usable kernels."""
    mat = sparse_mat.mat if isinstance(sparse_mat, _HashableSparseMat) else sparse_mat
    if _needs_pure_jax_kernels(mat):
        mat = copy.copy(mat)  # a per-call kernel choice, not a change to the user's object
        mat.backend = _PURE_JAX_BACKEND
    return mat


def stored_entries(sparse_mat: _SparseParam) -> tuple[np.ndarray, np.ndarray] | None:
    """``(row(p), col(p))`` of each stored entry of an ``etp_sp_mm`` structure, on the host, in the
    order of the weight's values (``None``: not a CSR or CSC with concrete indices)."""
    if isinstance(sparse_mat, _HashableSparseMat):
        return sparse_mat.coordinates
    return _entry_coordinates(_structure(sparse_mat))


def _nnz_shape(mat: brainevent.DataRepresentation) -> tuple[int, ...]:
    return tuple(np.shape(mat.data))


def _entry_coordinates(mat: brainevent.DataRepresentation) -> tuple[np.ndarray, np.ndarray] | None:
    """``(row(p), col(p))`` of each stored entry of a CSR or CSC with concrete indices, on the host.

    ``None`` for any other structure, or one whose indices are traced.
    """
    if not isinstance(mat, (brainevent.CSR, brainevent.CSC)):
        return None
    try:
        indptr, indices = np.asarray(mat.indptr), np.asarray(mat.indices)
    except jax.errors.TracerArrayConversionError:
        return None
    compressed = np.repeat(np.arange(indptr.size - 1, dtype=indices.dtype), np.diff(indptr))
    return (compressed, indices) if isinstance(mat, brainevent.CSR) else (indices, compressed)


def _kernel_backend(mat: brainevent.DataRepresentation) -> str | None:
    """The brainevent kernels that run for ``mat`` on this platform: its own backend, else
    brainevent's global choice for the platform, else numba on CPU where it is installed
    (``None``: brainevent's default elsewhere)."""
    platform = jax.default_backend()
    default = "numba" if platform == "cpu" and _NUMBA_AVAILABLE else None
    backend = mat.backend or brainevent.config.get_backend(platform) or default
    return None if backend is None else str(backend)


def _numba_kernels(mat: brainevent.DataRepresentation) -> bool:
    """Whether brainevent runs its numba CPU kernels for ``mat``.

    Its numba kernel for a matrix operand updates one row slice per stored entry, which at a
    million entries is over twenty times slower than its vector kernel applied row by row.
    """
    return jax.default_backend() == "cpu" and _kernel_backend(mat) == "numba"


def _by_coordinates(mat: brainevent.DataRepresentation) -> bool:
    """Whether the product runs as a gather and scatter-add over the host coordinates.

    Where brainevent would run its pure-JAX kernels: they find each stored entry's row with a
    cumulative sum over the structure's index arrays, which XLA folds at compile time where the
    structure is a constant of the program (tens of seconds per product at three million entries).
    Off the CPU also where no backend is named (on the matrix or in ``brainevent.config``):
    brainevent's default kernels there are those pure-JAX ones (the connectome benchmark did not
    compile in 150 s on a TPU v5e). A backend the user names is respected.
    """
    backend = _kernel_backend(mat)
    return backend == _PURE_JAX_BACKEND or (backend is None and jax.default_backend() != "cpu")


def _product(
    x: Array, values: Array, mat: brainevent.DataRepresentation, coordinates: tuple[np.ndarray, np.ndarray] | None
) -> Array:
    """``x @ mat.with_data(values)``, differentiated with respect to ``values`` by host coordinates.

    Without coordinates, brainevent's own differentiation rules apply. A batch of inputs goes
    through brainevent's numba kernels one row at a time (see :func:`_numba_kernels`). Where
    brainevent would run its pure-JAX kernels, the product is the same gather and scatter-add
    over the host coordinates, which leaves XLA nothing to fold (see :func:`_by_coordinates`).
    """
    if coordinates is None:
        return x @ mat.with_data(values)
    rows, cols = coordinates
    n_out = mat.shape[1]
    one_row_at_a_time = x.ndim == 2 and _numba_kernels(mat)
    by_coordinates = _by_coordinates(mat)

    # Rematerialised: reverse mode keeps ``x`` for the backward pass, not ``x[..., rows]``
    # (one value per stored entry, which through a time loop is one such array per step).
    @jax.checkpoint
    def scatter_values(x: Array, dv: Array) -> Array:
        spread = _at_entries(x, rows) * dv
        return jnp.zeros((*spread.shape[:-1], n_out), spread.dtype).at[..., cols].add(spread)

    def matmul(x: Array, values: Array) -> Array:
        if by_coordinates:
            return scatter_values(x, values)
        if one_row_at_a_time:
            return jax.lax.map(lambda row: row @ mat.with_data(values), x)
        return x @ mat.with_data(values)

    @jax.custom_jvp
    def product(x: Array, values: Array) -> Array:
        return matmul(x, values)

    def product_jvp(
        primals: tuple[Array, Array], tangents: tuple[Array | SymbolicZero, Array | SymbolicZero]
    ) -> tuple[Array, Array]:
        x, values = primals
        dx, dv = tangents
        y = product(x, values)
        dy = jnp.zeros_like(y)
        if not isinstance(dx, SymbolicZero):
            dy = dy + matmul(dx, values)
        if not isinstance(dv, SymbolicZero):
            dy = dy + scatter_values(x, dv).astype(y.dtype)
        return y, dy

    product.defjvp(product_jvp, symbolic_zeros=True)
    return product(x, values)


def _etp_sp_matmul_impl(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    sparse_mat: _SparseParam,
    has_bias: bool = False,
    weight_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array:
    mat = _structure(sparse_mat)
    y: Array = _product(x, apply_hook(weight_fn, weight), mat, _host_coordinates(sparse_mat))
    if has_bias:
        if bias is None:
            raise internal_error("has_bias=True without a bias operand")
        y = y + apply_hook(bias_fn, bias)
    return y


etp_sp_mm_p = register_primitive(
    "etp_sp_mm",
    _etp_sp_matmul_impl,
    batched=True,
    trainable_invars_fn=bias_trainable_invars,
    x_invar_index=0,
)
etp_sp_mv_p = register_primitive(
    "etp_sp_mv",
    _etp_sp_matmul_impl,
    batched=False,
    trainable_invars_fn=bias_trainable_invars,
    x_invar_index=0,
)
register_batched_counterpart(etp_sp_mv_p, etp_sp_mm_p)


# --- ETP rules --------------------------------------------------------------------------


def _host_coordinates(sparse_mat: _SparseParam) -> tuple[np.ndarray, np.ndarray] | None:
    """``(row(p), col(p))`` of an equation's structure parameter, or ``None`` where it has none."""
    return sparse_mat.coordinates if isinstance(sparse_mat, _HashableSparseMat) else None


def _at_entries(values: Array, index: np.ndarray) -> Array:
    """``values[..., index]``: an input- or output-sized array read at every stored entry.

    The product and the rules all gather this one way, so that the same gather met twice in a
    step (the input at the rows, by the product and by the instantaneous trace term) is one XLA
    operation, which XLA computes once. On a TPU a gather costs about one memory access per
    index, and the gathers and the scatter-add over the entries are most of a sparse step.
    """
    return jnp.take(values, index, axis=-1)


def _entry_cotangent(x: Array, hidden_dim: Array, coordinates: tuple[np.ndarray, np.ndarray]) -> Array:
    """``x[..., row(p)] · hd[..., col(p)]`` in their promoted dtype: the cotangent ``hd`` of the
    product pulled back to its (transformed) values, before the sum over the leading axes.

    ``x`` is gathered as it is, the product's own gather; ``hd`` is computed once first
    (:func:`~braintrace._op._rule_helpers.materialised`).
    """
    rows, cols = coordinates
    dtype = jnp.result_type(x, hidden_dim)
    return _at_entries(x, rows).astype(dtype) * _at_entries(materialised(hidden_dim), cols).astype(dtype)


def _gather_columns(sparse_mat: _SparseParam, hidden_dim: Array, trace: Array) -> Array:
    """``trace[..., p] · hidden_dim[..., col(p)]`` through the structure's protocol.

    The protocol takes one ``(O,)`` vector and one nnz-shaped array, so any leading axes
    (the batch of ``etp_sp_mm``) are broadcast, flattened and mapped over. A structure with
    host coordinates (CSR, CSC) gathers by them instead: the same values, in one XLA gather
    of ``hidden_dim`` computed once first (:func:`~braintrace._op._rule_helpers.materialised`;
    on CPU, XLA would otherwise recompute the arithmetic behind a hidden Jacobian for every
    stored entry: by coordinates, the connectome's D_RTRL step at 20,000 neurons took 6.3× its
    forward step, 2.6× with it).
    """
    coordinates = _host_coordinates(sparse_mat)
    if coordinates is not None:
        dtype = jnp.result_type(hidden_dim, trace)
        return _at_entries(materialised(hidden_dim), coordinates[1]).astype(dtype) * trace.astype(dtype)
    mat = _structure(sparse_mat)
    protocol = getattr(mat, "dt2t_transposed", None)
    if protocol is None:  # brainevent before dt2t_transposed: the same map under its old name
        protocol = mat.yw_to_w_transposed
    nnz = _nnz_shape(mat)
    dtype = jnp.result_type(hidden_dim, trace)
    lead = np.broadcast_shapes(hidden_dim.shape[:-1], trace.shape[: trace.ndim - len(nnz)])
    hd = jnp.broadcast_to(hidden_dim.astype(dtype), (*lead, hidden_dim.shape[-1]))
    eps = jnp.broadcast_to(trace.astype(dtype), (*lead, *nnz))
    if not lead:
        return jnp.asarray(protocol(hd, eps))
    flat = jax.vmap(protocol)(hd.reshape(-1, hd.shape[-1]), eps.reshape(-1, *nnz))
    return jnp.reshape(flat, (*lead, *nnz))


def _sp_mm_dt_to_t(
    hidden_dim: Array, trace: dict[str, Array], *, sparse_mat: _SparseParam, **params: object
) -> dict[str, Array]:
    """``ε_w[..., p] · hd[..., col(p)]`` and ``ε_b[..., o] · hd[..., o]``; hooks play no part."""
    out = {"weight": _gather_columns(sparse_mat, hidden_dim, trace["weight"])}
    if "bias" in trace:
        out["bias"] = trace["bias"] * hidden_dim
    return out


# The unbatched rule is the same gather: the output axis is the last one of hd either way.
_sp_mv_dt_to_t = _sp_mm_dt_to_t


def _sp_xy_to_dw(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """Pull ``hidden_dim`` back to the raw parameters in one VJP through ``with_data``.

    ``∂/∂data[p] = f_W'(data)[p] · Σ x[..., row(p)] · hd[..., col(p)]``, ``∂/∂b = f_b'ᵀ(Σ hd)``.
    ``x`` and ``hd`` are gathered once per stored entry, so they are computed once first
    (:func:`~braintrace._op._rule_helpers.materialised`).
    """
    return pullback(_etp_sp_matmul_impl, materialised(x), materialised(hidden_dim), weights, params)


def _sp_instant_drtrl(
    x: Array, hidden_dim: Array, weights: dict[str, Array], *, sparse_mat: _SparseParam, **params: object
) -> dict[str, Array]:
    """The instantaneous term in the transformed space: ``x[row(p)] · hd[col(p)]`` and ``hd``.

    The product is linear in the values, so the VJP of the hook-free impl (at any point) gives
    the weight term without a hook Jacobian. With host coordinates that VJP is gathered
    directly, ``x`` at the rows the way the product gathers it, so that a step computes that
    gather once for both; the impl's VJP would gather it again (its product is rematerialised).
    """
    coordinates = _host_coordinates(sparse_mat)
    if coordinates is None:
        plain = {**strip_hooks(params), "sparse_mat": sparse_mat, "has_bias": False}
        out = pullback(_etp_sp_matmul_impl, x, hidden_dim, {"weight": weights["weight"]}, plain)
    else:
        weight = weights["weight"]
        cotangent = _entry_cotangent(x, hidden_dim, coordinates)
        out = {"weight": hook_pullback(None, weight, cotangent).astype(weight.dtype)}
    if "bias" in weights:
        out["bias"] = hidden_dim
    return out


def _sp_solve_drtrl(
    signal: Array,
    trace: dict[str, Array],
    weights: dict[str, Array],
    *,
    sparse_mat: _SparseParam,
    weight_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
    **params: object,
) -> dict[str, Array]:
    """``∇data = f_W'(data)ᵀ (ε[p] · g[col(p)])`` and ``∇b = f_b'(b)ᵀ (ε_b · g)``."""
    cotangent = _gather_columns(sparse_mat, signal, trace["weight"])
    out = {"weight": hook_pullback(weight_fn, weights["weight"], cotangent)}
    if "bias" in trace:
        out["bias"] = hook_pullback(bias_fn, weights["bias"], trace["bias"] * signal)
    return out


def _sp_mm_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    batch = shape_of(x_var)[0]
    dtype = drtrl_dtype(x_var, y_var, weight_vars)
    out = {"weight": jnp.zeros((batch, *shape_of(weight_vars["weight"]), num_hidden_state), dtype)}
    if "bias" in weight_vars:
        out["bias"] = jnp.zeros((batch, shape_of(y_var)[-1], num_hidden_state), dtype)
    return out


def _sp_mv_init_drtrl(
    x_var: Var, y_var: Var, weight_vars: dict[str, Var], num_hidden_state: int
) -> dict[str, Array]:
    dtype = drtrl_dtype(x_var, y_var, weight_vars)
    out = {"weight": jnp.zeros((*shape_of(weight_vars["weight"]), num_hidden_state), dtype)}
    if "bias" in weight_vars:
        out["bias"] = jnp.zeros((shape_of(y_var)[-1], num_hidden_state), dtype)
    return out


def _sp_snap_adjacency(
    x_shape: tuple[int, ...], y_shape: tuple[int, ...], *, sparse_mat: _SparseParam, **params: object
) -> tuple[np.ndarray | None, ...] | None:
    """Output ``o`` reads input ``i`` where the structure stores ``(i, o)``: its pattern, transposed.

    The leading (batch) axes are the identity.
    """
    if len(x_shape) != len(y_shape) or x_shape[:-1] != y_shape[:-1]:
        return None
    mat = _structure(sparse_mat)
    coordinates = stored_entries(sparse_mat)
    if coordinates is not None:
        stored = np.zeros(mat.shape, bool)
        stored[coordinates] = True
    else:
        try:
            with jax.ensure_compile_time_eval():  # the rule may run while a step is traced
                stored = np.asarray(mat.with_data(jnp.ones(_nnz_shape(mat), mat.data.dtype)).todense()) != 0
        except jax.errors.TracerArrayConversionError:
            return None
    if stored.shape != (x_shape[-1], y_shape[-1]):
        return None
    return (*[None] * (len(y_shape) - 1), stored.T)


for _p, _dt_to_t, _init in (
    (etp_sp_mm_p, _sp_mm_dt_to_t, _sp_mm_init_drtrl),
    (etp_sp_mv_p, _sp_mv_dt_to_t, _sp_mv_init_drtrl),
):
    _p.register_etp_rules(
        dt_to_t=_dt_to_t,
        xy_to_dw=_sp_xy_to_dw,
        init_drtrl=_init,
        init_pp=zeros_pp,
        instant_drtrl=_sp_instant_drtrl,
        solve_drtrl=_sp_solve_drtrl,
        snap_anchor=snap_anchored,
        snap_adjacency=_sp_snap_adjacency,
    )


# --- user function ------------------------------------------------------------------------


def _check_structure(sparse_mat: object, op: str) -> None:
    if isinstance(sparse_mat, brainevent.JITCMatrix):
        raise TypeError(
            f"{op}: sparse_mat is procedurally generated connectivity "
            f"('{type(sparse_mat).__name__}'), which stores no value per connection to train; "
            f"materialise it first with sparse_mat.tocsr()."
        )
    if isinstance(sparse_mat, brainevent.DataRepresentation):
        return
    kind = f"{type(sparse_mat).__module__}.{type(sparse_mat).__qualname__}"
    hint = " Build one with brainevent, e.g. brainevent.CSR.fromdense(dense_weight)."
    if isinstance(sparse_mat, u.sparse.SparseMatrix):
        hint = (
            " brainunit sparse matrices lack the protocol; convert one with "
            "brainevent.CSR((m.data, m.indices, m.indptr), shape=m.shape)."
        )
    raise TypeError(
        f"{op}: sparse_mat must be a brainevent.DataRepresentation providing the with_data, "
        f"yw_to_w_transposed and yw_to_w online-learning protocol methods, got '{kind}'.{hint}"
    )


def _with_data_template(
    mat: brainevent.DataRepresentation, dtype: np.dtype[np.generic], op: str
) -> brainevent.DataRepresentation:
    """``mat``, or a copy of its pattern whose stored values ``with_data`` can replace.

    ``with_data`` requires the new values to match the stored ones in dtype and unit; the
    primitive binds unitless values of the weight's dtype.
    """
    data = mat.data
    if u.get_unit(data) == _UNITLESS and jnp.dtype(u.get_mantissa(data).dtype) == dtype:
        return mat
    if not callable(getattr(mat, "apply", None)):
        raise TypeError(
            f"{op}: sparse_mat stores {u.get_mantissa(data).dtype} values in unit "
            f"{u.get_unit(data)}, while weight is {dtype} without unit after unit splitting; "
            f"build the structure with unitless values of the weight's dtype."
        )
    return mat.apply(lambda d: np.zeros(np.shape(d), dtype))


def sparse_matmul(
    x: ArrayLike,
    weight: ArrayLike,
    *,
    sparse_mat: brainevent.DataRepresentation,
    bias: ArrayLike | None = None,
    weight_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
) -> Array | u.Quantity:
    """Sparse ``x @ M(weight) (+ bias)`` whose non-zero values learn online with eligibility traces.

    ``sparse_mat`` fixes which connections exist; ``weight`` holds their values (the
    trainable parameter). Each value reaches exactly one output, so the eligibility trace
    costs one entry per connection rather than one per dense weight.

    Parameters
    ----------
    x : array or Quantity
        Input, ``(batch, in)`` (binds ``etp_sp_mm``) or ``(in,)`` (binds ``etp_sp_mv``).
    weight : array or Quantity
        The non-zero values, shaped like ``sparse_mat.data``: ``(nnz,)`` for CSR/CSC, in the
        structure's storage order.
    sparse_mat : brainevent.DataRepresentation
        The ``(in, out)`` connectivity, e.g. ``brainevent.CSR.fromdense(mask)``. Only its
        sparsity pattern is used; its stored values are replaced by ``weight``.
    bias : array or Quantity, optional
        Bias, ``(out,)``, in the unit of ``x·weight``.
    weight_fn, bias_fn : callable, optional
        Shape-preserving transforms applied to the stored parameters inside the primitive;
        ``weight_fn`` maps the vector of non-zero values. Gradients are with respect to the
        raw stored parameters and exact for any such transform, including ones that mix
        values (D-RTRL keeps its one-entry-per-connection traces in the transformed space).

    Returns
    -------
    array or Quantity
        ``(batch, out)`` or ``(out,)``, in the unit of ``x·weight``.

    Raises
    ------
    TypeError
        If ``sparse_mat`` is not a ``brainevent.DataRepresentation`` (or is procedurally
        generated connectivity, which stores no values), an operand is not an array,
        ``weight`` is not floating point, or a hook is not callable.
    ValueError
        If ``x`` is not rank 1 or 2, the shapes of ``x``, ``weight``, ``bias`` and
        ``sparse_mat`` do not fit, or a hook changes the shape of its parameter.

    Examples
    --------
    >>> import jax.numpy as jnp, brainevent, braintrace
    >>> csr = brainevent.CSR.fromdense(jnp.array([[1., 0., 2.], [0., 3., 0.]]))
    >>> braintrace.sparse_matmul(jnp.array([1., 2.]), csr.data, sparse_mat=csr,
    ...                          bias=jnp.ones(3), weight_fn=lambda w: 2 * w)
    Array([ 3., 13.,  5.], dtype=float32)
    """
    op = "braintrace.sparse_matmul"
    _check_structure(sparse_mat, op)
    x_m, x_unit = split_units(x, "x", op)
    w_m, w_unit = split_units(weight, "weight", op)
    check_rank(x_m, "x", op, (1, 2), hint="Fold extra leading axes into the batch axis.")
    _check_shapes(x_m, w_m, sparse_mat, op)
    check_hook(weight_fn, "weight_fn", op, w_m)
    check_hook(bias_fn, "bias_fn", op)
    unit = x_unit * w_unit
    operands = [x_m, w_m]
    if bias is not None:
        b_m = bias_mantissa(bias, unit, op)
        check_bias_shape(b_m, (*x_m.shape[:-1], sparse_mat.shape[1]), op)
        check_hook(bias_fn, "bias_fn", op, b_m)
        operands.append(b_m)
    structure = _HashableSparseMat(_with_data_template(sparse_mat, w_m.dtype, op))
    prim = etp_sp_mm_p if x_m.ndim == 2 else etp_sp_mv_p
    y = prim.bind(
        *operands,
        sparse_mat=structure,
        has_bias=bias is not None,
        weight_fn=weight_fn,
        bias_fn=bias_fn,
    )
    return with_unit(y, unit)


def _check_shapes(x: Array, weight: Array, mat: brainevent.DataRepresentation, op: str) -> None:
    n_in, n_out = tuple(mat.shape)
    nnz = _nnz_shape(mat)
    if tuple(weight.shape) != nnz:
        raise OperandShapeError(
            f"{op}: weight of shape {tuple(weight.shape)} must hold one value per stored entry "
            f"of sparse_mat, shape {nnz}; pass e.g. sparse_mat.data or an array of that shape."
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(
            f"{op}: weight must be a floating-point array of non-zero values, got dtype "
            f"{weight.dtype}."
        )
    if x.shape[-1] != n_in:
        raise OperandShapeError(
            f"{op}: the last axis of x {tuple(x.shape)} must equal the input size {n_in} of "
            f"sparse_mat, shape {(n_in, n_out)} laid out as (in, out)."
        )
