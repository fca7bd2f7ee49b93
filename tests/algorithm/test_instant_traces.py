"""Traces without history, written once when a driver's loop ends (``carriers/instant_traces.py``).

A group whose past reaches its new state only through the relations (``h = tanh([x, h] W + b)``)
has traces ``ε^t = x^t ⊗ df^t``. In the drivers' loops each call keeps ``(x, df)`` and the trace
is written once at the loop's end. Pinned here: the drivers' gradients, losses, outputs, hidden
states and traces equal those of the same calls in a loop of the user's own (float32 at 1e-5 on
every platform, float64 at 1e-12; bfloat16 traces on an accelerator at bfloat16's resolution)
for D_RTRL, EProp (with random feedback, whose term is then ``⟨s − g, x ⊗ df⟩``, and with a
filter, whose ``ē`` is still written every step), bfloat16 traces, a model that mixes such a
group with a leaky one, and every driver; the factor states are not among the learner's states; a failed loop leaves the learner as it was; a driver
compiled once writes the trace of its own run at every run; and the traces that a gradient or
the next step reads are written every step. That the drivers' loop carries no such trace is
pinned in ``test_trace_traffic.py``.
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
from tests.algorithm.bptt import normal, x64  # noqa: F401  (a fixture)
from tests.algorithm.test_memoryless_groups import Plain
from tests.algorithm.test_trace_rule import Leaky

T, B, I, H = 5, 3, 4, 6


class PlainThenLeaky(brainstate.nn.Module):
    """A group without history (``Plain``) feeding a leaky one: only the first's trace is written once."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = Plain()
        self.w = brainstate.ParamState(normal(4, (H, H), 0.4))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.plain.init_state(batch_size)
        self.v = brainstate.HiddenState(jnp.zeros((batch_size or B, H)))

    def update(self, x: jax.Array) -> jax.Array:
        h = self.plain(x)
        self.v.value = 0.7 * self.v.value + braintrace.matmul(h, self.w.value)
        return self.v.value


def _compile(model: brainstate.nn.Module, algorithm: Any = braintrace.D_RTRL, batch: int = B, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, normal(11, (batch, I)), batch_size=batch, **options)


def _loss(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out - y) ** 2)


def _states(learner: Any) -> list[np.ndarray]:
    """The model's states, the traces (in the learner's order: their keys differ between learners)
    and the step count."""
    model = [st.value for st in brainstate.graph.states(learner.model4compile).values()]
    traces = list(learner.etrace_bwg.read().values())
    return [np.asarray(leaf) for leaf in jax.tree.leaves((model, traces, learner.running_index.value))]


def _own_loop(learner: Any, xs: jax.Array, ys: jax.Array) -> tuple[Any, list[jax.Array]]:
    """The same calls in the user's own loop (every call writes its traces): summed gradients, losses."""
    params = learner.param_states
    total = {p: jnp.zeros_like(st.value) for p, st in params.items()}
    losses = []
    for x, y in zip(xs, ys):
        grads, loss = brainstate.transform.grad(lambda: _loss(learner(x), y), params, return_value=True)()
        total = jax.tree.map(jnp.add, total, grads)
        losses.append(loss)
    return total, losses


def _close(a: Any, b: Any, tolerance: float = 1e-12) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.allclose(x, y, rtol=tolerance, atol=tolerance) for x, y in zip(la, lb))


@pytest.fixture(params=["float32", "float64"])
def tolerance(request: pytest.FixtureRequest) -> float:
    """Float32 at 1e-5 on every platform (the two programs may fuse their sums differently);
    float64 (where there is float64) at 1e-12."""
    if request.param == "float32":
        return 1e-5
    request.getfixturevalue("x64")
    return 1e-12


LEARNERS = [
    (braintrace.D_RTRL, {}),
    (braintrace.EProp, {}),
    (braintrace.EProp, {"feedback": "random", "random_feedback_key": 0}),
    (braintrace.D_RTRL, {"trace_dtype": jnp.bfloat16}),
    (braintrace.EProp, {"kappa_filter_decay": 0.8}),
]


@pytest.mark.parametrize(("algorithm", "options"), LEARNERS)
@pytest.mark.parametrize("model", [Plain, PlainThenLeaky])
def test_etrace_grad_equals_the_same_calls_in_a_loop_of_ones_own(
    tolerance: float, model: type, algorithm: Any, options: Any,
) -> None:
    tol = tolerance
    if options.get("trace_dtype") == jnp.bfloat16 and jax.default_backend() != "cpu":
        # An accelerator keeps a fused chain of bfloat16 operations in float32 and rounds once,
        # where the user's eager calls round after each operation: the two agree to bfloat16's
        # resolution (2^-8) per step, not float32's.
        tol = T * 2.0 ** -8
    xs, ys = normal(5, (T, B, I)), normal(6, (T, B, H))
    driven, own = _compile(model(), algorithm, **options), _compile(model(), algorithm, **options)
    assert len(driven._instant_relations) == 1 and len(driven.etrace_bwg) == (1 if model is Plain else 2)
    grads, losses = driven.etrace_grad(xs, ys, step_fn=lambda x, y: _loss(driven(x), y), reduction="sum",
                                         return_value=True, loss_output="per_step")
    want_grads, want_losses = _own_loop(own, xs, ys)
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(want_grads))
    assert _close(grads, want_grads, tol) and _close(losses, jnp.stack(want_losses), tol)
    assert _close(_states(driven), _states(own), tol)
    assert driven._deferred_instant == set(driven._instant_relations)


def test_etrace_train_and_etrace_evolve_leave_the_states_of_the_same_calls(x64: None) -> None:
    xs, ys = normal(5, (T, B, I)), normal(6, (T, B, H))
    trained, own = _compile(PlainThenLeaky()), _compile(PlainThenLeaky())
    trained.etrace_train(xs, ys, step_fn=lambda x, y: _loss(trained(x), y), optimizer=braintools.optim.SGD(0.1),
                         update_every=2)
    optimizer = braintools.optim.SGD(0.1)
    optimizer.register_trainable_weights(own.param_states)
    for start in range(0, T, 2):
        grads, _ = _own_loop(own, xs[start:start + 2], ys[start:start + 2])
        optimizer.update(jax.tree.map(lambda g: g / min(2, T - start), grads))
    assert _close(_states(trained), _states(own))

    evolved, own = _compile(PlainThenLeaky()), _compile(PlainThenLeaky())
    outs = evolved.etrace_evolve(xs, return_outputs=True)
    call = brainstate.transform.jit(lambda x: own(x))
    want = jnp.stack([call(x) for x in xs])
    assert _close(outs, want) and _close(_states(evolved), _states(own))


def test_the_factor_states_are_not_the_learners() -> None:
    learner = _compile(Plain())
    learner.etrace_evolve(normal(5, (T, B, I)))
    states = brainstate.graph.states(learner).values()
    assert learner._deferred_instant and {id(st) for st in learner._instant_factors.store.values()}.isdisjoint(
        id(st) for st in states)
    assert not any(leaf.shape == (B, I + H) for st in states for leaf in jax.tree.leaves(st.value))


def test_a_failed_loop_leaves_the_learner_as_it_was_and_the_next_writes_once() -> None:
    learner = _compile(Plain())
    xs = normal(5, (T, B, I))
    learner.etrace_evolve(xs[:2])
    before = _states(learner)

    def failing(x: jax.Array) -> jax.Array:
        learner(x)
        raise RuntimeError("step_fn failed")

    with pytest.raises(RuntimeError, match="step_fn failed"):
        learner.etrace_grad(xs, step_fn=failing)
    assert not learner._deferring_instant
    assert all(np.array_equal(a, b) for a, b in zip(before, _states(learner)))
    own = _compile(Plain())
    own.etrace_evolve(xs[:2])
    learner.etrace_grad(xs, step_fn=lambda x: jnp.sum(learner(x)))
    _own_loop(own, xs, jnp.zeros((T, B, H)))
    # Float32, two programs: their sums may round differently.
    assert learner._deferred_instant and _close(_states(learner), _states(own), 1e-5)


def test_a_compiled_driver_writes_the_trace_once_at_every_run(tolerance: float) -> None:
    """A program compiled once (``jit`` around ``etrace_grad``) and run twice: each run leaves the
    trace of its own last call."""
    learner, own = _compile(Plain()), _compile(Plain())
    run = brainstate.transform.jit(
        lambda xs, ys: learner.etrace_grad(xs, ys, step_fn=lambda x, y: _loss(learner(x), y), reduction="sum"))
    for seed in (5, 7):
        xs, ys = normal(seed, (T, B, I)), normal(seed + 1, (T, B, H))
        grads = run(xs, ys)
        want, _ = _own_loop(own, xs, ys)
        assert _close(grads, want, tolerance)
        assert _close(_states(learner), _states(own), tolerance)


@pytest.mark.parametrize(
    ("model", "algorithm", "options"),
    [(Leaky, braintrace.D_RTRL, {}), (Plain, braintrace.D_RTRL, {"vjp_method": "multi-step"}),
     (Plain, braintrace.D_RTRL, {"fast_solve": False}), (Plain, braintrace.ThreeFactor, {})],
)
def test_a_trace_the_gradient_or_the_next_step_reads_is_written_every_step(
    model: type, algorithm: Any, options: Any,
) -> None:
    assert not _compile(model(), algorithm, **options)._instant_relations
