"""The graph executors and the learner's call contract: input markers, errors, stacking, memory.

* ``run_call`` over ``MultiStepData`` (with a single-step argument broadcast to every step)
  equals stepping by hand; mismatched sequence lengths are rejected.
* A learner refuses what it cannot do: calls before compilation, an unknown ``vjp_method``, a
  gradient through a multi-step window with the single-step VJP.
* The output of a multi-step call is stacked over time.
* Single-step online learning runs in memory independent of the sequence length.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import normal, target_loss

B, I, O, T = 2, 3, 4, 5


class Driven(brainstate.nn.Module):
    """A leaky state driven by ``x`` (per step) and a constant ``bias_input`` (any shape that adds)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(1, (I, O), 0.5))
        self.leak = brainstate.ParamState(normal(2, (O,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((O,) if batch_size is None else (batch_size, O)))

    def update(self, x: Any, bias_input: Any = 0.0) -> Any:
        leak = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value) + bias_input)
        return self.h.value


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _learner(**options: Any) -> Any:
    return braintrace.compile(Driven(), braintrace.D_RTRL, normal(0, (B, I)), jnp.zeros(O), batch_size=B, **options)


# --- the executor -------------------------------------------------------------------------


def test_run_call_scans_multi_step_data_and_broadcasts_single_step_args() -> None:
    learner = _learner()
    ex = learner.vjp_executor
    xs, c = normal(3, (T, B, I)), normal(4, (O,))
    state0 = {p: st.value for p, st in ex.states.items()}
    outs, final, jacs, rolled = ex.run_call((braintrace.MultiStepData(xs), c), state0)
    assert rolled is None
    (xs_stack, dfs_stack), Ds_stack = jacs
    assert outs.shape == (T, B, O)
    assert all(v.shape[0] == T for v in jax.tree.leaves((xs_stack, dfs_stack, Ds_stack)))

    vals, by_hand = dict(state0), []
    for t in range(T):
        out, new_vals, _ = ex.run_step((xs[t], c), vals)
        vals.update(new_vals)
        by_hand.append(out)
    np.testing.assert_allclose(outs, jnp.stack(by_hand), rtol=1e-6, atol=1e-6)
    for p in vals:
        np.testing.assert_allclose(final[p], vals[p], rtol=1e-6, atol=1e-6)


def test_run_call_marks_single_step_data_explicitly() -> None:
    ex = _learner().vjp_executor
    xs, c = normal(3, (T, B, I)), normal(4, (O,))
    state0 = {p: st.value for p, st in ex.states.items()}
    plain = ex.run_call((braintrace.MultiStepData(xs), c), state0)[0]
    marked = ex.run_call((braintrace.MultiStepData(xs), braintrace.SingleStepData(c)), state0)[0]
    np.testing.assert_array_equal(plain, marked)


def test_mismatched_sequence_lengths_are_rejected() -> None:
    learner = _learner()
    xs, cs = normal(3, (T, B, I)), normal(4, (T - 1, O))
    with pytest.raises(ValueError, match="sequence size should be the same"):
        learner(braintrace.MultiStepData(xs), braintrace.MultiStepData(cs))


def test_executor_graph_before_compilation() -> None:
    ex = braintrace.ETraceVjpGraphExecutor(Driven())
    with pytest.raises(ValueError, match="compile_graph"):
        _ = ex.graph


def test_executor_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match="brainstate.nn.Module"):
        braintrace.ETraceGraphExecutor(lambda x: x)  # type: ignore[arg-type]


# --- learner call errors ------------------------------------------------------------------


def test_uncompiled_learner_call() -> None:
    model = Driven()
    brainstate.nn.init_all_states(model, batch_size=B)
    learner = braintrace.D_RTRL(model)
    with pytest.raises(ValueError, match="compile_graph"):
        learner(normal(0, (B, I)))


@pytest.mark.parametrize("method", ["single", "multi_step", "", None])
def test_bad_vjp_method(method: Any) -> None:
    with pytest.raises(ValueError, match="vjp_method"):
        braintrace.D_RTRL(Driven(), vjp_method=method)
    with pytest.raises(ValueError, match="vjp_method"):
        braintrace.ETraceVjpGraphExecutor(Driven(), vjp_method=method)


def test_single_step_vjp_rejects_a_gradient_through_multi_step_data() -> None:
    learner = _learner()
    xs = normal(3, (T, B, I))

    def loss() -> Any:
        return learner(braintrace.MultiStepData(xs), jnp.zeros(O)).sum()

    with pytest.raises(NotImplementedError, match="only support the input data that is at a single time step"):
        brainstate.transform.grad(loss, learner.param_states)()


@pytest.mark.parametrize(
    "args",
    [
        lambda: (normal(0, (B, I)),),
        lambda: (normal(0, (B + 1, I)), jnp.zeros(O)),
        lambda: (braintrace.MultiStepData(normal(0, (T, B + 1, I))), jnp.zeros(O)),
        lambda: (normal(0, (B, I)), jnp.zeros(O), jnp.zeros(O)),
    ],
    ids=["missing-arg", "other-batch-size", "other-batch-size-multi-step", "extra-arg"],
)
def test_inputs_must_match_the_compiled_step(args: Any) -> None:
    learner = _learner()
    with pytest.raises(ValueError, match=r"compiled for step inputs with shapes \(<\(2, 3\)>, <\(4,\)>\)"):
        learner(*args())


# --- outputs of multi-step calls ----------------------------------------------------------


@pytest.mark.parametrize("vjp_method", ["single-step", "multi-step"])
def test_multi_step_output_is_stacked_over_time(vjp_method: str) -> None:
    xs = normal(3, (T, B, I))
    windowed, stepped = _learner(vjp_method=vjp_method), _learner()
    outs = brainstate.transform.jit(lambda: windowed(braintrace.MultiStepData(xs), jnp.zeros(O)))()
    assert outs.shape == (T, B, O)
    by_step = brainstate.transform.jit(lambda: jnp.stack([stepped(xs[t], jnp.zeros(O)) for t in range(T)]))()
    np.testing.assert_allclose(outs, by_step, rtol=1e-6, atol=1e-6)
    assert int(windowed.running_index.value) == 1, "one call, one completed update"
    assert int(stepped.running_index.value) == T


def test_multi_step_output_pytree_is_stacked_leafwise() -> None:
    class Pair(Driven):
        def update(self, x: Any, bias_input: Any = 0.0) -> Any:
            h = super().update(x, bias_input)
            return {"h": h, "mean": h.mean(-1)}

    learner = braintrace.compile(Pair(), braintrace.D_RTRL, normal(0, (B, I)), batch_size=B, vjp_method="multi-step")
    outs = learner(braintrace.MultiStepData(normal(3, (T, B, I))))
    assert outs["h"].shape == (T, B, O) and outs["mean"].shape == (T, B)


# --- memory -------------------------------------------------------------------------------


def _temp_bytes(epoch: Any, steps: int) -> int:
    """Temp bytes XLA allocates for the jitted ``epoch`` over ``steps`` inputs."""
    compiled = brainstate.transform.jit(epoch).lower(normal(3, (steps, B, I))).compile()
    try:
        analysis = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        analysis = None
    if analysis is None or not hasattr(analysis, "temp_size_in_bytes"):
        pytest.skip("memory_analysis() is not available on this backend")
    return int(analysis.temp_size_in_bytes)


def _online_epoch(learner: Any) -> Any:
    """A scan of single-step updates, each with its own gradient, summed into the carry."""
    params = learner.param_states

    def epoch(xs: Any) -> Any:
        def body(acc: Any, x: Any) -> tuple[Any, None]:
            grads = brainstate.transform.grad(lambda: target_loss(0, learner(x, jnp.zeros(O))), params)()
            return jax.tree.map(jnp.add, acc, grads), None

        zeros = {p: jnp.zeros_like(st.value) for p, st in params.items()}
        return brainstate.transform.scan(body, zeros, xs)[0]

    return epoch


def _bptt_epoch(model: Any) -> Any:
    """The gradient of a loss summed over a scan of the model (stores every step)."""
    brainstate.nn.init_all_states(model, batch_size=B)
    params = model.states(brainstate.ParamState)

    def epoch(xs: Any) -> Any:
        def total() -> Any:
            def body(acc: Any, x: Any) -> tuple[Any, None]:
                return acc + target_loss(0, model(x, jnp.zeros(O))), None

            return brainstate.transform.scan(body, jnp.zeros(()), xs)[0]

        return brainstate.transform.grad(total, params)()

    return epoch


@pytest.mark.slow
def test_single_step_memory_does_not_grow_with_sequence_length() -> None:
    online = _online_epoch(_learner())
    short, long = _temp_bytes(online, 10), _temp_bytes(online, 100)
    assert long <= short + 1024, (short, long)
    # The measurement can see growth: BPTT keeps every step for its backward pass.
    bptt = _bptt_epoch(Driven())
    assert _temp_bytes(bptt, 100) > _temp_bytes(bptt, 10) + 90 * B * O * 4
