"""pp_prop's rule record (``pp_prop_rule``) run by the contract's learner equals the pp_prop engine.

``braintrace.compile(model, pp_prop_rule(d), x0)`` (a :class:`RuleLearner`) against
``braintrace.compile(model, braintrace.pp_prop, x0, decay_or_rank=d)``, both called one step at
a time on identical models: the per-step gradients agree element-wise in float64 (1e-10) over
several steps, for dense operations with a bias, element-wise weights with a transform hook
(which the engine leaves out of its one-step VJP), two-state groups, convolutions, embeddings
(a one-hot input trace), a GRU (relations sharing one input trace in the engine) and unbatched
models; and so do the traces. Negative controls: another decay, and a model outside the
record's regime (a group read past its update), differ.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.io_trace.relation_rule import PPCarrier, pp_prop_rule
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, per_step_grads, x64
from tests.algorithm.test_local_relations import Leaky as LocalLeaky
from tests.algorithm.test_pp_prop import Broadcast, ConvLeaky, Emb, Leaky, TwoState, inputs

__all__ = ["x64"]  # the fixture is used by name

#: (rtol, atol) in float64; a model whose parameters stay float32 under x64 (``braintrace.nn``
#: cells) agrees to rounding.
EXACT, EXACT_F32 = (1e-10, 1e-12), (1e-5, 1e-6)


def compile_both(make: Any, x0: Any, batch_size: int | None, decay: Any = 0.9, fast_solve: bool = True,
                 seed: int = 0) -> tuple[Any, Any]:
    """The record's learner and the engine, each on its own (identical) model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        brainstate.random.seed(seed)
        by_record = braintrace.compile(make(), pp_prop_rule(decay, fast_solve), x0, batch_size=batch_size)
        brainstate.random.seed(seed)
        engine = braintrace.compile(make(), braintrace.pp_prop, x0, batch_size=batch_size, decay_or_rank=decay,
                                    fast_solve=fast_solve)
    return by_record, engine


def assert_same_grads(got: dict[Any, Any], ref: dict[Any, Any]) -> None:
    assert set(got) == set(ref)
    for path in ref:
        rtol, atol = EXACT if ref[path].dtype == np.float64 else EXACT_F32
        np.testing.assert_allclose(got[path], ref[path], rtol, atol, err_msg=str(path))


class GRU(brainstate.nn.Module):
    """``braintrace.nn.GRUCell`` with a readout: three relations read one input."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = braintrace.nn.GRUCell(3, 4)
        self.w_out = brainstate.ParamState(normal(1, (4, 2)))

    def update(self, x: Any) -> Any:
        return self.cell(x) @ self.w_out.value


@pytest.mark.parametrize("make, batch, decay, fast_solve", [
    (Leaky, 2, 0.9, True),
    pytest.param(Leaky, 2, (3, 0.5), False, marks=pytest.mark.slow),
    pytest.param(LocalLeaky, 2, 0.9, True, marks=pytest.mark.slow),
    pytest.param(LocalLeaky, None, (3, 0.5), False, marks=pytest.mark.slow),
], ids=["direct-path", "direct-path-pair-decays", "covered", "covered-unbatched"])
def test_record_equals_engine_dense_and_element_wise(
    x64: None, make: Any, batch: int | None, decay: Any, fast_solve: bool,
) -> None:
    xs = inputs(4, batch)
    by_record, engine = compile_both(make, xs[0], batch, decay, fast_solve)
    # The engine leaves covered weights out of its one-step VJP; the record's learner does not.
    assert bool(engine._local_relation_weights().paths) == (make is LocalLeaky)
    assert_same_grads(per_step_grads(by_record, xs), per_step_grads(engine, xs))


@pytest.mark.parametrize("make, xs, batch", [
    (TwoState, inputs(3, 2), 2),
    (ConvLeaky, normal(2, (3, 2, 2, 5)), 2),
    (lambda: Emb(False), jnp.asarray([[1, 4], [1, 0], [3, 4]]), 2),
    (GRU, inputs(3, None), None),
    (Leaky, inputs(3, None), None),
], ids=["two-states", "conv", "embedding", "gru", "unbatched"])
@pytest.mark.slow
def test_record_equals_engine(x64: None, make: Any, xs: Any, batch: int | None) -> None:
    by_record, engine = compile_both(make, xs[0], batch)
    assert_same_grads(per_step_grads(by_record, xs), per_step_grads(engine, xs))


@pytest.mark.slow
def test_traces_equal_engine_and_reset_with_it(x64: None) -> None:
    xs = inputs(3, 2)
    by_record, engine = compile_both(Leaky, xs[0], 2)
    per_step_grads(by_record, xs), per_step_grads(engine, xs)
    for rel in engine.graph.hidden_param_op_relations:
        (key,) = engine.get_etrace_of(rel.trainable_paths["weight"])[1]
        (carrier,) = by_record.get_etrace_of(rel.trainable_paths["weight"]).values()
        assert isinstance(carrier, PPCarrier)
        np.testing.assert_allclose(np.asarray(carrier.df), engine.etrace_dfs[key].value, *EXACT)
        if rel.x_var is not None:
            np.testing.assert_allclose(np.asarray(carrier.x), engine.etrace_xs[id(rel.x_var)].value, *EXACT)
        assert carrier.steps.shape == () and carrier.steps == 3 == engine.trace_steps.value
    # A reset zeros the counter with the traces; a batch resize leaves the scalar as it is.
    by_record.reset_state(batch_size=3)
    assert all(c.steps.shape == () for c in by_record.carriers.read().values())
    by_record.reset(), engine.reset()
    assert all(not np.any(c.steps) and c.steps.shape == () for c in by_record.carriers.read().values())
    assert_same_grads(per_step_grads(by_record, xs[::-1]), per_step_grads(engine, xs[::-1]))


@pytest.mark.slow
def test_another_decay_differs_after_the_first_step(x64: None) -> None:
    xs = inputs(3, 2)
    by_record = compile_both(Leaky, xs[0], 2, decay=0.5)[0]
    engine = compile_both(Leaky, xs[0], 2, decay=0.9)[1]
    got, ref = per_step_grads(by_record, xs), per_step_grads(engine, xs)
    assert_same_grads({p: g[:1] for p, g in got.items()}, {p: g[:1] for p, g in ref.items()})  # exact either way
    assert max(np.abs(got[p][1:] - ref[p][1:]).max() for p in ref) > 1e-3


def test_the_first_step_after_a_reset_is_bptt(x64: None) -> None:
    """The docstring's claim, against a plain ``jax.grad`` of the step's loss (1e-10 element-wise)."""
    xs = inputs(1, 2)
    by_record = compile_both(Leaky, xs[0], 2)[0]
    brainstate.random.seed(0)
    ref = bptt_grads(Leaky(), xs, batch_size=2)
    got = {p: g[0] for p, g in per_step_grads(by_record, xs).items()}
    assert set(got) == set(ref) and all(np.any(ref[p] != 0) for p in ref)
    assert max_rel_err(ref, got) < 1e-10


class ReadPast(brainstate.nn.Module):
    """Layer 2 is driven by layer 1's previous value: a read past h1's update."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = brainstate.ParamState(normal(0, (3, 4), 0.7))
        self.w2 = brainstate.ParamState(normal(1, (4, 2), 0.7))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h1 = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4)))
        self.h2 = brainstate.HiddenState(jnp.zeros((batch_size or 1, 2)))

    def update(self, x: Any) -> Any:
        old1 = self.h1.value
        self.h1.value = 0.9 * old1 + jnp.tanh(braintrace.matmul(x, self.w1.value))
        self.h2.value = 0.5 * self.h2.value + jnp.tanh(braintrace.matmul(old1, self.w2.value))
        return self.h2.value


@pytest.mark.slow
def test_a_group_read_past_its_update_is_outside_the_regime(x64: None) -> None:
    xs = inputs(3, 2)
    by_record, engine = compile_both(ReadPast, xs[0], 2)
    assert engine._groups_read_past_update()
    got, ref = per_step_grads(by_record, xs), per_step_grads(engine, xs)
    assert max(np.abs(got[p] - ref[p]).max() for p in ref) > 1e-3


def test_refusals() -> None:
    with pytest.raises(ValueError, match="0 <= decay < 1"):
        pp_prop_rule(1.5)
    with pytest.raises(ValueError, match="two entries"):
        pp_prop_rule((0.9,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fast_solve must be a bool"):
        pp_prop_rule(0.9, fast_solve=1)  # type: ignore[arg-type]
    assert pp_prop_rule(19) is pp_prop_rule(0.9) and pp_prop_rule(0.9) is not pp_prop_rule(0.9, False)

    with pytest.raises(ValueError, match=r"outputs \(4,\) but drives a hidden group of shape \(2, 4\)"):
        braintrace.compile(Broadcast(), pp_prop_rule(0.9), jnp.ones(3))
    step = braintrace.RelationStep(x=jnp.ones(3), df=jnp.ones((4, 1)), diag=jnp.ones((4, 1, 1)),
                                   weights={"weight": jnp.ones((3, 4))})
    with pytest.raises(ValueError, match="names no relation"):
        pp_prop_rule(0.9).roll(PPCarrier(jnp.zeros(3), jnp.zeros((4, 1)), jnp.zeros((1, 1), jnp.int32)), step)
