"""Every failure the fuzzer found, as an explicit model, each judged by the oracle as in the fuzzer.

* A batched group whose drive has an axis of one behind the batch (``grouped_matmul`` over
  ``(B, 1, K)``, ``conv`` over ``(B, 1, W)``, reshaped into ``(B, N)``): D_RTRL's instantaneous
  rule received ``df`` in the hidden layout instead of ``y``'s (an ``IndexError`` in the grouped
  rule, a custom-VJP shape mismatch, a reshape error in the conv rule). Fixed in
  ``HiddenParamOpRelation.adds_unit_axes``: unit axes behind the batch are re-laid like leading ones.
* A ``while_loop`` settling a hidden state under ``vjp_method='multi-step'``: the window's VJP
  reached JAX's "Reverse-mode differentiation does not work for lax.while_loop". Now refused at
  compile time with a ``NotSupportedError`` naming the loop and the fix.
"""

from __future__ import annotations

import warnings

import brainstate
import jax.numpy as jnp
import pytest

import braintrace
from tests.fuzz.grammar import FuzzCase, GroupSpec, ModelSpec, OpSpec
from tests.fuzz.models import FuzzModel
from tests.fuzz.oracle import float64, run_case

UNIT_AXIS_BEHIND_BATCH = [
    pytest.param(FuzzCase(ModelSpec((GroupSpec(width=3, drive=OpSpec("grouped", 3, 3, size=1)),), batch=2), "d_rtrl"),
                 id="grouped-d_rtrl"),
    pytest.param(FuzzCase(ModelSpec((GroupSpec(width=3, drive=OpSpec("conv", 3, 3, size=1)),), batch=2),
                          "d_rtrl_window"), id="conv-window"),
]


@pytest.mark.parametrize("case", UNIT_AXIS_BEHIND_BATCH)
def test_a_unit_axis_behind_the_batch_runs(case: FuzzCase) -> None:
    outcome = run_case(case)
    assert (outcome.status, outcome.problems) == ("approximate", []), outcome.detail


def test_a_while_loop_under_multi_step_windows_is_refused_by_name() -> None:
    spec = ModelSpec((GroupSpec(width=3, drive=OpSpec("matmul", 3, 3), control="while"),))
    outcome = run_case(FuzzCase(spec, "d_rtrl_window"))
    assert (outcome.status, outcome.problems) == ("refused", []), outcome.detail
    with float64(), warnings.catch_warnings(), pytest.raises(
            braintrace.NotSupportedError, match="multi-step.*while_loop.*single-step"):
        warnings.simplefilter("ignore", UserWarning)  # the plain readout, reported as not online
        brainstate.random.seed(0)
        braintrace.compile(FuzzModel(spec), "d_rtrl", jnp.ones(3), vjp_method="multi-step")
