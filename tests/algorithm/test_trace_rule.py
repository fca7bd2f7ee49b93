"""The public rule contract (``braintrace.TraceRule``) and the learner that runs it.

A rule written as three pure functions, D-RTRL of dense and element-wise operations, equals BPTT
in float64 where the recurrence is element-wise (and equals the library's D_RTRL); the same rule
without its history term does not (the negative control). The learner stores, resets,
checkpoints and exposes the carriers for every rule, runs under the drivers, and refuses what
the contract does not allow at the call, naming the fix.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, target_loss, x64

T, B, I, H = 5, 3, 4, 6
EXACT = 1e-10


class Leaky(brainstate.nn.Module):
    """``h = τ ⊙ h + tanh(matmul(x, W) + b)``: an element-wise recurrence (D-RTRL is exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.tau = brainstate.ParamState(normal(1, (H,), 0.5))
        self.w = brainstate.ParamState(normal(2, (I, H), 0.6))
        self.b = brainstate.ParamState(normal(3, (H,), 0.1))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or B, H)))

    def update(self, x: jax.Array) -> jax.Array:
        leak = braintrace.element_wise(self.tau.value)
        self.h.value = leak * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value, self.b.value))
        return self.h.value


class Eps(NamedTuple):
    """The carrier: the trace of each trainable operand, per sample and output position."""

    weight: jax.Array
    bias: jax.Array | None


def init(info: braintrace.RelationInfo) -> Eps:
    assert info.params.get("weight_fn") is None, "this rule knows no transform hooks"
    y = info.y
    if info.primitive == "etp_elemwise":  # the operand has the output's shape (less the batch)
        return Eps(jnp.zeros(y.shape, y.dtype), None)
    bias = jnp.zeros(y.shape, y.dtype) if "bias" in info.weights else None
    return Eps(jnp.zeros((*info.x.shape, y.shape[-1]), y.dtype), bias)


def roll(eps: Eps, step: braintrace.RelationStep) -> Eps:
    d, df = step.diag[..., 0, 0], step.df[..., 0]
    if step.x is None:  # element-wise (no weight_fn): y is the weight itself
        return Eps(d * eps.weight + df, None)
    weight = d[..., None, :] * eps.weight + step.x[..., :, None] * df[..., None, :]
    return Eps(weight, None if eps.bias is None else d * eps.bias + df)


def contract(eps: Eps, q: jax.Array, step: braintrace.RelationStep) -> dict[str, jax.Array]:
    """``⟨q, ε⟩`` per operand, ``q`` over the output units (per sample)."""
    if step.x is None:
        return {"weight": eps.weight * q}
    out = {"weight": eps.weight * q[..., None, :]}
    if eps.bias is not None:
        out["bias"] = eps.bias * q
    return out


def solve(eps: Eps, g: jax.Array, step: braintrace.RelationStep) -> dict[str, jax.Array]:
    return contract(eps, g[..., 0] * step.diag[..., 0, 0], step)  # the history ⟨Dᵀ g, ε^{t-1}⟩


D_RTRL_RULE = braintrace.TraceRule(init, roll, solve)


def _compile(rule: Any, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(Leaky(), rule, normal(11, (T, B, I))[0], batch_size=B, **options)


def test_a_rule_written_against_the_contract_equals_bptt_and_the_library_d_rtrl(x64: None) -> None:
    xs = normal(11, (T, B, I))
    ref = bptt_grads(Leaky(), xs, batch_size=B)
    learner = _compile(D_RTRL_RULE)
    got = single_step_grads(learner, xs)
    assert set(got) == set(ref) and all(np.any(ref[p] != 0) for p in ref)
    assert max_rel_err(ref, got) < EXACT
    assert max_rel_err(single_step_grads(_compile("d_rtrl"), xs), got) < EXACT


def test_without_its_history_the_rule_is_the_one_step_gradient_and_differs_from_bptt(x64: None) -> None:
    xs = normal(11, (T, B, I))
    ref = bptt_grads(Leaky(), xs, batch_size=B)
    truncated = _compile(braintrace.TraceRule(init, roll, lambda eps, g, step: {}))
    assert max_rel_err(ref, single_step_grads(truncated, xs)) > 1e-3


def test_a_residual_function_chooses_what_the_backward_pass_keeps(x64: None) -> None:
    """Reading the history off the new trace, ``⟨g, ε^t − x ⊗ df⟩``, is the same gradient."""

    def residual(entering: Eps, new: Eps, step: braintrace.RelationStep) -> Eps:
        return new

    def from_new(eps: Eps, g: jax.Array, step: braintrace.RelationStep) -> dict[str, jax.Array]:
        instant = roll(Eps(jnp.zeros_like(eps.weight), None if eps.bias is None else jnp.zeros_like(eps.bias)), step)
        history = Eps(eps.weight - instant.weight, None if eps.bias is None else eps.bias - instant.bias)
        return contract(history, g[..., 0], step)

    xs = normal(11, (T, B, I))
    learner = _compile(braintrace.TraceRule(init, roll, from_new, residual))
    assert max_rel_err(bptt_grads(Leaky(), xs, batch_size=B), single_step_grads(learner, xs)) < EXACT


def test_the_drivers_run_a_rule_learner() -> None:
    xs = normal(11, (T, B, I))
    driven, called = _compile(D_RTRL_RULE), _compile(D_RTRL_RULE)
    got = driven.etrace_grad(xs, jnp.arange(T), step_fn=lambda x, t: target_loss(t, driven(x)), reduction="sum")
    want = single_step_grads(called, xs)
    assert max_rel_err(want, {p: np.asarray(v) for p, v in got.items()}) < 1e-6


def test_the_learner_stores_exposes_and_resets_every_carrier() -> None:
    learner = _compile(D_RTRL_RULE)
    assert len(learner.carriers) == len(learner.graph.hidden_param_op_relations) == 2
    assert len(learner.states(braintrace.EligibilityTrace)) == 2
    learner(normal(11, (T, B, I))[0])
    (carrier,) = learner.get_etrace_of(learner.param_states[("w",)]).values()
    assert isinstance(carrier, Eps) and carrier.weight.shape == (B, I, H) and np.any(np.asarray(carrier.weight) != 0)
    assert learner.get_etrace_of(("w",)).keys() == learner.get_etrace_of(learner.param_states[("w",)]).keys()
    assert {path for path, _ in learner.named_etraces()} == {("w",), ("b",), ("tau",)}
    with pytest.raises(ValueError, match="no carrier of the given weight"):
        learner.get_etrace_of(("nope",))
    learner.reset()
    (carrier,) = learner.get_etrace_of(("w",)).values()
    assert carrier.weight.shape == (B, I, H) and not np.any(np.asarray(carrier.weight))
    assert int(learner.running_index.value) == 0
    learner.reset_state(batch_size=2)  # the carriers of batched relations follow a new batch size
    assert {k: v.weight.shape for k, v in learner._get_etrace_data().items()} == {
        key: (2, I, H) if v.weight.ndim == 3 else (2, H) for key, v in learner._get_etrace_data().items()}


def test_a_checkpoint_restores_the_carriers(tmp_path: Any) -> None:
    xs = normal(11, (T, B, I))
    saved = _compile(D_RTRL_RULE)
    saved.etrace_evolve(xs[:3])
    braintrace.save_checkpoint(tmp_path / "rule.ckpt", saved)
    restored = _compile(D_RTRL_RULE)
    braintrace.load_checkpoint(tmp_path / "rule.ckpt", restored)
    pairs = list(zip(saved.carriers.values(), restored.carriers.values(), strict=True))  # relation order
    for a, b in ((a, b) for s, r in pairs for a, b in zip(jax.tree.leaves(s.value), jax.tree.leaves(r.value))):
        assert np.any(np.asarray(a) != 0)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_what_the_contract_does_not_allow_is_refused_naming_the_fix() -> None:
    with pytest.raises(TypeError, match="algorithm must be .* a braintrace.TraceRule"):
        braintrace.compile(Leaky(), object(), normal(11, (T, B, I))[0], batch_size=B)
    with pytest.raises(TypeError, match="roll must be callable"):
        _compile(braintrace.TraceRule(init, None, solve))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="single-step calls.*use D_RTRL for multi-step"):
        _compile(D_RTRL_RULE, vjp_method="multi-step")
    with pytest.raises(TypeError, match="must return a pytree of JAX arrays"):
        _compile(braintrace.TraceRule(lambda info: None, roll, solve))
    bad = _compile(braintrace.TraceRule(init, roll, lambda eps, g, step: {"kernel": eps.weight}))
    x = normal(11, (T, B, I))[0]
    with pytest.raises(ValueError, match=r"gradients for \['kernel'\], which are not trainable operands"):
        brainstate.transform.grad(lambda: jnp.sum(bad(x)), bad.param_states)()
