"""Small building blocks shared by the ETP rules of several primitive families.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._op._rule_helpers import pullback
>>> def impl(x, w, **params):
...     return x @ w
>>> pullback(impl, jnp.ones(2), jnp.ones(3), {'weight': jnp.zeros((2, 3))}, {})['weight']
Array([[1., 1., 1.],
       [1., 1., 1.]], dtype=float32)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
from typing import Callable, Iterator, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compatible_imports import Atom, ShapedArray, Var
from braintrace._typing import Array, Params, WeightFn

__all__ = [
    "HOOK_NAMES",
    "apply_hook",
    "shape_of",
    "dtype_of",
    "bias_trainable_invars",
    "drtrl_dtype",
    "hook_pullback",
    "hooked_matmul_solve_drtrl",
    "mix_states",
    "no_hooks",
    "propagate_df",
    "ROWS_PER_ITERATION",
    "SPELLED_OUT_STATES",
    "pullback",
    "sum_leading",
    "sum_over_states",
    "sum_states",
    "strip_hooks",
    "sum_rows",
    "sum_over_rows",
    "vectorised_rows",
    "zeros_pp",
]

Tree = TypeVar("Tree")
#: The operands of :func:`sum_over_rows`: an array or a pytree of arrays with a common leading axis.
Rows = TypeVar("Rows")

#: The static parameters that hold parameter transforms, across every operator family.
HOOK_NAMES = ("weight_fn", "bias_fn", "kernel_fn", "a_fn", "b_fn")


def apply_hook(hook: WeightFn | None, value: Array) -> Array:
    """``hook(value)``, or ``value`` itself when there is no hook."""
    return value if hook is None else hook(value)


def no_hooks(eqn_params: Params) -> bool:
    """``True`` when no transform hook is active: the gate of the closed-form kernels."""
    return all(eqn_params.get(name) is None for name in HOOK_NAMES)


def strip_hooks(eqn_params: Params) -> Params:
    """``eqn_params`` with every transform hook set to ``None`` (the untransformed operator)."""
    return {k: (None if k in HOOK_NAMES else v) for k, v in eqn_params.items()}


def hook_pullback(hook: WeightFn | None, value: Array, cotangent: Array) -> Array:
    """``f'(value)ᵀ c``: a cotangent on ``f(value)`` pulled back to the raw parameter.

    ``cotangent`` is first summed to the shape of ``value``: over extra leading axes (several
    batch rows or samples) and over the axes along which ``value`` broadcasts (a ``(1,)``
    bias on an ``(O,)`` output). One exact VJP of the hook follows, so a hook that couples
    entries (``w / norm(w)``, ``softmax``) is differentiated as a whole.
    """
    shape = tuple(value.shape)
    extra = cotangent.ndim - len(shape)
    if extra > 0:
        cotangent = sum_leading(cotangent, extra)
    kept = tuple(i for i, (n, c) in enumerate(zip(shape, cotangent.shape)) if n == 1 and c != 1)
    if kept:
        cotangent = cotangent.sum(axis=kept, keepdims=True)
    if hook is None:
        return cotangent.astype(jnp.result_type(cotangent, value))
    out, vjp = jax.vjp(hook, value)
    grads: Array = vjp(cotangent.astype(out.dtype))[0]
    return grads


def bias_trainable_invars(eqn_params: Params) -> dict[str, int]:
    """``{'weight': 1}`` plus ``{'bias': 2}`` when the equation binds a bias."""
    layout = {"weight": 1}
    if eqn_params.get("has_bias", False):
        layout["bias"] = 2
    return layout


def pullback(
    impl: Callable[..., Array],
    x: Array | None,
    hidden_dim: Array,
    weights: dict[str, Array],
    params: Params,
    order: tuple[str, ...] = ("weight", "bias"),
) -> dict[str, Array]:
    """One fused VJP of ``impl`` with respect to every trainable operand, at ``hidden_dim``.

    ``impl`` is called as ``impl(x, *operands, **params)`` with the operands of ``weights``
    taken in ``order`` (keys absent from ``weights`` are skipped, ``x`` is left out when
    ``None``). Hooks in ``params`` are differentiated through, so gradients are with respect
    to the raw stored parameters.
    """
    unknown = set(weights) - set(order)
    if unknown:
        raise KeyError(f"pullback: unexpected trainable keys {sorted(unknown)}; known: {order}.")
    keys = [k for k in order if k in weights]

    def forward(ws: dict[str, Array]) -> Array:
        operands = ([] if x is None else [x]) + [ws[k] for k in keys]
        return impl(*operands, **params)

    y, vjp = jax.vjp(forward, dict(weights))
    grads: dict[str, Array] = vjp(jnp.asarray(hidden_dim, dtype=y.dtype))[0]
    return grads


def materialised(value: Array) -> Array:
    """``value``, computed once into a buffer before an operation that reads it many times.

    XLA on CPU fuses the element-wise operations that produce an array into its consumer, and
    a consumer that reads each element many times (a trace-sized update broadcasting a
    hidden-sized ``D``; a gather of a hidden-sized vector at every connection of a sparse
    matrix) then recomputes them for every read. ``optimization_barrier`` does not keep them
    out of the fusion there; a product with ``[1, 0]`` at full precision (``v · 1 + 0 · 0``: the
    same values, a zero's sign aside) does, since XLA does not fuse products into element-wise
    loops. Only on CPU; elsewhere ``value`` is returned as it is.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> materialised(jnp.array([0.5, -2.0, jnp.inf]))
    Array([ 0.5, -2. ,  inf], dtype=float32)
    """
    def through_product(v: Array) -> Array:
        pair = jnp.stack([v, jnp.zeros_like(v)], axis=-1)
        return jnp.matmul(pair, jnp.array([1, 0], v.dtype), precision=jax.lax.Precision.HIGHEST)

    if not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    return jax.lax.platform_dependent(value, cpu=through_product, default=lambda v: v)


def shape_of(var: Atom) -> tuple[int, ...]:
    """The static shape of a jaxpr variable (or literal)."""
    return tuple(cast(ShapedArray, var.aval).shape)


def dtype_of(var: Atom) -> np.dtype[np.generic]:
    """The dtype of a jaxpr variable (or literal)."""
    return cast(ShapedArray, var.aval).dtype


def drtrl_dtype(x_var: Var | None, y_var: Var, weight_vars: dict[str, Var] | None) -> np.dtype[np.generic]:
    """The dtype of a D-RTRL trace: the promotion of every operand's and the output's dtype."""
    dtypes = [dtype_of(y_var)]
    if x_var is not None:
        dtypes.append(dtype_of(x_var))
    if weight_vars:
        dtypes.extend(dtype_of(v) for v in weight_vars.values())
    return jnp.result_type(*dtypes)


def zeros_pp(
    x_var: Var | None, y_var: Var, weight_vars: dict[str, Var] | None, num_hidden_state: int
) -> Array:
    """The pp_prop df trace of a primitive: ``zeros((*y.shape, S), y.dtype)``."""
    return jnp.zeros((*shape_of(y_var), num_hidden_state), dtype_of(y_var))


#: The widest state axis the helpers below spell out term by term. Beyond it (a SnAp trace is
#: ``K·S`` wide) the spelled-out program grows with the square of the width and its compile time
#: with it, so they contract with one reduction or matrix product instead.
SPELLED_OUT_STATES = 4


def sum_states(x: Array) -> Array:
    """``Σ_a x[..., a]`` over the trailing (hidden-state) axis, as a sum of slices.

    On CPU, XLA hands a reduction over that small axis whose operand is a product of several
    arrays to a library fusion much slower than slices and adds, which fuse as element-wise
    work. Axes wider than :data:`SPELLED_OUT_STATES` are reduced directly.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> sum_states(jnp.arange(6.0).reshape(3, 2))
    Array([1., 5., 9.], dtype=float32)
    """
    if x.shape[-1] > SPELLED_OUT_STATES:
        return jnp.sum(x, axis=-1)
    return functools.reduce(operator.add, [x[..., a] for a in range(x.shape[-1])])


def sum_over_states(signal: Array, trace: Array) -> Array:
    """``Σ_a signal[..., a] * trace[..., a]`` (broadcasting) as a sum of element-wise products.

    A sum of products, rather than a reduction over the small trailing state axis, lets XLA fuse
    it with neighbouring element-wise work (up to :data:`SPELLED_OUT_STATES` states).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> sum_over_states(jnp.ones((2, 6)), jnp.arange(6.0))
    Array([15., 15.], dtype=float32)
    """
    if trace.shape[-1] > SPELLED_OUT_STATES:
        return jnp.sum(signal * trace, axis=-1)
    terms = [signal[..., a] * trace[..., a] for a in range(trace.shape[-1])]
    return functools.reduce(operator.add, terms)


def sum_leading(x: Array, num_axes: int = 1) -> Array:
    """``x`` summed over its ``num_axes`` leading axes, as rows (see :func:`sum_over_rows`).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> sum_leading(jnp.arange(12.0).reshape(3, 2, 2), 2)
    Array([30., 36.], dtype=float32)
    """
    rows = jnp.reshape(x, (-1, *x.shape[num_axes:]))
    return sum_over_rows(lambda row: row, rows, lambda: rows.sum(axis=0))


def mix_states(diag: Array, vec: Array) -> Array:
    """``out[..., a] = Σ_b diag[..., a, b] · vec[..., b]`` (broadcasting), spelled out per state.

    As an einsum this contraction over the small state axis lowers to a batched matrix product
    with one tiny product per position, much slower on CPU than the element-wise products and
    sums, which fuse into one pass over ``vec``. Axes wider than :data:`SPELLED_OUT_STATES`
    use the (broadcasting) matrix product.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> mix_states(jnp.array([[0.0, 1.0], [2.0, 0.0]]), jnp.array([3.0, 4.0]))
    Array([4., 6.], dtype=float32)
    >>> wide, vec = jnp.arange(72.0).reshape(2, 6, 6), jnp.arange(6.0)  # a matrix product
    >>> bool(jnp.allclose(mix_states(wide, vec), jnp.einsum('pab,b->pa', wide, vec)))
    True
    """
    if vec.shape[-1] == 1:
        return diag[..., 0, :] * vec
    if vec.shape[-1] > SPELLED_OUT_STATES:
        return jnp.matmul(diag, vec[..., None])[..., 0]
    return jnp.stack([sum_over_states(diag[..., a, :], vec) for a in range(vec.shape[-1])], axis=-1)


def sum_rows(solve_row: Callable[[Array, dict[str, Array]], dict[str, Array]],
             signal: Array, trace: dict[str, Array]) -> dict[str, Array]:
    """``Σ_b solve_row(signal[b], trace[b])`` over the leading (batch) axis (see :func:`sum_over_rows`)."""
    def vectorised() -> dict[str, Array]:
        return {k: v.sum(axis=0) for k, v in jax.vmap(solve_row)(signal, trace).items()}

    return sum_over_rows(lambda row: solve_row(*row), (signal, trace), vectorised)


#: The rows one iteration of the CPU row loop of :func:`sum_over_rows` adds. Each iteration has
#: a fixed cost on CPU, and XLA fuses the rows of one iteration into one update of the running sum,
#: which streams each of them and the sum at once. Four streams of a trace larger than the cache
#: run faster than eight: the D_RTRL step at batch 32 takes 0.87–0.94× the time on the LIF-1024
#: benchmark model (0.81–0.89× with bfloat16 traces) and 0.76–0.94× on GRU-256, and on LIF-256
#: and the convolutional one, whose traces are in cache, the same within the noise
#: (``benchmarks/README.md``, compile time).
ROWS_PER_ITERATION = 4


#: Whether :func:`sum_over_rows` may loop over rows on CPU (see :func:`vectorised_rows`).
_ROW_LOOP: contextvars.ContextVar[bool] = contextvars.ContextVar("braintrace_row_loop", default=True)


@contextlib.contextmanager
def vectorised_rows() -> Iterator[None]:
    """Within this block, :func:`sum_over_rows` adds the rows as one reduction on every platform.

    For operands whose rows are split over devices (a batch sharded over a mesh): indexing them
    row by row in a loop would gather every row onto every device.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> with vectorised_rows():
    ...     sum_leading(jnp.ones((4, 2)))
    Array([4., 4.], dtype=float32)
    """
    token = _ROW_LOOP.set(False)
    try:
        yield
    finally:
        _ROW_LOOP.reset(token)


def sum_over_rows(solve_row: Callable[[Rows], Tree], operands: Rows, vectorised: Callable[[], Tree]) -> Tree:
    """``Σ_b solve_row(operands[b])`` over the operands' leading axis (``operands[b]``: row ``b``
    of every array in the tree), a program that does not grow with the number of rows (it adds at
    most :data:`ROWS_PER_ITERATION` ``- 1`` rows outside its loop).

    On CPU a loop adds the rows (:func:`_loop_over_rows`): XLA lowers a reduction over a leading
    (batch) axis, or a contraction over it, to a strided pass or a transposed copy of the whole
    operand, over ten times slower on a large trace than streaming it row by row. Elsewhere the
    batched ``vectorised()`` (the same sum as one reduction) runs.
    """
    num_rows = jax.tree.leaves(operands)[0].shape[0]
    if num_rows == 0 or not _ROW_LOOP.get():
        return vectorised()
    if num_rows == 1:
        return solve_row(jax.tree.map(lambda x: x[0], operands))
    return jax.lax.platform_dependent(cpu=lambda: _loop_over_rows(solve_row, operands, num_rows),
                                      default=vectorised)


def _loop_over_rows(solve_row: Callable[[Rows], Tree], operands: Rows, num_rows: int) -> Tree:
    """``Σ_b solve_row(operands[b])`` added in the order ``b = 0, 1, …``: a loop adding
    :data:`ROWS_PER_ITERATION` rows per iteration over the whole blocks of rows, then the rows
    left over (fewer than a block)."""
    num_blocks, rest = divmod(num_rows, ROWS_PER_ITERATION)

    def add_row(row: Rows, total: Tree | None) -> Tree:
        value = solve_row(row)
        return value if total is None else jax.tree.map(jnp.add, total, value)

    def add_row_at(index: Array, total: Tree) -> Tree:
        return add_row(jax.tree.map(lambda x: _row_at(x, index), operands), total)

    total: Tree | None = None
    if num_blocks:
        shapes = jax.eval_shape(solve_row, jax.tree.map(lambda x: x[0], operands))
        zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total = jax.lax.fori_loop(0, num_blocks * ROWS_PER_ITERATION, add_row_at, zero, unroll=ROWS_PER_ITERATION)
    for b in range(num_rows - rest, num_rows):
        total = add_row(jax.tree.map(lambda x: _row_at(x, b), operands), total)
    return cast(Tree, total)


def _row_at(x: Array, b: Array | int) -> Array:
    """``x[b]`` for an index ``0 <= b < len(x)``: traced (in the row loop) or a Python int.

    XLA on CPU slices a 16-bit float array (a trace stored in ``bfloat16``) in float32: it
    converts the whole array and converts every element of the row back and forth. Its bits are
    sliced instead, as unsigned integers, which XLA slices as they are. In the loop the array is
    tied to the index, or XLA would hoist the reinterpretation of the loop-invariant array out of
    the loop, as a copy of the whole trace.
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4:
        if isinstance(b, jax.Array):
            x, b = jax.lax.optimization_barrier((x, b))
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}"))
        return jax.lax.bitcast_convert_type(_row_at(bits, b), x.dtype)
    return jax.lax.dynamic_index_in_dim(x, b, keepdims=False, allow_negative_indices=False)


def propagate_df(p_seq: Array, df_seq: Array, num_state: int) -> Array:
    """``P_s df_s`` for every step of a window: ``(T, ..., S, S)`` times ``(T, ..., S)``."""
    return mix_states(p_seq, df_seq)


def hooked_matmul_solve_drtrl(
    signal: Array,
    trace: dict[str, Array],
    weights: dict[str, Array],
    *,
    weight_fn: WeightFn | None = None,
    bias_fn: WeightFn | None = None,
    **params: object,
) -> dict[str, Array]:
    """``∇W = f_W'(W)ᵀ (ε_W · g)``, ``∇b = f_b'(b)ᵀ (ε_b · g)`` for a trace in the hooked space.

    The D-RTRL solve of the matrix-product families (dense, grouped): the weight trace has one
    axis more than the signal, just before its output axis (``ε_W (..., I, O)`` against
    ``g (..., O)``; grouped ``(..., G, K, N)`` against ``(..., G, N)``); the bias trace has the
    signal's shape. Leading axes are summed before each hook's VJP.
    """
    g = jnp.expand_dims(signal, -2)
    out = {"weight": hook_pullback(weight_fn, weights["weight"], trace["weight"] * g)}
    if "bias" in trace:
        out["bias"] = hook_pullback(bias_fn, weights["bias"], trace["bias"] * signal)
    return out
