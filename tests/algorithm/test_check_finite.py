"""``check_finite=True`` of the sequence drivers: stop at the first non-finite value, say where.

Each case plants one non-finite value at a known step (an input, a loss, a gradient, a trace,
an optimizer update) and checks three things: the error names the step and what went bad, the
learner's states (and in ``etrace_train`` the weights and the optimizer's state) are those of a
clean run that stopped before that step, and (negative control) the default
``check_finite=False`` lets the same value through into the states.
"""

from __future__ import annotations

from typing import Any, Callable

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import braintrace

N_IN, N_REC, T = 3, 4, 6
BAD = 3  # the step that goes bad


class LinearRNN(brainstate.nn.Module):
    """``h = 0.5 h + x W``: no squashing, so a huge finite input overflows the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.asarray(np.random.RandomState(0).randn(N_IN, N_REC), jnp.float32))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((N_REC,), jnp.float32))

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
        return self.h.value


def build(**options: Any) -> Any:
    return braintrace.compile(LinearRNN(), braintrace.D_RTRL, jnp.zeros(N_IN), **options)


def data() -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inputs ``(T, in)``, targets ``(T, rec)`` and a positive per-step scale ``(T,)``."""
    rng = np.random.RandomState(1)
    xs = jnp.asarray(rng.randn(T, N_IN) * 0.5, jnp.float32)
    ys = jnp.asarray(rng.randn(T, N_REC), jnp.float32)
    return xs, ys, jnp.ones((T,), jnp.float32)


def loss_fn(learner: Any) -> Callable[..., Any]:
    """MSE, plus ``log(c)`` (non-finite where ``c <= 0``: only the loss) and ``sqrt(c)`` of a
    zero-slope term (whose gradient is ``0 * inf`` where ``c == 0``: only the gradient)."""

    def step_fn(x: Any, y: Any, c: Any, d: Any) -> Any:
        out = learner(x)
        return jnp.mean((out - y) ** 2) + jnp.log(c) + jnp.sqrt(0.0 * jnp.sum(out) + d)

    return step_fn


def states(learner: Any) -> dict[Any, np.ndarray]:
    return {path: np.asarray(leaf) for path, st in brainstate.graph.states(learner).items()
            for leaf in jax.tree.leaves(st.value) for path in [(path, leaf.shape)]}


def assert_states_equal(a: Any, b: Any) -> None:
    sa, sb = states(a), states(b)
    assert [k[1] for k in sa] == [k[1] for k in sb]
    for (ka, va), vb in zip(sa.items(), sb.values()):
        np.testing.assert_allclose(va, vb, rtol=1e-6, atol=1e-7, err_msg=str(ka))


def poisoned(what: str) -> tuple[jax.Array, ...]:
    """The four sequences of :func:`loss_fn`, with ``what`` made non-finite at step ``BAD``."""
    xs, ys, ones = data()
    c, d = ones, ones
    if what == "input":
        xs = xs.at[BAD, 1].set(jnp.nan)
    elif what == "loss":
        c = c.at[BAD].set(0.0)  # log(0) = -inf; its gradient does not reach the weights
    elif what == "gradient":
        d = d.at[BAD].set(0.0)  # sqrt(0) = 0, but its slope is infinite
    elif what == "trace":
        xs = xs.at[BAD].set(3e38)  # finite, but h = x W overflows
    return xs, ys, c, d


@pytest.mark.parametrize("what", ["input", "loss", "gradient"])
def test_etrace_grad_stops_at_the_first_bad_value(what: str) -> None:
    seqs = poisoned(what)
    learner = build()
    with pytest.raises(braintrace.NonFiniteError) as info:
        learner.etrace_grad(*seqs, step_fn=loss_fn(learner), check_finite=True)
    assert (info.value.step, info.value.what, info.value.call) == (BAD, what, "etrace_grad")
    assert f"the {what} at step {BAD} is not finite" in str(info.value)
    clean = build()
    clean.etrace_grad(*(s[:BAD] for s in seqs), step_fn=loss_fn(clean))
    assert int(learner.running_index.value) == BAD
    assert_states_equal(learner, clean)
    # negative control: unchecked, the same data runs to the end without a word
    unchecked = build()
    grads, losses = unchecked.etrace_grad(*seqs, step_fn=loss_fn(unchecked), return_value=True)
    assert int(unchecked.running_index.value) == T
    assert not all(np.isfinite(leaf).all() for leaf in jax.tree.leaves((grads, losses)))


@pytest.mark.parametrize("driver", ["etrace_grad", "etrace_train"])
@pytest.mark.parametrize("what", ["target", "mask", "weight"])
def test_the_first_non_finite_quantity_is_named(what: str, driver: str) -> None:
    """A NaN target, mask entry or weight is named as such (each also makes the loss and the
    gradient non-finite, which must not be what is reported)."""
    xs, ys, ones = data()
    c = d = ones
    mask = jnp.ones((T,), jnp.float32)
    if what == "target":
        ys = ys.at[BAD, 0].set(jnp.nan)
    elif what == "mask":
        mask = mask.at[BAD].set(jnp.nan)
    learner = build()
    bad_step = BAD
    if what == "weight":
        learner.param_states[("w",)].value = learner.param_states[("w",)].value.at[0, 0].set(jnp.inf)
        bad_step = 0
    call = getattr(learner, driver)
    options = {"optimizer": optax.sgd(1e-3)} if driver == "etrace_train" else {}
    with pytest.raises(braintrace.NonFiniteError) as info:
        call(xs, ys, c, d, step_fn=loss_fn(learner), mask=mask, check_finite=True, **options)
    assert (info.value.step, info.value.what) == (bad_step, what)
    assert f"the {what} at step {bad_step} is not finite" in str(info.value)
    assert int(learner.running_index.value) == bad_step


def test_a_trace_that_overflows_is_reported_as_trace() -> None:
    xs = poisoned("trace")[0]
    learner = build()
    with pytest.raises(braintrace.NonFiniteError) as info:
        learner.etrace_evolve(xs, check_finite=True)
    assert (info.value.step, info.value.what) == (BAD, "trace")
    clean = build()
    clean.etrace_evolve(xs[:BAD])
    assert_states_equal(learner, clean)
    unchecked = build()
    unchecked.etrace_evolve(xs)
    assert not np.isfinite(np.asarray(unchecked.model4compile.h.value)).all()  # the overflow propagates


def test_clean_data_gives_the_unchecked_result() -> None:
    seqs = data()
    seqs = (*seqs, seqs[2])
    checked, plain = build(), build()
    g1, l1 = checked.etrace_grad(*seqs, step_fn=loss_fn(checked), check_finite=True, return_value=True)
    g2, l2 = plain.etrace_grad(*seqs, step_fn=loss_fn(plain), return_value=True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), (g1, l1), (g2, l2))
    assert_states_equal(checked, plain)


def test_etrace_train_keeps_the_last_applied_update() -> None:
    seqs = poisoned("input")
    learner = build()
    optimizer = braintools.optim.Adam(lr=0.05)
    with pytest.raises(braintrace.NonFiniteError) as info:
        learner.etrace_train(*seqs, step_fn=loss_fn(learner), optimizer=optimizer, update_every=2,
                             check_finite=True)
    assert (info.value.step, info.value.what) == (BAD, "input")
    # the update after steps 0-1 is applied; the span of steps 2-3 holds the bad step: not applied
    clean = build()
    clean_optimizer = braintools.optim.Adam(lr=0.05)
    clean.etrace_train(*(s[:2] for s in seqs), step_fn=loss_fn(clean), optimizer=clean_optimizer, update_every=2)
    clean.etrace_evolve(seqs[0][2:BAD])
    assert_states_equal(learner, clean)
    assert int(optimizer.step_count.value) == int(clean_optimizer.step_count.value) == 1
    for a, b in zip(jax.tree.leaves(optimizer.opt_state.value), jax.tree.leaves(clean_optimizer.opt_state.value)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_an_update_that_overflows_is_not_applied() -> None:
    seqs = (*data(), data()[2])
    learner = build()
    before = np.asarray(learner.model4compile.w.value)
    with pytest.raises(braintrace.NonFiniteError) as info:
        learner.etrace_train(*seqs, step_fn=loss_fn(learner), optimizer=optax.scale(np.inf), update_every=2,
                             check_finite=True)
    assert (info.value.step, info.value.what) == (1, "update")
    assert "the optimizer update after step 1" in str(info.value)
    np.testing.assert_array_equal(np.asarray(learner.model4compile.w.value), before)
    clean = build()
    clean.etrace_evolve(seqs[0][:2])
    assert_states_equal(learner, clean)
    unchecked = build()
    unchecked.etrace_train(*seqs, step_fn=loss_fn(unchecked), optimizer=optax.scale(np.inf), update_every=2)
    assert not np.isfinite(np.asarray(unchecked.model4compile.w.value)).all()


def test_window_mode_reports_the_window_start() -> None:
    xs = poisoned("input")[0]
    learner = build(vjp_method="multi-step")
    with pytest.raises(braintrace.NonFiniteError) as info:
        learner.etrace_evolve(xs, chunk_size=2, check_finite=True)
    assert (info.value.step, info.value.what) == (2, "input")  # BAD = 3 lies in the window 2-3
    assert int(learner.running_index.value) == 1  # one call, the window 0-1


def test_first_step_bad_leaves_the_learner_untouched() -> None:
    xs = data()[0].at[0, 0].set(jnp.inf)
    learner, fresh = build(), build()
    with pytest.raises(braintrace.NonFiniteError, match="as they were before the run") as info:
        learner.etrace_evolve(xs, check_finite=True)
    assert info.value.step == 0
    assert_states_equal(learner, fresh)


def test_error_is_a_floating_point_error() -> None:
    assert issubclass(braintrace.NonFiniteError, FloatingPointError)
    assert issubclass(braintrace.NonFiniteError, ValueError)


def test_check_finite_argument_errors() -> None:
    learner = build()
    with pytest.raises(TypeError, match="check_finite must be True or False, got 1 of type int"):
        learner.etrace_evolve(data()[0], check_finite=1)

    @jax.jit
    def inside(xs: jax.Array) -> Any:
        return learner.etrace_evolve(xs, check_finite=True, return_outputs=True)

    with pytest.raises(ValueError, match="check_finite=True reads the loop's outcome on the host"):
        inside(data()[0])
