"""The deprecated parameter classes: construction rules, compiler visibility, same gradients."""

from __future__ import annotations

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._legacy import (
    ElemWiseOp,
    ElemWiseParam,
    ETraceGrad,
    ETraceParam,
    FakeElemWiseParam,
    FakeETraceParam,
    MatMulOp,
    NonTempParam,
)
from braintrace._op import etp_elemwise_p, etp_mv_p
from tests.nn.helpers import compile_quiet, normal, online_grads

W = normal(0, (3, 4))
X = normal(1, (3,))


def test_etrace_param() -> None:
    p = ETraceParam({"weight": W}, MatMulOp())
    assert isinstance(p, brainstate.ParamState)
    assert p.is_etrace and p.gradient is ETraceGrad.adaptive
    np.testing.assert_allclose(p.execute(X), X @ W, rtol=1e-6)
    assert ETraceParam({"weight": W}, MatMulOp(), grad="approx").gradient is ETraceGrad.approx
    with pytest.raises(ValueError, match="grad must be None or one of"):
        ETraceParam({"weight": W}, MatMulOp(), grad="exact")
    with pytest.raises(TypeError, match="ETraceParam: op must be an ETraceOp"):
        ETraceParam({"weight": W}, lambda x, w: x @ w)


def test_elemwise_param() -> None:
    w = normal(2, (4,))
    p = ElemWiseParam(w, jnp.tanh)
    assert isinstance(p.op, ElemWiseOp) and p.gradient is ETraceGrad.full
    np.testing.assert_allclose(p.execute(), jnp.tanh(w), rtol=1e-6)
    np.testing.assert_allclose(ElemWiseParam(w).execute(), w)
    op = ElemWiseOp(jnp.abs)
    assert ElemWiseParam(w, op).op is op
    with pytest.raises(TypeError, match="ElemWiseParam: op must be an ElemWiseOp or a callable"):
        ElemWiseParam(w, 3)


def test_non_temporal_param() -> None:
    op = MatMulOp()
    p = NonTempParam({"weight": W}, op, name="w", extra="ignored")
    assert isinstance(p, brainstate.ParamState)
    assert p._op is op and p.op == op.raw_xw_to_y
    np.testing.assert_allclose(p.execute(X), X @ W, rtol=1e-6)
    q = NonTempParam(W, lambda x, w: x @ w)
    np.testing.assert_allclose(q.execute(X), X @ W, rtol=1e-6)
    names = [e.primitive.name for e in jax.make_jaxpr(p.execute)(X).jaxpr.eqns]
    assert not any(n.startswith("etp_") for n in names)
    with pytest.raises(TypeError, match="NonTempParam: op must be an ETraceOp or a callable"):
        NonTempParam(W, "matmul")


def test_fake_params() -> None:
    fake = FakeETraceParam({"weight": W}, MatMulOp())
    assert not isinstance(fake, brainstate.State)
    np.testing.assert_allclose(fake.execute(X), X @ W, rtol=1e-6)
    w = normal(3, (4,))
    elem = FakeElemWiseParam(w, ElemWiseOp(jnp.tanh), name="g")
    assert elem.name == "g" and elem.value is w
    np.testing.assert_allclose(elem.execute(), jnp.tanh(w), rtol=1e-6)
    assert [e.primitive.name for e in jax.make_jaxpr(elem.execute)().jaxpr.eqns] == ["tanh"]
    np.testing.assert_allclose(FakeElemWiseParam(w, jnp.abs).execute(), jnp.abs(w))
    with pytest.raises(TypeError, match="an ETraceOp must be an ElemWiseOp"):
        FakeElemWiseParam(w, MatMulOp())
    with pytest.raises(TypeError, match="FakeETraceParam: op must be an ETraceOp or a callable"):
        FakeETraceParam(w, None)


class LegacyRNN(brainstate.nn.Module):
    """A leaky tanh RNN written with the v0.1 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = ETraceParam({"weight": W, "bias": normal(4, (4,))}, MatMulOp(weight_fn=jnp.tanh))
        self.leak = ElemWiseParam(normal(5, (4,)), jax.nn.sigmoid)
        self.w_out = NonTempParam({"weight": normal(6, (4, 2))}, MatMulOp())
        self.offset = FakeElemWiseParam(jnp.ones(2) * 0.1)

    def init_state(self, batch_size: int | None = None, **kw: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        self.h.value = self.leak.execute() * self.h.value + jnp.tanh(self.w_in.execute(x))
        return self.w_out.execute(self.h.value) + self.offset.execute()


class ModernRNN(brainstate.nn.Module):
    """The same model with ParamStates and the ETP functions (the migration target)."""

    def __init__(self, legacy: LegacyRNN) -> None:
        super().__init__()
        self.w_in = brainstate.ParamState(dict(legacy.w_in.value))
        self.leak = brainstate.ParamState(legacy.leak.value)
        self.w_out = brainstate.ParamState(dict(legacy.w_out.value))
        self.offset = legacy.offset.value

    def init_state(self, batch_size: int | None = None, **kw: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        w = self.w_in.value
        leak = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid)
        drive = braintrace.matmul(x, w["weight"], w["bias"], weight_fn=jnp.tanh)
        self.h.value = leak * self.h.value + jnp.tanh(drive)
        return self.h.value @ self.w_out.value["weight"] + self.offset


def test_compiler_sees_only_the_etrace_params(quiet: list) -> None:
    model = LegacyRNN()
    model.init_state()
    graph = braintrace.compile_etrace_graph(model, X)
    got = [(r.primitive, tuple(r.trainable_paths.values())[0]) for r in graph.hidden_param_op_relations]
    assert got == [(etp_elemwise_p, ("leak",)), (etp_mv_p, ("w_in",))]
    assert set(model.states(brainstate.ParamState)) == {("w_in",), ("leak",), ("w_out",)}


@pytest.mark.slow
def test_legacy_model_learns_exactly_like_its_migration() -> None:
    xs, ys = normal(7, (4, 3)), normal(8, (4, 2))
    legacy = LegacyRNN()
    modern = ModernRNN(legacy)
    old = online_grads(compile_quiet(legacy, xs[0]), xs, ys)
    new = online_grads(compile_quiet(modern, xs[0]), xs, ys)
    assert set(old) == set(new)
    for path in old:
        for a, b in zip(jax.tree.leaves(old[path]), jax.tree.leaves(new[path])):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
