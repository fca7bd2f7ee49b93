"""ThreeFactor and ``learning_signal='modulatory'``: a modulator in place of ``∂L/∂h``.

The model: an RNN cell (its recurrent weight is an ETP relation) and a plain linear readout.
With the loss ``Σ out · v`` the hidden signal is the constant ``∂L/∂h = R v``, so a modulator
equal to it must reproduce single-step D-RTRL element-wise, and anything else must not.
"""

from __future__ import annotations

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import normal, x64  # noqa: F401

ETP = ("cell", "W", "weight")
READOUT = ("readout",)
T = 6


class Net(brainstate.nn.Module):
    def __init__(self, n_in: int = 3, n_hid: int = 4, n_out: int = 2) -> None:
        super().__init__()
        self.cell = braintrace.nn.ValinaRNNCell(n_in, n_hid)
        self.readout = brainstate.ParamState(normal(5, (n_hid, n_out)))

    def update(self, x: jax.Array) -> jax.Array:
        return self.cell(x) @ self.readout.value


class TwoGroups(brainstate.nn.Module):
    """Two stacked cells: hidden groups of 4 and 3 units."""

    def __init__(self) -> None:
        super().__init__()
        self.a = braintrace.nn.ValinaRNNCell(3, 4)
        self.b = braintrace.nn.ValinaRNNCell(4, 3)

    def update(self, x: jax.Array) -> jax.Array:
        return self.b(self.a(x))


V = np.array([1.0, -0.5])


def build(algorithm: object, batch_size: int | None = None, **kwargs: object) -> braintrace.ETraceAlgorithm:
    brainstate.random.seed(0)
    x = jnp.ones((batch_size, 3)) if batch_size else jnp.ones(3)
    return braintrace.compile(Net(), algorithm, x, batch_size=batch_size, **kwargs)


def inputs(batch_size: int | None = None) -> jax.Array:
    return normal(11, (T, batch_size, 3) if batch_size else (T, 3))


def linear_loss(out: jax.Array) -> jax.Array:
    return jnp.sum(out * jnp.asarray(V, out.dtype))


def modulated_grads(learner: braintrace.ETraceAlgorithm, mods: jax.Array, xs: jax.Array) -> dict:
    return learner.etrace_grad(xs, mods, step_fn=lambda x, m: linear_loss(learner(x, modulator=m)), reduction="sum")


def d_rtrl_grads(xs: jax.Array, batch_size: int | None = None) -> dict:
    learner = build("d_rtrl", batch_size)
    return learner.etrace_grad(xs, step_fn=lambda x: linear_loss(learner(x)), reduction="sum")


def leaves(grads: dict, path: tuple) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(grads[path])]


def autodiff_signal(learner: braintrace.ETraceAlgorithm) -> jax.Array:
    """``∂L/∂h = R v`` per step (the readout does not change during the run)."""
    return learner.param_states[READOUT].value @ jnp.asarray(V, learner.param_states[READOUT].value.dtype)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_the_autodiff_signal_as_modulator_reproduces_single_step_d_rtrl(x64: None, batch_size: int | None) -> None:
    learner = build(braintrace.ThreeFactor, batch_size)
    signal = autodiff_signal(learner)
    if batch_size:
        signal = jnp.broadcast_to(signal, (batch_size, 4))
    mods = jnp.broadcast_to(signal, (T, *signal.shape))
    got = modulated_grads(learner, mods, inputs(batch_size))
    ref = d_rtrl_grads(inputs(batch_size), batch_size)
    for path in (ETP, READOUT):
        for a, b in zip(leaves(got, path), leaves(ref, path)):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    doubled = modulated_grads(build(braintrace.ThreeFactor, batch_size), 2 * mods, inputs(batch_size))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(leaves(doubled, ETP), leaves(ref, ETP)))
    assert diff > 1e-2  # negative control: the fixture sees a wrong modulator


def test_etp_gradient_is_linear_in_the_modulator_and_zero_at_zero() -> None:
    xs = inputs()
    base = jnp.asarray(normal(3, (T, 4)))
    g1 = modulated_grads(build(braintrace.ThreeFactor), base, xs)
    g3 = modulated_grads(build(braintrace.ThreeFactor), 3 * base, xs)
    gneg = modulated_grads(build(braintrace.ThreeFactor), -base, xs)
    g0 = modulated_grads(build(braintrace.ThreeFactor), jnp.zeros((T,)), xs)
    for a, b, c, z in zip(leaves(g1, ETP), leaves(g3, ETP), leaves(gneg, ETP), leaves(g0, ETP)):
        np.testing.assert_allclose(3 * a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(-a, c, rtol=1e-6, atol=1e-7)
        assert np.all(z == 0.0)  # an exact zero: no same-step autodiff term survives
        assert np.abs(a).max() > 1e-3


def test_plain_parameters_keep_the_exact_one_step_gradient_whatever_the_modulator() -> None:
    xs = inputs()
    ref = d_rtrl_grads(xs)
    for mods in (jnp.zeros((T,)), jnp.full((T,), 2.5)):
        got = modulated_grads(build(braintrace.ThreeFactor), mods, xs)
        np.testing.assert_allclose(leaves(got, READOUT)[0], leaves(ref, READOUT)[0], rtol=1e-6)


def test_a_scalar_reward_is_not_the_symmetric_signal() -> None:
    xs = inputs()
    got = modulated_grads(build(braintrace.ThreeFactor), jnp.ones((T,)), xs)
    ref = d_rtrl_grads(xs)
    assert max(float(np.abs(a - b).max()) for a, b in zip(leaves(got, ETP), leaves(ref, ETP))) > 1e-2


def test_expansion_scalar_varshape_and_full_shape_agree_on_two_groups() -> None:
    def grads(modulator: object) -> dict:
        brainstate.random.seed(0)
        learner = braintrace.compile(TwoGroups(), braintrace.ThreeFactor, jnp.ones(3))
        return brainstate.transform.grad(
            lambda x: learner(x, modulator=modulator).sum(), learner.param_states)(jnp.ones(3))

    scalar = grads(0.7)
    for same in (jnp.full((4,), 0.7), jnp.full((4, 1), 0.7)):  # varshape, full shape
        brainstate.random.seed(0)
        net = build(braintrace.ThreeFactor)
        g_same = brainstate.transform.grad(lambda x: net(x, modulator=same).sum(), net.param_states)(jnp.ones(3))
        brainstate.random.seed(0)
        net = build(braintrace.ThreeFactor)
        g_scalar = brainstate.transform.grad(lambda x: net(x, modulator=0.7).sum(), net.param_states)(jnp.ones(3))
        for a, b in zip(leaves(g_same, ETP), leaves(g_scalar, ETP)):
            np.testing.assert_array_equal(a, b)
    assert all(np.abs(leaf).max() > 0 for leaf in jax.tree.leaves(scalar))
    with pytest.raises(ValueError, match=r"hidden group 1 \[\('b', 'h'\)\]: .*shape \(4,\).*\(3, 1\)"):
        grads(jnp.ones(4))  # fits group 0 only: group 1 is named with both shapes


def test_refusals_name_the_problem_and_the_fix() -> None:
    with pytest.raises(ValueError, match="single-step.*multi-step.*unmodulated"):
        build(braintrace.ThreeFactor, vjp_method="multi-step")
    with pytest.raises(ValueError, match="single-step"):
        build(braintrace.ETraceConfig(learning_signal="modulatory"), vjp_method="multi-step")
    learner = build(braintrace.ThreeFactor)
    with pytest.raises(RuntimeError, match="modulator=reward.*learner.modulator"):
        learner(jnp.ones(3))
    with pytest.raises(TypeError, match="no per-group spelling"):
        learner(jnp.ones(3), modulator=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"shape \(5,\).*\(4, 1\)"):
        learner(jnp.ones(3), modulator=jnp.ones(5))
    assert int(learner.running_index.value) == 0  # refused before the step ran
    with pytest.raises(TypeError, match="modulator= is read by learning_signal='modulatory'"):
        build("d_rtrl")(jnp.ones(3), modulator=1.0)


def test_keyword_wins_and_the_standing_value_persists_without_leaking() -> None:
    x = inputs()[0]

    def etp_grad(learner: braintrace.ETraceAlgorithm, **kw: object) -> np.ndarray:
        g = brainstate.transform.grad(lambda y: learner(y, **kw).sum(), learner.param_states)(x)
        return leaves(g, ETP)[1]

    standing = build(braintrace.ThreeFactor, modulator=2.0)
    assert float(standing.modulator) == 2.0
    np.testing.assert_array_equal(etp_grad(standing, modulator=-1.0), etp_grad(build(braintrace.ThreeFactor),
                                                                                modulator=-1.0))  # keyword wins
    # The next call without a keyword reads the standing value again: the per-call one did not stick.
    twin = build(braintrace.ThreeFactor)
    etp_grad(twin, modulator=-1.0)
    np.testing.assert_array_equal(etp_grad(standing), etp_grad(twin, modulator=2.0))
    assert float(standing.modulator) == 2.0
    lonely = build(braintrace.ThreeFactor)
    with pytest.raises(ValueError):
        lonely(x, modulator=jnp.ones(7))
    with pytest.raises(RuntimeError):  # the failed call left nothing behind
        lonely(x)


def test_the_standing_modulator_reaches_already_jitted_code() -> None:
    learner = build(braintrace.ThreeFactor, modulator=jnp.ones(4))
    grad = brainstate.transform.jit(
        lambda x: brainstate.transform.grad(lambda y: learner(y).sum(), learner.param_states)(x)[ETP]["weight"])
    first = np.asarray(grad(jnp.ones(3)))
    learner.reset()
    learner.modulator = jnp.zeros(4)  # same shape: read in place by the traced function
    assert np.all(np.asarray(grad(jnp.ones(3))) == 0.0)
    learner.reset()
    learner.modulator = -jnp.ones(4)
    np.testing.assert_allclose(np.asarray(grad(jnp.ones(3))), -first, rtol=1e-6)
    with pytest.raises(ValueError, match=r"shape \(4,\).*got \(2,\).*assign None first"):
        learner.modulator = jnp.ones(2)
    learner.modulator = None
    assert learner.modulator is None


def test_coordinate_and_compile_names() -> None:
    learner = build("three_factor")
    assert type(learner) is braintrace.ThreeFactor
    assert learner.config == braintrace.ETraceConfig(learning_signal="modulatory")
    assert (learner.config.trace_factorization, learner.config.temporal_recursion,
            learner.config.recurrence_scope, learner.config.trace_filter) == ("per_param", "jacobian", "diagonal", "none")
    assert type(build(braintrace.ETraceConfig(learning_signal="modulatory"))) is braintrace.ParamDimVjpAlgorithm


def test_the_config_alone_gives_the_engine_the_same_rule() -> None:
    xs = inputs()
    mods = jnp.asarray(normal(4, (T, 4)))
    by_class = modulated_grads(build(braintrace.ThreeFactor), mods, xs)
    by_config = modulated_grads(build(braintrace.ETraceConfig(learning_signal="modulatory")), mods, xs)
    for a, b in zip(leaves(by_class, ETP), leaves(by_config, ETP)):
        np.testing.assert_array_equal(a, b)


def test_io_factorized_modulatory_zero_and_linear() -> None:
    config = braintrace.ETraceConfig(trace_factorization="io_factorized", decay=0.8, learning_signal="modulatory")
    xs = inputs()
    g1 = modulated_grads(build(config), jnp.ones((T,)), xs)
    g2 = modulated_grads(build(config), 2 * jnp.ones((T,)), xs)
    g0 = modulated_grads(build(config), jnp.zeros((T,)), xs)
    for a, b, z in zip(leaves(g1, ETP), leaves(g2, ETP), leaves(g0, ETP)):
        np.testing.assert_allclose(2 * a, b, rtol=1e-5, atol=1e-7)
        assert np.all(z == 0.0) and np.abs(a).max() > 1e-3
    np.testing.assert_allclose(leaves(g0, READOUT)[0], leaves(d_rtrl_grads(xs), READOUT)[0], rtol=1e-6)


def test_descent_with_a_positive_modulator_lowers_activity_and_a_negative_one_raises_it() -> None:
    def activity_after(sign: float) -> float:
        learner = build(braintrace.ThreeFactor)
        xs = inputs()
        params = {ETP: learner.param_states[ETP]}
        for _ in range(3):
            for t in range(T):
                g = brainstate.transform.grad(lambda x: learner(x, modulator=sign).sum(), params)(xs[t])
                for p, st in params.items():
                    st.value = jax.tree.map(lambda w, d: w - 0.05 * d, st.value, g[p])
        learner.reset()
        total = 0.0
        step = brainstate.transform.jit(lambda x: learner(x, modulator=0.0))
        for t in range(T):
            step(xs[t])
            total += float(learner.hidden_states[("cell", "h")].value.sum())
        return total

    before = activity_after(0.0)
    assert activity_after(1.0) < before - 1e-2
    assert activity_after(-1.0) > before + 1e-2


def test_vmapped_lanes_take_one_modulator_each() -> None:
    def pair(vmap: bool) -> braintrace.ETraceAlgorithm:
        brainstate.random.seed(0)
        return braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), "three_factor", jnp.ones((2, 3)), batch_size=2,
                                  vmap=vmap)

    lanes, batched = pair(True), pair(False)
    xs = normal(2, (3, 2, 3))
    m = jnp.array([1.0, -0.3])
    for t in range(3):
        g = brainstate.transform.grad(lambda x: lanes(x, modulator=m).sum(), lanes.module.param_states)(xs[t])
        ref = brainstate.transform.grad(lambda x: batched(x, modulator=m[:, None, None]).sum(),
                                        batched.param_states)(xs[t])
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"lanes on axis 0.*modulator=jnp.full\(\(2,\), value\)"):
        lanes(xs[0], modulator=1.0)


def _reward_task(shuffled: bool, steps: int = 400, lr: float = 1.0) -> tuple[float, float]:
    """Mean reward over the first and the last fifth of an online run.

    A cue held for 4 steps asks the cell's mean activity for 0.8 or 0.1; the only feedback is
    the scalar error of the previous step, broadcast to every unit as the modulator.
    ``shuffled`` keeps its size and draws its sign at random (the negative control).
    """
    brainstate.random.seed(0)
    learner = braintrace.compile(braintrace.nn.ValinaRNNCell(2, 8), "three_factor", jnp.ones(2))
    rng = np.random.default_rng(0)
    cues = np.repeat(rng.integers(0, 2, steps // 4), 4)
    xs = jnp.asarray(np.eye(2)[cues], jnp.float32)
    targets = np.where(cues == 0, 0.8, 0.1)
    signs = rng.choice([-1.0, 1.0], steps)
    params = learner.param_states

    @brainstate.transform.jit
    def train(x: jax.Array, m: jax.Array) -> jax.Array:
        def objective(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            activity = learner(x, modulator=m).mean()
            return activity, activity  # the loss must read the output; the modulator replaces ∂L/∂h

        g, activity = brainstate.transform.grad(objective, params, has_aux=True)(x)
        for p, st in params.items():
            st.value = jax.tree.map(lambda w, d: w - lr * d / 8, st.value, g[p])
        return activity

    rewards, error = [], 0.0
    for t in range(steps):
        m = signs[t] * abs(error) if shuffled else error
        error = float(train(xs[t], jnp.asarray(m, jnp.float32))) - targets[t]
        rewards.append(-error ** 2)
    fifth = steps // 5
    return float(np.mean(rewards[:fifth])), float(np.mean(rewards[-fifth:]))


def test_reward_modulated_learning_improves_the_reward_and_a_shuffled_reward_does_not() -> None:
    first, last = _reward_task(shuffled=False)
    assert last > first + 0.03 and last > -0.02  # measured: -0.068 -> -0.005
    first_c, last_c = _reward_task(shuffled=True)
    assert last_c < first_c  # measured: -0.19 -> -0.33
    assert last > last_c + 0.1


class Chained(brainstate.nn.Module):
    """The relation's weight is computed from two parameters: ``concatenate([W_in, W_rec])``."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = brainstate.ParamState(normal(7, (3, 4)))
        self.w_rec = brainstate.ParamState(normal(8, (4, 4), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: jax.Array) -> jax.Array:
        w = jnp.concatenate([self.w_in.value, self.w_rec.value])
        self.h.value = jnp.tanh(braintrace.matmul(jnp.concatenate([x, self.h.value]), w))
        return self.h.value


def test_parameters_behind_an_operand_chain_get_the_modulated_gradient_only() -> None:
    learner = braintrace.compile(Chained(), braintrace.ThreeFactor, jnp.ones(3))
    xs = inputs()
    zero = learner.etrace_grad(xs, jnp.zeros(T), step_fn=lambda x, m: learner(x, modulator=m).sum())
    assert all(np.all(np.asarray(g) == 0.0) for g in jax.tree.leaves(zero))  # no autodiff term survives
    learner.reset()
    one = learner.etrace_grad(xs, jnp.ones(T), step_fn=lambda x, m: learner(x, modulator=m).sum())
    assert all(np.abs(np.asarray(g)).max() > 1e-3 for g in jax.tree.leaves(one))
