"""The batch folds of ``braintrace._op._rule_helpers``: exact sums, a program independent of the batch."""

from __future__ import annotations

import functools
import operator
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from braintrace._op import _rule_helpers
from braintrace._op._rule_helpers import ROWS_PER_ITERATION, sum_leading, sum_over_rows, sum_rows
from tests.op.opcase import close, rand

# Around the rows one loop iteration adds: no row, one, part of a block, blocks and a remainder.
batches = pytest.mark.parametrize("batch", [0, 1, 2, 7, ROWS_PER_ITERATION, 2 * ROWS_PER_ITERATION + 3])


def _dot_row(signal: jax.Array, trace: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: signal * v for k, v in trace.items()}


@batches
def test_sum_leading_is_the_sum_over_the_leading_axes(batch: int) -> None:
    x = rand(1, (batch, 3, 4, 5))
    close(sum_leading(x, 2), x.sum(axis=(0, 1)), atol=1e-5)
    close(jax.jit(lambda v: sum_leading(v, 1))(x), x.sum(axis=0), atol=1e-5)


@batches
def test_sum_rows_adds_the_contraction_of_every_row(batch: int) -> None:
    signal, trace = rand(2, (batch, 4)), {"w": rand(3, (batch, 3, 4)), "b": rand(4, (batch, 4))}
    got = jax.jit(lambda s, t: sum_rows(_dot_row, s, t))(signal, trace)
    close(got["w"], jnp.einsum("bo,bio->io", signal, trace["w"]), atol=1e-5)
    close(got["b"], (signal * trace["b"]).sum(axis=0), atol=1e-5)


@batches
def test_rows_are_added_in_order(batch: int) -> None:
    """The sum is bit for bit ``((x[0] + x[1]) + x[2]) + …``, the order of a per-row sum."""
    x = rand(6, (batch, 5)) * jnp.logspace(-6, 6, 5)
    in_order = functools.reduce(operator.add, list(x), jnp.zeros(5))
    assert bool((jax.jit(sum_leading)(x) == in_order).all())


def _program_size(fn: Any, *args: Any) -> int:
    return len(jax.jit(fn).lower(*args).as_text().splitlines())


def _fold_programs(batch: int) -> tuple[int, int]:
    signal, trace = rand(2, (batch, 4)), {"w": rand(3, (batch, 3, 4))}
    rows = _program_size(lambda s, t: sum_rows(_dot_row, s, t), signal, trace)
    return rows, _program_size(sum_leading, rand(1, (batch, 3)))


def test_fold_program_does_not_grow_with_the_rows() -> None:
    # Whole blocks run in a loop; the rows past the last whole block (fewer than a block) are
    # added after it, so the program depends on the batch only through ``batch % block``.
    block = ROWS_PER_ITERATION
    assert _fold_programs(2 * block) == _fold_programs(4 * block) == _fold_programs(16 * block)
    assert _fold_programs(2 * block + 3) == _fold_programs(9 * block + 3)


def test_sum_over_rows_loops_on_cpu_and_is_vectorised_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two forms are given different sums here (twice and thrice the rows) to tell which ran."""
    def fold(r: jax.Array) -> jax.Array:
        return sum_over_rows(lambda row: row * 2.0, r, lambda: r.sum(axis=0) * 3.0)

    rows = rand(5, (ROWS_PER_ITERATION + 6, 3))
    close(jax.jit(fold)(rows), rows.sum(axis=0) * 2.0, atol=1e-5)
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *ops, cpu, default: default(*ops))
    close(jax.jit(lambda r: fold(r))(rows), rows.sum(axis=0) * 3.0, atol=1e-5)  # traced anew


def _roundings_of_16_bit_rows(batch: int) -> int:
    """The roundings to bfloat16 in the program adding the rows of a bfloat16 trace in float32."""
    def fold(signal: jax.Array, trace: jax.Array) -> jax.Array:
        return sum_over_rows(lambda row: row[0] * row[1].astype(jnp.float32), (signal, trace),
                             lambda: jnp.einsum("bo,bio->io", signal, trace.astype(jnp.float32)))

    args = rand(2, (batch, 4)), rand(3, (batch, 3, 4)).astype(jnp.bfloat16)
    close(jax.jit(fold)(*args), jnp.einsum("bo,bio->io", args[0], args[1].astype(jnp.float32)), atol=1e-5)
    return len(re.findall(r"= bf16\[(?:1,)?3,4\]\S* convert\(", jax.jit(fold).lower(*args).compile().as_text()))


def test_rows_of_a_16_bit_array_are_sliced_without_rounding() -> None:
    """Whole blocks and the rows past them are sliced as 16-bit integers and widened once.
    Negative control: slicing the floats, which XLA on CPU does in float32 and rounds back."""
    batch = 2 * ROWS_PER_ITERATION + 3
    assert _roundings_of_16_bit_rows(batch) == 0


def test_slicing_16_bit_floats_rounds_each_row_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rule_helpers, "_row_at", lambda x, b: jax.lax.dynamic_index_in_dim(x, b, keepdims=False))
    assert _roundings_of_16_bit_rows(2 * ROWS_PER_ITERATION + 3) > 0
