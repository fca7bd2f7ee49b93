"""The model shapes upstream braintrace 0.2.7 fixed (its issues 184-186), pinned exact here.

Each model is a diagonal recurrence, the regime where the per-position learners are exact:
a delay line (a pure copy between hidden states), an input-only latch, an output that reads
the pre-reset potential, a readout inside the step, a weight-free ``while_loop`` between
the weight product and the hidden state, and a state set to another one's new value (one
variable of the traced step for both; read by the output, by the next update, or not at all).
For every learner whose class covers them (D_RTRL, EProp without its filter, OSTLRecurrent, SnAp),
the sum of the single-step online gradients equals BPTT's element-wise (float64, relative
``1e-10``), and so do D_RTRL's windows; the labels of the copies agree with the gradient
audit. The negative control: on the recurrent weight of a GRU, outside the regime, D_RTRL is
far from BPTT.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import pytest

import braintrace
from braintrace._audit import check_gradients
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, window_grads, x64
from tests.compiler import control_flow_models as cf

__all__ = ["x64"]  # the fixture is used by name

T, B, I, O = 6, 2, 3, 4
EXACT = 1e-10


class _Model(brainstate.nn.Module):
    names: tuple[str, ...] = ("h",)

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(1, (I, O), 0.7))
        self.tau = brainstate.ParamState(normal(2, (O,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        for name in self.names:
            setattr(self, name, brainstate.HiddenState(jnp.zeros((batch_size, O))))

    def drive(self, x: Any) -> Any:
        return braintrace.matmul(x, self.w.value)

    def leak(self) -> Any:
        return braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)


class DelayLine(_Model):
    """``h = σ(τ) h + x W``, and ``d`` a pure copy of the previous ``h`` (a one-step delay) that the output reads."""

    names = ("h", "d")

    def update(self, x: Any) -> Any:
        self.d.value = self.h.value
        self.h.value = self.leak() * self.h.value + self.drive(x)
        return jnp.tanh(self.d.value) + 0.5 * jnp.tanh(self.h.value)


class InputLatch(_Model):
    """A state that holds the last drive ``l = x W`` (no recurrence of its own) and leaks into ``h``."""

    names = ("h", "latch")

    def update(self, x: Any) -> Any:
        self.h.value = self.leak() * self.h.value + self.latch.value
        self.latch.value = self.drive(x)
        return jnp.tanh(self.h.value) + jnp.tanh(self.latch.value)


class PreResetSpike(_Model):
    """A soft-reset neuron whose output is the spike of its pre-reset potential."""

    def update(self, x: Any) -> Any:
        pre = self.leak() * self.h.value + self.drive(x)
        spike = jax.nn.sigmoid(4.0 * (pre - 0.5))
        self.h.value = pre * (1.0 - spike)
        return spike


class ReadoutInside(_Model):
    """A leaky layer whose trainable readout is applied inside the step."""

    def __init__(self) -> None:
        super().__init__()
        self.w_out = brainstate.ParamState(normal(3, (O, 2), 0.5))

    def update(self, x: Any) -> Any:
        self.h.value = self.leak() * self.h.value + jnp.tanh(self.drive(x))
        return jnp.tanh(self.h.value) @ self.w_out.value


class CopyOfNewValue(_Model):
    """``h = σ(τ) h + x W`` and ``prev = h`` after the update: the step returns one variable for
    both new values. ``read`` says what reads ``prev``: the output, ``h``'s next update, or nothing."""

    names = ("h", "prev")

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read

    def update(self, x: Any) -> Any:
        feedback = 0.3 * self.prev.value if self.read == "update" else 0.0
        self.h.value = self.leak() * self.h.value + self.drive(x) + feedback
        self.prev.value = self.h.value
        return jnp.tanh(self.prev.value if self.read == "output" else self.h.value)


COPY_READS = ("output", "update", "nothing")


def _halved_drive(flat: bool = False) -> brainstate.nn.Module:
    return cf.HalvedDriveModel(n_in=I, n_hid=O, flat=flat)


MODELS: dict[str, Callable[[], brainstate.nn.Module]] = {
    "delay-line": DelayLine, "input-latch": InputLatch, "pre-reset-spike": PreResetSpike,
    "readout-inside": ReadoutInside, "while": _halved_drive,
    **{f"copy-read-by-{read}": functools.partial(CopyOfNewValue, read) for read in COPY_READS},
}
#: BPTT runs on the loop-free twin of the while model (JAX's reverse mode cannot cross a while_loop).
REFERENCES = {**MODELS, "while": lambda: _halved_drive(flat=True)}
LEARNERS = ("d_rtrl", "eprop", "ostl_recurrent", "snap")
CASES = [(m, a) for m in MODELS for a in LEARNERS]


def _learner(model: brainstate.nn.Module, algorithm: str, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, normal(9, (T, B, I))[0], batch_size=B, **options)


@pytest.mark.parametrize("model, algorithm", CASES, ids=[f"{m}-{a}" for m, a in CASES])
def test_single_step_equals_bptt(model: str, algorithm: str, x64: None) -> None:
    xs = normal(9, (T, B, I))
    got = single_step_grads(_learner(MODELS[model](), algorithm), xs)
    assert max_rel_err(bptt_grads(REFERENCES[model](), xs, batch_size=B), got) < EXACT


@pytest.mark.parametrize("model", list(MODELS))
def test_d_rtrl_windows_equal_bptt(model: str, x64: None) -> None:
    xs = normal(9, (T, B, I))
    got = window_grads(_learner(MODELS[model](), "d_rtrl", vjp_method="multi-step"), xs, (2, 3, 1))
    assert max_rel_err(bptt_grads(REFERENCES[model](), xs, batch_size=B), got) < EXACT


@pytest.mark.parametrize("read", COPY_READS)
def test_a_copy_of_a_new_value_joins_the_group_and_is_labelled_as_measured(read: str, x64: None) -> None:
    learner = _learner(CopyOfNewValue(read), "d_rtrl")
    assert [sorted(group.hidden_paths) for group in learner.graph.hidden_groups] == [[("h",), ("prev",)]]
    xs, ys = normal(9, (T, B, I)), normal(10, (T, B, O))
    audit = check_gradients(learner, xs, ys, step_fn=lambda x, y: jnp.sum((learner(x) - y) ** 2))
    errors = {row.path: row.relative_error for row in audit.rows}
    labels = {label.weight_path: label for label in learner.report.exactness}
    assert labels[("w",)].exact
    assert all(errors[path] < 1e-8 for path, label in labels.items() if label.exact)


def test_the_comparison_fails_outside_the_exact_regime(x64: None) -> None:
    xs = normal(9, (T, B, I))

    def gru() -> brainstate.nn.Module:
        brainstate.random.seed(0)
        return braintrace.nn.GRUCell(I, O)

    got = single_step_grads(_learner(gru(), "d_rtrl"), xs)
    assert max_rel_err(bptt_grads(gru(), xs, batch_size=B), got) > 1e-3
