"""UORO (the random-projection engine) against exact references, float64 where exactness is claimed.

* **Exactness in expectation.** With the draws injected from a table (:class:`TableUORO`), the
  mean over every sign pattern of the draws that reach a gradient is the exact within-group
  RTRL gradient: BPTT on the ETP weights of a one-group tanh RNN, and saturated SnAp. Rolling
  the per-position block diagonal of ``D`` instead is biased; no single pattern is exact.
* **Unbiasedness with production draws**, as a statistical test over many seeds.
* **The carrier**: the factors by hand, shapes and counts, dtypes, units, the step counter and
  key, reset, refusals.
* **The projector** ``νᵀ J_f`` equals ``jax``'s VJP of the model step, per primitive family.
* **F-32**: ``D · s̃`` is a JVP of the transition, equal to the dense product with
  ``HiddenGroup.full_jacobian``, and the compiled step holds no ``(P·S)²`` array.
* **Drivers**: ``etrace_grad`` single-step and in windows, and the vmapped learner.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from typing import Any, Callable, Iterator

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.rules import random_projection
from braintrace._algorithm.engine.graph_executor import TransitionPoint
from braintrace._algorithm.rules.projection_rule import transition_jvp
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, x64
from tests.algorithm.test_d_rtrl import ROW, Leaky, Row, identity
from tests.compiler import control_flow_models as cf

__all__ = ["x64"]  # the fixture is used by name

EXACT = 1e-10
H0 = 0.4
Grads = dict[tuple[Any, ...], np.ndarray]


# --- models ---------------------------------------------------------------------------------


class TanhRNN(brainstate.nn.Module):
    """``h = tanh(x @ W_in + h @ W_rec)`` from ``h = 0.4``: one hidden group whose Jacobian mixes positions."""

    def __init__(self, n_in: int = 3, n_hid: int = 2, dtype: Any = None) -> None:
        super().__init__()
        self.n_hid = n_hid
        self.w_in = brainstate.ParamState(jnp.asarray(normal(0, (n_in, n_hid), 0.7), dtype))
        self.w_rec = brainstate.ParamState(jnp.asarray(normal(1, (n_hid, n_hid), 0.7), dtype))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hid,) if batch_size is None else (batch_size, self.n_hid)
        self.h = brainstate.HiddenState(jnp.full(shape, H0, self.w_in.value.dtype))

    def drive(self, x: Any) -> Any:
        return braintrace.matmul(x, self.w_in.value) + braintrace.matmul(self.h.value, self.w_rec.value)

    def update(self, x: Any) -> Any:
        self.h.value = jnp.tanh(self.drive(x))
        return self.h.value


class TiedRNN(TanhRNN):
    """:class:`TanhRNN` whose input weight also drives the group through ``sin(x)``: two relations, one weight."""

    def drive(self, x: Any) -> Any:
        return super().drive(x) + braintrace.matmul(jnp.sin(x), self.w_in.value)


class Islands(brainstate.nn.Module):
    """Two independent one-unit tanh RNNs (two hidden groups); the output is their product."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = brainstate.ParamState(normal(10, (3, 1), 0.7))
        self.r1 = brainstate.ParamState(normal(11, (1, 1), 0.9))
        self.w2 = brainstate.ParamState(normal(12, (3, 1), 0.7))
        self.r2 = brainstate.ParamState(normal(13, (1, 1), 0.9))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h1 = brainstate.HiddenState(jnp.full((1,), H0))
        self.h2 = brainstate.HiddenState(jnp.full((1,), -H0))

    def update(self, x: Any) -> Any:
        self.h1.value = jnp.tanh(braintrace.matmul(x, self.w1.value) + braintrace.matmul(self.h1.value, self.r1.value))
        self.h2.value = jnp.tanh(braintrace.matmul(x, self.w2.value) + braintrace.matmul(self.h2.value, self.r2.value))
        return self.h1.value * self.h2.value


class Adaptive(brainstate.nn.Module):
    """Two states per neuron (``v``, adaptation ``a``) coupled across positions through ``mean(tanh v)``.

    The group's whole Jacobian is dense, ``(P·2)²``, while no weight is larger than ``(in, P)``.
    """

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__()
        self.n_hid = n_hid
        self.w = brainstate.ParamState(normal(20, (n_in, n_hid), 0.6))
        self.beta = brainstate.ParamState(normal(21, (n_hid,), 0.3))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.full((self.n_hid,), H0))
        self.a = brainstate.HiddenState(jnp.full((self.n_hid,), -H0))

    def update(self, x: Any) -> Any:
        v, a = self.v.value, self.a.value
        field = jnp.mean(jnp.tanh(v))
        beta = braintrace.element_wise(self.beta.value)
        self.v.value = 0.9 * v + jnp.tanh(braintrace.matmul(x, self.w.value) + field) - beta * a
        self.a.value = 0.8 * a + 0.5 * jnp.tanh(v)
        return self.v.value


class TableUORO(braintrace.UORO):
    """UORO whose draw for group ``g`` at step ``t`` is ``draws[g, t]`` (set before each run)."""

    draws: Any = None

    def _draw_projection(self, key: Any, step: Any, group_index: int, shape: tuple[int, ...], dtype: Any) -> Any:
        return jnp.reshape(jnp.asarray(self.draws)[group_index, step], shape).astype(dtype)


# --- drivers --------------------------------------------------------------------------------


def sequence(steps: int, n_in: int = 3, n_out: int = 2, scale: float = 1.0, seed: int = 2) -> tuple[Any, Any]:
    """Inputs ``(steps, n_in)`` and targets ``(steps, n_out)``."""
    return normal(seed, (steps, n_in), scale), normal(seed + 1, (steps, n_out), 0.5)


def squared_error(ys: Any) -> Callable[[Any, Any], Any]:
    """The BPTT oracle's per-step loss against ``ys``."""
    return lambda t, out: jnp.sum((out - ys[t]) ** 2)


def as_numpy(grads: Any) -> Grads:
    return {p: np.asarray(u.get_mantissa(g)) for p, g in grads.items()}


def sequence_grads(learner: Any, xs: Any, ys: Any, chunk: int | None = None, key: Any = None) -> Any:
    """``etrace_grad`` of the summed squared error, from a reset learner (plain mode or windows of ``chunk``).

    ``key`` replaces the carried key after the reset (raw key data).
    """
    learner.reset()
    if key is not None:
        learner.projection_rng.value = key
    if chunk is None:
        def step_fn(x: Any, y: Any) -> Any:
            return jnp.sum((learner(x) - y) ** 2)
    else:
        def step_fn(x: Any, y: Any) -> Any:
            return jnp.sum((learner(braintrace.MultiStepData(x)) - y) ** 2, axis=-1)
    return learner.etrace_grad(xs, ys, step_fn=step_fn, chunk_size=chunk, reduction="sum")


def sign_tables(groups: int, steps: int, units: int) -> Iterator[np.ndarray]:
    """Every sign pattern of the draws that reach a gradient (those before the last step), ``(G, T, units)``."""
    shape = (groups, steps - 1, units)
    for signs in itertools.product((1.0, -1.0), repeat=int(np.prod(shape))):
        table = np.ones((groups, steps, units))
        table[:, :-1] = np.reshape(signs, shape)
        yield table


def exhaustive(learner: TableUORO, xs: Any, ys: Any, tables: Iterator[np.ndarray], chunk: int | None = None
               ) -> tuple[Grads, list[Grads]]:
    """``(mean, runs)``: the gradient of a reset run per draw table (one compilation for all)."""

    @brainstate.transform.jit
    def run(table: Any) -> Any:
        learner.draws = table
        return sequence_grads(learner, xs, ys, chunk)

    runs = [as_numpy(run(jnp.asarray(t))) for t in tables]
    return {p: np.mean([r[p] for r in runs], axis=0) for p in runs[0]}, runs


def block_diagonal_jvp(group: Any, point: TransitionPoint, tangent: jax.Array) -> jax.Array:
    """The negative control's transition: the per-position block diagonal of ``D`` applied to ``tangent``."""
    blocks = group.diagonal_jacobian(point.hidden, point.inputs)
    return jnp.einsum("...ab,...b->...a", blocks, tangent.astype(blocks.dtype))


def carrier(learner: Any) -> Any:
    return learner._get_etrace_data()


# --- U1: exactness in expectation -----------------------------------------------------------


def test_mean_over_every_draw_pattern_equals_bptt_and_saturated_snap(x64: None, monkeypatch: Any) -> None:
    xs, ys = sequence(3)
    ref = bptt_grads(TanhRNN(), xs, loss=squared_error(ys))
    mean, runs = exhaustive(braintrace.compile(TanhRNN(), TableUORO, xs[0]), xs, ys, sign_tables(1, 3, 2))
    assert len(runs) == 16
    assert max_rel_err(ref, mean) < EXACT
    snap = braintrace.compile(TanhRNN(), braintrace.SnAp, xs[0], n=2)
    assert max_rel_err(single_step_grads(snap, xs, squared_error(ys)), mean) < EXACT
    assert min(max_rel_err(mean, r) for r in runs) > 1e-4  # measured 0.43: each pattern is far off

    # Negative control: rolling the per-position block diagonal of D instead is biased.
    monkeypatch.setattr(random_projection, "transition_jvp", block_diagonal_jvp)
    block, _ = exhaustive(braintrace.compile(TanhRNN(), TableUORO, xs[0]), xs, ys, sign_tables(1, 3, 2))
    assert max_rel_err(ref, block) > 1e-3  # measured 0.16


def _flat_norm(*trees: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(trees)))


def test_factors_after_one_and_two_steps_by_hand(x64: None) -> None:
    xs, _ = sequence(2, scale=5.0)  # a large input saturates tanh: rho0 far from 1 at step 2
    nus = np.array([[[1.0, -1.0], [-1.0, -1.0]]])
    learner = braintrace.compile(TanhRNN(), TableUORO, xs[0])
    learner.draws = nus
    w_in, w_rec = (learner.param_states[p].value for p in [("w_in",), ("w_rec",)])
    eps = learner.projection_eps

    def f(h: Any, wi: Any, wr: Any, x: Any) -> Any:
        return jnp.tanh(x @ wi + h @ wr)

    h0 = jnp.full(2, H0)
    nu1, nu2 = jnp.asarray(nus[0, 0]), jnp.asarray(nus[0, 1])
    proj1 = jax.vjp(lambda wi, wr: f(h0, wi, wr, xs[0]), w_in, w_rec)[1](nu1)
    rho1 = jnp.sqrt((_flat_norm(proj1) + eps) / (_flat_norm(nu1) + eps))  # rho0 = (0 + eps) / (0 + eps) = 1
    s1, theta1 = rho1 * nu1, [q / rho1 for q in proj1]

    step = brainstate.transform.jit(lambda x: learner(x))
    step(xs[0])
    got = carrier(learner)
    np.testing.assert_allclose(got["s_tilde"][0][:, 0], s1, rtol=1e-12)
    for path, want in zip([("w_in",), ("w_rec",)], theta1):
        np.testing.assert_allclose(got["theta_tilde"][(0, path)], want, rtol=1e-12)
    # The first outer product is ν νᵀ J_f.
    jac_in = jax.jacobian(lambda wi: f(h0, wi, w_rec, xs[0]))(w_in)  # (hidden, in, hidden)
    outer = jnp.einsum("p,ij->pij", got["s_tilde"][0][:, 0], got["theta_tilde"][(0, ("w_in",))])
    np.testing.assert_allclose(outer, jnp.einsum("p,q,qij->pij", nu1, nu1, jac_in), rtol=1e-12, atol=1e-15)

    h1 = f(h0, w_in, w_rec, xs[0])
    ds = jax.jvp(lambda h: f(h, w_in, w_rec, xs[1]), (h1,), (s1,))[1]
    proj2 = jax.vjp(lambda wi, wr: f(h1, wi, wr, xs[1]), w_in, w_rec)[1](nu2)
    rho0 = jnp.sqrt((_flat_norm(theta1) + eps) / (_flat_norm(ds) + eps))
    rho1 = jnp.sqrt((_flat_norm(proj2) + eps) / (_flat_norm(nu2) + eps))
    assert float(rho0) > 4.0  # measured 13.4
    s2 = rho0 * ds + rho1 * nu2
    theta2 = [t / rho0 + q / rho1 for t, q in zip(theta1, proj2)]

    step(xs[1])
    got = carrier(learner)
    np.testing.assert_allclose(got["s_tilde"][0][:, 0], s2, rtol=1e-12)
    for path, want in zip([("w_in",), ("w_rec",)], theta2):
        np.testing.assert_allclose(got["theta_tilde"][(0, path)], want, rtol=1e-12)


def test_a_tied_weight_has_one_factor_and_stays_unbiased(x64: None) -> None:
    xs, ys = sequence(3)
    learner = braintrace.compile(TiedRNN(), TableUORO, xs[0])
    assert sorted(learner.theta_tilde) == [(0, ("w_in",)), (0, ("w_rec",))]
    assert len(learner.graph.hidden_param_op_relations) == 3
    mean, _ = exhaustive(learner, xs, ys, sign_tables(1, 3, 2))
    assert max_rel_err(bptt_grads(TiedRNN(), xs, loss=squared_error(ys)), mean) < EXACT


def test_two_islands_draw_per_group_and_stay_unbiased(x64: None) -> None:
    xs, ys = sequence(3, n_out=1)
    learner = braintrace.compile(Islands(), TableUORO, xs[0])
    assert len(learner.graph.hidden_groups) == 2
    assert {gi: s.value.shape for gi, s in learner.s_tilde.items()} == {0: (1, 1), 1: (1, 1)}
    mean, runs = exhaustive(learner, xs, ys, sign_tables(2, 3, 1))
    assert len(runs) == 16
    assert max_rel_err(bptt_grads(Islands(), xs, loss=squared_error(ys)), mean) < EXACT
    assert min(max_rel_err(mean, r) for r in runs) > 1e-4


def test_step_counter_and_key_advance() -> None:
    xs, _ = sequence(4)
    learner = braintrace.compile(TanhRNN(), braintrace.UORO, xs[0], projection_key=3)
    key0 = np.asarray(jax.random.key_data(jax.random.key(3)))
    np.testing.assert_array_equal(learner.projection_rng.value, key0)

    def advanced(key: Any, steps: int) -> np.ndarray:
        for _ in range(steps):
            key = jax.random.split(key, 2)[0]  # one subkey per group (one group) and the carried key
        return np.asarray(key)

    brainstate.transform.jit(lambda x: learner(x))(xs[0])
    assert int(learner.projection_step.value) == 1
    np.testing.assert_array_equal(learner.projection_rng.value, advanced(key0, 1))
    brainstate.transform.jit(lambda x: learner(braintrace.MultiStepData(x)))(xs[1:])  # a window of three steps
    assert int(learner.projection_step.value) == 4 and int(learner.running_index.value) == 2
    np.testing.assert_array_equal(learner.projection_rng.value, advanced(key0, 4))
    learner.reset()
    assert int(learner.projection_step.value) == 0 and int(learner.running_index.value) == 0
    np.testing.assert_array_equal(learner.projection_rng.value, key0)


# --- U3: unbiased with production draws, statistically --------------------------------------


def seed_samples(n_seeds: int, steps: int) -> tuple[Grads, Grads]:
    """``(BPTT, {path: (n_seeds, *shape)})``: UORO run from seeds ``0 .. n_seeds - 1`` (one scan over seeds)."""
    xs, ys = sequence(steps, n_out=3)
    ref = bptt_grads(TanhRNN(n_hid=3), xs, loss=squared_error(ys))
    learner = braintrace.compile(TanhRNN(n_hid=3), braintrace.UORO, xs[0])

    def one(carry: None, key: Any) -> tuple[None, Any]:
        return None, sequence_grads(learner, xs, ys, key=key)

    keys = jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(jnp.arange(n_seeds))
    samples = brainstate.transform.jit(lambda k: brainstate.transform.scan(one, None, k)[1])(keys)
    return ref, as_numpy(samples)


def z_scores(samples: np.ndarray, ref: np.ndarray, directions: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per fixed random unit direction ``d``: ``((mean − ref)/se, (mean − 1.15·ref)/se, se/‖ref‖)`` of ``⟨d, ĝ⟩``."""
    n = samples.shape[0]
    d = np.random.default_rng(3).standard_normal((directions, ref.size))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    proj, target = samples.reshape(n, -1) @ d.T, d @ ref.ravel()
    mean, se = proj.mean(axis=0), proj.std(axis=0, ddof=1) / np.sqrt(n)
    return (mean - target) / se, (mean - 1.15 * target) / se, se / np.linalg.norm(ref)


@pytest.mark.parametrize(
    "n_seeds", [1024, pytest.param(16384, marks=pytest.mark.slow)], ids=["1024-seeds", "16384-seeds"]
)
def test_production_draws_are_unbiased_and_a_scaled_reference_is_rejected(x64: None, n_seeds: int) -> None:
    ref, samples = seed_samples(n_seeds, steps=5)
    for path in [("w_in",), ("w_rec",)]:
        z, z_scaled, rel_se = z_scores(samples[path], ref[path])
        assert np.all(np.abs(z) <= 3.5), (path, z)
        assert np.all(rel_se <= 0.25), (path, rel_se)
        assert np.any(np.abs(z_scaled) > 3.5), (path, z_scaled)  # the test has the power to see a 15% bias


# --- U4: a single run is not an exact rule --------------------------------------------------


def test_a_single_run_differs_from_d_rtrl_and_between_keys() -> None:
    xs, ys = sequence(5)

    d_rtrl = braintrace.compile(TanhRNN(), braintrace.D_RTRL, xs[0])
    exact_trace = as_numpy(brainstate.transform.jit(lambda: sequence_grads(d_rtrl, xs, ys))())
    uoro = braintrace.compile(TanhRNN(), braintrace.UORO, xs[0])
    run = brainstate.transform.jit(lambda key: sequence_grads(uoro, xs, ys, key=key))
    one, two = (as_numpy(run(jax.random.key_data(jax.random.key(seed)))) for seed in (1, 2))
    assert max_rel_err(exact_trace, one) > 1e-3
    assert max_rel_err(two, one) > 1e-3
    assert all(np.all(np.isfinite(g)) for g in one.values())


# --- U5: the carrier --------------------------------------------------------------------------


class Readout3to4(brainstate.nn.Module):
    """A 3 → 4 tanh RNN: ETP input weight and bias, a plain recurrent weight (``|θ|`` = 16 traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(30, (3, 4), 0.6))
        self.b = brainstate.ParamState(normal(31, (4,), 0.1))
        self.w_rec = brainstate.ParamState(normal(32, (4, 4), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        self.h.value = jnp.tanh(braintrace.matmul(x, self.w.value, self.b.value) + self.h.value @ self.w_rec.value)
        return self.h.value


def trace_size(learner: Any) -> int:
    """The number of trace entries (UORO's factors, without its key and step counter)."""
    data = carrier(learner)
    if isinstance(learner, braintrace.RandomProjectionVjpAlgorithm):
        data = (data["s_tilde"], data["theta_tilde"])
    return sum(int(np.size(leaf)) for leaf in jax.tree.leaves(data))


@pytest.mark.filterwarnings("ignore:The weight:UserWarning")  # the plain recurrent weight, by design
def test_carrier_shapes_and_count() -> None:
    x0 = jnp.ones(3)
    learner = braintrace.compile(Readout3to4(), "uoro", x0)
    assert {gi: s.value.shape for gi, s in learner.s_tilde.items()} == {0: (4, 1)}
    (theta,) = learner.get_etrace_of(("w",)).values()
    assert theta.shape == (3, 4) and learner.get_etrace_of(("b",))[(0, ("b",))].shape == (4,)
    with pytest.raises(ValueError, match="no etrace of the given weight"):
        learner.get_etrace_of(("w_rec",))
    assert trace_size(learner) == 20  # |θ| + P·S = 16 + 4
    assert trace_size(braintrace.compile(Readout3to4(), braintrace.D_RTRL, x0)) == 16  # |θ|·S
    assert trace_size(braintrace.compile(Readout3to4(), braintrace.SnAp, x0, n=2)) == 64  # |θ|·K·S, K = 4


def test_carrier_grows_with_parameters_plus_hidden_not_their_product() -> None:
    # Two states per neuron: UORO holds |θ| + P·S numbers, D_RTRL |θ|·S.
    model = lambda: Adaptive(n_in=8, n_hid=32)  # noqa: E731
    x0 = jnp.ones(8)
    uoro = braintrace.compile(model(), "uoro", x0)
    d_rtrl = braintrace.compile(model(), braintrace.D_RTRL, x0)
    n_theta, p, s = 8 * 32 + 32, 32, 2
    assert trace_size(uoro) == n_theta + p * s == 352
    assert trace_size(d_rtrl) == n_theta * s == 576


def test_a_model_with_units_learns_like_its_unitless_twin() -> None:
    class WithUnits(TanhRNN):
        def __init__(self, unit: Any) -> None:
            super().__init__()
            self.unit = unit
            if unit is not None:
                self.w_in.value = self.w_in.value * unit

        def drive(self, x: Any) -> Any:
            y = braintrace.matmul(x, self.w_in.value)
            y = y if self.unit is None else y / self.unit
            return y + braintrace.matmul(self.h.value, self.w_rec.value)

    xs, ys = sequence(4)

    def run(unit: Any) -> tuple[Any, Any]:
        learner = braintrace.compile(WithUnits(unit), braintrace.UORO, xs[0], projection_key=5)
        grads = brainstate.transform.jit(lambda: sequence_grads(learner, xs, ys))()
        return grads, learner

    with_units, learner = run(u.mV)
    plain, _ = run(None)
    (theta,) = learner.get_etrace_of(("w_in",)).values()
    assert u.get_unit(theta) == u.mV
    assert u.get_unit(with_units[("w_in",)]) == u.get_unit(learner.param_states[("w_in",)].value)
    for p in plain:
        np.testing.assert_allclose(u.get_mantissa(with_units[p]), plain[p], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_factors_stay_at_the_model_dtype(dtype: Any) -> None:
    xs, ys = sequence(4)
    xs, ys = xs.astype(dtype), ys.astype(dtype)
    learner = braintrace.compile(TanhRNN(dtype=dtype), braintrace.UORO, xs[0])
    grads = brainstate.transform.jit(lambda: sequence_grads(learner, xs, ys))()
    data = carrier(learner)
    assert data["s_tilde"][0].dtype == dtype
    assert {t.dtype for t in data["theta_tilde"].values()} == {jnp.dtype(dtype)}
    for g in grads.values():
        assert g.dtype == dtype and bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
    assert all(bool(jnp.any(t != 0)) for t in data["theta_tilde"].values())


@pytest.mark.parametrize("eps, error", [(0, ValueError), (0.0, ValueError), (1e-50, ValueError), (-1e-3, ValueError),
                                        (True, TypeError), ("1e-12", TypeError)])
def test_bad_projection_eps_is_refused(eps: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="projection_eps"):
        braintrace.UORO(TanhRNN(), projection_eps=eps)


@pytest.mark.parametrize("key", [1.5, jnp.zeros(3), "seed"], ids=["float", "wrong-shape", "str"])
def test_bad_projection_key_is_refused(key: Any) -> None:
    with pytest.raises(TypeError, match="projection_key"):
        braintrace.UORO(TanhRNN(), projection_key=key)


def test_a_key_array_and_its_seed_give_the_same_learner() -> None:
    a = braintrace.UORO(TanhRNN(), projection_key=jax.random.key(4))
    b = braintrace.UORO(TanhRNN(), projection_key=jax.random.PRNGKey(4))
    np.testing.assert_array_equal(a.projection_rng.value, b.projection_rng.value)


@pytest.mark.parametrize(
    "model, match",
    [(lambda: cf.SubstepModel(length=20), "descended scan"), (lambda: cf.SettleModel(), "while_loop")],
    ids=["descended-scan", "while-loop"],
)
def test_unsupported_control_flow_is_refused_by_name(model: Callable[[], Any], match: str) -> None:
    with warnings.catch_warnings(), pytest.raises(NotImplementedError, match=match):
        warnings.simplefilter("ignore", UserWarning)  # the models' plain readout
        braintrace.compile(model(), braintrace.UORO, jnp.ones(3))


# --- U6: the projector is the VJP of the step ------------------------------------------------


def one_step_projection(learner: TableUORO, h0: Any, x0: Any, nu: Any) -> Grads:
    """``νᵀ J_f`` per parameter, read off the factors after one step (``s̃ = rho1 ν``, ``θ̃ = proj / rho1``)."""

    @brainstate.transform.jit
    def run(nu: Any) -> Any:
        learner.draws = nu[None, None]
        learner.reset_state()
        learner.hidden_states[("h",)].value = h0
        learner(x0)
        return carrier(learner)

    data = run(nu)
    rho1 = jnp.sum(data["s_tilde"][0] * nu) / jnp.sum(nu * nu)
    return {p: np.asarray(theta * rho1) for (_, p), theta in data["theta_tilde"].items()}


def vjp_reference(model: Any, batch: int | None, h0: Any, x0: Any, nu: Any) -> Grads:
    """``νᵀ ∂h¹/∂θ`` at fixed ``h⁰`` by ``brainstate.transform.grad`` through the model step."""
    brainstate.nn.init_all_states(model, batch_size=batch)
    params = model.states(brainstate.ParamState)

    def f() -> Any:
        model.h.value = h0
        return jnp.sum(nu[..., 0] * model(x0))

    return as_numpy(brainstate.transform.jit(lambda: brainstate.transform.grad(f, params)())())


#: ``(row, batched, fast_solve)``: matmul (batched) and mv (unbatched), weight_fn, conv, NHWC conv
#: with bias, sparse batched and unbatched, LoRA with hooks, a shared-axis einsum; every row also
#: has an element-wise leak (with a weight_fn).
PROJECTOR_CASES = [
    ("mm-bias", True, True), ("mm-bias", True, False), ("mm-bias", False, True), ("mm-fn-tanh", True, True),
    ("conv1d-kernel-fn", True, True), ("conv2d-nhwc-bias", True, True), ("sparse-csr-bias", True, True),
    ("sparse-csr-bias", False, True), ("lora-alpha2-bias-hooks", True, True), ("einsum-shared-axis", True, True),
    pytest.param("conv2d-nhwc-bias", True, False, marks=pytest.mark.slow),
]


def _case_id(row_id: str, batched: bool, fast: bool) -> str:
    return f"{row_id}-{'batched' if batched else 'unbatched'}-{'fast' if fast else 'general'}"


@pytest.mark.parametrize(
    "row_id, batched, fast", PROJECTOR_CASES,
    ids=[_case_id(*(c.values if hasattr(c, "values") else c)) for c in PROJECTOR_CASES],
)
def test_projection_equals_the_vjp_of_the_step(x64: None, row_id: str, batched: bool, fast: bool) -> None:
    # Leaky: h = sigmoid(leak) ⊙ h + tail(op(x, W)); a non-zero h⁰ exercises the element-wise leak too.
    row = ROW[row_id]
    projection, reference = _projections(row, batched, fast)
    assert set(projection) == set(reference)
    for p in reference:
        assert projection[p].shape == reference[p].shape and np.any(reference[p] != 0), p
        np.testing.assert_allclose(projection[p], reference[p], rtol=1e-10, atol=1e-13 * np.abs(reference[p]).max())


def _projections(row: Row, batched: bool, fast: bool, nu: Any = None) -> tuple[Grads, Grads]:
    batch = 2 if batched else None
    xs = row.inputs(batch)
    x0 = jax.tree.map(lambda a: a[0], xs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(Leaky(row, x0, batched), TableUORO, x0, batch_size=batch, fast_solve=fast)
    h0 = normal(5, learner.hidden_states[("h",)].value.shape, 0.5)
    nu = normal(6, learner.s_tilde[0].value.shape) if nu is None else nu
    return one_step_projection(learner, h0, x0, nu), vjp_reference(Leaky(row, x0, batched), batch, h0, x0, nu)


def test_conv_bias_projection_is_the_spatial_sum(x64: None) -> None:
    row = dataclasses.replace(ROW["conv2d-nhwc-bias"], tail=identity)  # df = 1: proj_b = Σ_{batch, H, W} ν
    nu = normal(7, (2, 3, 3, 3, 1))
    projection, _ = _projections(row, True, True, nu)
    np.testing.assert_allclose(projection[("b",)], np.sum(nu[..., 0], axis=(0, 1, 2)), rtol=1e-12)


def test_tied_projection_sums_both_relations_and_is_linear_in_the_draw(x64: None) -> None:
    xs, _ = sequence(1)
    learner = braintrace.compile(TiedRNN(), TableUORO, xs[0])
    h0 = jnp.asarray([0.3, -0.2])
    nu1, nu2 = normal(8, (2, 1)), normal(9, (2, 1))
    p1, p2 = (one_step_projection(learner, h0, xs[0], nu) for nu in (nu1, nu2))
    ref = vjp_reference(TiedRNN(), None, h0, xs[0], nu1)
    for p in ref:
        np.testing.assert_allclose(p1[p], ref[p], rtol=1e-12)
    combined = one_step_projection(learner, h0, xs[0], nu1 - 3.0 * nu2)
    for p in ref:
        np.testing.assert_allclose(combined[p], p1[p] - 3.0 * p2[p], rtol=1e-10, atol=1e-14)


# --- U7: reset, the first step, production draws ---------------------------------------------


def test_a_reset_run_repeats_bit_for_bit_and_the_first_step_is_finite() -> None:
    xs, ys = sequence(3)
    learner = braintrace.compile(TanhRNN(), braintrace.UORO, xs[0])
    params = learner.param_states

    @brainstate.transform.jit
    def run() -> Any:
        learner.reset()
        return [_step(learner, params, x, y) for x, y in zip(xs, ys)]

    first, again = run(), run()
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    grads, out = first[0]
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in [*grads.values(), out])


def _step(learner: Any, params: Any, x: Any, y: Any) -> tuple[Any, Any]:
    def loss() -> tuple[Any, Any]:
        out = learner(x)
        return jnp.sum((out - y) ** 2), out

    return brainstate.transform.grad(loss, params, has_aux=True)()


class RecordingUORO(braintrace.UORO):
    """UORO that records its production draws ``(step, group, ν)`` on the host."""

    record: list[tuple[int, int, np.ndarray]]

    def _draw_projection(self, key: Any, step: Any, group_index: int, shape: tuple[int, ...], dtype: Any) -> Any:
        nu = super()._draw_projection(key, step, group_index, shape, dtype)
        jax.debug.callback(lambda s, n: self.record.append((int(s), group_index, np.asarray(n))), step, nu)
        return nu


def test_production_draws_are_signs_fresh_each_step_independent_per_group_and_keyed() -> None:
    steps = 64
    learner = braintrace.compile(Islands(), RecordingUORO, jnp.ones(3), projection_key=0)
    xs = normal(40, (steps, 3))

    @brainstate.transform.jit
    def window(key: Any) -> None:
        learner.reset()
        learner.projection_rng.value = key
        learner(braintrace.MultiStepData(xs))

    def draws(seed: int) -> np.ndarray:
        """``(groups, steps)``: the draws of one window."""
        learner.record = []
        window(jax.random.key_data(jax.random.key(seed)))
        table = np.zeros((2, steps))
        for step, group, nu in learner.record:
            table[group, step] = nu.item()
        return table

    first = draws(0)
    assert set(np.unique(first)) == {-1.0, 1.0}
    assert 0.3 < np.mean(first > 0) < 0.7
    assert 0.3 < np.mean(first[0] == first[1]) < 0.7  # the groups draw independently
    assert 0.3 < np.mean(first[:, 1:] == first[:, :-1]) < 0.7  # each step draws anew
    np.testing.assert_array_equal(draws(0), first)
    assert 0.3 < np.mean(draws(1) == first) < 0.7


def test_reset_state_keeps_an_unbatched_factor_and_resizes_a_batched_one() -> None:
    xs, _ = sequence(1)
    unbatched = braintrace.compile(TanhRNN(), braintrace.UORO, xs[0])
    unbatched.reset_state(batch_size=5)
    assert unbatched.s_tilde[0].value.shape == (2, 1)
    batched = braintrace.compile(TanhRNN(), braintrace.UORO, jnp.ones((3, 3)), batch_size=3)
    assert batched.s_tilde[0].value.shape == (3, 2, 1)
    batched.reset_state(batch_size=5)
    assert batched.s_tilde[0].value.shape == (5, 2, 1)
    assert batched.get_etrace_of(("w_in",))[(0, ("w_in",))].shape == (3, 2)


# --- F-32: the transition is applied matrix-free ---------------------------------------------


def _random_point(group: Any, seed: int) -> TransitionPoint:
    hidden = [normal(seed + i, v.aval.shape, 0.5) for i, v in enumerate(group.hidden_invars)]
    inputs = [normal(seed + 10 + i, v.aval.shape, 0.5).astype(v.aval.dtype) if jnp.issubdtype(v.aval.dtype, jnp.floating)
              else jnp.zeros(v.aval.shape, v.aval.dtype) for i, v in enumerate(group.transition_jaxpr_constvars)]
    return TransitionPoint(hidden, inputs)


@pytest.mark.parametrize("model", [lambda: TanhRNN(n_hid=4), lambda: Adaptive()], ids=["dense-rnn", "two-state-group"])
def test_transition_jvp_equals_the_dense_product(x64: None, model: Callable[[], Any]) -> None:
    learner = braintrace.compile(model(), braintrace.UORO, jnp.ones(3))
    (group,) = learner.graph.hidden_groups
    point = _random_point(group, 50)
    tangent = normal(60, learner.s_tilde[0].value.shape)
    dense = jax.jit(lambda pt: group.full_jacobian(pt.hidden, pt.inputs))(point)
    assert dense.shape == (*tangent.shape, *tangent.shape)
    want = jnp.tensordot(dense, tangent, axes=tangent.ndim)
    got = jax.jit(lambda pt, t: transition_jvp(group, pt, t))(point, tangent)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    # The Jacobian is not block diagonal: the test would see a block-diagonal product.
    assert float(jnp.max(jnp.abs(want - block_diagonal_jvp(group, point, tangent)))) > 1e-3


def _largest_array(hlo: str) -> int:
    dims = re.findall(r"\b(?:pred|[fsu]\d+|bf16)\[([\d,]*)\]", hlo)
    return max(int(np.prod([int(d) for d in ds.split(",") if d])) for ds in dims)


def test_no_dense_jacobian_in_the_compiled_step(monkeypatch: Any) -> None:
    p, s, n_in = 32, 2, 8
    dense_size = (p * s) ** 2

    def learner() -> Any:
        return braintrace.compile(Adaptive(n_in=n_in, n_hid=p), braintrace.UORO, jnp.ones(n_in))

    assert _largest_array(_hlo_of_step(learner(), n_in)) < dense_size // 4  # measured 512: (in, P, S)
    # The check sees a dense Jacobian in the step: the dense product in place of the JVP.
    monkeypatch.setattr(random_projection, "transition_jvp", lambda g, pt, t: jnp.tensordot(
        g.full_jacobian(pt.hidden, pt.inputs), t.astype(pt.hidden[0].dtype), axes=t.ndim))
    assert _largest_array(_hlo_of_step(learner(), n_in)) >= dense_size


def _hlo_of_step(learner: Any, n_in: int) -> str:
    params = learner.param_states

    def step(x: Any) -> Any:
        return brainstate.transform.grad(lambda: jnp.sum(learner(x) ** 2), params)()

    return brainstate.transform.jit(step).lower(jnp.ones(n_in)).compile().as_text()


# --- the drivers -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["single-step", "windows"])
def test_etrace_grad_is_exact_in_expectation(x64: None, mode: str) -> None:
    # Single step over 3 steps, or windows of 2 over 4 steps: two draws reach a boundary either way.
    steps, chunk, vjp = (3, None, "single-step") if mode == "single-step" else (4, 2, "multi-step")
    xs, ys = sequence(steps)
    learner = braintrace.compile(TanhRNN(), TableUORO, xs[0], vjp_method=vjp)
    tables = sign_tables(1, steps, 2) if chunk is None else (
        np.concatenate([t[:, :2], np.ones((1, 2, 2))], axis=1) for t in sign_tables(1, 3, 2))
    mean, runs = exhaustive(learner, xs, ys, tables, chunk)
    assert len(runs) == 16
    ref = bptt_grads(TanhRNN(), xs, loss=squared_error(ys))
    assert max_rel_err(ref, mean) < EXACT
    assert min(max_rel_err(mean, r) for r in runs) > 1e-4


def test_vmapped_learner_sums_the_per_sample_learners() -> None:
    # Every lane carries its own factors; the key is shared, so lane b repeats a learner run on sample b.
    steps, batch = 4, 3
    xs, ys = normal(70, (steps, batch, 3)), normal(71, (steps, batch, 2), 0.5)
    vmapped = braintrace.compile(TanhRNN(), "uoro", xs[0], batch_size=batch, vmap=True)

    def step_fn(x: Any, y: Any) -> Any:
        return jnp.sum((vmapped(x) - y) ** 2)

    got = as_numpy(vmapped.etrace_grad(xs, ys, step_fn=step_fn, reduction="sum"))
    assert all(np.all(np.isfinite(g)) for g in got.values())
    learner = braintrace.compile(TanhRNN(), "uoro", xs[0, 0])  # a fresh reset per sample: same key
    run = brainstate.transform.jit(lambda x, y: sequence_grads(learner, x, y))
    per_sample = [as_numpy(run(xs[:, b], ys[:, b])) for b in range(batch)]
    for p in got:
        np.testing.assert_allclose(got[p], sum(g[p] for g in per_sample), rtol=1e-5, atol=1e-6)
    vmapped.reset()
    again = as_numpy(vmapped.etrace_grad(xs, ys, step_fn=step_fn, reduction="sum"))
    for p in got:
        np.testing.assert_array_equal(again[p], got[p])
