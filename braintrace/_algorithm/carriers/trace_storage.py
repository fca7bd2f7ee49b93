"""Reduced-precision trace storage: the ``trace_dtype`` option of D_RTRL and pp_prop.

A learner given ``trace_dtype`` (e.g. ``jnp.bfloat16``) keeps its traces in that dtype between
steps and does every piece of arithmetic in the math dtype (that of the parameters and the
Jacobians, float32 in the usual case). A step reads the stored trace once, upcasts it, applies
the roll ``ε ← D ε + x ⊗ df`` in the math dtype and rounds the result once, to nearest, on
write; the gradient reads the stored trace and upcasts it inside the contraction. The saving
is memory and memory traffic (half the bytes of a float32 trace), never the precision of the
arithmetic: no product or sum is formed in ``bfloat16``.

The stored trace carries one rounding to nearest per step (per group of calls where a TPU's
drivers roll it over groups: :mod:`~braintrace._algorithm.carriers.backward_roll`), which the
roll then damps by ``D``.
How much of it reaches the gradient depends on how slowly the trace decays. Measured (cosine of
the bfloat16-trace gradient to the float32-trace one, summed over 1000 single steps): 0.999995
on the benchmark's LIF network with 1024 neurons (leak 0.88, reset on spikes), 0.9999 on a
leaky layer with leaks up to 0.95, but 0.9975 to 0.9997 (depending on the input stream) with
leaks up to 0.99: as the decay per step ``1 − a`` nears bfloat16's half unit in the last place
(``2^-9``), the roundings of successive steps add up instead of cancelling. For such slow
leaks use ``jnp.float16`` (three more mantissa bits, 0.99998 there; its range ends at 65504) or
float32. Stochastic rounding does not help: its noise accumulates over the trace's memory
(measured 0.969 where rounding to nearest gave 0.993).
``tests/algorithm/test_trace_dtype.py`` pins these regimes and ``benchmarks/half_precision.py``
measures the LIF network.

Examples
--------
>>> import jax.numpy as jnp
>>> storage_dtype(jnp.bfloat16, 'D_RTRL')
dtype(bfloat16)
>>> storage_dtype(None, 'D_RTRL') is None
True
>>> trace = {'weight': jnp.ones(3, jnp.bfloat16)}
>>> math = upcast(trace, jnp.float32)
>>> math['weight'].dtype, store({'weight': 0.5 * math['weight']}, trace)['weight'].dtype
(dtype('float32'), dtype(bfloat16))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._op._rule_helpers import materialised

__all__ = ["storage_dtype", "upcast", "store", "rounded", "math_dtype", "computed_once", "fresh_zeros"]

Trace = dict[str, jax.Array]


def storage_dtype(value: jax.typing.DTypeLike | None, learner: str) -> np.dtype | None:
    """``value`` (``trace_dtype=``) as a floating dtype, or ``None`` for native storage.

    Raises
    ------
    ValueError
        For anything that is not ``None`` or a floating dtype of 16 bits or more (``'int8'``,
        ``jnp.int32``, ``jnp.float8_e5m2``, ``'half-ish'``), naming the value and the accepted ones.

    Examples
    --------
    >>> storage_dtype('float16', 'pp_prop')
    dtype('float16')
    >>> storage_dtype('int8', 'pp_prop')
    Traceback (most recent call last):
    ...
    ValueError: pp_prop: trace_dtype must be a floating dtype (e.g. jnp.bfloat16, jnp.float16,
    jnp.float32) or None for the parameters' dtype, got 'int8' (int8). Pass
    trace_dtype=jnp.bfloat16 to halve the trace's memory.
    """
    if value is None:
        return None
    hint = (f"{learner}: trace_dtype must be a floating dtype (e.g. jnp.bfloat16, jnp.float16, "
            f"jnp.float32) or None for the parameters' dtype, got {value!r}")
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise ValueError(f"{hint}, which is not a dtype. Pass trace_dtype=jnp.bfloat16 to halve the "
                         f"trace's memory.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{hint} ({dtype}). Pass trace_dtype=jnp.bfloat16 to halve the trace's memory.")
    if dtype.itemsize < 2:
        raise ValueError(f"{hint}, an 8-bit float: its 2 or 3 mantissa bits round a trace's small "
                         f"increments away. Pass trace_dtype=jnp.bfloat16 (or jnp.float16).")
    return np.dtype(dtype)


def math_dtype(*arrays: jax.typing.ArrayLike | jax.typing.DTypeLike) -> np.dtype:
    """The dtype the roll is computed in: the promotion of the step's operands (never narrower
    than float32 for float32 parameters), whatever the storage."""
    return jnp.result_type(*arrays)


def upcast(trace: Trace, dtype: jax.typing.DTypeLike) -> Trace:
    """Every leaf of a stored trace in the math ``dtype`` (a no-op for leaves already in it)."""
    return {k: v.astype(dtype) for k, v in trace.items()}


def store(new: Trace, like: Trace) -> Trace:
    """``new`` (computed in the math dtype) rounded to the storage dtype of ``like``, per leaf."""
    return {k: rounded(new[k], like[k].dtype) for k in like}


def rounded(value: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
    """``value`` rounded to nearest, ties to even, in ``dtype``: ``value.astype(dtype)``, but for
    float32 to bfloat16 on CPU, where it is the faster split :func:`_split_to_bfloat16` (the same
    bits for every finite value below 5.2e33 in magnitude; NaN beyond).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> rounded(jnp.array([1.00390625, 1.01171875, -3.0]), jnp.bfloat16)  # two ties, to even
    Array([1, 1.01562, -3], dtype=bfloat16)
    """
    dtype = jnp.dtype(dtype)
    if value.dtype != jnp.float32 or dtype != jnp.bfloat16:
        return value.astype(dtype)
    return jax.lax.platform_dependent(value, cpu=_split_to_bfloat16, default=lambda v: v.astype(dtype))


def _split_to_bfloat16(value: jax.Array) -> jax.Array:
    """Float32 ``value`` rounded to bfloat16 with three float32 operations and a shift.

    Veltkamp's split: ``c = 65537 · v`` and ``h = c − (c − v)`` is ``v`` rounded to nearest to
    the 8 significant bits of a bfloat16 (ties to even; checked against ``astype`` over every
    float32), so dropping the low 16 bits of ``h`` is exact. XLA's ``astype`` rounds with integer
    operations and a select for NaN, and a CPU without AVX-512 BF16 spends more time on those
    than on moving the bytes: the split takes a ``(32, 1040, 1024)`` trace update from 0.69–0.74
    to 0.60–0.64 of the float32 update's time, and the whole LIF-1024 D_RTRL step from
    0.615–0.645 to 0.599–0.606 of the float32 step's.

    Two differences from ``astype``, both in what is no longer a usable trace: a value whose
    ``65537 · v`` overflows (``|v| ≥ 5.2e33``), an infinity or a NaN becomes NaN (never a finite
    number), and a subnormal becomes a signed zero (as XLA's CPU arithmetic already flushes them).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> _split_to_bfloat16(jnp.array([0.1, -2.5e-3, 1e34, jnp.inf], jnp.float32))
    Array([0.100098, -0.00250244, nan, nan], dtype=bfloat16)
    """
    scaled = value * jnp.float32(65537.0)
    high = scaled - (scaled - value)
    bits = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(high, jnp.uint32), jnp.uint32(16))
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def computed_once(factor: jax.Array, trace: Trace) -> jax.Array:
    """``factor`` (the step's ``D``), computed once before the update of a trace stored in 16 bits.

    XLA fuses the element-wise operations that compute ``D`` into the trace-sized update that
    broadcasts it, recomputing them for every entry along the broadcast axes. A float32 update is
    bound by memory and hides that arithmetic; a 16-bit one moves half the bytes and is then bound
    by it (on CPU, 8.7–9.6 ms against 5.2–5.4 ms for a ``(32, 1040, 1024)`` update with ``D``
    computed once). :func:`~braintrace._op._rule_helpers.materialised` computes it once (on CPU),
    for 16-bit traces only; otherwise ``factor`` is returned as it is.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> d = jnp.array([0.5, -2.0, jnp.inf])
    >>> computed_once(d, {'w': jnp.zeros(3, jnp.bfloat16)})
    Array([ 0.5, -2. ,  inf], dtype=float32)
    """
    if all(jnp.dtype(v.dtype).itemsize >= 4 for v in trace.values()):
        return factor
    return materialised(factor)


def fresh_zeros(shape: tuple[int, ...], dtype: jax.typing.DTypeLike) -> jax.Array:
    """Zeros of ``shape`` for a reset trace, written as a buffer of their own off the CPU.

    A reset inside ``jit`` followed by a time loop hands XLA a loop whose carry starts as a
    constant. On a TPU, XLA then moves the constant into the loop's first step, and the carry
    gets a layout of XLA's choosing rather than one its uses ask for. An ``optimization_barrier``
    keeps the zeros a computed buffer: on a TPU v5e (batch 32, T = 100) the LIF-1024 D_RTRL
    training step took 60 ms with it and 100 ms without, and 130 MiB less temporary memory. On
    CPU the zeros are returned as they are.

    Examples
    --------
    >>> fresh_zeros((2, 3, 1), jnp.float32).shape
    (2, 3, 1)
    """
    zeros = jnp.zeros(shape, dtype)
    return jax.lax.platform_dependent(zeros, cpu=lambda z: z, default=jax.lax.optimization_barrier)
