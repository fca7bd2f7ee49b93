"""One pass over a dense weight's trace: roll it and contract the gradient from it (a Pallas kernel on TPU).

A single-step D-RTRL step of a batched ``matmul`` whose hidden group has one state reads the
trace ``ε (B, I, O)`` twice: the roll ``ε ← d ε + x ⊗ df`` reads and writes it, and the
gradient's history term ``Σ_b q[b, o] ε[b, i, o]`` (``q = Dᵀ g``) reads it once more. Where the
gradient is taken in the same program as the roll (the learners' own drivers, see
``ParamDimVjpAlgorithm``) both can be done in one pass: :func:`roll_and_contract` reads each
block of ``ε`` once, writes its roll in place and adds its contraction to the gradient. On a TPU
it is a Pallas kernel; elsewhere (and as its reference) the same maths in XLA. A trace with a
low-pass filter ``ē ← κ ē + ε`` (EProp's ``kappa_filter_decay``) has both rolled and contracted
in one pass over each by :func:`roll_filter_and_contract`.

On one TPU v5e chip, the LIF-1024 trace (B = 32, I = 1040, O = 1024) over 100 steps: 46 ms
(592 GB/s over the two passes) with the kernel, 63 ms (431 GB/s) for XLA's fusion of the same
scan (``benchmarks/README.md``, "On a TPU").

Examples
--------
>>> import jax.numpy as jnp
>>> trace, d = jnp.ones((2, 3, 4)), jnp.full((2, 4), 0.5)
>>> x, df, q = jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((2, 4))
>>> new, grad = roll_and_contract(trace, d, x, df, q)
>>> float(new[0, 0, 0]), float(grad[0, 0])
(1.5, 2.0)
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "roll_and_contract", "roll_and_contract_xla", "roll_and_contract_pallas",
    "roll_filter_and_contract", "roll_filter_and_contract_xla", "roll_filter_and_contract_pallas",
]

#: The widest block of the output axis the kernel takes (lanes of 128 on a TPU).
_MAX_OUT_BLOCK = 512
#: The bytes of one trace block the kernel holds (each is double-buffered in and out).
_BLOCK_BYTES = 1 << 20


def roll_and_contract(
    trace: jax.Array, diag: jax.Array, x: jax.Array, df: jax.Array, signal: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(d ε + x ⊗ df, Σ_b signal ⊙ ε)`` in one pass over ``ε`` on a TPU (XLA elsewhere).

    Parameters
    ----------
    trace : jax.Array
        ``ε``, ``(B, I, O)`` float32.
    diag, df, signal : jax.Array
        ``(B, O)``: the roll's per-output factor ``d``, the instantaneous term's ``df`` and the
        signal ``q`` the entering trace is contracted with.
    x : jax.Array
        ``(B, I)``, the operation's input.

    Returns
    -------
    tuple
        The rolled trace ``ε'[b, i, o] = d[b, o] ε[b, i, o] + x[b, i] df[b, o]`` and the
        contraction ``G[i, o] = Σ_b signal[b, o] ε[b, i, o]`` of the entering trace.
    """
    if jax.devices()[0].platform == "tpu":
        return roll_and_contract_pallas(trace, diag, x, df, signal)
    return roll_and_contract_xla(trace, diag, x, df, signal)


def roll_and_contract_xla(
    trace: jax.Array, diag: jax.Array, x: jax.Array, df: jax.Array, signal: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """:func:`roll_and_contract` as XLA operations (the reference of the kernel)."""
    new = diag[:, None, :] * trace + x[:, :, None] * df[:, None, :]
    return new, jnp.sum(trace * signal[:, None, :], axis=0)


def roll_and_contract_pallas(
    trace: jax.Array, diag: jax.Array, x: jax.Array, df: jax.Array, signal: jax.Array, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """:func:`roll_and_contract` as one Pallas kernel (``interpret=True``: Pallas's interpreter, any platform).

    The grid runs over blocks ``(i, o)`` of the trace and, innermost, over the batch rows: each
    block of ``ε`` is read once and its roll written over it (the trace's buffer is aliased to
    the output), while the block's gradient stays in on-chip memory across the rows.
    """
    new, grad = _pallas_roll(_kernel, (trace,), x, (diag, df, signal), interpret)
    return new, grad


def roll_filter_and_contract(
    trace: jax.Array, filt: jax.Array, diag: jax.Array, x: jax.Array, df: jax.Array,
    signal: jax.Array, filt_signal: jax.Array, kappa: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A trace, its low-pass filter and the gradient's contraction of both, in one pass over each.

    Parameters
    ----------
    trace, filt : jax.Array
        ``ε`` and its filter ``ē``, ``(B, I, O)`` float32.
    diag, df, signal, filt_signal : jax.Array
        ``(B, O)``: the roll's factor ``d``, the instantaneous term's ``df``, and the signals
        ``q`` and ``r`` the entering ``ε`` and ``ē`` are contracted with.
    x : jax.Array
        ``(B, I)``, the operation's input.
    kappa : float
        The filter's decay ``κ``.

    Returns
    -------
    tuple
        ``ε' = d ε + x ⊗ df``, ``ē' = κ ē + ε'`` and ``G[i, o] = Σ_b q[b, o] ε[b, i, o] +
        r[b, o] ē[b, i, o]`` (of the entering trace and filter).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> trace, filt, d = jnp.ones((2, 3, 4)), jnp.ones((2, 3, 4)), jnp.full((2, 4), 0.5)
    >>> x, df, q, r = jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((2, 4)), jnp.ones((2, 4))
    >>> new, new_filt, grad = roll_filter_and_contract(trace, filt, d, x, df, q, r, 0.5)
    >>> float(new[0, 0, 0]), float(new_filt[0, 0, 0]), float(grad[0, 0])
    (1.5, 2.0, 4.0)
    """
    if jax.devices()[0].platform == "tpu":
        return roll_filter_and_contract_pallas(trace, filt, diag, x, df, signal, filt_signal, kappa)
    return roll_filter_and_contract_xla(trace, filt, diag, x, df, signal, filt_signal, kappa)


def roll_filter_and_contract_xla(
    trace: jax.Array, filt: jax.Array, diag: jax.Array, x: jax.Array, df: jax.Array,
    signal: jax.Array, filt_signal: jax.Array, kappa: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`roll_filter_and_contract` as XLA operations (the reference of the kernel)."""
    new, grad = roll_and_contract_xla(trace, diag, x, df, signal)
    return new, kappa * filt + new, grad + jnp.sum(filt * filt_signal[:, None, :], axis=0)


def roll_filter_and_contract_pallas(
    trace: jax.Array, filt: jax.Array, diag: jax.Array, x: jax.Array, df: jax.Array,
    signal: jax.Array, filt_signal: jax.Array, kappa: float, *, interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`roll_filter_and_contract` as one Pallas kernel, blocked as :func:`roll_and_contract_pallas`
    (both buffers aliased to their outputs)."""
    new, new_filt, grad = _pallas_roll(
        functools.partial(_filter_kernel, kappa), (trace, filt), x, (diag, df, signal, filt_signal), interpret)
    return new, new_filt, grad


def _pallas_roll(
    kernel: Callable[..., None], traces: tuple[jax.Array, ...], x: jax.Array, rows: tuple[jax.Array, ...],
    interpret: bool,
) -> list[jax.Array]:
    """Run ``kernel(*traces, x, *rows, *new_traces, grad)`` over blocks of the ``(B, I, O)`` traces.

    Each trace's buffer is aliased to its new value; ``x`` ``(B, I)`` comes in column blocks and
    every ``(B, O)`` row in row blocks; the gradient ``(I, O)`` block stays on chip across the
    batch, the innermost axis of the grid.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    batch, n_in, n_out = traces[0].shape
    out_block = _block(n_out, 128, _MAX_OUT_BLOCK)
    in_block = _block(n_in, 8, max(8, _BLOCK_BYTES // (traces[0].dtype.itemsize * out_block)))
    row = pl.BlockSpec((None, 1, out_block), lambda i, o, b: (b, 0, o))
    block = pl.BlockSpec((None, in_block, out_block), lambda i, o, b: (b, i, o))
    column = pl.BlockSpec((None, in_block, 1), lambda i, o, b: (b, i, 0))
    n = len(traces)
    return pl.pallas_call(
        kernel,
        grid=(n_in // in_block, n_out // out_block, batch),
        in_specs=[*[block] * n, column, *[row] * len(rows)],
        out_specs=[*[block] * n, pl.BlockSpec((in_block, out_block), lambda i, o, b: (i, o))],
        out_shape=[*(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in traces),
                   jax.ShapeDtypeStruct((n_in, n_out), traces[0].dtype)],
        input_output_aliases={i: i for i in range(n)},
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(*traces, x[:, :, None], *(r[:, None, :] for r in rows))


def _zero_at_first_row(grad_ref) -> None:  # type: ignore[no-untyped-def]
    """Start the gradient block at zero on the first batch row of each trace block."""
    from jax.experimental import pallas as pl

    @pl.when(pl.program_id(2) == 0)
    def _() -> None:
        grad_ref[...] = jnp.zeros_like(grad_ref)


def _kernel(trace_ref, x_ref, diag_ref, df_ref, signal_ref, new_ref, grad_ref):  # type: ignore[no-untyped-def]
    """One block of one batch row: add its contraction to the gradient block, write its roll."""
    _zero_at_first_row(grad_ref)
    old = trace_ref[...]
    grad_ref[...] += old * signal_ref[...]
    new_ref[...] = diag_ref[...] * old + x_ref[...] * df_ref[...]


def _filter_kernel(  # type: ignore[no-untyped-def]
    kappa, trace_ref, filt_ref, x_ref, diag_ref, df_ref, signal_ref, filt_signal_ref, new_ref, new_filt_ref, grad_ref,
):
    """:func:`_kernel` for a trace and its filter ``ē ← κ ē + ε'``, contracted with a signal each."""
    _zero_at_first_row(grad_ref)
    old, old_filt = trace_ref[...], filt_ref[...]
    grad_ref[...] += old * signal_ref[...] + old_filt * filt_signal_ref[...]
    new = diag_ref[...] * old + x_ref[...] * df_ref[...]
    new_ref[...] = new
    new_filt_ref[...] = kappa * old_filt + new


def _block(size: int, unit: int, cap: int) -> int:
    """The largest multiple of ``unit`` up to ``cap`` that divides ``size`` (``size`` itself
    when ``unit`` does not divide it: a block may always span a whole axis)."""
    if size % unit:
        return size
    block = max(unit, min(size, cap) // unit * unit)
    while size % block:
        block -= unit
    return block
