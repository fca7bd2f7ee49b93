"""What the learners expose of their traces: entries, values, shapes, and the layouts they accept.

* Bias traces are part of the trace: a relation's trace holds one entry per trainable key, and
  ``get_etrace_of`` returns the whole trace whichever key is asked for. On
  ``v ← λ v + x W + b`` the bias trace after ``n`` steps is ``Σ_{j<n} λ^j``.
* ``reset_state(batch_size=n)`` gives every trace that leads with the batch axis the new size.
* Traces are allocated at their final shape (an unbatched operation driving a batched state).
* An operation whose output adds axes of size one to an unbatched state (a layer's batch of
  one) learns: one step from reset equals the plain one-step gradient, and D_RTRL stays exact.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, x64
from tests.algorithm.test_d_rtrl import ROWS, Row, _setup

__all__ = ["x64"]  # the fixture is used by name

T, B, I, O = 4, 2, 3, 4
LAM = 0.6


def compile_quiet(model: brainstate.nn.Module, cls: Any, x0: Any, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, cls, x0, **options)


# --- bias traces ------------------------------------------------------------------------------


class LeakyBias(brainstate.nn.Module):
    """``v ← λ v + x W + b``, the bias in its own ``ParamState`` or beside the weight in one."""

    def __init__(self, shared_state: bool) -> None:
        super().__init__()
        self.shared_state = shared_state
        w, b = normal(0, (I, O), 0.5), normal(1, (O,), 0.1)
        if shared_state:
            self.p = brainstate.ParamState({"weight": w, "bias": b})
        else:
            self.w, self.b = brainstate.ParamState(w), brainstate.ParamState(b)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros((O,) if batch_size is None else (batch_size, O)))

    def params(self) -> tuple[Any, Any]:
        if self.shared_state:
            return self.p.value["weight"], self.p.value["bias"]
        return self.w.value, self.b.value

    def update(self, x: Any) -> Any:
        w, b = self.params()
        self.v.value = LAM * self.v.value + braintrace.matmul(x, w, b)
        return self.v.value

    def queries(self) -> list[Any]:
        return [self.p] if self.shared_state else [self.w, self.b]


def _run(learner: Any, x: Any, steps: int) -> None:
    brainstate.transform.jit(lambda: [learner(x) for _ in range(steps)])()


@pytest.mark.parametrize("shared_state", [False, True], ids=["separate-states", "one-state"])
@pytest.mark.parametrize("batch", [None, B], ids=["unbatched", "batched"])
def test_d_rtrl_bias_trace_is_the_geometric_sum(shared_state: bool, batch: int | None) -> None:
    model = LeakyBias(shared_state)
    x = normal(2, (I,) if batch is None else (batch, I))
    learner = compile_quiet(model, braintrace.D_RTRL, x, batch_size=batch)
    n = 3
    _run(learner, x, n)
    lead = () if batch is None else (batch,)
    expected = np.full((*lead, O, 1), sum(LAM**j for j in range(n)))
    for query in model.queries():
        (trace,) = learner.get_etrace_of(query).values()
        assert set(trace) == {"weight", "bias"}
        assert trace["weight"].shape == (*lead, I, O, 1)
        np.testing.assert_allclose(trace["bias"], expected, rtol=1e-6)
    learner.reset_state()
    (trace,) = learner.get_etrace_of(model.queries()[-1]).values()
    assert set(trace) == {"weight", "bias"} and not np.any(np.asarray(trace["bias"]))


@pytest.mark.parametrize("batch", [None, B], ids=["unbatched", "batched"])
def test_pp_prop_df_trace_queried_through_the_bias(batch: int | None) -> None:
    model = LeakyBias(shared_state=False)
    x = normal(2, (I,) if batch is None else (batch, I))
    alpha, n = 0.8, 3
    learner = compile_quiet(model, braintrace.pp_prop, x, batch_size=batch, decay_or_rank=alpha)
    _run(learner, x, n)
    xs_w, dfs_w = learner.get_etrace_of(model.w)
    xs_b, dfs_b = learner.get_etrace_of(model.b)
    assert xs_b.keys() == xs_w.keys() and dfs_b.keys() == dfs_w.keys() and dfs_b
    lead = () if batch is None else (batch,)
    # ε_f ← α (λ ε_f) + (1 − α) df with df = 1.
    expected = (1 - alpha) * sum((alpha * LAM) ** j for j in range(n))
    (eps_f,) = dfs_b.values()
    np.testing.assert_allclose(eps_f, np.full((*lead, O, 1), expected), rtol=1e-6)


# --- every learner exposes every key --------------------------------------------------------

#: Every public learner, with the options it needs.
LEARNERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "D_RTRL": (braintrace.D_RTRL, {}),
    "pp_prop": (braintrace.pp_prop, {"decay_or_rank": 0.9}),
    "EProp": (braintrace.EProp, {}),
    "OSTLRecurrent": (braintrace.OSTLRecurrent, {}),
    "OSTLFeedforward": (braintrace.OSTLFeedforward, {}),
    "OTTT": (braintrace.OTTT, {"leak": 0.5}),
    "OTPE": (braintrace.OTPE, {"leak": 0.5}),
}
#: Learners whose traces are dictionaries with one entry per trainable key.
PER_KEY = {"D_RTRL", "EProp", "OSTLRecurrent"}
#: Families the dense-only rules accept.
DENSE_ONLY = {"OTTT", "OTPE"}


def _sweep_cases() -> list[Any]:
    rows = [r for r in ROWS if r.id in {
        "mm-bias", "elemwise", "grouped-bias", "embedding", "lora-alpha2-bias-hooks",
        "einsum-per-head-diagonal", "conv2d-nhwc-bias", "sparse-csr-bias",
    }]
    cases = [pytest.param(row, name, id=f"{row.id}-{name}") for row in rows for name in LEARNERS if name not in DENSE_ONLY]
    # The dense-only rules need a leak that is not a trainable operation.
    return cases + [pytest.param(None, name, id=f"leaky-bias-{name}") for name in sorted(LEARNERS)]


def _learner(row: Row | None, name: str, batched: bool) -> tuple[Any, Any]:
    cls, options = LEARNERS[name]
    if row is None:
        batch = B if batched else None
        xs = normal(2, (T, I) if batch is None else (T, batch, I))
        return compile_quiet(LeakyBias(shared_state=False), cls, xs[0], batch_size=batch, **options), xs
    make, xs, batch = _setup(row, batched)
    return compile_quiet(make(), cls, xs[0], batch_size=batch, **options), xs


@pytest.mark.parametrize("row, name", _sweep_cases())
def test_get_etrace_of_has_an_entry_for_every_trainable_key(row: Row | None, name: str) -> None:
    learner, xs = _learner(row, name, batched=True)
    for rel in learner.graph.hidden_param_op_relations:
        for key, path in rel.trainable_paths.items():
            found = learner.get_etrace_of(path)
            if name in PER_KEY:
                assert found and all(set(trace) == set(rel.trainable_paths) for trace in found.values())
            elif isinstance(found, tuple):  # pp_prop family: (x traces, df traces)
                assert found[1]
            else:
                assert found
            if name == "OTTT" and key == "bias":
                assert -1 in found


@pytest.mark.parametrize("row, name", _sweep_cases())
def test_named_etraces_are_keyed_by_parameter_path_and_hidden_group(row: Row | None, name: str) -> None:
    learner, xs = _learner(row, name, batched=True)
    learner(xs[0])
    named = learner.named_etraces()
    relations = learner.graph.hidden_param_op_relations
    assert set(named) == {(p, g.index) for rel in relations for p in rel.trainable_paths.values() for g in rel.hidden_groups}
    for rel in relations:
        for path in rel.trainable_paths.values():
            by_id = learner.get_etrace_of(path)
            for group in rel.hidden_groups:
                leaves = jax.tree.leaves(named[(path, group.index)])
                assert leaves and all(any(leaf is other for other in jax.tree.leaves(by_id)) for leaf in leaves)


@pytest.mark.parametrize("row, name", _sweep_cases())
def test_reset_state_with_a_batch_size_resizes_every_batched_trace(row: Row | None, name: str) -> None:
    learner, xs = _learner(row, name, batched=True)
    learner(xs[0])
    learner.reset_state(batch_size=7)
    traces = learner.states(braintrace.EligibilityTrace)
    for path, st in traces.items():
        for leaf in jax.tree.leaves(st.value):
            if leaf.ndim:  # OTTT's bias trace is a scalar
                assert leaf.shape[0] == 7, (path, leaf.shape)
                assert not np.any(np.asarray(leaf))


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_reset_state_keeps_the_shape_of_traces_without_a_batch_axis(name: str) -> None:
    learner, xs = _learner(None, name, batched=False)
    before = _trace_shapes(learner)
    learner.reset_state(batch_size=7)
    assert _trace_shapes(learner) == before


def _trace_shapes(learner: Any) -> dict[Any, list[tuple[int, ...]]]:
    traces = learner.states(braintrace.EligibilityTrace)
    return {path: [leaf.shape for leaf in jax.tree.leaves(st.value)] for path, st in traces.items()}


# --- traces at their final shape ------------------------------------------------------------


class SharedInput(brainstate.nn.Module):
    """``h ← σ(leak) h + tanh(x W)`` with an unbatched ``x`` driving a batched ``h``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (I, O), 0.5))
        self.leak = brainstate.ParamState(normal(1, (B, O)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(normal(3, (batch_size, O), 0.5))

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value))
        return self.h.value


def test_an_unbatched_operation_on_a_batched_state_gets_per_sample_traces(x64: None) -> None:
    xs = normal(4, (T, I))
    learner = compile_quiet(SharedInput(), braintrace.D_RTRL, xs[0], batch_size=B)
    (trace,) = learner.get_etrace_of(("w",)).values()
    assert trace["weight"].shape == (B, I, O, 1)  # before any call: the shape it keeps
    got = single_step_grads(learner, xs)  # a scan carries the traces
    (trace,) = learner.get_etrace_of(("w",)).values()
    assert trace["weight"].shape == (B, I, O, 1)
    ref = bptt_grads(SharedInput(), xs, batch_size=B)
    assert max_rel_err(ref, got) < 1e-10


# --- outputs with a batch of one over an unbatched state ---------------------------------------

MAP = (6, 6, 2)


class ConvMap(brainstate.nn.Module):
    """``h = tanh(conv(h) + x)`` on an unbatched feature map, read out by ``Linear`` on ``h.ravel()``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = braintrace.nn.Conv2d(in_size=MAP, out_channels=MAP[-1], kernel_size=3, padding="SAME",
                                         b_init=braintools.init.Constant(0.1))
        self.out = braintrace.nn.Linear(int(np.prod(MAP)), 2)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(normal(5, MAP, 0.5))

    def update(self, x: Any) -> Any:
        self.h.value = jnp.tanh(self.conv(self.h.value) + x)
        return self.out(self.h.value.reshape(-1))


CONV_LEARNERS = ["D_RTRL", "pp_prop", "EProp", "OSTLRecurrent", "OSTLFeedforward"]


def _one_step_grads(model: brainstate.nn.Module, x: Any) -> dict[Any, Any]:
    params = model.states(brainstate.ParamState)
    return brainstate.transform.jit(brainstate.transform.grad(lambda: jnp.sum(model(x) ** 2), params))()


@pytest.mark.parametrize("name", CONV_LEARNERS)
def test_an_unbatched_map_through_conv2d_learns_one_exact_step(name: str) -> None:
    x = normal(6, MAP, 0.5)
    with brainstate.random.seed_context(0):
        reference_model = ConvMap()
    brainstate.nn.init_all_states(reference_model)
    ref = _one_step_grads(reference_model, x)
    with brainstate.random.seed_context(0):
        model = ConvMap()
    cls, options = LEARNERS[name]
    learner = compile_quiet(model, cls, x, batch_size=1, **options)
    one_step = brainstate.transform.grad(lambda: jnp.sum(learner(x) ** 2), learner.param_states)
    got = brainstate.transform.jit(one_step)()  # one compilation instead of one per operation
    assert set(got) == set(ref)
    for path in ref:
        for a, b in zip(jax.tree.leaves(ref[path]), jax.tree.leaves(got[path])):
            assert np.any(np.asarray(a) != 0)
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def _batch_of_one(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda x, w: op(x[None], w)[0]


BATCH_OF_ONE = {
    "matmul": (lambda x, w: braintrace.matmul(x, w), (I, O), (I,)),
    "grouped": (lambda x, w: braintrace.grouped_matmul(x, w), (2, I, O), (2, I)),
    "conv1d": (lambda x, w: braintrace.conv(x, w, padding="SAME"), (O, 2, 3), (2, 5)),  # NCH / OIH
}


class BatchOfOne(brainstate.nn.Module):
    """``h ← σ(leak) h + tanh(op(x[None], W)[0])`` on an unbatched state."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        op, w_shape, x_shape = BATCH_OF_ONE[kind]
        self.op = _batch_of_one(op)
        self.w = brainstate.ParamState(normal(0, w_shape, 0.5))
        self.y_shape = tuple(jax.eval_shape(self.op, jnp.zeros(x_shape), self.w.value).shape)
        self.leak = brainstate.ParamState(normal(1, self.y_shape))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.y_shape))

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(self.op(x, self.w.value))
        return self.h.value


@pytest.mark.parametrize("kind", sorted(BATCH_OF_ONE))
def test_a_batch_of_one_over_an_unbatched_state_keeps_d_rtrl_exact(kind: str, x64: None) -> None:
    xs = normal(7, (T, *BATCH_OF_ONE[kind][2]))
    ref = bptt_grads(BatchOfOne(kind), xs)
    learner = compile_quiet(BatchOfOne(kind), braintrace.D_RTRL, xs[0])
    assert max_rel_err(ref, single_step_grads(learner, xs)) < 1e-10
    ref1 = bptt_grads(BatchOfOne(kind), xs[:1])
    pp = compile_quiet(BatchOfOne(kind), braintrace.pp_prop, xs[0], decay_or_rank=0.8)
    assert max_rel_err(ref1, single_step_grads(pp, xs[:1])) < 1e-10
