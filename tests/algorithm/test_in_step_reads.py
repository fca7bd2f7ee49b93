"""Hidden states that read each other's *new* values within a step stay exact under D_RTRL.

An adaptation current reading the freshly updated membrane potential (or an LSTM's ``h``
reading the new ``c``) couples two members of a group inside the step. The perturbation
signal ``∂L/∂h^t`` already contains that in-step path, so the single-step history term must
contract it with the partial Jacobian (those reads held fixed), not the total one.
"""

from __future__ import annotations

from typing import Any

import brainstate
import jax.numpy as jnp

import braintrace
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, x64  # noqa: F401
from tests.algorithm.test_d_rtrl import compile_quiet

T, B, I, N = 5, 2, 3, 4


class ReadsNewValue(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(1, (I, N), 0.5))
        self.tau = brainstate.ParamState(jnp.zeros(N))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (N,) if batch_size is None else (batch_size, N)
        self.v = brainstate.HiddenState(jnp.zeros(shape))
        self.a = brainstate.HiddenState(jnp.zeros(shape))

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=lambda t: 0.5 + 0.4 * jnp.tanh(t))
        self.v.value = leak * self.v.value - 0.3 * self.a.value + braintrace.matmul(x, self.w.value)
        self.a.value = 0.9 * self.a.value + jnp.tanh(self.v.value)  # the new v
        return self.v.value + self.a.value


def test_in_step_reads_are_exact(x64: None) -> None:
    xs = normal(3, (T, B, I))
    ref = bptt_grads(ReadsNewValue(), xs, batch_size=B)
    learner = compile_quiet(ReadsNewValue(), xs[0], B)
    (group,) = learner.graph.hidden_groups
    assert group.num_state == 2 and group.reads_new_members()
    assert max_rel_err(ref, single_step_grads(learner, xs)) < 1e-10
