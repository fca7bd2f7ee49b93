"""The compiled gradient step of a batched learner is the same program at every batch size.

The batch is handled by array operations and loops, never by unrolling it in Python: the
lowered step (StableHLO) of a learner trained on 16 samples has the same operations, in the same
numbers, as the step trained on 32, and so do 18 and 34 (the CPU row loop adds whole blocks of
``ROWS_PER_ITERATION`` rows, the few rows past the last block after it). An unrolled batch shows
up as a handful of slices, reshapes and adds per sample, and as XLA compile times that grow with
the batch.
"""

from __future__ import annotations

import collections
import re
import warnings
from typing import Any, Callable

import brainstate
import jax.numpy as jnp
import pytest

import braintrace
from braintrace._op._rule_helpers import ROWS_PER_ITERATION

NUM = 16
CELLS: dict[str, Callable[[], brainstate.nn.Module]] = {
    "rnn": lambda: braintrace.nn.ValinaRNNCell(NUM, NUM),
    "gru": lambda: braintrace.nn.GRUCell(NUM, NUM),
}
OPTIONS: dict[str, dict[str, Any]] = {"d_rtrl": {}, "pp_prop": {"decay_or_rank": 0.9}}


def _lowered_step_ops(algorithm: str, cell: str, batch: int, vjp_method: str) -> collections.Counter[str]:
    """How many of each StableHLO operation the jitted gradient step of one call lowers to."""
    brainstate.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(CELLS[cell](), algorithm, jnp.ones((batch, NUM)), batch_size=batch,
                                     vjp_method=vjp_method, **OPTIONS[algorithm])
    window = vjp_method == "multi-step"

    def loss(x: Any) -> Any:
        return learner(braintrace.MultiStepData(x) if window else x).sum()

    step = brainstate.transform.jit(lambda x: brainstate.transform.grad(loss, learner.param_states)(x))
    x = jnp.ones((3, batch, NUM) if window else (batch, NUM))
    return collections.Counter(re.findall(r"stablehlo\.(\w+)", step.lower(x).as_text()))


@pytest.mark.parametrize("vjp_method", ["single-step", "multi-step"])
@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("algorithm", sorted(OPTIONS))
def test_gradient_step_does_not_grow_with_the_batch(algorithm: str, cell: str, vjp_method: str) -> None:
    block = ROWS_PER_ITERATION
    for batches in ((2 * block, 4 * block), (2 * block + 2, 4 * block + 2)):
        small, large = (_lowered_step_ops(algorithm, cell, b, vjp_method) for b in batches)
        grown = {op: (small[op], large[op]) for op in small.keys() | large.keys() if small[op] != large[op]}
        assert not grown, f"operations whose count depends on the batch {batches}: {grown}"
