"""Trainable operands computed from parameters: ``matmul(x, W * mask)``, ``jnp.abs(W)``, ``W.T``, ...

The traces are kept with respect to the operand and their gradient is pulled back through the
operations that compute it from the parameters (every parameter it reads, when there are
several). Checked against BPTT in float64 where D_RTRL is exact (diagonal recurrence), over
several steps, and for a whole-sequence window of pp_prop.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, window_grads, x64
from tests.compiler import control_flow_models as cf

__all__ = ["x64"]  # the fixture is used by name

EXACT = 1e-10
MASK = np.random.default_rng(0).random((3, 4)) > 0.5

#: name -> operand from (W (3, 4), U (1, 4))
OPERANDS: dict[str, Callable[[Any, Any], Any]] = {
    "mask": lambda w, u: w * jnp.asarray(MASK, w.dtype),
    "dale": lambda w, u: jnp.abs(w),
    "scale": lambda w, u: 2.0 * w,
    "transpose": lambda w, u: w.T.reshape(4, 3).T,
    "two_parameters": lambda w, u: jnp.concatenate([w[:2], u]),
    "square": lambda w, u: w * w,
}


class Diagonal(brainstate.nn.Module):
    """``h = 0.5 h + tanh(x op(W, U))``: element-wise recurrence, where D_RTRL is exact."""

    def __init__(self, operand: str) -> None:
        super().__init__()
        self.operand = OPERANDS[operand]
        self.w = brainstate.ParamState(normal(0, (3, 4)))
        self.u = brainstate.ParamState(normal(1, (1, 4)))
        self.tau = brainstate.ParamState(normal(2, (4,), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, 4)))

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(2.0 * self.tau.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(braintrace.matmul(x, self.operand(self.w.value, self.u.value)))
        return self.h.value


class Direct(Diagonal):
    """:class:`Diagonal` with the operand itself as the parameter ``v``."""

    def __init__(self, operand: str) -> None:
        super().__init__(operand)
        self.v = brainstate.ParamState(self.operand(self.w.value, self.u.value))
        self.operand = lambda w, u: self.v.value


def compile_learner(model: brainstate.nn.Module, algorithm: Any, x0: Any, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, x0, batch_size=x0.shape[0], **options)


@pytest.mark.parametrize("operand", sorted(OPERANDS))
def test_d_rtrl_single_step_equals_bptt(x64: None, operand: str) -> None:
    xs = normal(3, (4, 2, 3))
    ref = bptt_grads(Diagonal(operand), xs, batch_size=2)
    learner = compile_learner(Diagonal(operand), braintrace.D_RTRL, xs[0])
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


@pytest.mark.parametrize("operand", sorted(OPERANDS))
@pytest.mark.parametrize("algorithm, options", [(braintrace.pp_prop, {"decay_or_rank": 0.8}), (braintrace.D_RTRL, {})])
def test_learns_as_the_operand_would(x64: None, operand: str, algorithm: Any, options: dict[str, Any]) -> None:
    """Any learner, exact or not: the operand's gradient, pulled back through the chain."""
    xs = normal(7, (4, 2, 3))
    chained = Diagonal(operand)
    got = single_step_grads(compile_learner(chained, algorithm, xs[0], **options), xs)
    direct = single_step_grads(compile_learner(Direct(operand), algorithm, xs[0], **options), xs)
    _, vjp = jax.vjp(chained.operand, chained.w.value, chained.u.value)
    gw, gu = vjp(jnp.asarray(direct[("v",)]))
    expected = {("w",): np.asarray(gw), ("u",): np.asarray(gu), ("tau",): direct[("tau",)]}
    assert max_rel_err(expected, got) < EXACT


@pytest.mark.parametrize("operand", ["mask", "two_parameters"])
def test_pp_prop_whole_window_equals_bptt(x64: None, operand: str) -> None:
    xs = normal(4, (4, 2, 3))
    ref = bptt_grads(Diagonal(operand), xs, batch_size=2)
    whole = compile_learner(Diagonal(operand), braintrace.pp_prop, xs[0], decay_or_rank=0.8,
                            vjp_method="multi-step")
    assert max_rel_err(ref, window_grads(whole, xs, [4])) < EXACT


def test_every_parameter_of_the_operand_is_credited(x64: None) -> None:
    xs = normal(5, (3, 2, 3))
    learner = compile_learner(Diagonal("two_parameters"), braintrace.D_RTRL, xs[0])
    grads = single_step_grads(learner, xs)
    assert np.abs(grads[("u",)]).max() > 0 and np.abs(grads[("w",)][2]).max() == 0


def test_masked_entries_get_no_gradient() -> None:
    xs = normal(6, (3, 2, 3))
    grads = single_step_grads(compile_learner(Diagonal("mask"), braintrace.D_RTRL, xs[0]), xs)
    assert np.all(grads[("w",)][~MASK] == 0) and np.abs(grads[("w",)][MASK]).min() > 0


class StepDependent(brainstate.nn.Module):
    """The operand reads the input: ``matmul(x, W * mean(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (3, 4)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, 4)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value * x.mean())
        return self.h.value


@pytest.mark.parametrize("algorithm", [braintrace.D_RTRL, braintrace.pp_prop])
def test_step_dependent_operand_is_refused(algorithm: Any) -> None:
    options = {"decay_or_rank": 0.9} if algorithm is braintrace.pp_prop else {}
    message = r"'weight' operand of etp_mm \(parameter \('w',\)\) is computed through .* change from step"
    with pytest.raises(braintrace.NotSupportedError, match=message):
        compile_learner(StepDependent(), algorithm, jnp.ones((2, 3)), **options)


class ScaledSubsteps(cf.SubstepModel):
    """A descended scan whose body computes the operand: ``matmul(x_k, 2 W)``."""

    def substep(self, h: Any, x_k: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        return leak * h + 0.1 * jnp.tanh(braintrace.matmul(x_k, 2.0 * self.w.value))


def test_operand_computed_inside_a_descended_scan_is_refused() -> None:
    with pytest.raises(braintrace.NotSupportedError, match=r"computed through \['mul'\] inside a descended scan"):
        compile_learner(ScaledSubsteps(length=20), braintrace.D_RTRL, jnp.ones((1, 3)))
