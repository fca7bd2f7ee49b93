"""The batch folds of ``braintrace._op._rule_helpers``: exact sums, a program independent of the batch."""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import pytest

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
