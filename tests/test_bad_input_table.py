"""Every public entry point refuses inputs of the wrong shape, dtype or batch at the call.

One row per (entry point, kind of mistake): the call, the library error it must raise, and the
expected and received values its message must name. A row whose mistake JAX itself would
accept (an integer input to a layer, which promotes) is not a mistake and has no row.
"""

from __future__ import annotations

from typing import Any, Callable

import braintools
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace

B, N_IN, N_OUT, T = 2, 3, 4, 5


def learner() -> Any:
    return braintrace.compile(braintrace.nn.ValinaRNNCell(N_IN, N_OUT), braintrace.D_RTRL, jnp.ones((B, N_IN)),
                              batch_size=B)


def step_loss(net: Any) -> Callable[[Any], Any]:
    return lambda x: jnp.mean(net(x) ** 2)


def call(x: Any) -> Any:
    return learner()(x)


def evolve(xs: Any) -> Any:
    return learner().etrace_evolve(xs)


def grad(xs: Any, **kw: Any) -> Any:
    net = learner()
    return net.etrace_grad(xs, step_fn=step_loss(net), **kw)


def train(xs: Any) -> Any:
    net = learner()
    return net.etrace_train(xs, step_fn=step_loss(net), optimizer=braintools.optim.SGD(0.1))


def audit(xs: Any) -> Any:
    net = learner()
    return braintrace.check_gradients(net, xs, step_fn=step_loss(net))


def compile_for(x: Any, batch_size: int | None = B) -> Any:
    return braintrace.compile(braintrace.nn.ValinaRNNCell(N_IN, N_OUT), braintrace.D_RTRL, x, batch_size=batch_size)


def load_into_other(tmp: str) -> Any:
    path = braintrace.save_checkpoint(f"{tmp}/a.ckpt", learner())
    other = braintrace.compile(braintrace.nn.ValinaRNNCell(N_IN, N_OUT + 1), braintrace.D_RTRL, jnp.ones((B, N_IN)),
                               batch_size=B)
    return braintrace.load_checkpoint(path, other)


SEQ = (T, B, N_IN)
ROWS: list[tuple[str, Callable[[], Any], type, tuple[str, ...]]] = [
    # learner(x), one step
    ("call/shape", lambda: call(jnp.ones((B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("call/dtype", lambda: call(jnp.ones((B, N_IN), jnp.int32)), TypeError, ("float32", "int32")),
    ("call/batch", lambda: call(jnp.ones((B + 1, N_IN))), ValueError, ("(2, 3)", "(3, 3)")),
    # the drivers
    ("etrace_evolve/shape", lambda: evolve(jnp.ones((T, B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("etrace_evolve/dtype", lambda: evolve(jnp.ones(SEQ, jnp.int32)), TypeError, ("float32", "int32")),
    ("etrace_evolve/batch", lambda: evolve(jnp.ones((T, B + 1, N_IN))), ValueError, ("(2, 3)", "(3, 3)")),
    ("etrace_grad/shape", lambda: grad(jnp.ones((T, B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("etrace_grad/dtype", lambda: grad(jnp.ones(SEQ, jnp.int32)), TypeError, ("float32", "int32")),
    ("etrace_grad/batch", lambda: grad(jnp.ones((T, B + 1, N_IN))), ValueError, ("(2, 3)", "(3, 3)")),
    ("etrace_grad/mask shape", lambda: grad(jnp.ones(SEQ), mask=jnp.ones(T + 1)), ValueError, ("(5,)", "(6,)")),
    ("etrace_grad/mask dtype", lambda: grad(jnp.ones(SEQ), mask=np.array(["a"] * T)), TypeError, ("<U1",)),
    ("etrace_train/shape", lambda: train(jnp.ones((T, B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("etrace_train/dtype", lambda: train(jnp.ones(SEQ, jnp.int32)), TypeError, ("float32", "int32")),
    ("etrace_train/batch", lambda: train(jnp.ones((T, B + 1, N_IN))), ValueError, ("(2, 3)", "(3, 3)")),
    ("check_gradients/shape", lambda: audit(jnp.ones((T, B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("check_gradients/batch", lambda: audit(jnp.ones((T, B + 1, N_IN))), ValueError, ("(2, 3)", "(3, 3)")),
    # compile
    ("compile/shape", lambda: compile_for(jnp.ones((B, N_IN + 2))), ValueError, ("(2, 9)", "(7, 4)")),
    ("compile/batch", lambda: compile_for(jnp.ones((B + 1, N_IN))), ValueError, ("batch_size=2", "(3, 3)")),
    # layers
    ("nn.Linear/shape", lambda: braintrace.nn.Linear(N_IN, N_OUT)(jnp.ones((B, N_IN + 2))), ValueError, ("(2, 5)", "(3, 4)")),
]


@pytest.mark.parametrize("name, thunk, error, shown", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_at_the_call(name: str, thunk: Callable[[], Any], error: type, shown: tuple[str, ...]) -> None:
    with pytest.raises(error) as info:
        thunk()
    message = str(info.value)
    for value in shown:
        assert value in message, f"{name}: {value!r} not in the message: {message}"
    assert "jax" not in type(info.value).__module__, f"{name}: a raw JAX error: {message}"


def test_checkpoint_of_another_shape_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError) as info:
        load_into_other(str(tmp_path))
    assert "expected (8, 5) float32, found (7, 4) float32" in str(info.value)


def test_the_right_inputs_pass() -> None:  # negative control: the same calls, right inputs
    assert call(jnp.ones((B, N_IN))).shape == (B, N_OUT)
    assert evolve(jnp.ones(SEQ)) is None
    assert set(grad(jnp.ones(SEQ), mask=np.ones(T, bool))) == {("W", "weight")}
    assert train(jnp.ones(SEQ)).losses.shape == (T,)
