"""Every public entry point refuses inputs of the wrong shape, dtype or batch at the call.

One row per (entry point, kind of mistake): the call, the library error it must raise, and the
expected and received values its message must name. A row whose mistake JAX itself would
accept (an integer input to a layer, which promotes) is not a mistake and has no row.
"""

from __future__ import annotations

from typing import Any, Callable

import brainevent
import brainstate
import braintools
import brainunit as u
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


def compare(xs: Any) -> Any:
    return braintrace.compare_learners(braintrace.nn.ValinaRNNCell(N_IN, N_OUT), ["d_rtrl"], xs,
                                       loss_fn=lambda out: jnp.sum(out ** 2), example_inputs=jnp.ones((B, N_IN)),
                                       batch_size=B)


def estimate(x: Any) -> Any:
    return braintrace.estimate_memory(braintrace.nn.ValinaRNNCell(N_IN, N_OUT), ["d_rtrl"], x, batch_size=B)


def stepped(make: Callable[[], Any], x: Any) -> Any:
    """One step on ``x`` of the layer ``make()`` builds, its hidden states created for a batch of ``B``."""
    with brainstate.environ.context(dt=1.0 * u.ms):
        layer = make()
        brainstate.nn.init_all_states(layer, batch_size=B)
        return layer(x)


def cell_rows(cls: type) -> list[tuple[str, Callable[[], Any], type, tuple[str, ...]]]:
    """A recurrent cell ``N_IN -> N_OUT`` at batch ``B``: too many features, then the wrong batch."""
    name = f"nn.{cls.__name__}"
    return [
        (f"{name}/shape", lambda: stepped(lambda: cls(N_IN, N_OUT), jnp.ones((B, N_IN + 2))), ValueError,
         ("(2, 3)", "(2, 5)")),
        (f"{name}/batch", lambda: stepped(lambda: cls(N_IN, N_OUT), jnp.ones((B + 1, N_IN))), ValueError,
         ("(2, 3)", "(3, 3)")),
    ]


def state_rows(cls: type, unit: Any) -> list[tuple[str, Callable[[], Any], type, tuple[str, ...]]]:
    """A neuron or synapse of ``N_OUT`` units at batch ``B``: inputs that do not broadcast onto its state."""
    name = f"nn.{cls.__name__}"
    return [
        (f"{name}/shape", lambda: stepped(lambda: cls(N_OUT), jnp.ones((B, N_OUT + 2)) * unit), ValueError,
         ("(2, 4)", "(2, 6)")),
        (f"{name}/batch", lambda: stepped(lambda: cls(N_OUT), jnp.ones((B + 1, N_OUT)) * unit), ValueError,
         ("(2, 4)", "(3, 4)")),
        # a plain input where the state carries a unit (InputUnitError, also a brainunit UnitMismatchError)
        (f"{name}/unit", lambda: stepped(lambda: cls(N_OUT), jnp.ones((B, N_OUT))), ValueError,
         (f"a quantity in {unit}", "no unit", f"x * brainunit.{unit}")),
    ]


SPARSE = brainevent.CSR.fromdense(jnp.eye(N_IN, N_OUT))
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
    ("check_gradients/dtype", lambda: audit(jnp.ones(SEQ, jnp.int32)), TypeError, ("float32", "int32")),
    ("compare_learners/shape", lambda: compare(jnp.ones((T, B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("compare_learners/dtype", lambda: compare(jnp.ones(SEQ, jnp.int32)), TypeError, ("float32", "int32")),
    ("compare_learners/batch", lambda: compare(jnp.ones((T, B + 1, N_IN))), ValueError, ("(2, 3)", "(3, 3)")),
    # memory planning
    ("estimate_memory/shape", lambda: estimate(jnp.ones((B, N_IN + 2))), braintrace.CompilationError,
     ("(2, 3)", "(2, 5)")),
    ("estimate_memory/batch", lambda: estimate(jnp.ones((B + 1, N_IN))), braintrace.CompilationError,
     ("batch_size=2", "(3, 3)")),
    ("learner_memory/shape", lambda: braintrace.learner_memory(learner(), jnp.ones((B, N_IN + 2))), ValueError,
     ("(2, 3)", "(2, 5)")),
    ("learner_memory/dtype", lambda: braintrace.learner_memory(learner(), jnp.ones((B, N_IN), jnp.int32)), TypeError,
     ("float32", "int32")),
    ("learner_memory/batch", lambda: braintrace.learner_memory(learner(), jnp.ones((B + 1, N_IN))), ValueError,
     ("(2, 3)", "(3, 3)")),
    ("learner.memory/shape", lambda: learner().memory(jnp.ones((B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("learner.memory/batch", lambda: learner().memory(jnp.ones((B + 1, N_IN))), ValueError, ("(2, 3)", "(3, 3)")),
    # compile
    ("compile/shape", lambda: compile_for(jnp.ones((B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("compile/batch", lambda: compile_for(jnp.ones((B + 1, N_IN))), ValueError, ("batch_size=2", "(3, 3)")),
    # layers
    # layers (braintrace.nn); an integer input promotes, so only Embedding has a dtype row
    ("nn.Linear/shape", lambda: braintrace.nn.Linear(N_IN, N_OUT)(jnp.ones((B, N_IN + 2))), ValueError, ("(2, 5)", "(3, 4)")),
    ("nn.SignedWLinear/shape", lambda: braintrace.nn.SignedWLinear(N_IN, N_OUT)(jnp.ones((B, N_IN + 2))), ValueError,
     ("(2, 5)", "(3, 4)")),
    ("nn.ScaledWSLinear/shape", lambda: braintrace.nn.ScaledWSLinear(N_IN, N_OUT)(jnp.ones((B, N_IN + 2))), ValueError,
     ("(2, 5)", "(3, 4)")),
    ("nn.GroupedLinear/shape", lambda: braintrace.nn.GroupedLinear(2, N_IN, N_OUT)(jnp.ones((B, 2, N_IN + 2))),
     ValueError, ("(2, 2, 5)", "(2, 3, 4)")),
    ("nn.GroupedLinear/groups", lambda: braintrace.nn.GroupedLinear(2, N_IN, N_OUT)(jnp.ones((B, 3, N_IN))),
     ValueError, ("(2, 3, 3)", "(2, 3, 4)")),
    ("nn.SparseLinear/shape", lambda: braintrace.nn.SparseLinear(SPARSE)(jnp.ones((B, N_IN + 2))), ValueError,
     ("(2, 5)", "(3, 4)")),
    ("nn.LoRA/shape", lambda: braintrace.nn.LoRA(N_IN, 2, N_OUT)(jnp.ones((B, N_IN + 2))), ValueError,
     ("(2, 5)", "(3, 2)")),
    ("nn.Embedding/dtype", lambda: braintrace.nn.Embedding(10, N_OUT)(jnp.array([1.0, 2.0])), TypeError,
     ("integers", "float32")),
    ("nn.Embedding/range", lambda: braintrace.nn.Embedding(10, N_OUT)(jnp.array([1, 10])), ValueError,
     ("index 10", "[0, 10)")),
    ("nn.Conv1d/shape", lambda: braintrace.nn.Conv1d((2, N_IN), N_OUT, 1)(jnp.ones((B, 2, N_IN + 2))), ValueError,
     ("(2, 3)", "(2, 5)")),
    ("nn.Conv1d/rank", lambda: braintrace.nn.Conv1d((2, N_IN), N_OUT, 1)(jnp.ones((B, 2, 2, N_IN))), ValueError,
     ("3D", "(2, 2, 2, 3)")),
    ("nn.Conv2d/shape", lambda: braintrace.nn.Conv2d((2, 2, N_IN), N_OUT, 1)(jnp.ones((B, 2, 2, N_IN + 2))), ValueError,
     ("(2, 2, 3)", "(2, 2, 5)")),
    ("nn.Conv2d/layout", lambda: braintrace.nn.Conv2d((2, 2, N_IN), N_OUT, 1)(jnp.ones((B, N_IN, 2, 2))), ValueError,
     ("(2, 2, 3)", "(3, 2, 2)", "channel_first=True")),
    ("nn.Conv3d/shape", lambda: braintrace.nn.Conv3d((2, 2, 2, N_IN), N_OUT, 1)(jnp.ones((B, 2, 2, 2, N_IN + 2))),
     ValueError, ("(2, 2, 2, 3)", "(2, 2, 2, 5)")),
    ("nn.LeakyRateReadout/shape", lambda: stepped(lambda: braintrace.nn.LeakyRateReadout(N_IN, N_OUT),
                                                   jnp.ones((B, N_IN + 2))), ValueError, ("(2, 3)", "(2, 5)")),
    ("nn.LeakyRateReadout/batch", lambda: stepped(lambda: braintrace.nn.LeakyRateReadout(N_IN, N_OUT),
                                                   jnp.ones((B + 1, N_IN))), ValueError, ("(2, 3)", "(3, 3)")),
    *[row for cls in (braintrace.nn.ValinaRNNCell, braintrace.nn.GRUCell, braintrace.nn.MGUCell, braintrace.nn.LSTMCell,
                      braintrace.nn.URLSTMCell, braintrace.nn.CFNCell, braintrace.nn.MinimalRNNCell,
                      braintrace.nn.MiniGRU, braintrace.nn.MiniLSTM, braintrace.nn.LRUCell)
      for row in cell_rows(cls)],
    *[row for cls in (braintrace.nn.IF, braintrace.nn.LIF, braintrace.nn.ALIF) for row in state_rows(cls, u.mA)],
    *[row for cls in (braintrace.nn.Expon, braintrace.nn.Alpha, braintrace.nn.DualExpon)
      for row in state_rows(cls, u.mS)],
]


@pytest.mark.parametrize("name, thunk, error, shown", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_at_the_call(name: str, thunk: Callable[[], Any], error: type, shown: tuple[str, ...]) -> None:
    with pytest.raises(error) as info:
        thunk()
    message = str(info.value)
    for value in shown:
        assert value in message, f"{name}: {value!r} not in the message: {message}"
    assert "jax" not in type(info.value).__module__, f"{name}: a raw JAX error: {message}"


def test_every_nn_layer_is_in_the_table() -> None:
    audited = {row[0].split("/")[0].removeprefix("nn.") for row in ROWS if row[0].startswith("nn.")}
    # VanillaRNNCell is ValinaRNNCell under its correct spelling: the class name covers both
    exported = {getattr(braintrace.nn, name).__name__ for name in braintrace.nn.__all__}
    assert exported <= audited, f"layers without a row: {sorted(exported - audited)}"


def test_checkpoint_of_another_shape_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError) as info:
        load_into_other(str(tmp_path))
    assert "expected (8, 5) float32, found (7, 4) float32" in str(info.value)


def test_the_right_inputs_pass() -> None:  # negative control: the same calls, right inputs
    assert call(jnp.ones((B, N_IN))).shape == (B, N_OUT)
    assert evolve(jnp.ones(SEQ)) is None
    assert set(grad(jnp.ones(SEQ), mask=np.ones(T, bool))) == {("W", "weight")}
    assert train(jnp.ones(SEQ)).losses.shape == (T,)


def test_the_right_layer_inputs_pass() -> None:  # negative control of the layer rows
    assert stepped(lambda: braintrace.nn.GRUCell(N_IN, N_OUT), jnp.ones((B, N_IN))).shape == (B, N_OUT)
    assert stepped(lambda: braintrace.nn.LRUCell(N_IN, N_OUT), jnp.ones((B, N_IN))).shape == (B, N_IN)
    assert stepped(lambda: braintrace.nn.LeakyRateReadout(N_IN, N_OUT), jnp.ones((B, N_IN))).shape == (B, N_OUT)
    assert stepped(lambda: braintrace.nn.LIF(N_OUT), 0.0 * u.mA).shape == (B, N_OUT)  # a scalar broadcasts
    assert stepped(lambda: braintrace.nn.Alpha(N_OUT), jnp.ones(N_OUT) * u.mS).shape == (B, N_OUT)
    assert stepped(lambda: braintrace.nn.IF(N_OUT), jnp.ones((B, N_OUT)) * u.nA).shape == (B, N_OUT)  # any current
    assert braintrace.nn.Embedding(10, N_OUT)(jnp.array([0, 9])).shape == (2, N_OUT)
    assert braintrace.nn.Conv2d((2, 2, N_IN), N_OUT, 1)(jnp.ones((2, 2, N_IN))).shape == (2, 2, N_OUT)  # unbatched
