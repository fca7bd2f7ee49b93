"""Outputs that read a hidden state's previous value past its update: exact single-step D_RTRL.

The single-step history term is ``⟨∂L/∂h^{t-1}, ε^{t-1}⟩``. When every output reads
``h^{t-1}`` through the new value ``h^t``, ``∂L/∂h^{t-1} = Dᵀ ∂L/∂h^t``; when an output reads
it past the update — a spike of the pre-reset potential, a value returned before it is scaled
into the state, a component returned before it is stacked into a ``HiddenGroupState`` — the
compiler marks the group and the learner takes ``∂L/∂h^{t-1}`` through every path of the step.
Each case here is a diagonal recurrence, so D_RTRL must equal BPTT (float64, relative 1e-10).
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import pytest

import braintrace
from braintrace._compiler import groups_read_past_update
from tests.algorithm.bptt import bptt_grads, cosine, max_rel_err, normal, single_step_grads, x64

__all__ = ["x64"]  # the fixture is used by name

T, B, I, O = 5, 2, 3, 4
EXACT = 1e-10


class Leaky(brainstate.nn.Module):
    """``pre = σ(τ) h + x W``; the stored value and the output depend on ``mode``."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.w = brainstate.ParamState(normal(1, (I, O), 0.7))
        self.tau = brainstate.ParamState(normal(2, (O,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, O)))

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        pre = leak * self.h.value + braintrace.matmul(x, self.w.value)
        if self.mode == "new":  # the output reads the stored value
            self.h.value = pre
            return jnp.tanh(self.h.value)
        if self.mode == "scaled":  # stored 0.5·pre, output from pre
            self.h.value = 0.5 * pre
            return jnp.tanh(pre)
        if self.mode == "old":  # the output reads h^{t-1} directly
            out = jnp.tanh(self.h.value)
            self.h.value = pre
            return out + 0.0 * pre
        spike = jax.nn.sigmoid(4.0 * (pre - 0.5))  # "spike": soft reset, spike of the pre-reset value
        self.h.value = pre * (1.0 - spike)
        return spike


class StackedAdaptive(brainstate.nn.Module):
    """A two-component ``HiddenGroupState`` whose output is the component before the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(3, (I, O), 0.5))
        self.tau = brainstate.ParamState(normal(4, (O,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.s = brainstate.HiddenGroupState(jnp.zeros((batch_size, O, 2)))

    def update(self, x: Any) -> Any:
        v, a = self.s.value[..., 0], self.s.value[..., 1]
        alpha = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        v_new = alpha * v + jnp.tanh(braintrace.matmul(x, self.w.value)) - 0.3 * a
        a_new = 0.8 * a + 0.5 * jnp.tanh(v)
        self.s.value = jnp.stack([v_new, a_new], axis=-1)
        return v_new


def _learner(model: brainstate.nn.Module, x0: Any, algorithm: Any = braintrace.D_RTRL, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, x0, batch_size=B, **options)


@pytest.mark.parametrize("mode", ["scaled", "old", "spike"])
def test_outputs_read_past_the_update_single_step_equals_bptt(x64: None, mode: str) -> None:
    xs = normal(5, (T, B, I))
    ref = bptt_grads(Leaky(mode), xs, batch_size=B)
    learner = _learner(Leaky(mode), xs[0])
    assert learner._groups_read_past_update() == frozenset({0})
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


def test_hidden_group_state_output_before_the_stack_equals_bptt(x64: None) -> None:
    xs = normal(6, (T, B, I))
    ref = bptt_grads(StackedAdaptive(), xs, batch_size=B)
    learner = _learner(StackedAdaptive(), xs[0])
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


def test_reading_the_new_value_is_not_marked(x64: None) -> None:
    xs = normal(7, (T, B, I))
    learner = _learner(Leaky("new"), xs[0])
    assert learner._groups_read_past_update() == frozenset()
    assert max_rel_err(bptt_grads(Leaky("new"), xs, batch_size=B), single_step_grads(learner, xs)) < EXACT


@pytest.mark.parametrize("mode", ["new", "scaled", "old", "spike"])
def test_the_report_says_which_groups_outputs_read_past_their_update(mode: str) -> None:
    report = _learner(Leaky(mode), jnp.zeros((B, I))).report
    if mode == "new":
        assert report.read_past_update == []
        assert "other than through their new values" not in report.to_str()
        return
    assert report.read_past_update == [(0, [("h",)])]
    (record,) = [r for r in report.diagnostics if r.kind is braintrace.DiagnosticKind.OUTPUT_READS_PAST_UPDATE]
    assert record.level is braintrace.DiagnosticLevel.INFO and "dL/dh^(t-1) through every path" in record.message
    assert "Group 0: [('h',)]" in report.to_str().split("other than through their new values")[1]


def test_analysis_marks_only_the_group_read_past_its_update() -> None:
    class TwoLayers(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = brainstate.ParamState(jnp.ones((I, O)))
            self.w2 = brainstate.ParamState(jnp.ones((O, 2)))

        def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
            self.h1 = brainstate.HiddenState(jnp.zeros((batch_size, O)))
            self.h2 = brainstate.HiddenState(jnp.zeros((batch_size, 2)))

        def update(self, x: Any) -> Any:
            old1 = self.h1.value
            self.h1.value = 0.9 * self.h1.value + braintrace.matmul(x, self.w1.value)
            # Layer 2 is driven by layer 1's previous value: a read past h1's update.
            self.h2.value = 0.5 * self.h2.value + braintrace.matmul(old1, self.w2.value)
            return self.h2.value

    learner = _learner(TwoLayers(), jnp.zeros((B, I)))
    graph = learner.graph
    marked = groups_read_past_update(graph.hidden_perturb, graph.hidden_groups, graph.module_info)
    groups = {g.index: g.hidden_paths for g in graph.hidden_groups}
    assert [groups[i] for i in marked] == [[("h1",)]]


def test_eprop_without_filter_follows_d_rtrl_on_a_read_past_the_update(x64: None) -> None:
    xs = normal(8, (T, B, I))
    ref = bptt_grads(Leaky("spike"), xs, batch_size=B)
    learner = _learner(Leaky("spike"), xs[0], braintrace.EProp, kappa_filter_decay=0.0)
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


@pytest.mark.parametrize("mode", ["scaled", "spike"])
def test_pp_prop_takes_the_history_of_a_read_past_the_update_from_its_entering_traces(
    x64: None, mode: str
) -> None:
    # pp_prop is approximate; with a read past the update its history term comes from
    # ⟨∂L/∂h^{t-1}, x̄^{t-1} ⊗ df̄^{t-1}⟩. Measured cosines with BPTT (T=8): 0.9955 / 0.9962,
    # against 0.9877 / 0.9745 for the sum of one-step gradients (no history at all).
    xs = normal(5, (8, B, I))
    ref = bptt_grads(Leaky(mode), xs, batch_size=B)
    no_history = bptt_grads(Leaky(mode), xs, batch_size=B, truncated=True)
    learner = _learner(Leaky(mode), xs[0], braintrace.pp_prop, decay_or_rank=0.9)
    online = single_step_grads(learner, xs)
    assert cosine(ref, online) > max(0.99, cosine(ref, no_history))
    first = single_step_grads(_learner(Leaky(mode), xs[0], braintrace.pp_prop, decay_or_rank=0.9), xs[:1])
    assert max_rel_err(bptt_grads(Leaky(mode), xs[:1], batch_size=B), first) < EXACT
