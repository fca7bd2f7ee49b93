"""DNI, SyntheticGradient and train_synthetic_gradient against BPTT and multi-step D_RTRL.

The model (:class:`PlainAndEtpRNN`) has a plain input weight (outside any ETP operation), an
ETP recurrent weight and a plain readout; sequences of ``T = 8`` steps are driven in windows of
2 (a single window over the whole sequence would be exact reverse mode for every rule).

* **B1** a zero synthesiser is multi-step D_RTRL bit for bit; a constant one moves the plain input
  weight and leaves the readout and the ETP weight bit-identical.
* **B2** an oracle synthesiser (the true future hidden gradient at every window exit, by BPTT)
  makes the plain keys equal BPTT in float64, where the zero synthesiser does not; the ETP key
  stays bit-identical to D_RTRL.
* **B3** a synthesiser fitted with ``train_synthetic_gradient`` aligns the plain gradient with BPTT
  better than the zero one on a held-out sequence; the model does not move; the regression error
  falls; a fit at one window length refuses another (F-35).
* **B5** structure: routing, tracing, refusals, the coordinate, compile integration.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import brainstate
import braintools
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._compatible_imports import subjaxprs
from tests.algorithm.bptt import bptt_grads, cosine, max_rel_err, normal, x64

__all__ = ["x64"]  # the fixture is used by name

# The plain input weight is the subject: its "learns only within the window" warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore:The weight .* through plain JAX operations:UserWarning")

T, CHUNK, N_IN, N_HID, N_OUT = 8, 2, 3, 4, 2
H0 = 0.3
W_IN, W_REC, W_OUT = ("w_in",), ("w_rec",), ("w_out",)
Grads = dict[tuple[Any, ...], np.ndarray]


# --- the model, its loss and its exact future gradients ------------------------------------


class PlainAndEtpRNN(brainstate.nn.Module):
    """``h = tanh(x @ W_in + matmul(h, W_rec))``, ``out = h @ W_out``: plain, ETP, plain."""

    def __init__(self, dtype: Any = None) -> None:
        super().__init__()
        self.w_in = brainstate.ParamState(jnp.asarray(normal(0, (N_IN, N_HID), 0.6), dtype))
        self.w_rec = brainstate.ParamState(jnp.asarray(normal(1, (N_HID, N_HID), 0.5), dtype))
        self.w_out = brainstate.ParamState(jnp.asarray(normal(2, (N_HID, N_OUT), 0.5), dtype))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.full((N_HID,), H0, self.w_in.value.dtype))

    def update(self, x: Any) -> Any:
        self.h.value = jnp.tanh(x @ self.w_in.value + braintrace.matmul(self.h.value, self.w_rec.value))
        return self.h.value @ self.w_out.value


def inputs(seed: int, steps: int = T) -> jax.Array:
    return normal(seed, (steps, N_IN))


TARGETS = normal(50, (64, N_OUT))


def target_error(out: Any, target: Any) -> jax.Array:
    """One step's loss: half the squared error against the step's target."""
    return 0.5 * jnp.sum((out - target) ** 2)


def squares(out: Any, target: Any) -> jax.Array:
    """One step's loss ``Σ out²`` (the default of train_synthetic_gradient; the target is unused)."""
    return jnp.sum(out ** 2)


def at_step(error: Any) -> Any:
    """``error`` as ``loss(t, out)`` against ``TARGETS[t]`` (the BPTT oracle's form)."""
    return lambda t, out: error(out, TARGETS[t].astype(out.dtype))


loss = at_step(target_error)


def future_gradients(model: PlainAndEtpRNN, xs: jax.Array, chunk: int) -> jax.Array:
    """``(K, N_HID, 1)``: ``∂(Σ_{t ≥ b_k} l_t)/∂h^{b_k}`` at every window exit ``b_k`` (BPTT)."""
    w_in, w_rec, w_out = model.w_in.value, model.w_rec.value, model.w_out.value
    windows = xs.shape[0] // chunk

    def total(eps: jax.Array) -> jax.Array:
        h, acc = jnp.full((N_HID,), H0, w_in.dtype), jnp.zeros((), w_in.dtype)
        for t in range(xs.shape[0]):
            h = jnp.tanh(xs[t] @ w_in + h @ w_rec)
            acc = acc + loss(t, h @ w_out)  # the exit step's own loss is inside the window
            if (t + 1) % chunk == 0:
                h = h + eps[(t + 1) // chunk - 1]
        return acc

    return jax.jit(jax.grad(total))(jnp.zeros((windows, N_HID), w_in.dtype))[..., None]


# --- synthesisers plugged in through the override seam --------------------------------------


class ConstantSynth(braintrace.SyntheticGradient):
    """Predicts ``values[gi]`` everywhere in group ``gi``."""

    def __init__(self, group_shapes: dict[int, tuple[int, ...]], values: dict[int, float]) -> None:
        super().__init__(group_shapes)
        self.values = values

    def apply(self, param_values: Any, group_hiddens: Any) -> dict[int, jax.Array]:
        return {i: jnp.full_like(h, self.values[i]) for i, h in group_hiddens.items()}


class OracleSynth(braintrace.SyntheticGradient):
    """Predicts, at the exit of window ``k`` (the learner's call counter), ``table[k]``."""

    def __init__(self, group_shapes: dict[int, tuple[int, ...]], table: jax.Array, counter: Any) -> None:
        super().__init__(group_shapes)
        self.table, self.counter = table, counter

    def param_values(self) -> Any:
        return {"table": self.table, "k": self.counter.value}

    def apply(self, param_values: Any, group_hiddens: Any) -> dict[int, jax.Array]:
        return {0: param_values["table"][param_values["k"]].astype(group_hiddens[0].dtype)}


class ShapeSynth(braintrace.SyntheticGradient):
    """Returns zeros of ``shape`` whatever the group (a wrong output shape)."""

    def __init__(self, group_shapes: dict[int, tuple[int, ...]], shape: tuple[int, ...]) -> None:
        super().__init__(group_shapes)
        self.shape = shape

    def apply(self, param_values: Any, group_hiddens: Any) -> dict[int, jax.Array]:
        return {i: jnp.zeros(self.shape, h.dtype) for i, h in group_hiddens.items()}


def dni(synth_factory: Any = None, dtype: Any = None, model: Any = None) -> Any:
    learner = braintrace.compile(PlainAndEtpRNN(dtype) if model is None else model, "dni", inputs(0)[0])
    shapes = learner.group_signal_shapes()
    learner.attach_synthesizer(braintrace.SyntheticGradient(shapes) if synth_factory is None
                               else synth_factory(shapes, learner))
    return learner


def d_rtrl(dtype: Any = None) -> Any:
    return braintrace.compile(PlainAndEtpRNN(dtype), braintrace.D_RTRL, inputs(0)[0], vjp_method="multi-step")


@functools.lru_cache(maxsize=None)
def d_rtrl_float32_grads() -> Grads:
    """Multi-step D_RTRL's window gradients on ``inputs(1)`` (float32), shared by the tests below."""
    return run_windows(d_rtrl(jnp.float32), inputs(1))


def run_windows(learner: Any, xs: jax.Array, error: Any = target_error) -> Grads:
    """``Σ_windows grad(Σ_{t in window} error(out_t, TARGETS[t]))``: one learner call per window of ``CHUNK``."""
    ys = TARGETS[: xs.shape[0]].astype(xs.dtype)

    def step_fn(x: jax.Array, y: jax.Array) -> jax.Array:
        return jax.vmap(error)(learner(braintrace.MultiStepData(x)), y)

    grads = brainstate.transform.jit(
        lambda: learner.etrace_grad(xs, ys, step_fn=step_fn, chunk_size=CHUNK, reduction="sum"))()
    return {p: np.asarray(u.get_mantissa(g)) for p, g in grads.items()}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


# --- B1 ---------------------------------------------------------------------------------------


def test_zero_synthesiser_is_multistep_d_rtrl_bit_for_bit() -> None:
    xs = inputs(1)
    got, ref = run_windows(dni(), xs), d_rtrl_float32_grads()
    assert set(got) == set(ref) == {W_IN, W_REC, W_OUT}
    for key in ref:
        np.testing.assert_array_equal(got[key], ref[key], err_msg=str(key))


def test_constant_synthesiser_moves_only_the_plain_input_weight() -> None:
    xs = inputs(1)
    got = run_windows(dni(lambda s, _: ConstantSynth(s, {0: 0.5})), xs)
    ref = d_rtrl_float32_grads()
    assert rel(ref[W_IN], got[W_IN]) > 1e-3
    np.testing.assert_array_equal(got[W_OUT], ref[W_OUT])  # the readout does not reach h
    np.testing.assert_array_equal(got[W_REC], ref[W_REC])  # ETP: its future credit is in the trace


# --- B2 ---------------------------------------------------------------------------------------


def test_oracle_synthesiser_makes_plain_keys_bptt_and_keeps_etp_keys(x64: None) -> None:
    xs = inputs(1)
    table = future_gradients(PlainAndEtpRNN(), xs, CHUNK)
    assert float(jnp.max(jnp.abs(table[-1]))) == 0.0  # nothing follows the last window
    assert float(jnp.max(jnp.abs(table[0]))) > 1e-2
    oracle = run_windows(dni(lambda s, learner: OracleSynth(s, table, learner.running_index)), xs)
    zero = run_windows(dni(), xs)  # multi-step D_RTRL bit for bit (B1)
    bptt = bptt_grads(PlainAndEtpRNN(), xs, loss)
    plain = [W_IN, W_OUT]
    assert max_rel_err({k: bptt[k] for k in plain}, {k: oracle[k] for k in plain}) < 1e-10
    assert rel(bptt[W_IN], zero[W_IN]) > 1e-3  # the window truncates the plain input weight
    np.testing.assert_array_equal(oracle[W_REC], zero[W_REC])
    assert rel(bptt[W_REC], oracle[W_REC]) > 1e-3  # diagonal D_RTRL's, not BPTT's


# --- B3 ---------------------------------------------------------------------------------------


def params_of(learner: Any) -> dict[Any, np.ndarray]:
    return {p: np.asarray(st.value) for p, st in learner.param_states.items()}


def test_trained_synthesiser_aligns_plain_gradient_with_bptt_on_held_out_data() -> None:
    train, held_out = normal(7, (40, N_IN)), inputs(9)
    learner = dni(lambda s, _: braintrace.SyntheticGradient(s, scale=0.0))
    before = params_of(learner)
    errors = braintrace.train_synthetic_gradient(learner, train, chunk_size=CHUNK, epochs=30, lr=0.1)
    assert errors[-1] < errors[0]  # the bootstrapped targets keep part of the error irreducible
    after = params_of(learner)
    for p in before:
        np.testing.assert_array_equal(before[p], after[p])  # the model's parameters do not move

    learner.reset()
    trained = run_windows(learner, held_out, squares)
    zero = run_windows(dni(), held_out, squares)
    bptt = bptt_grads(PlainAndEtpRNN(), held_out, at_step(squares))
    aligned = cosine({W_IN: bptt[W_IN]}, {W_IN: trained[W_IN]})
    baseline = cosine({W_IN: bptt[W_IN]}, {W_IN: zero[W_IN]})
    assert aligned > baseline + 0.01, (aligned, baseline)


def test_a_fit_at_one_window_length_refuses_another() -> None:
    learner = dni()
    braintrace.train_synthetic_gradient(learner, inputs(2), chunk_size=1)
    assert learner.synthesizer.fitted_chunk_size == 1
    brainstate.transform.jit(learner)(inputs(3)[0])  # windows of the fitted length run
    with pytest.raises(ValueError, match=r"fitted at chunk_size=1.*window of 2 step.*chunk_size=2"):
        learner(braintrace.MultiStepData(inputs(3)[:2]))
    braintrace.train_synthetic_gradient(learner, inputs(2), chunk_size=2)
    with pytest.raises(ValueError, match=r"fitted at chunk_size=2.*window of 1 step"):
        learner(inputs(3)[0])  # a plain call is a window of one step


def test_sgd_and_a_braintools_sgd_fit_the_same() -> None:
    fits = []
    for optimizer in (None, braintools.optim.SGD(lr=0.05)):
        learner = dni(lambda s, _: braintrace.SyntheticGradient(s, scale=0.1, seed=4))
        errors = braintrace.train_synthetic_gradient(learner, inputs(2), chunk_size=CHUNK, epochs=2,
                                                     lr=0.05, optimizer=optimizer)
        fits.append((errors, {k: np.asarray(st.value) for k, st in learner.synthesizer.states_dict().items()}))
    np.testing.assert_allclose(fits[0][0], fits[1][0], rtol=1e-6)
    for key in fits[0][1]:
        np.testing.assert_allclose(fits[0][1][key], fits[1][1][key], rtol=1e-6, atol=1e-9)
    assert any(np.any(v != 0) for k, v in fits[0][1].items() if k[0] == "synth_b")  # it did train


# --- B5: routing --------------------------------------------------------------------------------


def test_synthesiser_parameters_are_in_no_relation_and_get_no_online_gradient() -> None:
    learner = dni(lambda s, _: braintrace.SyntheticGradient(s, scale=0.3, seed=1))
    synth_states = learner.synthesizer.states_dict()
    relation_paths = {p for rel_ in learner.graph.hidden_param_op_relations for p in rel_.trainable_paths.values()}
    assert not set(synth_states) & (relation_paths | set(learner.param_states))
    assert not {id(s) for s in synth_states.values()} & {id(s) for s in learner.param_states.values()}
    window = braintrace.MultiStepData(inputs(1)[:CHUNK])
    grads = brainstate.transform.jit(brainstate.transform.grad(lambda: jnp.sum(learner(window) ** 2), synth_states))()
    assert set(grads) == set(synth_states)
    for value in grads.values():
        assert not np.any(np.asarray(value))


def hidden_cotangent(learner: Any) -> np.ndarray:
    window = braintrace.MultiStepData(inputs(1)[:CHUNK])
    grads = brainstate.transform.jit(
        brainstate.transform.grad(lambda: loss(0, learner(window)[-1]), learner.hidden_states))()
    return np.asarray(grads[("h",)])


def test_returned_hidden_cotangent_carries_the_injection() -> None:
    zero = hidden_cotangent(dni())
    live = hidden_cotangent(dni(lambda s, _: ConstantSynth(s, {0: 0.5})))
    assert np.max(np.abs(live - zero)) > 1e-3


def exit_hidden_grads(learner: Any, xs: jax.Array, windows: int) -> Grads:
    """Windows of ``len(xs) // windows`` steps; the loss ``Σ h²`` reads the last exit hidden only."""
    size = xs.shape[0] // windows

    def run() -> Any:
        grads = []
        for k in range(windows):
            def last_exit(k: int = k) -> jax.Array:
                learner(braintrace.MultiStepData(xs[k * size:(k + 1) * size]))  # the output is unused
                return jnp.sum(learner.hidden_states[("h",)].value ** 2) if k == windows - 1 else jnp.zeros(())
            grads.append(brainstate.transform.grad(last_exit, learner.param_states)())
        return jax.tree.map(lambda *g: sum(g), *grads)

    return {p: np.asarray(g) for p, g in brainstate.transform.jit(run)().items()}


@pytest.mark.parametrize("make", [d_rtrl, dni], ids=["D_RTRL", "DNI"])
def test_a_loss_on_the_exit_hidden_alone_is_differentiated(make: Any) -> None:
    # The window's stacked outputs then get a zero cotangent (materialised for the scan's transpose).
    xs = inputs(1, steps=4)
    model = PlainAndEtpRNN()
    brainstate.nn.init_all_states(model)

    def bptt() -> jax.Array:
        for t in range(xs.shape[0]):
            model(xs[t])
        return jnp.sum(model.h.value ** 2)

    ref = {p: np.asarray(g) for p, g in brainstate.transform.grad(bptt, model.states(brainstate.ParamState))().items()}
    one_window = exit_hidden_grads(make(), xs, windows=1)  # one window over everything: reverse mode (F-23)
    assert max_rel_err(ref, one_window) < 1e-5
    assert rel(ref[W_IN], exit_hidden_grads(make(), xs, windows=2)[W_IN]) > 1e-3  # two windows truncate


class SharedRNN(PlainAndEtpRNN):
    """The recurrent weight also enters the step plainly (``+ 0.1·Σ W_rec``)."""

    def update(self, x: Any) -> Any:
        drive = x @ self.w_in.value + braintrace.matmul(self.h.value, self.w_rec.value)
        self.h.value = jnp.tanh(drive + 0.1 * jnp.sum(self.w_rec.value))
        return self.h.value @ self.w_out.value


def test_a_relation_parameter_used_plainly_too_gets_no_future_credit_for_that_use() -> None:
    # F-36: routing is by parameter path, so the plain use of a relation weight is not injected.
    xs = inputs(1)
    live = run_windows(dni(lambda s, _: ConstantSynth(s, {0: 0.5}), model=SharedRNN()), xs)
    ref = run_windows(braintrace.compile(SharedRNN(), braintrace.D_RTRL, xs[0], vjp_method="multi-step"), xs)
    # Equal up to the float32 rounding of two programs (JAX 0.12 orders a sum differently: 1 ulp);
    # a credit injected through the plain use would move W_rec's gradient by far more.
    np.testing.assert_allclose(live[W_REC], ref[W_REC], rtol=1e-6, atol=1e-7)
    assert rel(ref[W_IN], live[W_IN]) > 1e-3


class TwoGroups(brainstate.nn.Module):
    """Two independent tanh RNNs of widths 4 and 3, each with a plain input weight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_a = brainstate.ParamState(normal(3, (N_IN, 4), 0.6))
        self.in_b = brainstate.ParamState(normal(4, (N_IN, 3), 0.6))
        self.rec_a = brainstate.ParamState(normal(5, (4, 4), 0.5))
        self.rec_b = brainstate.ParamState(normal(6, (3, 3), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.a = brainstate.HiddenState(jnp.full((4,), H0))
        self.b = brainstate.HiddenState(jnp.full((3,), H0))

    def update(self, x: Any) -> Any:
        self.a.value = jnp.tanh(x @ self.in_a.value + braintrace.matmul(self.a.value, self.rec_a.value))
        self.b.value = jnp.tanh(x @ self.in_b.value + braintrace.matmul(self.b.value, self.rec_b.value))
        return jnp.concatenate([self.a.value, self.b.value])


def test_each_group_gets_its_own_map() -> None:
    xs = inputs(1)
    learner = braintrace.compile(TwoGroups(), "dni", xs[0])
    shapes = learner.group_signal_shapes()
    assert sorted(shapes.values()) == [(3, 1), (4, 1)]
    index_b = next(i for i, s in shapes.items() if s == (3, 1))
    synth = braintrace.SyntheticGradient(shapes, scale=0.2)
    assert {k: v.shape for k, v in synth.apply(synth.param_values(), {i: jnp.ones(s) for i, s in shapes.items()}).items()} == shapes
    learner.attach_synthesizer(ConstantSynth(shapes, {i: 0.5 if i == index_b else 0.0 for i in shapes}))

    live = run_windows(learner, xs, squares)
    ref = run_windows(braintrace.compile(TwoGroups(), braintrace.D_RTRL, xs[0], vjp_method="multi-step"), xs, squares)
    np.testing.assert_array_equal(live[("in_a",)], ref[("in_a",)])  # group a got zero
    assert rel(ref[("in_b",)], live[("in_b",)]) > 1e-3


class LeakyMV(brainstate.nn.Module):
    """``h ← 0.5 h + matmul(x, W_rec-free drive) + x @ W_in`` with ``h`` in ``unit`` (or unitless)."""

    def __init__(self, unit: Any) -> None:
        super().__init__()
        self.unit = 1.0 if unit is None else unit
        self.w_in = brainstate.ParamState(normal(0, (N_IN, N_HID), 0.6))
        self.w_etp = brainstate.ParamState(normal(1, (N_IN, N_HID), 0.6))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((N_HID,)) * self.unit)

    def update(self, x: Any) -> Any:
        drive = jnp.tanh(x @ self.w_in.value) + braintrace.matmul(x, self.w_etp.value)
        self.h.value = 0.5 * self.h.value + drive * self.unit
        return self.h.value / self.unit


def test_a_hidden_with_units_gets_the_injection_of_its_unitless_twin() -> None:
    xs = inputs(1)
    grads = []
    for unit in (u.mV, None):
        learner = braintrace.compile(LeakyMV(unit), "dni", xs[0])
        learner.attach_synthesizer(ConstantSynth(learner.group_signal_shapes(), {0: 0.5}))
        grads.append(run_windows(learner, xs, squares))
    for key in grads[1]:
        np.testing.assert_allclose(u.get_mantissa(grads[0][key]), grads[1][key], rtol=1e-6)
    plain = run_windows(braintrace.compile(LeakyMV(None), braintrace.D_RTRL, xs[0], vjp_method="multi-step"), xs,
                        squares)
    assert rel(plain[W_IN], grads[1][W_IN]) > 1e-3


class BatchedRNN(PlainAndEtpRNN):
    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.full((N_HID,) if batch_size is None else (batch_size, N_HID), H0))


def test_the_vmapped_learner_injects_per_sample() -> None:
    x = normal(8, (2, N_IN))  # one step of a batch of 2: a window of one step per sample

    def grads_of(learner: Any) -> Grads:
        fn = brainstate.transform.grad(lambda: jnp.sum(learner(x) ** 2), learner.module.param_states)
        return {p: np.asarray(g) for p, g in brainstate.transform.jit(fn)().items()}

    got = []
    for value in (0.0, 0.5):
        learner = braintrace.compile(BatchedRNN(), "dni", x, batch_size=2, vmap=True)
        assert learner.module.group_signal_shapes() == {0: (2, N_HID, 1)}
        learner.module.attach_synthesizer(ConstantSynth(learner.module.group_signal_shapes(), {0: value}))
        got.append(grads_of(learner))
    ref = grads_of(braintrace.compile(BatchedRNN(), braintrace.D_RTRL, x, batch_size=2, vmap=True,
                                      vjp_method="multi-step"))
    # Element-wise to 1e-6 here, not bit for bit: the batch reductions of a different program may
    # be ordered differently (1 ulp seen on the readout).
    for key in ref:
        np.testing.assert_allclose(got[0][key], ref[key], rtol=1e-6)
    assert rel(ref[W_IN], got[1][W_IN]) > 1e-3
    np.testing.assert_allclose(got[1][W_REC], ref[W_REC], rtol=1e-6)
    np.testing.assert_allclose(got[1][W_OUT], ref[W_OUT], rtol=1e-6)


# --- B5: tracing --------------------------------------------------------------------------------


def count_primitive(jaxpr: Any, name: str) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for sub in subjaxprs(eqn):
            total += count_primitive(sub, name)
    return total


def window_grad_dots(learner: Any) -> int:
    window = braintrace.MultiStepData(inputs(1)[:CHUNK])
    fn = brainstate.transform.grad(lambda: jnp.sum(learner(window) ** 2), learner.param_states)
    return count_primitive(brainstate.transform.make_jaxpr(fn)()[0].jaxpr, "dot_general")


class NoHookDNI(braintrace.DNI):
    def _exit_cotangent(self, aux: Any, new_hidden: Any) -> None:
        return None


def test_the_second_pass_is_traced_only_with_the_hook() -> None:
    base = window_grad_dots(d_rtrl())
    assert window_grad_dots(dni()) > base
    no_hook = braintrace.compile(PlainAndEtpRNN(), NoHookDNI, inputs(0)[0])
    no_hook.attach_synthesizer(braintrace.SyntheticGradient(no_hook.group_signal_shapes()))
    assert window_grad_dots(no_hook) == base


def test_the_training_window_body_is_traced_once_whatever_the_number_of_windows() -> None:
    counts = []
    for steps in (4, 8):
        calls = []

        def counted(out: Any) -> jax.Array:
            calls.append(1)
            return jnp.sum(out ** 2)

        learner = dni()
        errors = braintrace.train_synthetic_gradient(learner, normal(2, (steps, N_IN)), chunk_size=CHUNK,
                                                     loss_fn=counted)
        assert errors[0] > 0  # the auxiliary loss is not trivially zero
        counts.append(len(calls))
    assert counts == [1, 1], counts  # traced once, whatever the number of windows


# --- B5: refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk, match", [(3, "T=8 steps, which chunk_size=3 does not divide"),
                                          (0, "chunk_size must be >= 1, got 0")])
def test_ragged_or_empty_chunks_are_refused(chunk: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        braintrace.train_synthetic_gradient(dni(), inputs(2), chunk_size=chunk)


def test_training_refuses_a_learner_without_synthesiser_or_not_dni() -> None:
    bare = braintrace.compile(PlainAndEtpRNN(), "dni", inputs(0)[0])
    with pytest.raises(RuntimeError, match="no synthesiser.*attach_synthesizer"):
        braintrace.train_synthetic_gradient(bare, inputs(2))
    with pytest.raises(TypeError, match="must be a braintrace.DNI"):
        braintrace.train_synthetic_gradient(d_rtrl(), inputs(2))
    with pytest.raises(TypeError, match="one array"):
        braintrace.train_synthetic_gradient(dni(), [inputs(2)])


def test_a_call_without_synthesiser_is_refused() -> None:
    bare = braintrace.compile(PlainAndEtpRNN(), "dni", inputs(0)[0])
    with pytest.raises(RuntimeError, match=r"attach_synthesizer.*synthesizer="):
        bare(inputs(1)[0])


@pytest.mark.parametrize("shape, wrong", [((5, 1), "(5, 1)"), ((4, 2), "(4, 2)")])
def test_attach_checks_group_shapes(shape: tuple[int, ...], wrong: str) -> None:
    learner = braintrace.compile(PlainAndEtpRNN(), "dni", inputs(0)[0])
    with pytest.raises(ValueError, match=rf"group 0 has shape {re.escape(wrong)}.*group 0 has shape \(4, 1\)"):
        learner.attach_synthesizer(braintrace.SyntheticGradient({0: shape}))
    with pytest.raises(ValueError, match=r"group 1 has shape \(4, 1\).*None"):
        learner.attach_synthesizer(braintrace.SyntheticGradient({0: (4, 1), 1: (4, 1)}))
    with pytest.raises(ValueError, match=rf"group 0 has shape {re.escape(wrong)}"):  # given before compiling
        braintrace.compile(PlainAndEtpRNN(), "dni", inputs(0)[0],
                           synthesizer=braintrace.SyntheticGradient({0: shape}))
    with pytest.raises(TypeError, match="SyntheticGradient"):
        learner.attach_synthesizer(object())  # type: ignore[arg-type]


def test_an_estimate_of_the_wrong_shape_is_refused_before_splitting() -> None:
    learner = dni(lambda s, _: ShapeSynth(s, (4, 2)))  # a wider state axis must not be truncated
    with pytest.raises(ValueError, match=r"estimate for hidden group 0 has shape \(4, 2\).*\(4, 1\)"):
        learner(inputs(1)[0])


def test_single_step_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="injected at the exit of a multi-step window"):
        braintrace.DNI(PlainAndEtpRNN(), vjp_method="single-step")
    with pytest.raises(ValueError, match="multi-step"):
        braintrace.compile(PlainAndEtpRNN(), "dni", inputs(0)[0], vjp_method="single-step")


def test_group_signal_shapes_needs_compile() -> None:
    with pytest.raises(ValueError, match="group_signal_shapes.*not compiled"):
        braintrace.DNI(PlainAndEtpRNN()).group_signal_shapes()


@pytest.mark.parametrize("args, error, match", [
    (({},), TypeError, "non-empty dict"),
    (({"0": (4, 1)},), TypeError, "group indices must be ints"),
    (({0: (4, 0)},), ValueError, "positive ints"),
    (({0: "ab"},), TypeError, "tuple of ints"),
    (({0: (4, 1)}, None, -1.0), ValueError, "scale must be a finite float >= 0"),
    (({0: (4, 1)}, None, "1"), TypeError, "scale must be a float"),
    (({0: (4, 1)}, 0), ValueError, "hidden_width"),
    (({0: (4, 1)}, None, 0.0, 1.5), TypeError, "seed must be an int"),
])
def test_synthetic_gradient_checks_its_arguments(args: tuple[Any, ...], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        braintrace.SyntheticGradient(*args)


def test_synthetic_gradient_apply_checks_the_mixed_axes() -> None:
    synth = braintrace.SyntheticGradient({0: (2, 4, 1)}, scale=0.1)
    assert synth.apply(synth.param_values(), {0: jnp.ones((5, 4, 1))})[0].shape == (5, 4, 1)  # leading axes shared
    with pytest.raises(ValueError, match=r"group 0 has shape \(2, 4, 2\).*\(2, 4, 1\)"):
        synth.apply(synth.param_values(), {0: jnp.ones((2, 4, 2))})
    with pytest.raises(ValueError, match="no map for hidden group 3"):
        synth.apply(synth.param_values(), {3: jnp.ones((2, 4, 1))})


def test_synthetic_gradient_draws_and_dtypes() -> None:
    a, b = (braintrace.SyntheticGradient({0: (3, 2)}, scale=0.5, seed=s) for s in (1, 1))
    w = a.param_values()["w"][0]
    assert w.shape == (6, 6) and w.dtype == jnp.float32
    np.testing.assert_array_equal(w, b.param_values()["w"][0])  # the seed decides the draw
    assert not np.array_equal(w, braintrace.SyntheticGradient({0: (3, 2)}, scale=0.5, seed=2).param_values()["w"][0])
    assert float(jnp.std(w)) > 0.1
    out = a.apply(a.param_values(), {0: jnp.ones((3, 2), jnp.bfloat16)})[0]
    assert out.dtype == jnp.bfloat16  # cast back to the hidden's dtype


# --- B5: the coordinate and compile -----------------------------------------------------------


def test_coordinate_and_compile() -> None:
    learner = braintrace.compile(PlainAndEtpRNN(), "dni", inputs(0)[0])
    assert type(learner) is braintrace.DNI and learner.vjp_method == "multi-step"
    config = learner.config
    assert (config.trace_factorization, config.temporal_recursion, config.recurrence_scope,
            config.learning_signal, config.trace_filter, config.update_schedule) == (
        "per_param", "jacobian", "diagonal", "bootstrapped", "none", "per_step")
    assert config.decay is None and config.kappa is None and config.sparse_n is None
    assert config == braintrace.ETraceConfig(learning_signal="bootstrapped") != braintrace.D_RTRL(PlainAndEtpRNN()).config
    assert isinstance(learner, braintrace.ParamDimVjpAlgorithm)
    with pytest.raises(NotImplementedError, match="braintrace.DNI"):
        braintrace.compile(PlainAndEtpRNN(), braintrace.ETraceConfig(learning_signal="bootstrapped"), inputs(0)[0])
    with pytest.raises(TypeError, match="no option 'config'"):
        braintrace.DNI(PlainAndEtpRNN(), config=braintrace.ETraceConfig())
