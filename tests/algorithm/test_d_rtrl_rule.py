"""D-RTRL's rule record (``braintrace.d_rtrl_rule``): the per-relation maths every per-parameter
trace learner rolls by.

Run alone on the contract's learner it gives D_RTRL's single-step gradients, which equal BPTT in
float64 where the recurrence is element-wise and do not where it mixes units (the negative
control: the record is D-RTRL's approximation, not an oracle). D_RTRL itself rolls through the
record: a record that rolls differently changes D_RTRL's gradients.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.param_trace.d_rtrl import ParamDimVjpAlgorithm
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, x64  # noqa: F401  (a fixture)
from tests.algorithm.test_trace_rule import Leaky

T, B, I, H = 5, 3, 4, 6
EXACT = 1e-10


def _compile(model: brainstate.nn.Module, algorithm: Any, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, normal(11, (T, B, I))[0], batch_size=B, **options)


def test_the_record_equals_bptt_where_d_rtrl_is_exact_and_equals_d_rtrl(x64: None) -> None:
    xs = normal(11, (T, B, I))
    got = single_step_grads(_compile(Leaky(), braintrace.d_rtrl_rule()), xs)
    ref = bptt_grads(Leaky(), xs, batch_size=B)
    assert set(got) == set(ref) and all(np.any(ref[p] != 0) for p in ref)
    assert max_rel_err(ref, got) < EXACT
    assert max_rel_err(single_step_grads(_compile(Leaky(), braintrace.D_RTRL), xs), got) < EXACT


@pytest.mark.parametrize("cell", ["GRUCell", "ValinaRNNCell"])
@pytest.mark.parametrize("fast_solve", [True, False])
def test_the_record_equals_d_rtrl_with_and_without_the_closed_form_kernels(cell: str, fast_solve: bool) -> None:
    """A GRU gates its update; a vanilla cell mixes its units."""
    xs = normal(11, (T, B, I))

    def model() -> brainstate.nn.Module:
        brainstate.random.seed(3)
        built: brainstate.nn.Module = getattr(braintrace.nn, cell)(I, H)
        return built

    want = single_step_grads(_compile(model(), braintrace.D_RTRL, fast_solve=fast_solve), xs)
    got = single_step_grads(_compile(model(), braintrace.d_rtrl_rule(fast_solve)), xs)
    assert set(got) == set(want) and all(np.any(want[p] != 0) for p in want)
    assert max_rel_err(want, got) < 1e-5


def test_where_the_recurrence_mixes_units_the_record_is_not_bptt(x64: None) -> None:
    xs = normal(11, (T, B, I))

    def model() -> brainstate.nn.Module:
        brainstate.random.seed(3)
        return braintrace.nn.ValinaRNNCell(I, H)

    got = single_step_grads(_compile(model(), braintrace.d_rtrl_rule()), xs)
    assert max_rel_err(bptt_grads(model(), xs, batch_size=B), got) > 1e-3


def test_d_rtrl_rolls_its_traces_through_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    xs = normal(11, (T, B, I))
    record = braintrace.d_rtrl_rule()
    assert _compile(Leaky(), braintrace.D_RTRL).relation_rule is record
    assert _compile(Leaky(), braintrace.D_RTRL, fast_solve=False).relation_rule is braintrace.d_rtrl_rule(False)
    want = single_step_grads(_compile(Leaky(), braintrace.D_RTRL), xs)

    forgetful = braintrace.TraceRule(record.init, lambda eps, step: record.roll(jax.tree.map(jnp.zeros_like, eps), step),
                                     record.solve)
    monkeypatch.setattr(ParamDimVjpAlgorithm, "relation_rule", property(lambda self: forgetful))
    got = single_step_grads(_compile(Leaky(), braintrace.D_RTRL), xs)
    assert max_rel_err(want, got) > 1e-3  # the traces lost their history: D_RTRL read the record


def test_the_record_refuses_what_it_cannot_roll_naming_the_fix() -> None:
    with pytest.raises(TypeError, match="fast_solve must be a bool"):
        braintrace.d_rtrl_rule("yes")  # type: ignore[arg-type]
    record = braintrace.d_rtrl_rule()
    step = braintrace.RelationStep(jnp.ones(3), jnp.ones((2, 1)), jnp.ones((2, 1, 1)), {"weight": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match="names no relation .* info=RelationInfo"):
        record.roll({"weight": jnp.zeros((3, 2, 1))}, step)
    info = braintrace.RelationInfo(None, jax.ShapeDtypeStruct((2,), jnp.float32), {}, 1, "etp_mv", {})
    with pytest.raises(ValueError, match="does not give its primitive .* pass etp="):
        record.init(info)


def test_where_a_group_reads_its_own_new_state_the_record_is_not_d_rtrl() -> None:
    """An LSTM's ``h`` reads the ``c`` of the same step: D_RTRL meets the signal with other
    Jacobians than the step's ``D`` there, as the record's docstring says."""
    xs = normal(11, (T, B, I))

    def model() -> brainstate.nn.Module:
        brainstate.random.seed(3)
        return braintrace.nn.LSTMCell(I, H)

    learner = _compile(model(), braintrace.D_RTRL)
    assert any(group.reads_new_members() for group in learner.graph.hidden_groups)
    got = single_step_grads(_compile(model(), braintrace.d_rtrl_rule()), xs)
    assert max_rel_err(single_step_grads(learner, xs), got) > 1e-3
